//! A reschedule and a cancel racing the send, end to end through the real binaries: the
//! intake's answer for each reminder and the provider's requests for its key agree
//! (docs/decisions/0309-reschedule-and-truthful-cancel.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use nudge_domain::{Channel, IdempotencyKey, ReminderId};
use nudge_e2e::{TestEnv, WorkerOptions, keys_report};
use serde_json::{Value, json};

const REMINDERS: usize = 300;
/// Every third is cancelled (100), the others moved an hour ahead (200).
const CANCEL_EVERY: usize = 3;
/// Due times are this far apart, so the intake takes a change every few tens of milliseconds.
const SPACING_MS: i64 = 20;
/// Each change is sent at its reminder's due time plus or minus up to this.
const JITTER_MS: i64 = 200;

/// A random offset from -JITTER_MS to JITTER_MS (a v4 UUID's random bits).
fn random_offset_ms() -> i64 {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let r = i64::from(u16::from_le_bytes([bytes[0], bytes[1]]));
    r % (2 * JITTER_MS + 1) - JITTER_MS
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn reminder(i: usize, scheduled_at: DateTime<Utc>) -> Value {
    json!({
        "event_id": format!("race-{i}"),
        "subscriber_ref": format!("patient-{i}"),
        "channels": ["sms"],
        "scheduled_at": rfc3339(scheduled_at),
        "expires_at": rfc3339(scheduled_at + chrono::Duration::minutes(30)),
        "destinations": {"sms": format!("+1555{i:07}")},
        "content": {"template": "appointment"}
    })
}

/// What the intake answered for one reminder's channel: the word and the state it named.
#[derive(Debug, Clone)]
struct Answered {
    cancel: bool,
    answer: String,
    state: Option<String>,
    new_time: Option<DateTime<Utc>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_or_reschedule_racing_the_send_and_the_providers_requests_agree() {
    let mut env = TestEnv::start("reschedule-race").await.unwrap();
    env.tenant("clinic", 2).await.unwrap();
    let secret = env.rotate_secret("clinic").unwrap();
    let (_, url) = env.start_intake("intake").await.unwrap();
    env.start_producer("producer").unwrap();
    // Two workers behind one bucket, so some leases wait for their slot (leased, unfenced).
    let mut options = WorkerOptions::for_channel(Channel::Sms);
    options.rate = Some((40.0, 4));
    for name in ["worker-sms-1", "worker-sms-2"] {
        env.start_worker(Channel::Sms, name, &options).unwrap();
    }

    // Posted in one batch, due one after another from a few seconds on.
    let first_due = Utc::now() + chrono::Duration::seconds(6);
    let due: Vec<DateTime<Utc>> = (0..REMINDERS)
        .map(|i| first_due + chrono::Duration::milliseconds(SPACING_MS * i as i64))
        .collect();
    let batch = json!({
        "reminders": due.iter().enumerate().map(|(i, t)| reminder(i, *t)).collect::<Vec<_>>()
    });
    let reminders_url = format!("{url}/v1/tenants/clinic/reminders");
    let posted: Value = env
        .signed(
            reqwest::Method::POST,
            &reminders_url,
            &secret,
            serde_json::to_vec(&batch).unwrap(),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ids = Vec::with_capacity(REMINDERS);
    for (i, item) in posted["results"].as_array().unwrap().iter().enumerate() {
        assert_eq!(item["status"], 202, "reminder {i}: {item}");
        let id: uuid::Uuid = item["reminder"]["reminder_id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        ids.push(ReminderId::from_uuid(id));
    }
    assert!(
        Utc::now() < first_due - chrono::Duration::milliseconds(JITTER_MS),
        "the batch was recorded before the first change is due"
    );

    // Each change at its reminder's due time plus or minus up to 200 ms.
    let mut tasks = Vec::with_capacity(REMINDERS);
    for (i, due_at) in due.iter().copied().enumerate() {
        let offset = random_offset_ms();
        let send_at = due_at + chrono::Duration::milliseconds(offset);
        let cancel = i % CANCEL_EVERY == 0;
        let event_url = format!("{url}/v1/tenants/clinic/reminders/race-{i}");
        let (method, target, body, new_time) = if cancel {
            (
                reqwest::Method::POST,
                format!("{event_url}/cancel"),
                Vec::new(),
                None,
            )
        } else {
            // As the body carries it: milliseconds.
            let later = (due_at + chrono::Duration::hours(1)).trunc_subsecs(3);
            let mut body = reminder(i, later);
            body["revision"] = json!(1);
            (
                reqwest::Method::PUT,
                event_url,
                serde_json::to_vec(&body).unwrap(),
                Some(later),
            )
        };
        let http = env.http.clone();
        let secret = secret.clone();
        tasks.push(tokio::spawn(async move {
            // Not a wait for an effect: the client's own schedule for its change.
            if let Ok(wait) = (send_at - Utc::now()).to_std() {
                tokio::time::sleep(wait).await;
            }
            let signature = nudge_e2e::intake_signature(&method, &target, &secret, &body);
            let response = http
                .request(method, &target)
                .header("content-type", "application/json")
                .header("nudge-signature", signature)
                .timeout(Duration::from_secs(30))
                .body(body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let answer: Value = response.json().await.unwrap();
            assert_eq!(status, 200, "reminder {i}: {answer}");
            let channel = &answer["channels"][0];
            assert_eq!(channel["channel"], "sms", "reminder {i}: {answer}");
            let word = if cancel {
                &channel["answer"]
            } else {
                &channel["change"]
            };
            Answered {
                cancel,
                answer: word.as_str().unwrap().to_owned(),
                state: channel["state"].as_str().map(str::to_owned),
                new_time,
            }
        }));
    }
    let mut answers = Vec::with_capacity(REMINDERS);
    for task in tasks {
        answers.push(task.await.unwrap());
    }

    // Everything too late to change has settled; the moved wait for their new time.
    let ledger = env.ledger.clone();
    env.wait_for(
        "every delivery to settle or wait for its new time",
        Duration::from_secs(90),
        || {
            let ledger = ledger.clone();
            async move {
                let busy: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM deliveries
                 WHERE state IN ('queued', 'sending', 'retry_wait')
                    OR (state = 'scheduled' AND next_attempt_at < now())",
                )
                .fetch_one(ledger.pool())
                .await?;
                Ok((busy == 0).then_some(()))
            }
        },
    )
    .await;

    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    let requests: HashMap<&str, usize> = keys
        .keys
        .iter()
        .map(|k| (k.key.as_str(), k.requests.len()))
        .collect();
    let rows: Vec<(uuid::Uuid, String, Option<DateTime<Utc>>, i64)> = sqlx::query_as(
        "SELECT d.reminder_id, d.state, d.next_attempt_at,
                (SELECT count(*) FROM attempts a WHERE a.delivery_id = d.id)
         FROM deliveries d",
    )
    .fetch_all(env.ledger.pool())
    .await
    .unwrap();
    let ledger_state: HashMap<uuid::Uuid, (String, Option<DateTime<Utc>>, i64)> = rows
        .into_iter()
        .map(|(id, state, next, attempts)| (id, (state, next, attempts)))
        .collect();

    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut disagreements = Vec::new();
    for (i, (answered, id)) in answers.iter().zip(&ids).enumerate() {
        let key = IdempotencyKey::for_delivery(*id, Channel::Sms).to_string();
        let sent = requests.get(key.as_str()).copied().unwrap_or(0);
        let kind = if answered.cancel {
            "cancel"
        } else {
            "reschedule"
        };
        *counts
            .entry(format!(
                "{kind} {}{}",
                answered.answer,
                answered
                    .state
                    .as_ref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
            ))
            .or_default() += 1;
        // A delivery may not exist when the change came before the producer's window.
        let (state, next, attempts) = ledger_state
            .get(&id.as_uuid())
            .cloned()
            .unwrap_or_else(|| ("none".to_owned(), None, 0));
        let agrees = match answered.answer.as_str() {
            "cancelled" => sent == 0 && (state == "cancelled" || state == "none"),
            "moved" => {
                sent == 0
                    && (state == "none" || (state == "scheduled" && next == answered.new_time))
            }
            "too_late" => {
                sent >= 1 && i64::try_from(sent).unwrap() == attempts && state == "delivered"
            }
            _ => false,
        };
        if !agrees {
            disagreements.push(format!(
                "reminder {i}: answered {kind} {} {:?}; provider requests {sent}; ledger {state} \
                 with {attempts} attempts, next {next:?}",
                answered.answer, answered.state
            ));
        }
    }
    // How many leases waiting for their slot lost to a change (their fence found no lease).
    let lost_while_waiting: usize = ["worker-sms-1", "worker-sms-2"]
        .iter()
        .map(|name| {
            std::fs::read_to_string(env.dir.join(format!("{name}.log")))
                .unwrap_or_default()
                .matches("lease lost while waiting for the send slot")
                .count()
        })
        .sum();
    eprintln!(
        "reschedule race over {REMINDERS} reminders, answers: {counts:?}; waiting leases that \
         lost to a change: {lost_while_waiting}"
    );
    assert!(
        disagreements.is_empty(),
        "{} answers disagree with the provider:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
    assert_eq!(
        answers.iter().filter(|a| a.cancel).count(),
        REMINDERS / CANCEL_EVERY
    );

    let exits = env.stop_all(Duration::from_secs(15));
    for (name, code) in exits {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }
}
