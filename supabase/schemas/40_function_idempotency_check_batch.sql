-- agent.idempotency_check_batch
--
-- Refuses (22023) a batch that is not a JSON array of 1 to p_row_cap items,
-- or a p_row_cap above the plane's (agent.idempotency_row_cap); without
-- p_row_cap, the plane's. Private.

CREATE FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
declare
  v_count integer;
  v_cap integer := agent.idempotency_row_cap(p_row_cap);
begin
  if p_items is null then
    raise exception 'p_items is required' using errcode = '22023';
  end if;
  if jsonb_typeof(p_items) <> 'array' then
    raise exception 'p_items must be a JSON array of items, got a JSON %', jsonb_typeof(p_items)
      using errcode = '22023';
  end if;
  v_count := jsonb_array_length(p_items);
  if v_count not between 1 and v_cap then
    raise exception 'p_items must hold between 1 and the row cap % items, got %', v_cap, v_count
      using errcode = '22023',
            hint = 'a batch answers a row per item; more than the row cap would be cut from the answer';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
