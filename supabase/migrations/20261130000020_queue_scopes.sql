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
-- The message's payload is the work its claim carries (at most
-- max_request_bytes, 64 KiB by default), so a consumer stopped mid-effect
-- leaves it for a re-drive or the message's next delivery.
insert into agent.idempotency_scopes (scope, retain, max_response_bytes)
values ('queue.*', interval '7 days', 65536)
on conflict (scope) do nothing;
