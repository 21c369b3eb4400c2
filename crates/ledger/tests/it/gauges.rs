#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The metrics' picture of the ledger: live work per tenant and channel (due, queued, leased,
//! in backoff, oldest eligible age), work awaiting an operator per channel, and the pause and
//! drain flags, read at a fixed instant.

use nudge_domain::Channel;
use nudge_ledger::test_support::*;
use nudge_ledger::{AwaitingOperator, DrainFlag, Ledger};
use sqlx::PgPool;

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn gauges_count_live_work_per_tenant_and_channel_and_leave_future_work_out(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let a = tenant(&ledger).await;
    let b = ledger.create_tenant("clinic-b", &ops(t0())).await.unwrap();
    owed(&ledger, a.id, "a-sms", &[Channel::Sms], t0()).await;
    owed(&ledger, a.id, "a-push", &[Channel::Push], t0() + secs(30)).await;
    owed(
        &ledger,
        a.id,
        "a-later",
        &[Channel::Email],
        t0() + secs(3_000),
    )
    .await;
    owed(&ledger, b.id, "b-sms", &[Channel::Sms], t0() + secs(45)).await;
    let now = t0() + secs(100);
    // The push delivery is claimed by the relay: queued.
    let claimed = ledger.claim_due(Channel::Push, 10, at(now)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    ledger
        .set_intake_paused(b.id, true, &ops(now))
        .await
        .unwrap();
    ledger
        .set_draining(Channel::Email, true, &ops(now), at(now))
        .await
        .unwrap();
    ledger
        .ensure_bucket(&account("sms-main"), Channel::Sms, 10.0, 5, now)
        .await
        .unwrap();

    let gauges = ledger.gauges(at(now)).await.unwrap();
    let mut work: Vec<_> = gauges
        .work
        .iter()
        .map(|w| {
            (
                w.tenant_id == a.id,
                w.channel,
                w.due,
                w.queued,
                w.leased,
                w.backoff,
                w.oldest_eligible_age_s,
            )
        })
        .collect();
    work.sort_by_key(|w| (w.0, w.1.as_str()));
    assert_eq!(
        work,
        [
            (false, Channel::Sms, 1, 0, 0, 0, Some(55.0)),
            (true, Channel::Push, 0, 1, 0, 0, Some(70.0)),
            (true, Channel::Sms, 1, 0, 0, 0, Some(100.0)),
        ],
        "the email reminder's time has not come: it is not live work yet"
    );
    let mut awaiting = gauges.awaiting_operator.clone();
    awaiting.sort_by_key(|a| a.channel.as_str());
    let none = |channel| AwaitingOperator {
        channel,
        ambiguous: 0,
        dead_lettered: 0,
    };
    assert_eq!(
        awaiting,
        [
            none(Channel::Email),
            none(Channel::Push),
            none(Channel::Sms)
        ]
    );
    assert_eq!(gauges.paused_tenants, [b.id]);
    let flag = |channel, draining| DrainFlag { channel, draining };
    assert!(gauges.draining.contains(&flag(Channel::Email, true)));
    assert!(gauges.draining.contains(&flag(Channel::Sms, false)));
    assert_eq!(gauges.buckets.len(), 1);
    assert_eq!(gauges.buckets[0].account, account("sms-main"));
    assert!(!gauges.buckets[0].paused);
    assert_eq!(gauges.buckets[0].rate_per_second, 10.0);
}
