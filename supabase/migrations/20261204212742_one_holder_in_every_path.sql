-- One holder in every path, and nothing held by nobody.
--
-- The single claim keeps the plane's first promise, one worker at a time
-- holds a key; the paths built since did not, and this migration makes
-- them:
--
-- 1. A batch decides each key once, in key order.
--    agent.idempotency_claim_many decided a batch in two passes: a bulk
--    insert of free keys in key order, then agent.idempotency_decide for
--    every other item in input order. A key's later occurrence was decided
--    again with its own token, so a batch that waited on another
--    transaction's row past its lease took over its own claim (two items,
--    one key, both lease_live); and the second pass, in input order, let
--    two batches over the same keys wait for each other in a cycle
--    (40P01). Now each key is decided once, by its first occurrence, in one
--    INSERT ... ON CONFLICT DO UPDATE that visits the keys in key order: a
--    free key is inserted, a taken one is locked (ON CONFLICT DO UPDATE
--    locks the row it finds, whether or not it updates it) and taken over
--    when its lease has passed and the request is the same. Every item is
--    answered from its key's row, which the batch holds: a later
--    occurrence what a single claim would answer it now (processing while
--    the batch holds the key). The leases won are timed from the end of
--    the batch. The work a first occurrence stores is measured before
--    anything is written by agent.idempotency_check_work, which
--    agent.idempotency_decide now calls too. agent.idempotency_complete_many
--    and agent.idempotency_release_many lock their rows in (organization,
--    scope, key) order before writing any.
-- 2. The plane owns its row cap. It was whatever the caller said (p_row_cap,
--    up to 100,000): behind a server that cuts answers at 1,000 rows, a
--    batch or a re-drive of more still claimed or took over the rows cut
--    from the answer, with tokens nobody received. The cap is now
--    agent.idempotency_settings.max_rows (one row, default 1000: Supabase's
--    api.max_rows), set to the server's db-max-rows where that is set.
--    agent.idempotency_row_cap(p_row_cap) answers it and refuses (22023) a
--    caller's cap above it; every function that answers rows asks it (the
--    batches through agent.idempotency_check_batch, the failures through
--    agent.idempotency_failures_scope, the re-drive, the sweep, the
--    sweeper's read, the orphans). p_row_cap defaults to the plane's cap.
-- 3. A re-drive can be repeated after a lost answer.
--    agent.idempotency_redrive minted the new lease tokens itself, so a
--    lost or cut answer left claims taken over that nobody held, each
--    costing an attempt toward the dead letter. It now takes one token
--    per orphan from its caller (p_lease_tokens replaces p_limit): a repeat
--    with the same tokens answers again what they still hold, at the same
--    attempt, and takes over more only with the tokens that hold nothing.
--    With p_max_bytes it hands out no more work than the caller reads in
--    one answer. A new argument list is a new function: the old one is
--    dropped.
-- 4. The sweep never deletes unfinished work. A claim still processing that
--    carries its request is work a worker acknowledged; when nothing
--    re-drove it before its retention passed, the sweep deleted it without
--    a trace. agent.idempotency_retire_expired retires the sweeper's
--    expired claims: it deletes the finished ones and journals each
--    unfinished one as a dead letter ({"ok": false, "error":
--    "swept_unredriven", ...}, kept for its scope's retention, with its
--    work, so idem failures lists it and idem redrive --failed can send it
--    back after a fix), and answers how many of each.
--    agent.idempotency_delete_expired answers through it (the deleted
--    count), and agent.idempotency_sweep reports both (its report type
--    gains dead_lettered). The sweep skips rows another transaction holds,
--    so it never waits on a claim.

CREATE TABLE agent.idempotency_settings (
    id boolean DEFAULT true NOT NULL,
    max_rows integer DEFAULT 1000 NOT NULL,
    CONSTRAINT idempotency_settings_max_rows_range CHECK (((max_rows >= 1) AND (max_rows <= 100000))),
    CONSTRAINT idempotency_settings_one_row CHECK (id)
);

ALTER TABLE agent.idempotency_settings OWNER TO idempotency_owner;

COMMENT ON TABLE agent.idempotency_settings IS 'The plane''s settings, one row: max_rows, the row cap no answer may exceed (the server''s db-max-rows).';

ALTER TABLE ONLY agent.idempotency_settings
    ADD CONSTRAINT idempotency_settings_pkey PRIMARY KEY (id);

ALTER TABLE agent.idempotency_settings ENABLE ROW LEVEL SECURITY;

REVOKE ALL ON TABLE agent.idempotency_settings FROM PUBLIC, anon, authenticated, service_role;

INSERT INTO agent.idempotency_settings (id, max_rows) VALUES (true, 1000);

CREATE TYPE agent.idempotency_retired AS (
	deleted integer,
	dead_lettered integer
);

ALTER TYPE agent.idempotency_retired OWNER TO idempotency_owner;

ALTER TYPE agent.idempotency_sweep_report ADD ATTRIBUTE dead_lettered integer;

DROP FUNCTION agent.idempotency_redrive(text, integer, bigint, uuid, integer);

SET local check_function_bodies = off;

CREATE FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_size bigint := octet_length(p_request::text);
  v_limit integer;
begin
  -- No text under the smallest limit a policy may set (1024) can be above
  -- one, or 64 levels deep under 130 bytes.
  if v_size >= 130
     and jsonb_path_exists(p_request, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'the request nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM6',
            hint = 'flatten the request, or store it as its JSON text ({"$json": "<text>"})';
  end if;
  if v_size > 1024 then
    select p.max_request_bytes into v_limit from agent.idempotency_policy(p_scope) p;
    if v_limit is null then
      raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
        using errcode = 'IDEM1',
              hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
    end if;
    if v_size > v_limit then
      v_size := agent.idempotency_json_size(p_request);
      if v_size > v_limit then
        raise exception 'the request is % bytes as compact JSON, above the % bytes scope % keeps',
                        v_size, v_limit, p_scope
          using errcode = 'IDEM5',
                hint = 'store the work elsewhere and claim with a reference to it, '
                       'or raise max_request_bytes for the scope';
      end if;
    end if;
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_check_work(p_scope text, p_request jsonb) FROM PUBLIC;

CREATE FUNCTION agent.idempotency_row_cap(p_row_cap integer DEFAULT NULL::integer) RETURNS integer
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_cap integer;
begin
  select s.max_rows into v_cap from agent.idempotency_settings s;
  v_cap := coalesce(v_cap, 1000);
  if p_row_cap is null then
    return v_cap;
  end if;
  if p_row_cap not between 1 and v_cap then
    raise exception 'p_row_cap % is outside 1 to the plane''s row cap %', p_row_cap, v_cap
      using errcode = '22023',
            hint = 'the plane''s row cap (agent.idempotency_settings.max_rows) is the server''s db-max-rows '
                   '(Supabase api.max_rows): omit p_row_cap, or pass that cap or a lower one';
  end if;
  return p_row_cap;
end
$$;

ALTER FUNCTION agent.idempotency_row_cap(p_row_cap integer) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) FROM PUBLIC;

CREATE FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) RETURNS SETOF agent.idempotency_retired
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_deleted integer;
  v_dead integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if pg_catalog.cardinality(p_ids) > agent.idempotency_row_cap() then
    raise exception 'p_ids holds % ids; at most the plane''s row cap % per call',
                    pg_catalog.cardinality(p_ids), agent.idempotency_row_cap()
      using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', pg_catalog.array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  -- Unfinished work (still processing, carrying its request: acknowledged,
  -- and nobody re-drove it) is never deleted: it is journaled as a dead
  -- letter, kept for its scope's retention from now, and listed among the
  -- failures, which an operator can send back after a fix.
  with expired as (
    select x.id, x.organization_id, x.scope, x.status = 'processing' and x.request is not null as unfinished
      from agent.idempotency_keys x
     where x.id = any (p_ids)
       and x.retain_until < pg_catalog.now()
       for update of x skip locked
  ), dead as (
    update agent.idempotency_keys as k
       set status = 'completed',
           response = pg_catalog.jsonb_build_object('ok', false, 'error', 'swept_unredriven',
                                                    'output', pg_catalog.jsonb_build_object('attempts', k.reclaims + 1)),
           lease_expires_at = least(k.lease_expires_at, pg_catalog.now()),
           retain_until = pg_catalog.now() + coalesce((select p.retain from agent.idempotency_policy(k.scope) p),
                                                      interval '1 day'),
           redrive_at = null
      from expired e
     where e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  ), deleted as (
    delete from agent.idempotency_keys k
     using expired e
     where not e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  )
  select (select pg_catalog.count(*) from deleted), (select pg_catalog.count(*) from dead) into v_deleted, v_dead;
  if v_dead > 0 then
    raise warning 'idempotency sweep: % unfinished claims carrying work passed their retention unredriven; journaled as dead letters (swept_unredriven)', v_dead
      using hint = 'schedule a re-drive for their scopes (idem redrive), then send them back: idem redrive --failed';
  end if;
  return next (v_deleted, v_dead)::agent.idempotency_retired;
end
$$;

ALTER FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) FROM PUBLIC;

CREATE FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid DEFAULT NULL::uuid, p_row_cap integer DEFAULT NULL::integer, p_max_bytes bigint DEFAULT NULL::bigint) RETURNS SETOF agent.idempotency_work
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_lease_tokens is null then
    raise exception 'p_lease_tokens is required: one fresh lease token per orphan the call may take over'
      using errcode = '22023',
            hint = 'mint them as for claims; a repeat with the same tokens after a lost answer answers the same claims';
  end if;
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
  end if;
  if p_max_bytes is not null and p_max_bytes < 1 then
    raise exception 'p_max_bytes must be at least 1, got %', p_max_bytes using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each orphan needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;

  v_family := right(p_scope, 2) = '.*';
  v_prefix := case when v_family then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_family and exists (select 1 from agent.idempotency_scopes s
                                    where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  return query
    with mine as (
      -- What an earlier call with these tokens took over and still holds:
      -- its answer was lost, so it is answered again, at the same attempt.
      select k.*
        from agent.idempotency_keys k
       where k.redrive_at is not null
         and k.lease_token = any (p_lease_tokens)
         and k.status = 'processing'
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         for update of k skip locked
    ), unused as (
      select t.token, pg_catalog.row_number() over (order by t.n) as n
        from pg_catalog.unnest(p_lease_tokens) with ordinality t(token, n)
       where not exists (select 1 from mine m where m.lease_token = t.token)
    ), orphans as (
      select k.id, k.organization_id, k.scope, k.redrive_at, pg_catalog.octet_length(k.request::text) as size
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and k.lease_token <> all (p_lease_tokens)
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit (select pg_catalog.count(*) from unused)
         for update of k skip locked
    ), numbered as (
      select o.id, o.organization_id, o.scope, pg_catalog.row_number() over (order by o.redrive_at, o.id) as n,
             pg_catalog.sum(o.size) over (order by o.redrive_at, o.id)
               + (select coalesce(pg_catalog.sum(pg_catalog.octet_length(m.request::text)), 0) from mine m) as bytes
        from orphans o
    ), decided as (
      -- Orphans locked beyond the byte budget stay orphans, for the next call.
      select o.id, o.organization_id, p.max_attempts, u.token
        from numbered o
        join unused u on u.n = o.n
       cross join lateral agent.idempotency_policy(o.scope) p
       where p_max_bytes is null or o.bytes <= p_max_bytes or (o.n = 1 and not exists (select 1 from mine))
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token else d.token end,
             claimed_at = case when k.reclaims + 1 >= d.max_attempts then k.claimed_at else v_at end,
             lease_expires_at = case when k.reclaims + 1 >= d.max_attempts then k.lease_expires_at
                                     else v_at + v_lease end,
             retain_until = case when k.reclaims + 1 >= d.max_attempts
                                 then greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at))
                                 else greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at))
                            end,
             reclaims = case when k.reclaims + 1 >= d.max_attempts then k.reclaims else k.reclaims + 1 end,
             redrive_at = case when k.reclaims + 1 >= d.max_attempts then null else v_at + v_lease end
        from decided d
       where k.id = d.id and k.organization_id = d.organization_id
      returning k.*
    ), answered as (
      select * from taken
      union all
      select * from mine
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer
      from answered t
     order by t.lease_expires_at, t.id;
end
$_$;

ALTER FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) OWNER TO idempotency_owner;
REVOKE ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) FROM PUBLIC;

CREATE OR REPLACE FUNCTION agent.idempotency_decide(p_organization_id uuid, p_scope text, p_key text, p_request_hash text, p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint, p_may_insert boolean, p_may_take_over boolean, p_request jsonb DEFAULT NULL::jsonb) RETURNS SETOF agent.idempotency_claim_outcome
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
declare
  v_policy_retain interval;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  v_request jsonb := nullif(p_request, 'null'::jsonb);
  r agent.idempotency_keys;
begin
  -- One test on the way in; the messages are built only for a refusal.
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512
     or p_request_hash is null or octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]'
     or p_lease_token is null
     or p_lease_ms is null or p_lease_ms not between 1000 and 86400000
     or p_retain_ms not between 1 and 31622400000
     or p_may_insert is null or p_may_take_over is null then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
    if p_request_hash is null then
      raise exception 'p_request_hash is required' using errcode = '22023';
    elsif octet_length(p_request_hash) <> 64 or p_request_hash ~ '[^0-9a-f]' then
      raise exception 'p_request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      pg_catalog.left(p_request_hash, 80)
        using errcode = '22023';
    elsif p_lease_token is null then
      raise exception 'p_lease_token is required' using errcode = '22023';
    elsif p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
      raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
        using errcode = '22023';
    elsif p_retain_ms not between 1 and 31622400000 then
      raise exception 'p_retain_ms must be between 1 and 31622400000 (366 days), got %', p_retain_ms
        using errcode = '22023';
    else
      raise exception 'p_may_insert and p_may_take_over are required' using errcode = '22023';
    end if;
  end if;

  -- The work is measured before anything is locked, as a completion's
  -- answer is (see 0014).
  if v_request is not null then
    perform agent.idempotency_check_work(p_scope, v_request);
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  -- What the caller asks for; the scope's policy is the floor of it.
  v_retain := greatest(coalesce(p_retain_ms, 0) * interval '1 millisecond', v_lease);

  -- Each pass decides, or sees the row change under it (released, taken
  -- over by someone else) and looks again; a key that keeps changing hands
  -- gives up with a serialization failure, which is safe to retry.
  for pass in 1..4 loop
    if p_may_insert then
      v_at := pg_catalog.clock_timestamp();
      -- The first claim, the hot path, reads its scope's policy in the
      -- same statement: no policy row, no insert.
      insert into agent.idempotency_keys as k
        (organization_id, scope, key, request_hash, status, lease_token,
         claimed_at, lease_expires_at, retain_until, request, redrive_at)
      select p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
             v_at, v_at + v_lease, v_at + v_lease + greatest(s.retain, v_retain),
             v_request, case when v_request is not null then v_at + v_lease end
        from agent.idempotency_scopes s
       where s.scope = p_scope
          or (s.scope like '%.*'
              and char_length(p_scope) > char_length(s.scope) - 1
              and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
       order by s.scope = p_scope desc, char_length(s.scope) desc
       limit 1
      on conflict (organization_id, scope, key) do nothing
      returning k.* into r;
      if found then
        v_outcome := 'claimed';
        v_won := true;
        exit;
      end if;
    end if;
    if v_policy_retain is null then
      select p.retain into v_policy_retain from agent.idempotency_policy(p_scope) p;
      if v_policy_retain is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
          using errcode = 'IDEM1',
                hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
      end if;
      v_retain := greatest(v_retain, v_policy_retain);
    end if;

    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope and k.key = p_key;
    if not found then
      -- Released since our insert: insert again; or nothing to take over.
      continue when p_may_insert;
      return;
    end if;
    if r.request_hash <> p_request_hash then
      v_outcome := 'conflict';
    elsif r.status = 'completed' then
      v_outcome := 'completed';
    elsif r.lease_expires_at > pg_catalog.clock_timestamp() then
      v_outcome := case when r.lease_token <> p_lease_token then 'processing'
                        when r.reclaims > 0 then 'reclaimed'
                        else 'claimed' end;
    elsif not p_may_take_over then
      v_outcome := 'reclaimable';
    end if;
    exit when v_outcome is not null;

    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set lease_token = p_lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, v_request),
           redrive_at = case when coalesce(k.request, v_request) is not null then v_at + v_lease end
     where k.id = r.id
       and k.lease_token = r.lease_token
       and k.status = 'processing'
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.* into r;
    if found then
      v_outcome := 'reclaimed';
      v_won := true;
      exit;
    end if;
  end loop;
  if v_outcome is null then
    raise exception 'the key %/% kept changing hands; try again', p_scope, p_key using errcode = '40001';
  end if;

  -- A win that waited: the lease starts now, and the retention, counted
  -- from the lease's end, moves with it.
  if v_won and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.id = r.id
    returning k.* into r;
  end if;

  return next (
    v_outcome, r.id, r.organization_id, r.scope, r.key,
    case when v_outcome = 'conflict' then null else r.request_hash end,
    r.status,
    case when v_outcome in ('claimed', 'reclaimed') then r.lease_token end,
    case when v_outcome = 'completed' then r.resource_type end,
    case when v_outcome = 'completed' then r.resource_id end,
    case when v_outcome = 'completed' then r.response end,
    r.claimed_at, r.lease_expires_at, r.retain_until,
    r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp()
  )::agent.idempotency_claim_outcome;
end
$_$;

CREATE OR REPLACE FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_count integer;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_items is null then
    raise exception 'p_items is required' using errcode = '22023';
  end if;
  if jsonb_typeof(p_items) <> 'array' then
    raise exception 'p_items must be a JSON array of items, got a JSON %', jsonb_typeof(p_items)
      using errcode = '22023';
  end if;
  v_count := jsonb_array_length(p_items);
  if v_count not between 1 and v_cap then
    raise exception 'p_items must hold between 1 and the row cap % items, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a batch answers a row per item; more than the row cap would be cut from the answer';
  end if;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_failures_scope(p_scope text, p_limit integer, p_row_cap integer) RETURNS text
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
declare
  v_prefix text;
  v_cap integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_limit is null or p_limit not between 1 and v_cap then
    raise exception 'p_limit must be between 1 and the row cap %, got %', v_cap, p_limit
      using errcode = '22023',
            hint = 'every failure is answered; more than the row cap would be cut from the answer';
  end if;
  v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_prefix is not null and exists (select 1 from agent.idempotency_scopes s
                                               where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;
  return v_prefix;
end
$_$;

CREATE OR REPLACE FUNCTION agent.idempotency_claim_many(p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_claim_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_keys text[];
  v_hashes text[];
  v_tokens uuid[];
  v_requests jsonb[];
  v_item jsonb;
  v_index integer;
  v_text text;
  v_earlier integer;
  v_state text;
  v_message text;
  v_hint text;
  v_retain interval;
  v_lease interval := p_lease_ms * interval '1 millisecond';
  v_at timestamptz;
  v_firsts boolean[];
  v_rows agent.idempotency_keys[];
  v_answered integer;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]' then
    raise exception 'p_scope must be 1 to 128 characters of a-z, 0-9, ".", "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select p.retain into v_retain from agent.idempotency_policy(p_scope) p;
  if v_retain is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
  end if;
  v_retain := greatest(v_retain, v_lease);

  -- Every item is checked before anything is written, in one pass over
  -- the array; the first bad item, if any, is checked again on its own to
  -- say what is wrong with it.
  select (e.ordinality - 1)::integer, e.value into v_index, v_item
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(pg_catalog.jsonb_typeof(e.value) = 'object'
                      and pg_catalog.jsonb_typeof(e.value -> 'key') = 'string'
                      and char_length(e.value ->> 'key') between 1 and 512
                      and pg_catalog.jsonb_typeof(e.value -> 'request_hash') = 'string'
                      and (e.value ->> 'request_hash') ~ '^[0-9a-f]{64}$'
                      and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
                      and (e.value ->> 'lease_token')
                          ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$',
                      false)
   order by e.ordinality
   limit 1;
  if found then
    perform agent.idempotency_check_item(v_item, v_index);
    v_text := agent.idempotency_item_text(v_item, v_index, 'key', true);
    if char_length(v_text) not between 1 and 512 then
      raise exception 'p_items[%].key must be 1 to 512 characters, got %', v_index, char_length(v_text)
        using errcode = '22023';
    end if;
    v_text := agent.idempotency_item_text(v_item, v_index, 'request_hash', true);
    if octet_length(v_text) <> 64 or v_text ~ '[^0-9a-f]' then
      raise exception 'p_items[%].request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      v_index, pg_catalog.left(v_text, 80)
        using errcode = '22023';
    end if;
    perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  -- The items' fields, and whether each is its key's first occurrence.
  select pg_catalog.array_agg(t.key order by t.n), pg_catalog.array_agg(t.hash order by t.n),
         pg_catalog.array_agg(t.token order by t.n), pg_catalog.array_agg(t.request order by t.n),
         pg_catalog.array_agg(t.first order by t.n)
    into v_keys, v_hashes, v_tokens, v_requests, v_firsts
    from (select e.ordinality as n, e.value ->> 'key' as key, e.value ->> 'request_hash' as hash,
                 (e.value ->> 'lease_token')::uuid as token, nullif(e.value -> 'request', 'null'::jsonb) as request,
                 pg_catalog.row_number() over (partition by e.value ->> 'key' order by e.ordinality) = 1 as first
            from pg_catalog.jsonb_array_elements(p_items) with ordinality e) t;
  -- The first item whose token an earlier item named, and that item.
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by v_tokens[i]) as first
            from pg_catalog.generate_subscripts(v_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_items[%].lease_token repeats p_items[%].lease_token: each item needs a token of its own',
                    v_index, v_earlier
      using errcode = '22023',
            hint = 'a claim repeated with its token answers claimed again; mint a fresh token per item';
  end if;
  -- The work each key's first occurrence stores, measured as a single
  -- claim's is; later occurrences store nothing.
  if pg_catalog.array_length(pg_catalog.array_remove(v_requests, null), 1) is not null then
    begin
      for i in 1 .. pg_catalog.cardinality(v_keys) loop
        v_index := i - 1;
        if v_firsts[i] and v_requests[i] is not null then
          perform agent.idempotency_check_work(p_scope, v_requests[i]);
        end if;
      end loop;
    exception when others then
      get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
      raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
    end;
  end if;

  -- Each key is decided once, by its first occurrence, in one statement
  -- that visits the keys in key order: a free key is inserted; a taken one
  -- is locked, and taken over when its lease has passed and the request is
  -- the same (the row's work kept, or this item's stored). Every row the
  -- batch touches is locked in (organization, scope, key) order, as every
  -- batch of the plane locks them, so batches over the same keys wait for
  -- each other in one order and never deadlock; and no other transaction
  -- can change a row between this decision and the answer read below.
  v_at := pg_catalog.clock_timestamp();
  with firsts as (
    select v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request
      from pg_catalog.generate_subscripts(v_keys, 1) i
     where v_firsts[i]
  ), decided as (
    insert into agent.idempotency_keys as k
      (organization_id, scope, key, request_hash, status, lease_token,
       claimed_at, lease_expires_at, retain_until, request, redrive_at)
    select p_organization_id, p_scope, f.key, f.hash, 'processing', f.token,
           v_at, v_at + v_lease, v_at + v_lease + v_retain,
           f.request, case when f.request is not null then v_at + v_lease end
      from firsts f
     order by f.key
    on conflict (organization_id, scope, key) do update
       set lease_token = excluded.lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, excluded.request),
           redrive_at = case when coalesce(k.request, excluded.request) is not null then v_at + v_lease end
     where k.status = 'processing'
       and k.request_hash = excluded.request_hash
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.*
  )
  select pg_catalog.array_agg(row(decided.*)::agent.idempotency_keys) into v_rows from decided;

  -- The leases won are timed from the end of the batch, when the answer
  -- is made: time spent waiting on other transactions' rows is not taken
  -- out of them. The retention, counted from the lease's end, moves with it.
  if v_rows is not null and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    with moved as (
      update agent.idempotency_keys as k
         set claimed_at = v_at,
             lease_expires_at = v_at + v_lease,
             retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
             redrive_at = case when k.redrive_at is not null then v_at + v_lease end
        from pg_catalog.unnest(v_rows) w
       where k.organization_id = p_organization_id and k.id = w.id
      returning k.*
    )
    select pg_catalog.array_agg(row(moved.*)::agent.idempotency_keys) into v_rows from moved;
  end if;
  -- The rows of the keys the batch did not win, which it holds all the same.
  if coalesce(pg_catalog.cardinality(v_rows), 0) < pg_catalog.cardinality(v_keys) then
    select coalesce(v_rows, '{}') || coalesce(pg_catalog.array_agg(k), '{}') into v_rows
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope
       and k.key = any (v_keys)
       and k.id <> all (select w.id from pg_catalog.unnest(coalesce(v_rows, '{}')) w);
  end if;

  -- Every item answered from its key's row: the first occurrence what it
  -- decided, a later one what a single claim would answer it now (the key
  -- is its batch's first occurrence's, so never claimed a second time).
  return query
    select (i - 1)::integer, o.outcome, k.id, k.organization_id, k.scope, k.key,
           case when o.outcome = 'conflict' then null else k.request_hash end,
           k.status,
           case when o.outcome in ('claimed', 'reclaimed') then k.lease_token end,
           case when o.outcome = 'completed' then k.resource_type end,
           case when o.outcome = 'completed' then k.resource_id end,
           case when o.outcome = 'completed' then k.response end,
           k.claimed_at, k.lease_expires_at, k.retain_until,
           k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp()
      from pg_catalog.generate_subscripts(v_keys, 1) i
      join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
     cross join lateral (
       select case when k.request_hash <> v_hashes[i] then 'conflict'
                   when k.status = 'completed' then 'completed'
                   when k.lease_token <> v_tokens[i] then 'processing'
                   when k.reclaims > 0 then 'reclaimed'
                   else 'claimed' end as outcome
     ) o
     order by i;
  get diagnostics v_answered = row_count;
  if v_answered <> pg_catalog.cardinality(v_keys) then
    raise exception 'claim_many answered % of % items', v_answered, pg_catalog.cardinality(v_keys)
      using errcode = 'XX000';
  end if;
end
$_$;

CREATE OR REPLACE FUNCTION agent.idempotency_complete_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_completion_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_types text[] := '{}'::text[];
  v_resources text[] := '{}'::text[];
  v_responses jsonb[] := '{}'::jsonb[];
  v_item jsonb;
  v_index integer;
  v_type text;
  v_resource text;
  v_response jsonb;
  v_state text;
  v_message text;
  v_hint text;
  r agent.idempotency_claim;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
    v_type := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_type', false), '');
    v_resource := nullif(agent.idempotency_item_text(v_item, v_index, 'resource_id', false), '');
    v_response := nullif(v_item -> 'response', 'null'::jsonb);
    if v_response is null and v_resource is null then
      raise exception 'p_items[%] carries neither a response nor a resource; a completion carries one', v_index
        using errcode = '22023';
    end if;
    if v_resource is not null and v_type is null then
      raise exception 'p_items[%].resource_id needs resource_type, so a reader can tell what it names', v_index
        using errcode = '22023';
    end if;
    if char_length(v_type) > 128 or char_length(v_resource) > 512 then
      raise exception 'p_items[%]: resource_type may have at most 128 characters and resource_id at most 512', v_index
        using errcode = '22023';
    end if;
    v_types := pg_catalog.array_append(v_types, v_type);
    v_resources := pg_catalog.array_append(v_resources, v_resource);
    v_responses := pg_catalog.array_append(v_responses, v_response);
  end loop;

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

  begin
    for i in 1 .. pg_catalog.cardinality(v_ids) loop
      v_index := i - 1;
      select * into r
        from agent.idempotency_complete(v_ids[i], v_tokens[i], v_types[i], v_resources[i], v_responses[i],
                                        p_organization_id);
      if found then
        return next (v_index, true, r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                     r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                     r.lease_expires_at, r.retain_until, r.lease_live)::agent.idempotency_completion_item;
      else
        return next (v_index, false, null, null, null, null, null, null, null, null, null, null, null, null,
                     null, null)::agent.idempotency_completion_item;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_release_many(p_organization_id uuid, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_release_item
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[] := '{}'::uuid[];
  v_tokens uuid[] := '{}'::uuid[];
  v_item jsonb;
  v_index integer;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);

  for v_item, v_index in select e.value, (e.ordinality - 1)::integer
                           from jsonb_array_elements(p_items) with ordinality e loop
    perform agent.idempotency_check_item(v_item, v_index);
    v_ids := pg_catalog.array_append(v_ids, agent.idempotency_item_uuid(v_item, v_index, 'claim_id'));
    v_tokens := pg_catalog.array_append(v_tokens, agent.idempotency_item_uuid(v_item, v_index, 'lease_token'));
  end loop;

  -- The rows are locked in (organization, scope, key) order before any is
  -- written, as every batch of the plane locks them, so that batches over
  -- the same keys never wait for each other in a cycle.
  perform 1
     from agent.idempotency_keys k
    where k.organization_id = p_organization_id and k.id = any (v_ids)
    order by k.scope, k.key
      for update of k;

  for i in 1 .. pg_catalog.cardinality(v_ids) loop
    return next (i - 1, agent.idempotency_release(v_ids[i], v_tokens[i], p_organization_id))
      ::agent.idempotency_release_item;
  end loop;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
begin
  return (select r.deleted from agent.idempotency_retire_expired(p_ids) r);
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_sweep(p_bound integer, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_sweep_report
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_ids uuid[];
  v_read integer;
  v_retired agent.idempotency_retired;
  v_cap integer;
begin
  if p_bound is null then
    raise exception 'p_bound is required: the most expired claims one sweep reads' using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_bound < 1 then
    raise exception 'p_bound must be at least 1, got %', p_bound using errcode = '22023';
  end if;
  if p_bound > v_cap then
    raise exception 'p_bound % is above the row cap %: a sweep reads at most the row cap',
                    p_bound, v_cap
      using errcode = '22023',
            hint = 'lower p_bound to the row cap or below; a larger backlog is swept by sweeping more often';
  end if;

  select coalesce(pg_catalog.array_agg(e.id), '{}') into v_ids
    from agent.idempotency_expired(p_bound) e;
  v_read := pg_catalog.cardinality(v_ids);
  select * into v_retired from agent.idempotency_retire_expired(v_ids);

  if v_read >= p_bound then
    raise warning 'idempotency sweep read % expired claims, its whole bound: the backlog may be larger', v_read
      using hint = 'sweep more often or raise the bound (up to the row cap)';
  end if;
  return next (v_read, v_retired.deleted, p_bound, v_read >= p_bound, v_retired.dead_lettered)
    ::agent.idempotency_sweep_report;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_expired(p_limit integer) RETURNS SETOF agent.idempotency_rows
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_row agent.idempotency_rows;
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the plane''s row cap %, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  for v_row in
    select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, null::uuid,
           k.resource_type, k.resource_id, k.response, k.claimed_at, k.lease_expires_at,
           k.retain_until, k.reclaims
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit
  loop
    return next v_row;
  end loop;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_orphans(p_limit integer DEFAULT 100) RETURNS SETOF agent.idempotency_orphaned_scope
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_limit is null or p_limit not between 1 and least(1000, agent.idempotency_row_cap()) then
    raise exception 'p_limit must be between 1 and % scopes (1000, or the plane''s row cap when lower), got %',
                    least(1000, agent.idempotency_row_cap()), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope, count(*), min(k.redrive_at),
           (extract(epoch from pg_catalog.clock_timestamp() - min(k.redrive_at)) * 1000)::bigint
      from agent.idempotency_keys k
     where k.redrive_at <= pg_catalog.clock_timestamp()
       and k.status = 'processing'
     group by k.scope
     order by count(*) desc, k.scope
     limit p_limit;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_failures(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  return query
    with failed as (
      select k.*
        from agent.idempotency_keys k
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
       order by k.claimed_at, k.id
       limit p_limit
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(jsonb_array_length(f.replaced), 0),
           (count(*) over ())::integer
      from failed f
     order by f.claimed_at, f.id;
end
$$;

CREATE OR REPLACE FUNCTION agent.idempotency_redrive_failed(p_scope text, p_limit integer, p_organization_id uuid DEFAULT NULL::uuid, p_since timestamp with time zone DEFAULT NULL::timestamp with time zone, p_claim_ids uuid[] DEFAULT NULL::uuid[], p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_failure
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_prefix text;
  v_at timestamptz;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  if p_claim_ids is not null
     and (cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null) then
    raise exception 'p_claim_ids must name at least one claim, and no NULL; omit it to send back every failure'
      using errcode = '22023';
  end if;
  if p_claim_ids is null and p_since is null then
    raise exception 'name what to send back: p_claim_ids (the chosen failures), p_since (every failure claimed since), or both'
      using errcode = '22023';
  end if;

  v_at := pg_catalog.clock_timestamp();
  return query
    with chosen as (
      select k.id, k.organization_id, k.scope, p.retain
        from agent.idempotency_keys k
       cross join lateral agent.idempotency_policy(k.scope) p
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and k.request is not null
         and p.retain is not null
         and p.max_attempts > 1
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
         and (p_claim_ids is null or k.id = any (p_claim_ids))
       order by k.claimed_at, k.id
       limit p_limit
         for update of k skip locked
    ), sent as (
      update agent.idempotency_keys as k
         set status = 'processing',
             response = null,
             resource_type = null,
             resource_id = null,
             lease_token = gen_random_uuid(),
             claimed_at = v_at,
             lease_expires_at = v_at,
             redrive_at = v_at,
             reclaims = 0,
             retain_until = greatest(k.retain_until, v_at + c.retain),
             replaced = (
               select coalesce(jsonb_agg(e.entry order by e.n), '[]'::jsonb)
                 from jsonb_array_elements(
                        coalesce(k.replaced, '[]'::jsonb)
                        || jsonb_build_array(jsonb_build_object(
                             'response', k.response,
                             'resource_type', k.resource_type,
                             'resource_id', k.resource_id,
                             'attempts', k.reclaims + 1,
                             'claimed_at', k.claimed_at,
                             'sent_back_at', v_at))
                      ) with ordinality as e(entry, n)
                where e.n > jsonb_array_length(coalesce(k.replaced, '[]'::jsonb)) + 1 - 20
             )
        from chosen c
       where k.id = c.id and k.organization_id = c.organization_id
      returning k.*
    )
    select s.id, s.organization_id, s.scope, s.key, s.status,
           s.replaced -> -1 -> 'response' ->> 'error', s.replaced -> -1 -> 'response',
           s.replaced -> -1 ->> 'resource_type', s.replaced -> -1 ->> 'resource_id',
           (s.replaced -> -1 ->> 'attempts')::integer, s.claimed_at, s.retain_until,
           true, jsonb_array_length(s.replaced),
           (count(*) over ())::integer
      from sent s
     order by s.id;
end
$$;

GRANT ALL ON FUNCTION agent.idempotency_row_cap(p_row_cap integer) TO service_role;
GRANT ALL ON FUNCTION agent.idempotency_retire_expired(p_ids uuid[]) TO service_role;
GRANT ALL ON FUNCTION agent.idempotency_redrive(p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, p_max_bytes bigint) TO service_role;
