-- An optional layout: agent.idempotency_keys hash-partitioned by
-- organization_id. Apply it after the migrations (supabase/migrations/),
-- in one transaction that stops at the first error:
-- `psql -v ON_ERROR_STOP=1 -1 -f`, or as a Supabase migration (copy it
-- into supabase/migrations/ with a timestamp after the last one there; the
-- CLI applies each file in a transaction). Never with a plain `psql -f`:
-- its first statement would fail outside a transaction, psql would go on,
-- and each later statement would commit on its own with no lock, so claims
-- written between the copy and the swap would be lost. It moves the rows
-- the table already holds under an ACCESS EXCLUSIVE lock, so that no claim written meanwhile
-- is left behind; on a large table, apply it in a quiet hour.
--
-- Why it is possible: every key starts with organization_id, so
-- unique (organization_id, scope, key) holds within each partition, and a
-- claim (the hot path) touches exactly one partition.
--
-- What it changes, and nothing else:
--
-- 1. The primary key is (id, organization_id). A partitioned table's keys
--    must include its partition key. id still leads, so a caller that
--    names a claim by id alone (an old completion or release, the sweeper's
--    delete by ids) is answered from each partition's primary key index,
--    one probe per partition; one that names the organization too (the
--    Rust crate and the TypeScript client do) touches one
--    partition.
-- 2. 16 partitions (modulus 16). The count is fixed when the layout is
--    applied; changing it later means moving every row again. 16 keeps each
--    partition's indexes small up to a few hundred million claims; see
--    docs/scaling.md for the sizing rule.
-- 3. Each partition keeps the table's settings: fillfactor 80, row level
--    security on with no policy, owned by idempotency_owner, and no
--    privilege for any API role. A partition is a table of its own, so each
--    is closed as the parent is: nobody but the owner can read or write one
--    directly, and the functions remain the only way in.
--
-- The columns, their defaults and every check constraint are copied from
-- the table as the migrations left it (LIKE ... INCLUDING ALL), so the
-- functions, the view agent.idempotency_rows and every rule work
-- unchanged. The sweeper's bound still holds per pass: its read takes the
-- oldest expired rows across all partitions at once (a merge of each
-- partition's retain_until index, reading at most the bound from each).

lock table agent.idempotency_keys in access exclusive mode;

create table agent.idempotency_keys_partitioned
  (like agent.idempotency_keys including all excluding indexes)
  partition by hash (organization_id);

create table agent.idempotency_keys_p00 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 0) with (fillfactor = 80);
create table agent.idempotency_keys_p01 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 1) with (fillfactor = 80);
create table agent.idempotency_keys_p02 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 2) with (fillfactor = 80);
create table agent.idempotency_keys_p03 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 3) with (fillfactor = 80);
create table agent.idempotency_keys_p04 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 4) with (fillfactor = 80);
create table agent.idempotency_keys_p05 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 5) with (fillfactor = 80);
create table agent.idempotency_keys_p06 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 6) with (fillfactor = 80);
create table agent.idempotency_keys_p07 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 7) with (fillfactor = 80);
create table agent.idempotency_keys_p08 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 8) with (fillfactor = 80);
create table agent.idempotency_keys_p09 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 9) with (fillfactor = 80);
create table agent.idempotency_keys_p10 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 10) with (fillfactor = 80);
create table agent.idempotency_keys_p11 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 11) with (fillfactor = 80);
create table agent.idempotency_keys_p12 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 12) with (fillfactor = 80);
create table agent.idempotency_keys_p13 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 13) with (fillfactor = 80);
create table agent.idempotency_keys_p14 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 14) with (fillfactor = 80);
create table agent.idempotency_keys_p15 partition of agent.idempotency_keys_partitioned
  for values with (modulus 16, remainder 15) with (fillfactor = 80);

insert into agent.idempotency_keys_partitioned select * from agent.idempotency_keys;

-- What depends on the old table's row type moves to the new one: the views
-- the bounded reads and the re-drive answer (same columns, so each is
-- replaced in place, as the declared schema defines it), and the helper that turns a row
-- into a claim (its argument is the row type, so it is dropped here and
-- made again below). Every other function names the table only in its
-- body, which PostgreSQL resolves when it runs.
create or replace view agent.idempotency_rows with (security_invoker = true) as
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, k.lease_token,
         k.resource_type, k.resource_id, k.response, k.claimed_at, k.lease_expires_at,
         k.retain_until, k.reclaims
    from agent.idempotency_keys_partitioned k;
create or replace view agent.idempotency_work with (security_invoker = true) as
  select k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status, k.lease_token,
         k.request, k.reclaims + 1 as attempt, k.claimed_at, k.lease_expires_at, k.retain_until,
         k.response, null::integer as taken, k.traceparent
    from agent.idempotency_keys_partitioned k;
drop function agent.idempotency_claim_of(agent.idempotency_keys);
drop table agent.idempotency_keys;
alter table agent.idempotency_keys_partitioned rename to idempotency_keys;

-- The keys and the sweeper's index, under the names the single table used.
alter table agent.idempotency_keys
  add constraint idempotency_keys_pkey primary key (id, organization_id),
  add constraint idempotency_keys_org_scope_key_key unique (organization_id, scope, key);
create index idempotency_keys_retain_until_idx on agent.idempotency_keys (retain_until, id);
create index idempotency_keys_redrive_idx on agent.idempotency_keys (scope, redrive_at)
  where redrive_at is not null;

comment on table agent.idempotency_keys is
  'Idempotency claims and the replay journal, hash-partitioned by organization_id. '
  'Written only through the agent.idempotency_* functions.';

-- Owner, row level security and privileges, on the parent and on every
-- partition.
alter table agent.idempotency_keys owner to idempotency_owner;
alter table agent.idempotency_keys enable row level security;
revoke all on agent.idempotency_keys from public, anon, authenticated, service_role;
alter table agent.idempotency_keys_p00 owner to idempotency_owner;
alter table agent.idempotency_keys_p01 owner to idempotency_owner;
alter table agent.idempotency_keys_p02 owner to idempotency_owner;
alter table agent.idempotency_keys_p03 owner to idempotency_owner;
alter table agent.idempotency_keys_p04 owner to idempotency_owner;
alter table agent.idempotency_keys_p05 owner to idempotency_owner;
alter table agent.idempotency_keys_p06 owner to idempotency_owner;
alter table agent.idempotency_keys_p07 owner to idempotency_owner;
alter table agent.idempotency_keys_p08 owner to idempotency_owner;
alter table agent.idempotency_keys_p09 owner to idempotency_owner;
alter table agent.idempotency_keys_p10 owner to idempotency_owner;
alter table agent.idempotency_keys_p11 owner to idempotency_owner;
alter table agent.idempotency_keys_p12 owner to idempotency_owner;
alter table agent.idempotency_keys_p13 owner to idempotency_owner;
alter table agent.idempotency_keys_p14 owner to idempotency_owner;
alter table agent.idempotency_keys_p15 owner to idempotency_owner;
alter table agent.idempotency_keys_p00 enable row level security;
alter table agent.idempotency_keys_p01 enable row level security;
alter table agent.idempotency_keys_p02 enable row level security;
alter table agent.idempotency_keys_p03 enable row level security;
alter table agent.idempotency_keys_p04 enable row level security;
alter table agent.idempotency_keys_p05 enable row level security;
alter table agent.idempotency_keys_p06 enable row level security;
alter table agent.idempotency_keys_p07 enable row level security;
alter table agent.idempotency_keys_p08 enable row level security;
alter table agent.idempotency_keys_p09 enable row level security;
alter table agent.idempotency_keys_p10 enable row level security;
alter table agent.idempotency_keys_p11 enable row level security;
alter table agent.idempotency_keys_p12 enable row level security;
alter table agent.idempotency_keys_p13 enable row level security;
alter table agent.idempotency_keys_p14 enable row level security;
alter table agent.idempotency_keys_p15 enable row level security;
revoke all on
  agent.idempotency_keys_p00, agent.idempotency_keys_p01, agent.idempotency_keys_p02, agent.idempotency_keys_p03,
  agent.idempotency_keys_p04, agent.idempotency_keys_p05, agent.idempotency_keys_p06, agent.idempotency_keys_p07,
  agent.idempotency_keys_p08, agent.idempotency_keys_p09, agent.idempotency_keys_p10, agent.idempotency_keys_p11,
  agent.idempotency_keys_p12, agent.idempotency_keys_p13, agent.idempotency_keys_p14, agent.idempotency_keys_p15
from public, anon, authenticated, service_role;

-- The row-to-claim helper, on the new row type, exactly as the declared
-- schema defines it; private to its owner, as there.
create function agent.idempotency_claim_of(k agent.idempotency_keys)
returns agent.idempotency_claim
language plpgsql volatile security invoker set search_path = ''
as $$
begin
  return (k.id, k.organization_id, k.scope, k.key, k.request_hash, k.status,
          k.lease_token, k.resource_type, k.resource_id, k.response, k.claimed_at,
          k.lease_expires_at, k.retain_until,
          k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp())::agent.idempotency_claim;
end
$$;
alter function agent.idempotency_claim_of(agent.idempotency_keys) owner to idempotency_owner;
revoke all on function agent.idempotency_claim_of(agent.idempotency_keys)
  from public, anon, authenticated, service_role;
