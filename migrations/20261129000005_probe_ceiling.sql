-- The rate at which a provider last answered 429: admission climbs back quickly to 90% of it
-- and probes slowly around it (see nudge_domain::admission::on_success).
ALTER TABLE rate_buckets ADD COLUMN throttled_rate double precision NULL
    CHECK (throttled_rate IS NULL OR throttled_rate >= 0);
