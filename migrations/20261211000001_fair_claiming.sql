-- Fair claiming across tenants (invariant 14): the relay hands a channel's due work out in
-- weighted turns per tenant, oldest first within a tenant, instead of oldest first across all.
--
-- * `tenants.claim_weight`: a tenant's share of each claim relative to the others with due work
--   on the channel (`nudgectl tenant set TENANT --weight N --reason`), 1 by default.
-- * `deliveries_due_tenant_idx` serves both halves of the claim: "does this tenant have due
--   work on the channel" (one probe per tenant) and "its oldest due deliveries" (ties, a batch
--   due at one instant, in the order of their ids: UUIDv7, so creation order). It replaces
--   `deliveries_due_channel_idx`, whose one reader was the claim, so the send path still
--   writes the same number of index entries per delivery.

ALTER TABLE tenants
    ADD COLUMN claim_weight integer NOT NULL DEFAULT 1
        CHECK (claim_weight BETWEEN 1 AND 1000);

CREATE INDEX deliveries_due_tenant_idx ON deliveries (channel, tenant_id, next_attempt_at, id)
    WHERE state IN ('scheduled', 'retry_wait');

DROP INDEX deliveries_due_channel_idx;
