-- The work outlives its worker.
--
-- Serverless workers are stopped mid-effect (wall clock, CPU, memory, an
-- idle worker dropped early). A claim alone keeps the key, not the work: a
-- webhook acknowledged before its worker died was held by a claim nobody
-- could finish. From here a claim can carry its work, its holder can keep
-- the lease alive, and anyone can take over work whose holder is gone.
--
-- 1. The claim carries its work. agent.idempotency_claim takes a last
--    argument, p_request jsonb DEFAULT NULL: the request to run, stored by
--    the same statement that makes the claim (no second round trip, no
--    moment between "claimed" and "stored"). A takeover keeps what the row
--    holds and stores p_request only where it held none. JSON null counts
--    as none. It is bounded by the scope's new max_request_bytes (compact
--    JSON, IDEM5 above it) and by the 64-level depth every client reads
--    back (IDEM6), both measured before anything is locked. No answer of
--    a claim, a replay, a conflict or a read ever carries it: only the
--    re-drive below hands it out, to the caller it hands the claim to.
-- 2. Heartbeats. agent.idempotency_extend(p_claim_id, p_lease_token,
--    p_lease_ms, p_organization_id DEFAULT NULL) moves the lease's end to
--    p_lease_ms from now (database clock), fenced by the token like a
--    completion: it answers the new end, or NULL when the claim is no
--    longer this token's (completed, released, taken over): the holder
--    must stop. A holder whose lease passed but whom nobody replaced may
--    still extend. It may also shorten the lease: a holder that backs off
--    after a retryable failure sets the lease to the backoff and leaves the
--    claim, which is re-driven when it passes. Retention keeps counting
--    from the lease's end.
-- 3. Re-drive. agent.idempotency_redrive(p_scope, p_limit, p_lease_ms,
--    p_organization_id DEFAULT NULL) takes over, in one statement, up to
--    p_limit orphans of a scope or a family (tool.*): claims still
--    processing whose lease passed and that carry their work. Concurrent
--    re-drivers split them (FOR UPDATE SKIP LOCKED). Each is handed out
--    with a fresh lease token (the old holder, if it was only slow, is
--    fenced off: its completion, release or extension answers that the
--    fence moved on) and its attempt number; one whose work has been
--    handed out max_attempts times already (the scope's new policy
--    column) is journaled as a failure instead, the dead letter:
--    {"ok": false, "error": "dead_lettered", "output": {"attempts": n}},
--    which every later claim of its key replays. It answers rows of the
--    view agent.idempotency_work (so a server's row cap applies to it like
--    to every bounded read); p_limit is checked against p_row_cap (default
--    1000), as agent.idempotency_sweep checks its bound.
--
-- agent.idempotency_orphans(p_limit DEFAULT 100) counts the orphans of each
-- scope, for `idem doctor`.
--
-- How orphans are found without slowing the hot path: a claim that carries
-- work has redrive_at, the end of its lease, in a partial index; a claim
-- without work has it NULL and is in no new index. A completion sets it
-- NULL (for a claim without work it was NULL already, so that completion
-- stays a HOT update); an extension or a takeover moves it with the lease.
--
-- Attempts: a claim's attempt number is reclaims + 1. Every takeover adds
-- one, a re-drive's and a redelivery's alike (a redelivery that finds a
-- passed lease takes the claim over as it always has).
--
-- Everything follows 0011: owned by idempotency_owner, SECURITY DEFINER
-- with search_path '', every name qualified, executable by service_role.

-- 1. Data ------------------------------------------------------------------------

alter table agent.idempotency_keys
  add column request jsonb,
  add column redrive_at timestamptz,
  add constraint idempotency_keys_redrive_carries_work
    check (redrive_at is null or (status = 'processing' and request is not null));

comment on column agent.idempotency_keys.request is
  'The work the claim carries, as its claimant stored it; handed out only by agent.idempotency_redrive.';
comment on column agent.idempotency_keys.redrive_at is
  'When a claim carrying work may be re-driven: its lease end while processing, NULL otherwise.';

create index idempotency_keys_redrive_idx on agent.idempotency_keys (scope, redrive_at)
  where redrive_at is not null;

alter table agent.idempotency_scopes
  add column max_request_bytes integer not null default 65536,
  add column max_attempts integer not null default 5,
  add constraint idempotency_scopes_max_request_bytes_range
    check (max_request_bytes between 1024 and 4194304),
  add constraint idempotency_scopes_max_attempts_range
    check (max_attempts between 1 and 100);

comment on table agent.idempotency_scopes is
  'Retention, answer and request limits, and attempts per scope (exact, or a family such as tool.*). '
  'A scope with no row is refused.';

-- The claim table's columns as the bounded reads answer them (see 0011),
-- named one by one: the work a claim carries is not the sweeper's to read.
create or replace view agent.idempotency_rows with (security_invoker = true) as
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, k.lease_token,
         k.resource_type, k.resource_id, k.response, k.claimed_at, k.lease_expires_at,
         k.retain_until, k.reclaims
    from agent.idempotency_keys k;

-- A claim's work as agent.idempotency_redrive answers it: status is
-- processing for work handed out (with the new holder's lease token, its
-- request and its attempt number) and completed for a dead letter (with
-- its journaled failure, and neither token nor request). taken is set by
-- the re-drive alone: how many rows that call answered, in every row, so
-- a client sees an answer a server's row cap cut short without asking the
-- server to count (a count makes some PostgREST-compatible servers run the
-- function a second time, and a re-drive must run once). Like
-- agent.idempotency_rows, no API role can read the table through it.
create view agent.idempotency_work with (security_invoker = true) as
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, k.lease_token,
         k.request, k.reclaims + 1 as attempt, k.claimed_at, k.lease_expires_at, k.retain_until,
         k.response, null::integer as taken
    from agent.idempotency_keys k;
alter view agent.idempotency_work owner to idempotency_owner;
revoke all on agent.idempotency_work from public, anon, authenticated, service_role;
grant select on agent.idempotency_work to service_role;

-- 2. Policy ----------------------------------------------------------------------

-- The policy of p_scope, as 0008 finds it, with the new columns.
drop function agent.idempotency_policy(text);
create function agent.idempotency_policy(
  p_scope text,
  out retain interval,
  out max_response_bytes integer,
  out max_request_bytes integer,
  out max_attempts integer
)
language plpgsql stable security invoker set search_path = ''
as $$
begin
  select s.retain, s.max_response_bytes, s.max_request_bytes, s.max_attempts
    into retain, max_response_bytes, max_request_bytes, max_attempts
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
end
$$;

-- 3. The claim decision, carrying work ---------------------------------------------

-- 0011's decision with p_request: stored by the first claim's insert, kept
-- (or stored where there was none) by a takeover. Every other line is
-- 0011's.
drop function agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean);
create function agent.idempotency_decide(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint,
  p_may_insert boolean,
  p_may_take_over boolean,
  p_request jsonb default null
) returns setof agent.idempotency_claim_outcome
language plpgsql volatile security invoker
set search_path = ''
as $$
declare
  v_policy_retain interval;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  v_request jsonb := nullif(p_request, 'null'::jsonb);
  v_size bigint;
  v_limit integer;
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
  -- answer is (see 0014): no text under the smallest limit a policy may
  -- set (1024) can be above one, or 64 levels deep under 130 bytes.
  if v_request is not null then
    v_size := octet_length(v_request::text);
    if v_size >= 130
       and jsonb_path_exists(v_request, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
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
        v_size := agent.idempotency_json_size(v_request);
        if v_size > v_limit then
          raise exception 'the request is % bytes as compact JSON, above the % bytes scope % keeps',
                          v_size, v_limit, p_scope
            using errcode = 'IDEM5',
                  hint = 'store the work elsewhere and claim with a reference to it, '
                         'or raise max_request_bytes for the scope';
        end if;
      end if;
    end if;
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
$$;

-- The one-call claim, with the work it carries. A new argument is a new
-- signature (see 0014), so the old function is dropped and made again.
drop function agent.idempotency_claim(uuid, text, text, text, uuid, bigint);
create function agent.idempotency_claim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_request jsonb default null
) returns setof agent.idempotency_claim_outcome
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
begin
  return query
    select * from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                           p_lease_ms, null, true, true, p_request);
end
$$;

-- 4. Completion leaves the re-drive index ------------------------------------------

-- 0014's completion; new is only that a completed claim is no longer work
-- to re-drive (redrive_at NULL).
create or replace function agent.idempotency_complete(
  p_claim_id uuid,
  p_lease_token uuid,
  p_resource_type text default null,
  p_resource_id text default null,
  p_response jsonb default null,
  p_organization_id uuid default null
) returns setof agent.idempotency_claim
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
  v_organization_id uuid := p_organization_id;
  v_scope text;
  v_limit integer;
  v_size bigint;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if v_response is null and v_resource_id is null then
    raise exception 'a completion carries a response or a resource; this one carries neither'
      using errcode = '22023';
  end if;
  if v_resource_id is not null and v_resource_type is null then
    raise exception 'p_resource_id needs p_resource_type, so a reader can tell what it names'
      using errcode = '22023';
  end if;
  if char_length(v_resource_type) > 128 or char_length(v_resource_id) > 512 then
    raise exception 'p_resource_type may have at most 128 characters and p_resource_id at most 512'
      using errcode = '22023';
  end if;

  if v_organization_id is null then
    select k.organization_id into v_organization_id from agent.idempotency_keys k where k.id = p_claim_id;
    if not found then
      return;
    end if;
  end if;

  if v_response is not null then
    v_size := octet_length(v_response::text);
    if v_size >= 130
       and jsonb_path_exists(v_response, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
      raise exception 'the response nests arrays and objects deeper than 64 levels, more than every client reads back'
        using errcode = 'IDEM3',
              hint = 'flatten the response, or store it elsewhere and complete with its resource';
    end if;
    if v_size > 1024 then
      select k.scope into v_scope
        from agent.idempotency_keys k
       where k.organization_id = v_organization_id and k.id = p_claim_id;
      if not found then
        return;
      end if;
      select p.max_response_bytes into v_limit from agent.idempotency_policy(v_scope) p;
      if v_limit is null then
        raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
          using errcode = 'IDEM1';
      end if;
      if v_size > v_limit then
        v_size := agent.idempotency_json_size(v_response);
        if v_size > v_limit then
          raise exception 'the response is % bytes as compact JSON, above the % bytes scope % keeps',
                          v_size, v_limit, v_scope
            using errcode = 'IDEM2',
                  hint = 'store the response elsewhere and complete with its resource (and a reference to it)';
        end if;
      end if;
    end if;
  end if;

  update agent.idempotency_keys as k
     set status = 'completed',
         resource_type = v_resource_type,
         resource_id = v_resource_id,
         response = v_response,
         retain_until = greatest(k.retain_until,
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at)),
         redrive_at = null
   where k.organization_id = v_organization_id
     and k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.organization_id = v_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'completed'
       and k.resource_type is not distinct from v_resource_type
       and k.resource_id is not distinct from v_resource_id
       and k.response is not distinct from v_response;
  end if;
  if found then
    return next (r.id, r.organization_id, r.scope, r.key, r.request_hash, r.status,
                 r.lease_token, r.resource_type, r.resource_id, r.response, r.claimed_at,
                 r.lease_expires_at, r.retain_until,
                 r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
  end if;
end
$$;

-- The sweeper's bounded read, as 0016 left it, naming the view's columns:
-- the table now has columns the view does not.
create or replace function agent.idempotency_expired(p_limit integer)
returns setof agent.idempotency_rows
language plpgsql stable security definer set search_path = ''
as $$
declare
  v_row agent.idempotency_rows;
begin
  if p_limit is null or p_limit < 1 or p_limit > 100000 then
    raise exception 'p_limit must be between 1 and 100000, got %', p_limit using errcode = '22023';
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

-- 5. Heartbeats ---------------------------------------------------------------------

-- Moves the lease of a claim the caller still holds to p_lease_ms from now;
-- answers its new end, or NULL when the fence moved on.
create function agent.idempotency_extend(
  p_claim_id uuid,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_organization_id uuid default null
) returns timestamptz
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_lease interval;
  v_at timestamptz;
  v_end timestamptz;
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  if p_organization_id is null then
    -- A caller that does not name the organization: found by id alone,
    -- which a partitioned table answers from every partition.
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  else
    update agent.idempotency_keys as k
       set lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
     where k.organization_id = p_organization_id
       and k.id = p_claim_id
       and k.lease_token = p_lease_token
       and k.status = 'processing'
    returning k.lease_expires_at into v_end;
  end if;
  return v_end;
end
$$;

-- 6. Re-drive -------------------------------------------------------------------------

-- Takes over up to p_limit orphans of p_scope (exact, or a family ending in
-- ".*"), of one organization when p_organization_id is given: each handed
-- out with a fresh token and a lease of p_lease_ms, or journaled as a dead
-- letter when its work was handed out max_attempts times already.
create function agent.idempotency_redrive(
  p_scope text,
  p_limit integer,
  p_lease_ms bigint,
  p_organization_id uuid default null,
  p_row_cap integer default 1000
) returns setof agent.idempotency_work
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_limit is null then
    raise exception 'p_limit is required: the most orphans one call takes over' using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap the caller is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_limit not between 1 and p_row_cap then
    raise exception 'p_limit must be between 1 and the row cap p_row_cap %, got %', p_row_cap, p_limit
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
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
    with orphans as (
      select k.id, k.organization_id, k.scope
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit p_limit
         for update of k skip locked
    ), decided as (
      select o.id, o.organization_id, p.max_attempts
        from orphans o
       cross join lateral agent.idempotency_policy(o.scope) p
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token
                                else gen_random_uuid() end,
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
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer
      from taken t
     order by t.lease_expires_at, t.id;
end
$$;

-- How much work nobody is doing: per scope, the orphans (claims still
-- processing whose lease passed and that carry work), since when the oldest
-- waits and how long that is by the database clock, most orphans first, at
-- most p_limit scopes. For `idem doctor`: orphans that wait long mean
-- nothing re-drives the scope. Read-only; it reads the re-drive index alone.
create type agent.idempotency_orphaned_scope as (
  scope     text,
  orphans   bigint,
  oldest    timestamptz,
  waited_ms bigint
);
alter type agent.idempotency_orphaned_scope owner to idempotency_owner;

create function agent.idempotency_orphans(p_limit integer default 100)
returns setof agent.idempotency_orphaned_scope
language plpgsql stable security definer set search_path = ''
as $$
begin
  if p_limit is null or p_limit not between 1 and 1000 then
    raise exception 'p_limit must be between 1 and 1000 scopes, got %', p_limit using errcode = '22023';
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

-- 7. Owners and execution ---------------------------------------------------------------

alter function agent.idempotency_policy(text) owner to idempotency_owner;
alter function agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean, jsonb)
  owner to idempotency_owner;
alter function agent.idempotency_claim(uuid, text, text, text, uuid, bigint, jsonb) owner to idempotency_owner;
alter function agent.idempotency_extend(uuid, uuid, bigint, uuid) owner to idempotency_owner;
alter function agent.idempotency_redrive(text, integer, bigint, uuid, integer) owner to idempotency_owner;
alter function agent.idempotency_orphans(integer) owner to idempotency_owner;

revoke all on function
  agent.idempotency_policy(text),
  agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean, jsonb)
from public, anon, authenticated, service_role;
revoke all on function
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint, jsonb),
  agent.idempotency_extend(uuid, uuid, bigint, uuid),
  agent.idempotency_redrive(text, integer, bigint, uuid, integer),
  agent.idempotency_orphans(integer)
from public, anon, authenticated;
grant execute on function
  agent.idempotency_claim(uuid, text, text, text, uuid, bigint, jsonb),
  agent.idempotency_extend(uuid, uuid, bigint, uuid),
  agent.idempotency_redrive(text, integer, bigint, uuid, integer),
  agent.idempotency_orphans(integer)
to service_role;
