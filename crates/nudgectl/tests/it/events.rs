//! `nudgectl events replay|tail`: a tenant's delivery events as JSON Lines, from a position or
//! a time, and the cursor to go on from.
#![allow(clippy::unwrap_used)]

use clap::Parser;
use nudge_domain::{Channel, EventId};
use nudge_ledger::test_support::{owed, t0, tenant};
use nudge_ledger::{Ledger, LedgerTime};
use nudgectl::{Cli, execute};
use serde_json::Value;
use sqlx::PgPool;

async fn ctl(ledger: &Ledger, args: &[&str]) -> anyhow::Result<(Vec<Value>, String)> {
    let command =
        Cli::try_parse_from(std::iter::once("nudgectl").chain(args.iter().copied()))?.command;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    execute(ledger, "ops@clinic", None, command, &mut out, &mut err).await?;
    let lines = String::from_utf8(out)?
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    Ok((lines, String::from_utf8(err)?))
}

fn kinds(lines: &[Value]) -> Vec<(&str, &str)> {
    lines
        .iter()
        .map(|l| (l["event_id"].as_str().unwrap(), l["kind"].as_str().unwrap()))
        .collect()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn events_are_replayed_from_a_cursor_or_a_time_and_tailed_to_a_limit(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let tenant = tenant(&ledger).await;
    owed(&ledger, tenant.id, "appt-1", &[Channel::Sms], t0()).await;
    owed(&ledger, tenant.id, "appt-2", &[Channel::Sms], t0()).await;
    ledger.sequence_events(100).await.unwrap();

    let (all, err) = ctl(&ledger, &["events", "replay", "--tenant", "clinic-a"])
        .await
        .unwrap();
    assert_eq!(
        kinds(&all),
        [("appt-1", "scheduled"), ("appt-2", "scheduled")]
    );
    let first = all[0]["position"].as_i64().unwrap();
    let last = all[1]["position"].as_i64().unwrap();
    assert!(
        err.contains(&format!("2 events; next cursor: {last}")),
        "{err}"
    );

    let (after_first, _) = ctl(
        &ledger,
        &[
            "events",
            "replay",
            "--tenant",
            "clinic-a",
            "--from",
            &first.to_string(),
        ],
    )
    .await
    .unwrap();
    assert_eq!(kinds(&after_first), [("appt-2", "scheduled")]);

    // Cancelled later: from a time after the first events, only the cancellation.
    let since = chrono::Utc::now();
    ledger
        .cancel_reminder_by_channel(
            tenant.id,
            &EventId::parse("appt-1").unwrap(),
            LedgerTime::Database,
        )
        .await
        .unwrap();
    ledger.sequence_events(100).await.unwrap();
    let (from_time, _) = ctl(
        &ledger,
        &[
            "events",
            "replay",
            "--tenant",
            "clinic-a",
            "--from",
            &since.to_rfc3339(),
        ],
    )
    .await
    .unwrap();
    assert_eq!(kinds(&from_time), [("appt-1", "cancelled")]);
    assert_eq!(from_time[0]["delivery_seq"], 2);

    // Tail from a cursor, to a limit: stops at once with what is there.
    let (tailed, err) = ctl(
        &ledger,
        &[
            "events",
            "tail",
            "--tenant",
            "clinic-a",
            "--from",
            &last.to_string(),
            "--limit",
            "1",
        ],
    )
    .await
    .unwrap();
    assert_eq!(kinds(&tailed), [("appt-1", "cancelled")]);
    assert!(err.contains("1 events; next cursor:"), "{err}");
    // From the newest, for a second: nothing new.
    let (none, _) = ctl(
        &ledger,
        &["events", "tail", "--tenant", "clinic-a", "--for", "1"],
    )
    .await
    .unwrap();
    assert!(none.is_empty());

    for bad in [
        &["events", "replay", "--tenant", "clinic-a", "--from", "-3"][..],
        &[
            "events",
            "replay",
            "--tenant",
            "clinic-a",
            "--from",
            "yesterday",
        ][..],
        &["events", "tail", "--tenant", "clinic-a", "--limit", "0"][..],
    ] {
        assert!(ctl(&ledger, bad).await.is_err(), "{bad:?}");
    }
    assert!(
        ctl(&ledger, &["events", "replay", "--tenant", "nobody"])
            .await
            .is_err()
    );
}
