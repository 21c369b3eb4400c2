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

/// A webhook's signing secret set before the tenant secret key existed is sealed again by the
/// same step as the intake's (`nudgectl migrate`), and still opens for the push afterwards.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_webhook_secret_sealed_before_the_key_is_sealed_again_with_the_signing_secrets(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = test_support::tenant(&ledger).await;
    let by = test_support::ops(test_support::t0());
    ledger
        .rotate_signing_secret(tenant.id, &test_support::cipher(), &by)
        .await
        .unwrap();
    let set = ledger
        .set_tenant_webhook(
            tenant.id,
            "https://clinic.example/hooks",
            None,
            &test_support::cipher(),
            &by,
        )
        .await
        .unwrap();
    let webhook_sealed_with = || async {
        sqlx::query_scalar::<_, String>("SELECT sealed_with FROM tenant_webhook_secrets")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert_eq!(webhook_sealed_with().await, ["destination_key"]);
    assert_eq!(
        ledger
            .tenant_secrets_sealed_with_destination_key()
            .await
            .unwrap(),
        2,
        "the signing secret and the webhook's"
    );

    assert_eq!(
        ledger
            .reseal_tenant_secrets(&intakes_cipher())
            .await
            .unwrap(),
        2
    );
    assert_eq!(webhook_sealed_with().await, ["tenant_secret_key"]);
    assert_eq!(sealed_with(&pool).await, ["tenant_secret_key"]);
    assert_eq!(
        ledger
            .tenant_secrets_sealed_with_destination_key()
            .await
            .unwrap(),
        0
    );

    // The push opens it with both keys, and only with both.
    test_support::owed(
        &ledger,
        tenant.id,
        "appt-1",
        &[nudge_domain::Channel::Sms],
        test_support::t0(),
    )
    .await;
    ledger.sequence_events(100).await.unwrap();
    let claimed = ledger
        .claim_webhooks(std::time::Duration::from_secs(30), 10, &[])
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let fence = |cipher: DestinationCipher| {
        let ledger = ledger.clone();
        let claimed = claimed[0].clone();
        async move {
            ledger
                .webhook_fence(
                    claimed.tenant_id,
                    claimed.lease,
                    std::time::Duration::from_secs(30),
                    &cipher,
                )
                .await
                .unwrap()
        }
    };
    match fence(intakes_cipher()).await {
        nudge_ledger::Fence::Held(target) => {
            assert_eq!(
                target.secrets.first().map(|s| s.expose().to_owned()),
                set.secret.as_ref().map(|s| s.expose().to_owned())
            );
        }
        other => panic!("not opened: {other:?}"),
    }
    assert!(matches!(
        fence(workers_cipher()).await,
        nudge_ledger::Fence::Unopenable(_)
    ));
}
