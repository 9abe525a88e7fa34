-- Run admission. A Run's effect is a row we own, so its unique start key is
-- its claim: admission never touches agent.idempotency_keys.

create table agent.runs (
  id               uuid        primary key default gen_random_uuid(),
  organization_id  uuid        not null,
  start_key        text        not null,
  input            jsonb       not null,
  status           text        not null default 'admitted',
  admitted_at      timestamptz not null default now(),
  retain_until     timestamptz not null default now() + interval '396 days',
  constraint runs_org_start_key_key unique (organization_id, start_key),
  constraint runs_status_check
    check (status in ('admitted', 'running', 'succeeded', 'failed', 'cancelled')),
  constraint runs_start_key_length check (char_length(start_key) between 1 and 512)
);

comment on table agent.runs is
  'Admitted Runs. The unique (organization_id, start_key) is the Run claim; replays find the admitted Run.';

alter table agent.runs enable row level security;

create type agent.run_admission as (
  id              uuid,
  organization_id uuid,
  start_key       text,
  input           jsonb,
  status          text,
  admitted_at     timestamptz,
  retain_until    timestamptz,
  admitted        boolean
);

-- Admits a Run once per (organization, start key). Answers one row: the Run,
-- with admitted = true only for the call that inserted it. A replay answers
-- the Run already admitted, with the input it was admitted with.
create function agent.run_admit(
  p_organization_id uuid,
  p_start_key text,
  p_input jsonb
) returns setof agent.run_admission
language plpgsql volatile security invoker set search_path = ''
as $$
begin
  if p_organization_id is null or nullif(p_start_key, '') is null
     or p_input is null or p_input = 'null'::jsonb then
    raise exception 'p_organization_id, p_start_key and p_input are required'
      using errcode = '22023';
  end if;

  return query
    insert into agent.runs as r (organization_id, start_key, input)
    values (p_organization_id, p_start_key, p_input)
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
           r.admitted_at, r.retain_until, false
      from agent.runs r
     where r.organization_id = p_organization_id
       and r.start_key = p_start_key;
end
$$;
