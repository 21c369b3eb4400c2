//! Fair claiming end to end (invariant 14): a large tenant's batch and a small clinic's few
//! reminders on one provider account limited to 40 requests/s, through the real producer,
//! janitor and two SMS workers and the stub's token bucket. Oldest first across tenants would
//! send the small clinic's reminders after the whole batch (here about 10 s late); in weighted
//! turns they go out within the in-flight window (about a second of the account's rate).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::Utc;
use nudge_domain::{Channel, IdempotencyKey};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report, percentile, stats};

const LIMIT: u32 = 40;
const BIG: usize = 600;
const SMALL: usize = 10;
/// Small's reminders fall due this long after big's batch (which takes BIG / LIMIT = 15 s).
const SMALL_AFTER_S: i64 = 5;
/// The target for small's lateness (scheduled to accepted), p99...
const SMALL_TARGET_S: f64 = 2.0;
/// ...give or take this on a loaded 2-core machine (the relay's and the workers' passes).
const TOLERANCE_S: f64 = 1.5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_clinics_reminders_are_not_late_behind_a_large_tenants_batch_on_a_shared_account() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("fair-claiming").await.unwrap();
    let big = env.tenant("big", 2).await.unwrap();
    let small = env.tenant("small", 2).await.unwrap();
    env.script(
        "sms-main",
        serde_json::json!({"rate_limit": {"per_second": LIMIT, "burst": LIMIT}}),
    )
    .await
    .unwrap();
    // Everything due from `start`: the processes start meanwhile and are warm by then.
    let start = Utc::now() + chrono::Duration::seconds(20);
    let small_due = start + chrono::Duration::seconds(SMALL_AFTER_S);
    for i in 0..BIG {
        env.reminder(
            big,
            &format!("big-{i}"),
            &[Channel::Sms],
            start,
            start + chrono::Duration::hours(1),
        )
        .await
        .unwrap();
    }
    let mut small_keys = Vec::new();
    for i in 0..SMALL {
        let created = env
            .reminder(
                small,
                &format!("small-{i}"),
                &[Channel::Sms],
                small_due,
                small_due + chrono::Duration::hours(1),
            )
            .await
            .unwrap();
        small_keys.push(
            IdempotencyKey::for_delivery(created.id, Channel::Sms)
                .as_str()
                .to_owned(),
        );
    }
    env.start_producer("producer").unwrap();
    env.start_janitor(200, 1_000).unwrap();
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((f64::from(LIMIT), LIMIT));
    options.prefetch = 32;
    env.start_worker(Channel::Sms, "worker-a", &options)
        .unwrap();
    env.start_worker(Channel::Sms, "worker-b", &options)
        .unwrap();
    assert!(Utc::now() < start, "setup took longer than its lead");

    let total = i64::try_from(BIG + SMALL).unwrap();
    let ledger = env.ledger.clone();
    env.wait_for("every reminder delivered", Duration::from_secs(120), || {
        let ledger = ledger.clone();
        async move {
            let done = nudge_e2e::count_in(&ledger, "delivered").await?;
            Ok((done == total).then_some(()))
        }
    })
    .await;

    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let mut late: Vec<f64> = keys
        .keys
        .iter()
        .filter(|k| small_keys.contains(&k.key))
        .filter_map(|k| k.accepted_at)
        .map(|at| (at - small_due).num_milliseconds() as f64 / 1000.0)
        .collect();
    late.sort_by(f64::total_cmp);
    let big_last = keys
        .keys
        .iter()
        .filter(|k| !small_keys.contains(&k.key))
        .filter_map(|k| k.accepted_at)
        .max()
        .unwrap();
    let big_drain_s = (big_last - start).num_milliseconds() as f64 / 1000.0;
    let stub = stats(env.stub_stats().await.unwrap()).unwrap();
    let status_429 = stub.accounts["sms-main"]
        .by_status
        .get(&429)
        .copied()
        .unwrap_or(0);
    eprintln!(
        "fair claiming: small p50 {:.2} s p99 {:.2} s late (target {SMALL_TARGET_S} s + {TOLERANCE_S} s); \
         big drained in {big_drain_s:.1} s (floor {:.1} s); 429s {status_429}",
        percentile(&late, 50.0),
        percentile(&late, 99.0),
        (BIG + SMALL) as f64 / f64::from(LIMIT)
    );
    assert_eq!(late.len(), SMALL, "every small reminder accepted");
    assert!(
        percentile(&late, 99.0) <= SMALL_TARGET_S + TOLERANCE_S,
        "small's reminders were late behind big's batch: {late:?}"
    );
    assert!(
        big_drain_s <= (BIG + SMALL) as f64 / f64::from(LIMIT) * 1.25 + TOLERANCE_S,
        "big's drain stays near its floor: {big_drain_s:.1} s"
    );
}
