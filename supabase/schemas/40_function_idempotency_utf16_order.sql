-- agent.idempotency_utf16_order
--
-- A key's UTF-8 bytes, re-ordered as its UTF-16 code units order (private):
-- the lead bytes of U+E000..U+FFFF (EE, EF) move above every supplementary
-- character's (F0..F4), so comparing the bytes compares the UTF-16 code
-- units, as RFC 8785 sorts object members. Only keys holding such a
-- character need it; for every other key it answers the UTF-8 bytes.

CREATE FUNCTION agent.idempotency_utf16_order(p_key text) RETURNS bytea
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_bytes bytea := pg_catalog.convert_to(p_key, 'UTF8');
begin
  for i in 0 .. pg_catalog.length(v_bytes) - 1 loop
    case pg_catalog.get_byte(v_bytes, i)
      when 238 then v_bytes := pg_catalog.set_byte(v_bytes, i, 245);
      when 239 then v_bytes := pg_catalog.set_byte(v_bytes, i, 246);
      else null;
    end case;
  end loop;
  return v_bytes;
end;
$$;

ALTER FUNCTION agent.idempotency_utf16_order(p_key text) OWNER TO idempotency_owner;
