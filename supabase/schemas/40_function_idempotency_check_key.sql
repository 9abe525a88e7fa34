-- agent.idempotency_check_key
--
-- Refuses (22023) a missing organization, a scope that is empty, longer than
-- 128 characters or of other characters than a-z, 0-9, '.', '_' and '-', or a
-- key that is empty or longer than 512 characters. Private.

CREATE FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path TO ''
    AS $$
begin
  if p_organization_id is null then
    raise exception 'p_organization_id is required' using errcode = '22023';
  end if;
  if p_scope is null then
    raise exception 'p_scope is required' using errcode = '22023';
  end if;
  if char_length(p_scope) not between 1 and 128 or p_scope ~ '[^a-z0-9._-]' then
    raise exception 'p_scope must be 1 to 128 characters of a-z, 0-9, ".", "_" and "-", got %',
                    pg_catalog.left(p_scope, 128)
      using errcode = '22023';
  end if;
  if p_key is null then
    raise exception 'p_key is required' using errcode = '22023';
  end if;
  if char_length(p_key) not between 1 and 512 then
    raise exception 'p_key must be 1 to 512 characters, got %', char_length(p_key) using errcode = '22023';
  end if;
end
$$;

ALTER FUNCTION agent.idempotency_check_key(p_organization_id uuid, p_scope text, p_key text) OWNER TO idempotency_owner;
