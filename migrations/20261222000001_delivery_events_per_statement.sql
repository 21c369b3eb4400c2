-- Delivery events written per statement (decision 0601, its cost measured in
-- bench/results/throughput-ab-20261203): the row trigger of migration 20261220000001 called
-- PL/pgSQL and ran one insert for every delivery that changed, about 120 us an event on the
-- benchmark's machine, a fifth of the pipeline's throughput. The engine changes deliveries in
-- batches (materialisation inserts a post's deliveries in one statement, a worker settles its
-- outcomes in one), so the events are now written once per statement, set-based, from the
-- statement's transition tables (about 20 us an event written, in SQL; what the pipeline gains
-- is decision 0603's measurement). What is written is unchanged: the same
-- kinds for the same changes, in the same transaction, by no path that can forget.
--
-- A delivery's count of events (`deliveries.event_seq`, each event's `delivery_seq`) is still
-- kept on the row before it is written: an AFTER statement trigger cannot change the rows it
-- sees, so a BEFORE row trigger counts, called only for a change that is an event (its WHEN
-- is the same mapping the statement's insert uses), and does nothing else.
--
-- A statement with several changes to `deliveries` (a WITH of several updates) fires each
-- statement trigger once, its transition tables holding every row the statement changed;
-- an `INSERT ... ON CONFLICT DO NOTHING` lists only the rows it inserted.

DROP TRIGGER deliveries_event_insert ON deliveries;
DROP TRIGGER deliveries_event_update ON deliveries;
DROP FUNCTION public.nudge_delivery_event();

-- Which change is which event, or NULL for a change that is none: `old_state` is NULL for an
-- insert. The same mapping as migration 20261220000001's row trigger: made `scheduled` (or
-- as a restore's reconciliation found it), `redriven`, `deferred`, `sent`, `delivered`,
-- `failed`, `held_ambiguous`, `expired`, `cancelled`, `suppressed`, `rescheduled`; claims,
-- leases and a lease given back are the engine's own steps. A SQL function the planner
-- inlines into both callers: one mapping.
CREATE FUNCTION public.nudge_delivery_event_kind(
    old_state text, new_state text, old_scheduled_at timestamptz, new_scheduled_at timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN old_state IS NULL THEN
            CASE new_state WHEN 'suppressed' THEN 'suppressed'
                           WHEN 'ambiguous' THEN 'held_ambiguous'
                           WHEN 'delivered' THEN 'delivered'
                           WHEN 'dead_lettered' THEN 'failed'
                           WHEN 'expired' THEN 'expired'
                           WHEN 'cancelled' THEN 'cancelled'
                           ELSE 'scheduled' END
        -- Claimed or leased (to `queued` or `sending`) with its time unchanged: the engine's
        -- own step, whatever the state before.
        WHEN new_state IS DISTINCT FROM old_state AND new_state IN ('queued', 'sending')
             AND new_scheduled_at IS NOT DISTINCT FROM old_scheduled_at THEN NULL
        WHEN new_state IS DISTINCT FROM old_state THEN
            CASE
                WHEN old_state = 'dead_lettered'
                     AND new_state IN ('scheduled', 'retry_wait', 'queued') THEN 'redriven'
                WHEN new_state = 'retry_wait' THEN 'deferred'
                WHEN new_state = 'delivered' AND old_state = 'sending' THEN 'sent'
                WHEN new_state = 'delivered' THEN 'delivered'
                WHEN new_state = 'dead_lettered' THEN 'failed'
                WHEN new_state = 'ambiguous' THEN 'held_ambiguous'
                WHEN new_state IN ('expired', 'cancelled', 'suppressed') THEN new_state
                WHEN new_state = 'scheduled'
                     AND new_scheduled_at IS DISTINCT FROM old_scheduled_at THEN 'rescheduled'
            END
        WHEN new_scheduled_at IS DISTINCT FROM old_scheduled_at THEN 'rescheduled'
    END
$$;

-- Counts the event the statement's trigger will write for this row.
CREATE FUNCTION public.nudge_delivery_event_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.event_seq := OLD.event_seq + 1;
    RETURN NEW;
END $$;

CREATE TRIGGER deliveries_event_count BEFORE UPDATE OF state, scheduled_at ON deliveries
    FOR EACH ROW WHEN (public.nudge_delivery_event_kind(OLD.state, NEW.state, OLD.scheduled_at,
                                                        NEW.scheduled_at) IS NOT NULL)
    EXECUTE FUNCTION public.nudge_delivery_event_count();

CREATE FUNCTION public.nudge_delivery_events_inserted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.delivery_events (
        tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
        previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
        provider_message_id)
    SELECT n.tenant_id, n.id, n.reminder_id, r.event_id, n.channel, n.event_seq,
           public.nudge_delivery_event_kind(NULL, n.state, NULL, n.scheduled_at),
           n.state, NULL, n.lane, n.attempt_count, n.last_error_class,
           left(n.last_error_reason, 200),
           CASE WHEN n.state IN ('scheduled', 'retry_wait', 'queued') THEN n.next_attempt_at END,
           n.provider_message_id
    FROM inserted n JOIN public.reminders r ON r.id = n.reminder_id;
    RETURN NULL;
END $$;

CREATE FUNCTION public.nudge_delivery_events_updated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.delivery_events (
        tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
        previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
        provider_message_id)
    SELECT c.tenant_id, c.id, c.reminder_id, r.event_id, c.channel, c.event_seq, c.kind,
           c.state, c.previous_state, c.lane, c.attempt_count,
           CASE WHEN (c.kind = 'deferred' AND c.unattempted) THEN NULL ELSE c.last_error_class END,
           -- A wait without an attempt of its own: the lease deferred it (the provider
           -- account's rate, pause or the tenant's share: `rate_limited`), or a lease was
           -- given back unsent (a worker stopping or lost: `returned_unsent`), unless the
           -- subscriber's quiet hours or a missing account say why. The last attempt's class
           -- and reason are not this wait's.
           left(CASE WHEN NOT (c.kind = 'deferred' AND c.unattempted) THEN c.last_error_reason
                     WHEN c.last_error_reason IN ('quiet_hours', 'account_unavailable')
                         THEN c.last_error_reason
                     WHEN c.previous_state = 'queued' THEN 'rate_limited'
                     ELSE 'returned_unsent' END, 200),
           CASE WHEN c.state IN ('scheduled', 'retry_wait', 'queued') THEN c.next_attempt_at END,
           c.provider_message_id
    FROM (SELECT n.*, o.state AS previous_state,
                 public.nudge_delivery_event_kind(o.state, n.state, o.scheduled_at,
                                                  n.scheduled_at) AS kind,
                 o.state = 'queued' OR n.attempt_count < o.attempt_count AS unattempted
          FROM updated_new n JOIN updated_old o ON o.id = n.id) c
    JOIN public.reminders r ON r.id = c.reminder_id
    WHERE c.kind IS NOT NULL;
    RETURN NULL;
END $$;

CREATE TRIGGER deliveries_events_inserted AFTER INSERT ON deliveries
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_delivery_events_inserted();
-- Every update statement, the claims and leases too (a trigger with transition tables takes
-- no column list); theirs write nothing and cost the join of their transition tables.
CREATE TRIGGER deliveries_events_updated AFTER UPDATE ON deliveries
    REFERENCING OLD TABLE AS updated_old NEW TABLE AS updated_new
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_delivery_events_updated();

REVOKE ALL ON FUNCTION public.nudge_delivery_event_count() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_delivery_events_inserted() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_delivery_events_updated() FROM PUBLIC;
