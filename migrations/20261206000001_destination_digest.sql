-- A destination's keyed digest: HMAC-SHA256 under the subscriber key over the tenant, the
-- channel and the destination in its normal form (see the ledger's `crypto`), stored beside
-- its ciphertext. A post of the destination a contact already holds is recognised without
-- opening it and changes nothing, so a provider's flag (invalid, opted out) is cleared only
-- when the destination really changes.
--
-- A delivery records the digest of the destination its send used, stamped by the fence that
-- started it: a provider's answer or a late receipt flags the contact only while the contact
-- still holds that destination, never a number stored since.
--
-- NULL on rows written before: such a contact keeps its flags when it is next written (the
-- safe side: an opt-out is never cleared on a guess), and a delivery fenced before matches
-- only a contact that has not been written since. No CHECK: adding one would scan the
-- deliveries under an exclusive lock; the ledger writes 32 bytes or nothing.
ALTER TABLE contacts ADD COLUMN destination_digest bytea NULL;
ALTER TABLE deliveries ADD COLUMN destination_digest bytea NULL;
