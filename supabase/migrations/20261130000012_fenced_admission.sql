-- Fenced Run admission, and reading an admitted Run back.
--
-- A saved-search start freezes its input under a claim and stores the
-- snapshot as the claim's answer. A snapshot above the claim's response
-- limit cannot be stored there; its durable home is the Run's own input
-- (up to 4 MiB). So such a Run is admitted first, while the claim is still
-- held, and the claim then completes with a reference to the Run. Two
-- additions make that safe:
--
-- 1. agent.run_admit(..., p_claim_id, p_lease_token), both DEFAULT NULL (a
--    call without them works as before). Given, the Run is inserted only
--    while that claim is held by that token: processing, the same lease
--    token, its lease live by the database clock, and a claim of the same
--    organization. The check locks the claim row FOR SHARE until the
--    admission commits, so no reclaim or completion can slip between the
--    check and the insert. A claim not held so is refused with IDEM4
--    (HTTP 400), whether or not a Run exists under the key: a preparation
--    whose fence was lost starts no Run. Either argument without the other
--    is refused (22023), naming the one missing. The size and depth of the
--    input are still measured first, before any row is locked.
-- 2. agent.run_get(p_organization_id, p_start_key, p_admission_token?): the
--    Run admitted under a start key, 0 or 1 row; never writes. A replay of
--    a claim that references its Run reads the snapshot back with it;
--    `admitted` is true when p_admission_token is the token that admitted
--    the Run.

-- 1. Fenced admission -------------------------------------------------------

-- A new argument is a new signature: the old function goes, or PostgREST
-- would find two candidates for a call that names only the first four.
drop function agent.run_admit(uuid, text, jsonb, uuid);

-- Admits a Run once per (organization, start key); see 0007 and 0011. A
-- repeat carrying the admitting p_admission_token (an earlier attempt of
-- the same call, or of the same orchestrator step, whose answer was lost)
-- answers admitted = true; anyone else gets admitted = false and the input
-- the Run was admitted with. With p_claim_id and p_lease_token, only while
-- that claim is held by that token (IDEM4 otherwise).
create function agent.run_admit(
  p_organization_id uuid,
  p_start_key text,
  p_input jsonb,
  p_admission_token uuid default null,
  p_claim_id uuid default null,
  p_lease_token uuid default null
) returns setof agent.run_admission
language plpgsql volatile security definer
set search_path = '' set lock_timeout = '5s'
as $$
declare
  v_size bigint;
  v_held boolean;
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
  if p_claim_id is null and p_lease_token is not null then
    raise exception 'p_claim_id is required with p_lease_token: a fence names the claim and its token'
      using errcode = '22023';
  end if;
  if p_lease_token is null and p_claim_id is not null then
    raise exception 'p_lease_token is required with p_claim_id: a fence names the claim and its token'
      using errcode = '22023';
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

  if p_claim_id is not null then
    -- FOR SHARE: a reclaim or a completion of the claim (an UPDATE) waits
    -- until this admission commits or rolls back.
    select k.status = 'processing'
           and k.lease_token = p_lease_token
           and k.organization_id = p_organization_id
           and k.lease_expires_at > pg_catalog.clock_timestamp()
      into v_held
      from agent.idempotency_keys k
     where k.id = p_claim_id
       for share;
    if v_held is not true then
      raise exception 'claim % is not held by this lease token (completed, released, another organization''s, '
                      'or its lease passed); no Run admitted', p_claim_id
        using errcode = 'IDEM4',
              hint = 'the preparation lost its fence: start again, and the holder''s Run is answered';
    end if;
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

-- 2. Reading a Run back -----------------------------------------------------

-- The Run admitted under (organization, start key): 0 or 1 row. Never
-- writes. admitted is true when p_admission_token is the admitting token.
create function agent.run_get(
  p_organization_id uuid,
  p_start_key text,
  p_admission_token uuid default null
) returns setof agent.run_admission
language plpgsql stable security definer set search_path = ''
as $$
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_start_key is null or char_length(p_start_key) not between 1 and 512 then
    raise exception 'p_start_key must be 1 to 512 characters' using errcode = '22023';
  end if;
  return query
    select r.id, r.organization_id, r.start_key, r.input, r.status,
           r.admitted_at, r.retain_until,
           coalesce(r.admission_token = p_admission_token, false)
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$$;

-- 3. Owners and execution ---------------------------------------------------

alter function agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid) owner to idempotency_owner;
alter function agent.run_get(uuid, text, uuid) owner to idempotency_owner;

revoke all on function
  agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid),
  agent.run_get(uuid, text, uuid)
from public, anon, authenticated;
grant execute on function
  agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid),
  agent.run_get(uuid, text, uuid)
to service_role;
