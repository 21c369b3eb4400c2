-- The janitor's watchdog looks for reminders whose time has come but that have no delivery
-- (a materialisation bug would leave them silently dropped); it scans a bounded recent range.
CREATE INDEX reminders_due_idx ON reminders (scheduled_at) WHERE cancelled_at IS NULL;
