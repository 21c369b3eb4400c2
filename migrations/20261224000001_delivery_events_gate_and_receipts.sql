-- Delivery events: what they cost a statement that writes none, what receipts tell, and where
-- positions go on after a failover (decision 0605).
--
-- 1. The gate. The statement trigger of migration 20261222000001 runs for every UPDATE of
--    `deliveries`: the claim's, the lease's, the fence's (one per send) and the renewal's too,
--    which write no event but paid its insert's plan, join and reminder lookup each time. It
--    now returns at once unless one of the statement's rows changed its `event_seq`: the row
--    trigger that counts an event (`deliveries_event_count`, called only for a change that is
--    one) sets it to the old count plus one whatever the statement wrote there, so no change
--    that is an event can pass the gate unseen, and a statement that sets `event_seq` itself
--    only makes the trigger look (and find no event).
--
-- 2. The events' uuid is not indexed. It is random (122 bits) and nothing looks an event up by
--    it; the unique index cost every event an insert at a random place of a btree, and every
--    numbering another (the sequencer's update is not HOT).
--
-- 3. Receipts. A receipt saying delivered that arrives before the worker recorded the send
--    (the delivery still `sending`) wrote nothing, and its `sent` later said nothing of it: the
--    `sent` now writes the `delivered` after it, in the same statement. A second receipt
--    saying delivered (Twilio's `read` after `delivered`) wrote another `delivered`: only the
--    first does now (receipts of one delivery are recorded one after another, under its row's
--    lock, so "the first" is the lowest id).
--
-- 4. A delivery given back again for an account that is still missing (`account_unavailable`,
--    rechecked every `producer.republish_after_s` or so) wrote a `deferred` at each recheck:
--    only the first is an event now; a later one changes nothing the client was told but when
--    it is looked at next.

ALTER TABLE delivery_events DROP CONSTRAINT delivery_events_event_uuid_key;

-- The mapping of migration 20261222000001, and one more case that is not an event: given back
-- again for an account still missing (from `queued`, its time unchanged, the reason it was
-- given back for last time and this time `account_unavailable`).
CREATE FUNCTION public.nudge_delivery_event_kind(
    old_state text, new_state text, old_scheduled_at timestamptz, new_scheduled_at timestamptz,
    old_reason text, new_reason text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN old_state = 'queued' AND new_state = 'retry_wait'
             AND old_reason = 'account_unavailable' AND new_reason = 'account_unavailable'
             AND new_scheduled_at IS NOT DISTINCT FROM old_scheduled_at THEN NULL
        ELSE public.nudge_delivery_event_kind(old_state, new_state, old_scheduled_at,
                                              new_scheduled_at)
    END
$$;

DROP TRIGGER deliveries_event_count ON deliveries;
CREATE TRIGGER deliveries_event_count BEFORE UPDATE OF state, scheduled_at ON deliveries
    FOR EACH ROW WHEN (public.nudge_delivery_event_kind(OLD.state, NEW.state, OLD.scheduled_at,
                                                        NEW.scheduled_at, OLD.last_error_reason,
                                                        NEW.last_error_reason) IS NOT NULL)
    EXECUTE FUNCTION public.nudge_delivery_event_count();

CREATE OR REPLACE FUNCTION public.nudge_delivery_events_updated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- No row of the statement is an event: `deliveries_event_count` counted none.
    IF NOT EXISTS (SELECT 1 FROM updated_new n JOIN updated_old o ON o.id = n.id
                   WHERE n.event_seq <> o.event_seq) THEN
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
    IF EXISTS (SELECT 1 FROM updated_new n JOIN updated_old o ON o.id = n.id
               WHERE o.state = 'sending' AND n.state = 'delivered'
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

-- A receipt that confirms a delivery the provider had accepted (`sent`) changes no state, but
-- the client is told `delivered`, once: not again for a later receipt saying the same.
CREATE OR REPLACE FUNCTION public.nudge_receipt_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    d public.deliveries%ROWTYPE;
BEGIN
    -- The delivery's row is locked (the receipt's statement locks it before inserting), so an
    -- earlier receipt of it has committed or is this statement's own.
    IF EXISTS (SELECT 1 FROM public.provider_events pe
               WHERE pe.delivery_id = NEW.delivery_id AND pe.outcome = 'delivered'
                 AND pe.id < NEW.id) THEN
        RETURN NULL;
    END IF;
    UPDATE public.deliveries SET event_seq = event_seq + 1
    WHERE id = NEW.delivery_id AND state = 'delivered'
    RETURNING * INTO d;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO public.delivery_events (
        tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
        previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
        provider_message_id)
    SELECT d.tenant_id, d.id, d.reminder_id, r.event_id, d.channel, d.event_seq, 'delivered',
           d.state, d.state, d.lane, d.attempt_count, NULL, left('receipt: ' || NEW.status, 200),
           NULL, COALESCE(NEW.provider_message_id, d.provider_message_id)
    FROM public.reminders r WHERE r.id = d.reminder_id;
    RETURN NULL;
END $$;

-- 5. Positions after an adopted failover or a reconciled restore. A promoted replica that
--    missed the primary's last commits, or a copy restored from a backup, has its positions'
--    sequence where its copy stopped, below positions a client may have read (and a webhook
--    acknowledged) before: the events numbered next would be skipped by such a reader. When
--    the ledger's identity records a failover it adopted or a restore reconciled, the
--    sequence moves on by 2^40 (about nine years of numbering at 4,000 events a second), under
--    the sequencer's lock: every event numbered from then on is after every position given
--    before, whatever was lost. Events the lost history had numbered and the copy still holds
--    unnumbered, or numbered lower, are read again (at least once, never skipped). The trigger
--    is deferred to the commit: a sequence does not roll back, and a reconciliation's dry run
--    (which rolls back) must move nothing.
CREATE FUNCTION public.nudge_skip_event_positions() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last bigint;
BEGIN
    -- "nudgeEvs", the sequencer's: no round runs meanwhile.
    PERFORM pg_advisory_xact_lock(7959378311690679923);
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO last
    FROM public.delivery_event_positions;
    PERFORM setval('public.delivery_event_positions', last + 1099511627776);
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER ledger_identity_events_skip_event_positions
    AFTER INSERT ON ledger_identity_events DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.event IN ('failover', 'reconciled'))
    EXECUTE FUNCTION public.nudge_skip_event_positions();

REVOKE ALL ON FUNCTION public.nudge_skip_event_positions() FROM PUBLIC;
