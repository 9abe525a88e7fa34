-- agent.idempotency_check_batch
--
-- Refuses (22023) a batch that is not a JSON array of 1 to p_row_cap items.
-- Private.

CREATE FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
declare
  v_count integer;
begin
  if p_row_cap is null or p_row_cap not between 1 and 100000 then
    raise exception 'p_row_cap must be between 1 and 100000, got %', p_row_cap
      using errcode = '22023',
            hint = 'the row cap the caller is held to: PostgREST db-max-rows, Supabase api.max_rows (default 1000)';
  end if;
  if p_items is null then
    raise exception 'p_items is required' using errcode = '22023';
  end if;
  if jsonb_typeof(p_items) <> 'array' then
    raise exception 'p_items must be a JSON array of items, got a JSON %', jsonb_typeof(p_items)
      using errcode = '22023';
  end if;
  v_count := jsonb_array_length(p_items);
  if v_count not between 1 and p_row_cap then
    raise exception 'p_items must hold between 1 and the row cap p_row_cap % items, got %', p_row_cap, v_count
      using errcode = '22023',
            hint = 'a batch answers a row per item; more than the row cap would be cut from the answer';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_batch(p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
