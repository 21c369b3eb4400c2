//! The delivery rules of nudge, as plain values and functions.
//!
//! This crate owns what a delivery *is* and what may happen to it: identifiers parsed at the edge
//! ([`ids`]), the delivery state machine ([`state`]), the `Retry-After` header ([`retry_after`]),
//! the retry policy with injected jitter ([`policy`]), what a provider's answer means
//! ([`answer`]: verdicts and their effects on bucket, contact and operators), how it is classified
//! ([`mod@classify`]), the one function that turns an attempt's outcome into the next state
//! ([`mod@decide`]), what a client's reschedule or cancel did to each channel ([`change`]),
//! fairness between tenants: the claim's turns and a tenant's cap ([`fairness`]), the drain
//! model: a channel's admitted rate, the time of each turn at it and the drain floor
//! ([`drain`]), and the patient's time: IANA zones from a compiled-in database, local times
//! and how a reminder's times become instants ([`zone`]), and consent: whether a destination may
//! be reached and what a patient's reply means ([`consent`]). Every other crate asks these questions here instead of
//! answering them again.
//!
//! It must never do I/O: no clock reads inside the rules (time is a parameter), no network, no
//! database, no async runtime and no logging. Randomness only arrives through the [`Jitter`] trait
//! so that tests can pin every number exactly.

pub mod admission;
pub mod answer;
pub mod change;
pub mod classify;
pub mod consent;
pub mod decide;
pub mod drain;
pub mod fairness;
pub mod ids;
pub mod lane;
pub mod policy;
pub mod quiet;
pub mod restore;
pub mod retention;
pub mod retry_after;
pub mod series;
pub mod state;
pub mod zone;

pub use admission::{
    Admission, AdmissionSettings, BucketConfig, BucketState, DeferReason, InvalidBucket,
    InvalidShare, MaxShare, TenantCap, ThrottledSend, admit, admit_capped, on_success,
    on_suspended, on_throttled, on_throttled_after, reconfigured,
};
pub use answer::{
    Alert, BucketSignal, ContactFlag, Effects, ProviderAnswer, ProviderCode, Verdict,
    retry_after_at,
};
pub use change::{CancelChange, ChannelChange, Found, InvalidRevision, Revision, RevisionOrder};
pub use classify::{
    IdempotencySupport, OutcomeClass, SendOutcome, classify, classify_verdict, response_class,
};
pub use consent::{
    Category, CategoryError, ConsentSource, ConsentState, Keyword, keyword_as_received,
};
pub use decide::{
    AttemptContext, AttemptFacts, Decision, RETRY_AFTER_SEEN_MAX_CHARS, decide, is_account_fault,
};
pub use fairness::{
    ClaimOrder, ClaimWeight, Claimed, Contender, InvalidFairness, TenantOffer, claim_order,
    fair_shares,
};
pub use ids::{
    Channel, DeliveryId, EventId, IdError, IdempotencyKey, ProviderAccount, RedriveId, ReminderId,
    SubscriberRef, TenantId,
};
pub use lane::{Lane, UnknownLane};
pub use policy::{FixedJitter, InvalidPolicy, Jitter, MaxJitter, RandJitter, RetryPolicy};
pub use quiet::{InvalidQuietHours, QuietHours, QuietSpan, QuietVerdict, quiet_verdict};
pub use restore::{AfterRestore, HoldReason, KeepReason, RESTORED_REASON, after_restore};
pub use retention::{InvalidRetention, RetentionDays, RetentionPolicy};
pub use retry_after::{MalformedReason, MalformedRetryAfter, RetryAfter};
pub use series::{Occurrence, Series, SeriesError, SeriesLimits};
pub use state::{DeliveryState, IllegalTransition};
pub use zone::{
    ExpiresAfter, Expiry, InvalidExpiresAfter, InvalidLocalTime, LocalTime, ReminderTimes,
    Resolution, Resolved, ResolvedTimes, SendTime, TZDB_VERSION, TimeError, UnknownZone, Zone,
    ZoneSource,
};
