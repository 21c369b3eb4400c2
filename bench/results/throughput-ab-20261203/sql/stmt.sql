DROP TRIGGER deliveries_event_insert ON deliveries;
DROP TRIGGER deliveries_event_update ON deliveries;
CREATE FUNCTION public.nudge_delivery_events_inserted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.delivery_events (tenant_id, delivery_id, reminder_id, event_id, channel,
        delivery_seq, kind, state, previous_state, lane, attempt_count, error_class, reason,
        next_attempt_at, provider_message_id)
    SELECT n.tenant_id, n.id, n.reminder_id, r.event_id, n.channel, 1,
           CASE n.state WHEN 'suppressed' THEN 'suppressed' ELSE 'scheduled' END,
           n.state, NULL, n.lane, n.attempt_count, n.last_error_class, n.last_error_reason,
           n.next_attempt_at, n.provider_message_id
    FROM new_rows n JOIN public.reminders r ON r.id = n.reminder_id;
    RETURN NULL;
END $$;
CREATE FUNCTION public.nudge_delivery_events_updated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.delivery_events (tenant_id, delivery_id, reminder_id, event_id, channel,
        delivery_seq, kind, state, previous_state, lane, attempt_count, error_class, reason,
        next_attempt_at, provider_message_id)
    SELECT n.tenant_id, n.id, n.reminder_id, r.event_id, n.channel, 1,
           CASE WHEN n.state = 'retry_wait' THEN 'deferred'
                WHEN n.state = 'delivered' AND o.state = 'sending' THEN 'sent'
                ELSE n.state END,
           n.state, o.state, n.lane, n.attempt_count, n.last_error_class, n.last_error_reason,
           n.next_attempt_at, n.provider_message_id
    FROM new_rows n JOIN old_rows o ON o.id = n.id JOIN public.reminders r ON r.id = n.reminder_id
    WHERE (n.state IS DISTINCT FROM o.state AND n.state NOT IN ('queued', 'sending'))
       OR n.scheduled_at IS DISTINCT FROM o.scheduled_at;
    RETURN NULL;
END $$;
CREATE TRIGGER deliveries_events_ins AFTER INSERT ON deliveries REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_delivery_events_inserted();
CREATE TRIGGER deliveries_events_upd AFTER UPDATE ON deliveries REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_delivery_events_updated();
