-- agent.idempotency_item_text
--
-- A batch item's text field, refused (22023) when required and missing, or
-- not a string. Private.

CREATE FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
declare
  v_kind text := jsonb_typeof(p_item -> p_field);
begin
  if v_kind is null or v_kind = 'null' then
    if p_required then
      raise exception 'p_items[%].% is required', p_index, p_field using errcode = '22023';
    end if;
    return null;
  end if;
  if v_kind <> 'string' then
    raise exception 'p_items[%].% must be a JSON string, got a JSON %', p_index, p_field, v_kind
      using errcode = '22023';
  end if;
  return p_item ->> p_field;
end
$$;

ALTER FUNCTION agent.idempotency_item_text(p_item jsonb, p_index integer, p_field text, p_required boolean) OWNER TO idempotency_owner;
