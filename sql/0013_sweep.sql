-- The bounded sweep as one SQL call, for a scheduler inside the database
-- (Supabase Cron, that is pg_cron; see the README's "Sweeping with Supabase
-- Cron" and sql/recipes/pg_cron_sweep.sql).
--
-- agent.idempotency_sweep(p_bound, p_row_cap DEFAULT 1000) is one pass of
-- `idem sweep`, with the same rules:
--
-- 1. The bound is checked before anything is read. p_bound NULL or below 1,
--    p_row_cap NULL or outside 1..100000, and p_bound above p_row_cap are
--    refused with SQLSTATE 22023, naming the argument; nothing is deleted.
--    p_row_cap stands for the row cap `idem sweep` is held to (PostgREST
--    db-max-rows, Supabase api.max_rows; 1000 by default, at most 100000 in
--    the client), so a pass in the database reads, locks and deletes no
--    more rows than a pass over HTTP may.
-- 2. The pass is the two functions the HTTP sweeper calls, so the rule is
--    written once: agent.idempotency_expired(p_bound) reads up to p_bound
--    claims past retention, oldest first, and
--    agent.idempotency_delete_expired deletes those still past retention.
-- 3. It answers one row: read, deleted, bound, filled. filled (read =
--    bound) means the backlog may be larger than one pass, and the pass
--    also raises a WARNING saying so (in the server log, and in a client's
--    notices); as with `idem sweep`, the backlog is judged by the read,
--    never by the delete count.
--
-- It follows 0011: owned by idempotency_owner, SECURITY DEFINER with
-- search_path pinned to '', every name qualified, executable by
-- service_role only.

create type agent.idempotency_sweep_report as (
  read integer,
  deleted integer,
  bound integer,
  filled boolean
);
alter type agent.idempotency_sweep_report owner to idempotency_owner;

-- One bounded pass: reads up to p_bound claims past retention, oldest
-- first, deletes those still past it, and answers what it did.
create function agent.idempotency_sweep(p_bound integer, p_row_cap integer default 1000)
returns setof agent.idempotency_sweep_report
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_ids uuid[];
  v_read integer;
  v_deleted integer;
begin
  if p_bound is null then
    raise exception 'p_bound is required: the most expired claims one sweep reads' using errcode = '22023';
  end if;
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap idem sweep is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_bound < 1 then
    raise exception 'p_bound must be at least 1, got %', p_bound using errcode = '22023';
  end if;
  if p_bound > p_row_cap then
    raise exception 'p_bound % is above the row cap p_row_cap %: a sweep reads at most the row cap',
                    p_bound, p_row_cap
      using errcode = '22023',
            hint = 'lower p_bound to the row cap or below; a larger backlog is swept by sweeping more often';
  end if;

  select coalesce(pg_catalog.array_agg(e.id), '{}') into v_ids
    from agent.idempotency_expired(p_bound) e;
  v_read := pg_catalog.cardinality(v_ids);
  v_deleted := agent.idempotency_delete_expired(v_ids);

  if v_read >= p_bound then
    raise warning 'idempotency sweep read % expired claims, its whole bound: the backlog may be larger', v_read
      using hint = 'sweep more often or raise the bound (up to the row cap)';
  end if;
  return next (v_read, v_deleted, p_bound, v_read >= p_bound)::agent.idempotency_sweep_report;
end
$$;

alter function agent.idempotency_sweep(integer, integer) owner to idempotency_owner;

revoke all on function agent.idempotency_sweep(integer, integer) from public, anon, authenticated;
grant execute on function agent.idempotency_sweep(integer, integer) to service_role;
