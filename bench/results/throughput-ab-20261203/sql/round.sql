\set n 20000
INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at, expires_at, created_at)
SELECT gen_random_uuid(), (SELECT id FROM tenants LIMIT 1), 'ev-' || :'tag' || '-' || g, 'sub-' || g, ARRAY['sms'], now(), now() + interval '1 hour', now()
FROM generate_series(1, :n) g;
CREATE TEMP TABLE batch AS SELECT id FROM reminders WHERE event_id LIKE 'ev-' || :'tag' || '-%';
\timing on
INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key, scheduled_at, expires_at, next_attempt_at, created_at, updated_at)
SELECT gen_random_uuid(), b.id, (SELECT id FROM tenants LIMIT 1), 'sms', 'scheduled', 'nudge-' || b.id || '-sms', now(), now() + interval '1 hour', now(), now(), now() FROM batch b;
UPDATE deliveries SET state = 'sending', lease_owner = 'w', lease_expires_at = now() + interval '1 hour' WHERE reminder_id IN (SELECT id FROM batch);
UPDATE deliveries SET state = 'delivered', settled_at = now(), lease_owner = NULL, lease_expires_at = NULL, provider_message_id = 'x' WHERE reminder_id IN (SELECT id FROM batch);
SELECT nudge_sequence_delivery_events(100000);
\timing off
