-- agent.idempotency_item_uuid
--
-- A batch item's UUID field, refused (22023) when missing or malformed.
-- Private.

CREATE FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) RETURNS uuid
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $_$
declare
  v_text text := agent.idempotency_item_text(p_item, p_index, p_field, true);
begin
  if v_text !~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' then
    raise exception 'p_items[%].% must be a UUID, got %', p_index, p_field, pg_catalog.left(v_text, 80)
      using errcode = '22023';
  end if;
  return v_text::uuid;
end
$_$;

ALTER FUNCTION agent.idempotency_item_uuid(p_item jsonb, p_index integer, p_field text) OWNER TO idempotency_owner;
