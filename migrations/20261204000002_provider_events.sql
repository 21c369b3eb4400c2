-- Delivery receipts: what a provider reported about a message after it answered the send
-- (Twilio status callbacks, SendGrid events), recorded once per provider event and against the
-- delivery whose key the receipt carried. A receipt replayed (a provider retrying a webhook, a
-- captured request sent again) hits the unique (account, event key) and changes nothing.
-- A receipt showing the provider took a message settles a delivery held `ambiguous` as
-- `delivered`; one showing it failed settles it `dead_lettered`; bounces and opt-outs flag the
-- contact (`contacts.invalid_at`, `contacts.opted_out_at`). Deleted with their delivery.
CREATE TABLE provider_events (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider_account     text NOT NULL CHECK (provider_account ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    -- The provider's identity of the event (Twilio: message sid and status; SendGrid:
    -- sg_event_id): the replay guard.
    event_key            text NOT NULL CHECK (length(event_key) BETWEEN 1 AND 200),
    -- NULL when the receipt named no delivery of this account (kept for review).
    delivery_id          uuid NULL REFERENCES deliveries (id) ON DELETE CASCADE,
    -- The provider's own status word (`delivered`, `undelivered`, `bounce`, ...).
    status               text NOT NULL CHECK (length(status) BETWEEN 1 AND 64),
    outcome              text NOT NULL CHECK (outcome IN ('progress', 'delivered', 'failed')),
    contact_flag         text NULL CHECK (contact_flag IN ('invalid', 'opted_out')),
    code                 text NULL CHECK (length(code) <= 48),
    provider_message_id  text NULL CHECK (length(provider_message_id) <= 256),
    -- The delivery this receipt settled from `ambiguous`, if it did.
    settled              boolean NOT NULL DEFAULT false,
    received_at          timestamptz NOT NULL,
    UNIQUE (provider_account, event_key)
);
CREATE INDEX provider_events_delivery_idx ON provider_events (delivery_id);
