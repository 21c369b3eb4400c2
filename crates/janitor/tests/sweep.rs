//! One pass of the janitor's sweep (`sweep_once`) on a real ledger, with time moved by the
//! test: what it expires, what it gives back unsent, what it decides, and what it leaves alone.
//! The sweep connects as the janitor's restricted role, as the janitor does in production.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use nudge_domain::{
    AdmissionSettings, Channel, DeliveryState, EventId, IdempotencySupport, ProviderAccount,
    RetryPolicy, SubscriberRef,
};
use nudge_janitor::{SweepReport, sweep_once};
use nudge_ledger::{
    DestinationCipher, DueDelivery, LeaseBatch, LeaseOutcome, Ledger, LedgerTime, NewReminder,
    SendSlot, SubscriberKey, WorkerRoutes,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The same database as `pool`, connected as the janitor's restricted role.
async fn as_janitor(pool: &PgPool) -> Ledger {
    let options = (*pool.connect_options()).clone().username("nudge_janitor");
    let janitor = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    Ledger::from_pool(janitor)
}

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 29, 9, 0, 0).unwrap()
}

fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[1; 32]).with_subscriber_key(SubscriberKey::new(&[2; 32]))
}

/// SMS deliveries for `events`, due at t0 (expiring an hour later), claimed at t0.
async fn claimed(ledger: &Ledger, events: &[&str]) -> Vec<DueDelivery> {
    let tenant = ledger
        .create_tenant(
            "clinic",
            &nudge_ledger::Operator::new("ops", Some("test"), t0()).unwrap(),
        )
        .await
        .unwrap();
    let mut ids = Vec::new();
    for event in events {
        let created = ledger
            .create_reminder(
                &NewReminder::new(
                    tenant.id,
                    EventId::parse(event).unwrap(),
                    SubscriberRef::parse("patient-1").unwrap(),
                    &[Channel::Sms],
                    t0(),
                    t0() + secs(3600),
                )
                .unwrap(),
                &cipher(),
                t0(),
            )
            .await
            .unwrap();
        ledger
            .materialise_reminder(tenant.id, created.id, t0())
            .await
            .unwrap();
        ids.push(created.id);
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
    let routes = WorkerRoutes {
        default: account.clone(),
        accounts: vec![(account, IdempotencySupport::Honoured)],
    };
    let settings = AdmissionSettings::default();
    let cipher = cipher();
    let batch = LeaseBatch {
        channel: Channel::Sms,
        lease_holder: "worker-that-died",
        lease_for: Duration::from_secs(60),
        routes: &routes,
        admission: &settings,
        cipher: &cipher,
        at: LedgerTime::Fixed(t0()),
    };
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
