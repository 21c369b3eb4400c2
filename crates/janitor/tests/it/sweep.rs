//! One pass of the janitor's sweep (`sweep_once`) on a real ledger, with time moved by the
//! test: what it expires, what it gives back unsent, what it decides, and what it leaves alone.
//! The sweep connects as the janitor's restricted role, as the janitor does in production.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nudge_domain::{Channel, DeliveryState, IdempotencySupport, ProviderAccount, RetryPolicy};
use nudge_janitor::{SweepReport, sweep_once};
use nudge_ledger::test_support::{Leaser, at, owed, secs, t0, tenant};
use nudge_ledger::{DueDelivery, LeaseOutcome, Ledger, LedgerTime, SendSlot};
use sqlx::PgPool;

use crate::common::as_janitor;

/// SMS deliveries for `events`, due at t0 (expiring an hour later), claimed at t0.
async fn claimed(ledger: &Ledger, events: &[&str]) -> Vec<DueDelivery> {
    let tenant = tenant(ledger).await;
    let mut ids = Vec::new();
    for event in events {
        ids.push(owed(ledger, tenant.id, event, &[Channel::Sms], t0()).await);
    }
    let claimed = ledger
        .claim_due(Channel::Sms, 100, LedgerTime::Fixed(t0()))
        .await
        .unwrap();
    // In the order of `events`.
    ids.iter()
        .map(|id| {
            claimed
                .iter()
                .find(|d| d.reminder_id == *id)
                .unwrap()
                .clone()
        })
        .collect()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_sweep_expires_owed_work_returns_unsent_leases_and_decides_sent_ones(pool: PgPool) {
    let janitor = as_janitor(&pool).await;
    let ledger = Ledger::from_pool(pool);
    let account = ProviderAccount::parse("main").unwrap();
    // 2/s, burst 1: of the two leased together, the second waits for its slot, unfenced.
    ledger
        .ensure_bucket(&account, Channel::Sms, 2.0, 1, t0())
        .await
        .unwrap();
    let due = claimed(&ledger, &["sent", "waiting", "idle"]).await;
    let leaser = Leaser::new(IdempotencySupport::Honoured);
    let batch = leaser.batch(Channel::Sms, "worker-that-died", at(t0()));
    let result = ledger
        .lease_batch(
            &batch,
            &[due[0].message_pointer(), due[1].message_pointer()],
        )
        .await
        .unwrap();
    assert!(matches!(
        result.outcomes[0],
        LeaseOutcome::Leased {
            slot: SendSlot::Now,
            ..
        }
    ));
    assert!(matches!(
        result.outcomes[1],
        LeaseOutcome::Leased {
            slot: SendSlot::At { .. },
            ..
        }
    ));
    let policy = RetryPolicy::default();

    let early = sweep_once(&janitor, &policy, 100, LedgerTime::Fixed(t0() + secs(30)))
        .await
        .unwrap();
    let lapsed = sweep_once(&janitor, &policy, 100, LedgerTime::Fixed(t0() + secs(61)))
        .await
        .unwrap();

    assert_eq!(
        early,
        SweepReport::default(),
        "nothing is due for the sweep yet"
    );
    assert_eq!(
        lapsed,
        SweepReport {
            expired: 0,
            reaped: 1,
            returned_unsent: 1
        }
    );
    let delivery = |i: usize| {
        let ledger = ledger.clone();
        let id = due[i].id;
        async move { ledger.delivery(id).await.unwrap().unwrap() }
    };
    let sent = delivery(0).await;
    assert_eq!(
        sent.state,
        DeliveryState::RetryWait,
        "sent, idempotent: retried"
    );
    assert_eq!(sent.attempt_count, 1);
    let waiting = delivery(1).await;
    assert_eq!(
        waiting.state,
        DeliveryState::RetryWait,
        "never sent: due again"
    );
    assert_eq!(waiting.attempt_count, 0);
    assert_eq!(
        delivery(2).await.state,
        DeliveryState::Queued,
        "not leased: left alone"
    );

    // An hour on, what is still owed has expired. Settling at the test's fixed time, days
    // before the database's clock, is refused to every role but the owner (a backdated
    // settlement would age work into retention), so this sweep runs as the owner.
    let late = sweep_once(&ledger, &policy, 100, LedgerTime::Fixed(t0() + secs(3601)))
        .await
        .unwrap();
    assert_eq!(late.expired, 3);
    for i in 0..3 {
        assert_eq!(delivery(i).await.state, DeliveryState::Expired);
    }
}
