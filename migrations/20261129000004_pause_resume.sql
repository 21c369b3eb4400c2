-- When a tenant's intake was paused: on resume, reminders created since then whose window
-- already ran get their deliveries (nothing created during a pause is left behind).
ALTER TABLE tenants ADD COLUMN intake_paused_at timestamptz NULL;
CREATE INDEX reminders_created_idx ON reminders (tenant_id, created_at);
