-- The burst a provider was found to take back to back, when a 429 came while the bucket was
-- spending a larger one: admission uses it instead of the configured burst until an operator
-- reconfigures the bucket (see nudge_domain::admission::on_throttled_after). burst_from: when
-- the bucket last admitted with its whole burst available; burst_cut_at: the last shrink.
ALTER TABLE rate_buckets
    ADD COLUMN burst_limit integer NULL CHECK (burst_limit IS NULL OR burst_limit >= 1),
    ADD COLUMN burst_from timestamptz NULL,
    ADD COLUMN burst_cut_at timestamptz NULL;
