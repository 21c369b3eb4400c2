-- The outbox of delivery events (DESIGN invariant 13, decision 0601): every change of a
-- delivery that a client can see writes its event in the same statement, by a trigger on
-- `deliveries`, so no path that changes a delivery can forget it and no event exists for a
-- change that rolled back. An event names ids, states, classes and times; never a
-- destination, content or subscriber reference.
--
-- The cursor. `id` is allocated at insert, in no commit order, so a reader taking "id > the
-- last one" would skip an event whose transaction commits after a later one's. `position` is
-- therefore given after commit, by one sequencer at a time (`nudge_sequence_delivery_events`,
-- called by the janitor, serialised by an advisory lock held to its commit): it numbers the
-- events it can see that have none, in id order, so an event committed later gets a later
-- position than every one already numbered, and a reader paging by position never skips one.
-- A delivery's events come in its order: the second of two changes to one delivery waits for
-- the first's commit (the row's lock), so whoever sees the second sees the first.
--
-- Adding `deliveries.event_seq` with a constant default rewrites nothing (PostgreSQL 11+).

CREATE TABLE delivery_events (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_uuid          uuid NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    tenant_id           uuid NOT NULL,
    delivery_id         uuid NOT NULL,
    reminder_id         uuid NOT NULL,
    -- The client's own id of the reminder (never PHI: the API refuses nothing else there).
    event_id            text NOT NULL,
    channel             text NOT NULL,
    -- The delivery's own count of events, 1 for its first: the order per delivery.
    delivery_seq        integer NOT NULL CHECK (delivery_seq >= 1),
    kind                text NOT NULL CHECK (kind IN (
        'scheduled', 'deferred', 'sent', 'delivered', 'failed', 'expired', 'cancelled',
        'suppressed', 'held_ambiguous', 'redriven', 'rescheduled')),
    state               text NOT NULL,
    previous_state      text,
    lane                text NOT NULL,
    attempt_count       integer NOT NULL,
    error_class         text,
    reason              text CHECK (length(reason) <= 200),
    -- When a waiting delivery is next due (`scheduled`, `deferred`, `redriven`,
    -- `rescheduled`).
    next_attempt_at     timestamptz,
    provider_message_id text CHECK (length(provider_message_id) <= 256),
    occurred_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    position            bigint UNIQUE
);

CREATE INDEX delivery_events_unsequenced_idx ON delivery_events (id) WHERE position IS NULL;
CREATE INDEX delivery_events_tenant_position_idx ON delivery_events (tenant_id, position)
    WHERE position IS NOT NULL;

CREATE SEQUENCE delivery_event_positions AS bigint;

-- A delivery's count of events: 0 for those made before events, 1 from its insert (whose event
-- is its first), one more with each later event.
ALTER TABLE deliveries ADD COLUMN event_seq integer NOT NULL DEFAULT 0;
ALTER TABLE deliveries ALTER COLUMN event_seq SET DEFAULT 1;

-- Which change is which event: `scheduled` (made), `suppressed` (made or settled so),
-- `deferred` (waiting for a retry, a slot or quiet hours), `sent` (the provider accepted),
-- `delivered` (a receipt settled a delivery that was held or waiting), `failed`
-- (dead-lettered), `held_ambiguous`, `expired`, `cancelled`, `redriven` (a dead letter fed
-- again) and `rescheduled` (its time moved). Claims, leases and a lease given back are the
-- engine's own steps: no event.
CREATE FUNCTION public.nudge_delivery_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    k text;
    class text := NEW.last_error_class;
    why text := NEW.last_error_reason;
BEGIN
    IF TG_OP = 'INSERT' THEN
        -- Made waiting, or (a restore's reconciliation) made as it was found.
        k := CASE NEW.state WHEN 'suppressed' THEN 'suppressed'
                            WHEN 'ambiguous' THEN 'held_ambiguous'
                            WHEN 'delivered' THEN 'delivered'
                            WHEN 'dead_lettered' THEN 'failed'
                            WHEN 'expired' THEN 'expired'
                            WHEN 'cancelled' THEN 'cancelled'
                            ELSE 'scheduled' END;
    ELSIF NEW.state IS DISTINCT FROM OLD.state THEN
        k := CASE
            WHEN OLD.state = 'dead_lettered' AND NEW.state IN ('scheduled', 'retry_wait', 'queued')
                THEN 'redriven'
            WHEN NEW.state = 'retry_wait' THEN 'deferred'
            WHEN NEW.state = 'delivered' AND OLD.state = 'sending' THEN 'sent'
            WHEN NEW.state = 'delivered' THEN 'delivered'
            WHEN NEW.state = 'dead_lettered' THEN 'failed'
            WHEN NEW.state = 'ambiguous' THEN 'held_ambiguous'
            WHEN NEW.state IN ('expired', 'cancelled', 'suppressed') THEN NEW.state
            WHEN NEW.state = 'scheduled' AND NEW.scheduled_at IS DISTINCT FROM OLD.scheduled_at
                THEN 'rescheduled'
        END;
    ELSIF NEW.scheduled_at IS DISTINCT FROM OLD.scheduled_at THEN
        k := 'rescheduled';
    END IF;
    IF k IS NULL THEN
        RETURN NEW;
    END IF;
    -- A wait without an attempt of its own: the lease deferred it (the provider account's
    -- rate, pause or the tenant's share: `rate_limited`), or a lease was given back unsent (a
    -- worker stopping or lost: `returned_unsent`), unless the subscriber's quiet hours or a
    -- missing account say why. The last attempt's class and reason are not this wait's.
    IF k = 'deferred' AND (OLD.state = 'queued' OR NEW.attempt_count < OLD.attempt_count) THEN
        class := NULL;
        why := CASE WHEN why IN ('quiet_hours', 'account_unavailable') THEN why
                    WHEN OLD.state = 'queued' THEN 'rate_limited'
                    ELSE 'returned_unsent' END;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        NEW.event_seq := OLD.event_seq + 1;
    END IF;
    INSERT INTO public.delivery_events (
        tenant_id, delivery_id, reminder_id, event_id, channel, delivery_seq, kind, state,
        previous_state, lane, attempt_count, error_class, reason, next_attempt_at,
        provider_message_id)
    SELECT NEW.tenant_id, NEW.id, NEW.reminder_id, r.event_id, NEW.channel, NEW.event_seq, k,
           NEW.state, CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END, NEW.lane,
           NEW.attempt_count, class, left(why, 200),
           CASE WHEN NEW.state IN ('scheduled', 'retry_wait', 'queued')
                THEN NEW.next_attempt_at END,
           NEW.provider_message_id
    FROM public.reminders r WHERE r.id = NEW.reminder_id;
    RETURN NEW;
END $$;

-- After the insert: a BEFORE trigger would also fire for a row that `ON CONFLICT DO NOTHING`
-- then skips (materialisation inserts what may exist already), writing an event for nothing.
CREATE TRIGGER deliveries_event_insert AFTER INSERT ON deliveries
    FOR EACH ROW EXECUTE FUNCTION public.nudge_delivery_event();
CREATE TRIGGER deliveries_event_update BEFORE UPDATE OF state, scheduled_at ON deliveries
    -- The claim (to `queued`) and the lease (to `sending`) are the busiest changes and never
    -- an event: the condition keeps the function from being called for them.
    FOR EACH ROW WHEN ((NEW.state IS DISTINCT FROM OLD.state
                        AND NEW.state NOT IN ('queued', 'sending'))
                       OR NEW.scheduled_at IS DISTINCT FROM OLD.scheduled_at)
    EXECUTE FUNCTION public.nudge_delivery_event();

-- A receipt that confirms a delivery the provider had accepted (`sent`) changes no state, but
-- the client is told: `delivered`. One that settles a held delivery is the state change's
-- event above.
CREATE FUNCTION public.nudge_receipt_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    d public.deliveries%ROWTYPE;
BEGIN
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

CREATE TRIGGER provider_events_delivered_event AFTER INSERT ON provider_events
    FOR EACH ROW WHEN (NEW.outcome = 'delivered' AND NOT NEW.settled
                       AND NEW.delivery_id IS NOT NULL)
    EXECUTE FUNCTION public.nudge_receipt_event();

-- Numbers at most `max_events` of the events it sees without a position, in id order, and
-- returns how many. One caller at a time (an advisory lock; another caller
-- meanwhile numbers none and returns -1): two would interleave their numbers.
CREATE FUNCTION public.nudge_sequence_delivery_events(max_events integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    numbered integer;
    base bigint;
BEGIN
    IF max_events IS NULL OR max_events < 1 OR max_events > 100000 THEN
        RAISE EXCEPTION 'max_events must be 1 to 100000' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- "nudgeEvs"
    IF NOT pg_try_advisory_xact_lock(7959378311690679923) THEN
        RETURN -1;
    END IF;
    -- Only this function, under the lock, moves the sequence: the block it takes is its own.
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO base
    FROM public.delivery_event_positions;
    WITH next AS (
        SELECT e.id, row_number() OVER (ORDER BY e.id) AS rn
        FROM (SELECT id FROM public.delivery_events
              WHERE position IS NULL
              ORDER BY id
              LIMIT max_events) e
    )
    UPDATE public.delivery_events e SET position = base + n.rn
    FROM next n WHERE e.id = n.id;
    GET DIAGNOSTICS numbered = ROW_COUNT;
    IF numbered > 0 THEN
        PERFORM setval('public.delivery_event_positions', base + numbered);
    END IF;
    RETURN numbered;
END $$;

REVOKE ALL ON FUNCTION public.nudge_delivery_event() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_receipt_event() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_sequence_delivery_events(integer) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT ON public.delivery_events TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.delivery_events TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_sequence_delivery_events(integer)
            TO nudge_janitor;
    END IF;
END $$;
