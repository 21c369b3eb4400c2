//! Admission at the narrowest limit: the rate bucket of one provider account + channel.
//!
//! Every worker replica shares one bucket row. A worker locks the row, asks [`admit`] for a send
//! slot on the row's [`BucketState`], and writes the state back in the same transaction, so the
//! replicas together never send faster than the bucket allows. The limiter is GCRA (the virtual
//! scheduling form of a token bucket): with effective rate `r` the emission interval is
//! `T = 1/r` and the tolerance `tau = (burst - 1) * T`, so in any interval of length `L` at
//! most `r * L + burst` sends are admitted.
//!
//! Provider feedback moves the effective rate ([`on_throttled`], [`on_success`]: AIMD, and a
//! `Retry-After` pauses the whole bucket); a 429 for a send that was spending the bucket's
//! burst shrinks the burst instead (the provider's own burst is smaller than ours, its rate
//! may not be); an operator's change of rate or burst goes through [`reconfigured`]. Lanes share the bucket with reserves: while both new and recovery work
//! (retries, redrives) are waiting, each class keeps its reserved share of the rate; while only
//! one is waiting it gets the whole rate.
//!
//! All arithmetic is exact: instants are whole nanoseconds, the emission interval is the exact
//! ceiling of `1e9 / r` nanoseconds (so no slot is ever early), and the instants that go back
//! into the row are rounded *up* to the microsecond, because that is what a PostgreSQL
//! `timestamptz` keeps: a state read back from the database never admits earlier than the one
//! written.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::lane::Lane;

const NANOS_PER_SECOND: i128 = 1_000_000_000;
/// PostgreSQL `timestamptz` resolution.
const STORED_RESOLUTION_NS: i128 = 1_000;
/// Beyond the whole calendar chrono can represent (about 524,000 years), so any instant pushed
/// by it saturates; small enough that `interval * u32::MAX` cannot overflow an `i128`.
const MAX_INTERVAL_NS: i128 = 1 << 74;

const DECREASE_FACTOR: f64 = 0.75;
/// The first 429 a bucket ever meets halves its rate: no ceiling is known yet, and the
/// configured rate may be far above the provider's (as TCP leaves slow start at half the window).
const FIRST_DECREASE_FACTOR: f64 = 0.5;
const FLOOR_FRACTION: f64 = 0.02;
const FLOOR_MIN: f64 = 0.1;
const INCREASE_FRACTION: f64 = 0.025;
const INCREASE_MIN: f64 = 0.5;
/// Near the ceiling found by the last 429 the rate probes in small steps.
const PROBE_FRACTION: f64 = 0.005;
const PROBE_MIN: f64 = 0.1;
/// Below this share of that ceiling, and above `PROBE_ABOVE` of it, the rate climbs quickly.
const PROBE_BELOW: f64 = 0.9;
const PROBE_ABOVE: f64 = 1.05;
/// AIMD moves the rate at most once per this much time, whatever the number of replicas
/// reporting: a burst of 429s from one overload halves the rate once, not once per send.
const FEEDBACK_SPACING: TimeDelta = TimeDelta::seconds(1);
/// A 429 met while spending the burst shrinks it to this share (at least 1): the provider took
/// fewer back to back than we sent.
const BURST_DECREASE_FACTOR: f64 = 0.75;
/// A 429 moves the bucket (pause, slower rate) only when another came within this long before
/// it: one alone is about its own request.
const CONFIRM_WINDOW: Duration = Duration::from_secs(1);
/// ...or within this many intervals at the admitting rate, when that is longer.
const CONFIRM_INTERVALS: i128 = 3;

/// Why a [`BucketConfig`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidBucket {
    #[error("rate per second must be a finite number >= 0")]
    Rate,
    /// A positive rate with a burst of 0 would never admit anything; use rate 0 to close.
    #[error("burst must be at least 1 unless the rate is 0")]
    ZeroBurst,
    #[error("the reserve for new work must be in [0, 1)")]
    ReserveNew,
    #[error("the reserve for recovery work must be in [0, 1)")]
    ReserveRecovery,
    /// Both classes could not keep their reserve at the same time.
    #[error("the reserves for new and recovery work must add up to less than 1")]
    ReservesTooLarge,
}

/// What an operator sets for a bucket: its rate, burst and the lanes' reserves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketConfig {
    rate_per_second: f64,
    burst: u32,
    reserve_new: f64,
    reserve_recovery: f64,
}

impl BucketConfig {
    /// `rate_per_second` >= 0 (0 = closed: nothing is admitted); `burst` >= 1 unless the rate is
    /// 0 (how many may go back to back: a token bucket of capacity `burst`); `reserve_new` and
    /// `reserve_recovery` in `[0, 1)`, their sum < 1.
    pub fn new(
        rate_per_second: f64,
        burst: u32,
        reserve_new: f64,
        reserve_recovery: f64,
    ) -> Result<Self, InvalidBucket> {
        if !rate_per_second.is_finite() || rate_per_second < 0.0 {
            return Err(InvalidBucket::Rate);
        }
        if burst == 0 && rate_per_second > 0.0 {
            return Err(InvalidBucket::ZeroBurst);
        }
        if !(0.0..1.0).contains(&reserve_new) {
            return Err(InvalidBucket::ReserveNew);
        }
        if !(0.0..1.0).contains(&reserve_recovery) {
            return Err(InvalidBucket::ReserveRecovery);
        }
        if reserve_new + reserve_recovery >= 1.0 {
            return Err(InvalidBucket::ReservesTooLarge);
        }
        Ok(Self {
            rate_per_second,
            burst,
            reserve_new,
            reserve_recovery,
        })
    }

    pub fn rate_per_second(&self) -> f64 {
        self.rate_per_second
    }

    pub fn burst(&self) -> u32 {
        self.burst
    }

    pub fn reserve_new(&self) -> f64 {
        self.reserve_new
    }

    pub fn reserve_recovery(&self) -> f64 {
        self.reserve_recovery
    }

    /// The lowest effective rate 429 feedback may bring the bucket to:
    /// `max(rate * 0.02, 0.1)`, but never above the configured rate (0 when closed).
    pub fn floor_rate(&self) -> f64 {
        (self.rate_per_second * FLOOR_FRACTION)
            .max(FLOOR_MIN)
            .min(self.rate_per_second)
    }

    fn increase_step(&self) -> f64 {
        (self.rate_per_second * INCREASE_FRACTION).max(INCREASE_MIN)
    }
}

/// The shared state of one bucket: a database row, read under a lock and written back.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketState {
    /// What 429 feedback currently admits; never above the configured rate.
    pub effective_rate: f64,
    /// Set by a valid `Retry-After`: nothing is sent before it.
    pub paused_until: Option<DateTime<Utc>>,
    /// GCRA theoretical arrival time over all lanes.
    pub tat: Option<DateTime<Utc>>,
    /// GCRA theoretical arrival time of the new lane's sub-limit.
    pub tat_new: Option<DateTime<Utc>>,
    /// GCRA theoretical arrival time of the recovery (retry + redrive) lanes' sub-limit.
    pub tat_recovery: Option<DateTime<Utc>>,
    /// Last time the new lane asked.
    pub new_demand_at: Option<DateTime<Utc>>,
    /// Last time a recovery lane asked.
    pub recovery_demand_at: Option<DateTime<Utc>>,
    /// The rate at which the provider last answered 429: the ceiling found by probing. The
    /// rate climbs quickly to 90% of it, then probes slowly up to 5% above it.
    pub throttled_rate: Option<f64>,
    pub last_decrease_at: Option<DateTime<Utc>>,
    pub last_increase_at: Option<DateTime<Utc>>,
    /// The burst the provider was found to take back to back, when smaller than the
    /// configured one: admission uses it instead, until an operator reconfigures the bucket.
    pub burst_limit: Option<u32>,
    /// When the bucket last admitted a send with its whole burst available (it had been idle
    /// for at least `burst` intervals): the sends reserved within `burst` intervals after it
    /// are the ones spending the burst.
    pub burst_from: Option<DateTime<Utc>>,
    /// When a 429 last shrank the burst: a 429 for a send reserved before it says nothing new.
    pub burst_cut_at: Option<DateTime<Utc>>,
    /// When the provider last answered 429. One 429 alone is an answer about one request (a
    /// send that met the provider's bucket a moment early); a second within the confirmation
    /// window says the account is over its limit, and only then is the bucket paused or slowed.
    pub last_throttled_at: Option<DateTime<Utc>>,
    /// Until when the last 429's `Retry-After` asked to wait: a 429 before then confirms it
    /// however far apart the two came (a quiet account sends seconds apart), and the pause a
    /// confirmed 429 sets lasts at least until then.
    pub throttled_until: Option<DateTime<Utc>>,
}

impl BucketState {
    /// A bucket that has admitted nothing yet, running at its configured rate.
    pub fn fresh(config: &BucketConfig) -> Self {
        Self {
            effective_rate: config.rate_per_second,
            paused_until: None,
            tat: None,
            tat_new: None,
            tat_recovery: None,
            new_demand_at: None,
            recovery_demand_at: None,
            last_decrease_at: None,
            last_increase_at: None,
            throttled_rate: None,
            burst_limit: None,
            burst_from: None,
            burst_cut_at: None,
            last_throttled_at: None,
            throttled_until: None,
        }
    }
}

/// The bucket's answer to one request for a send slot.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Send at `send_at` (`now <= send_at <= now + max_wait`): the slot is reserved (the state
    /// was updated, so it must be written back).
    Admitted { send_at: DateTime<Utc> },
    /// No slot within `max_wait`: nothing reserved; try again at `until`, the bucket's next
    /// opening for this lane.
    Deferred {
        until: DateTime<Utc>,
        reason: DeferReason,
    },
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeferReason {
    /// The rate is 0: an operator stopped this bucket.
    Closed,
    /// The provider asked us to wait (`Retry-After`) past the admission wait.
    Paused,
    /// The next slot for this lane is further away than the admission wait.
    Throttled,
    /// The tenant's cap on its share of the bucket (`nudgectl tenant set --max-share`) has no
    /// slot within the admission wait, though the bucket may.
    Capped,
    /// Not a slot at all: the delivery fell due inside its subscriber's quiet hours and waits
    /// for their end (`crate::quiet`). Admission never answers it.
    QuietHours,
}

impl DeferReason {
    /// A stable lowercase name, for metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DeferReason::Closed => "closed",
            DeferReason::Paused => "paused",
            DeferReason::Throttled => "throttled",
            DeferReason::Capped => "capped",
            DeferReason::QuietHours => "quiet_hours",
        }
    }
}

/// How [`admit`] treats waiting; the same for every bucket of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionSettings {
    /// The longest a worker may hold a slot ahead of time (and sleep to it).
    pub max_wait: Duration,
    /// When the bucket is closed (rate 0), how long until asking again.
    pub closed_recheck: Duration,
    /// A lane that asked within this long is waiting, so the other class must leave it its
    /// reserve.
    pub demand_window: Duration,
    /// The longest one provider answer may pause the whole bucket, whatever its `Retry-After`
    /// says (the delivery that got the answer follows its own retry ceiling).
    pub max_pause: Duration,
    /// How close to its lease's end (counting the request's own timeout) or its expiry a
    /// send may still start: the time left to record its outcome while the lease is held.
    pub send_margin: Duration,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            max_wait: Duration::from_millis(500),
            closed_recheck: Duration::from_secs(10),
            demand_window: Duration::from_secs(1),
            max_pause: Duration::from_secs(60),
            send_margin: Duration::from_secs(1),
        }
    }
}

/// Why a [`MaxShare`] was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a tenant's maximum share of an account is a number above 0 and at most 1")]
pub struct InvalidShare;

/// The most a tenant may take of any provider account's rate it sends through, as a share in
/// `(0, 1)`. A share of 1 is no cap, and is represented by no `MaxShare` at all.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct MaxShare(f64);

impl MaxShare {
    /// `Ok(None)` for 1 (no cap); an error outside `(0, 1]` or for a non-number.
    pub fn new(share: f64) -> Result<Option<Self>, InvalidShare> {
        if !share.is_finite() || share <= 0.0 || share > 1.0 {
            return Err(InvalidShare);
        }
        Ok((share < 1.0).then_some(Self(share)))
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// The tenant's share of a bucket's burst: at least 1, rounded up (a cap never makes a
    /// request impossible).
    pub fn burst(self, burst: u32) -> u32 {
        // At most `burst`, which fits.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let share = (f64::from(burst) * self.0).ceil() as u32;
        share.clamp(1, burst.max(1))
    }
}

/// A tenant's cap on one bucket (`nudgectl tenant set TENANT --max-share S`): the tenant's own
/// limiter at `S` times the bucket's admitting rate, with that share of the burst (at least 1),
/// whose state (`tat`) is kept per tenant and bucket. It bounds the tenant even when it is
/// alone on the account.
///
/// A request the cap holds back is deferred to the tenant's next slot rather than reserved
/// ahead: a reservation later than the bucket's own next slot would move the bucket's TAT past
/// the slots between, lost to every other tenant. The k-th request held back in one round of
/// admission (`deferred` counts them) comes back k of the tenant's intervals later, so a batch
/// of a capped tenant's work returns at its pace, not all at once.
#[derive(Debug)]
pub struct TenantCap<'a> {
    pub share: MaxShare,
    /// The tenant's GCRA theoretical arrival time on this bucket.
    pub tat: &'a mut Option<DateTime<Utc>>,
    /// How many of the tenant's requests this round has held back so far.
    pub deferred: &'a mut u32,
}

/// Asks the bucket for a send slot for `lane` at `now`; see [`admit_capped`].
pub fn admit(
    config: &BucketConfig,
    state: &mut BucketState,
    lane: Lane,
    now: DateTime<Utc>,
    settings: &AdmissionSettings,
) -> Admission {
    admit_capped(config, state, lane, now, settings, None)
}

/// Asks the bucket for a send slot for `lane` at `now`, for a tenant with or without a cap.
///
/// The slot is the latest of: `now`, the pause, the global limiter's next slot, while the
/// other class of work has asked within `demand_window` this class's sub-limiter's next slot
/// (at the rate minus the other class's reserve), and with a cap the tenant's limiter's next
/// slot. Within `max_wait` the slot is reserved (in every limiter that bounded it); otherwise
/// nothing is, and the answer says when it opens. Either way the lane's demand time is
/// recorded, so the state must be written back in both cases.
pub fn admit_capped(
    config: &BucketConfig,
    state: &mut BucketState,
    lane: Lane,
    now: DateTime<Utc>,
    settings: &AdmissionSettings,
    cap: Option<TenantCap<'_>>,
) -> Admission {
    let now_ns = to_ns(now);
    let is_new = match lane {
        Lane::New => true,
        Lane::Retry | Lane::Redrive => false,
    };
    let (own_demand, other_demand, other_reserve) = if is_new {
        (
            &mut state.new_demand_at,
            state.recovery_demand_at,
            config.reserve_recovery,
        )
    } else {
        (
            &mut state.recovery_demand_at,
            state.new_demand_at,
            config.reserve_new,
        )
    };
    // A time in the future (a replica whose clock runs ahead) counts as recent.
    let contended =
        other_demand.is_some_and(|at| now_ns - to_ns(at) <= duration_ns(settings.demand_window));
    // Monotone, so a replica with a slow clock cannot shorten another's demand window.
    *own_demand = Some(own_demand.map_or(now, |at| at.max(now)));

    let rate = admitting_rate(config, state);
    if rate <= 0.0 {
        return Admission::Deferred {
            until: from_ns(now_ns + duration_ns(settings.closed_recheck)),
            reason: DeferReason::Closed,
        };
    }

    let burst = admitting_burst(config, state);
    let global = Gcra::new(rate, burst);
    let global_tat = state.tat.map(to_ns);
    let pause = state.paused_until.map(to_ns);
    let mut slot = global.earliest(global_tat, now_ns);
    if let Some(pause) = pause {
        slot = slot.max(pause);
    }
    let sub = contended.then(|| {
        let tat = if is_new {
            state.tat_new
        } else {
            state.tat_recovery
        };
        (
            Gcra::new(rate * (1.0 - other_reserve), burst),
            tat.map(to_ns),
        )
    });
    if let Some((limiter, tat)) = sub {
        slot = slot.max(limiter.earliest(tat, now_ns));
    }
    let mut capped = cap.map(|cap| {
        let share = cap.share.get();
        let limiter = Gcra::new(rate * share, cap.share.burst(burst));
        // A reservation is at most the wait ahead, so a TAT further than the wait plus the
        // tenant's burst of intervals was paced at a slower rate (before the bucket's rate
        // rose): it holds the tenant back no further than that, as `reconfigured` clamps the
        // bucket's own.
        let horizon =
            now_ns + duration_ns(settings.max_wait) + limiter.tolerance + limiter.interval;
        let tat = cap.tat.map(to_ns).map(|t| t.min(horizon));
        (limiter, tat, cap.tat, cap.deferred)
    });
    if let Some((limiter, tat, _, deferred)) = &mut capped {
        let own = limiter.earliest(*tat, now_ns);
        if own > slot {
            let until = own + i128::from(**deferred) * limiter.interval;
            **deferred = deferred.saturating_add(1);
            return Admission::Deferred {
                until: from_ns(until),
                reason: DeferReason::Capped,
            };
        }
    }

    if slot > now_ns + duration_ns(settings.max_wait) {
        let reason = if pause == Some(slot) {
            DeferReason::Paused
        } else {
            DeferReason::Throttled
        };
        return Admission::Deferred {
            until: from_ns(slot),
            reason,
        };
    }

    if global_tat.is_none_or(|tat| tat <= slot) {
        // The whole burst was there: this send starts spending it. Rounded down, as the
        // admission time the send carries back with a 429 is the database's microseconds.
        state.burst_from = Some(from_ns(
            now_ns.div_euclid(STORED_RESOLUTION_NS) * STORED_RESOLUTION_NS,
        ));
    }
    state.tat = Some(stored(global.after(global_tat, slot)));
    if let Some((limiter, tat)) = sub {
        let next = Some(stored(limiter.after(tat, slot)));
        if is_new {
            state.tat_new = next;
        } else {
            state.tat_recovery = next;
        }
    }
    if let Some((limiter, tat, stored_tat, _)) = capped {
        *stored_tat = Some(stored(limiter.after(tat, slot)));
    }
    Admission::Admitted {
        send_at: from_ns(slot),
    }
}

/// A 429. One alone is read as an answer about one request: a send that met the provider's
/// bucket a moment early (the network's jitter at a bucket set at the provider's own limit).
/// Its delivery waits for its own retry; the bucket keeps its rate and does not pause (a 429
/// while the bucket spends its burst still shrinks the burst, see [`on_throttled_after`]). A
/// second 429 within the confirmation window (one second, or three intervals at the admitting
/// rate when that is longer), or before the first one's `Retry-After` has passed, says the
/// account is over its limit; its pause lasts until the later of the two `Retry-After`s: the effective rate drops (the
/// first time a bucket is ever throttled to half, later to three quarters), at most once per
/// second, floored at [`BucketConfig::floor_rate`], and the rate it dropped from is kept as the
/// ceiling found. With a valid `Retry-After` (`retry_at` is `Some`) such a 429 also pauses the
/// whole bucket until then (a later existing pause is kept). Without the decrease on a
/// `Retry-After`, a bucket configured above the provider's real limit would pause, resume at
/// the same rate and be throttled again, forever. Returns true when the state changed. See
/// [`on_throttled_after`].
pub fn on_throttled(
    config: &BucketConfig,
    state: &mut BucketState,
    retry_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> bool {
    on_throttled_after(config, state, retry_at, None, now)
}

/// A throttled send's times, as the worker that sent it knows them: when its slot was reserved
/// and the slot it went out in (the reservation's instant for a slot that had come already).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottledSend {
    pub reserved_at: DateTime<Utc>,
    pub slot_at: DateTime<Utc>,
}

/// [`on_throttled`] for a send whose times are known. A 429 for a slot reserved before the
/// last decrease was paced at the old rate and says nothing new about the new one: it may
/// pause the bucket, but it does not lower the rate again (one decrease per round of
/// reservations, as TCP makes one per window), so a burst of late 429s does not drive the rate
/// far below the provider's limit. The same holds for a send that went out on the burst's
/// credit before the last shrink of the burst: it was part of the burst that shrink answered,
/// and does not lower the rate however late it is recorded.
///
/// A 429 for a send that spent the burst (reserved no earlier than an admission that found the
/// whole burst available, its slot within `burst` intervals of it) is read first as "burst too
/// large": the provider took fewer back to back than we sent, at a rate it may well sustain.
/// The burst shrinks to three quarters (at least 1; once per round: not for a send reserved
/// before the last shrink) and the rate is left alone; the stored TATs keep their credit
/// counted in requests, so the shrink costs no slot. Only a 429 outside a burst, or with the
/// burst already down to 1, lowers the rate. The send's slot decides, not when its answer is
/// recorded: a loaded worker recording a burst's 429 late does not make it the rate's.
pub fn on_throttled_after(
    config: &BucketConfig,
    state: &mut BucketState,
    retry_at: Option<DateTime<Utc>>,
    send: Option<ThrottledSend>,
    now: DateTime<Utc>,
) -> bool {
    let before = state.clone();
    // What an earlier 429 asked for and has not passed yet.
    let asked_before = state.throttled_until.filter(|until| *until > now);
    // A closed bucket sends nothing more: a late answer's pause is kept, as the provider asked.
    let confirmed = config.rate_per_second <= 0.0
        || asked_before.is_some()
        || throttled_recently(config, state, now);
    if config.rate_per_second > 0.0 {
        state.last_throttled_at = Some(state.last_throttled_at.map_or(now, |at| at.max(now)));
    }
    let asked = retry_at.into_iter().chain(asked_before).max();
    state.throttled_until = if confirmed { None } else { asked };
    if confirmed && let Some(retry_at) = asked {
        let until = from_ns(round_up_to_stored(to_ns(retry_at)));
        if until > now && state.paused_until.is_none_or(|p| p < until) {
            state.paused_until = Some(until);
        }
    }
    let reserved_at = send.map(|s| s.reserved_at);
    if spending_burst(config, state, send, now) {
        let stale = matches!((reserved_at, state.burst_cut_at), (Some(r), Some(c)) if r <= c);
        if !stale {
            let old = admitting_burst(config, state);
            // Truncated: 2 goes to 1, so the shrink always makes progress.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let new = ((f64::from(old) * BURST_DECREASE_FACTOR) as u32).clamp(1, old);
            state.burst_limit = Some(new);
            state.burst_cut_at = Some(now);
            reburst(config, state, old, new);
        }
        return *state != before;
    }
    if !confirmed {
        return *state != before;
    }
    // A send reserved before the last decrease was paced at the old rate. One that went out on
    // the burst's credit (its slot at its reservation) before the last shrink of the burst
    // was part of the burst that shrink answered: its 429 can be recorded after a later
    // admission began a new burst, when it no longer reads as the old one's. A send paced at
    // the rate before the shrink still speaks for the rate.
    let stale = matches!((reserved_at, state.last_decrease_at), (Some(r), Some(d)) if r <= d)
        || matches!((send, state.burst_cut_at),
                    (Some(t), Some(c)) if t.reserved_at <= c && t.slot_at <= t.reserved_at);
    if config.rate_per_second > 0.0 && !stale && !within_spacing(state.last_decrease_at, now) {
        let old_rate = admitting_rate(config, state);
        let factor = if state.throttled_rate.is_none() {
            FIRST_DECREASE_FACTOR
        } else {
            DECREASE_FACTOR
        };
        state.throttled_rate = Some(current_rate(config, state));
        state.effective_rate = (current_rate(config, state) * factor)
            .max(config.floor_rate())
            .min(config.rate_per_second);
        state.last_decrease_at = Some(now);
        rescale(config, state, old_rate, admitting_rate(config, state), now);
    }
    *state != before
}

/// The account cannot send at all (the provider refused its credentials): the whole bucket
/// pauses until `until` (a later existing pause is kept) and its rate is left alone, because a
/// refusal of credentials says nothing about how fast the provider takes messages. After the
/// pause one send probes; if the credentials are still refused it suspends again. Every
/// delivery waiting meanwhile is given back unsent, so none burns an attempt on a known
/// refusal. Returns true when the state changed.
pub fn on_suspended(state: &mut BucketState, until: DateTime<Utc>, now: DateTime<Utc>) -> bool {
    let until = from_ns(round_up_to_stored(to_ns(until)));
    if until > now && state.paused_until.is_none_or(|p| p < until) {
        state.paused_until = Some(until);
        true
    } else {
        false
    }
}

/// A successful send. The effective rate rises by `max(rate * 0.025, 0.5)`, at most once per
/// second and only a second after the last decrease (the success must be sustained, not the
/// tail of sends admitted before the 429), never above the configured rate. Returns true when
/// the state changed; at the configured rate it does not, so the row need not be written.
pub fn on_success(config: &BucketConfig, state: &mut BucketState, now: DateTime<Utc>) -> bool {
    if config.rate_per_second <= 0.0
        || within_spacing(state.last_increase_at, now)
        || within_spacing(state.last_decrease_at, now)
    {
        return false;
    }
    let rate = current_rate(config, state);
    let probing = state
        .throttled_rate
        .is_some_and(|ceiling| rate >= ceiling * PROBE_BELOW && rate < ceiling * PROBE_ABOVE);
    let step = if probing {
        (config.rate_per_second * PROBE_FRACTION).max(PROBE_MIN)
    } else {
        config.increase_step()
    };
    let next = (rate + step)
        .min(config.rate_per_second)
        .max(config.floor_rate());
    if next == state.effective_rate {
        return false;
    }
    let old_rate = admitting_rate(config, state);
    state.effective_rate = next;
    state.last_increase_at = Some(now);
    rescale(config, state, old_rate, admitting_rate(config, state), now);
    true
}

/// After an operator changed the rate or burst: the effective rate becomes the configured one,
/// the AIMD history is cleared, and each TAT is clamped to `now + burst * T` at its limiter's
/// new interval, so reservations made at an older, slower rate do not hold the new rate back.
/// A provider's pause is kept: the provider asked for it, not the operator.
pub fn reconfigured(config: &BucketConfig, state: &mut BucketState, now: DateTime<Utc>) {
    state.effective_rate = config.rate_per_second;
    state.throttled_rate = None;
    state.burst_limit = None;
    state.burst_from = None;
    state.burst_cut_at = None;
    state.last_decrease_at = None;
    state.last_increase_at = None;
    let rate = config.rate_per_second;
    if rate <= 0.0 {
        return;
    }
    let now_ns = to_ns(now);
    for (tat, limiter_rate) in [
        (&mut state.tat, rate),
        (&mut state.tat_new, rate * (1.0 - config.reserve_recovery)),
        (&mut state.tat_recovery, rate * (1.0 - config.reserve_new)),
    ] {
        let limit = now_ns + i128::from(config.burst) * interval_ns(limiter_rate);
        if let Some(t) = *tat
            && to_ns(t) > limit
        {
            *tat = Some(stored(limit));
        }
    }
}

/// The rate the bucket admits at now: the effective rate, bounded by the configured one. A
/// corrupt (NaN) effective rate is read as the floor: slow, but never stuck and never fast.
fn admitting_rate(config: &BucketConfig, state: &BucketState) -> f64 {
    if config.rate_per_second <= 0.0 {
        return 0.0;
    }
    if state.effective_rate.is_nan() {
        return config.floor_rate();
    }
    state.effective_rate.min(config.rate_per_second)
}

/// The burst the bucket admits with: the configured one, or the smaller one the provider was
/// found to take back to back.
fn admitting_burst(config: &BucketConfig, state: &BucketState) -> u32 {
    state
        .burst_limit
        .map_or(config.burst, |b| b.clamp(1, config.burst.max(1)))
}

/// Whether a throttled send spent the burst: reserved no earlier than the last admission that
/// found the whole burst available (`from`), and either answered while the burst was being
/// spent (less than `burst` intervals after `from`) or sent on the burst's credit (its slot
/// came at its reservation, and within those intervals). A burst of 1 has nothing to shrink; a
/// 429 whose send is not known is read as the rate's.
///
/// The credit part is for a loaded worker: judged by the answer's arrival alone, a burst's 429
/// recorded after the burst's time was read as the rate's and halved it. A send paced at the
/// rate (its slot after its reservation) still counts only while the burst is spent, because a
/// lease batch reserves its slots at one instant, up to the admission wait ahead: judged by the
/// reservation, the 429s of sends paced at the rate were read as the burst's (3.2% 429s
/// instead of 0.8% in the drain benchmark's bucket at twice the provider's rate).
///
/// Known limits: a send past the credit, paced but with its slot still in the burst's window,
/// whose 429 is recorded after the window, is read as the rate's. An admission for a slot at a
/// pause's end starts the burst's window at its own instant, not at the slot, so a burst spent
/// when a pause ends is judged as paced: its 429s (a provider not yet refilled when its own
/// `Retry-After` ends) lower the rate (`bench/results/history.md`, 2026-12-03).
fn spending_burst(
    config: &BucketConfig,
    state: &BucketState,
    send: Option<ThrottledSend>,
    now: DateTime<Utc>,
) -> bool {
    let rate = admitting_rate(config, state);
    let burst = admitting_burst(config, state);
    if rate <= 0.0 || burst <= 1 {
        return false;
    }
    let (Some(send), Some(from)) = (send, state.burst_from) else {
        return false;
    };
    let (reserved, slot) = (to_ns(send.reserved_at), to_ns(send.slot_at));
    let spent_by = to_ns(from) + i128::from(burst) * interval_ns(rate);
    let on_credit = slot <= reserved && slot < spent_by;
    reserved >= to_ns(from) && (to_ns(now) < spent_by || on_credit)
}

/// Moves each stored TAT earlier by the tolerance the burst lost, so the credit (or debt)
/// counted in requests is kept: a send paced exactly at the rate stays where it was, and only
/// the credit above the new burst is gone. Every slot admitted afterwards also conformed to the
/// old burst, so the bound `rate * L + burst` (configured burst) holds across the change.
fn reburst(config: &BucketConfig, state: &mut BucketState, old_burst: u32, new_burst: u32) {
    let rate = admitting_rate(config, state);
    if rate <= 0.0 || new_burst >= old_burst {
        return;
    }
    for (tat, share) in [
        (&mut state.tat, 1.0),
        (&mut state.tat_new, 1.0 - config.reserve_recovery),
        (&mut state.tat_recovery, 1.0 - config.reserve_new),
    ] {
        let Some(t) = *tat else { continue };
        let shift = i128::from(old_burst - new_burst) * interval_ns(rate * share);
        *tat = Some(stored(to_ns(t) - shift));
    }
}

/// The rate AIMD starts from: the admitting rate, but never below the floor.
fn current_rate(config: &BucketConfig, state: &BucketState) -> f64 {
    admitting_rate(config, state).max(config.floor_rate())
}

/// Whether another 429 came within the confirmation window before `now`: one second, or
/// [`CONFIRM_INTERVALS`] intervals at the admitting rate when that is longer (a slow bucket
/// sends its next request only an interval later). One in the future (clock skew between
/// replicas) counts as recent.
fn throttled_recently(config: &BucketConfig, state: &BucketState, now: DateTime<Utc>) -> bool {
    let window = duration_ns(CONFIRM_WINDOW)
        .max(CONFIRM_INTERVALS * interval_ns(admitting_rate(config, state)));
    state
        .last_throttled_at
        .is_some_and(|at| to_ns(now) - to_ns(at) <= window)
}

/// Whether `last` was less than [`FEEDBACK_SPACING`] before `now`. A `last` after `now` (clock
/// skew between replicas) counts as within, so skew cannot double a step.
fn within_spacing(last: Option<DateTime<Utc>>, now: DateTime<Utc>) -> bool {
    last.is_some_and(|last| now.signed_duration_since(last) < FEEDBACK_SPACING)
}

/// Re-expresses the stored TATs after the effective rate moved from `old_rate` to `new_rate`,
/// keeping each limiter's credit (or debt) counted in requests, not in time. A TAT is a time,
/// and the tolerance `(burst - 1) * T` grows when the rate falls: left as it was, a lowered
/// rate would let more than `burst` requests through at once. Rounded towards later TATs.
fn rescale(
    config: &BucketConfig,
    state: &mut BucketState,
    old_rate: f64,
    new_rate: f64,
    now: DateTime<Utc>,
) {
    if old_rate <= 0.0 || new_rate <= 0.0 || old_rate == new_rate {
        return;
    }
    let now_ns = to_ns(now);
    let burst = admitting_burst(config, state);
    for (tat, share) in [
        (&mut state.tat, 1.0),
        (&mut state.tat_new, 1.0 - config.reserve_recovery),
        (&mut state.tat_recovery, 1.0 - config.reserve_new),
    ] {
        let Some(t) = *tat else { continue };
        let old = Gcra::new(old_rate * share, burst);
        let new = Gcra::new(new_rate * share, burst);
        // Credit in old-time units: how far the earliest slot is before now (negative: debt).
        let credit = now_ns + old.tolerance - to_ns(t);
        let Some(scaled) = credit.checked_mul(new.interval) else {
            continue;
        };
        let rescaled = now_ns + new.tolerance - scaled.div_euclid(old.interval);
        *tat = Some(stored(rescaled.max(to_ns(t).min(now_ns))));
    }
}

/// One GCRA limiter in nanoseconds.
#[derive(Debug, Clone, Copy)]
struct Gcra {
    interval: i128,
    tolerance: i128,
}

impl Gcra {
    fn new(rate: f64, burst: u32) -> Self {
        let interval = interval_ns(rate);
        Self {
            interval,
            tolerance: i128::from(burst.saturating_sub(1)) * interval,
        }
    }

    /// The earliest conforming slot at `now`.
    fn earliest(self, tat: Option<i128>, now: i128) -> i128 {
        tat.map_or(now, |tat| now.max(tat - self.tolerance))
    }

    /// The TAT after admitting at `slot` (no TAT yet means "now", and `slot >= now`).
    fn after(self, tat: Option<i128>, slot: i128) -> i128 {
        tat.map_or(slot, |tat| tat.max(slot)) + self.interval
    }
}

/// The exact ceiling of `1e9 / rate` nanoseconds, in `[1, MAX_INTERVAL_NS]`.
///
/// A finite positive `f64` is exactly `mantissa * 2^exponent`, so the division is done on
/// integers: a float division could round `k + epsilon` down to `k` and make every slot a
/// fraction of a nanosecond early, which breaks the bound on long runs.
fn interval_ns(rate: f64) -> i128 {
    if rate.is_nan() || rate <= 0.0 {
        return MAX_INTERVAL_NS;
    }
    if rate.is_infinite() {
        return 1;
    }
    let bits = rate.to_bits();
    let exponent_bits = i32::try_from((bits >> 52) & 0x7ff).unwrap_or(0);
    let fraction = bits & ((1 << 52) - 1);
    let (mantissa, exponent) = if exponent_bits == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1 << 52), exponent_bits - 1075)
    };
    let mantissa = u128::from(mantissa);
    const ONE_SECOND: u128 = 1_000_000_000;
    let ceiling = if exponent >= 0 {
        // rate >= 2^41 > 1e9 per second: less than one nanosecond apart.
        if exponent > 40 {
            1
        } else {
            ONE_SECOND.div_ceil(mantissa << exponent)
        }
    } else {
        let shift = exponent.unsigned_abs();
        // 1e9 < 2^30, so the numerator fits in a u128 up to a shift of 97; beyond it the
        // quotient is at least 1e9 * 2^45 ns, above the cap.
        if shift > 97 {
            return MAX_INTERVAL_NS;
        }
        (ONE_SECOND << shift).div_ceil(mantissa)
    };
    i128::try_from(ceiling)
        .unwrap_or(MAX_INTERVAL_NS)
        .clamp(1, MAX_INTERVAL_NS)
}

fn to_ns(t: DateTime<Utc>) -> i128 {
    i128::from(t.timestamp()) * NANOS_PER_SECOND + i128::from(t.timestamp_subsec_nanos())
}

/// Saturates at the ends of chrono's calendar.
fn from_ns(ns: i128) -> DateTime<Utc> {
    let seconds = ns.div_euclid(NANOS_PER_SECOND);
    let nanos = u32::try_from(ns.rem_euclid(NANOS_PER_SECOND)).unwrap_or(0);
    i64::try_from(seconds)
        .ok()
        .and_then(|s| DateTime::from_timestamp(s, nanos))
        .unwrap_or(if ns < 0 {
            DateTime::<Utc>::MIN_UTC
        } else {
            DateTime::<Utc>::MAX_UTC
        })
}

fn round_up_to_stored(ns: i128) -> i128 {
    ns.div_euclid(STORED_RESOLUTION_NS) * STORED_RESOLUTION_NS
        + if ns.rem_euclid(STORED_RESOLUTION_NS) == 0 {
            0
        } else {
            STORED_RESOLUTION_NS
        }
}

/// An instant that goes back into the row: rounded up to what the database keeps.
fn stored(ns: i128) -> DateTime<Utc> {
    from_ns(round_up_to_stored(ns))
}

fn duration_ns(d: Duration) -> i128 {
    // At most about 1.8e28: always fits.
    i128::try_from(d.as_nanos()).unwrap_or(i128::MAX / 4)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A failed unwrap is a failed test, with its location.
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap()
    }

    fn ms(n: i64) -> TimeDelta {
        TimeDelta::milliseconds(n)
    }

    fn config(rate: f64, burst: u32) -> BucketConfig {
        BucketConfig::new(rate, burst, 0.2, 0.1).unwrap()
    }

    fn waiting(max_wait_ms: u64) -> AdmissionSettings {
        AdmissionSettings {
            max_wait: Duration::from_millis(max_wait_ms),
            ..AdmissionSettings::default()
        }
    }

    fn send_at(a: Admission) -> DateTime<Utc> {
        match a {
            Admission::Admitted { send_at } => send_at,
            Admission::Deferred { .. } => panic!("expected a slot, got {a:?}"),
        }
    }

    #[test]
    fn a_suspended_bucket_defers_everything_until_then_and_keeps_its_rate() {
        let c = config(40.0, 5);
        let mut state = BucketState::fresh(&c);
        let until = t0() + TimeDelta::seconds(60);
        assert!(on_suspended(&mut state, until, t0()));
        assert_eq!(state.effective_rate, 40.0);
        for lane in [Lane::New, Lane::Retry, Lane::Redrive] {
            assert_eq!(
                admit(&c, &mut state, lane, t0() + ms(10), &waiting(500)),
                Admission::Deferred {
                    until,
                    reason: DeferReason::Paused
                }
            );
        }
        // An earlier suspension does not shorten it; one in the past does nothing.
        assert!(!on_suspended(
            &mut state,
            t0() + TimeDelta::seconds(30),
            t0()
        ));
        assert!(!on_suspended(
            &mut state,
            t0() - TimeDelta::seconds(1),
            t0()
        ));
        assert_eq!(state.paused_until, Some(until));
        assert!(matches!(
            admit(&c, &mut state, Lane::New, until, &waiting(500)),
            Admission::Admitted { .. }
        ));
    }

    /// The admitted counts of each lane's client, each asking every `period_ms` (in the order
    /// given at the same instant) for `seconds`, counting slots before the end.
    fn simulate(
        config: &BucketConfig,
        clients: &[(Lane, i64)],
        seconds: i64,
    ) -> (Vec<usize>, BucketState) {
        let mut state = BucketState::fresh(config);
        let settings = AdmissionSettings::default();
        let end = t0() + TimeDelta::seconds(seconds);
        let mut counts = vec![0; clients.len()];
        for tick in 0..seconds * 1_000 {
            for (i, &(lane, period_ms)) in clients.iter().enumerate() {
                if tick % period_ms == 0
                    && let Admission::Admitted { send_at } =
                        admit(config, &mut state, lane, t0() + ms(tick), &settings)
                    && send_at < end
                {
                    counts[i] += 1;
                }
            }
        }
        (counts, state)
    }

    #[test]
    fn a_config_that_could_never_admit_or_over_reserves_is_refused() {
        for rate in [-1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                BucketConfig::new(rate, 1, 0.0, 0.0),
                Err(InvalidBucket::Rate)
            );
        }
        assert_eq!(
            BucketConfig::new(1.0, 0, 0.0, 0.0),
            Err(InvalidBucket::ZeroBurst)
        );
        for reserve in [-0.1, 1.0, f64::NAN] {
            assert_eq!(
                BucketConfig::new(1.0, 1, reserve, 0.0),
                Err(InvalidBucket::ReserveNew)
            );
            assert_eq!(
                BucketConfig::new(1.0, 1, 0.0, reserve),
                Err(InvalidBucket::ReserveRecovery)
            );
        }
        assert_eq!(
            BucketConfig::new(1.0, 1, 0.5, 0.5),
            Err(InvalidBucket::ReservesTooLarge)
        );
    }

    #[test]
    fn a_closed_bucket_may_have_no_burst_and_a_valid_config_reads_back() {
        assert!(BucketConfig::new(0.0, 0, 0.0, 0.0).is_ok());
        let c = BucketConfig::new(40.0, 5, 0.2, 0.1).unwrap();
        assert_eq!(
            (
                c.rate_per_second(),
                c.burst(),
                c.reserve_new(),
                c.reserve_recovery()
            ),
            (40.0, 5, 0.2, 0.1)
        );
        assert_eq!(c.floor_rate(), 0.8);
        assert_eq!(config(1.0, 1).floor_rate(), 0.1);
        assert_eq!(config(0.05, 1).floor_rate(), 0.05);
        assert_eq!(config(0.0, 1).floor_rate(), 0.0);
    }

    #[test]
    fn a_fresh_state_runs_at_the_configured_rate_with_no_history() {
        let s = BucketState::fresh(&config(40.0, 5));
        assert_eq!(s.effective_rate, 40.0);
        assert_eq!(
            s,
            BucketState {
                effective_rate: 40.0,
                paused_until: None,
                tat: None,
                tat_new: None,
                tat_recovery: None,
                new_demand_at: None,
                recovery_demand_at: None,
                last_decrease_at: None,
                last_increase_at: None,
                throttled_rate: None,
                burst_limit: None,
                burst_from: None,
                burst_cut_at: None,
                last_throttled_at: None,
                throttled_until: None,
            }
        );
    }

    #[test]
    fn the_default_settings_are_half_a_second_ten_seconds_and_one_second() {
        let s = AdmissionSettings::default();
        assert_eq!(s.max_wait, Duration::from_millis(500));
        assert_eq!(s.closed_recheck, Duration::from_secs(10));
        assert_eq!(s.demand_window, Duration::from_secs(1));
        assert_eq!(DeferReason::Throttled.as_str(), "throttled");
    }

    #[test]
    fn a_burst_goes_back_to_back_then_slots_are_one_interval_apart() {
        let c = config(10.0, 3);
        let mut s = BucketState::fresh(&c);
        let settings = waiting(1_000);
        let slots: Vec<_> = (0..8)
            .map(|_| send_at(admit(&c, &mut s, Lane::New, t0(), &settings)) - t0())
            .collect();
        assert_eq!(
            slots,
            [0, 0, 0, 100, 200, 300, 400, 500].map(ms).to_vec(),
            "burst of 3, then one every 100 ms"
        );
    }

    #[test]
    fn after_the_burst_a_request_without_wait_is_deferred_to_the_next_slot_which_then_admits() {
        let c = config(10.0, 3);
        let mut s = BucketState::fresh(&c);
        let settings = waiting(0);
        for _ in 0..3 {
            assert_eq!(
                admit(&c, &mut s, Lane::Retry, t0(), &settings),
                Admission::Admitted { send_at: t0() }
            );
        }
        let before = s.clone();
        let deferred = admit(&c, &mut s, Lane::Retry, t0() + ms(30), &settings);
        assert_eq!(
            deferred,
            Admission::Deferred {
                until: t0() + ms(100),
                reason: DeferReason::Throttled
            }
        );
        assert_eq!(
            s,
            BucketState {
                recovery_demand_at: Some(t0() + ms(30)),
                ..before
            },
            "a deferral reserves nothing, it only records the demand"
        );
        assert_eq!(
            admit(&c, &mut s, Lane::Retry, t0() + ms(100), &settings),
            Admission::Admitted {
                send_at: t0() + ms(100)
            }
        );
    }

    #[test]
    fn an_interval_that_is_not_whole_nanoseconds_rounds_up_so_no_slot_is_early() {
        assert_eq!(interval_ns(3.0), 333_333_334);
        assert_eq!(interval_ns(0.5), 2 * NANOS_PER_SECOND);
        assert_eq!(interval_ns(0.1), 10 * NANOS_PER_SECOND);
        assert_eq!(interval_ns(1e9), 1);
        assert_eq!(interval_ns(1e300), 1);
        assert_eq!(interval_ns(f64::MIN_POSITIVE), MAX_INTERVAL_NS);
        assert_eq!(interval_ns(0.0), MAX_INTERVAL_NS);
        let c = config(3.0, 1);
        let mut s = BucketState::fresh(&c);
        let settings = waiting(1_000);
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &settings));
        let second = send_at(admit(&c, &mut s, Lane::New, t0(), &settings));
        // 333_333_334 ns, stored rounded up to the microsecond.
        assert_eq!(second - t0(), TimeDelta::nanoseconds(333_334_000));
    }

    #[test]
    fn a_tiny_or_huge_rate_neither_panics_nor_admits_early() {
        let tiny = config(1e-300, 1);
        let mut s = BucketState::fresh(&tiny);
        let settings = waiting(0);
        assert!(matches!(
            admit(&tiny, &mut s, Lane::New, t0(), &settings),
            Admission::Admitted { .. }
        ));
        assert_eq!(s.tat, Some(DateTime::<Utc>::MAX_UTC));
        assert!(matches!(
            admit(&tiny, &mut s, Lane::New, t0(), &settings),
            Admission::Deferred {
                reason: DeferReason::Throttled,
                ..
            }
        ));
        let huge = config(1e300, 1);
        let mut s = BucketState::fresh(&huge);
        assert_eq!(
            admit(&huge, &mut s, Lane::New, t0(), &settings),
            Admission::Admitted { send_at: t0() }
        );
    }

    #[test]
    fn a_retry_after_pause_is_honoured_to_the_nanosecond_then_the_burst_resumes() {
        let c = config(10.0, 2);
        let mut s = BucketState::fresh(&c);
        let until = t0() + ms(2_500);
        // A 429 just before: the next one confirms it.
        s.last_throttled_at = Some(t0());
        assert!(on_throttled(&c, &mut s, Some(until), t0()));
        assert_eq!(s.paused_until, Some(until));
        assert_eq!(
            s.effective_rate, 5.0,
            "a Retry-After pauses the bucket, and the (first) 429 also halves its rate"
        );
        assert_eq!(
            admit(&c, &mut s, Lane::New, t0() + ms(1), &waiting(500)),
            Admission::Deferred {
                until,
                reason: DeferReason::Paused
            }
        );
        assert_eq!(s.tat, None);
        let settings = waiting(3_000);
        let slots: Vec<_> = (0..3)
            .map(|_| send_at(admit(&c, &mut s, Lane::New, t0() + ms(1), &settings)))
            .collect();
        // Burst 2 at the pause's end (the second within a nanosecond-rounding of it), then
        // spaced at the slowed rate (5/s: 200 ms).
        assert_eq!(slots[0], until);
        assert!((slots[1] - until).num_microseconds().unwrap() < 1);
        let gap = (slots[2] - until).num_microseconds().unwrap();
        assert!((200_000..=200_001).contains(&gap), "{gap} µs");
    }

    #[test]
    fn a_shorter_or_past_retry_after_does_not_shorten_a_pause() {
        let c = config(10.0, 2);
        let mut s = BucketState::fresh(&c);
        // A 429 just before: the next one confirms it.
        s.last_throttled_at = Some(t0());
        assert!(on_throttled(&c, &mut s, Some(t0() + ms(5_000)), t0()));
        // Within the second after the decrease, neither a shorter nor a past Retry-After
        // changes anything.
        assert!(!on_throttled(&c, &mut s, Some(t0() + ms(1_000)), t0()));
        assert!(!on_throttled(&c, &mut s, Some(t0() - ms(1_000)), t0()));
        assert_eq!(s.paused_until, Some(t0() + ms(5_000)));
        assert!(on_throttled(&c, &mut s, Some(t0() + ms(6_000)), t0()));
        assert_eq!(s.paused_until, Some(t0() + ms(6_000)));
        // A Retry-After already in the past still reports the 429 (the rate steps down) but
        // sets no pause.
        let mut fresh = BucketState::fresh(&c);
        fresh.last_throttled_at = Some(t0());
        assert!(on_throttled(&c, &mut fresh, Some(t0()), t0()));
        assert_eq!(fresh.paused_until, None);
        assert_eq!(fresh.effective_rate, 5.0);
    }

    #[test]
    fn a_pause_that_ends_within_the_wait_is_throttled_when_the_limiter_is_later() {
        let c = config(1.0, 1);
        let mut s = BucketState::fresh(&c);
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        // A 429 just before: the next one confirms it.
        s.last_throttled_at = Some(t0());
        assert!(on_throttled(&c, &mut s, Some(t0() + ms(200)), t0()));
        // The 429 also halved the bucket's rate: the one outstanding reservation now spaces
        // the next slot 1/0.5 s after it.
        assert_eq!(
            admit(&c, &mut s, Lane::New, t0(), &waiting(100)),
            Admission::Deferred {
                until: t0() + ms(2_000),
                reason: DeferReason::Throttled
            }
        );
    }

    #[test]
    fn a_rate_of_zero_closes_the_bucket_until_the_recheck() {
        let closed = BucketConfig::new(0.0, 0, 0.2, 0.1).unwrap();
        let mut s = BucketState::fresh(&closed);
        let settings = AdmissionSettings::default();
        assert_eq!(
            admit(&closed, &mut s, Lane::New, t0(), &settings),
            Admission::Deferred {
                until: t0() + TimeDelta::seconds(10),
                reason: DeferReason::Closed
            }
        );
        assert_eq!(s.tat, None);
        assert_eq!(s.new_demand_at, Some(t0()));

        let open = config(10.0, 5);
        let mut s = BucketState::fresh(&open);
        s.effective_rate = 0.0;
        assert_eq!(
            admit(&open, &mut s, Lane::Redrive, t0(), &settings),
            Admission::Deferred {
                until: t0() + TimeDelta::seconds(10),
                reason: DeferReason::Closed
            }
        );
        assert_eq!(s.recovery_demand_at, Some(t0()));
    }

    #[test]
    fn an_effective_rate_above_the_configured_one_admits_only_at_the_configured_rate() {
        let c = config(10.0, 1);
        let mut s = BucketState::fresh(&c);
        s.effective_rate = 1_000.0;
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(1_000)));
        assert_eq!(
            send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(1_000))),
            t0() + ms(100)
        );
    }

    #[test]
    fn reconfiguring_to_a_faster_rate_drops_the_slow_backlog_and_keeps_the_pause() {
        let slow = config(1.0, 2);
        let mut s = BucketState::fresh(&slow);
        let settings = waiting(10_000);
        for _ in 0..10 {
            let _ = send_at(admit(&slow, &mut s, Lane::New, t0(), &settings));
        }
        s.tat_new = Some(t0() + TimeDelta::seconds(60));
        s.tat_recovery = Some(t0() + ms(10));
        s.paused_until = Some(t0() + ms(50));
        s.effective_rate = 0.5;
        s.last_decrease_at = Some(t0());
        s.last_increase_at = Some(t0());
        assert_eq!(s.tat, Some(t0() + TimeDelta::seconds(10)));

        let fast = config(100.0, 2);
        reconfigured(&fast, &mut s, t0());
        assert_eq!(s.effective_rate, 100.0);
        assert_eq!((s.last_decrease_at, s.last_increase_at), (None, None));
        assert_eq!(s.paused_until, Some(t0() + ms(50)));
        assert_eq!(s.tat, Some(t0() + ms(20)), "now + burst / rate");
        // The new lane's sub-limit runs at 100 * (1 - 0.1) = 90/s: 2 * 11_111_112 ns.
        assert_eq!(s.tat_new, Some(t0() + TimeDelta::nanoseconds(22_223_000)));
        assert_eq!(
            s.tat_recovery,
            Some(t0() + ms(10)),
            "a TAT within the bound is kept"
        );
        assert_eq!(
            send_at(admit(&fast, &mut s, Lane::New, t0(), &settings)),
            t0() + ms(50),
            "only the pause holds it back"
        );
    }

    #[test]
    fn reconfiguring_to_zero_closes_and_back_reopens_at_the_new_rate() {
        let c = config(10.0, 1);
        let mut s = BucketState::fresh(&c);
        let closed = BucketConfig::new(0.0, 1, 0.2, 0.1).unwrap();
        reconfigured(&closed, &mut s, t0());
        assert_eq!(s.effective_rate, 0.0);
        assert!(matches!(
            admit(&closed, &mut s, Lane::New, t0(), &waiting(0)),
            Admission::Deferred {
                reason: DeferReason::Closed,
                ..
            }
        ));
        reconfigured(&c, &mut s, t0());
        assert_eq!(
            admit(&c, &mut s, Lane::New, t0(), &waiting(0)),
            Admission::Admitted { send_at: t0() }
        );
    }

    #[test]
    fn a_lone_429_moves_nothing_the_first_confirmed_halves_the_rate_and_later_ones_lower_it_to_three_quarters_once_per_second()
     {
        let c = config(100.0, 10);
        let mut s = BucketState::fresh(&c);
        let pause = t0() + ms(5_000);
        assert!(on_throttled(&c, &mut s, Some(pause), t0() - ms(400)));
        assert_eq!(
            (s.effective_rate, s.paused_until, s.last_decrease_at),
            (100.0, None, None),
            "one 429 alone is about its own request: no pause, no decrease"
        );
        assert_eq!(s.last_throttled_at, Some(t0() - ms(400)));
        assert!(on_throttled(&c, &mut s, None, t0()));
        assert_eq!(
            s.effective_rate, 50.0,
            "confirmed, no ceiling known yet: halve"
        );
        assert_eq!(s.last_decrease_at, Some(t0()));
        assert!(on_throttled(&c, &mut s, None, t0() + ms(999)));
        assert_eq!(s.effective_rate, 50.0, "once per second");
        assert!(on_throttled(&c, &mut s, None, t0() + ms(1_000)));
        assert_eq!(s.effective_rate, 37.5);
        // Alone again: more than the window after the last one.
        assert!(on_throttled(&c, &mut s, None, t0() + ms(2_001)));
        assert_eq!(s.effective_rate, 37.5);
    }

    #[test]
    fn a_429_before_the_last_ones_retry_after_has_passed_confirms_it_and_pauses_until_then() {
        // A quiet account: sends seconds apart, far beyond the window.
        let c = config(40.0, 5);
        let mut s = BucketState::fresh(&c);
        let asked = t0() + TimeDelta::seconds(600);
        assert!(on_throttled(&c, &mut s, Some(asked), t0()));
        assert_eq!((s.paused_until, s.effective_rate), (None, 40.0), "alone");
        assert_eq!(s.throttled_until, Some(asked), "what it asked for is kept");
        // Five seconds later another 429, without a Retry-After of its own.
        assert!(on_throttled(&c, &mut s, None, t0() + TimeDelta::seconds(5)));
        assert_eq!(
            (s.paused_until, s.effective_rate, s.throttled_until),
            (Some(asked), 20.0, None),
            "confirmed: paused as the first asked, and slowed"
        );
        // Once that time has passed, a 429 is alone again.
        let mut s = BucketState::fresh(&c);
        let _ = on_throttled(&c, &mut s, Some(t0() + TimeDelta::seconds(2)), t0());
        let _ = on_throttled(&c, &mut s, None, t0() + TimeDelta::seconds(3));
        assert_eq!((s.paused_until, s.effective_rate), (None, 40.0));
    }

    #[test]
    fn a_slow_bucket_confirms_a_429_over_three_of_its_intervals() {
        let c = config(0.5, 1);
        let mut s = BucketState::fresh(&c);
        let _ = on_throttled(&c, &mut s, None, t0());
        let _ = on_throttled(&c, &mut s, None, t0() + ms(5_900));
        assert_eq!(s.effective_rate, 0.25, "6 s (three 2 s intervals) confirms");
        let mut s = BucketState::fresh(&c);
        let _ = on_throttled(&c, &mut s, None, t0());
        let _ = on_throttled(&c, &mut s, None, t0() + ms(6_100));
        assert_eq!(s.effective_rate, 0.5, "beyond it, the second is alone too");
    }

    #[test]
    fn the_rate_never_falls_below_the_floor() {
        let c = config(100.0, 10);
        let mut s = BucketState::fresh(&c);
        for i in 0..40 {
            let _ = on_throttled(&c, &mut s, None, t0() + TimeDelta::seconds(i));
        }
        assert_eq!(s.effective_rate, 2.0, "2% of 100");
        let slow = config(2.0, 1);
        let mut s = BucketState::fresh(&slow);
        for i in 0..40 {
            let _ = on_throttled(&slow, &mut s, None, t0() + TimeDelta::seconds(i));
        }
        assert_eq!(s.effective_rate, 0.1, "never below 0.1/s");
        let tiny = config(0.05, 1);
        let mut s = BucketState::fresh(&tiny);
        s.last_throttled_at = Some(t0());
        let _ = on_throttled(&tiny, &mut s, None, t0());
        assert_eq!(s.effective_rate, 0.05, "the floor is never above the rate");
    }

    #[test]
    fn success_climbs_fast_to_near_the_last_ceiling_then_probes_slowly_up_to_the_rate() {
        let c = config(100.0, 10);
        let mut s = BucketState::fresh(&c);
        assert!(!on_success(&c, &mut s, t0()), "already at the rate");
        assert_eq!(s, BucketState::fresh(&c));
        s.last_throttled_at = Some(t0());
        let _ = on_throttled(&c, &mut s, None, t0());
        assert_eq!(s.effective_rate, 50.0);
        assert_eq!(s.throttled_rate, Some(100.0), "the ceiling found");
        assert!(
            !on_success(&c, &mut s, t0() + ms(999)),
            "the success must be sustained a second after the 429"
        );
        assert!(on_success(&c, &mut s, t0() + ms(1_000)));
        assert_eq!(s.effective_rate, 52.5, "2.5% of the rate per second");
        assert!(!on_success(&c, &mut s, t0() + ms(1_500)));
        let mut t = t0() + ms(1_000);
        for _ in 0..15 {
            t += TimeDelta::seconds(1);
            let _ = on_success(&c, &mut s, t);
        }
        assert_eq!(s.effective_rate, 90.0, "fast up to 90% of the ceiling");
        t += TimeDelta::seconds(1);
        assert!(on_success(&c, &mut s, t));
        assert_eq!(
            s.effective_rate, 90.5,
            "then probing: 0.5% of the rate per second"
        );
        for _ in 0..40 {
            t += TimeDelta::seconds(1);
            let _ = on_success(&c, &mut s, t);
        }
        assert_eq!(s.effective_rate, 100.0, "never above the configured rate");

        let slow = config(4.0, 1);
        let mut s = BucketState::fresh(&slow);
        s.last_throttled_at = Some(t0());
        let _ = on_throttled(&slow, &mut s, None, t0());
        assert!(on_success(&slow, &mut s, t0() + ms(1_000)));
        assert_eq!(s.effective_rate, 2.5, "at least 0.5/s");
    }

    #[test]
    fn a_429_for_a_slot_reserved_before_the_last_decrease_does_not_lower_the_rate_again() {
        let c = config(80.0, 5);
        let mut s = BucketState::fresh(&c);
        // A 429 just before: the next one confirms it.
        s.last_throttled_at = Some(t0());
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0())),
            t0() + ms(100)
        ));
        assert_eq!(s.effective_rate, 40.0);
        // Two seconds later, a 429 for a slot reserved before that decrease: paced at 80/s.
        let _ = on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0() + ms(50))),
            t0() + ms(2_100),
        );
        assert_eq!(s.effective_rate, 40.0);
        // ...but its Retry-After still pauses the bucket.
        let pause = t0() + ms(3_000);
        assert!(on_throttled_after(
            &c,
            &mut s,
            Some(pause),
            Some(sent(t0())),
            t0() + ms(2_200)
        ));
        assert_eq!((s.effective_rate, s.paused_until), (40.0, Some(pause)));
        // A slot reserved after the decrease that still drew a 429: the new rate is too high too.
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0() + ms(500))),
            t0() + ms(2_300)
        ));
        assert_eq!(s.effective_rate, 30.0);
    }

    /// A send that went out at the instant its slot was reserved.
    fn sent(at: DateTime<Utc>) -> ThrottledSend {
        ThrottledSend {
            reserved_at: at,
            slot_at: at,
        }
    }

    /// A provider with its own token bucket (rate, burst), answering each send at its slot.
    struct Provider {
        interval: i128,
        tolerance: i128,
        tat: Option<i128>,
    }

    impl Provider {
        fn new(rate: f64, burst: u32) -> Self {
            let g = Gcra::new(rate, burst);
            Self {
                interval: g.interval,
                tolerance: g.tolerance,
                tat: None,
            }
        }

        /// Whether a send arriving at `at` is accepted (false: 429).
        fn accepts(&mut self, at: DateTime<Utc>) -> bool {
            let at = to_ns(at);
            let tat = self.tat.unwrap_or(at);
            if tat - self.tolerance > at {
                return false;
            }
            self.tat = Some(tat.max(at) + self.interval);
            true
        }
    }

    /// A backlog sent through our bucket to `provider` for `seconds`: each millisecond the
    /// worker asks for slots until one is further than the wait, sends each at its slot, and
    /// reports every 429 with its admission time a millisecond after the send. Returns the
    /// sends accepted and the 429s.
    fn drain_against(
        config: &BucketConfig,
        state: &mut BucketState,
        provider: &mut Provider,
        seconds: i64,
    ) -> (usize, usize) {
        drain_through_a_window(config, state, provider, seconds, 10_000, 1, 0)
    }

    /// A drain with at most `window` sends reserved and not yet answered (the relay's
    /// in-flight window), each answered `answer_ms` after its slot; a 429 reaches the bucket
    /// `feedback_ms` after its answer (a worker slow to record it).
    fn drain_through_a_window(
        config: &BucketConfig,
        state: &mut BucketState,
        provider: &mut Provider,
        seconds: i64,
        window: usize,
        answer_ms: i64,
        feedback_ms: i64,
    ) -> (usize, usize) {
        let settings = waiting(500);
        // Reserved, not yet sent: (slot, reserved at).
        let mut pending: Vec<(DateTime<Utc>, DateTime<Utc>)> = Vec::new();
        let (mut accepted, mut throttled) = (0, 0);
        // Sends in flight: answered at.
        let mut answers: Vec<DateTime<Utc>> = Vec::new();
        // 429s on their way to the bucket: (arriving at, the send).
        let mut feedback: Vec<(DateTime<Utc>, ThrottledSend)> = Vec::new();
        for tick in 0..seconds * 1_000 {
            let now = t0() + ms(tick);
            answers.retain(|&answer_at| answer_at > now);
            feedback.retain(|&(arrives_at, send)| {
                if arrives_at > now {
                    return true;
                }
                let _ = on_throttled_after(config, state, None, Some(send), now);
                false
            });
            while pending.len() + answers.len() < window {
                let Admission::Admitted { send_at } =
                    admit(config, state, Lane::New, now, &settings)
                else {
                    break;
                };
                pending.push((send_at, now));
            }
            pending.sort();
            while pending.first().is_some_and(|&(at, _)| at <= now) {
                let (slot_at, reserved_at) = pending.remove(0);
                if provider.accepts(slot_at) {
                    accepted += 1;
                } else {
                    throttled += 1;
                    let send = ThrottledSend {
                        reserved_at,
                        slot_at,
                    };
                    feedback.push((now + ms(answer_ms + feedback_ms), send));
                }
                answers.push(now + ms(answer_ms));
            }
        }
        (accepted, throttled)
    }

    #[test]
    fn a_burst_over_the_providers_shrinks_the_burst_once_and_keeps_the_rate() {
        // Our bucket at the provider's 40/s with a burst of 50; the provider's burst is 40.
        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        let mut provider = Provider::new(40.0, 40);
        let (accepted, throttled) = drain_against(&c, &mut s, &mut provider, 30);
        assert_eq!(s.effective_rate, 40.0, "the rate is never cut");
        assert_eq!(s.last_decrease_at, None);
        assert_eq!(
            s.burst_limit,
            Some(37),
            "shrunk once, to three quarters of 50"
        );
        assert_eq!(
            throttled, 10,
            "only the ten sends beyond the provider's burst"
        );
        // The floor: the provider's 40 at once plus 40/s after; within one send of it.
        assert!(accepted >= 40 + 40 * 30 - 1 - 1, "accepted {accepted}");
    }

    #[test]
    fn a_burst_over_the_providers_sent_through_a_window_with_slow_answers_keeps_the_rate() {
        // As deployed in the drain benchmark: the relay keeps 40 in flight (one second at
        // 40/s), so the burst of 50 is spent over the first answers; the provider answers
        // 20 ms after each send, and a loaded worker records a 429 up to 2 s later (past the
        // burst's 1.25 s: the slot, not the arrival, says it was the burst's).
        for latency_ms in [0, 150, 400, 1_300, 2_000] {
            let c = config(40.0, 50);
            let mut s = BucketState::fresh(&c);
            let mut provider = Provider::new(40.0, 40);
            let (accepted, throttled) =
                drain_through_a_window(&c, &mut s, &mut provider, 30, 40, 20, latency_ms);
            assert_eq!(
                s.last_decrease_at, None,
                "latency {latency_ms} ms: rate cut"
            );
            assert_eq!(s.effective_rate, 40.0);
            assert!(throttled <= 10, "latency {latency_ms} ms: {throttled} 429s");
            // Within 2% of the floor's 40 + 40/s.
            let floor = 40 + 40 * 30;
            assert!(
                accepted as f64 >= f64::from(floor) * 0.98,
                "latency {latency_ms} ms: accepted {accepted} of {floor}"
            );
        }
    }

    #[test]
    fn a_bucket_at_twice_the_providers_rate_through_a_window_is_cut_whatever_the_feedbacks_delay() {
        // The drain benchmark's bucket at 80/s (burst 40) over a provider at 40/s (burst 40),
        // through the relay's window of one second's sends: the rate is cut to the provider's
        // neighbourhood however late the 429s are recorded, and the 429s are bounded by what
        // the delay lets through.
        for latency_ms in [0, 150, 400, 1_300, 2_000] {
            let c = config(80.0, 40);
            let mut s = BucketState::fresh(&c);
            let mut provider = Provider::new(40.0, 40);
            let (accepted, throttled) =
                drain_through_a_window(&c, &mut s, &mut provider, 30, 80, 20, latency_ms);
            assert!(
                s.effective_rate <= 45.0,
                "latency {latency_ms} ms: still at {}/s",
                s.effective_rate
            );
            // The sends over the provider's rate while the 429s are on their way (40/s for
            // the feedback's delay), plus a burst's worth (40) before the cut takes hold.
            let bound = 40 + 40 * usize::try_from(latency_ms).unwrap() / 1_000;
            assert!(
                throttled <= bound,
                "latency {latency_ms} ms: {throttled} 429s (bound {bound}), {accepted} accepted"
            );
            // Within 2% of the floor's 40 + 40/s.
            assert!(
                accepted * 50 >= (40 + 40 * 30) * 49,
                "latency {latency_ms} ms: accepted {accepted}"
            );
        }
    }

    #[test]
    fn a_429_for_a_send_spending_the_burst_shrinks_it_and_later_ones_of_the_round_do_not() {
        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        for _ in 0..50 {
            let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        }
        assert_eq!(s.burst_from, Some(t0()));
        let tat = s.tat;
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0())),
            t0() + ms(5)
        ));
        assert_eq!(
            (s.burst_limit, s.burst_cut_at),
            (Some(37), Some(t0() + ms(5)))
        );
        assert_eq!(s.effective_rate, 40.0);
        assert_eq!(
            s.tat,
            tat.map(|t| t - ms(13 * 25)),
            "the TAT keeps the debt counted in sends: 13 intervals of tolerance gone"
        );
        // The next slot is where it was: one interval after the burst.
        assert_eq!(
            send_at(admit(&c, &mut s, Lane::New, t0() + ms(1), &waiting(100))),
            t0() + ms(25)
        );
        let mut after_first = s.clone();
        let _ = on_throttled_after(&c, &mut s, None, Some(sent(t0())), t0() + ms(6));
        after_first.last_throttled_at = Some(t0() + ms(6));
        assert_eq!(
            s, after_first,
            "the same round: nothing new but the 429's time"
        );
        // After the burst's time (37 intervals), a 429 is about the rate again, once
        // another confirms it.
        let _ = on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0() + ms(1_000))),
            t0() + ms(1_008),
        );
        assert_eq!(s.effective_rate, 40.0);
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0() + ms(1_000))),
            t0() + ms(1_010)
        ));
        assert_eq!(s.effective_rate, 20.0);
        assert_eq!(s.burst_limit, Some(37));
    }

    /// The drain benchmark's slow run of the burst over the provider's (logged): the first
    /// 429s of the burst shrink it and pause the bucket for their Retry-After; an admission
    /// meanwhile, for a slot at the pause's end, finds the shrunk burst whole there and starts
    /// a new one; a 429 of the old burst recorded after it is no longer the new burst's, and
    /// must not halve the rate either (it did: 20/s, and the drain took 35.7 s for its 30 s).
    #[test]
    fn a_late_429_of_a_burst_already_shrunk_keeps_the_rate_after_a_new_burst_began() {
        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        for _ in 0..50 {
            let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        }
        let pause = t0() + ms(1_116);
        let _ = on_throttled_after(&c, &mut s, Some(pause), Some(sent(t0())), t0() + ms(116));
        assert!(on_throttled_after(
            &c,
            &mut s,
            Some(pause),
            Some(sent(t0())),
            t0() + ms(123)
        ));
        assert_eq!(
            (s.burst_limit, s.paused_until, s.effective_rate),
            (Some(37), Some(pause), 40.0),
            "shrunk and paused, the rate kept"
        );
        assert_eq!(
            send_at(admit(
                &c,
                &mut s,
                Lane::New,
                t0() + ms(127),
                &waiting(1_500)
            )),
            pause
        );
        assert_eq!(
            s.burst_from,
            Some(t0() + ms(127)),
            "a new burst, begun by an admission for a slot at the pause's end"
        );
        let _ = on_throttled_after(&c, &mut s, None, Some(sent(t0())), t0() + ms(226));
        assert_eq!(s.effective_rate, 40.0, "the old burst's 429 keeps the rate");
        assert_eq!(s.burst_limit, Some(37), "and the burst");
        // A send of the new burst's round that still draws 429s outside its burst: the rate's.
        let after_pause = ThrottledSend {
            reserved_at: t0() + ms(127),
            slot_at: t0() + ms(2_500),
        };
        let _ = on_throttled_after(&c, &mut s, None, Some(after_pause), t0() + ms(2_510));
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(after_pause),
            t0() + ms(2_520)
        ));
        assert_eq!(s.effective_rate, 20.0);
    }

    /// Only a send on the burst's credit is excused by the shrink: one paced at the rate,
    /// reserved before the shrink, whose 429s come after the burst's time, still lowers it.
    #[test]
    fn a_paced_send_reserved_before_the_shrink_still_lowers_the_rate() {
        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        for _ in 0..50 {
            let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        }
        let _ = on_throttled_after(&c, &mut s, None, Some(sent(t0())), t0() + ms(116));
        assert_eq!((s.burst_limit, s.effective_rate), (Some(37), 40.0));
        let paced = ThrottledSend {
            reserved_at: t0() + ms(50),
            slot_at: t0() + ms(1_300),
        };
        let _ = on_throttled_after(&c, &mut s, None, Some(paced), t0() + ms(1_400));
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(paced),
            t0() + ms(1_410)
        ));
        assert_eq!(s.effective_rate, 20.0, "the rate's, confirmed");
    }

    #[test]
    fn a_burst_of_one_or_a_429_without_its_reservation_lowers_the_rate() {
        let c = config(40.0, 2);
        let mut s = BucketState::fresh(&c);
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0())),
            t0() + ms(5)
        ));
        assert_eq!(
            (s.burst_limit, s.effective_rate),
            (Some(1), 40.0),
            "2 shrinks to 1"
        );
        let _ = send_at(admit(&c, &mut s, Lane::New, t0() + ms(100), &waiting(0)));
        assert!(on_throttled_after(
            &c,
            &mut s,
            None,
            Some(sent(t0() + ms(100))),
            t0() + ms(105)
        ));
        assert_eq!((s.burst_limit, s.effective_rate), (Some(1), 20.0));

        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        s.last_throttled_at = Some(t0());
        assert!(on_throttled(&c, &mut s, None, t0() + ms(5)));
        assert_eq!((s.burst_limit, s.effective_rate), (None, 20.0));
    }

    #[test]
    fn reconfiguring_forgets_the_burst_found() {
        let c = config(40.0, 50);
        let mut s = BucketState::fresh(&c);
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        let _ = on_throttled_after(&c, &mut s, None, Some(sent(t0())), t0() + ms(5));
        assert_eq!(s.burst_limit, Some(37));
        reconfigured(&c, &mut s, t0() + ms(10));
        assert_eq!(
            (s.burst_limit, s.burst_from, s.burst_cut_at),
            (None, None, None)
        );
    }

    #[test]
    fn feedback_on_a_closed_bucket_changes_nothing() {
        let closed = BucketConfig::new(0.0, 0, 0.2, 0.1).unwrap();
        let mut s = BucketState::fresh(&closed);
        assert!(!on_throttled(&closed, &mut s, None, t0()));
        assert!(!on_success(&closed, &mut s, t0()));
        assert_eq!(s, BucketState::fresh(&closed));
    }

    #[test]
    fn a_corrupt_effective_rate_is_read_as_the_floor() {
        let c = config(100.0, 1);
        let mut s = BucketState::fresh(&c);
        s.effective_rate = f64::NAN;
        let _ = send_at(admit(&c, &mut s, Lane::New, t0(), &waiting(0)));
        assert!(matches!(
            admit(&c, &mut s, Lane::New, t0(), &waiting(0)),
            Admission::Deferred { until, .. } if until == t0() + ms(500)
        ));
        assert!(on_success(&c, &mut s, t0()));
        assert_eq!(s.effective_rate, 4.5);
    }

    #[test]
    fn new_work_alone_gets_the_full_rate() {
        let c = BucketConfig::new(50.0, 5, 0.3, 0.3).unwrap();
        let (counts, _) = simulate(&c, &[(Lane::New, 1)], 60);
        assert!((3_000..=3_005).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn recovery_work_alone_gets_the_full_rate() {
        let c = BucketConfig::new(50.0, 5, 0.3, 0.3).unwrap();
        let (counts, _) = simulate(&c, &[(Lane::Retry, 1), (Lane::Redrive, 1)], 60);
        let total = counts[0] + counts[1];
        assert!((3_000..=3_005).contains(&total), "{counts:?}");
    }

    #[test]
    fn greedy_recovery_leaves_new_work_its_reserve() {
        let c = BucketConfig::new(100.0, 10, 0.3, 0.2).unwrap();
        let (counts, _) = simulate(
            &c,
            &[(Lane::Retry, 1), (Lane::Redrive, 1), (Lane::New, 5)],
            60,
        );
        let (recovery, new) = (counts[0] + counts[1], counts[2]);
        assert!(new >= 1_770, "new kept 30% of 6000 within 1.5%: {counts:?}");
        assert!(recovery >= 1_200, "{counts:?}");
        assert!(recovery + new <= 6_010, "{counts:?}");
    }

    #[test]
    fn greedy_new_work_leaves_recovery_its_reserve() {
        let c = BucketConfig::new(100.0, 10, 0.3, 0.2).unwrap();
        let (counts, _) = simulate(&c, &[(Lane::New, 1), (Lane::Retry, 5)], 60);
        let (new, recovery) = (counts[0], counts[1]);
        assert!(
            recovery >= 1_180,
            "recovery kept 20% of 6000 within 1.5%: {counts:?}"
        );
        assert!(new >= 1_800, "{counts:?}");
        assert!(recovery + new <= 6_010, "{counts:?}");
    }

    #[test]
    fn a_class_that_stopped_asking_no_longer_holds_its_reserve() {
        let c = BucketConfig::new(10.0, 1, 0.5, 0.0).unwrap();
        let mut s = BucketState::fresh(&c);
        let settings = waiting(10_000);
        let _ = admit(&c, &mut s, Lane::New, t0(), &settings);
        let later = t0() + ms(1_001);
        let slots: Vec<_> = (0..3)
            .map(|_| send_at(admit(&c, &mut s, Lane::Retry, later, &settings)) - later)
            .collect();
        assert_eq!(slots, [0, 100, 200].map(ms).to_vec());
        assert_eq!(s.tat_recovery, None, "the sub-limit did not apply");
        let _ = admit(&c, &mut s, Lane::New, later, &settings);
        let at = send_at(admit(&c, &mut s, Lane::Retry, later, &settings)) - later;
        assert_eq!(at, ms(400), "contended: only after the new slot at 300 ms");
    }

    /// The largest number of instants in any window `[t, t + 1 s)`.
    fn busiest_second(mut times: Vec<DateTime<Utc>>) -> usize {
        times.sort();
        let mut best = 0;
        let mut start = 0;
        for end in 0..times.len() {
            while times[end] - times[start] >= TimeDelta::seconds(1) {
                start += 1;
            }
            best = best.max(end - start + 1);
        }
        best
    }

    fn lane(i: u8) -> Lane {
        Lane::ALL[usize::from(i % 3)]
    }

    fn bucket() -> impl Strategy<Value = (BucketConfig, AdmissionSettings)> {
        (
            0.5f64..500.0,
            1u32..=50,
            0.0f64..0.45,
            0.0f64..0.45,
            0u64..2_000,
            0u64..2_000,
        )
            .prop_map(|(rate, burst, rn, rr, wait_ms, window_ms)| {
                (
                    BucketConfig::new(rate, burst, rn, rr).unwrap(),
                    AdmissionSettings {
                        max_wait: Duration::from_millis(wait_ms),
                        closed_recheck: Duration::from_secs(10),
                        demand_window: Duration::from_millis(window_ms),
                        max_pause: Duration::from_secs(60),
                        send_margin: Duration::from_secs(1),
                    },
                )
            })
    }

    /// Increasing request times (microsecond gaps at one of four scales, so from thousands to
    /// tens of requests per second) with a lane each.
    fn requests() -> impl Strategy<Value = Vec<(u64, u8)>> {
        (0u32..4).prop_flat_map(|scale| {
            proptest::collection::vec((0u64..20 * 10u64.pow(scale), any::<u8>()), 1..600)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn feedback_during_a_run_never_lets_more_than_rate_plus_burst_through_in_a_second(
            (config, settings) in bucket(),
            requests in requests(),
            feedback in proptest::collection::vec(0u8..4, 600),
        ) {
            let mut state = BucketState::fresh(&config);
            let mut now = t0();
            let mut admitted = Vec::new();
            for (i, &(gap_us, l)) in requests.iter().enumerate() {
                now += TimeDelta::microseconds(i64::try_from(gap_us).unwrap());
                // A random mix of 429s (with and without Retry-After) and successes.
                match feedback[i % feedback.len()] {
                    0 => { let _ = on_throttled(&config, &mut state, None, now); }
                    1 => { let _ = on_throttled(&config, &mut state, Some(now + ms(300)), now); }
                    2 => { let _ = on_success(&config, &mut state, now); }
                    _ => {}
                }
                if let Admission::Admitted { send_at } =
                    admit(&config, &mut state, lane(l), now, &settings)
                {
                    admitted.push(send_at);
                }
                prop_assert!(state.effective_rate <= config.rate_per_second());
            }
            let busiest = busiest_second(admitted);
            prop_assert!(
                busiest as f64 <= config.rate_per_second() + f64::from(config.burst()),
                "{} in one second", busiest
            );
        }

        #[test]
        fn admitted_slots_are_within_the_wait_after_any_pause_and_within_the_rate(
            (config, settings) in bucket(),
            requests in requests(),
            pause in proptest::option::of((0usize..600, 0i64..3_000)),
        ) {
            let mut state = BucketState::fresh(&config);
            let max_wait = TimeDelta::from_std(settings.max_wait).unwrap();
            let mut now = t0();
            let mut admitted = Vec::new();
            for (i, &(gap_us, l)) in requests.iter().enumerate() {
                now += TimeDelta::microseconds(i64::try_from(gap_us).unwrap());
                if let Some((at, for_ms)) = pause && at == i {
                    let _ = on_throttled(&config, &mut state, Some(now + ms(for_ms)), now);
                }
                let paused_until = state.paused_until;
                if let Admission::Admitted { send_at } =
                    admit(&config, &mut state, lane(l), now, &settings)
                {
                    prop_assert!(now <= send_at && send_at <= now + max_wait);
                    prop_assert!(paused_until.is_none_or(|p| send_at >= p));
                    admitted.push(send_at);
                }
            }
            // A pause's 429 may have lowered the effective rate; it never exceeds the configured one.
            prop_assert!(state.effective_rate <= config.rate_per_second());
            let busiest = busiest_second(admitted);
            prop_assert!(
                busiest as f64 <= config.rate_per_second() + f64::from(config.burst()),
                "{} in one second", busiest
            );
        }

        #[test]
        fn two_replicas_with_skewed_clocks_send_at_most_rate_over_a_second_plus_the_skew_plus_burst_in_true_time(
            (config, settings) in bucket(),
            a in requests(),
            b in requests(),
            skew_us in -200_000i64..200_000,
        ) {
            // Each replica's requests, in true time; replica 1's clock reads `skew_us` ahead.
            let mut events = Vec::new();
            for (replica, requests) in [(0i64, &a), (1, &b)] {
                let mut true_us = 0i64;
                for &(gap_us, l) in requests {
                    true_us += i64::try_from(gap_us).unwrap();
                    events.push((true_us, replica, l));
                }
            }
            events.sort();
            let max_wait = TimeDelta::from_std(settings.max_wait).unwrap();
            let mut state = BucketState::fresh(&config);
            let mut admitted = Vec::new();
            for (true_us, replica, l) in events {
                let offset = TimeDelta::microseconds(replica * skew_us);
                let now = t0() + TimeDelta::microseconds(true_us) + offset;
                if let Admission::Admitted { send_at } =
                    admit(&config, &mut state, lane(l), now, &settings)
                {
                    prop_assert!(now <= send_at && send_at <= now + max_wait);
                    // The replica sleeps until its own clock shows `send_at`: the provider
                    // sees the request at that instant in true time.
                    admitted.push(send_at - offset);
                }
            }
            // A replica whose clock runs ahead by d takes slots up to d early in true time, so
            // the provider may see the rate over one second plus the skew, plus the burst.
            // Counted in each replica's own clock instead, this exceeded rate + burst unseen.
            let busiest = busiest_second(admitted);
            let skew_s = skew_us.unsigned_abs() as f64 / 1e6;
            prop_assert!(
                busiest as f64 <= state.effective_rate * (1.0 + skew_s) + f64::from(config.burst()),
                "{} in one second of true time (skew {} ms)", busiest, skew_us / 1000
            );
        }

        #[test]
        fn a_closed_bucket_never_admits(
            burst in 0u32..50,
            (open, settings) in bucket(),
            requests in requests(),
            effective_zero in any::<bool>(),
        ) {
            let config = if effective_zero {
                open
            } else {
                BucketConfig::new(0.0, burst, 0.2, 0.1).unwrap()
            };
            let mut state = BucketState::fresh(&config);
            state.effective_rate = 0.0;
            let recheck = TimeDelta::from_std(settings.closed_recheck).unwrap();
            let mut now = t0();
            for (gap_us, l) in requests {
                now += TimeDelta::microseconds(i64::try_from(gap_us).unwrap());
                prop_assert_eq!(
                    admit(&config, &mut state, lane(l), now, &settings),
                    Admission::Deferred { until: now + recheck, reason: DeferReason::Closed }
                );
            }
            prop_assert_eq!((state.tat, state.tat_new, state.tat_recovery), (None, None, None));
        }

        #[test]
        fn feedback_keeps_the_effective_rate_between_the_floor_and_the_rate(
            rate in prop_oneof![Just(0.0), 0.0f64..1.0, 0.0f64..2_000.0],
            start in 0.0f64..=1.0,
            feedback in proptest::collection::vec((0i64..3_000, 0u8..3, 0i64..10_000), 1..200),
        ) {
            let config = BucketConfig::new(rate, 1, 0.2, 0.1).unwrap();
            let mut state = BucketState::fresh(&config);
            // Anywhere in the valid range, not only at the top.
            state.effective_rate = config.floor_rate()
                + start * (config.rate_per_second() - config.floor_rate());
            let mut now = t0();
            let mut last_decrease: Option<DateTime<Utc>> = None;
            for (gap_ms, kind, retry_ms) in feedback {
                now += ms(gap_ms);
                let before_state = state.clone();
                let before = state.effective_rate;
                let changed = match kind {
                    0 => on_throttled(&config, &mut state, None, now),
                    1 => on_throttled(&config, &mut state, Some(now + ms(retry_ms)), now),
                    _ => on_success(&config, &mut state, now),
                };
                prop_assert_eq!(changed, state != before_state);
                prop_assert!(config.floor_rate() <= state.effective_rate);
                prop_assert!(state.effective_rate <= config.rate_per_second());
                if state.effective_rate < before {
                    if let Some(last) = last_decrease {
                        prop_assert!(now - last >= TimeDelta::seconds(1));
                    }
                    last_decrease = Some(now);
                }
            }
        }

        #[test]
        fn the_interval_is_the_least_whole_nanosecond_count_not_shorter_than_one_over_the_rate(
            rate in prop_oneof![1e-6f64..1.0, 1.0f64..1e6, 1e6f64..1e10],
        ) {
            let t = interval_ns(rate) as f64;
            let exact = 1e9 / rate;
            prop_assert!(t >= exact * (1.0 - 1e-15));
            prop_assert!(t - 1.0 < exact * (1.0 + 1e-15));
        }
    }
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// The adversary answers 429 at random moments, for admission times it picks (real
        /// ones, made up ones, in the future or the past), with and without Retry-After: the
        /// configured rate plus the configured burst still bound every second, the burst found
        /// stays in `[1, burst]` and never grows without an operator.
        #[test]
        fn burst_feedback_for_any_admission_time_never_lets_more_than_rate_plus_burst_through(
            (config, settings) in bucket(),
            requests in requests(),
            feedback in proptest::collection::vec((0u8..4, -3_000i64..3_000, any::<bool>()), 600),
        ) {
            let mut state = BucketState::fresh(&config);
            let mut now = t0();
            let mut admitted: Vec<DateTime<Utc>> = Vec::new();
            let mut reserved: Vec<DateTime<Utc>> = Vec::new();
            let mut last_limit = None;
            for (i, &(gap_us, l)) in requests.iter().enumerate() {
                now += TimeDelta::microseconds(i64::try_from(gap_us).unwrap());
                let (kind, offset_ms, real) = feedback[i % feedback.len()];
                // A real send's reservation and slot, or made-up ones (the slot anywhere from
                // a second before the reservation to two after).
                let send = if real && !reserved.is_empty() {
                    let k = usize::try_from(offset_ms.unsigned_abs()).unwrap() % reserved.len();
                    ThrottledSend { reserved_at: reserved[k], slot_at: admitted[k] }
                } else {
                    let reserved_at = now + ms(offset_ms);
                    ThrottledSend {
                        reserved_at,
                        slot_at: reserved_at + ms((offset_ms * 7).rem_euclid(3_000) - 1_000),
                    }
                };
                match kind {
                    0 => { let _ = on_throttled_after(&config, &mut state, None, Some(send), now); }
                    1 => { let _ = on_throttled_after(&config, &mut state, Some(now + ms(300)), Some(send), now); }
                    2 => { let _ = on_success(&config, &mut state, now); }
                    _ => {}
                }
                if let Admission::Admitted { send_at } =
                    admit(&config, &mut state, lane(l), now, &settings)
                {
                    admitted.push(send_at);
                    reserved.push(now);
                }
                let limit = admitting_burst(&config, &state);
                prop_assert!((1..=config.burst()).contains(&limit));
                if let Some(last) = last_limit {
                    prop_assert!(limit <= last, "the burst grew from {} to {}", last, limit);
                }
                last_limit = Some(limit);
                prop_assert!(state.effective_rate <= config.rate_per_second());
            }
            let busiest = busiest_second(admitted);
            prop_assert!(
                busiest as f64 <= config.rate_per_second() + f64::from(config.burst()),
                "{} in one second", busiest
            );
        }

        /// Against a provider at our rate whose burst is smaller than ours, the bucket never
        /// lowers its rate: only the sends beyond the provider's burst draw 429s.
        #[test]
        fn a_provider_with_a_smaller_burst_at_our_rate_never_costs_rate(
            rate in 5.0f64..200.0,
            provider_burst in 1u32..40,
            extra in 1u32..40,
        ) {
            let config = BucketConfig::new(rate, provider_burst + extra, 0.2, 0.1).unwrap();
            let mut state = BucketState::fresh(&config);
            let mut provider = Provider::new(rate, provider_burst);
            let (_, throttled) = drain_against(&config, &mut state, &mut provider, 5);
            prop_assert_eq!(state.effective_rate, rate);
            prop_assert!(throttled <= extra as usize, "{} 429s", throttled);
        }
    }
}
