-- Fair shares of a provider account between tenants (invariant 14), and one 429 that is only
-- an answer about one request.
--
-- * `tenant_claim_passes`: per channel and tenant, the virtual time of the tenant's next turn
--   in the relay's claim (stride scheduling, decision 0413). Kept between claims, so claims of a
--   few deliveries serve tenants in turn and by weight as one large claim does. Written by the
--   claim itself, for the tenants that had due work.
-- * `tenants.max_share`: an optional cap, the most a tenant may take of any provider account's
--   rate (`nudgectl tenant set TENANT --max-share S`), NULL for none.
-- * `tenant_bucket_shares`: the capped tenants' own GCRA state per bucket, written by admission
--   under the bucket's row lock.
-- * `rate_buckets.last_throttled_at` and `throttled_until`: when the provider last answered 429
--   and until when its Retry-After asked to wait. One 429 alone pauses and slows nothing (its
--   own delivery waits for its retry); another within the confirmation window, or before that
--   Retry-After has passed, pauses or slows the bucket (decision 0120).

CREATE TABLE tenant_claim_passes (
    channel    text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    tenant_id  uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    pass       double precision NOT NULL CHECK (pass = pass AND pass >= 0),
    PRIMARY KEY (channel, tenant_id)
);

ALTER TABLE tenants
    ADD COLUMN max_share double precision CHECK (max_share > 0 AND max_share < 1);

CREATE TABLE tenant_bucket_shares (
    provider_account text NOT NULL,
    channel          text NOT NULL,
    tenant_id        uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    tat              timestamptz NOT NULL,
    PRIMARY KEY (provider_account, channel, tenant_id),
    FOREIGN KEY (provider_account, channel)
        REFERENCES rate_buckets (provider_account, channel) ON DELETE CASCADE
);

ALTER TABLE rate_buckets
    ADD COLUMN last_throttled_at timestamptz,
    ADD COLUMN throttled_until timestamptz;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_producer') THEN
        GRANT SELECT, INSERT, UPDATE ON public.tenant_claim_passes TO nudge_producer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT (id, max_share) ON public.tenants TO nudge_worker;
        GRANT SELECT, INSERT, UPDATE ON public.tenant_bucket_shares TO nudge_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.tenant_claim_passes, public.tenant_bucket_shares TO nudge_janitor;
    END IF;
END $$;
