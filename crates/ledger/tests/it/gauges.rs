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

/// The console's samples: one per channel and minute whoever writes it first (a second
/// janitor writes nothing), the oldest eligible wait as of the minute's start, the attempts
/// delivered and answered 429 in the minute before, and nothing older than a day kept.
#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_minute_is_sampled_once_with_its_wait_and_its_attempts_and_a_day_is_kept(pool: PgPool) {
    use nudge_domain::{
        AttemptContext, FixedJitter, IdempotencySupport, RetryPolicy, SendOutcome, decide,
    };
    use nudge_ledger::{AttemptRecord, Recorded};
    let owner = Ledger::from_pool(pool.clone());
    let janitor = connected_as(&pool, "nudge_janitor").await;
    let clinic = tenant(&owner).await;
    // Two SMS due at t0; one is answered 200 and one 429 thirty seconds later.
    owed(&owner, clinic.id, "sent", &[Channel::Sms], t0()).await;
    owed(&owner, clinic.id, "throttled", &[Channel::Sms], t0()).await;
    owed(&owner, clinic.id, "waiting", &[Channel::Email], t0()).await;
    let answered = t0() + secs(30);
    for (due, status) in owner
        .claim_due(Channel::Sms, 10, at(answered))
        .await
        .unwrap()
        .into_iter()
        .zip([200u16, 429])
    {
        let lease = leased(lease(&owner, &due, answered).await);
        let ctx = AttemptContext {
            attempt_number: lease.attempt_number,
            expires_at: lease.expires_at,
            idempotency: IdempotencySupport::Honoured,
        };
        let outcome = SendOutcome::Response {
            status,
            retry_after: None,
            provider_message_id: (status == 200).then(|| "prov-1".to_owned()),
        };
        let decision = decide(
            &ctx,
            &outcome,
            answered,
            &RetryPolicy::default(),
            &mut FixedJitter::new(1_000),
        );
        let attempt = AttemptRecord {
            started_at: answered,
            finished_at: answered,
            worker: "worker-1".into(),
            correlation_id: None,
        };
        assert_eq!(
            record(&owner, &lease, &decision, &attempt, answered).await,
            Recorded::Applied
        );
    }
    // The minute after, as of its start (09:01:00): the email has waited since t0, 60 s; the
    // throttled SMS waits to retry since 09:00:31 (the retry's jitter: 1 s), 29 s; no push.
    let next = t0() + secs(90);
    assert_eq!(janitor.record_ledger_sample(at(next)).await.unwrap(), 3);
    assert_eq!(
        janitor
            .record_ledger_sample(at(next + secs(20)))
            .await
            .unwrap(),
        0,
        "the minute has its sample"
    );
    let rows: Vec<(String, Option<f64>, i64, i64)> = sqlx::query_as(
        "SELECT channel, oldest_eligible_age_s, delivered, throttled FROM ledger_samples
         ORDER BY channel",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![
            ("email".to_owned(), Some(60.0), 0, 0),
            ("push".to_owned(), None, 0, 0),
            ("sms".to_owned(), Some(29.0), 1, 1),
        ]
    );
    // A day and a minute later, the first minute's samples go as the new one is written.
    assert_eq!(
        janitor
            .record_ledger_sample(at(next + secs(86_400 + 60)))
            .await
            .unwrap(),
        3
    );
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_samples")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, 3);
}
