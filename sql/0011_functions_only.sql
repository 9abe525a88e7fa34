-- The functions are the only way in, and every one of them checks its
-- arguments. Every client reaches the plane through these functions: an
-- edge function, curl, the sweeper, the Rust crate. So the database holds
-- every rule, whatever a client sends.
--
-- 1. A dedicated owner. The plane's tables, types and functions belong to
--    idempotency_owner, a role nobody logs in as. The functions run as
--    SECURITY DEFINER with search_path pinned to '', so they act as that
--    owner. No API role (anon, authenticated, service_role) holds any
--    privilege on a table. PostgREST's table endpoints (GET, POST, PATCH,
--    DELETE /idempotency_keys and the rest) therefore answer 4xx for every
--    role: 42501, or PGRST205 from a server that lists no table a role
--    holds nothing on. A forged completed row, a rewritten response or a deleted
--    claim can no longer go around the checks below.
-- 2. Arguments. Every function refuses a NULL or malformed required
--    argument before it reads or writes anything: SQLSTATE 22023
--    (invalid_parameter_value), HTTP 400, with a message that names the
--    argument. This matters because PostgREST binds a JSON null to SQL
--    NULL. A NULL request hash used to compare as "not different": it
--    took over a passed lease of another request, or replayed a stored
--    answer to a caller that did not know the request.
-- 3. Internal helpers (idempotency_decide, _policy, _claim_of, _json_size,
--    _check_key) are executable by their owner alone. The public
--    functions call them as that owner. The bounded reads answer rows of
--    a view, agent.idempotency_rows, that no API role can read through.
-- 4. A response a client cannot read back is refused. Arrays and objects
--    nested deeper than 64 levels get IDEM3. A policy may allow at most
--    4 MiB of compact JSON: PostgreSQL writes a stored response back with
--    a space after every ',' and ':', up to half as large again, and a
--    client must be able to read the row whole (the Rust crate reads 8 MiB
--    by default). The size and the depth are measured before the row is
--    locked, so a refused answer never holds the key's lock.
-- 5. Default privileges. 0007 revoked EXECUTE from PUBLIC on every future
--    function the migrating role creates, in every schema. That is undone
--    here. PostgreSQL cannot revoke a PUBLIC default for one schema (a
--    per-schema default can only add to the global one), so an event
--    trigger takes its place. It revokes EXECUTE from PUBLIC, anon and
--    authenticated on every function created in (or moved into) schema
--    agent, whichever role creates it. Beneath that, anon, authenticated
--    and PUBLIC hold no USAGE on schema agent (0004), so they cannot call
--    anything in it even where no event trigger fires. On Supabase,
--    supautils runs user event triggers for every role except
--    superusers; supabase_admin is one.

-- 1. The owner -----------------------------------------------------------------

-- Created only where it does not exist, and a concurrent creator's win is
-- not an error, as in 0001.
do $owner$
begin
  if not exists (select 1 from pg_catalog.pg_roles where rolname = 'idempotency_owner') then
    begin
      create role idempotency_owner nologin noinherit;
    exception when duplicate_object or unique_violation then
      null;
    end;
  end if;
  -- Whoever runs the migrations must be able to act as the owner: to hand
  -- objects to it now (PostgreSQL 16 and later ask for SET), and to use
  -- its privileges when it replaces or revokes later (USAGE, that is,
  -- inherited). A superuser already can. On Supabase, postgres
  -- (CREATEROLE) grants it to itself; from PostgreSQL 16 its creator holds
  -- it with ADMIN only, without INHERIT or SET, so those are asked for.
  if not pg_catalog.pg_has_role(current_user, 'idempotency_owner', 'usage') then
    if current_setting('server_version_num')::integer >= 160000 then
      execute format('grant idempotency_owner to %I with inherit true, set true', current_user);
    else
      grant idempotency_owner to current_user;
    end if;
  end if;
end
$owner$;

grant usage, create on schema agent to idempotency_owner;

alter table agent.idempotency_keys owner to idempotency_owner;
alter table agent.idempotency_scopes owner to idempotency_owner;
alter table agent.runs owner to idempotency_owner;
alter table agent.provider_jobs owner to idempotency_owner;
alter type agent.idempotency_claim owner to idempotency_owner;
alter type agent.idempotency_claim_outcome owner to idempotency_owner;
alter type agent.run_admission owner to idempotency_owner;

-- The owner bypasses row level security on its own tables (RLS stays on,
-- with no policy). Nobody else holds anything on them.
revoke all on agent.idempotency_keys, agent.idempotency_scopes, agent.runs, agent.provider_jobs
  from public, anon, authenticated, service_role;

-- The claim table's columns as a relation an API role may name but not read
-- through. The bounded reads (idempotency_expired, idempotency_cap_probe)
-- answer rows of it. An RPC server then shapes and caps their answers like
-- a table's: postrust-server applies db-max-rows only to functions that
-- return rows of a relation the API's roles can see (PostgREST caps every
-- function). The view runs with its caller's privileges, and no API role
-- holds any on the table, so a read through it is refused (42501). The
-- bounded reads answer k.* of the table as rows of the view, so a column
-- added to the table must be added to the view in the same migration.
create view agent.idempotency_rows with (security_invoker = true) as
  select * from agent.idempotency_keys;
alter view agent.idempotency_rows owner to idempotency_owner;
revoke all on agent.idempotency_rows from public, anon, authenticated, service_role;
grant select on agent.idempotency_rows to service_role;

-- 2. Arguments -----------------------------------------------------------------

-- The checks below, and the table's own check of the request hash, test
-- lengths and search for a character outside the allowed set. They do not
-- match an anchored, bounded pattern: PostgreSQL's regular expressions
-- expand ^[0-9a-f]{64}$ into 64 states, and matching it cost about 12 µs on
-- every claim, against under 1 µs for the search.
alter table agent.idempotency_keys
  add constraint idempotency_keys_request_hash_hex
  check (octet_length(request_hash) = 64 and request_hash !~ '[^0-9a-f]') not valid;
alter table agent.idempotency_keys validate constraint idempotency_keys_request_hash_hex;
alter table agent.idempotency_keys drop constraint idempotency_keys_request_hash_sha256;

-- Raises 22023 naming the first of a key's arguments that is NULL or
-- malformed; returns when all three are well formed. The callers run their
-- own one-expression test first and call this only to build the refusal.
create function agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text)
returns void
language plpgsql immutable security invoker set search_path = ''
as $$
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
  if p_key is null then
    raise exception 'p_key is required' using errcode = '22023';
  end if;
  if char_length(p_key) not between 1 and 512 then
    raise exception 'p_key must be 1 to 512 characters, got %', char_length(p_key) using errcode = '22023';
  end if;
end
$$;

-- Every claim decision; see 0008 for what each path does and 0009 for its
-- lean first claim. New here: every argument is checked on the way in,
-- the request hash included. A malformed hash was refused before only by
-- the table's check, and only on the path that inserts.
create or replace function agent.idempotency_decide(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint,
  p_may_insert boolean,
  p_may_take_over boolean
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
         claimed_at, lease_expires_at, retain_until)
      select p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
             v_at, v_at + v_lease, v_at + v_lease + greatest(s.retain, v_retain)
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
           reclaims = k.reclaims + 1
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
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at))
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

-- v1: p_retain_ms is a required argument of both (it has no default), so
-- a NULL is refused like any other, by name.
create or replace function agent.idempotency_try_claim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
begin
  if p_retain_ms is null then
    raise exception 'p_retain_ms is required' using errcode = '22023';
  end if;
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, true, false) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

create or replace function agent.idempotency_reclaim(
  p_organization_id uuid,
  p_scope text,
  p_key text,
  p_request_hash text,
  p_lease_token uuid,
  p_lease_ms bigint,
  p_retain_ms bigint
) returns setof agent.idempotency_claim
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
begin
  if p_retain_ms is null then
    raise exception 'p_retain_ms is required' using errcode = '22023';
  end if;
  return query
    select d.id, d.organization_id, d.scope, d.key, d.request_hash, d.status, d.lease_token, d.resource_type,
           d.resource_id, d.response, d.claimed_at, d.lease_expires_at, d.retain_until, d.lease_live
      from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                    p_lease_ms, p_retain_ms, false, true) d
     where d.outcome in ('claimed', 'reclaimed');
end
$$;

-- Reads one claim; never writes. A scope with no policy is refused (IDEM1).
create or replace function agent.idempotency_get(
  p_organization_id uuid,
  p_scope text,
  p_key text
) returns setof agent.idempotency_claim
language plpgsql stable security definer set search_path = ''
as $$
begin
  if p_organization_id is null or p_scope is null
     or char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]'
     or p_key is null or char_length(p_key) not between 1 and 512 then
    perform agent.idempotency_check_key(p_organization_id, p_scope, p_key);
  end if;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1';
  end if;
  return query
    select c.*
      from agent.idempotency_keys k
     cross join lateral agent.idempotency_claim_of(k) c
     where k.organization_id = p_organization_id
       and k.scope = p_scope
       and k.key = p_key;
end
$$;

-- Completes a claim the caller still holds; see 0002 for the rules and 0009
-- for the answer it builds. New here: what a client could not read back is
-- refused before the row is locked. A response nested deeper than 64
-- levels gets IDEM3, one above its scope's max_response_bytes (as compact
-- JSON) gets IDEM2. Either way the claim stays processing.
create or replace function agent.idempotency_complete(
  p_claim_id uuid,
  p_lease_token uuid,
  p_resource_type text default null,
  p_resource_id text default null,
  p_response jsonb default null
) returns setof agent.idempotency_claim
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_resource_type text := nullif(p_resource_type, '');
  v_resource_id   text := nullif(p_resource_id, '');
  v_response      jsonb := nullif(p_response, 'null'::jsonb);
  r agent.idempotency_keys;
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

  if v_response is not null then
    -- PostgreSQL's text form of a jsonb is the compact form plus a space
    -- after every ',' and ':' between tokens. 65 nested containers take
    -- at least 130 bytes of it; no text shorter than the smallest limit a
    -- policy may set (1024) can be above one, and only a text longer than
    -- the scope's limit is measured exactly.
    v_size := octet_length(v_response::text);
    if v_size >= 130
       and jsonb_path_exists(v_response, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
      raise exception 'the response nests arrays and objects deeper than 64 levels, more than every client reads back'
        using errcode = 'IDEM3',
              hint = 'flatten the response, or store it elsewhere and complete with its resource';
    end if;
    if v_size > 1024 then
      select k.scope into v_scope from agent.idempotency_keys k where k.id = p_claim_id;
      if not found then
        -- No such claim: nothing to complete, as the fence below would say.
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
                                 pg_catalog.clock_timestamp() + (k.retain_until - k.lease_expires_at))
   where k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing'
  returning k.* into r;

  if not found then
    -- Completed already by this very token: an earlier attempt of this call.
    select k.* into r
      from agent.idempotency_keys k
     where k.id = p_claim_id
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

-- Deletes an unfinished claim the caller still holds; false when the fence
-- moved on. A completed claim is the journal and is never released.
create or replace function agent.idempotency_release(
  p_claim_id uuid,
  p_lease_token uuid
) returns boolean
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
begin
  if p_claim_id is null then
    raise exception 'p_claim_id is required' using errcode = '22023';
  end if;
  if p_lease_token is null then
    raise exception 'p_lease_token is required' using errcode = '22023';
  end if;
  delete from agent.idempotency_keys k
   where k.id = p_claim_id
     and k.lease_token = p_lease_token
     and k.status = 'processing';
  return found;
end
$$;

-- Deletes the given rows that are still past retention; answers how many.
create or replace function agent.idempotency_delete_expired(p_ids uuid[])
returns integer
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_deleted integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if cardinality(p_ids) > 100000 then
    raise exception 'p_ids holds % ids; at most 100000 per call', cardinality(p_ids)
      using errcode = '22023';
  end if;
  if array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', array_position(p_ids, null) using errcode = '22023';
  end if;
  delete from agent.idempotency_keys k
   where k.id = any (p_ids)
     and k.retain_until < now();
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$$;

-- Admits a Run once per (organization, start key); see 0007. New here:
-- each argument is checked by name, and an input no client could read back
-- (nested deeper than 64 levels: IDEM3; above 4 MiB as compact JSON:
-- IDEM2) is refused, because every replay answers it.
create or replace function agent.run_admit(
  p_organization_id uuid,
  p_start_key text,
  p_input jsonb,
  p_admission_token uuid default null
) returns setof agent.run_admission
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_size bigint;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_start_key is null or char_length(p_start_key) not between 1 and 512 then
    raise exception 'p_start_key must be 1 to 512 characters' using errcode = '22023';
  end if;
  if p_input is null or p_input = 'null'::jsonb then
    raise exception 'p_input is required' using errcode = '22023';
  end if;
  v_size := octet_length(p_input::text);
  if v_size >= 130
     and jsonb_path_exists(p_input, 'strict $.**{64} ? (@.type() == "array" || @.type() == "object")') then
    raise exception 'p_input nests arrays and objects deeper than 64 levels, more than every client reads back'
      using errcode = 'IDEM3';
  end if;
  if v_size > 4194304 and agent.idempotency_json_size(p_input) > 4194304 then
    raise exception 'p_input is above the 4194304 bytes of compact JSON a Run input may hold'
      using errcode = 'IDEM2';
  end if;

  return query
    insert into agent.runs as r (organization_id, start_key, input, admission_token)
    values (p_organization_id, p_start_key, p_input, p_admission_token)
    on conflict (organization_id, start_key) do nothing
    returning r.id, r.organization_id, r.start_key, r.input, r.status,
              r.admitted_at, r.retain_until, true;
  if found then
    return;
  end if;

  -- The conflicting insert has committed (ON CONFLICT waited for it), and
  -- this statement's fresh snapshot sees it.
  return query
    select r.id, r.organization_id, r.start_key, r.input, r.status,
           r.admitted_at, r.retain_until,
           coalesce(r.admission_token = p_admission_token, false)
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$$;

-- Records a job this platform started, once; see 0005.
create or replace function agent.provider_job_register(
  p_organization_id uuid,
  p_provider text,
  p_job_id text
) returns setof agent.provider_jobs
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  r agent.provider_jobs;
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_provider is null or char_length(p_provider) not between 1 and 64 or p_provider ~ '[^a-z0-9_-]' then
    raise exception 'p_provider must be 1 to 64 characters of a-z, 0-9, "_" and "-"' using errcode = '22023';
  end if;
  if p_job_id is null or char_length(p_job_id) not between 1 and 512 then
    raise exception 'p_job_id must be 1 to 512 characters' using errcode = '22023';
  end if;
  insert into agent.provider_jobs as j (organization_id, provider, job_id)
  values (p_organization_id, p_provider, p_job_id)
  on conflict (provider, job_id) do nothing
  returning j.* into r;
  if not found then
    select j.* into r from agent.provider_jobs j
     where j.provider = p_provider and j.job_id = p_job_id;
    if r.organization_id is distinct from p_organization_id then
      raise exception 'provider job %/% belongs to another organization', p_provider, p_job_id
        using errcode = '23505';
    end if;
  end if;
  return next r;
end
$$;

-- The job a callback path names: 0 or 1 row. Never writes.
create or replace function agent.provider_job_lookup(
  p_provider text,
  p_job_id text
) returns setof agent.provider_jobs
language plpgsql stable security definer set search_path = ''
as $$
begin
  if p_provider is null or char_length(p_provider) not between 1 and 64 or p_provider ~ '[^a-z0-9_-]' then
    raise exception 'p_provider must be 1 to 64 characters of a-z, 0-9, "_" and "-"' using errcode = '22023';
  end if;
  if p_job_id is null or char_length(p_job_id) not between 1 and 512 then
    raise exception 'p_job_id must be 1 to 512 characters' using errcode = '22023';
  end if;
  return query
    select j.* from agent.provider_jobs j
     where j.provider = p_provider and j.job_id = p_job_id;
end
$$;

-- The bounded reads answer rows of agent.idempotency_rows (see above); a new
-- result type is a new function, so they are made again, with their grants.
drop function agent.idempotency_expired(integer);
drop function agent.idempotency_cap_probe(integer);

-- The sweeper's bounded read: up to p_limit rows past retention, oldest
-- first; see 0002.
create function agent.idempotency_expired(p_limit integer)
returns setof agent.idempotency_rows
language plpgsql stable security definer set search_path = ''
as $$
begin
  if p_limit is null or p_limit < 1 or p_limit > 100000 then
    raise exception 'p_limit must be between 1 and 100000, got %', p_limit using errcode = '22023';
  end if;
  return query
    select k.*
      from agent.idempotency_keys k
     where k.retain_until < now()
     order by k.retain_until, k.id
     limit p_limit;
end
$$;

-- The row-cap probe for `idem doctor`: p_rows synthetic rows, nothing read
-- or written; see 0006.
create function agent.idempotency_cap_probe(p_rows integer)
returns setof agent.idempotency_rows
language plpgsql volatile security definer set search_path = ''
as $$
begin
  if p_rows is null or p_rows < 1 or p_rows > 100001 then
    raise exception 'p_rows must be between 1 and 100001, got %', p_rows using errcode = '22023';
  end if;
  return query
    select gen_random_uuid(), '00000000-0000-0000-0000-000000000000'::uuid, 'probe', 'probe-' || i,
           repeat('0', 64), 'processing', gen_random_uuid(), null::text, null::text, null::jsonb,
           now(), now(), now(), 0
      from generate_series(1, p_rows) as i;
end
$$;

revoke all on function agent.idempotency_expired(integer), agent.idempotency_cap_probe(integer)
  from public, anon, authenticated;
grant execute on function agent.idempotency_expired(integer), agent.idempotency_cap_probe(integer)
  to service_role;

-- 3. Owners and execution -------------------------------------------------------

-- The one-call claim runs as its owner too; its body is unchanged.
alter function agent.idempotency_claim(uuid, text, text, text, uuid, bigint) security definer;

-- Everything that touches the plane's tables belongs to the owner. The
-- internal helpers stay SECURITY INVOKER: only the owner may execute them,
-- so they always run as the owner already. idempotency_surface stays its
-- caller's: it reports what the caller may execute, and reads only the
-- catalog.
alter function agent.idempotency_claim(uuid, text, text, text, uuid, bigint) owner to idempotency_owner;
alter function agent.idempotency_try_claim(uuid, text, text, text, uuid, bigint, bigint) owner to idempotency_owner;
alter function agent.idempotency_reclaim(uuid, text, text, text, uuid, bigint, bigint) owner to idempotency_owner;
alter function agent.idempotency_get(uuid, text, text) owner to idempotency_owner;
alter function agent.idempotency_complete(uuid, uuid, text, text, jsonb) owner to idempotency_owner;
alter function agent.idempotency_release(uuid, uuid) owner to idempotency_owner;
alter function agent.idempotency_expired(integer) owner to idempotency_owner;
alter function agent.idempotency_delete_expired(uuid[]) owner to idempotency_owner;
alter function agent.idempotency_cap_probe(integer) owner to idempotency_owner;
alter function agent.run_admit(uuid, text, jsonb, uuid) owner to idempotency_owner;
alter function agent.provider_job_register(uuid, text, text) owner to idempotency_owner;
alter function agent.provider_job_lookup(text, text) owner to idempotency_owner;
alter function agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean)
  owner to idempotency_owner;
alter function agent.idempotency_policy(text) owner to idempotency_owner;
alter function agent.idempotency_claim_of(agent.idempotency_keys) owner to idempotency_owner;
alter function agent.idempotency_json_size(jsonb) owner to idempotency_owner;
alter function agent.idempotency_check_key(uuid, text, text) owner to idempotency_owner;

revoke all on function
  agent.idempotency_decide(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean),
  agent.idempotency_policy(text),
  agent.idempotency_claim_of(agent.idempotency_keys),
  agent.idempotency_json_size(jsonb),
  agent.idempotency_check_key(uuid, text, text)
from public, anon, authenticated, service_role;

-- 4. What a client can read -------------------------------------------------------

-- A policy above the new ceiling is lowered to it: a larger answer is one
-- that a client reading 8 MiB cannot read back.
update agent.idempotency_scopes set max_response_bytes = 4194304 where max_response_bytes > 4194304;
alter table agent.idempotency_scopes drop constraint idempotency_scopes_max_response_bytes_range;
alter table agent.idempotency_scopes add constraint idempotency_scopes_max_response_bytes_range
  check (max_response_bytes between 1024 and 4194304);

-- 5. Default privileges --------------------------------------------------------

-- Undoes 0007's revoke, which applied to the migrating role's functions in
-- every schema.
alter default privileges grant execute on functions to public;

-- Revokes EXECUTE from PUBLIC, anon and authenticated on every function,
-- procedure or aggregate just created in, or moved into, schema agent. It
-- runs as the role that ran the command: that role owns the new function,
-- or is a superuser, so it may revoke. A grant to service_role (or to
-- anyone else) is left as it is. Such a grant is always explicit.
create function agent.idempotency_private_functions()
returns event_trigger
language plpgsql security invoker set search_path = ''
as $$
declare
  v_routine regprocedure;
begin
  for v_routine in
    select c.objid
      from pg_catalog.pg_event_trigger_ddl_commands() c
     where c.classid = 'pg_catalog.pg_proc'::regclass
       and c.schema_name = 'agent'
  loop
    execute format('revoke execute on routine %s from public, anon, authenticated', v_routine);
  end loop;
end
$$;

revoke all on function agent.idempotency_private_functions() from public, anon, authenticated, service_role;

-- Creating an event trigger takes a superuser, or Supabase's postgres
-- (supautils). Elsewhere the migration goes on without it, and says so:
-- the missing USAGE on schema agent still keeps anon and authenticated out.
do $trigger$
begin
  create event trigger idempotency_private_functions on ddl_command_end
    when tag in ('CREATE FUNCTION', 'CREATE PROCEDURE', 'CREATE AGGREGATE',
                 'ALTER FUNCTION', 'ALTER PROCEDURE', 'ALTER ROUTINE', 'ALTER AGGREGATE')
    execute function agent.idempotency_private_functions();
exception when insufficient_privilege then
  raise warning 'idempotency plane: % may not create event triggers; functions created later in schema agent '
                'stay executable by PUBLIC until revoked (anon and authenticated still lack USAGE on the schema)',
                current_user;
end
$trigger$;
