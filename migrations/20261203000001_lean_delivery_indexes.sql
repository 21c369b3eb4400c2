-- Fewer indexes on deliveries: every state change of a delivery (claim, lease, outcome) is a
-- new row version that PostgreSQL enters in every index whose predicate it meets, so each
-- index costs three or four entries per delivery on the send path.
--
-- * The idempotency key is a function of (reminder_id, channel)
--   (`nudge_domain::IdempotencyKey::for_delivery`), which is already unique: a CHECK holds the
--   key to that function, so two deliveries can never share a key, and its unique index goes.
--   A key quoted by a provider is found through (reminder_id, channel), which it spells out.
-- * `deliveries_reminder_idx` (reminder_id) is the leading column of the
--   (reminder_id, channel) unique index.
-- * `deliveries_due_idx` (next_attempt_at, all channels) has no reader left: the relay claims
--   per channel through `deliveries_due_channel_idx`.

ALTER TABLE deliveries
    ADD CONSTRAINT deliveries_idempotency_key_derived
        CHECK (idempotency_key = 'nudge-' || reminder_id::text || '-' || channel) NOT VALID;
ALTER TABLE deliveries VALIDATE CONSTRAINT deliveries_idempotency_key_derived;
ALTER TABLE deliveries DROP CONSTRAINT deliveries_idempotency_key_key;
DROP INDEX deliveries_reminder_idx;
DROP INDEX deliveries_due_idx;
