-- The workers suspend an account without a rate bucket (`account_suspensions`, migration
-- 20261207000001) when its credentials are refused, and their lease reads the suspension;
-- the roles' grants (20261208000002) came after the table and did not name it.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT, INSERT, UPDATE ON public.account_suspensions TO nudge_worker;
    END IF;
END $$;
