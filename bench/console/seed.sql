-- The console benchmark's ledger (scripts/bench-console.sh): :tenants tenants and :deliveries
-- deliveries, one reminder each, spread over the last :days days, most of them settled history
-- as a ledger that has run for a while holds it:
--   96.5% delivered, 1% dead-lettered (http_400, http_404, poison_message), 0.5% expired,
--   0.2% held ambiguous, 1% scheduled for later, 0.5% due and waiting to retry,
--   0.2% queued, 0.1% being sent;
-- and :audit audit rows. Written as the owner with triggers off (session_replication_role =
-- replica): the delivery events the triggers would write are not what the console reads, and
-- writing a million of them would only make the set-up slower.
\set ON_ERROR_STOP on
SET session_replication_role = replica;
BEGIN;
INSERT INTO tenants (id, name, created_at, updated_at)
SELECT gen_random_uuid(), format('bench-clinic-%s', lpad(t::text, 4, '0')), now(), now()
FROM generate_series(1, :tenants) t;

CREATE TEMP TABLE bench_tenants AS
SELECT id, row_number() OVER (ORDER BY name) - 1 AS n FROM tenants WHERE name LIKE 'bench-clinic-%';

CREATE TEMP TABLE bench_rows AS
SELECT i,
       gen_random_uuid() AS reminder_id,
       gen_random_uuid() AS delivery_id,
       t.id AS tenant_id,
       (ARRAY['push', 'email', 'sms'])[1 + i % 3] AS channel,
       now() - make_interval(secs => (i::double precision / :deliveries) * :days * 86400) AS at,
       CASE
           WHEN i % 1000 < 965 THEN 'delivered'
           WHEN i % 1000 < 975 THEN 'dead_lettered'
           WHEN i % 1000 < 980 THEN 'expired'
           WHEN i % 1000 < 982 THEN 'ambiguous'
           WHEN i % 1000 < 992 THEN 'scheduled'
           WHEN i % 1000 < 997 THEN 'retry_wait'
           WHEN i % 1000 < 999 THEN 'queued'
           ELSE 'sending'
       END AS state
FROM generate_series(0, :deliveries - 1) i JOIN bench_tenants t ON t.n = i % :tenants;

INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
                       expires_at, created_at)
SELECT reminder_id, tenant_id, format('bench-%s', i), format('sub-%s', i % 50000),
       ARRAY[channel],
       CASE WHEN state = 'scheduled' THEN now() + make_interval(mins => 10 + i % 600) ELSE at END,
       CASE WHEN state = 'scheduled' THEN now() + make_interval(mins => 10 + i % 600) ELSE at END
           + interval '1 day',
       at
FROM bench_rows;

INSERT INTO deliveries (id, reminder_id, tenant_id, channel, state, idempotency_key,
                        attempt_count, scheduled_at, expires_at, next_attempt_at, queued_at,
                        lease_owner, lease_expires_at, first_attempt_at, last_attempt_at,
                        provider_account, provider_message_id, last_error_class,
                        last_error_reason, settled_at, created_at, updated_at)
SELECT b.delivery_id, b.reminder_id, b.tenant_id, b.channel, b.state,
       format('nudge-%s-%s', b.reminder_id, b.channel),
       CASE WHEN b.state IN ('scheduled', 'queued') THEN 0 ELSE 1 + b.i % 3 END,
       r.scheduled_at, r.expires_at,
       CASE b.state
           WHEN 'scheduled' THEN r.scheduled_at
           WHEN 'retry_wait' THEN now() - make_interval(secs => b.i % 900)
           WHEN 'queued' THEN now() - make_interval(secs => b.i % 60)
       END,
       CASE WHEN b.state = 'queued' THEN now() - make_interval(secs => b.i % 60) END,
       CASE WHEN b.state = 'sending' THEN 'bench-worker' END,
       CASE WHEN b.state = 'sending' THEN now() + interval '1 minute' END,
       CASE WHEN b.state NOT IN ('scheduled', 'queued') THEN r.scheduled_at END,
       CASE WHEN b.state NOT IN ('scheduled', 'queued') THEN r.scheduled_at END,
       CASE WHEN b.state NOT IN ('scheduled', 'queued') THEN b.channel || '-main' END,
       CASE WHEN b.state = 'delivered' THEN format('prov-%s', b.i) END,
       CASE b.state WHEN 'dead_lettered' THEN 'terminal' WHEN 'retry_wait' THEN 'retryable'
                    WHEN 'ambiguous' THEN 'ambiguous' END,
       CASE b.state
           WHEN 'dead_lettered' THEN (ARRAY['http_400', 'http_404', 'poison_message: delivery_limit'])[1 + b.i % 3]
           WHEN 'retry_wait' THEN 'http_429'
           WHEN 'ambiguous' THEN 'http_502'
           WHEN 'expired' THEN 'expired'
       END,
       CASE WHEN b.state IN ('delivered', 'dead_lettered', 'expired', 'ambiguous')
            THEN r.scheduled_at + interval '1 second' END,
       b.at, b.at
FROM bench_rows b JOIN reminders r ON r.id = b.reminder_id;

INSERT INTO audit_log (at, actor, action, target, reason, incident, details)
SELECT now() - make_interval(secs => a * 60),
       (ARRAY['ops@clinic', 'console:alice', 'console:bob'])[1 + a % 3],
       (ARRAY['rate_set', 'intake_pause', 'intake_resume', 'drain_on', 'drain_off'])[1 + a % 5],
       format('channel:%s', (ARRAY['push', 'email', 'sms'])[1 + a % 3]),
       'benchmark history',
       CASE WHEN a % 10 = 0 THEN format('INC-%s', a / 10) END,
       '{}'::jsonb
FROM generate_series(1, :audit) a;
COMMIT;
SET session_replication_role = origin;
ANALYZE;
