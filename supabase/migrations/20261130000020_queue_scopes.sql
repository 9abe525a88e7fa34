-- Scopes for queue consumers.
--
-- A consumer of Supabase Queues (pgmq) claims each message under the
-- producer's idempotency key, in a scope of the family queue.* (one scope
-- per queue: queue.orders). A duplicate arrives while the producer still
-- retries (minutes) or while pgmq redelivers a message whose visibility
-- timeout passed (up to max_reads times the timeout), so seven days holds
-- every duplicate a sane queue can make; a queue that keeps messages longer
-- sets its own scope's retention the way every scope does:
--
--   insert into agent.idempotency_scopes (scope, retain, max_response_bytes)
--   values ('queue.ledger', interval '30 days', 65536);
--
-- A consumer's claims carry no work: the queue keeps each message until it
-- is archived, so a consumer stopped mid-effect leaves the message itself
-- for its next delivery, which finds the claim and takes it over once the
-- lease has passed.
insert into agent.idempotency_scopes (scope, retain, max_response_bytes)
values ('queue.*', interval '7 days', 65536)
on conflict (scope) do nothing;
