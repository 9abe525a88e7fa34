-- agent.idempotency_canonical_json
--
-- A JSON value in RFC 8785 canonical form (private): no whitespace, object
-- members sorted by their names' UTF-16 code units, strings as ECMAScript's
-- JSON.stringify writes them (jsonb writes them so), numbers as
-- agent.idempotency_json_number spells them. The same text the Rust crate's
-- canonical_json and the TypeScript client's canonicalize write, so a hash
-- the database takes of a value equals a client's.

CREATE FUNCTION agent.idempotency_canonical_json(p_value jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    AS $$
declare
  v_out text;
  v_type text := pg_catalog.jsonb_typeof(p_value);
begin
  if v_type = 'object' then
    select pg_catalog.string_agg(
             pg_catalog.to_jsonb(e.key)::text || ':' ||
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by case when e.key ~ '[\uE000-\uFFFF]' then agent.idempotency_utf16_order(e.key)
                              else pg_catalog.convert_to(e.key, 'UTF8') end)
      into v_out
      from pg_catalog.jsonb_each(p_value) e;
    return '{' || coalesce(v_out, '') || '}';
  elsif v_type = 'array' then
    select pg_catalog.string_agg(
             case pg_catalog.jsonb_typeof(e.value)
               when 'object' then agent.idempotency_canonical_json(e.value)
               when 'array' then agent.idempotency_canonical_json(e.value)
               when 'number' then
                 case when e.value::text ~ '^-?(0|[1-9][0-9]{0,14})(\.[0-9]{0,14})?$'
                           and pg_catalog.char_length(pg_catalog.rtrim(pg_catalog.replace(pg_catalog.ltrim(e.value::text, '-0'), '.', ''), '0')) <= 15
                           and (pg_catalog.abs(e.value::numeric) >= 0.000001 or e.value::numeric = 0)
                      then pg_catalog.trim_scale(e.value::numeric)::text
                      else agent.idempotency_json_number(e.value::numeric) end
               else e.value::text
             end,
             ',' order by e.position)
      into v_out
      from pg_catalog.jsonb_array_elements(p_value) with ordinality e(value, position);
    return '[' || coalesce(v_out, '') || ']';
  elsif v_type = 'number' then
    return agent.idempotency_json_number(p_value::numeric);
  end if;
  return p_value::text;
end;
$$;

ALTER FUNCTION agent.idempotency_canonical_json(p_value jsonb) OWNER TO idempotency_owner;
