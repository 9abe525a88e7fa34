-- traces_and_console
--
-- Drafted by scripts/draft-migration.sh from supabase/schemas/, after v0.1.
-- Why the plane changes:
--
-- - Traces across the hop: a claim keeps the W3C traceparent of the worker
--   that first made it (agent.idempotency_keys.traceparent, refused 22023
--   when malformed), so whoever runs its work again (a re-drive, a queue
--   redelivery, a send-back after a fix) links its span to that trace.
--   idempotency_claim and idempotency_queue_take take p_traceparent (a new
--   signature: dropped and made again, their grants restated), batch items
--   a traceparent; the claim, batch, queue, re-drive and failure rows answer
--   it (a new last attribute of their types, and of idempotency_work).
-- - Replays counted for the console's plot: agent.idempotency_replays,
--   UNLOGGED, one row per minute, scope and backend, trimmed to 7 days by
--   every sweep pass.
-- - idem console's bounded reads (idempotency_in_flight, _processing,
--   _failure_counts, _sweep_backlog, _activity) and its compare-and-set
--   action, idempotency_abandon (abandoned_by_operator), service_role only.
--
-- A claim with p_traceparent is refused by a plane without this migration
-- (an unknown argument): migrate before turning a client's tracing on.

SET local check_function_bodies = off;

DROP FUNCTION "agent"."idempotency_claim"(uuid, text, text, text, uuid, bigint, jsonb);

DROP FUNCTION "agent"."idempotency_decide"(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean, jsonb);

DROP FUNCTION "agent"."idempotency_queue_take"(text, text, uuid, bigint, uuid[], integer, text, uuid[], integer);

DROP FUNCTION "agent"."idempotency_redrive"(text, uuid[], bigint, uuid, integer, bigint);

DROP VIEW "agent"."idempotency_work";

CREATE UNLOGGED TABLE "agent"."idempotency_replays" (
  "minute"  timestamp with time zone NOT NULL,
  "scope"   text                     NOT NULL,
  "backend" integer                  NOT NULL,
  "replays" bigint                   NOT NULL DEFAULT 0,
  CONSTRAINT "idempotency_replays_pkey" PRIMARY KEY (minute, scope, backend),
  CONSTRAINT "idempotency_replays_replays_positive" CHECK ((replays >= 0))
);

ALTER TABLE "agent"."idempotency_replays"
  ENABLE ROW LEVEL SECURITY;

ALTER TABLE "agent"."idempotency_replays"
  OWNER TO "idempotency_owner";

ALTER TABLE "agent"."idempotency_keys"
  ADD COLUMN "traceparent" text;

CREATE TYPE "agent"."idempotency_activity_bucket" AS (
  "bucket"   timestamp WITH time zone,
  "claims"   bigint,
  "replays"  bigint,
  "failures" bigint
);

ALTER TYPE "agent"."idempotency_activity_bucket" OWNER TO "idempotency_owner";

CREATE TYPE "agent"."idempotency_failure_count" AS (
  "scope"             text,
  "failures"          bigint,
  "redrivable"        bigint,
  "dead_lettered"     bigint,
  "oldest_claimed_at" timestamp WITH time zone
);

ALTER TYPE "agent"."idempotency_failure_count" OWNER TO "idempotency_owner";

CREATE TYPE "agent"."idempotency_in_flight_scope" AS (
  "scope"                   text,
  "processing"              bigint,
  "live"                    bigint,
  "orphans"                 bigint,
  "oldest_claimed_at"       timestamp WITH time zone,
  "oldest_lease_expires_at" timestamp WITH time zone
);

ALTER TYPE "agent"."idempotency_in_flight_scope" OWNER TO "idempotency_owner";

CREATE TYPE "agent"."idempotency_processing_claim" AS (
  "id"               uuid,
  "organization_id"  uuid,
  "scope"            text,
  "key"              text,
  "claimed_at"       timestamp WITH time zone,
  "lease_expires_at" timestamp WITH time zone,
  "lease_live"       boolean,
  "attempt"          integer,
  "carries_work"     boolean,
  "version"          text
);

ALTER TYPE "agent"."idempotency_processing_claim" OWNER TO "idempotency_owner";

CREATE TYPE "agent"."idempotency_sweep_backlog_day" AS (
  "retain_date" date,
  "rows"        bigint
);

ALTER TYPE "agent"."idempotency_sweep_backlog_day" OWNER TO "idempotency_owner";

ALTER TYPE "agent"."idempotency_claim_item" ADD ATTRIBUTE "traceparent" text CASCADE;

ALTER TYPE "agent"."idempotency_claim_outcome" ADD ATTRIBUTE "traceparent" text CASCADE;

ALTER TYPE "agent"."idempotency_failure" ADD ATTRIBUTE "traceparent" text CASCADE;

ALTER TYPE "agent"."idempotency_queue_item" ADD ATTRIBUTE "traceparent" text CASCADE;

CREATE OR REPLACE FUNCTION agent.idempotency_abandon (
  p_id      uuid,
  p_version text
)
  RETURNS SETOF agent.idempotency_failure
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  if p_id is null then
    raise exception 'p_id is required: the claim agent.idempotency_processing showed' using errcode = '22023';
  end if;
  if p_version is null or p_version !~ '^[0-9a-f]{64}$' then
    raise exception 'p_version must be the 64 hex digits agent.idempotency_processing showed, got %',
                    pg_catalog.left(p_version, 80)
      using errcode = '22023';
  end if;
  return query
    with ended as (
      update agent.idempotency_keys as k
         set status = 'completed',
             response = pg_catalog.jsonb_build_object(
                          'ok', false, 'error', 'abandoned_by_operator',
                          'output', pg_catalog.jsonb_build_object(
                                      'attempts', k.reclaims + 1,
                                      'claimed_at', k.claimed_at,
                                      'lease_expires_at', k.lease_expires_at)),
             resource_type = null,
             resource_id = null,
             lease_token = pg_catalog.gen_random_uuid(),
             lease_expires_at = least(k.lease_expires_at, v_at),
             retain_until = greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at)),
             redrive_at = null
       where k.id = p_id
         and k.status = 'processing'
         and agent.idempotency_version(k.lease_token, k.lease_expires_at, k.reclaims) = p_version
      returning k.*
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(pg_catalog.jsonb_array_length(f.replaced), 0), 1,
           coalesce((f.replaced -> 0 ->> 'claimed_at')::timestamptz, f.claimed_at), f.traceparent
      from ended f;
end
$function$;

ALTER FUNCTION "agent"."idempotency_abandon"(uuid, text) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_activity (
  p_since    timestamp with time zone,
  p_bucket_s integer,
  p_limit    integer
)
  RETURNS SETOF agent.idempotency_activity_bucket
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
  v_start timestamptz;
  v_buckets bigint;
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % buckets, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  if p_bucket_s is null or p_bucket_s not between 60 and 86400 or p_bucket_s % 60 <> 0 then
    raise exception 'p_bucket_s must be whole minutes, 60 to 86400 seconds, got %', p_bucket_s using errcode = '22023';
  end if;
  if p_since is null or not pg_catalog.isfinite(p_since) or p_since >= v_at then
    raise exception 'p_since must be a time in the past, got %', p_since using errcode = '22023';
  end if;
  v_start := pg_catalog.date_trunc('minute', p_since);
  v_buckets := pg_catalog.ceil(extract(epoch from v_at - v_start) / p_bucket_s)::bigint;
  if v_buckets > p_limit then
    raise exception 'from % to now is % buckets of % s, more than p_limit %', v_start, v_buckets, p_bucket_s, p_limit
      using errcode = '22023',
            hint = 'start later, or take longer buckets';
  end if;
  return query
    with buckets as (
      select n, v_start + n * p_bucket_s * interval '1 second' as bucket
        from pg_catalog.generate_series(0::bigint, v_buckets - 1) n
    ), claims as (
      select pg_catalog.floor(extract(epoch from k.claimed_at - v_start) / p_bucket_s)::bigint as n,
             pg_catalog.count(*) as claims,
             pg_catalog.count(*) filter (where k.status = 'completed' and k.response -> 'ok' = 'false'::jsonb)
               as failures
        from agent.idempotency_keys k
       where k.claimed_at >= v_start
       group by 1
    ), replays as (
      select pg_catalog.floor(extract(epoch from r.minute - v_start) / p_bucket_s)::bigint as n,
             pg_catalog.sum(r.replays)::bigint as replays
        from agent.idempotency_replays r
       where r.minute >= v_start
       group by 1
    )
    select b.bucket, coalesce(c.claims, 0), coalesce(r.replays, 0), coalesce(c.failures, 0)
      from buckets b
      left join claims c on c.n = b.n
      left join replays r on r.n = b.n
     order by b.bucket;
end
$function$;

ALTER FUNCTION "agent"."idempotency_activity"(timestamp WITH time zone, integer, integer) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_check_traceparent (
  p_traceparent text,
  p_name        text
)
  RETURNS text
  LANGUAGE plpgsql
  IMMUTABLE
  SET search_path TO ''
  AS $function$
begin
  if p_traceparent is null or p_traceparent = '' then
    return null;
  end if;
  if p_traceparent !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
     or substr(p_traceparent, 4, 32) = '00000000000000000000000000000000'
     or substr(p_traceparent, 37, 16) = '0000000000000000' then
    raise exception '% must be a W3C traceparent of version 00 (00-<32 hex>-<16 hex>-<2 hex>, lowercase, ids not all zeros), got %',
                    p_name, pg_catalog.left(p_traceparent, 80)
      using errcode = '22023';
  end if;
  return p_traceparent;
end
$function$;

ALTER FUNCTION "agent"."idempotency_check_traceparent"(text, text) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_claim (
  p_organization_id uuid,
  p_scope           text,
  p_key             text,
  p_request_hash    text,
  p_lease_token     uuid,
  p_lease_ms        bigint,
  p_request         jsonb  DEFAULT NULL::jsonb,
  p_traceparent     text   DEFAULT NULL::text
)
  RETURNS SETOF agent.idempotency_claim_outcome
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
begin
  return query
    select * from agent.idempotency_decide(p_organization_id, p_scope, p_key, p_request_hash, p_lease_token,
                                           p_lease_ms, null, true, true, p_request, p_traceparent);
end
$function$;

ALTER FUNCTION "agent"."idempotency_claim"(uuid, text, text, text, uuid, bigint, jsonb, text) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_claim_many (
  p_organization_id uuid,
  p_scope           text,
  p_lease_ms        bigint,
  p_items           jsonb,
  p_row_cap         integer DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_claim_item
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_keys text[];
  v_hashes text[];
  v_tokens uuid[];
  v_requests jsonb[];
  v_traceparents text[];
  v_item jsonb;
  v_index integer;
  v_text text;
  v_earlier integer;
  v_state text;
  v_message text;
  v_hint text;
  v_retain interval;
  v_lease interval := p_lease_ms * interval '1 millisecond';
  v_at timestamptz;
  v_firsts boolean[];
  v_rows agent.idempotency_keys[];
  v_answered integer;
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
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  perform agent.idempotency_check_batch(p_items, p_row_cap);
  select p.retain into v_retain from agent.idempotency_policy(p_scope) p;
  if v_retain is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. tool.*) to agent.idempotency_scopes in a migration';
  end if;
  v_retain := greatest(v_retain, v_lease);

  -- Every item is checked before anything is written, in one pass over
  -- the array; the first bad item, if any, is checked again on its own to
  -- say what is wrong with it.
  select (e.ordinality - 1)::integer, e.value into v_index, v_item
    from pg_catalog.jsonb_array_elements(p_items) with ordinality e
   where not coalesce(pg_catalog.jsonb_typeof(e.value) = 'object'
                      and pg_catalog.jsonb_typeof(e.value -> 'key') = 'string'
                      and char_length(e.value ->> 'key') between 1 and 512
                      and pg_catalog.jsonb_typeof(e.value -> 'request_hash') = 'string'
                      and (e.value ->> 'request_hash') ~ '^[0-9a-f]{64}$'
                      and pg_catalog.jsonb_typeof(e.value -> 'lease_token') = 'string'
                      and (e.value ->> 'lease_token')
                          ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'
                      and (coalesce(pg_catalog.jsonb_typeof(e.value -> 'traceparent'), 'null') = 'null'
                           or e.value ->> 'traceparent' = ''
                           or ((e.value ->> 'traceparent') ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
                               and substr(e.value ->> 'traceparent', 4, 32) <> '00000000000000000000000000000000'
                               and substr(e.value ->> 'traceparent', 37, 16) <> '0000000000000000')),
                      false)
   order by e.ordinality
   limit 1;
  if found then
    perform agent.idempotency_check_item(v_item, v_index);
    v_text := agent.idempotency_item_text(v_item, v_index, 'key', true);
    if char_length(v_text) not between 1 and 512 then
      raise exception 'p_items[%].key must be 1 to 512 characters, got %', v_index, char_length(v_text)
        using errcode = '22023';
    end if;
    v_text := agent.idempotency_item_text(v_item, v_index, 'request_hash', true);
    if octet_length(v_text) <> 64 or v_text ~ '[^0-9a-f]' then
      raise exception 'p_items[%].request_hash must be 64 lowercase hex digits (a SHA-256), got %',
                      v_index, pg_catalog.left(v_text, 80)
        using errcode = '22023';
    end if;
    perform agent.idempotency_item_uuid(v_item, v_index, 'lease_token');
    perform agent.idempotency_check_traceparent(agent.idempotency_item_text(v_item, v_index, 'traceparent', false),
                                                'p_items[' || v_index || '].traceparent');
    raise exception 'p_items[%] is malformed', v_index using errcode = '22023';
  end if;
  -- The items' fields, and whether each is its key's first occurrence.
  select pg_catalog.array_agg(t.key order by t.n), pg_catalog.array_agg(t.hash order by t.n),
         pg_catalog.array_agg(t.token order by t.n), pg_catalog.array_agg(t.request order by t.n),
         pg_catalog.array_agg(t.first order by t.n), pg_catalog.array_agg(t.traceparent order by t.n)
    into v_keys, v_hashes, v_tokens, v_requests, v_firsts, v_traceparents
    from (select e.ordinality as n, e.value ->> 'key' as key, e.value ->> 'request_hash' as hash,
                 (e.value ->> 'lease_token')::uuid as token, nullif(e.value -> 'request', 'null'::jsonb) as request,
                 nullif(e.value ->> 'traceparent', '') as traceparent,
                 pg_catalog.row_number() over (partition by e.value ->> 'key' order by e.ordinality) = 1 as first
            from pg_catalog.jsonb_array_elements(p_items) with ordinality e) t;
  -- The first item whose token an earlier item named, and that item.
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by v_tokens[i]) as first
            from pg_catalog.generate_subscripts(v_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_items[%].lease_token repeats p_items[%].lease_token: each item needs a token of its own',
                    v_index, v_earlier
      using errcode = '22023',
            hint = 'a claim repeated with its token answers claimed again; mint a fresh token per item';
  end if;
  -- The work each key's first occurrence stores, measured as a single
  -- claim's is; later occurrences store nothing.
  if pg_catalog.array_length(pg_catalog.array_remove(v_requests, null), 1) is not null then
    begin
      for i in 1 .. pg_catalog.cardinality(v_keys) loop
        v_index := i - 1;
        if v_firsts[i] and v_requests[i] is not null then
          perform agent.idempotency_check_work(p_scope, v_requests[i]);
        end if;
      end loop;
    exception when others then
      get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
      raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
    end;
  end if;

  -- Each key is decided once, by its first occurrence, in one statement
  -- that visits the keys in key order: a free key is inserted; a taken one
  -- is locked, and taken over when its lease has passed and the request is
  -- the same (the row's work kept, or this item's stored). Every row the
  -- batch touches is locked in (organization, scope, key) order, as every
  -- batch of the plane locks them, so batches over the same keys wait for
  -- each other in one order and never deadlock; and no other transaction
  -- can change a row between this decision and the answer read below.
  v_at := pg_catalog.clock_timestamp();
  with firsts as (
    select v_keys[i] as key, v_hashes[i] as hash, v_tokens[i] as token, v_requests[i] as request,
           v_traceparents[i] as traceparent
      from pg_catalog.generate_subscripts(v_keys, 1) i
     where v_firsts[i]
  ), decided as (
    insert into agent.idempotency_keys as k
      (organization_id, scope, key, request_hash, status, lease_token,
       claimed_at, lease_expires_at, retain_until, request, redrive_at, traceparent)
    select p_organization_id, p_scope, f.key, f.hash, 'processing', f.token,
           v_at, v_at + v_lease, v_at + v_lease + v_retain,
           f.request, case when f.request is not null then v_at + v_lease end, f.traceparent
      from firsts f
     order by f.key
    on conflict (organization_id, scope, key) do update
       set lease_token = excluded.lease_token,
           claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + v_retain),
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, excluded.request),
           redrive_at = case when coalesce(k.request, excluded.request) is not null then v_at + v_lease end,
           traceparent = coalesce(k.traceparent, excluded.traceparent)
     where k.status = 'processing'
       and k.request_hash = excluded.request_hash
       and k.lease_expires_at <= pg_catalog.clock_timestamp()
    returning k.*
  )
  select pg_catalog.array_agg(row(decided.*)::agent.idempotency_keys) into v_rows from decided;

  -- The leases won are timed from the end of the batch, when the answer
  -- is made: time spent waiting on other transactions' rows is not taken
  -- out of them. The retention, counted from the lease's end, moves with it.
  if v_rows is not null and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    with moved as (
      update agent.idempotency_keys as k
         set claimed_at = v_at,
             lease_expires_at = v_at + v_lease,
             retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
             redrive_at = case when k.redrive_at is not null then v_at + v_lease end
        from pg_catalog.unnest(v_rows) w
       where k.organization_id = p_organization_id and k.id = w.id
      returning k.*
    )
    select pg_catalog.array_agg(row(moved.*)::agent.idempotency_keys) into v_rows from moved;
  end if;
  -- The rows of the keys the batch did not win, which it holds all the same.
  if coalesce(pg_catalog.cardinality(v_rows), 0) < pg_catalog.cardinality(v_keys) then
    select coalesce(v_rows, '{}') || coalesce(pg_catalog.array_agg(k), '{}') into v_rows
      from agent.idempotency_keys k
     where k.organization_id = p_organization_id and k.scope = p_scope
       and k.key = any (v_keys)
       and k.id <> all (select w.id from pg_catalog.unnest(coalesce(v_rows, '{}')) w);
  end if;

  -- Every item answered from its key's row: the first occurrence what it
  -- decided, a later one what a single claim would answer it now (the key
  -- is its batch's first occurrence's, so never claimed a second time).
  return query
    select (i - 1)::integer, o.outcome, k.id, k.organization_id, k.scope, k.key,
           case when o.outcome = 'conflict' then null else k.request_hash end,
           k.status,
           case when o.outcome in ('claimed', 'reclaimed') then k.lease_token end,
           case when o.outcome = 'completed' then k.resource_type end,
           case when o.outcome = 'completed' then k.resource_id end,
           case when o.outcome = 'completed' then k.response end,
           k.claimed_at, k.lease_expires_at, k.retain_until,
           k.status = 'processing' and k.lease_expires_at > pg_catalog.clock_timestamp(),
           case when o.outcome in ('claimed', 'reclaimed') then k.traceparent end
      from pg_catalog.generate_subscripts(v_keys, 1) i
      join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
     cross join lateral (
       select case when k.request_hash <> v_hashes[i] then 'conflict'
                   when k.status = 'completed' then 'completed'
                   when k.lease_token <> v_tokens[i] then 'processing'
                   when k.reclaims > 0 then 'reclaimed'
                   else 'claimed' end as outcome
     ) o
     order by i;
  get diagnostics v_answered = row_count;
  if v_answered <> pg_catalog.cardinality(v_keys) then
    raise exception 'claim_many answered % of % items', v_answered, pg_catalog.cardinality(v_keys)
      using errcode = 'XX000';
  end if;
  -- Items answered from the journal, counted as replays.
  select pg_catalog.count(*) into v_answered
    from pg_catalog.generate_subscripts(v_keys, 1) i
    join pg_catalog.unnest(v_rows) k on k.key = v_keys[i]
   where k.status = 'completed' and k.request_hash = v_hashes[i];
  if v_answered > 0 then
    perform agent.idempotency_count_replays(p_scope, v_answered);
  end if;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_count_replays (
  p_scope   text,
  p_replays bigint
)
  RETURNS void
  LANGUAGE sql
  SET search_path TO ''
  AS $function$
  insert into agent.idempotency_replays as r (minute, scope, backend, replays)
  values (pg_catalog.date_trunc('minute', pg_catalog.clock_timestamp()), p_scope, pg_catalog.pg_backend_pid(),
          p_replays)
  on conflict (minute, scope, backend) do update set replays = r.replays + excluded.replays
$function$;

ALTER FUNCTION "agent"."idempotency_count_replays"(text, bigint) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_decide (
  p_organization_id uuid,
  p_scope           text,
  p_key             text,
  p_request_hash    text,
  p_lease_token     uuid,
  p_lease_ms        bigint,
  p_retain_ms       bigint,
  p_may_insert      boolean,
  p_may_take_over   boolean,
  p_request         jsonb   DEFAULT NULL::jsonb,
  p_traceparent     text    DEFAULT NULL::text
)
  RETURNS SETOF agent.idempotency_claim_outcome
  LANGUAGE plpgsql
  SET search_path TO ''
  AS $function$
declare
  v_policy_retain interval;
  v_lease interval;
  v_retain interval;
  v_at timestamptz;
  v_won boolean := false;
  v_outcome text;
  v_request jsonb := nullif(p_request, 'null'::jsonb);
  v_traceparent text;
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

  -- The work is measured before anything is locked, as a completion's
  -- answer is (agent.idempotency_complete).
  if v_request is not null then
    perform agent.idempotency_check_work(p_scope, v_request);
  end if;
  if p_traceparent is not null then
    v_traceparent := agent.idempotency_check_traceparent(p_traceparent, 'p_traceparent');
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
         claimed_at, lease_expires_at, retain_until, request, redrive_at, traceparent)
      select p_organization_id, p_scope, p_key, p_request_hash, 'processing', p_lease_token,
             v_at, v_at + v_lease, v_at + v_lease + greatest(s.retain, v_retain),
             v_request, case when v_request is not null then v_at + v_lease end, v_traceparent
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
           reclaims = k.reclaims + 1,
           request = coalesce(k.request, v_request),
           redrive_at = case when coalesce(k.request, v_request) is not null then v_at + v_lease end,
           traceparent = coalesce(k.traceparent, v_traceparent)
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
  -- A replay writes nothing to the journal; it is counted, for the
  -- console's plot, in an unlogged table of its own.
  if v_outcome = 'completed' then
    perform agent.idempotency_count_replays(p_scope, 1);
  end if;

  -- A win that waited: the lease starts now, and the retention, counted
  -- from the lease's end, moves with it.
  if v_won and pg_catalog.clock_timestamp() - v_at > interval '10 milliseconds' then
    v_at := pg_catalog.clock_timestamp();
    update agent.idempotency_keys as k
       set claimed_at = v_at,
           lease_expires_at = v_at + v_lease,
           retain_until = greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at)),
           redrive_at = case when k.redrive_at is not null then v_at + v_lease end
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
    r.status = 'processing' and r.lease_expires_at > pg_catalog.clock_timestamp(),
    case when v_outcome in ('claimed', 'reclaimed') then r.traceparent end
  )::agent.idempotency_claim_outcome;
end
$function$;

ALTER FUNCTION "agent"."idempotency_decide"(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean, jsonb, text) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_failure_counts (
  p_limit integer DEFAULT 100
)
  RETURNS SETOF agent.idempotency_failure_count
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % scopes, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope,
           pg_catalog.count(*),
           pg_catalog.count(*) filter (where k.request is not null),
           pg_catalog.count(*) filter (where k.dead_lettered_at is not null),
           pg_catalog.min(k.claimed_at)
      from agent.idempotency_keys k
     where k.status = 'completed'
       and k.response -> 'ok' = 'false'::jsonb
     group by k.scope
     order by pg_catalog.count(*) desc, k.scope
     limit p_limit;
end
$function$;

ALTER FUNCTION "agent"."idempotency_failure_counts"(integer) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_failures (
  p_scope           text,
  p_limit           integer,
  p_organization_id uuid                     DEFAULT NULL::uuid,
  p_since           timestamp with time zone DEFAULT NULL::timestamp WITH time zone,
  p_row_cap         integer                  DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_failure
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  return query
    with failed as (
      select k.*
        from agent.idempotency_keys k
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
       order by k.claimed_at, k.id
       limit p_limit
    )
    select f.id, f.organization_id, f.scope, f.key, f.status, f.response ->> 'error', f.response,
           f.resource_type, f.resource_id, f.reclaims + 1, f.claimed_at, f.retain_until,
           f.request is not null, coalesce(jsonb_array_length(f.replaced), 0),
           (count(*) over ())::integer,
           coalesce((f.replaced -> 0 ->> 'claimed_at')::timestamptz, f.claimed_at), f.traceparent
      from failed f
     order by f.claimed_at, f.id;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_in_flight (
  p_limit integer DEFAULT 100
)
  RETURNS SETOF agent.idempotency_in_flight_scope
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
declare
  v_at timestamptz := pg_catalog.clock_timestamp();
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % scopes, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select k.scope,
           pg_catalog.count(*),
           pg_catalog.count(*) filter (where k.lease_expires_at > v_at),
           pg_catalog.count(*) filter (where k.redrive_at <= v_at),
           pg_catalog.min(k.claimed_at),
           pg_catalog.min(k.lease_expires_at)
      from agent.idempotency_keys k
     where k.status = 'processing'
     group by k.scope
     order by pg_catalog.count(*) desc, k.scope
     limit p_limit;
end
$function$;

ALTER FUNCTION "agent"."idempotency_in_flight"(integer) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_processing (
  p_scope text,
  p_limit integer
)
  RETURNS SETOF agent.idempotency_processing_claim
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
declare
  v_prefix text;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, null);
  return query
    select k.id, k.organization_id, k.scope, k.key, k.claimed_at, k.lease_expires_at,
           k.lease_expires_at > pg_catalog.clock_timestamp(), k.reclaims + 1, k.request is not null,
           agent.idempotency_version(k.lease_token, k.lease_expires_at, k.reclaims)
      from agent.idempotency_keys k
     where k.status = 'processing'
       and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
     order by k.claimed_at, k.id
     limit p_limit;
end
$function$;

ALTER FUNCTION "agent"."idempotency_processing"(text, integer) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_queue_take (
  p_queue             text,
  p_dead_letter_queue text,
  p_organization_id   uuid,
  p_lease_ms          bigint,
  p_lease_tokens      uuid[],
  p_max_reads         integer DEFAULT 5,
  p_scope             text    DEFAULT NULL::text,
  p_organizations     uuid[]  DEFAULT NULL::uuid[],
  p_row_cap           integer DEFAULT NULL::integer,
  p_traceparent       text    DEFAULT NULL::text
)
  RETURNS SETOF agent.idempotency_queue_item
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_scope text := coalesce(p_scope, 'queue.' || p_queue);
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
  v_accepted uuid[];
  v_visible integer;
  v_max_work integer;
  v_items agent.idempotency_queue_item[] := '{}'::agent.idempotency_queue_item[];
  v_item agent.idempotency_queue_item;
  v_hashes text[] := '{}'::text[];
  v_message record;
  v_body jsonb;
  v_key text;
  v_org uuid;
  v_reason text;
  v_claims jsonb;
  v_claim record;
  v_orgs uuid[];
  v_first integer;
  v_firsts integer[];
  v_failure jsonb;
  v_archive bigint[] := '{}'::bigint[];
  v_work record;
  v_traceparent text := agent.idempotency_check_traceparent(p_traceparent, 'p_traceparent');
  -- 2^1024 - 2^970: from here on the nearest IEEE 754 double is infinity,
  -- which no JSON reader of a client can hash or hand on.
  c_beyond constant jsonb := pg_catalog.jsonb_build_object('max', 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792::numeric);
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  if p_dead_letter_queue = p_queue then
    raise exception 'p_dead_letter_queue must be another queue than p_queue %', p_queue using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  if p_max_reads is null or p_max_reads < 1 then
    raise exception 'p_max_reads must be at least 1, got %', p_max_reads using errcode = '22023';
  end if;
  if char_length(v_scope) > 128 or v_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*$' then
    raise exception 'p_scope must be a scope of a-z, 0-9, ".", "_" and "-", got %', pg_catalog.left(v_scope, 128)
      using errcode = '22023';
  end if;
  v_accepted := coalesce(p_organizations, array[p_organization_id]::uuid[]);
  if pg_catalog.array_position(v_accepted, null) is not null or pg_catalog.cardinality(v_accepted) = 0 then
    raise exception 'p_organization_id or p_organizations must name the organizations whose messages this consumer takes'
      using errcode = '22023';
  end if;
  if p_organization_id is not null and p_organization_id <> all (v_accepted) then
    raise exception 'p_organization_id % is not among p_organizations', p_organization_id using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'one fresh token per message (or re-drive) the call may take: the answer names every one';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each message needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;
  select p.max_request_bytes into v_max_work from agent.idempotency_policy(v_scope) p;
  if v_max_work is null then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', v_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, queue.*) to agent.idempotency_scopes in a migration';
  end if;

  -- Read: each message hidden for the lease and a second more, so it comes
  -- back only once its claim may be taken over.
  v_visible := (p_lease_ms + 999) / 1000 + 1;
  for v_message in
    select r.msg_id, r.read_ct, r.enqueued_at, r.message
      from pgmq.read(p_queue, v_visible, v_count) r
     order by r.msg_id
  loop
    v_body := v_message.message;
    v_reason := null;
    v_key := null;
    v_org := null;
    if v_body is null or pg_catalog.jsonb_typeof(v_body) <> 'object' then
      v_reason := 'the message is not a JSON object';
    elsif pg_catalog.jsonb_path_exists(v_body, 'strict $.** ? (@.type() == "number" && (@ >= $max || @ <= -$max))',
                                       c_beyond) then
      v_reason := 'the message holds a number beyond every IEEE 754 double, which a client reads as infinity';
    else
      case pg_catalog.jsonb_typeof(v_body -> 'idempotency_key')
        when 'string' then
          v_key := v_body ->> 'idempotency_key';
          if char_length(v_key) not between 1 and 512 then
            v_reason := 'idempotency_key must have 1 to 512 characters';
          end if;
        when 'null' then
          v_key := 'msg-' || v_message.msg_id;
        else
          if v_body ? 'idempotency_key' then
            v_reason := 'idempotency_key is not a string';
          else
            v_key := 'msg-' || v_message.msg_id;
          end if;
      end case;
      if v_reason is null then
        case coalesce(pg_catalog.jsonb_typeof(v_body -> 'organization_id'), 'null')
          when 'null' then
            v_org := p_organization_id;
            if v_org is null then
              v_reason := 'the message names no organization_id, and this consumer has no default one';
            end if;
          when 'string' then
            if (v_body ->> 'organization_id') ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' then
              v_org := (v_body ->> 'organization_id')::uuid;
              if v_org <> all (v_accepted) then
                v_reason := 'organization_id ' || v_org || ' is not one this consumer accepts';
              end if;
            else
              v_reason := 'organization_id is not a UUID';
            end if;
          else
            v_reason := 'organization_id is not a UUID';
        end case;
      end if;
      if v_reason is null and pg_catalog.octet_length((v_body -> 'payload')::text) > v_max_work
         and agent.idempotency_json_size(v_body -> 'payload') > v_max_work then
        v_reason := 'the payload is above the ' || v_max_work || ' bytes scope ' || v_scope
                    || ' keeps, so a failure could not be run again after a fix';
      end if;
    end if;
    v_item := (v_message.msg_id, v_message.read_ct, v_message.enqueued_at,
               case when v_reason is null then v_body end, v_org, v_key,
               case when v_reason is null then 'unclaimed' else 'malformed' end,
               null, null, null, null, null, null, null,
               case when v_reason is null then coalesce(v_body -> 'payload', 'null'::jsonb) end,
               null, false, false, v_reason, null, null)::agent.idempotency_queue_item;
    v_items := v_items || v_item;
    v_hashes := v_hashes || case when v_reason is null
                                 then agent.idempotency_request_hash(coalesce(v_body -> 'payload', 'null'::jsonb)) end;
  end loop;

  -- A message no client can read is dead-lettered alone, at once.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'malformed' then
      select r.message into v_body from pgmq.set_vt(p_queue, v_items[i].msg_id, v_visible) r;
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct, v_body,
                                             pg_catalog.jsonb_build_object('error', 'malformed_message',
                                                                           'output', pg_catalog.jsonb_build_object('reason', v_items[i].reason)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;

  -- Claim: one batch per organization, in organization order (each batch
  -- locks its keys in key order), every message under its own token; a key
  -- twice among them is decided by its first message, the others are its
  -- copies and end with it.
  select pg_catalog.array_agg(distinct t.organization_id order by t.organization_id) into v_orgs
    from pg_catalog.unnest(v_items) t
   where t.outcome = 'unclaimed';
  -- Each message to claim, and the first message of its key.
  select pg_catalog.array_agg(f.first order by f.n) into v_firsts
    from (select n, case when v_items[n].outcome = 'unclaimed'
                         then pg_catalog.min(n) over (partition by v_items[n].outcome, v_items[n].organization_id,
                                                                   v_items[n].key) end as first
            from pg_catalog.generate_subscripts(v_items, 1) n) f;
  for v_org in select pg_catalog.unnest(coalesce(v_orgs, '{}')) loop
    select pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
             'key', v_items[i].key, 'request_hash', v_hashes[i], 'lease_token', p_lease_tokens[i],
             'request', v_items[i].payload, 'traceparent', v_traceparent) order by i)
      into v_claims
      from pg_catalog.generate_subscripts(v_items, 1) i
     where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org;
    for v_claim in
      select c.*, x.i
        from agent.idempotency_claim_many(v_org, v_scope, p_lease_ms, v_claims, v_cap) c
        join (select i, pg_catalog.row_number() over (order by i) - 1 as n
                from pg_catalog.generate_subscripts(v_items, 1) i
               where v_items[i].outcome = 'unclaimed' and v_items[i].organization_id = v_org) x on x.n = c.item
       order by c.item
    loop
      v_index := v_claim.i;
      v_items[v_index].id := v_claim.id;
      v_items[v_index].lease_expires_at := v_claim.lease_expires_at;
      v_items[v_index].retain_until := v_claim.retain_until;
      v_items[v_index].lease_live := v_claim.lease_live;
      v_first := nullif(v_firsts[v_index], v_index);
      if v_first is not null and v_hashes[v_first] = v_hashes[v_index] then
        v_items[v_index].outcome := 'copy';
        v_items[v_index].copy_of := v_items[v_first].msg_id;
      else
        v_items[v_index].outcome := v_claim.outcome;
        if v_claim.outcome in ('claimed', 'reclaimed') then
          v_items[v_index].lease_token := v_claim.lease_token;
          v_items[v_index].traceparent := v_claim.traceparent;
        elsif v_claim.outcome = 'completed' then
          v_items[v_index].response := v_claim.response;
        end if;
      end if;
    end loop;
  end loop;

  -- What this call can end now, it ends now: a message read too often is
  -- journaled as the failure dead_lettered; a conflict is dead-lettered; a
  -- journaled answer is replayed and archived, a failure's first copy
  -- dead-lettered with it.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome in ('claimed', 'reclaimed') and v_items[i].read_ct > p_max_reads then
      v_failure := pg_catalog.jsonb_build_object(
                     'ok', false, 'error', 'dead_lettered',
                     'output', pg_catalog.jsonb_build_object('reads', v_items[i].read_ct, 'max_reads', p_max_reads));
      perform agent.idempotency_complete(v_items[i].id, v_items[i].lease_token, null, null, v_failure,
                                         v_items[i].organization_id);
      v_items[i].outcome := 'completed';
      v_items[i].response := v_failure;
      v_items[i].lease_token := null;
    end if;
    if v_items[i].outcome = 'conflict' then
      perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                             v_items[i].message,
                                             pg_catalog.jsonb_build_object('error', 'conflict', 'output',
                                               pg_catalog.jsonb_build_object('key', v_items[i].key)));
      v_items[i].dead_lettered := true;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    elsif v_items[i].outcome = 'completed' then
      if v_items[i].response -> 'ok' = 'false'::jsonb then
        update agent.idempotency_keys k
           set dead_lettered_at = pg_catalog.clock_timestamp()
         where k.organization_id = v_items[i].organization_id and k.id = v_items[i].id
           and k.dead_lettered_at is null;
        if found then
          perform agent.idempotency_queue_letter(p_queue, p_dead_letter_queue, v_items[i].msg_id, v_items[i].read_ct,
                                                 v_items[i].message, v_items[i].response);
          v_items[i].dead_lettered := true;
        end if;
      end if;
      v_items[i].archived := true;
      v_archive := v_archive || v_items[i].msg_id;
    end if;
  end loop;
  -- Copies follow their first message: archived with an answer it found.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome = 'copy' then
      v_first := v_firsts[i];
      if v_items[v_first].archived then
        v_items[i].response := v_items[v_first].response;
        v_items[i].archived := true;
        v_archive := v_archive || v_items[i].msg_id;
      elsif v_items[v_first].outcome = 'processing' then
        v_items[i].outcome := 'processing';
        v_items[i].copy_of := null;
      end if;
    end if;
  end loop;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;

  -- Slots the queue did not fill take over this scope's work whose worker
  -- stopped, or that an operator sent back after a fix: each runs again
  -- under a token of the caller's, with the payload its claim keeps.
  if coalesce(pg_catalog.cardinality(v_items), 0) < v_count then
    for v_org in select o from pg_catalog.unnest(v_accepted) o order by o loop
      exit when coalesce(pg_catalog.cardinality(v_items), 0) >= v_count;
      for v_work in
        select w.*
          from agent.idempotency_redrive(
                 v_scope,
                 (select pg_catalog.array_agg(t order by n)
                    from pg_catalog.unnest(p_lease_tokens) with ordinality u(t, n)
                   where n > coalesce(pg_catalog.cardinality(v_items), 0)),
                 p_lease_ms, v_org, v_cap) w
      loop
        v_items := v_items || (null, null, null, null, v_work.organization_id, v_work.key,
                               case when v_work.status = 'processing' then 'redriven' else 'completed' end,
                               null, v_work.id, v_work.lease_token, v_work.lease_expires_at, v_work.retain_until,
                               v_work.status = 'processing', v_work.attempt, v_work.request, v_work.response,
                               false, false, null, null, v_work.traceparent)::agent.idempotency_queue_item;
        if v_work.status = 'completed' and v_work.response -> 'ok' = 'false'::jsonb then
          -- Re-driven as often as its scope allows: journaled as dead_lettered.
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_work.organization_id and k.id = v_work.id
             and k.dead_lettered_at is null
          returning k.request into v_body;
          if found then
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, null, null,
                      pg_catalog.jsonb_build_object('idempotency_key', v_work.key, 'organization_id', v_work.organization_id,
                                                    'payload', v_body),
                      v_work.response);
            v_items[pg_catalog.cardinality(v_items)].dead_lettered := true;
          end if;
        end if;
      end loop;
    end loop;
  end if;

  -- The answer carries what its reader needs: the message of a message to
  -- run (its payload inside), the payload of re-driven work, the
  -- answer of one replayed; and how many rows it holds, so a cut answer is
  -- told from a whole one.
  for i in 1 .. coalesce(pg_catalog.cardinality(v_items), 0) loop
    if v_items[i].outcome not in ('claimed', 'reclaimed') then
      v_items[i].message := null;
    end if;
    if v_items[i].outcome <> 'redriven' then
      v_items[i].payload := null;
    end if;
    v_items[i].taken := pg_catalog.cardinality(v_items);
  end loop;
  return query select t.* from pg_catalog.unnest(v_items) t;
end
$function$;

ALTER FUNCTION "agent"."idempotency_queue_take"(text, text, uuid, bigint, uuid[], integer, text, uuid[], integer, text) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_redrive_failed (
  p_scope           text,
  p_limit           integer,
  p_organization_id uuid                     DEFAULT NULL::uuid,
  p_since           timestamp with time zone DEFAULT NULL::timestamp WITH time zone,
  p_claim_ids       uuid[]                   DEFAULT NULL::uuid[],
  p_row_cap         integer                  DEFAULT NULL::integer
)
  RETURNS SETOF agent.idempotency_failure
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_prefix text;
  v_at timestamptz;
begin
  v_prefix := agent.idempotency_failures_scope(p_scope, p_limit, p_row_cap);
  if p_claim_ids is not null
     and (cardinality(p_claim_ids) = 0 or array_position(p_claim_ids, null) is not null) then
    raise exception 'p_claim_ids must name at least one claim, and no NULL; omit it to send back every failure'
      using errcode = '22023';
  end if;
  if p_claim_ids is null and p_since is null then
    raise exception 'name what to send back: p_claim_ids (the chosen failures), p_since (every failure claimed since), or both'
      using errcode = '22023';
  end if;

  v_at := pg_catalog.clock_timestamp();
  return query
    with chosen as (
      select k.id, k.organization_id, k.scope, p.retain
        from agent.idempotency_keys k
       cross join lateral agent.idempotency_policy(k.scope) p
       where k.status = 'completed'
         and k.response -> 'ok' = 'false'::jsonb
         and k.request is not null
         and p.retain is not null
         and p.max_attempts > 1
         and (k.scope = p_scope or (v_prefix is not null and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         and (p_since is null or k.claimed_at >= p_since)
         and (p_claim_ids is null or k.id = any (p_claim_ids))
       order by k.claimed_at, k.id
       limit p_limit
         for update of k skip locked
    ), sent as (
      update agent.idempotency_keys as k
         set status = 'processing',
             response = null,
             resource_type = null,
             resource_id = null,
             lease_token = gen_random_uuid(),
             claimed_at = v_at,
             lease_expires_at = v_at,
             redrive_at = v_at,
             reclaims = 0,
             retain_until = greatest(k.retain_until, v_at + c.retain),
             replaced = (
               select coalesce(jsonb_agg(e.entry order by e.n), '[]'::jsonb)
                 from jsonb_array_elements(
                        coalesce(k.replaced, '[]'::jsonb)
                        || jsonb_build_array(jsonb_build_object(
                             'response', k.response,
                             'resource_type', k.resource_type,
                             'resource_id', k.resource_id,
                             'attempts', k.reclaims + 1,
                             'claimed_at', k.claimed_at,
                             'sent_back_at', v_at))
                      ) with ordinality as e(entry, n)
                where e.n = 1 or e.n > jsonb_array_length(coalesce(k.replaced, '[]'::jsonb)) + 1 - 19
             )
        from chosen c
       where k.id = c.id and k.organization_id = c.organization_id
      returning k.*
    )
    select s.id, s.organization_id, s.scope, s.key, s.status,
           s.replaced -> -1 -> 'response' ->> 'error', s.replaced -> -1 -> 'response',
           s.replaced -> -1 ->> 'resource_type', s.replaced -> -1 ->> 'resource_id',
           (s.replaced -> -1 ->> 'attempts')::integer, s.claimed_at, s.retain_until,
           true, jsonb_array_length(s.replaced),
           (count(*) over ())::integer,
           (s.replaced -> 0 ->> 'claimed_at')::timestamptz, s.traceparent
      from sent s
     order by s.id;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_retire_expired (
  p_ids uuid[]
)
  RETURNS SETOF agent.idempotency_retired
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_deleted integer;
  v_dead integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if pg_catalog.cardinality(p_ids) > agent.idempotency_row_cap() then
    raise exception 'p_ids holds % ids; at most the plane''s row cap % per call',
                    pg_catalog.cardinality(p_ids), agent.idempotency_row_cap()
      using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', pg_catalog.array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  -- Unfinished work (still processing, carrying its request: acknowledged,
  -- and nobody re-drove it) is never deleted: it is journaled as a dead
  -- letter, kept for its scope's retention from now, and listed among the
  -- failures, which an operator can send back after a fix.
  with expired as (
    select x.id, x.organization_id, x.scope, x.status = 'processing' and x.request is not null as unfinished
      from agent.idempotency_keys x
     where x.id = any (p_ids)
       and x.retain_until < pg_catalog.now()
       for update of x skip locked
  ), dead as (
    update agent.idempotency_keys as k
       set status = 'completed',
           response = pg_catalog.jsonb_build_object('ok', false, 'error', 'swept_unredriven',
                                                    'output', pg_catalog.jsonb_build_object('attempts', k.reclaims + 1)),
           lease_expires_at = least(k.lease_expires_at, pg_catalog.now()),
           retain_until = pg_catalog.now() + coalesce((select p.retain from agent.idempotency_policy(k.scope) p),
                                                      interval '1 day'),
           redrive_at = null
      from expired e
     where e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  ), deleted as (
    delete from agent.idempotency_keys k
     using expired e
     where not e.unfinished and k.id = e.id and k.organization_id = e.organization_id
    returning k.id
  )
  select (select pg_catalog.count(*) from deleted), (select pg_catalog.count(*) from dead) into v_deleted, v_dead;
  if v_dead > 0 then
    raise warning 'idempotency sweep: % unfinished claims carrying work passed their retention unredriven; journaled as dead letters (swept_unredriven)', v_dead
      using hint = 'schedule a re-drive for their scopes (idem redrive), then send them back: idem redrive --failed';
  end if;
  perform agent.idempotency_trim_replays();
  return next (v_deleted, v_dead)::agent.idempotency_retired;
end
$function$;

CREATE OR REPLACE FUNCTION agent.idempotency_sweep_backlog (
  p_limit integer DEFAULT 100
)
  RETURNS SETOF agent.idempotency_sweep_backlog_day
  LANGUAGE plpgsql
  STABLE
  SECURITY DEFINER
  SET search_path TO ''
  AS $function$
begin
  if p_limit is null or p_limit not between 1 and agent.idempotency_row_cap() then
    raise exception 'p_limit must be between 1 and the row cap % days, got %', agent.idempotency_row_cap(), p_limit
      using errcode = '22023';
  end if;
  return query
    select (k.retain_until at time zone 'UTC')::date, pg_catalog.count(*)
      from agent.idempotency_keys k
     where k.retain_until < pg_catalog.clock_timestamp()
     group by 1
     order by 1
     limit p_limit;
end
$function$;

ALTER FUNCTION "agent"."idempotency_sweep_backlog"(integer) OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_trim_replays()
  RETURNS integer
  LANGUAGE plpgsql
  SET search_path TO ''
  AS $function$
declare
  v_deleted integer;
begin
  delete from agent.idempotency_replays r
   where r.minute < least(pg_catalog.clock_timestamp() - interval '7 days',
                          (select pg_catalog.min(o.minute) from agent.idempotency_replays o) + interval '1 day');
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$function$;

ALTER FUNCTION "agent"."idempotency_trim_replays"() OWNER TO "idempotency_owner";

CREATE OR REPLACE FUNCTION agent.idempotency_version (
  p_lease_token      uuid,
  p_lease_expires_at timestamp with time zone,
  p_reclaims         integer
)
  RETURNS text
  LANGUAGE sql
  IMMUTABLE
  SET search_path TO ''
  AS $function$
  select pg_catalog.encode(
           pg_catalog.sha256(pg_catalog.convert_to(
             p_lease_token::text || '/'
               || (extract(epoch from p_lease_expires_at) * 1000000)::bigint::text || '/'
               || p_reclaims::text, 'UTF8')),
           'hex')
$function$;

ALTER FUNCTION "agent"."idempotency_version"(uuid, timestamp WITH time zone, integer) OWNER TO "idempotency_owner";

ALTER TABLE "agent"."idempotency_keys"
  ADD CONSTRAINT "idempotency_keys_traceparent_w3c" CHECK (((traceparent IS NULL) OR (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'::text)));

CREATE VIEW "agent"."idempotency_work" WITH (security_invoker=true) AS  SELECT k.id,
    k.organization_id,
    k.scope,
    k.key,
    k.request_hash,
    k.status,
    k.lease_token,
    k.request,
    (k.reclaims + 1) AS attempt,
    k.claimed_at,
    k.lease_expires_at,
    k.retain_until,
    k.response,
    NULL::integer AS taken,
    k.traceparent
   FROM agent.idempotency_keys k;

CREATE OR REPLACE FUNCTION agent.idempotency_redrive (
  p_scope           text,
  p_lease_tokens    uuid[],
  p_lease_ms        bigint,
  p_organization_id uuid    DEFAULT NULL::uuid,
  p_row_cap         integer DEFAULT NULL::integer,
  p_max_bytes       bigint  DEFAULT NULL::bigint
)
  RETURNS SETOF agent.idempotency_work
  LANGUAGE plpgsql
  SECURITY DEFINER
  SET search_path TO ''
  SET lock_timeout TO '5s'
  AS $function$
declare
  v_family boolean;
  v_prefix text;
  v_lease interval;
  v_at timestamptz;
  v_cap integer;
  v_count integer;
  v_earlier integer;
  v_index integer;
begin
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_lease_ms is null or p_lease_ms not between 1000 and 86400000 then
    raise exception 'p_lease_ms must be between 1000 (one second) and 86400000 (one day), got %', p_lease_ms
      using errcode = '22023';
  end if;
  v_cap := agent.idempotency_row_cap(p_row_cap);
  if p_lease_tokens is null then
    raise exception 'p_lease_tokens is required: one fresh lease token per orphan the call may take over'
      using errcode = '22023',
            hint = 'mint them as for claims; a repeat with the same tokens after a lost answer answers the same claims';
  end if;
  v_count := coalesce(pg_catalog.cardinality(p_lease_tokens), 0);
  if v_count not between 1 and v_cap then
    raise exception 'p_lease_tokens must hold between 1 and the row cap % tokens, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a re-drive answers every claim it takes over; more than the row cap would be cut from the answer';
  end if;
  if p_max_bytes is not null and p_max_bytes < 1 then
    raise exception 'p_max_bytes must be at least 1, got %', p_max_bytes using errcode = '22023';
  end if;
  if pg_catalog.array_position(p_lease_tokens, null) is not null then
    raise exception 'p_lease_tokens[%] is NULL', pg_catalog.array_position(p_lease_tokens, null) - 1
      using errcode = '22023';
  end if;
  select t.first - 1, t.i - 1 into v_earlier, v_index
    from (select i, pg_catalog.min(i) over (partition by p_lease_tokens[i]) as first
            from pg_catalog.generate_subscripts(p_lease_tokens, 1) i) t
   where t.i > t.first
   order by t.i
   limit 1;
  if v_earlier is not null then
    raise exception 'p_lease_tokens[%] repeats p_lease_tokens[%]: each orphan needs a token of its own', v_index, v_earlier
      using errcode = '22023';
  end if;

  v_family := right(p_scope, 2) = '.*';
  v_prefix := case when v_family then left(p_scope, -1) end;
  if (select p.retain from agent.idempotency_policy(p_scope) p) is null
     and not (v_family and exists (select 1 from agent.idempotency_scopes s
                                    where left(s.scope, char_length(v_prefix)) = v_prefix)) then
    raise exception 'unknown scope %: no row of agent.idempotency_scopes names it or a family of it', p_scope
      using errcode = 'IDEM1',
            hint = 'add the scope (or its family, e.g. webhook.*) to agent.idempotency_scopes in a migration';
  end if;

  v_lease := p_lease_ms * interval '1 millisecond';
  v_at := pg_catalog.clock_timestamp();
  return query
    with mine as (
      -- What an earlier call with these tokens took over and still holds:
      -- its answer was lost, so it is answered again, at the same attempt.
      select k.*
        from agent.idempotency_keys k
       where k.redrive_at is not null
         and k.lease_token = any (p_lease_tokens)
         and k.status = 'processing'
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
         for update of k skip locked
    ), unused as (
      select t.token, pg_catalog.row_number() over (order by t.n) as n
        from pg_catalog.unnest(p_lease_tokens) with ordinality t(token, n)
       where not exists (select 1 from mine m where m.lease_token = t.token)
    ), orphans as (
      select k.id, k.organization_id, k.scope, k.redrive_at, pg_catalog.octet_length(k.request::text) as size
        from agent.idempotency_keys k
       where k.redrive_at <= v_at
         and k.status = 'processing'
         and k.lease_expires_at <= v_at
         and k.lease_token <> all (p_lease_tokens)
         and (k.scope = p_scope or (v_family and left(k.scope, char_length(v_prefix)) = v_prefix))
         and (p_organization_id is null or k.organization_id = p_organization_id)
       order by k.redrive_at, k.id
       limit (select pg_catalog.count(*) from unused)
         for update of k skip locked
    ), numbered as (
      select o.id, o.organization_id, o.scope, pg_catalog.row_number() over (order by o.redrive_at, o.id) as n,
             pg_catalog.sum(o.size) over (order by o.redrive_at, o.id)
               + (select coalesce(pg_catalog.sum(pg_catalog.octet_length(m.request::text)), 0) from mine m) as bytes
        from orphans o
    ), decided as (
      -- Orphans locked beyond the byte budget stay orphans, for the next call.
      select o.id, o.organization_id, p.max_attempts, u.token
        from numbered o
        join unused u on u.n = o.n
       cross join lateral agent.idempotency_policy(o.scope) p
       where p_max_bytes is null or o.bytes <= p_max_bytes or (o.n = 1 and not exists (select 1 from mine))
    ), taken as (
      update agent.idempotency_keys as k
         set status = case when k.reclaims + 1 >= d.max_attempts then 'completed' else 'processing' end,
             response = case when k.reclaims + 1 >= d.max_attempts
                             then jsonb_build_object('ok', false, 'error', 'dead_lettered',
                                                     'output', jsonb_build_object('attempts', k.reclaims + 1))
                             else k.response end,
             lease_token = case when k.reclaims + 1 >= d.max_attempts then k.lease_token else d.token end,
             claimed_at = case when k.reclaims + 1 >= d.max_attempts then k.claimed_at else v_at end,
             lease_expires_at = case when k.reclaims + 1 >= d.max_attempts then k.lease_expires_at
                                     else v_at + v_lease end,
             retain_until = case when k.reclaims + 1 >= d.max_attempts
                                 then greatest(k.retain_until, v_at + (k.retain_until - k.lease_expires_at))
                                 else greatest(k.retain_until, v_at + v_lease + (k.retain_until - k.lease_expires_at))
                            end,
             reclaims = case when k.reclaims + 1 >= d.max_attempts then k.reclaims else k.reclaims + 1 end,
             redrive_at = case when k.reclaims + 1 >= d.max_attempts then null else v_at + v_lease end
        from decided d
       where k.id = d.id and k.organization_id = d.organization_id
      returning k.*
    ), answered as (
      select * from taken
      union all
      select * from mine
    )
    select t.id, t.organization_id, t.scope, t.key, t.request_hash, t.status,
           case when t.status = 'processing' then t.lease_token end,
           case when t.status = 'processing' then t.request end,
           t.reclaims + 1, t.claimed_at, t.lease_expires_at, t.retain_until,
           case when t.status = 'completed' then t.response end,
           (count(*) over ())::integer,
           t.traceparent
      from answered t
     order by t.lease_expires_at, t.id;
end
$function$;

ALTER FUNCTION "agent"."idempotency_redrive"(text, uuid[], bigint, uuid, integer, bigint) OWNER TO "idempotency_owner";

ALTER VIEW "agent"."idempotency_work" OWNER TO "idempotency_owner";

COMMENT ON COLUMN "agent"."idempotency_keys"."traceparent" IS 'The W3C traceparent of the worker that first claimed the key, when it sent one: a re-drive, a redelivery or a send-back links its span to that trace. Kept by takeovers and send-backs.';

COMMENT ON TABLE "agent"."idempotency_replays" IS 'Claims answered from the journal (replays) per minute, scope and backend, for agent.idempotency_activity. Unlogged; trimmed to 7 days by the sweep.';

REVOKE ALL ON FUNCTION "agent"."idempotency_abandon"(uuid, text) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_abandon"(uuid, text) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_activity"(timestamp WITH time zone, integer, integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_activity"(timestamp WITH time zone, integer, integer) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_check_traceparent"(text, text) FROM PUBLIC;

REVOKE ALL ON FUNCTION "agent"."idempotency_claim"(uuid, text, text, text, uuid, bigint, jsonb, text) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_claim"(uuid, text, text, text, uuid, bigint, jsonb, text) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_count_replays"(text, bigint) FROM PUBLIC;

REVOKE ALL ON FUNCTION "agent"."idempotency_decide"(uuid, text, text, text, uuid, bigint, bigint, boolean, boolean, jsonb, text) FROM PUBLIC;

REVOKE ALL ON FUNCTION "agent"."idempotency_failure_counts"(integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_failure_counts"(integer) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_in_flight"(integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_in_flight"(integer) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_processing"(text, integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_processing"(text, integer) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_queue_take"(text, text, uuid, bigint, uuid[], integer, text, uuid[], integer, text) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_queue_take"(text, text, uuid, bigint, uuid[], integer, text, uuid[], integer, text) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_redrive"(text, uuid[], bigint, uuid, integer, bigint) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_redrive"(text, uuid[], bigint, uuid, integer, bigint) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_sweep_backlog"(integer) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION "agent"."idempotency_sweep_backlog"(integer) TO "service_role";

REVOKE ALL ON FUNCTION "agent"."idempotency_trim_replays"() FROM PUBLIC;

REVOKE ALL ON FUNCTION "agent"."idempotency_version"(uuid, timestamp WITH time zone, integer) FROM PUBLIC;

REVOKE ALL ON TYPE "agent"."idempotency_activity_bucket" FROM PUBLIC;

GRANT USAGE ON TYPE "agent"."idempotency_activity_bucket" TO "service_role";

REVOKE ALL ON TYPE "agent"."idempotency_failure_count" FROM PUBLIC;

GRANT USAGE ON TYPE "agent"."idempotency_failure_count" TO "service_role";

REVOKE ALL ON TYPE "agent"."idempotency_in_flight_scope" FROM PUBLIC;

GRANT USAGE ON TYPE "agent"."idempotency_in_flight_scope" TO "service_role";

REVOKE ALL ON TYPE "agent"."idempotency_processing_claim" FROM PUBLIC;

GRANT USAGE ON TYPE "agent"."idempotency_processing_claim" TO "service_role";

REVOKE ALL ON TYPE "agent"."idempotency_sweep_backlog_day" FROM PUBLIC;

GRANT USAGE ON TYPE "agent"."idempotency_sweep_backlog_day" TO "service_role";

GRANT SELECT ON TABLE "agent"."idempotency_work" TO "service_role";

-- The table's privileges as 90_grants.sql states them (the diff sees no
-- difference between the default and an owner-only list): no API role may
-- touch it, whatever default privileges the schema carries.
REVOKE ALL ON TABLE "agent"."idempotency_replays" FROM PUBLIC, "anon", "authenticated", "service_role";
