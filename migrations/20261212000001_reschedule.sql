-- Reschedule (docs/decisions/0309-reschedule-and-truthful-cancel.md): a client replaces a
-- reminder's schedule and body under a revision that must grow. The first post is revision 0
-- unless it gives one. `revision_digest` is the keyed digest of the body that made the current
-- revision (until the first replacement the post's own `request_digest` stands for it; NULL
-- after an operator's move, which has no body), so that the same revision sent again is told
-- apart from another body under it.
ALTER TABLE reminders
    ADD COLUMN revision        bigint NOT NULL DEFAULT 0 CHECK (revision >= 0),
    ADD COLUMN revision_digest bytea NULL;

-- Each applied reschedule: from and to (schedule and expiry), the channels added and removed,
-- who asked and when (the database's clock). No PHI: times, channel names and a source. Goes
-- with its reminder (retention deletes reminders through its functions; erasure keeps the
-- times, as it keeps the reminder's own).
CREATE TABLE reminder_revisions (
    reminder_id        uuid NOT NULL REFERENCES reminders (id) ON DELETE CASCADE,
    revision           bigint NOT NULL CHECK (revision > 0),
    from_scheduled_at  timestamptz NOT NULL,
    to_scheduled_at    timestamptz NOT NULL,
    from_expires_at    timestamptz NOT NULL,
    to_expires_at      timestamptz NOT NULL,
    channels_added     text[] NOT NULL DEFAULT '{}',
    channels_removed   text[] NOT NULL DEFAULT '{}',
    -- `intake` (the client's PUT) or `nudgectl` (an operator; its audit row names the actor).
    source             text NOT NULL CHECK (source IN ('intake', 'nudgectl')),
    created_at         timestamptz NOT NULL,
    PRIMARY KEY (reminder_id, revision)
);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT, INSERT ON public.reminder_revisions TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.reminder_revisions TO nudge_janitor;
    END IF;
END $$;
