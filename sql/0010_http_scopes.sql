-- HTTP APIs made idempotent with the Idempotency-Key header (the crate's
-- tower layer, or any client that claims http.<method>.<route> scopes).
--
-- One family for every route: an answer is kept for 24 hours, as Stripe
-- keeps its keys, and up to 64 KiB of it as JSON (a larger answer is kept
-- without its body). A route that needs longer adds its exact scope, e.g.
--   insert into agent.idempotency_scopes values ('http.post.payouts', interval '7 days', 65536);
insert into agent.idempotency_scopes (scope, retain, max_response_bytes)
values ('http.*', interval '24 hours', 65536)
on conflict (scope) do nothing;
