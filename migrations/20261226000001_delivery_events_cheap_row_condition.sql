-- Delivery events: the row trigger that counts an event is called on a condition that costs a
-- statement nothing to prepare (decision 0607).
--
-- `deliveries_event_count` was called WHEN `nudge_delivery_event_kind(...) IS NOT NULL`.
-- PostgreSQL prepares a trigger's WHEN once per statement, and preparing it inlines the SQL
-- functions it calls, parsing and analysing their bodies (two here: the six-argument mapping
-- calls the four-argument one) for every UPDATE of `deliveries` that sets `state` or
-- `scheduled_at`. The claim, the lease and the record are such statements, of a few rows each
-- in a running pipeline: about 60 us of PostgreSQL CPU per statement on the benchmark's machine,
-- the larger part of what events cost the pipeline.
--
-- The WHEN is now the mapping's necessary condition, written out with no function: the state
-- changed and not to `queued` or `sending` (the claim, the lease), or the time moved. Every
-- change the mapping names an event passes it (the mapping returns NULL for any change that
-- fails it). The function called decides with the mapping itself, planned once per session as
-- PL/pgSQL does, and counts only an event: one mapping still, and the same rows counted.

CREATE OR REPLACE FUNCTION public.nudge_delivery_event_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF public.nudge_delivery_event_kind(OLD.state, NEW.state, OLD.scheduled_at,
                                        NEW.scheduled_at, OLD.last_error_reason,
                                        NEW.last_error_reason) IS NOT NULL THEN
        NEW.event_seq := OLD.event_seq + 1;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER deliveries_event_count ON deliveries;
CREATE TRIGGER deliveries_event_count BEFORE UPDATE OF state, scheduled_at ON deliveries
    FOR EACH ROW WHEN ((NEW.state IS DISTINCT FROM OLD.state
                        AND NEW.state NOT IN ('queued', 'sending'))
                       OR NEW.scheduled_at IS DISTINCT FROM OLD.scheduled_at)
    EXECUTE FUNCTION public.nudge_delivery_event_count();
