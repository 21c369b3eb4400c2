-- Delivery events: the gate of migration 20261224000001 in linear time (decision 0606).
--
-- The gate asked whether any row of an UPDATE of `deliveries` changed its `event_seq` with
-- `NOT EXISTS (SELECT 1 FROM updated_new n JOIN updated_old o ON o.id = n.id WHERE ...)`.
-- PostgreSQL plans an EXISTS for its first row, and with the rows expected to differ it chose
-- a nested loop; no row differs in the common case (the claim, the lease, a renewal: no
-- event), so the loop ran to its end, the statement's rows squared. A claim of 155 rows made
-- 24,025 comparisons, and the claim took 2.7 times as long with events as without; one UPDATE
-- of 20,000 rows spent 232 s in the gate.
--
-- 1. A delivery's event count never goes down: a statement that sets `event_seq` lower is
--    refused. Only the triggers of migrations 20261220000001 and 20261224000001 write it, each
--    to one more; a hand-written change may still raise it (it is then no event).
-- 2. The gate compares the sums of the counts before and after the statement: equal exactly
--    when no row changed its count, by 1. Two passes over the transition tables.
-- 3. The check for a receipt that came before the send looks among the rows now `delivered`,
--    each by the receipts' index on `delivery_id`, before joining the rows with what they were.

CREATE FUNCTION public.nudge_delivery_event_seq_kept() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a delivery''s event count never goes down (delivery %: % to %)',
        OLD.id, OLD.event_seq, NEW.event_seq
        USING ERRCODE = 'check_violation';
END $$;

-- Named to fire after `deliveries_event_count` (BEFORE triggers fire in name order), so an
-- event's own count, set there, is the one compared.
CREATE TRIGGER deliveries_event_seq_kept BEFORE UPDATE OF event_seq ON deliveries
    FOR EACH ROW WHEN (NEW.event_seq < OLD.event_seq)
    EXECUTE FUNCTION public.nudge_delivery_event_seq_kept();

REVOKE ALL ON FUNCTION public.nudge_delivery_event_seq_kept() FROM PUBLIC;

CREATE OR REPLACE FUNCTION public.nudge_delivery_events_updated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- No row of the statement is an event: `deliveries_event_count` counted none. A row's
    -- count never goes down (`deliveries_event_seq_kept`), so the statement's rows add up to
    -- the same count before and after exactly when none of them changed it: two passes over
    -- the statement's rows, and no join of them.
    IF (SELECT COALESCE(sum(n.event_seq::bigint), 0) FROM updated_new n)
       = (SELECT COALESCE(sum(o.event_seq::bigint), 0) FROM updated_old o) THEN
        RETURN NULL;
    END IF;
    WITH c AS (
        SELECT n.*, o.state AS previous_state,
               public.nudge_delivery_event_kind(o.state, n.state, o.scheduled_at,
                                                n.scheduled_at, o.last_error_reason,
                                                n.last_error_reason) AS kind,
               o.state = 'queued' OR n.attempt_count < o.attempt_count AS unattempted
        FROM updated_new n JOIN updated_old o ON o.id = n.id)
    INSERT INTO public.delivery_events (
        tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
        previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
        provider_message_id)
    SELECT c.tenant_id, c.id, c.reminder_id, r.event_id, c.channel, c.event_seq, c.kind,
           c.state, c.previous_state, c.lane, c.attempt_count,
           CASE WHEN (c.kind = 'deferred' AND c.unattempted) THEN NULL
                ELSE c.last_error_class END,
           -- A wait without an attempt of its own: the lease deferred it (the provider
           -- account's rate, pause or the tenant's share: `rate_limited`), or a lease was
           -- given back unsent (a worker stopping or lost: `returned_unsent`), unless the
           -- subscriber's quiet hours or a missing account say why. The last attempt's
           -- class and reason are not this wait's.
           left(CASE WHEN NOT (c.kind = 'deferred' AND c.unattempted) THEN c.last_error_reason
                     WHEN c.last_error_reason IN ('quiet_hours', 'account_unavailable')
                         THEN c.last_error_reason
                     WHEN c.previous_state = 'queued' THEN 'rate_limited'
                     ELSE 'returned_unsent' END, 200),
           CASE WHEN c.state IN ('scheduled', 'retry_wait', 'queued') THEN c.next_attempt_at END,
           c.provider_message_id
    FROM c JOIN public.reminders r ON r.id = c.reminder_id
    WHERE c.kind IS NOT NULL;
    -- Sent, and a receipt saying delivered came first (recorded while the delivery was still
    -- `sending`): the client is told now, after the `sent`. Only when there is one: the update
    -- fires this trigger again (for no event).
    -- Looked for among the rows now delivered, each by its receipts' index, before the rows
    -- are joined with what they were.
    IF EXISTS (SELECT 1 FROM updated_new n
               WHERE n.state = 'delivered'
                 AND EXISTS (SELECT 1 FROM public.provider_events pe
                             WHERE pe.delivery_id = n.id AND pe.outcome = 'delivered')) THEN
        WITH confirmed AS (
            UPDATE public.deliveries d SET event_seq = d.event_seq + 1
            FROM updated_new n JOIN updated_old o ON o.id = n.id
            WHERE d.id = n.id AND o.state = 'sending' AND n.state = 'delivered'
              AND EXISTS (SELECT 1 FROM public.provider_events pe
                          WHERE pe.delivery_id = n.id AND pe.outcome = 'delivered')
            RETURNING d.*)
        INSERT INTO public.delivery_events (
            tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
            previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
            provider_message_id)
        SELECT d.tenant_id, d.id, d.reminder_id, r.event_id, d.channel, d.event_seq,
               'delivered', d.state, d.state, d.lane, d.attempt_count, NULL,
               left('receipt: ' || pe.status, 200), NULL,
               COALESCE(pe.provider_message_id, d.provider_message_id)
        FROM confirmed d
        JOIN public.reminders r ON r.id = d.reminder_id
        CROSS JOIN LATERAL (SELECT p.status, p.provider_message_id
                            FROM public.provider_events p
                            WHERE p.delivery_id = d.id AND p.outcome = 'delivered'
                            ORDER BY p.id LIMIT 1) pe;
    END IF;
    RETURN NULL;
END $$;
