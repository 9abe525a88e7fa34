-- Asynchronous provider jobs. A provider callback names a job, never an
-- organization, and the idempotency key is scoped to one organization, so a
-- callback resolves its tenant here before it claims.

create table agent.provider_jobs (
  id               uuid        primary key default gen_random_uuid(),
  organization_id  uuid        not null,
  provider         text        not null,
  job_id           text        not null,
  created_at       timestamptz not null default now(),
  constraint provider_jobs_provider_job_id_key unique (provider, job_id),
  constraint provider_jobs_provider_shape check (provider ~ '^[a-z0-9_-]{1,64}$'),
  constraint provider_jobs_job_id_length check (char_length(job_id) between 1 and 512)
);

comment on table agent.provider_jobs is
  'Jobs started at providers that answer by callback; maps (provider, job_id) to its organization.';

alter table agent.provider_jobs enable row level security;

-- Records a job this platform started, once. A repeat answers the stored
-- row; the same job id under another organization raises 23505 (409).
create function agent.provider_job_register(
  p_organization_id uuid,
  p_provider text,
  p_job_id text
) returns setof agent.provider_jobs
language plpgsql volatile security invoker set search_path = ''
as $$
declare
  r agent.provider_jobs;
begin
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
create function agent.provider_job_lookup(
  p_provider text,
  p_job_id text
) returns setof agent.provider_jobs
language sql stable security invoker set search_path = ''
as $$
  select j.* from agent.provider_jobs j
   where j.provider = p_provider and j.job_id = p_job_id;
$$;

revoke all on agent.provider_jobs from public, anon, authenticated;
grant select, insert on agent.provider_jobs to service_role;
revoke all on function
  agent.provider_job_register(uuid, text, text),
  agent.provider_job_lookup(text, text)
from public, anon, authenticated;
grant execute on function
  agent.provider_job_register(uuid, text, text),
  agent.provider_job_lookup(text, text)
to service_role;
