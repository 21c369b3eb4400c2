-- Quiet hours (issue 25, invariant 11; docs/decisions/0502-quiet-hours-at-the-lease-and-the-fence.md):
--
-- * `tenant_quiet_hours`: per tenant and channel, a daily window of the subscriber's wall-clock
--   time in which nothing is sent on the channel (`nudgectl tenant quiet-hours set TENANT
--   --channel sms --from 21:00 --to 08:00 --reason`). `quiet_to` not after `quiet_from`: the
--   window ends the next day. No row: no quiet hours on that channel.
-- * `tenants.quiet_hours_ignorable`: whether the tenant's reminders may say
--   `"quiet_hours": "ignore"` (urgent classes, such as a cancelled appointment).
-- * `contacts.quiet_from`/`quiet_to`/`quiet_off`/`quiet_set_at`: the subscriber's own window,
--   or none at all, or (both NULL, not off) the tenant's, as `PUT .../contacts` last gave it,
--   written on their contacts with when. The subscriber's setting is the one of their contacts
--   with the latest `quiet_set_at`, so a contact added later follows it, and one a concurrent
--   write held (skipped, not waited for) is outranked. Erasure and retention, which delete
--   contacts, take it with them.
-- * `reminders.ignore_quiet_hours`: the reminder said `"quiet_hours": "ignore"`; it counts
--   only while its tenant allows it (read at each lease).
--
-- The window is read in the subscriber's zone, else the tenant's; without either, no window
-- applies and the delivery is sent as it would have been (the ledger refuses a window for a
-- tenant without a default zone). A delivery that falls due inside a window goes back as
-- `retry_wait` until the window's end with the reason `quiet_hours`, or settles `expired` with
-- that reason when its expiry comes first.

CREATE TABLE tenant_quiet_hours (
    tenant_id   uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    channel     text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    quiet_from  time(0) without time zone NOT NULL,
    quiet_to    time(0) without time zone NOT NULL,
    updated_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, channel),
    CONSTRAINT tenant_quiet_hours_not_empty CHECK (quiet_from <> quiet_to)
);

ALTER TABLE tenants
    ADD COLUMN quiet_hours_ignorable boolean NOT NULL DEFAULT false;

ALTER TABLE contacts
    ADD COLUMN quiet_from time(0) without time zone NULL,
    ADD COLUMN quiet_to time(0) without time zone NULL,
    ADD COLUMN quiet_off boolean NOT NULL DEFAULT false,
    ADD COLUMN quiet_set_at timestamptz NULL,
    ADD CONSTRAINT contacts_quiet_window CHECK (
        (quiet_from IS NULL AND quiet_to IS NULL)
        OR (quiet_from IS NOT NULL AND quiet_to IS NOT NULL AND quiet_from <> quiet_to
            AND NOT quiet_off)),
    ADD CONSTRAINT contacts_quiet_set CHECK (
        quiet_set_at IS NOT NULL OR (quiet_from IS NULL AND NOT quiet_off));

ALTER TABLE reminders
    ADD COLUMN ignore_quiet_hours boolean NOT NULL DEFAULT false;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT (time_zone, quiet_hours_ignorable) ON public.tenants TO nudge_worker;
        GRANT SELECT ON public.tenant_quiet_hours TO nudge_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT ON public.tenant_quiet_hours TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.tenant_quiet_hours TO nudge_janitor;
    END IF;
END $$;
