-- agent.idempotency_row_cap
--
-- The plane's row cap (public): without an argument, the cap every answer
-- is held to (agent.idempotency_settings.max_rows); with one, that cap
-- checked (22023 outside 1 to the plane's) and answered. Every function
-- that answers rows asks it.

CREATE FUNCTION agent.idempotency_row_cap(p_row_cap integer DEFAULT NULL::integer) RETURNS integer
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_cap integer;
begin
  select s.max_rows into v_cap from agent.idempotency_settings s;
  v_cap := coalesce(v_cap, 1000);
  if p_row_cap is null then
    return v_cap;
  end if;
  if p_row_cap not between 1 and v_cap then
    raise exception 'p_row_cap % is outside 1 to the plane''s row cap %', p_row_cap, v_cap
      using errcode = '22023',
            hint = 'the plane''s row cap (agent.idempotency_settings.max_rows) is the server''s db-max-rows '
                   '(Supabase api.max_rows): omit p_row_cap, or pass that cap or a lower one';
  end if;
  return p_row_cap;
end
$$;

ALTER FUNCTION agent.idempotency_row_cap(p_row_cap integer) OWNER TO idempotency_owner;
