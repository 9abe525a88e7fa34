-- agent.idempotency_queue_settle
--
-- Ends a batch taken from a queue (public), in one transaction: journals each
-- item's ending fenced by its token, and archives exactly the messages whose
-- ending it journaled (a message is archived if and only if its ending is
-- journaled); a journaled failure is sent to the dead-letter queue once per
-- command (recorded in dead_lettered_at), then archived. A release frees the
-- claim and leaves its messages to come back; leave does nothing (an effect
-- whose outcome is unknown stays under its lease). An item whose claim is no
-- longer the caller's journals nothing and archives nothing. A repeat after a
-- lost answer journals and sends nothing twice.

CREATE FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer DEFAULT NULL::integer) RETURNS SETOF agent.idempotency_queue_settled
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    SET lock_timeout TO '5s'
    AS $_$
declare
  v_items agent.idempotency_queue_ending[];
  v_item agent.idempotency_queue_ending;
  v_orgs uuid[];
  v_claims uuid[];
  v_locked bigint[];
  v_row agent.idempotency_claim;
  v_archive bigint[] := '{}'::bigint[];
  v_body jsonb;
  v_reads integer;
  v_request jsonb;
  v_key text;
  v_lettered boolean;
  v_state text;
  v_message text;
  v_hint text;
  v_index integer;
begin
  perform agent.idempotency_queue_check(p_queue, 'p_queue');
  perform agent.idempotency_queue_check(p_dead_letter_queue, 'p_dead_letter_queue');
  v_items := agent.idempotency_queue_items(p_items, p_row_cap, true);
  select pg_catalog.array_agg(i.organization_id order by i.item), pg_catalog.array_agg(i.claim_id order by i.item)
    into v_orgs, v_claims
    from pg_catalog.unnest(v_items) i;
  select coalesce(pg_catalog.array_agg(distinct m order by m), '{}') into v_locked
    from pg_catalog.unnest(v_items) i
   cross join lateral pg_catalog.unnest(i.msg_ids) m
   where i.ending = 'journal';
  perform agent.idempotency_queue_lock(p_queue, v_locked, v_orgs, v_claims);

  begin
    foreach v_item in array v_items loop
      v_index := v_item.item;
      v_lettered := false;
      if v_item.ending = 'journal' then
        select * into v_row
          from agent.idempotency_complete(v_item.claim_id, v_item.lease_token, v_item.resource_type,
                                          v_item.resource_id, v_item.response, v_item.organization_id);
        if not found then
          -- The claim is no longer this caller's: its messages stay, and
          -- come back to whoever holds it now.
          return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
          continue;
        end if;
        if v_row.response -> 'ok' = 'false'::jsonb then
          update agent.idempotency_keys k
             set dead_lettered_at = pg_catalog.clock_timestamp()
           where k.organization_id = v_item.organization_id and k.id = v_item.claim_id
             and k.dead_lettered_at is null
          returning k.request, k.key into v_request, v_key;
          if found then
            v_body := null;
            v_reads := null;
            if pg_catalog.cardinality(v_item.msg_ids) > 0 then
              execute pg_catalog.format('select q.message, q.read_ct from pgmq.%I q where q.msg_id = $1',
                                        'q_' || p_queue)
                into v_body, v_reads
                using v_item.msg_ids[1];
            end if;
            perform agent.idempotency_queue_letter(
                      p_queue, p_dead_letter_queue, v_item.msg_ids[1], v_reads,
                      coalesce(v_body, pg_catalog.jsonb_build_object('idempotency_key', v_key, 'organization_id', v_item.organization_id,
                                                                 'payload', v_request)),
                      v_row.response);
            v_lettered := true;
          end if;
        end if;
        v_archive := v_archive || v_item.msg_ids;
        return next (v_index, true, pg_catalog.cardinality(v_item.msg_ids), v_lettered)::agent.idempotency_queue_settled;
      elsif v_item.ending = 'release' then
        -- Whether the fence still held changes nothing here: the message is left either way.
        perform agent.idempotency_release(v_item.claim_id, v_item.lease_token, v_item.organization_id);
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      else
        return next (v_index, false, 0, false)::agent.idempotency_queue_settled;
      end if;
    end loop;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text, v_hint = pg_exception_hint;
    raise exception 'p_items[%]: %', v_index, v_message using errcode = v_state, hint = v_hint;
  end;
  if pg_catalog.cardinality(v_archive) > 0 then
    perform pgmq.archive(p_queue, v_archive);
  end if;
end
$_$;

ALTER FUNCTION agent.idempotency_queue_settle(p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer) OWNER TO idempotency_owner;
