-- An attempt the provider refused because of the account (its credentials refused, or an
-- answer read as the account's misconfiguration: the attempt's reason starts with
-- `auth_failure`) says nothing about the delivery, so it does not spend the delivery's attempt
-- budget. The budget counts `attempt_count - attempt_base` (attempts since the last redrive);
-- recording such an attempt moves `attempt_base` on by one with it, in the same statement, so
-- the attempt stays in the history with its number and the next attempt's budget is what it
-- was before. The account's suspension, not the attempt limit, is what stops these sends;
-- expiry still ends the delivery.
CREATE FUNCTION nudge_account_fault_spends_no_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE deliveries
    SET attempt_base = attempt_base + 1
    WHERE id = NEW.delivery_id AND attempt_base < attempt_count;
    RETURN NULL;
END;
$$;

CREATE TRIGGER attempts_account_fault_spends_no_attempt
    AFTER INSERT ON attempts
    FOR EACH ROW
    WHEN (NEW.reason LIKE 'auth_failure%')
    EXECUTE FUNCTION nudge_account_fault_spends_no_attempt();
