-- Supabase Queues through the Data API, for a database that is not Supabase.
--
-- On Supabase, "Expose Queues via PostgREST" (Integrations > Queues >
-- Settings) creates the schema pgmq_public with thin wrappers over the
-- pgmq extension's functions, and the Data API then serves them
-- (https://supabase.com/docs/guides/queues/api). This file makes the same
-- wrappers, with the same names, arguments and answers, over the pgmq SQL
-- that `idem up --with-pgmq` and the tests install from the pgmq crate, so
-- a consumer calls them here exactly as it calls them on Supabase. Only
-- service_role may call them: a consumer needs nothing more.
--
-- Safe to apply again: every statement replaces or re-grants.

create schema if not exists pgmq_public;
revoke all on schema pgmq_public from public;
grant usage on schema pgmq_public to service_role;

create or replace function pgmq_public.pop(queue_name text)
returns setof pgmq.message_record
language plpgsql set search_path = ''
as $$
begin
  return query select * from pgmq.pop(queue_name := queue_name);
end;
$$;

create or replace function pgmq_public.send(queue_name text, message jsonb, sleep_seconds integer default 0)
returns setof bigint
language plpgsql set search_path = ''
as $$
begin
  return query select * from pgmq.send(queue_name := queue_name, msg := message, delay := sleep_seconds);
end;
$$;

create or replace function pgmq_public.send_batch(queue_name text, messages jsonb[], sleep_seconds integer default 0)
returns setof bigint
language plpgsql set search_path = ''
as $$
begin
  return query select * from pgmq.send_batch(queue_name := queue_name, msgs := messages, delay := sleep_seconds);
end;
$$;

create or replace function pgmq_public.read(queue_name text, sleep_seconds integer, n integer)
returns setof pgmq.message_record
language plpgsql set search_path = ''
as $$
begin
  return query select * from pgmq.read(queue_name := queue_name, vt := sleep_seconds, qty := n);
end;
$$;

create or replace function pgmq_public.archive(queue_name text, message_id bigint)
returns boolean
language plpgsql set search_path = ''
as $$
begin
  return pgmq.archive(queue_name := queue_name, msg_id := message_id);
end;
$$;

create or replace function pgmq_public.delete(queue_name text, message_id bigint)
returns boolean
language plpgsql set search_path = ''
as $$
begin
  return pgmq.delete(queue_name := queue_name, msg_id := message_id);
end;
$$;

revoke all on all functions in schema pgmq_public from public, anon, authenticated;
grant execute on all functions in schema pgmq_public to service_role;

-- The wrappers run as their caller: the service role reaches the queues'
-- tables, now and as queues are created.
grant usage on schema pgmq to service_role;
grant select, insert, update, delete on all tables in schema pgmq to service_role;
grant usage, select on all sequences in schema pgmq to service_role;
alter default privileges in schema pgmq grant select, insert, update, delete on tables to service_role;
alter default privileges in schema pgmq grant usage, select on sequences to service_role;
