-- agent.idempotency_cap_probe
--
-- p_rows synthetic rows (public), nothing read or written: idem doctor's
-- check of the server's row cap.

CREATE FUNCTION agent.idempotency_cap_probe(p_rows integer) RETURNS SETOF agent.idempotency_rows
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    AS $$
begin
  if p_rows is null or p_rows < 1 or p_rows > 100001 then
    raise exception 'p_rows must be between 1 and 100001, got %', p_rows using errcode = '22023';
  end if;
  return query
    select gen_random_uuid(), '00000000-0000-0000-0000-000000000000'::uuid, 'probe', 'probe-' || i,
           repeat('0', 64), 'processing', gen_random_uuid(), null::text, null::text, null::jsonb,
           now(), now(), now(), 0
      from generate_series(1, p_rows) as i;
end
$$;

ALTER FUNCTION agent.idempotency_cap_probe(p_rows integer) OWNER TO idempotency_owner;
