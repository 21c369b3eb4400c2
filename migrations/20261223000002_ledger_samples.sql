-- One sample a minute per channel for the console's sparklines (decision 0701): how long the
-- oldest eligible delivery had waited, how many attempts were delivered and how many were
-- answered 429 in the minute before. Written by the janitor's gauge loop through
-- `nudge_record_ledger_sample` (once per minute whatever the number of janitors: the minute is
-- the key), which also trims what is older than a day: the table stays at most 3 x 1,441 rows.
CREATE TABLE public.ledger_samples (
    at                    timestamptz NOT NULL CHECK (at = date_trunc('minute', at)),
    channel               text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    oldest_eligible_age_s double precision NULL CHECK (oldest_eligible_age_s >= 0),
    delivered             bigint NOT NULL CHECK (delivered >= 0),
    throttled             bigint NOT NULL CHECK (throttled >= 0),
    PRIMARY KEY (at, channel)
);

-- The sample of the minute that began at or before `p_at` (NULL: the database's clock): the
-- oldest eligible delivery's wait at that minute's start (read through
-- deliveries_eligible_idx), and the attempts that finished in the minute before it (read
-- through attempts_finished_idx). Nothing when that minute has its sample already. Returns how
-- many rows it wrote (0 or 3).
CREATE FUNCTION public.nudge_record_ledger_sample(p_at timestamptz)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH m AS (SELECT date_trunc('minute', COALESCE(p_at, now())) AS at),
    trimmed AS (
        DELETE FROM public.ledger_samples s USING m
        WHERE s.at < m.at - interval '1 day'
        RETURNING 1
    ),
    counts AS (
        SELECT d.channel,
               count(*) FILTER (WHERE a.outcome_class = 'delivered') AS delivered,
               count(*) FILTER (WHERE a.http_status = 429) AS throttled
        FROM m, public.attempts a JOIN public.deliveries d ON d.id = a.delivery_id
        WHERE a.finished_at >= m.at - interval '1 minute' AND a.finished_at < m.at
        GROUP BY d.channel
    ),
    written AS (
        INSERT INTO public.ledger_samples (at, channel, oldest_eligible_age_s, delivered, throttled)
        SELECT m.at, ch.channel,
               extract(epoch FROM m.at - (
                   SELECT min(d.next_attempt_at) FROM public.deliveries d
                   WHERE d.channel = ch.channel
                     AND d.state IN ('scheduled', 'queued', 'retry_wait')
                     AND d.next_attempt_at <= m.at))::float8,
               COALESCE(c.delivered, 0), COALESCE(c.throttled, 0)
        FROM m CROSS JOIN (VALUES ('push'), ('email'), ('sms')) AS ch (channel)
        LEFT JOIN counts c ON c.channel = ch.channel
        WHERE NOT EXISTS (SELECT 1 FROM public.ledger_samples s WHERE s.at = m.at)
        ON CONFLICT (at, channel) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM written)::integer + 0 * (SELECT count(*) FROM trimmed)::integer
$$;
REVOKE ALL ON FUNCTION public.nudge_record_ledger_sample(timestamptz) FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT EXECUTE ON FUNCTION public.nudge_record_ledger_sample(timestamptz) TO nudge_janitor;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_console') THEN
        GRANT SELECT ON public.ledger_samples TO nudge_console;
    END IF;
END $$;
