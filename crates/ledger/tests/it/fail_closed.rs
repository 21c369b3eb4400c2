//! A tenant routed to its own provider account fails closed (0411): while its account is
//! suspended, its bucket paused or closed, or no live worker has the account, its deliveries
//! wait (never sent through the workers' default or another tenant's account), with a reason
//! an operator can read, and go out through the tenant's account once it is back. Expiry still
//! wins.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use nudge_domain::{
    AttemptContext, Channel, DeferReason, DeliveryState, FixedJitter, IdempotencySupport, Lane,
    ProviderAccount, ProviderAnswer, RetryPolicy, SendOutcome, TenantId, Verdict, decide,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    AttemptRecord, DueDelivery, FeedbackApplied, LeaseOutcome, LeasedDelivery, Ledger,
    OutcomeToRecord, Recorded, WorkerRoutes,
};
use sqlx::PgPool;

/// The tenant's own account ("other" in the fixtures' worker routes, beside the default "main").
fn own() -> ProviderAccount {
    account("other")
}

/// Tenant `routed` on its own account `own` for SMS, and tenant `shared` on the default.
async fn two_tenants(ledger: &Ledger, own: &ProviderAccount) -> (TenantId, TenantId) {
    let routed = ledger.create_tenant("routed", &ops(t0())).await.unwrap();
    let shared = ledger.create_tenant("shared", &ops(t0())).await.unwrap();
    ledger
        .set_tenant_channel_account(routed.id, Channel::Sms, Some(own), &ops(t0()))
        .await
        .unwrap();
    (routed.id, shared.id)
}

/// Claims the SMS work due at `now` of `tenant`.
async fn claim_of(ledger: &Ledger, tenant: TenantId, now: DateTime<Utc>) -> Vec<DueDelivery> {
    ledger
        .claim_due(Channel::Sms, 1000, at(now))
        .await
        .unwrap()
        .into_iter()
        .filter(|d| d.tenant_id == tenant)
        .collect()
}

/// How many attempts of `tenant`'s deliveries went through `account`.
async fn attempts_through(ledger: &Ledger, tenant: TenantId, account: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM attempts a JOIN deliveries d ON d.id = a.delivery_id
         WHERE d.tenant_id = $1 AND a.provider_account = $2",
    )
    .bind(tenant.as_uuid())
    .bind(account)
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

/// How many of `tenant`'s deliveries were ever leased through `account`.
async fn leased_through(ledger: &Ledger, tenant: TenantId, account: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM deliveries WHERE tenant_id = $1 AND provider_account = $2",
    )
    .bind(tenant.as_uuid())
    .bind(account)
    .fetch_one(ledger.pool())
    .await
    .unwrap()
}

/// Records `verdict` (answered with `status`) for `lease`, at `now`.
async fn answer(
    ledger: &Ledger,
    lease: &LeasedDelivery,
    verdict: Verdict,
    status: u16,
    now: DateTime<Utc>,
) -> Recorded {
    let outcome = SendOutcome::Answered(ProviderAnswer::new(verdict, Some(status)));
    let decision = decide(
        &AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::Honoured,
        },
        &outcome,
        now,
        &RetryPolicy::default(),
        &mut FixedJitter::new(1_000),
    );
    let attempt = AttemptRecord {
        started_at: now,
        finished_at: now,
        worker: "worker-1".into(),
        correlation_id: None,
    };
    ledger
        .record_outcomes(
            &[OutcomeToRecord {
                lease,
                decision: &decision,
                attempt: &attempt,
            }],
            std::time::Duration::from_secs(60),
            at(now),
        )
        .await
        .unwrap()
        .remove(0)
}

/// A worker that has only the default account `main`.
fn default_only() -> WorkerRoutes {
    WorkerRoutes {
        default: account("main"),
        accounts: vec![(account("main"), IdempotencySupport::Honoured)],
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenant_whose_own_account_is_suspended_waits_for_it_and_never_goes_through_the_default(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let (routed, shared) = two_tenants(&ledger, &own()).await;
    for event in ["first", "second"] {
        owed(&ledger, routed, event, &[Channel::Sms], t0()).await;
    }
    owed(&ledger, shared, "theirs", &[Channel::Sms], t0()).await;
    let all = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    let (due, theirs): (Vec<_>, Vec<_>) = all.into_iter().partition(|d| d.tenant_id == routed);
    let first = leased(lease(&ledger, &due[0], t0()).await);
    assert_eq!(first.provider_account, own());

    // The provider refuses the account's credentials: the account (no bucket) is suspended
    // for a minute.
    assert_eq!(
        answer(&ledger, &first, Verdict::AuthFailure, 401, t0() + secs(1)).await,
        Recorded::Applied
    );
    let suspended_until = t0() + secs(1) + secs(60);
    let second = lease(&ledger, &due[1], t0() + secs(2)).await;
    let theirs = lease(&ledger, &theirs[0], t0() + secs(2)).await;

    assert!(
        matches!(&second, LeaseOutcome::Released { until, reason: DeferReason::Paused, account }
                 if *until == suspended_until && *account == own()),
        "{second:?}"
    );
    let record = ledger.delivery(due[1].id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    assert_eq!(record.next_attempt_at, Some(suspended_until));
    assert_eq!(record.attempt_count, 0, "waiting spends no attempt");
    assert_eq!(
        leased(theirs).provider_account,
        account("main"),
        "the other tenant, on the default, is not held up"
    );

    // Once the suspension ends, both go out through the tenant's own account.
    let again = claim_of(&ledger, routed, suspended_until).await;
    assert!(again.iter().any(|d| d.id == due[1].id), "{again:?}");
    for due in &again {
        let lease = leased(lease(&ledger, due, suspended_until).await);
        assert_eq!(lease.provider_account, own());
    }
    assert_eq!(leased_through(&ledger, routed, "main").await, 0);
    assert_eq!(attempts_through(&ledger, routed, "main").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenant_whose_own_bucket_is_paused_or_closed_waits_for_it_and_never_goes_through_the_default(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let (routed, _) = two_tenants(&ledger, &own()).await;
    for name in ["main", "other"] {
        ledger
            .ensure_bucket(&account(name), Channel::Sms, 20.0, 5, t0())
            .await
            .unwrap();
    }
    owed(&ledger, routed, "one", &[Channel::Sms], t0()).await;

    // Paused by a provider's Retry-After: two 429s within a second (one alone is about its own
    // request, decision 0120).
    let pause_until = t0() + secs(30);
    let lone = ledger
        .bucket_feedback(
            &own(),
            Channel::Sms,
            nudge_ledger::Feedback::Throttled {
                retry_at: Some(pause_until),
                send: None,
            },
            std::time::Duration::from_secs(60),
            at(t0() - chrono::Duration::milliseconds(100)),
        )
        .await
        .unwrap();
    assert_eq!(lone, None);
    let applied = ledger
        .bucket_feedback(
            &own(),
            Channel::Sms,
            nudge_ledger::Feedback::Throttled {
                retry_at: Some(pause_until),
                send: None,
            },
            std::time::Duration::from_secs(60),
            at(t0()),
        )
        .await
        .unwrap();
    assert!(
        matches!(applied, Some(FeedbackApplied { paused_until: Some(u), .. }) if u == pause_until)
    );
    let due = claim_of(&ledger, routed, t0()).await.remove(0);
    let paused = lease(&ledger, &due, t0()).await;
    assert!(
        matches!(&paused, LeaseOutcome::Released { until, reason: DeferReason::Paused, account }
                 if *until == pause_until && *account == own()),
        "{paused:?}"
    );

    // Closed by an operator (rate 0) by the time the pause ends: it waits again.
    ledger
        .set_rate(&own(), Channel::Sms, 0.0, None, &ops(pause_until))
        .await
        .unwrap();
    let due = claim_of(&ledger, routed, pause_until).await.remove(0);
    let closed = lease(&ledger, &due, pause_until).await;
    assert!(
        matches!(&closed, LeaseOutcome::Released { reason: DeferReason::Closed, account, .. }
                 if *account == own()),
        "{closed:?}"
    );
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    assert_eq!(record.attempt_count, 0);
    assert_eq!(record.lane, Lane::New, "its lane is kept");

    // Reopened: sent through its own bucket.
    let reopened_at = pause_until + secs(10);
    ledger
        .set_rate(&own(), Channel::Sms, 20.0, None, &ops(reopened_at))
        .await
        .unwrap();
    let due = claim_of(&ledger, routed, reopened_at).await.remove(0);
    let sent = leased(lease(&ledger, &due, reopened_at).await);
    assert_eq!(sent.provider_account, own());
    assert_eq!(leased_through(&ledger, routed, "main").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenant_whose_own_account_no_worker_has_waits_visibly_and_goes_out_once_one_has_it(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let missing = account("clinic-own");
    let (routed, shared) = two_tenants(&ledger, &missing).await;
    owed(&ledger, routed, "one", &[Channel::Sms], t0()).await;
    owed(&ledger, shared, "theirs", &[Channel::Sms], t0()).await;
    let routes = default_only();
    let due = ledger.claim_due(Channel::Sms, 10, at(t0())).await.unwrap();
    assert_eq!(due.len(), 2);
    let ours = due.iter().find(|d| d.tenant_id == routed).unwrap().clone();

    // One batch with both: the shared tenant's is leased through the default; the routed
    // tenant's is given back until the next look, with its reason.
    let admission = settings();
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        &admission,
        &cipher,
        at(t0()),
    );
    let messages: Vec<_> = due.iter().map(DueDelivery::message_pointer).collect();
    let outcomes = ledger
        .lease_batch(&batch, &messages)
        .await
        .unwrap()
        .outcomes;
    let look_again = t0() + chrono::Duration::from_std(ACCOUNT_RECHECK).unwrap();
    for (due, outcome) in due.iter().zip(outcomes) {
        if due.tenant_id == routed {
            assert!(
                matches!(&outcome, LeaseOutcome::AccountUnavailable { until, account }
                         if *until == look_again && *account == missing),
                "{outcome:?}"
            );
        } else {
            assert_eq!(leased(outcome).provider_account, account("main"));
        }
    }
    let record = ledger.delivery(ours.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::RetryWait);
    assert_eq!(
        record.last_error_reason.as_deref(),
        Some("account_unavailable")
    );
    assert_eq!(record.next_attempt_at, Some(look_again));
    assert_eq!(record.attempt_count, 0, "waiting spends no attempt");
    assert_eq!(record.lane, Lane::New, "its lane is kept");
    assert_eq!(record.generation, ours.generation);
    // Not in flight: it takes no room from the relay's window for the channel.
    assert_eq!(ledger.in_flight(Channel::Sms).await.unwrap(), 1);

    // What an operator sees: N deliveries of the tenant wait for an account nobody has.
    let waiting = ledger.awaiting_accounts(at(t0() + secs(1))).await.unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0].tenant, "routed");
    assert_eq!(waiting[0].account, Some(missing.clone()));
    assert_eq!(waiting[0].deliveries, 1);
    assert!(!waiting[0].held_now);
    let lateness = ledger
        .tenant_lateness(20, at(t0() + secs(1)))
        .await
        .unwrap();
    let row = lateness
        .tenants
        .iter()
        .find(|t| t.tenant_id == routed)
        .unwrap();
    assert_eq!((row.awaiting_account, row.backoff), (1, 1));
    assert_eq!(row.account, Some(missing.clone()));

    // At the next look it is still nobody's: given back again, never through the default.
    let again = claim_of(&ledger, routed, look_again).await.remove(0);
    let outcome = lease_as(&ledger, &again, "worker-1", &routes, look_again).await;
    assert!(
        matches!(outcome, LeaseOutcome::AccountUnavailable { .. }),
        "{outcome:?}"
    );
    // The client was told once that it waits for its account, not again at each look
    // (migration 20261224000001): the second give-back writes no event and counts none.
    let told: Vec<(String, Option<String>, i32)> = sqlx::query_as(
        "SELECT kind, reason, delivery_seq FROM delivery_events WHERE delivery_id = $1
         ORDER BY id",
    )
    .bind(ours.id.as_uuid())
    .fetch_all(ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        told,
        [
            ("scheduled".to_owned(), None, 1),
            (
                "deferred".to_owned(),
                Some("account_unavailable".to_owned()),
                2
            )
        ]
    );
    let counted: i32 = sqlx::query_scalar("SELECT event_seq FROM deliveries WHERE id = $1")
        .bind(ours.id.as_uuid())
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert_eq!(counted, 2);

    // A worker with the account starts and announces it: a worker without it now leaves the
    // delivery queued for that one, which sends it through the tenant's account.
    let later = look_again + chrono::Duration::from_std(ACCOUNT_RECHECK).unwrap();
    ledger
        .announce_accounts(Channel::Sms, std::slice::from_ref(&missing), at(later))
        .await
        .unwrap();
    assert!(
        ledger.awaiting_accounts(at(later)).await.unwrap()[0].held_now,
        "status says the next look sends them"
    );
    let again = claim_of(&ledger, routed, later).await.remove(0);
    let left = lease_as(&ledger, &again, "worker-1", &routes, later).await;
    assert!(
        matches!(&left, LeaseOutcome::UnknownAccount(a) if a == missing.as_str()),
        "{left:?}"
    );
    assert_eq!(
        ledger.delivery(again.id).await.unwrap().unwrap().state,
        DeliveryState::Queued
    );
    let with_it = WorkerRoutes {
        default: account("main"),
        accounts: vec![
            (account("main"), IdempotencySupport::Honoured),
            (missing.clone(), IdempotencySupport::Honoured),
        ],
    };
    let sent = leased(lease_as(&ledger, &again, "worker-2", &with_it, later).await);
    assert_eq!(sent.provider_account, missing);
    assert_eq!(sent.attempt_number, 1);
    let record = ledger.delivery(again.id).await.unwrap().unwrap();
    assert_eq!(record.last_error_reason, None, "it no longer waits");
    assert!(
        ledger
            .awaiting_accounts(at(later))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(leased_through(&ledger, routed, "main").await, 0);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_announcement_lapses_and_the_wait_then_starts(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let missing = account("clinic-own");
    let (routed, _) = two_tenants(&ledger, &missing).await;
    owed(&ledger, routed, "one", &[Channel::Sms], t0()).await;
    ledger
        .announce_accounts(Channel::Sms, std::slice::from_ref(&missing), at(t0()))
        .await
        .unwrap();
    let held_until = t0() + chrono::Duration::from_std(nudge_ledger::HOLD_FOR).unwrap();

    let due = claim_of(&ledger, routed, t0()).await.remove(0);
    let held = lease_as(&ledger, &due, "worker-1", &default_only(), t0()).await;
    let lapsed = lease_as(&ledger, &due, "worker-1", &default_only(), held_until).await;

    assert!(matches!(held, LeaseOutcome::UnknownAccount(_)), "{held:?}");
    assert!(
        matches!(lapsed, LeaseOutcome::AccountUnavailable { .. }),
        "{lapsed:?}"
    );
    let announced = ledger.announced_accounts(at(held_until)).await.unwrap();
    assert_eq!(announced.len(), 1);
    assert!(!announced[0].live);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn expiry_wins_over_a_wait_for_an_account(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let missing = account("clinic-own");
    let (routed, _) = two_tenants(&ledger, &missing).await;
    owed(&ledger, routed, "one", &[Channel::Sms], t0()).await;
    // The fixtures' reminders expire an hour after their time.
    let expires_at = t0() + secs(3600);
    let near_the_end = expires_at - secs(10);

    let due = claim_of(&ledger, routed, near_the_end).await.remove(0);
    let waiting = lease_as(&ledger, &due, "worker-1", &default_only(), near_the_end).await;
    assert!(
        matches!(waiting, LeaseOutcome::AccountUnavailable { until, .. } if until == expires_at),
        "the next look is never after its expiry: {waiting:?}"
    );
    let due = claim_of(&ledger, routed, expires_at).await.remove(0);
    let expired = lease_as(&ledger, &due, "worker-1", &default_only(), expires_at).await;

    assert!(matches!(expired, LeaseOutcome::Expired), "{expired:?}");
    let record = ledger.delivery(due.id).await.unwrap().unwrap();
    assert_eq!(record.state, DeliveryState::Expired);
    assert_eq!(leased_through(&ledger, routed, "main").await, 0);
}
