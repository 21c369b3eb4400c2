-- The patient's time (invariant 11; docs/decisions/0501-time-zones-from-a-compiled-in-database.md):
--
-- * `tenants.time_zone`: the tenant's default IANA zone (`nudgectl tenant set TENANT
--   --time-zone Europe/Berlin --reason`), for a local time whose reminder and subscriber give
--   none. NULL: the tenant has no default, and such a local time is refused.
-- * `contacts.time_zone`: the subscriber's zone, kept on each of the subscriber's contacts
--   (one per channel) beside the destination the send already reads with its lease, so that
--   erasure and retention remove it with them. A zone given for a subscriber (`PUT
--   .../contacts`, a reminder's `time_zone`) is written to every contact of that subscriber.
--
-- Names are checked against the tz database compiled into the binaries, never against the
-- host's; the database only bounds their form. Instants stay what they were: a reminder
-- stores the instants its local time resolved to.

ALTER TABLE tenants
    ADD COLUMN time_zone text NULL
        CONSTRAINT tenants_time_zone_form CHECK (time_zone ~ '^[A-Za-z0-9_+/-]{1,64}$');

ALTER TABLE contacts
    ADD COLUMN time_zone text NULL
        CONSTRAINT contacts_time_zone_form CHECK (time_zone ~ '^[A-Za-z0-9_+/-]{1,64}$');
