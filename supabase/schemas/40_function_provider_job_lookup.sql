-- agent.provider_job_lookup
--
-- Finds the organization of a provider's job (public), for a callback.

CREATE FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) RETURNS SETOF agent.provider_jobs
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
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

ALTER FUNCTION agent.provider_job_lookup(p_provider text, p_job_id text) OWNER TO idempotency_owner;
