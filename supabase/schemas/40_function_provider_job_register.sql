-- agent.provider_job_register
--
-- Records which organization started a provider's job (public), so its
-- callback finds the claim. A repeat by the same organization answers the
-- same row; another organization's is refused (23505).

CREATE FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) RETURNS SETOF agent.provider_jobs
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
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

ALTER FUNCTION agent.provider_job_register(p_organization_id uuid, p_provider text, p_job_id text) OWNER TO idempotency_owner;
