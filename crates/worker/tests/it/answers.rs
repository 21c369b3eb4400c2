//! What a provider adapter's verdict does through the worker's one step, with a scripted
//! adapter in place of a provider: the contact flagged with the outcome and later deliveries
//! to it settled without a send; an account suspended when its credentials are refused, its
//! other deliveries given back unsent; a recipient's throttle kept from the bucket. And a
//! tenant routed to an account no worker has: it waits, nothing goes through the default.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use nudge_domain::{
    AdmissionSettings, Channel, DeliveryState, IdempotencySupport, ProviderAccount, ProviderAnswer,
    RetryPolicy, SendOutcome, Verdict,
};
use nudge_ledger::test_support::{self, DESTINATION_KEY as KEY, db_now};
use nudge_ledger::{DestinationCipher, DueDelivery, Ledger};
use nudge_provider::{Provider, SendRequest};
use nudge_worker::{LedgerClock, Processed, Providers, Recorder, Worker, WorkerMetrics};
use sqlx::PgPool;

use crate::common::envelope;

/// An adapter that answers from a list and counts what it was asked to send.
struct Scripted {
    account: ProviderAccount,
    endpoint: url::Url,
    answers: Mutex<VecDeque<SendOutcome>>,
    sent: AtomicUsize,
}

impl Provider for Scripted {
    fn account(&self) -> &ProviderAccount {
        &self.account
    }

    fn idempotency(&self) -> IdempotencySupport {
        IdempotencySupport::NotHonoured
    }

    fn endpoint(&self) -> &url::Url {
        &self.endpoint
    }

    fn send<'a>(
        &'a self,
        _req: SendRequest<'a>,
    ) -> impl std::future::Future<Output = SendOutcome> + Send + 'a {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let answer = self.answers.lock().unwrap().pop_front();
        async move {
            answer.unwrap_or_else(|| {
                SendOutcome::Answered(ProviderAnswer::new(Verdict::Accepted, Some(201)))
            })
        }
    }
}

fn account() -> ProviderAccount {
    ProviderAccount::parse("sms-twilio").unwrap()
}

fn answered(verdict: Verdict, status: u16) -> SendOutcome {
    SendOutcome::Answered(ProviderAnswer::new(verdict, Some(status)))
}

fn worker(ledger: &Ledger, answers: Vec<SendOutcome>) -> (Worker, Arc<Scripted>) {
    let provider = Arc::new(Scripted {
        account: account(),
        endpoint: url::Url::parse("http://127.0.0.1:9/").unwrap(),
        answers: Mutex::new(answers.into()),
        sent: AtomicUsize::new(0),
    });
    let clock = Arc::new(LedgerClock::new(Arc::new(Utc::now)));
    let admission = AdmissionSettings::default();
    let worker = Worker {
        channel: Channel::Sms,
        ledger: ledger.clone(),
        cipher: DestinationCipher::new(&KEY),
        providers: Providers::new(vec![provider.clone()], account()),
        policy: RetryPolicy::default(),
        lease_for: Duration::from_secs(30),
        account_recheck: Duration::from_secs(30),
        worker_id: format!("test-worker-{}", uuid::Uuid::new_v4().simple()),
        leases: Arc::default(),
        recorder: Recorder::spawn(ledger.clone(), admission.max_pause),
        clock,
        admission,
        metrics: Arc::new(WorkerMetrics::new()),
        shutdown: tokio_util::sync::CancellationToken::new(),
    };
    (worker, provider)
}

/// An SMS reminder for `subscriber`, due now, materialised and claimed as the relay would.
async fn due(ledger: &Ledger, event: &str, subscriber: &str) -> DueDelivery {
    test_support::published(
        ledger,
        Channel::Sms,
        event,
        subscriber,
        chrono::Duration::seconds(-1),
        chrono::Duration::hours(1),
    )
    .await
}

async fn contact(ledger: &Ledger, subscriber: &str) {
    test_support::contact(ledger, subscriber, Channel::Sms, "+15550100").await;
}

async fn record(ledger: &Ledger, d: &DueDelivery) -> nudge_ledger::DeliveryRecord {
    ledger.delivery(d.id).await.unwrap().unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_opted_out_answer_suppresses_later_reminders_to_that_number_without_a_send(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    contact(&ledger, "patient-1").await;
    // Another number: the opt-out is the number's (0505), not the subscriber's.
    test_support::contact(&ledger, "patient-2", Channel::Sms, "+15550199").await;
    let (worker, provider) = worker(&ledger, vec![answered(Verdict::ContactOptedOut, 400)]);

    let first = due(&ledger, "first", "patient-1").await;
    // Made and published before the answer: its lease finds the opt-out.
    let second = due(&ledger, "second", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&first)).await,
        Processed::Attempted(DeliveryState::DeadLettered)
    );
    assert_eq!(
        worker.process_one(&envelope(&second)).await,
        Processed::Attempted(DeliveryState::Suppressed)
    );
    let other = due(&ledger, "other", "patient-2").await;
    assert_eq!(
        worker.process_one(&envelope(&other)).await,
        Processed::Attempted(DeliveryState::Delivered)
    );

    assert_eq!(
        provider.sent.load(Ordering::SeqCst),
        2,
        "the opted-out contact got one send"
    );
    assert_eq!(
        record(&ledger, &second).await.last_error_reason.as_deref(),
        Some("contact_opted_out")
    );
    // One made due after the answer is created suppressed: nothing to claim, nothing sent.
    let now = test_support::db_now(&ledger).await;
    test_support::owed_from(
        &ledger,
        now,
        Channel::Sms,
        "third",
        "patient-1",
        chrono::Duration::seconds(-1),
        chrono::Duration::hours(1),
    )
    .await;
    let (state, reason): (String, Option<String>) = sqlx::query_as(
        "SELECT d.state, d.last_error_reason FROM deliveries d
         JOIN reminders r ON r.id = d.reminder_id WHERE r.event_id = 'third'",
    )
    .fetch_one(ledger.pool())
    .await
    .unwrap();
    assert_eq!(
        (state.as_str(), reason.as_deref()),
        ("suppressed", Some("contact_opted_out"))
    );
    let claimed = ledger
        .claim_due(Channel::Sms, 100, nudge_ledger::LedgerTime::Database)
        .await
        .unwrap();
    assert!(claimed.is_empty(), "nothing of it to claim: {claimed:?}");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_invalid_contact_answer_dead_letters_later_reminders_to_it_without_a_send(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    contact(&ledger, "patient-1").await;
    let (worker, provider) = worker(&ledger, vec![answered(Verdict::ContactInvalid, 400)]);
    let first = due(&ledger, "first", "patient-1").await;
    worker.process_one(&envelope(&first)).await;
    let second = due(&ledger, "second", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&second)).await,
        Processed::Attempted(DeliveryState::DeadLettered)
    );
    assert_eq!(provider.sent.load(Ordering::SeqCst), 1);
    assert_eq!(
        record(&ledger, &second).await.last_error_reason.as_deref(),
        Some("contact_invalid")
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn refused_credentials_suspend_the_account_and_its_other_deliveries_go_back_unsent(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let now = db_now(&ledger).await;
    ledger
        .ensure_bucket(&account(), Channel::Sms, 50.0, 50, now)
        .await
        .unwrap();
    contact(&ledger, "patient-1").await;
    let (worker, provider) = worker(&ledger, vec![answered(Verdict::AuthFailure, 401)]);

    let first = due(&ledger, "first", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&first)).await,
        Processed::Attempted(DeliveryState::RetryWait)
    );
    let bucket = ledger.rate_buckets().await.unwrap().remove(0);
    let paused_until = bucket.paused_until.expect("suspended");
    let pause = paused_until - db_now(&ledger).await;
    assert!(
        pause > chrono::Duration::seconds(55) && pause <= chrono::Duration::seconds(60),
        "suspended for admission.max_pause_s (60 s, 5 s tolerance for the test's own run), got {pause}"
    );
    assert_eq!(bucket.effective_rate, 50.0);

    let mut others = Vec::new();
    for i in 0..5 {
        others.push(due(&ledger, &format!("other-{i}"), "patient-1").await);
    }
    let payloads: Vec<Vec<u8>> = others.iter().map(envelope).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    for processed in worker.process_batch(&refs).await {
        assert_eq!(processed, Processed::Released("bucket_paused"));
    }
    assert_eq!(
        provider.sent.load(Ordering::SeqCst),
        1,
        "one send found the refusal"
    );
    for d in &others {
        let r = record(&ledger, d).await;
        assert_eq!(r.state, DeliveryState::RetryWait);
        assert_eq!(r.attempt_count, 0, "no attempt burnt on a known refusal");
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn refused_credentials_suspend_an_account_without_a_bucket_too(pool: PgPool) {
    // No rate configured, so no bucket: the suspension is the account's all the same.
    let ledger = Ledger::from_pool(pool);
    contact(&ledger, "patient-1").await;
    let (worker, provider) = worker(&ledger, vec![answered(Verdict::AuthFailure, 401)]);
    assert!(ledger.rate_buckets().await.unwrap().is_empty());

    let first = due(&ledger, "first", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&first)).await,
        Processed::Attempted(DeliveryState::RetryWait)
    );
    let mut others = Vec::new();
    for i in 0..5 {
        others.push(due(&ledger, &format!("other-{i}"), "patient-1").await);
    }
    let payloads: Vec<Vec<u8>> = others.iter().map(envelope).collect();
    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
    for processed in worker.process_batch(&refs).await {
        assert_eq!(processed, Processed::Released("bucket_paused"));
    }
    assert_eq!(
        provider.sent.load(Ordering::SeqCst),
        1,
        "one send found the refusal"
    );
    let now = db_now(&ledger).await;
    for d in &others {
        let r = record(&ledger, d).await;
        assert_eq!(r.state, DeliveryState::RetryWait);
        assert_eq!(r.attempt_count, 0, "no attempt burnt on a known refusal");
        let due_in = r.next_attempt_at.unwrap() - now;
        assert!(
            due_in > chrono::Duration::seconds(55) && due_in <= chrono::Duration::seconds(60),
            "due at the suspension's end (admission.max_pause_s, 60 s; 5 s tolerance for the \
             test's own run), got {due_in}"
        );
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_attempt_refused_for_the_account_spends_none_of_the_deliverys_attempt_budget(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    contact(&ledger, "patient-1").await;
    let (mut worker, _provider) = worker(&ledger, vec![answered(Verdict::AuthFailure, 401)]);
    // One attempt allowed: a refusal of the account must not be that one.
    worker.policy = RetryPolicy::new(
        Duration::from_millis(100),
        Duration::from_millis(100),
        1,
        Duration::from_secs(3600),
    )
    .unwrap();
    let first = due(&ledger, "first", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&first)).await,
        Processed::Attempted(DeliveryState::RetryWait)
    );
    let (count, base): (i32, i32) =
        sqlx::query_as("SELECT attempt_count, attempt_base FROM deliveries WHERE id = $1")
            .bind(first.id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(count, 1, "the attempt is in the history");
    assert_eq!(count - base, 0, "and spent nothing of the budget");
    let attempts = ledger.attempts(first.id).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].attempt_number, 1);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_recipient_throttle_retries_that_delivery_and_leaves_the_bucket_alone(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let now = db_now(&ledger).await;
    ledger
        .ensure_bucket(&account(), Channel::Sms, 50.0, 50, now)
        .await
        .unwrap();
    contact(&ledger, "patient-1").await;
    let throttled = SendOutcome::Answered(
        ProviderAnswer::new(Verdict::ThrottledRecipient, Some(429))
            .with_retry_after(Some("30".into())),
    );
    let (worker, _) = worker(&ledger, vec![throttled]);
    let first = due(&ledger, "first", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&first)).await,
        Processed::Attempted(DeliveryState::RetryWait)
    );
    let bucket = ledger.rate_buckets().await.unwrap().remove(0);
    assert_eq!(bucket.paused_until, None);
    assert_eq!(bucket.effective_rate, 50.0);
    let r = record(&ledger, &first).await;
    let wait = r.next_attempt_at.unwrap() - db_now(&ledger).await;
    assert!(
        wait > chrono::Duration::seconds(25),
        "Retry-After honoured: {wait}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_account_throttle_confirmed_by_a_second_slows_and_pauses_the_bucket_like_a_generic_429(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let now = db_now(&ledger).await;
    ledger
        .ensure_bucket(&account(), Channel::Sms, 50.0, 50, now)
        .await
        .unwrap();
    contact(&ledger, "patient-1").await;
    let throttled = SendOutcome::Answered(
        ProviderAnswer::new(Verdict::ThrottledAccount, Some(429))
            .with_retry_after(Some("10".into()))
            .with_code(Some("20429")),
    );
    let (worker, _) = worker(&ledger, vec![throttled.clone(), throttled]);
    let first = due(&ledger, "first", "patient-1").await;
    worker.process_one(&envelope(&first)).await;
    let bucket = ledger.rate_buckets().await.unwrap().remove(0);
    assert_eq!(
        bucket.paused_until, None,
        "one 429 alone is about its own request (decision 0120)"
    );
    let second = due(&ledger, "second", "patient-1").await;
    worker.process_one(&envelope(&second)).await;
    let bucket = ledger.rate_buckets().await.unwrap().remove(0);
    assert!(bucket.paused_until.is_some(), "the second confirms it");
    // Slowed: a 429 while the bucket spends its burst shrinks the burst, else it cuts the rate.
    let burst_cut: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT burst_cut_at FROM rate_buckets")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
    assert!(
        bucket.effective_rate < 50.0 || burst_cut.is_some(),
        "the account's 429 slowed the bucket: {bucket:?}"
    );
    assert_eq!(
        record(&ledger, &first).await.last_error_reason.as_deref(),
        Some("throttled_account: 20429")
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_tenant_on_an_account_no_worker_has_waits_and_nothing_goes_through_the_default(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    contact(&ledger, "patient-1").await;
    let clinic = test_support::clinic(&ledger).await;
    let own = ProviderAccount::parse("clinic-own").unwrap();
    ledger
        .set_tenant_channel_account(
            clinic.id,
            Channel::Sms,
            Some(&own),
            &test_support::ops(db_now(&ledger).await),
        )
        .await
        .unwrap();
    let (worker, provider) = worker(&ledger, vec![]);

    let waiting = due(&ledger, "waiting", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&waiting)).await,
        Processed::Released("account_unavailable")
    );
    // Another worker with the account starts: this one now leaves the next for it.
    ledger
        .announce_accounts(
            Channel::Sms,
            std::slice::from_ref(&own),
            nudge_ledger::LedgerTime::Database,
        )
        .await
        .unwrap();
    let left = due(&ledger, "left", "patient-1").await;
    assert_eq!(
        worker.process_one(&envelope(&left)).await,
        Processed::Dropped("unknown_provider_account")
    );

    assert_eq!(
        provider.sent.load(Ordering::SeqCst),
        0,
        "nothing through the default"
    );
    let r = record(&ledger, &waiting).await;
    assert_eq!(r.state, DeliveryState::RetryWait);
    assert_eq!(r.last_error_reason.as_deref(), Some("account_unavailable"));
    assert_eq!(r.attempt_count, 0);
    let next = r.next_attempt_at.unwrap() - db_now(&ledger).await;
    assert!(
        next > chrono::Duration::seconds(25) && next <= chrono::Duration::seconds(30),
        "looked at again after worker.account_recheck_ms (30 s, 5 s tolerance): {next}"
    );
    assert_eq!(record(&ledger, &left).await.state, DeliveryState::Queued);
}
