-- agent.idempotency_json_number
--
-- The RFC 8785 (JSON Canonicalization Scheme) spelling of a JSON number (private):
-- the IEEE 754 double it denotes, written as ECMAScript's Number::toString
-- writes it (1.0 -> 1, 1e21 -> 1e+21, 1e-7 -> 1e-7). A number whose nearest
-- double is infinity (from 2^1024 - 2^970 up) is refused (22003): no client
-- could read it back.

CREATE FUNCTION agent.idempotency_json_number(p_number numeric) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO ''
    SET extra_float_digits TO '1'
    AS $$
declare
  v_text text;
  v_parts text[];
  v_digits text;
  v_sign text := '';
  v_point integer;
  v_length integer;
begin
  -- 2^1024 - 2^970: from here on, the nearest double is infinity.
  if pg_catalog.abs(p_number) >= 179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792 then
    raise exception 'the number % is beyond every IEEE 754 double: a JSON reader reads it as infinity',
                    pg_catalog.left(p_number::text, 24) || case when pg_catalog.char_length(p_number::text) > 24 then '...' else '' end
      using errcode = '22003';
  end if;
  -- At most 2^-1075 (half the least double) rounds to zero.
  if p_number = 0 or pg_catalog.abs(p_number) * 404804506614621236704990693437834614099113299528284236713802716054860679135990693783920767402874248990374155728633623822779617474771586953734026799881477019843034848553132722728933815484186432682479535356945490137124014966849385397236206711298319112681620113024717539104666829230461005064372655017292012526615415482186989568 <= 1 then
    return '0';
  end if;
  -- PostgreSQL writes a double with the fewest digits that read back as
  -- it (extra_float_digits > 0); what follows only moves the point.
  v_text := p_number::double precision::text;
  if pg_catalog.left(v_text, 1) = '-' then
    v_sign := '-';
    v_text := pg_catalog.substr(v_text, 2);
  end if;
  v_parts := pg_catalog.regexp_match(v_text, '^([0-9]+)(?:\.([0-9]+))?(?:e([+-][0-9]+))?$');
  v_digits := v_parts[1] || coalesce(v_parts[2], '');
  -- The value is 0.<digits> * 10^v_point.
  v_point := pg_catalog.char_length(v_parts[1]) + coalesce(v_parts[3]::integer, 0);
  v_length := pg_catalog.char_length(v_digits);
  v_digits := pg_catalog.ltrim(v_digits, '0');
  v_point := v_point - (v_length - pg_catalog.char_length(v_digits));
  v_digits := pg_catalog.rtrim(v_digits, '0');
  v_length := pg_catalog.char_length(v_digits);
  -- ECMAScript's Number::toString, with k = v_length and n = v_point.
  if v_length <= v_point and v_point <= 21 then
    return v_sign || v_digits || pg_catalog.repeat('0', v_point - v_length);
  elsif 0 < v_point and v_point <= 21 then
    return v_sign || pg_catalog.left(v_digits, v_point) || '.' || pg_catalog.substr(v_digits, v_point + 1);
  elsif -6 < v_point and v_point <= 0 then
    return v_sign || '0.' || pg_catalog.repeat('0', -v_point) || v_digits;
  end if;
  return v_sign || pg_catalog.left(v_digits, 1)
         || case when v_length > 1 then '.' || pg_catalog.substr(v_digits, 2) else '' end
         || 'e' || case when v_point > 0 then '+' else '-' end || pg_catalog.abs(v_point - 1)::text;
end;
$$;

ALTER FUNCTION agent.idempotency_json_number(p_number numeric) OWNER TO idempotency_owner;
