-- Recurring reminders (issue 25, point 4; docs/decisions/0503-series-expand-in-floating-time.md
-- and 0504-a-series-is-expanded-by-the-window-that-reaches-it.md):
--
-- * `series`: what `POST /v1/tenants/{tenant}/series` recorded, idempotent on
--   `(tenant_id, series_id)`: the subscriber (keyed, as on reminders), channels, content (sealed,
--   bound to the series' id), the zone, the start in local time, the RRULE as posted and each
--   occurrence's lifetime. `next_at` is the instant of the first occurrence not created yet
--   (NULL: none left, or cancelled); the producer's window that reaches it creates the
--   occurrences up to its end, in its own transaction, and moves it on. So a series holds as
--   many reminder rows as its occurrences inside the producer's horizon, however long it runs.
-- * `reminders.series_key`: the series an occurrence belongs to. Its event id is
--   `{series_id}/{local date-time the rule gave}`, so a replayed window creates none twice
--   (the unique `(tenant_id, event_id)`). Its content is the series' (`content_ciphertext`
--   NULL on the reminder, read from the series at the lease) unless a reschedule gave it its
--   own.
--
-- Erasure of the subscriber erases their series as it does their reminders (subscriber
-- reference replaced, content dropped, cancelled).

CREATE TABLE series (
    id                  uuid PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id),
    series_id           text NOT NULL,
    subscriber_ref      text NOT NULL,
    channels            text[] NOT NULL CHECK (cardinality(channels) > 0),
    content_ciphertext  bytea NULL,
    time_zone           text NOT NULL,
    start_local         timestamp(0) without time zone NOT NULL,
    rrule               text NOT NULL,
    expires_after_s     integer NOT NULL CHECK (expires_after_s > 0),
    ignore_quiet_hours  boolean NOT NULL DEFAULT false,
    correlation_id      text NULL,
    request_digest      bytea NULL,
    next_at             timestamptz NULL,
    occurrences_created integer NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL,
    cancelled_at        timestamptz NULL,
    erased_at           timestamptz NULL,
    CONSTRAINT series_unique_id UNIQUE (tenant_id, series_id),
    CONSTRAINT series_cancelled_has_no_next CHECK (cancelled_at IS NULL OR next_at IS NULL)
);

-- The window's question: which of this tenant's series have an occurrence before its end.
CREATE INDEX series_next_idx ON series (tenant_id, next_at) WHERE next_at IS NOT NULL;

ALTER TABLE reminders
    ADD COLUMN series_key uuid NULL REFERENCES series (id);

CREATE INDEX reminders_series_idx ON reminders (series_key, scheduled_at)
    WHERE series_key IS NOT NULL;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_producer') THEN
        GRANT SELECT ON public.series TO nudge_producer;
        GRANT UPDATE (next_at, occurrences_created) ON public.series TO nudge_producer;
        GRANT INSERT ON public.reminders TO nudge_producer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT, INSERT, UPDATE ON public.series TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT (id, content_ciphertext) ON public.series TO nudge_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.series TO nudge_janitor;
    END IF;
END $$;
