-- agent.run_admit
--
-- Admits a Run once per (organization_id, start_key) (public); a repeat
-- answers the Run admitted first. Given p_claim_id and p_lease_token, it
-- admits only while that claim's lease is live and the token is its fence.

CREATE FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid DEFAULT NULL::uuid, p_claim_id uuid DEFAULT NULL::uuid, p_lease_token uuid DEFAULT NULL::uuid, p_max_run_duration_ms bigint DEFAULT NULL::bigint) RETURNS SETOF agent.run_admission
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
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
$_$;

ALTER FUNCTION agent.run_admit(p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, p_lease_token uuid, p_max_run_duration_ms bigint) OWNER TO idempotency_owner;
