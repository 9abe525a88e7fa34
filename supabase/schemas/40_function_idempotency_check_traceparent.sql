-- agent.idempotency_check_traceparent
--
-- The traceparent a claim stores, checked: NULL or empty for none, else a W3C
-- Trace Context traceparent of version 00 (00-<32 hex trace id>-<16 hex
-- parent id>-<2 hex flags>, lowercase, neither id all zeros). Anything else
-- is refused (22023) naming p_name. Private.

CREATE FUNCTION agent.idempotency_check_traceparent(p_traceparent text, p_name text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $_$
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
$_$;

ALTER FUNCTION agent.idempotency_check_traceparent(p_traceparent text, p_name text) OWNER TO idempotency_owner;
