-- agent.idempotency_check_item
--
-- Refuses (22023) a batch item that is not a JSON object, naming it
-- p_items[i]. Private.

CREATE FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_item is null or jsonb_typeof(p_item) <> 'object' then
    raise exception 'p_items[%] must be a JSON object, got a JSON %', p_index, coalesce(jsonb_typeof(p_item), 'null')
      using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_item(p_item jsonb, p_index integer) OWNER TO idempotency_owner;
