-- agent.idempotency_delete_expired
--
-- Deletes the given claims (public) that are still past retention; answers
-- how many.

CREATE FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $$
declare
  v_deleted integer;
begin
  if p_ids is null then
    raise exception 'p_ids is required' using errcode = '22023';
  end if;
  if cardinality(p_ids) > 100000 then
    raise exception 'p_ids holds % ids; at most 100000 per call', cardinality(p_ids)
      using errcode = '22023';
  end if;
  if array_position(p_ids, null) is not null then
    raise exception 'p_ids holds a NULL at position %', array_position(p_ids, null) using errcode = '22023';
  end if;
  -- A row another transaction holds is left for the next pass: the sweep
  -- never waits on a claim, so it never takes part in a cycle of waits.
  delete from agent.idempotency_keys k
   where k.id in (select x.id
                    from agent.idempotency_keys x
                   where x.id = any (p_ids)
                     and x.retain_until < now()
                     for update of x skip locked);
  get diagnostics v_deleted = row_count;
  return v_deleted;
end
$$;

ALTER FUNCTION agent.idempotency_delete_expired(p_ids uuid[]) OWNER TO idempotency_owner;
