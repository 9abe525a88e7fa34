-- One body limit for webhook deliveries.
--
-- The webhook gates (Rust and TypeScript) store every delivery's body with
-- its claim, so a re-drive can carry the event on; the plane refuses work
-- above the scope's max_request_bytes (IDEM5), and the gate answers such a
-- delivery 413, unclaimed. The TypeScript handler read bodies up to 1 MiB
-- while webhook.* kept 64 KiB of work: a correctly signed 104 KB event was
-- refused 413 on every delivery, forever.
--
-- Now both gates take bodies up to 256 KiB by default, refused 413 above it
-- before anything else (the signature included), and store a body as the
-- shorter of its text and its base64 form, so a body of n bytes takes at
-- most 4 * ceil(n / 3) + 18 bytes of work whatever its bytes. webhook.*
-- keeps 384 KiB, which holds every body up to 256 KiB (349,546 bytes at
-- most). A deployment that changed webhook.* keeps its own value; one still
-- at the shipped 64 KiB is raised. `idem doctor` says when a scope under
-- webhook.* keeps less than the handler's limit needs, reading the policies
-- with agent.idempotency_policies, new here: the rows that govern a scope
-- or a family, for operators (service_role only, never writes).

update agent.idempotency_scopes
   set max_request_bytes = 393216
 where scope = 'webhook.*'
   and max_request_bytes = 65536;

CREATE FUNCTION agent.idempotency_policies(p_scope text) RETURNS TABLE(scope text, retain_ms bigint, max_response_bytes integer, max_request_bytes integer, max_attempts integer)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $_$
declare
  v_prefix text;
  v_governs text;
begin
  if p_scope is null or char_length(p_scope) > 128 or p_scope !~ '^[a-z0-9_-]+(\.[a-z0-9_-]+)*(\.\*)?$' then
    raise exception 'p_scope must be a scope (webhook.stripe) or a family (webhook.*) of a-z, 0-9, "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  v_prefix := case when right(p_scope, 2) = '.*' then left(p_scope, -1) end;
  select s.scope into v_governs
    from agent.idempotency_scopes s
   where s.scope = p_scope
      or (s.scope like '%.*'
          and char_length(p_scope) > char_length(s.scope) - 1
          and left(p_scope, char_length(s.scope) - 1) = left(s.scope, -1))
   order by s.scope = p_scope desc, char_length(s.scope) desc
   limit 1;
  return query
    select s.scope, (extract(epoch from s.retain) * 1000)::bigint, s.max_response_bytes, s.max_request_bytes,
           s.max_attempts
      from agent.idempotency_scopes s
     where s.scope = v_governs
        or (v_prefix is not null and left(s.scope, char_length(v_prefix)) = v_prefix)
     order by s.scope;
end
$_$;

ALTER FUNCTION agent.idempotency_policies(p_scope text) OWNER TO idempotency_owner;

REVOKE ALL ON FUNCTION agent.idempotency_policies(p_scope text) FROM PUBLIC;
GRANT ALL ON FUNCTION agent.idempotency_policies(p_scope text) TO service_role;
