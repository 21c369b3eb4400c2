//! The emulated accounts: scripts, buckets, per-key history, counters.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound as _, Utc};
use governor::clock::Clock as _;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use nudge_domain::ProviderAccount;

use crate::script::{RetryAfterForm, Script, Step, StepStatus};
use crate::shape::ShapeConfig;
use crate::stats::{
    AccountStats, AnswerKind, KeyReport, KeyRequest, KeysReport, SlidingWindowMax, Stats,
};

/// The shared state of one stub server; cheap to clone (all clones see the same accounts).
#[derive(Clone, Default)]
pub struct StubState {
    inner: Arc<Mutex<Inner>>,
    shape: Arc<ShapeConfig>,
}

impl std::fmt::Debug for StubState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StubState").finish_non_exhaustive()
    }
}

#[derive(Default)]
pub(crate) struct Inner {
    accounts: BTreeMap<String, Account>,
    total: Counters,
    /// The `n` of the last `msg_<n>` handed out.
    last_message: u64,
    /// What was posted to `/webhooks/{name}`.
    pub(crate) webhooks: crate::webhooks::Webhooks,
}

struct Account {
    script: Script,
    bucket: Option<(DefaultDirectRateLimiter, RetryAfterForm)>,
    keys: HashMap<String, KeyState>,
    counters: Counters,
}

impl Account {
    fn new(script: Script) -> Self {
        let bucket = script.rate_limit.map(|rl| {
            let quota = Quota::per_second(rl.per_second).allow_burst(rl.burst());
            (RateLimiter::direct(quota), rl.retry_after)
        });
        Self {
            script,
            bucket,
            keys: HashMap::new(),
            counters: Counters::default(),
        }
    }
}

struct KeyState {
    /// Requests answered by a step so far: the index into the sequence for the next one.
    stepped: usize,
    accepted: Option<Accepted>,
    requests: Vec<KeyRequest>,
}

struct Accepted {
    at: DateTime<Utc>,
    status: StepStatus,
    message_id: String,
}

struct Counters {
    stats: AccountStats,
    window: SlidingWindowMax,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            stats: AccountStats::default(),
            window: SlidingWindowMax::new(Duration::from_secs(1)),
        }
    }
}

impl Counters {
    fn arrival(&mut self, now: DateTime<Utc>, instant: Instant) {
        let s = &mut self.stats;
        s.requests += 1;
        s.first_request_at.get_or_insert(now);
        s.last_request_at = Some(now);
        s.max_requests_in_any_second = self.window.record(instant);
    }

    fn answered(&mut self, status: u16) {
        *self.stats.by_status.entry(status).or_default() += 1;
    }
}

/// A provider request as the handler saw it: no destination or content, only whether the body
/// was acceptable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Incoming<'a> {
    pub(crate) key: Option<&'a str>,
    /// Why the request is refused before the script is consulted (bad key header, bad body).
    pub(crate) invalid: Option<&'static str>,
    /// The W3C `traceparent` header, kept with the key's history (at most 64 characters).
    pub(crate) traceparent: Option<&'a str>,
    /// Whether an already accepted key gets its first answer again (providers that honour an
    /// idempotency key) or is sent again (the real providers' shapes, which do not).
    pub(crate) dedupe: bool,
}

/// What to answer, decided under the lock and carried out after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) retry_after: Option<String>,
    pub(crate) body: serde_json::Value,
    pub(crate) delay: Option<Duration>,
    pub(crate) hang: bool,
    /// The scripted step's provider error code and receipt (see [`Step`]).
    pub(crate) code: Option<String>,
    pub(crate) receipt: Option<String>,
    pub(crate) receipt_delay: Duration,
    /// The message id handed out when the step took the message (a 2xx, or a 2xx hang).
    pub(crate) message_id: Option<String>,
}

impl StubState {
    pub fn new() -> Self {
        Self::default()
    }

    /// A stub speaking `shape` (its routes, answers and receipts) instead of the generic one.
    pub fn with_shape(shape: ShapeConfig) -> Self {
        Self {
            inner: Arc::default(),
            shape: Arc::new(shape),
        }
    }

    /// The shape this stub speaks.
    pub fn shape(&self) -> &ShapeConfig {
        &self.shape
    }

    /// Sets `account`'s script. Its bucket starts full again; its keys keep their history
    /// (dedup survives like at a real provider, and a key's next request gets the new
    /// sequence at the position the key has reached). [`StubState::reset`] forgets everything.
    pub fn set_script(&self, account: ProviderAccount, script: Script) {
        let mut inner = self.lock();
        match inner.accounts.get_mut(account.as_str()) {
            Some(existing) => {
                let fresh = Account::new(script);
                existing.script = fresh.script;
                existing.bucket = fresh.bucket;
            }
            None => {
                inner
                    .accounts
                    .insert(account.as_str().to_owned(), Account::new(script));
            }
        }
    }

    /// The account's script; the empty (accept everything) script when none was set.
    pub fn script(&self, account: &ProviderAccount) -> Script {
        self.lock()
            .accounts
            .get(account.as_str())
            .map(|a| a.script.clone())
            .unwrap_or_default()
    }

    /// Forgets every script, key, counter and webhook request; message ids start again at
    /// `msg_1`.
    pub fn reset(&self) {
        *self.lock() = Inner::default();
    }

    pub fn stats(&self) -> Stats {
        let inner = self.lock();
        Stats {
            total: inner.total.stats.clone(),
            accounts: inner
                .accounts
                .iter()
                .filter(|(_, a)| a.counters.stats.requests > 0)
                .map(|(name, a)| (name.clone(), a.counters.stats.clone()))
                .collect(),
        }
    }

    pub fn keys(&self) -> KeysReport {
        let inner = self.lock();
        let mut keys: Vec<KeyReport> = inner
            .accounts
            .iter()
            .flat_map(|(account, a)| {
                a.keys.iter().map(move |(key, k)| KeyReport {
                    account: account.clone(),
                    key: key.clone(),
                    requests: k.requests.clone(),
                    accepted_at: k.accepted.as_ref().map(|acc| acc.at),
                    message_id: k.accepted.as_ref().map(|acc| acc.message_id.clone()),
                })
            })
            .collect();
        keys.sort_by(|a, b| (&a.account, &a.key).cmp(&(&b.account, &b.key)));
        KeysReport { keys }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves counters at worst one request off; a test
        // double should keep answering rather than poison every later request.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Decides the answer to one provider request and records it.
    pub(crate) fn handle(&self, account: &ProviderAccount, req: Incoming<'_>) -> Reply {
        // Stored at the precision it is reported with, so the library and HTTP views agree.
        let now = Utc::now().trunc_subsecs(3);
        let instant = Instant::now();
        let traceparent = req.traceparent.filter(|t| t.len() <= 64);
        let mut guard = self.lock();
        let inner = &mut *guard;
        let acct = inner
            .accounts
            .entry(account.as_str().to_owned())
            .or_insert_with(|| Account::new(Script::default()));

        inner.total.arrival(now, instant);
        acct.counters.arrival(now, instant);
        let mut key_state = match req.key {
            Some(key) => {
                let new = !acct.keys.contains_key(key);
                if new {
                    inner.total.stats.unique_keys += 1;
                    acct.counters.stats.unique_keys += 1;
                }
                Some(acct.keys.entry(key.to_owned()).or_insert_with(|| KeyState {
                    stepped: 0,
                    accepted: None,
                    requests: Vec::new(),
                }))
            }
            None => {
                inner.total.stats.without_key += 1;
                acct.counters.stats.without_key += 1;
                None
            }
        };

        let Decision {
            reply,
            kind,
            newly_accepted,
        } = decide(
            &acct.script,
            acct.bucket.as_ref(),
            key_state.as_deref_mut(),
            req,
            now,
            &mut inner.last_message,
        );

        for counters in [&mut inner.total, &mut acct.counters] {
            let s = &mut counters.stats;
            match kind {
                AnswerKind::RateLimited => s.rate_limited += 1,
                AnswerKind::Duplicate => s.duplicates += 1,
                AnswerKind::Hung => s.hung += 1,
                AnswerKind::Scripted | AnswerKind::Invalid => {}
            }
            if newly_accepted {
                s.accepted += 1;
            }
            // A hung request is never answered.
            if kind != AnswerKind::Hung {
                counters.answered(reply.status);
            }
        }
        if let Some(k) = key_state {
            k.requests.push(KeyRequest {
                at: now,
                status: reply.status,
                kind,
                traceparent: traceparent.map(str::to_owned),
            });
        }
        reply
    }
}

struct Decision {
    reply: Reply,
    kind: AnswerKind,
    /// The request got the first 2xx of its key (or a 2xx without a key).
    newly_accepted: bool,
}

impl Decision {
    fn plain(reply: Reply, kind: AnswerKind) -> Self {
        Self {
            reply,
            kind,
            newly_accepted: false,
        }
    }
}

/// The rules in order: bucket, request validity, dedup, then the key's next step.
fn decide(
    script: &Script,
    bucket: Option<&(DefaultDirectRateLimiter, RetryAfterForm)>,
    mut key: Option<&mut KeyState>,
    req: Incoming<'_>,
    now: DateTime<Utc>,
    last_message: &mut u64,
) -> Decision {
    if let Some((limiter, form)) = bucket
        && let Err(not_until) = limiter.check()
    {
        let wait = not_until.wait_time_from(limiter.clock().now());
        let reply = Reply {
            status: 429,
            retry_after: form.render(now, wait),
            body: serde_json::json!({"error": "rate limited"}),
            delay: None,
            hang: false,
            code: None,
            receipt: None,
            receipt_delay: Duration::ZERO,
            message_id: None,
        };
        return Decision::plain(reply, AnswerKind::RateLimited);
    }

    let invalid = req.invalid.or_else(|| {
        (script.require_idempotency_key && req.key.is_none()).then_some("missing Idempotency-Key")
    });
    if let Some(message) = invalid {
        let reply = Reply {
            status: 400,
            retry_after: None,
            body: serde_json::json!({ "error": message }),
            delay: None,
            hang: false,
            code: None,
            receipt: None,
            receipt_delay: Duration::ZERO,
            message_id: None,
        };
        return Decision::plain(reply, AnswerKind::Invalid);
    }

    if let Some(accepted) = key
        .as_ref()
        .and_then(|k| k.accepted.as_ref())
        .filter(|_| req.dedupe)
    {
        let reply = Reply {
            status: accepted.status.as_u16(),
            retry_after: None,
            body: serde_json::json!({ "id": accepted.message_id }),
            delay: None,
            hang: false,
            code: None,
            receipt: None,
            receipt_delay: Duration::ZERO,
            message_id: None,
        };
        return Decision::plain(reply, AnswerKind::Duplicate);
    }

    // A request without a key cannot be followed, so every one of them is a "first" request.
    let position = key.as_ref().map_or(0, |k| k.stepped);
    let step: Step = script
        .sequence
        .get(position)
        .or(script.default.as_ref())
        .cloned()
        .unwrap_or_default();
    let newly_accepted = step.status.is_success();
    let mut taken = None;
    let body = if newly_accepted {
        *last_message += 1;
        let message_id = format!("msg_{last_message}");
        if let Some(k) = key.as_deref_mut()
            && k.accepted.is_none()
        {
            k.accepted = Some(Accepted {
                at: now,
                status: step.status,
                message_id: message_id.clone(),
            });
        }
        taken = Some(message_id.clone());
        serde_json::json!({ "id": message_id })
    } else {
        serde_json::json!({ "error": format!("scripted {}", step.status.as_u16()) })
    };
    if let Some(k) = key {
        k.stepped += 1;
    }
    let reply = Reply {
        status: step.status.as_u16(),
        retry_after: step.retry_after.as_ref().map(|r| r.render(now)),
        body,
        delay: step.delay(),
        hang: step.hang,
        code: step.code.clone(),
        receipt: step.receipt.clone(),
        receipt_delay: Duration::from_millis(step.receipt_delay_ms.unwrap_or(0)),
        message_id: taken,
    };
    let kind = if step.hang {
        AnswerKind::Hung
    } else {
        AnswerKind::Scripted
    };
    Decision {
        reply,
        kind,
        newly_accepted,
    }
}
