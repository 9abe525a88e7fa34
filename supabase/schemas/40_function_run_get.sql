-- agent.run_get
--
-- Reads an admitted Run (public) without writing.

CREATE FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid DEFAULT NULL::uuid) RETURNS SETOF agent.run_admission
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
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

ALTER FUNCTION agent.run_get(p_organization_id uuid, p_start_key text, p_admission_token uuid) OWNER TO idempotency_owner;
