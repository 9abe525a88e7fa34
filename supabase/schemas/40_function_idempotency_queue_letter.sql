-- agent.idempotency_queue_letter
--
-- Sends one dead letter (private): the message's members and a dead_letter
-- member saying where it came from and how it failed (queue, msg_id, reads,
-- the message as read, the failure), as the consumers' dead letters always
-- were. A malformed message goes as its text (message_text), so the
-- dead-letter queue stays readable by every client.

CREATE FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  if p_failure ->> 'error' = 'malformed_message' then
    -- What no client could read goes on as text, so the dead-letter queue
    -- stays readable by every client.
    perform pgmq.send(p_dead_letter_queue,
                      pg_catalog.jsonb_build_object(
                        'dead_letter', pg_catalog.jsonb_build_object(
                          'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message_text', p_message::text,
                          'failure', pg_catalog.jsonb_build_object(
                            'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
    return;
  end if;
  perform pgmq.send(p_dead_letter_queue,
                    case when pg_catalog.jsonb_typeof(p_message) = 'object' then p_message else '{}'::jsonb end
                    || pg_catalog.jsonb_build_object(
                         'dead_letter', pg_catalog.jsonb_build_object(
                           'queue', p_queue, 'msg_id', p_msg_id, 'reads', p_read_ct, 'message', p_message,
                           'failure', pg_catalog.jsonb_build_object(
                             'ok', false, 'error', p_failure -> 'error', 'output', p_failure -> 'output'))));
end
$$;

ALTER FUNCTION agent.idempotency_queue_letter(p_queue text, p_dead_letter_queue text, p_msg_id bigint, p_read_ct integer, p_message jsonb, p_failure jsonb) OWNER TO idempotency_owner;
