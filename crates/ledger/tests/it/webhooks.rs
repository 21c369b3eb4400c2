//! Tenants' webhooks (decision 0602): set and audited with a secret made once; leased to one
//! pusher at a time; the acknowledged position moved only by its holder; a failed batch kept
//! for its retry; a webhook failing too long disabled with nothing skipped, and resumed by
//! enabling it; a rotation's overlap; and what the `nudge_events` role may do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use nudge_domain::{Channel, TenantId};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    ClaimedWebhook, FailureRecorded, Fence, Ledger, WebhookFailure, WebhookSecret,
    check_webhook_url,
};
use sqlx::PgPool;
use uuid::Uuid;

const LEASE: Duration = Duration::from_secs(30);

async fn events(owner: &Ledger, tenant: TenantId, n: usize) -> Vec<i64> {
    for i in 0..n {
        owed(owner, tenant, &format!("appt-{i}"), &[Channel::Sms], t0()).await;
    }
    owner.sequence_events(10_000).await.unwrap();
    owner
        .tenant_events(tenant, 0, 1_000)
        .await
        .unwrap()
        .events
        .iter()
        .map(|e| e.position)
        .collect()
}

async fn claim(pusher: &Ledger) -> Vec<ClaimedWebhook> {
    pusher.claim_webhooks(LEASE, 10, &[]).await.unwrap()
}

async fn secrets(pusher: &Ledger, claimed: &ClaimedWebhook) -> Vec<WebhookSecret> {
    match pusher
        .webhook_fence(claimed.tenant_id, claimed.lease, LEASE, &cipher())
        .await
        .unwrap()
    {
        Fence::Held(target) => target.secrets,
        other => panic!("not held: {other:?}"),
    }
}

fn failure(through: i64, disable_after: Duration) -> WebhookFailure {
    WebhookFailure {
        pending_through: through,
        error: "server_error: answered 503".into(),
        retry_in: Duration::ZERO,
        disable_after,
    }
}

#[test]
fn a_webhook_url_must_be_https_with_a_host_and_no_credentials() {
    assert_eq!(
        check_webhook_url("https://clinic.example/hooks/nudge", false).as_deref(),
        Ok("https://clinic.example/hooks/nudge")
    );
    assert_eq!(
        check_webhook_url(" HTTPS://Clinic.Example:443/h?t=1", false).as_deref(),
        Ok("https://clinic.example/h?t=1"),
        "stored in its normal form"
    );
    assert!(check_webhook_url("http://127.0.0.1:8080/h", true).is_ok());
    for (url, why) in [
        (
            "http://clinic.example/h",
            "plain http is refused: use https",
        ),
        ("ftp://clinic.example/h", "the scheme must be https"),
        (
            "https://user:pw@clinic.example/h",
            "the URL must not carry a user name or password",
        ),
        (
            "https://clinic.example/h#x",
            "the URL must not carry a fragment (#...)",
        ),
        ("clinic.example/h", "not an absolute URL"),
    ] {
        assert_eq!(check_webhook_url(url, false), Err(why), "{url}");
    }
    let long = format!("https://clinic.example/{}", "a".repeat(2_100));
    assert!(check_webhook_url(&long, false).is_err());
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_webhook_is_set_once_with_its_secret_and_audited(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let tenant = tenant(&owner).await;
    let positions = events(&owner, tenant.id, 2).await;
    let set = owner
        .set_tenant_webhook(
            tenant.id,
            "https://a.example/h",
            None,
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    assert!(set.created);
    assert!(set.secret.as_ref().unwrap().expose().starts_with("whsec_"));
    assert_eq!(
        set.acked_position, positions[1],
        "a new webhook starts after what exists"
    );
    assert!(
        owner
            .set_tenant_webhook(
                tenant.id,
                "https://b.example/h",
                Some(0),
                &cipher(),
                &ops(t0())
            )
            .await
            .is_err(),
        "a start position for an existing webhook is refused"
    );
    let again = owner
        .set_tenant_webhook(
            tenant.id,
            "https://b.example/h?token=s3cr3t",
            None,
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    assert!(!again.created && again.secret.is_none());
    assert_eq!(
        again.acked_position, positions[1],
        "a URL change keeps the position"
    );
    let shown = owner.tenant_webhook(tenant.id).await.unwrap().unwrap();
    assert_eq!(shown.url, "https://b.example/h?token=s3cr3t");
    assert_eq!(shown.secrets.len(), 1);
    assert_eq!(shown.newest_position, positions[1]);
    let stored: Vec<u8> = sqlx::query_scalar(
        "SELECT secret_ciphertext FROM tenant_webhook_secrets WHERE tenant_id = $1",
    )
    .bind(tenant.id.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    let secret = set.secret.unwrap();
    assert!(
        !stored
            .windows(secret.expose().len())
            .any(|w| w == secret.expose().as_bytes()),
        "the secret is stored sealed"
    );
    let audit: Vec<(String, String)> = sqlx::query_as(
        "SELECT action, details::text FROM audit_log WHERE action LIKE 'tenant_webhook%' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(audit.len(), 2);
    assert!(
        audit.iter().all(|(_, d)| !d.contains("whsec_")),
        "{audit:?}"
    );
    assert!(
        audit[1].1.contains("a.example"),
        "the URL it replaced: {audit:?}"
    );
    assert!(
        audit.iter().all(|(_, d)| !d.contains("s3cr3t")),
        "no query in the audit: {audit:?}"
    );
    let other = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    assert!(
        owner
            .set_tenant_webhook(
                other.id,
                "https://c.example/h",
                Some(1),
                &cipher(),
                &ops(t0())
            )
            .await
            .is_err(),
        "a start past the tenant's newest event (it has none) would skip events"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn one_task_holds_a_tenant_and_only_its_lease_moves_the_position(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let pusher = connected_as(&pool, "nudge_events").await;
    let tenant = tenant(&owner).await;
    owner
        .set_tenant_webhook(
            tenant.id,
            "https://a.example/h",
            Some(0),
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    assert!(
        claim(&pusher).await.is_empty(),
        "nothing to push: not leased"
    );
    let positions = events(&owner, tenant.id, 4).await;
    assert!(
        pusher
            .claim_webhooks(LEASE, 10, &[tenant.id])
            .await
            .unwrap()
            .is_empty(),
        "a tenant this process pushes already is not claimed again"
    );
    let first = claim(&pusher).await.remove(0);
    assert_eq!((first.acked_position, first.pending_through), (0, None));
    assert_eq!(secrets(&pusher, &first).await.len(), 1);
    assert!(claim(&pusher).await.is_empty(), "held");
    let stranger = Uuid::new_v4();
    assert!(
        !pusher
            .webhook_acknowledged(tenant.id, stranger, positions[1])
            .await
            .unwrap()
    );
    assert!(matches!(
        pusher
            .webhook_fence(tenant.id, stranger, LEASE, &cipher())
            .await
            .unwrap(),
        Fence::Lost
    ));
    assert!(
        pusher
            .webhook_acknowledged(tenant.id, first.lease, positions[1])
            .await
            .unwrap()
    );
    assert_eq!(
        owner
            .tenant_webhook(tenant.id)
            .await
            .unwrap()
            .unwrap()
            .acked_position,
        positions[1]
    );
    // A failure keeps the batch, releases the lease, and waits for its time.
    let recorded = pusher
        .webhook_failed(
            tenant.id,
            first.lease,
            &WebhookFailure {
                retry_in: Duration::from_secs(600),
                ..failure(positions[3], Duration::from_secs(3_600))
            },
        )
        .await
        .unwrap();
    assert_eq!(recorded, FailureRecorded::Retrying);
    let shown = owner.tenant_webhook(tenant.id).await.unwrap().unwrap();
    assert_eq!(shown.pending_through, Some(positions[3]));
    assert_eq!(shown.failures, 1);
    assert!(shown.lease_until.is_none());
    assert!(
        claim(&pusher).await.is_empty(),
        "not before its retry's time"
    );
    sqlx::query("UPDATE tenant_webhooks SET next_attempt_at = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    let second = claim(&pusher).await.remove(0);
    assert_eq!(
        (second.pending_through, second.failures),
        (Some(positions[3]), 1)
    );
    assert_ne!(second.lease, first.lease, "each claim its own lease");
    // The first lease is gone: nothing it records or sends counts.
    assert_eq!(
        pusher
            .webhook_failed(tenant.id, first.lease, &failure(positions[3], LEASE))
            .await
            .unwrap(),
        FailureRecorded::LeaseLost
    );
    assert!(matches!(
        pusher
            .webhook_fence(tenant.id, first.lease, LEASE, &cipher())
            .await
            .unwrap(),
        Fence::Lost
    ));
    // A lapsed lease is taken over; the old holder's acknowledgement is refused.
    sqlx::query("UPDATE tenant_webhooks SET lease_until = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    let third = claim(&pusher).await.remove(0);
    assert!(
        !pusher
            .webhook_acknowledged(tenant.id, second.lease, positions[3])
            .await
            .unwrap()
    );
    assert!(
        pusher
            .webhook_acknowledged(tenant.id, third.lease, positions[3])
            .await
            .unwrap()
    );
    let done = owner.tenant_webhook(tenant.id).await.unwrap().unwrap();
    assert_eq!(
        (
            done.acked_position,
            done.pending_through,
            done.failures,
            done.failing_since
        ),
        (positions[3], None, 0, None)
    );
    pusher
        .release_webhook(tenant.id, third.lease)
        .await
        .unwrap();
    assert!(claim(&pusher).await.is_empty(), "all pushed");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_webhook_failing_too_long_is_disabled_and_enabling_it_resumes_where_it_was(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let pusher = connected_as(&pool, "nudge_events").await;
    let tenant = tenant(&owner).await;
    owner
        .set_tenant_webhook(
            tenant.id,
            "https://a.example/h",
            Some(0),
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    let positions = events(&owner, tenant.id, 2).await;
    let hour = Duration::from_secs(3_600);
    let claimed = claim(&pusher).await.remove(0);
    assert_eq!(
        pusher
            .webhook_failed(tenant.id, claimed.lease, &failure(positions[1], hour))
            .await
            .unwrap(),
        FailureRecorded::Retrying
    );
    // Failing for two hours now.
    sqlx::query("UPDATE tenant_webhooks SET failing_since = now() - interval '2 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let claimed = claim(&pusher).await.remove(0);
    assert_eq!(
        pusher
            .webhook_failed(tenant.id, claimed.lease, &failure(positions[1], hour))
            .await
            .unwrap(),
        FailureRecorded::Disabled
    );
    let off = owner.tenant_webhook(tenant.id).await.unwrap().unwrap();
    assert!(!off.enabled);
    assert_eq!(off.disabled_by.as_deref(), Some("failing"));
    assert!(
        off.disabled_reason
            .as_deref()
            .unwrap()
            .contains("answered 503"),
        "{off:?}"
    );
    assert!(
        off.disabled_reason
            .as_deref()
            .unwrap()
            .starts_with("failing since 20"),
        "{off:?}"
    );
    assert_eq!(off.acked_position, 0, "nothing skipped");
    assert!(claim(&pusher).await.is_empty());
    let counts = owner.webhook_counts().await.unwrap();
    assert_eq!((counts.disabled, counts.disabled_by_operator), (1, 0));
    assert_eq!(
        (counts.behind, counts.oldest_unacknowledged_s),
        (0, 0.0),
        "a disabled webhook is alerted as such, not as behind"
    );

    assert!(
        owner
            .set_tenant_webhook_enabled(tenant.id, true, &ops(t0()))
            .await
            .unwrap()
    );
    assert!(
        !owner
            .set_tenant_webhook_enabled(tenant.id, true, &ops(t0()))
            .await
            .unwrap()
    );
    let claimed = claim(&pusher).await;
    assert_eq!(claimed.len(), 1, "pushed again at once");
    let counts = owner.webhook_counts().await.unwrap();
    assert_eq!(counts.behind, 1, "{counts:?}");
    let oldest: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM now() - min(occurred_at))::float8 FROM delivery_events",
    )
    .fetch_one(owner.pool())
    .await
    .unwrap();
    // Both read the database's clock, a statement apart.
    assert!(
        (counts.oldest_unacknowledged_s - oldest).abs() < 5.0,
        "{counts:?} against {oldest}"
    );
    assert_eq!((claimed[0].acked_position, claimed[0].failures), (0, 0));
    assert_eq!(
        claimed[0].pending_through,
        Some(positions[1]),
        "the same batch"
    );
    // An operator's disable stops the holder before its next batch; the events wait.
    assert!(
        owner
            .set_tenant_webhook_enabled(tenant.id, false, &ops(t0()))
            .await
            .unwrap()
    );
    assert!(matches!(
        pusher
            .webhook_fence(tenant.id, claimed[0].lease, LEASE, &cipher())
            .await
            .unwrap(),
        Fence::Lost
    ));
    let counts = owner.webhook_counts().await.unwrap();
    assert_eq!(
        (counts.enabled, counts.disabled, counts.disabled_by_operator),
        (0, 0, 1)
    );
    let off = owner.tenant_webhook(tenant.id).await.unwrap().unwrap();
    assert_eq!(off.disabled_by.as_deref(), Some("operator"));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_rotation_signs_with_both_secrets_for_its_overlap_from_the_next_batch(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let pusher = connected_as(&pool, "nudge_events").await;
    let tenant = tenant(&owner).await;
    let first = owner
        .set_tenant_webhook(
            tenant.id,
            "https://a.example/h",
            Some(0),
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap()
        .secret
        .unwrap();
    events(&owner, tenant.id, 1).await;
    let claimed = claim(&pusher).await.remove(0);
    assert_eq!(secrets(&pusher, &claimed).await, vec![first.clone()]);
    // Rotated while the lease is held: the next batch is signed by both.
    let second = owner
        .rotate_webhook_secret(tenant.id, Duration::from_secs(3_600), &cipher(), &ops(t0()))
        .await
        .unwrap();
    assert_eq!(
        secrets(&pusher, &claimed).await,
        vec![second.clone(), first.clone()],
        "newest first"
    );
    // A second rotation ends the first secret now and gives the second no overlap.
    let third = owner
        .rotate_webhook_secret(tenant.id, Duration::ZERO, &cipher(), &ops(t0()))
        .await
        .unwrap();
    assert_eq!(secrets(&pusher, &claimed).await, vec![third]);
    assert_eq!(
        owner
            .tenant_webhook(tenant.id)
            .await
            .unwrap()
            .unwrap()
            .secrets
            .len(),
        1
    );
    // A URL change, too, is read at the next batch.
    owner
        .set_tenant_webhook(
            tenant.id,
            "https://b.example/h",
            None,
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    match pusher
        .webhook_fence(tenant.id, claimed.lease, LEASE, &cipher())
        .await
        .unwrap()
    {
        Fence::Held(target) => assert_eq!(target.url, "https://b.example/h"),
        other => panic!("{other:?}"),
    }
    // A secret this process cannot open fails the batch by name, without stalling anything.
    let without_key = nudge_ledger::DestinationCipher::new(&[7; 32]);
    assert!(matches!(
        pusher
            .webhook_fence(tenant.id, claimed.lease, LEASE, &without_key)
            .await
            .unwrap(),
        Fence::Unopenable(_)
    ));
    let missing = owner.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    assert!(
        owner
            .rotate_webhook_secret(missing.id, Duration::ZERO, &cipher(), &ops(t0()))
            .await
            .is_err(),
        "no webhook, no rotation"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn the_events_role_cannot_change_where_a_webhook_points_or_write_events(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let tenant = tenant(&owner).await;
    owner
        .set_tenant_webhook(
            tenant.id,
            "https://a.example/h",
            Some(0),
            &cipher(),
            &ops(t0()),
        )
        .await
        .unwrap();
    for sql in [
        "UPDATE tenant_webhooks SET url = 'https://evil.example/'",
        "UPDATE tenant_webhook_secrets SET retires_at = now()",
        "DELETE FROM tenant_webhooks",
        "INSERT INTO tenant_webhook_secrets (tenant_id, generation, secret_ciphertext, sealed_with) \
         SELECT tenant_id, 9, '\\x00', 'destination_key' FROM tenant_webhooks",
        "DELETE FROM delivery_events",
        "SELECT count(*) FROM contacts",
    ] {
        assert_eq!(
            as_role(&pool, "nudge_events", sql).await.as_deref(),
            Some("42501"),
            "{sql}"
        );
    }
    assert_eq!(
        as_role(
            &pool,
            "nudge_events",
            "UPDATE tenant_webhooks SET failures = failures"
        )
        .await,
        None
    );
}
