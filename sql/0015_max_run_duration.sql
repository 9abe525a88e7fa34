-- A Run's max_run_duration, capped at 30 days.
--
-- A tool claim is the replay journal of the Run that made it, so it must be
-- remembered for at least the longest max_run_duration any definition may
-- set: a Run can wait on an approval for days. Retention is per scope, so
-- every tool scope keeps 30 days (the tool.* check on
-- agent.idempotency_scopes), and that holds only while no Run may run
-- longer. The cap is a rule, enforced where a duration is accepted:
--
-- 1. agent.runs.max_run_duration (interval, NULL when the definition sets
--    none), checked above zero and at most 30 days by the table itself,
--    whoever writes the row.
-- 2. agent.run_admit(..., p_max_run_duration_ms bigint DEFAULT NULL): the
--    Run's max_run_duration, refused with 22023 (HTTP 400), naming the cap,
--    when it is zero, negative or above 30 days (2592000000 ms); nothing is
--    written. A call without it admits as before. An existing Run answers
--    as it was admitted (the first admission's duration stands).
--
-- A new argument is a new signature: the old function is dropped (a second
-- overload would make PostgREST's choice by argument names ambiguous) and
-- made again, owned, private and granted as in 0012.

alter table agent.runs add column max_run_duration interval;
alter table agent.runs add constraint runs_max_run_duration_cap
  check (max_run_duration is null
         or (max_run_duration > interval '0' and max_run_duration <= interval '30 days'));

comment on column agent.runs.max_run_duration is
  'The longest this Run may take, set by its definition: above zero, at most 30 days (every tool claim is kept 30 days, so a Run''s replay journal outlives it).';

drop function agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid);

-- Admits a Run once per (organization, start key); see 0007, 0011 and 0012.
create function agent.run_admit(
  p_organization_id uuid,
  p_start_key text,
  p_input jsonb,
  p_admission_token uuid default null,
  p_claim_id uuid default null,
  p_lease_token uuid default null,
  p_max_run_duration_ms bigint default null
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
  if p_max_run_duration_ms is not null
     and (p_max_run_duration_ms <= 0 or p_max_run_duration_ms > 2592000000) then
    raise exception 'p_max_run_duration_ms must be above zero and at most 2592000000 (30 days, the tool retention); got %',
      p_max_run_duration_ms
      using errcode = '22023';
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
    insert into agent.runs as r (organization_id, start_key, input, admission_token, max_run_duration)
    values (p_organization_id, p_start_key, p_input, p_admission_token,
            p_max_run_duration_ms * interval '1 millisecond')
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

alter function agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid, bigint) owner to idempotency_owner;

revoke all on function agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid, bigint) from public, anon, authenticated;
grant execute on function agent.run_admit(uuid, text, jsonb, uuid, uuid, uuid, bigint) to service_role;
