-- reminders (tenant_id, created_at) served one query, the resume backlog
-- (materialise_paused_backlog), and only as a tenant_id prefix: its created_at condition is
-- OR'ed with a subquery, so no index range can serve it. reminders_window_idx
-- (tenant_id, scheduled_at) WHERE cancelled_at IS NULL gives that query the same plan at the
-- same cost (the query asks cancelled_at IS NULL too), and every import and intake write
-- kept one index fewer up to date.
DROP INDEX IF EXISTS reminders_created_idx;
