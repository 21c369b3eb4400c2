//! Quiet hours end to end (issue 25), through the real producer and SMS worker run under
//! `TZ=Asia/Tokyo`: a window that covers "now" in the tenant's zone (New York) sends nothing
//! inside it and every reminder within 2 s after it ends; a reminder whose expiry falls inside
//! the window settles `expired` with the reason `quiet_hours` and no request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::time::Duration;

use chrono::{DateTime, Utc};
use nudge_domain::{Channel, IdempotencyKey, QuietHours, Zone};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report};

/// Reminders due now, inside the window.
const OWED: usize = 5;
/// The window ends this long after the reminders are posted.
const WINDOW_LEFT_S: i64 = 12;
/// Every reminder is accepted within this long after the window's end...
const AFTER_END_S: f64 = 2.0;
/// ...give or take this on a loaded 2-core machine (the relay's pass and a publish).
const TOLERANCE_S: f64 = 1.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_sent_inside_quiet_hours_and_everything_soon_after_they_end() {
    let _alone = crate::alone().await;
    let mut env = TestEnv::start("quiet-hours").await.unwrap();
    env.host_zone = Some("Asia/Tokyo".to_owned());
    let tenant = env.tenant("clinic", 2).await.unwrap();
    let new_york = Zone::parse("America/New_York").unwrap();
    let now = DateTime::from_timestamp(Utc::now().timestamp(), 0).unwrap();
    let end = now + chrono::Duration::seconds(WINDOW_LEFT_S);
    let clock = |at: DateTime<Utc>| new_york.local_at(at).naive().format("%H:%M:%S").to_string();
    let (from, to) = (clock(now - chrono::Duration::minutes(2)), clock(end));
    for args in [
        vec![
            "tenant",
            "set",
            "clinic",
            "--time-zone",
            "America/New_York",
            "--reason",
            "test",
        ],
        vec![
            "tenant",
            "quiet-hours",
            "set",
            "clinic",
            "--channel",
            "sms",
            "--from",
            &from,
            "--to",
            &to,
            "--reason",
            "test",
        ],
    ] {
        let (code, out, err) = env.nudgectl(&args).unwrap();
        assert_eq!(code, 0, "nudgectl {args:?}: {out}{err}");
    }
    let (_, shown, _) = env
        .nudgectl(&["tenant", "quiet-hours", "show", "clinic"])
        .unwrap();
    // The window reads back as the domain shows it (`HH:MM` when the seconds are zero).
    let window = QuietHours::parse(&from, &to).unwrap();
    assert!(
        shown.contains(&format!("sms    {window}")),
        "quiet-hours show: {shown}"
    );

    let mut keys = Vec::new();
    for i in 0..OWED {
        let created = env
            .reminder(
                tenant,
                &format!("owed-{i}"),
                &[Channel::Sms],
                now,
                now + chrono::Duration::hours(1),
            )
            .await
            .unwrap();
        keys.push(
            IdempotencyKey::for_delivery(created.id, Channel::Sms)
                .as_str()
                .to_owned(),
        );
    }
    // Its expiry falls inside the window: it is never sent.
    let expiring = env
        .reminder(
            tenant,
            "expiring",
            &[Channel::Sms],
            now,
            end - chrono::Duration::seconds(4),
        )
        .await
        .unwrap();
    env.start_producer("producer").unwrap();
    env.start_worker(
        Channel::Sms,
        "worker-sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();

    let ledger = env.ledger.clone();
    env.wait_for(
        "the owed reminders delivered and the expiring one expired",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let states = nudge_e2e::states_in(&ledger).await?;
                Ok((states.get("delivered") == Some(&(OWED as i64))
                    && states.get("expired") == Some(&1))
                .then_some(()))
            }
        },
    )
    .await;

    let report = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let inside: Vec<DateTime<Utc>> = report
        .keys
        .iter()
        .flat_map(|k| k.requests.iter().map(|r| r.at))
        .filter(|at| *at < end)
        .collect();
    let after: Vec<f64> = report
        .keys
        .iter()
        .filter(|k| keys.contains(&k.key))
        .filter_map(|k| k.accepted_at)
        .map(|at| (at - end).num_milliseconds() as f64 / 1000.0)
        .collect();
    eprintln!(
        "quiet hours {from}-{to} in New York: {} requests inside; accepted after the end: {after:?} s",
        inside.len()
    );
    assert!(inside.is_empty(), "requests inside the window: {inside:?}");
    assert_eq!(after.len(), OWED, "every owed reminder accepted once");
    assert!(
        after.iter().all(|s| *s <= AFTER_END_S + TOLERANCE_S),
        "sent more than {AFTER_END_S} s (+{TOLERANCE_S} s) after the window: {after:?}"
    );
    let expiring_key = IdempotencyKey::for_delivery(expiring.id, Channel::Sms);
    assert!(
        report.keys.iter().all(|k| k.key != expiring_key.as_str()),
        "the expiring reminder reached the provider"
    );
    let (state, reason): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error_reason FROM deliveries WHERE reminder_id = $1")
            .bind(expiring.id.as_uuid())
            .fetch_one(env.ledger.pool())
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), reason.as_deref()),
        ("expired", Some("quiet_hours"))
    );
}
