//! Tenants' signing secrets are sealed with `crypto.tenant_secret_key`, which only the intake
//! and `nudgectl` hold: the workers' destination key does not open them. Secrets sealed before
//! that key existed still open, and are sealed again under it by `nudgectl migrate`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_ledger::test_support;

use nudge_ledger::{DestinationCipher, Ledger, LedgerError};
use sqlx::PgPool;

const DESTINATION_KEY: [u8; 32] = [42; 32];
const TENANT_SECRET_KEY: [u8; 32] = [44; 32];

/// What a worker holds.
fn workers_cipher() -> DestinationCipher {
    DestinationCipher::new(&DESTINATION_KEY)
}

/// What the intake and `nudgectl` hold.
fn intakes_cipher() -> DestinationCipher {
    test_support::cipher().with_tenant_secret_key(&TENANT_SECRET_KEY)
}

async fn sealed_with(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT sealed_with FROM tenant_secrets ORDER BY generation")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rotated_secret_does_not_open_with_the_workers_destination_key(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = test_support::tenant(&ledger).await;
    let secret = ledger
        .rotate_signing_secret(
            tenant.id,
            &intakes_cipher(),
            &test_support::ops(test_support::t0()),
        )
        .await
        .unwrap();

    assert_eq!(sealed_with(&pool).await, ["tenant_secret_key"]);
    let opened = ledger
        .intake_tenant(&tenant.name, &intakes_cipher())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(opened.secrets, [secret]);
    let as_worker = ledger.intake_tenant(&tenant.name, &workers_cipher()).await;
    assert!(
        matches!(as_worker, Err(LedgerError::TenantSecretKeyMissing)),
        "{as_worker:?}"
    );
    // Another tenant secret key does not open it either.
    let other = test_support::cipher().with_tenant_secret_key(&[45; 32]);
    assert!(matches!(
        ledger.intake_tenant(&tenant.name, &other).await,
        Err(LedgerError::Crypto)
    ));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_secret_sealed_before_the_key_still_opens_and_migrate_seals_it_again(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = test_support::tenant(&ledger).await;
    // Rotated by a release (or a deployment) without the tenant secret key.
    let old = ledger
        .rotate_signing_secret(
            tenant.id,
            &test_support::cipher(),
            &test_support::ops(test_support::t0()),
        )
        .await
        .unwrap();
    assert_eq!(sealed_with(&pool).await, ["destination_key"]);
    assert_eq!(
        ledger
            .tenant_secrets_sealed_with_destination_key()
            .await
            .unwrap(),
        1
    );
    let opened = ledger
        .intake_tenant(&tenant.name, &intakes_cipher())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        opened.secrets.first(),
        Some(&old),
        "an upgraded intake still verifies"
    );

    assert!(matches!(
        ledger.reseal_tenant_secrets(&test_support::cipher()).await,
        Err(LedgerError::TenantSecretKeyMissing)
    ));
    assert_eq!(
        ledger
            .reseal_tenant_secrets(&intakes_cipher())
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        ledger
            .reseal_tenant_secrets(&intakes_cipher())
            .await
            .unwrap(),
        0
    );

    assert_eq!(sealed_with(&pool).await, ["tenant_secret_key"]);
    let opened = ledger
        .intake_tenant(&tenant.name, &intakes_cipher())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(opened.secrets, [old], "the same secret, sealed again");
    assert!(matches!(
        ledger.intake_tenant(&tenant.name, &workers_cipher()).await,
        Err(LedgerError::TenantSecretKeyMissing)
    ));
}
