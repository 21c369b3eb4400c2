-- Series, as reviewed (issue 25; docs/decisions/0504-a-series-is-expanded-by-the-window-that-reaches-it.md):
--
-- * `series.next_local`: the wall-clock time the rule gave the next occurrence not created yet
--   (beside its instant, `next_at`). The expansion resumes from it resolved under the tz rules
--   of the build that runs it, or from `next_at` if that is earlier, so a tz database that
--   moves an occurrence earlier cannot skip it. NULL where only `next_at` is known (a series
--   written before this migration, filled here where PostgreSQL knows the zone): the
--   expansion then resumes from `next_at`.
-- * `reminders.content_from_series`: an occurrence's content is its series' (read from the
--   series at the lease) while this holds; a reschedule clears it, so the occurrence then
--   sends the content the reschedule gave, or none, never the series' again. Set here for the
--   occurrences already created without content of their own.

ALTER TABLE series
    ADD COLUMN next_local timestamp(0) without time zone NULL;

UPDATE series SET next_local = (next_at AT TIME ZONE time_zone)::timestamp(0)
WHERE next_at IS NOT NULL AND time_zone IN (SELECT name FROM pg_catalog.pg_timezone_names);

ALTER TABLE reminders
    ADD COLUMN content_from_series boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT reminders_content_from_a_series
        CHECK (NOT content_from_series OR series_key IS NOT NULL);

UPDATE reminders SET content_from_series = true
WHERE series_key IS NOT NULL AND content_ciphertext IS NULL;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_producer') THEN
        GRANT UPDATE (next_local) ON public.series TO nudge_producer;
    END IF;
END $$;
