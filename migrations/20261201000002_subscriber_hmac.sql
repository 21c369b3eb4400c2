-- Subscriber references at rest: a keyed hash (HMAC-SHA256 under crypto.subscriber_key, 64
-- lowercase hex digits) instead of the client's identifier. The key lives outside the
-- database, so this migration cannot convert existing rows: it marks them (false), and
-- `nudgectl migrate` with the key configured converts them in batches, each subscriber's
-- contacts (re-encrypted: a destination's associated data names the stored reference) and
-- reminders in one transaction, so a reader's join never sees one side converted alone.
ALTER TABLE reminders ADD COLUMN subscriber_ref_keyed boolean NOT NULL DEFAULT false;
ALTER TABLE contacts ADD COLUMN subscriber_ref_keyed boolean NOT NULL DEFAULT false;

ALTER TABLE reminders ADD CONSTRAINT reminders_subscriber_ref_keyed_form
    CHECK (NOT subscriber_ref_keyed OR subscriber_ref ~ '^[0-9a-f]{64}$');
ALTER TABLE contacts ADD CONSTRAINT contacts_subscriber_ref_keyed_form
    CHECK (NOT subscriber_ref_keyed OR subscriber_ref ~ '^[0-9a-f]{64}$');

-- What the conversion still has to do; empty once it is done.
CREATE INDEX reminders_plaintext_subscriber_idx ON reminders (tenant_id, subscriber_ref)
    WHERE NOT subscriber_ref_keyed;
CREATE INDEX contacts_plaintext_subscriber_idx ON contacts (tenant_id, subscriber_ref)
    WHERE NOT subscriber_ref_keyed;
