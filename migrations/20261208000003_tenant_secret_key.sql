-- Tenants' signing secrets get a key of their own (`crypto.tenant_secret_key`), held only by
-- the intake and `nudgectl`. They were sealed with the destination key, which every worker
-- holds: one worker's key and a read of `tenant_secrets` signed as every tenant. Rows written
-- before say `destination_key` and still open with it; `nudgectl migrate` seals them again
-- under the new key once both keys are configured (`tenant_secret_key` from then on). The
-- associated data of a row sealed with the new key names the key too, so a ciphertext cannot
-- be relabelled as the other kind.
ALTER TABLE tenant_secrets
    ADD COLUMN sealed_with text NOT NULL DEFAULT 'destination_key'
        CHECK (sealed_with IN ('destination_key', 'tenant_secret_key'));
