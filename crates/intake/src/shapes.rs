//! The request and answer shapes of the `/v1` API, documented for OpenAPI by `utoipa` from
//! these very types (`docs/openapi.json` is generated from them; a test keeps the committed
//! one equal).
//!
//! The request types are the contract's description of a body: the handlers parse a body
//! with the ledger's reminder format (`nudge_ledger::input`), whose errors name a JSON
//! pointer and never a value, not with these types. The answers are what the handlers
//! serialise. A shape never holds a destination, subscriber reference or content in an
//! answer. This module must never read a request, touch the ledger or import a handler.

use chrono::{DateTime, Utc};
use nudge_domain::Channel;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::Problem;

/// The correlation id header, read from requests and set on reminder answers.
pub const CORRELATION_HEADER: &str = "x-correlation-id";

/// A channel name.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChannelName {
    Push,
    Email,
    Sms,
}

/// Destinations per channel: a phone number, an email address or a push token (each 1 to
/// 1024 bytes, not blank). Stored encrypted; never echoed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Destinations {
    #[schema(min_length = 1, max_length = 1024)]
    pub push: Option<String>,
    #[schema(min_length = 1, max_length = 1024)]
    pub email: Option<String>,
    #[schema(min_length = 1, max_length = 1024)]
    pub sms: Option<String>,
}

/// One reminder: the fields of a `nudgectl reminders load` line without `tenant` (the path
/// names it). Every channel listed needs a destination, and no other channel may have one.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReminderBody {
    /// The client's id for this event, unique per tenant: posting it again is safe.
    #[schema(min_length = 1, max_length = 200, pattern = "^[!-~]+$")]
    pub event_id: String,
    /// The client's opaque identifier of the patient (stored only as a keyed hash).
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]+$")]
    pub subscriber_ref: String,
    #[schema(min_items = 1, max_items = 3)]
    pub channels: Vec<ChannelName>,
    /// When to send (RFC 3339 with an offset); at most `intake.max_schedule_ahead_days` ahead.
    /// Exactly one of `scheduled_at` and `scheduled_local`.
    pub scheduled_at: Option<DateTime<Utc>>,
    /// When to send, as the patient's wall clock (`2027-03-14T02:30:00`, no offset), read in
    /// `time_zone`, else the subscriber's zone, else the tenant's (none: 400). A time the
    /// clocks skip moves forward by the gap; one that happens twice is the earlier.
    #[schema(value_type = Option<String>, example = "2027-03-14T02:30:00", pattern = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$")]
    pub scheduled_local: Option<String>,
    /// The subscriber's IANA time zone (`Europe/Berlin`), known to the built-in tz database:
    /// reads `scheduled_local`, and is the subscriber's zone from then on.
    #[schema(min_length = 1, max_length = 64, example = "Europe/Berlin")]
    pub time_zone: Option<String>,
    /// After this, never send (after the scheduled instant). Exactly one of `expires_at` and
    /// `expires_after_s`.
    pub expires_at: Option<DateTime<Utc>>,
    /// Seconds after the scheduled instant after which it is never sent (1 to 31622400).
    #[schema(minimum = 1, maximum = 31622400)]
    pub expires_after_s: Option<u32>,
    pub destinations: Destinations,
    /// Template parameters: a JSON object of at most 16 KiB as JSON text. Stored encrypted.
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    /// The client's revision of this reminder: 0 when absent. A replacement (`PUT`) must give
    /// a higher one.
    #[schema(minimum = 0)]
    pub revision: Option<i64>,
    pub quiet_hours: Option<QuietHoursMode>,
    /// What the reminder is about: `general` when absent, else one of the tenant's categories
    /// (`nudgectl category create`); another is a 400 at `/category`. A subscriber may switch
    /// a category off per channel (`PUT .../preferences`) unless it is required.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[a-z0-9][a-z0-9_-]*$",
        example = "appointment"
    )]
    pub category: Option<String>,
}

/// `respect` (the default): not sent inside the subscriber's quiet hours; `ignore`: sent
/// inside them, for urgent reminders (a cancelled appointment), only where the tenant allows
/// it (else 400 at `/quiet_hours`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum QuietHoursMode {
    Respect,
    Ignore,
}

/// The body of `PUT /v1/tenants/{tenant}/reminders/{event_id}`: the whole reminder as it
/// should now be, under a revision higher than its current one. The subscriber stays the
/// same; `event_id`, when given, must be the path's.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RescheduleBody {
    /// Must grow with each replacement (the first post is revision 0 unless it gave one). The
    /// current revision with the same body again changes nothing; an older one, or the
    /// current one with another body, is a 409 naming the current one.
    #[schema(minimum = 0)]
    pub revision: i64,
    #[schema(min_length = 1, max_length = 200, pattern = "^[!-~]+$")]
    pub event_id: Option<String>,
    /// The reminder's subscriber, as posted.
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]+$")]
    pub subscriber_ref: String,
    #[schema(min_items = 1, max_items = 3)]
    pub channels: Vec<ChannelName>,
    /// The new time (RFC 3339 with an offset): not before now (unless unchanged), at most
    /// `intake.max_schedule_ahead_days` ahead. Exactly one of `scheduled_at` and
    /// `scheduled_local`.
    pub scheduled_at: Option<DateTime<Utc>>,
    /// The new time as the patient's wall clock, read as in a post.
    #[schema(value_type = Option<String>, example = "2027-03-14T02:30:00", pattern = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$")]
    pub scheduled_local: Option<String>,
    /// The subscriber's IANA time zone, as in a post.
    #[schema(min_length = 1, max_length = 64, example = "Europe/Berlin")]
    pub time_zone: Option<String>,
    /// After this, never send (after the scheduled instant, and after now). Exactly one of
    /// `expires_at` and `expires_after_s`.
    pub expires_at: Option<DateTime<Utc>>,
    /// Seconds after the scheduled instant after which it is never sent (1 to 31622400).
    #[schema(minimum = 1, maximum = 31622400)]
    pub expires_after_s: Option<u32>,
    pub destinations: Destinations,
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    /// As in a post; absent: `respect`.
    pub quiet_hours: Option<QuietHoursMode>,
    /// As in a post; absent: `general`.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[a-z0-9][a-z0-9_-]*$",
        example = "appointment"
    )]
    pub category: Option<String>,
}

/// What a reschedule did to one channel: `moved` (to the new time; its delivery keeps its
/// key and attempts), `added`, `removed` (its owed delivery cancelled), `unchanged` (its
/// time did not change), or `too_late` with `state` (`sending`: its send started;
/// `delivered`, ...: settled), which the reschedule did not touch.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChannelRescheduled {
    pub channel: ChannelName,
    /// `moved`, `added`, `removed`, `unchanged` or `too_late`.
    pub change: &'static str,
    /// The delivery's state, with `too_late`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'static str>,
}

/// The answer to a reschedule (200): applied (`rescheduled`) or the same revision and body
/// again (`unchanged`, nothing changed). Committed before it is sent.
#[derive(Debug, Serialize, ToSchema)]
pub struct RescheduleAnswer {
    pub reminder_id: uuid::Uuid,
    pub event_id: String,
    /// `rescheduled` or `unchanged`.
    pub status: &'static str,
    pub revision: i64,
    /// The reminder's time now.
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Every channel of the old and the new reminder.
    pub channels: Vec<ChannelRescheduled>,
    /// Deliveries created now (an added channel, or the reminder moved to a time that has
    /// come or whose window ran).
    pub deliveries_created: u64,
}

/// Several reminders in one request, each answered on its own.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReminderBatch {
    /// 1 to `intake.batch_max` (default 500) reminders.
    #[schema(min_items = 1)]
    pub reminders: Vec<ReminderBody>,
}

/// The body of `POST /v1/tenants/{tenant}/reminders`: one reminder, or a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PostReminders {
    One(Box<ReminderBody>),
    Many(ReminderBatch),
}

/// Why a reminder is recorded but not scheduled yet: it is held until the tenant is resumed
/// or the channel's drain ends, then scheduled at once if its time has come.
///
/// Withheld, not "held": in nudge's words a held delivery is an ambiguous one, waiting for an
/// operator. The public API keeps its words: this is the field `held` of [`Accepted`] and the
/// schema `Held` of the OpenAPI document, and both stay so named (clients read them).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(
    as = Held,
    description = "Why a reminder is recorded but not scheduled yet: it is held until the tenant is resumed\nor the channel's drain ends, then scheduled at once if its time has come."
)]
pub struct Withheld {
    pub tenant_paused: bool,
    /// Those of the reminder's channels that are draining.
    pub draining_channels: Vec<ChannelName>,
}

/// A reminder recorded (202, first time) or recognised (200, the same event and body again).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Accepted {
    pub reminder_id: uuid::Uuid,
    pub event_id: String,
    /// `accepted` (recorded now) or `duplicate` (recorded before, nothing changed).
    pub status: &'static str,
    /// Deliveries created at once (the reminder is due, or its window has run).
    pub deliveries_created: u64,
    pub correlation_id: String,
    /// Present when the reminder is recorded but held.
    #[serde(rename = "held", skip_serializing_if = "Option::is_none")]
    pub withheld: Option<Withheld>,
    /// The instant it is scheduled for (a local time resolved); with `accepted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduled_at: Option<DateTime<Utc>>,
    /// The instant it expires; with `accepted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
    /// How `scheduled_local` was read; with `accepted` when the reminder gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalResolution>,
}

/// How a reminder's `scheduled_local` became its instant.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LocalResolution {
    /// The zone it was read in.
    pub time_zone: &'static str,
    /// Whose zone that is: `reminder` (its `time_zone`), `subscriber` or `tenant`.
    pub zone_from: &'static str,
    /// The zone's offset from UTC at the instant (`-04:00`).
    pub utc_offset: String,
    /// The wall clock in the zone at the instant: `scheduled_local`, or later by the gap.
    pub wall_clock: String,
    /// `exact`; `moved_past_gap` (the clocks skipped it: moved forward by the gap);
    /// `earlier_of_two` (it happens twice: the earlier).
    pub resolution: &'static str,
}

/// One reminder of a batch, answered on its own.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchItem {
    /// Its position in `reminders`.
    pub index: usize,
    /// 202 accepted, 200 duplicate, 409 event id used for another reminder, 400 invalid.
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reminder: Option<Accepted>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// Present with 400 (paths relative to this reminder) and 409.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<Problem>,
}

/// The answer to a batch: one item per reminder, in order. Everything accepted in it is
/// committed together, before this answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAnswer {
    pub results: Vec<BatchItem>,
}

/// The 200 answer of `POST .../reminders`: a duplicate single reminder, or a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PostAnswer {
    One(Box<Accepted>),
    Many(BatchAnswer),
}

/// One channel of a reminder. `state` is a delivery state (`scheduled`, `queued`, `sending`,
/// `retry_wait`, `delivered`, `dead_lettered`, `expired`, `cancelled`, `suppressed`: not sent
/// because the destination opted out, `ambiguous`) or `pending` while no delivery exists yet
/// (not due yet, or held).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChannelState {
    pub channel: ChannelName,
    pub state: String,
    pub attempts: i32,
    pub settled_at: Option<DateTime<Utc>>,
}

/// A reminder's state per channel. No destination, subscriber or content.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReminderState {
    pub reminder_id: uuid::Uuid,
    pub event_id: String,
    pub scheduled_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    pub correlation_id: Option<String>,
    /// The current revision: a reschedule (`PUT`) must give a higher one.
    pub revision: i64,
    pub channels: Vec<ChannelState>,
}

/// What a cancellation did to one channel: `cancelled` (no request will ever be made for
/// it), `too_late` with `state` (`sending`: its send started and finishes, never retried;
/// `delivered`; `ambiguous`: maybe sent), or `already_settled` with `state` (`cancelled`,
/// `suppressed`, `expired`, `dead_lettered`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChannelCancelled {
    pub channel: ChannelName,
    /// `cancelled`, `too_late` or `already_settled`.
    pub answer: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'static str>,
}

/// What a cancellation did: `channels` answers every channel; `cancelled` lists the
/// deliveries settled now; `reminder` shows every channel after it.
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelAnswer {
    pub cancelled: Vec<ChannelName>,
    pub channels: Vec<ChannelCancelled>,
    pub reminder: ReminderState,
}

/// The body of `PUT .../contacts`: destinations for one or more channels; channels not given
/// keep theirs. `time_zone`, when given, is the subscriber's zone on all their contacts;
/// `quiet_hours`, when given, their quiet hours on all of them.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContactsBody {
    pub destinations: Destinations,
    /// The subscriber's IANA time zone (`Europe/Berlin`), known to the built-in tz database.
    #[schema(min_length = 1, max_length = 64, example = "Europe/Berlin")]
    pub time_zone: Option<String>,
    pub quiet_hours: Option<SubscriberQuietHoursBody>,
}

/// A subscriber's quiet hours: `"tenant"` (the tenant's window per channel, the default),
/// `"none"` (no quiet hours at all), or their own window on every channel, in their zone.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum SubscriberQuietHoursBody {
    Keyword(QuietKeyword),
    Window(QuietWindow),
}

/// `tenant`: the tenant's window per channel; `none`: no quiet hours at all.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum QuietKeyword {
    Tenant,
    None,
}

/// A daily window of wall-clock time: from `from` (inclusive) to `to` (exclusive), ending the
/// next day when `to` is not after `from`; `from` and `to` differ.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuietWindow {
    #[schema(
        pattern = "^([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?$",
        example = "21:00"
    )]
    pub from: String,
    #[schema(
        pattern = "^([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?$",
        example = "08:00"
    )]
    pub to: String,
}

/// The channels whose destination was stored, the subscriber's zone when one was given, and
/// their quiet hours when given (`tenant`, `none`, or the window as `HH:MM-HH:MM`).
#[derive(Debug, Serialize, ToSchema)]
pub struct ContactsAnswer {
    pub channels: Vec<ChannelName>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quiet_hours: Option<String>,
}

/// What an erasure did (counts only).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErasureAnswer {
    pub contacts_deleted: u64,
    pub reminders_erased: u64,
    pub deliveries_cancelled: u64,
    /// The subscriber's series, cancelled and erased like their reminders.
    pub series_erased: u64,
    /// Their preferences, deleted (a destination's opt-out stays: it is the destination's).
    pub preferences_deleted: u64,
}

/// The consent of one of the subscriber's destinations as it stands: its last change.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConsentNow {
    pub channel: ChannelName,
    /// `opted_in` or `opted_out`.
    pub state: String,
    /// Where the change came from: `api`, `inbound_keyword`, `provider_stop`,
    /// `provider_bounce`, `operator` or `import`.
    pub source: String,
    pub changed_at: DateTime<Utc>,
}

/// One change of a destination's consent (no category) or of one of the subscriber's
/// preferences (its category). No destination.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConsentHistoryEntry {
    /// The entry's id: give the last one seen as `after` for the next page.
    pub id: i64,
    pub channel: ChannelName,
    /// The preference's category; null for a destination's change.
    pub category: Option<String>,
    pub state: String,
    pub source: String,
    /// Who: `inbound:<account>` (the patient's reply), `provider:<account>`, an operator.
    pub actor: String,
    /// The keyword as the patient sent it (trimmed), for a reply.
    pub keyword: Option<String>,
    pub correlation_id: Option<String>,
    /// The database's time of the change.
    pub recorded_at: DateTime<Utc>,
}

/// A subscriber's consent: each of their destinations' as it stands, and one page of the
/// history of those destinations and of the subscriber's preferences, oldest first. A
/// destination's history is the destination's: it holds what was recorded for a number
/// before this subscriber was posted with it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConsentHistoryAnswer {
    pub current: Vec<ConsentNow>,
    pub entries: Vec<ConsentHistoryEntry>,
    /// Present when there are more entries: ask again with `after` set to it.
    pub next_after: Option<i64>,
}

/// A recurring reminder: the reminder's fields, a zone, a start in the patient's local time
/// and an RFC 5545 RRULE. Each occurrence becomes its own reminder, event id
/// `{series_id}/{local date-time the rule gave}` (`med-42/2027-03-14T08:00:00`), created
/// within the producer's horizon: a series of years never holds more rows than that. The
/// rule is expanded on the wall clock: 08:00 stays 08:00 across both daylight-saving changes;
/// a time the clocks skip happens once, moved forward by the gap; one they repeat happens
/// once, the first time. The start counts as the first occurrence only when the rule matches
/// it (RFC 5545).
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SeriesBody {
    /// The client's id for the series, unique per tenant: posting it again is safe.
    #[schema(min_length = 1, max_length = 180, pattern = "^[!-~]+$")]
    pub series_id: String,
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]+$")]
    pub subscriber_ref: String,
    #[schema(min_items = 1, max_items = 3)]
    pub channels: Vec<ChannelName>,
    /// The IANA zone the rule runs in (`Europe/Berlin`): also the subscriber's zone from then
    /// on.
    #[schema(min_length = 1, max_length = 64, example = "Europe/Berlin")]
    pub time_zone: String,
    /// The first wall-clock time (`2027-03-01T08:00:00`), at most
    /// `intake.max_schedule_ahead_days` ahead. Occurrences before the post are not created.
    #[schema(value_type = String, example = "2027-03-01T08:00:00", pattern = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$")]
    pub start_local: String,
    /// `FREQ=DAILY|WEEKLY|MONTHLY` with INTERVAL, BYDAY, BYMONTHDAY, BYHOUR, BYMINUTE, WKST,
    /// and COUNT or UNTIL (one of them; UNTIL as `YYYYMMDD`, `YYYYMMDDTHHMMSS` local or
    /// `YYYYMMDDTHHMMSSZ`), ending within `intake.max_schedule_ahead_days` of the start and
    /// at most 24 times a day. `RRULE:` in front is accepted (512 bytes in all).
    #[schema(min_length = 1, max_length = 512, example = "FREQ=DAILY;COUNT=30")]
    pub rrule: String,
    /// Each occurrence's lifetime: never sent later than this many seconds after its time.
    #[schema(minimum = 1, maximum = 31622400)]
    pub expires_after_s: u32,
    pub destinations: Destinations,
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    pub quiet_hours: Option<QuietHoursMode>,
    /// Every occurrence's category, as a reminder's: `general` when absent.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[a-z0-9][a-z0-9_-]*$",
        example = "medication"
    )]
    pub category: Option<String>,
}

/// One occurrence: its event id, the wall-clock time the rule gave, and when it is due.
#[derive(Debug, Serialize, ToSchema)]
pub struct OccurrenceShape {
    pub event_id: String,
    #[schema(value_type = String, example = "2027-03-14T02:30:00")]
    pub local: String,
    pub scheduled_at: DateTime<Utc>,
}

/// The answer to a series' post: 202 `accepted`, or 200 `duplicate` (the same series again).
#[derive(Debug, Serialize, ToSchema)]
pub struct SeriesAccepted {
    pub series_id: String,
    /// `accepted` or `duplicate`.
    pub status: &'static str,
    /// Occurrences created with the post (due before the producer's horizon already passed).
    pub occurrences_created: u64,
    pub correlation_id: String,
    /// The next occurrences from now (at most 5).
    pub upcoming: Vec<OccurrenceShape>,
}

/// A series as the ledger has it (no subscriber, destination or content).
#[derive(Debug, Serialize, ToSchema)]
pub struct SeriesState {
    pub series_id: String,
    pub channels: Vec<ChannelName>,
    pub time_zone: String,
    #[schema(value_type = String, example = "2027-03-01T08:00:00")]
    pub start_local: String,
    pub rrule: String,
    pub expires_after_s: u32,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    /// The first occurrence not created as a reminder yet (none: all created, or cancelled).
    pub next_at: Option<DateTime<Utc>>,
    pub occurrences_created: u64,
    /// Occurrences a provider was given (sent, delivered, or held as maybe sent).
    pub occurrences_sent: u64,
    /// The next occurrences from now (at most 5; none once cancelled or unexpandable).
    pub upcoming: Vec<OccurrenceShape>,
    /// Its zone or rule no longer parses (a zone this build's tz database lacks): no
    /// occurrence is created until it is mended (post it again under a new id and cancel it).
    pub unexpandable: bool,
}

/// What a series' cancel did: no occurrence is created any more; those created and not sent
/// are cancelled with their deliveries; those a provider was given are counted.
#[derive(Debug, Serialize, ToSchema)]
pub struct SeriesCancelAnswer {
    pub series_id: String,
    pub occurrences_cancelled: u64,
    pub deliveries_cancelled: u64,
    pub occurrences_sent: u64,
    /// It had been cancelled before: this cancel changed nothing.
    pub already_cancelled: bool,
}

/// The API's name of `c`.
pub fn channel_name(c: Channel) -> ChannelName {
    match c {
        Channel::Push => ChannelName::Push,
        Channel::Email => ChannelName::Email,
        Channel::Sms => ChannelName::Sms,
    }
}

/// One preference of a subscriber: a channel and a category, whether they want it, and its
/// last change (`source`, `changed_at` null: never changed, opted in).
#[derive(Debug, Serialize, ToSchema)]
pub struct PreferenceShape {
    pub channel: ChannelName,
    pub category: String,
    /// Required by the tenant: cannot be switched off here.
    pub required: bool,
    /// `opted_in` or `opted_out`.
    pub state: String,
    /// `api`, `operator`, ...; null when never changed.
    pub source: Option<String>,
    pub changed_at: Option<DateTime<Utc>>,
}

/// A subscriber's preferences: every channel with every category of the tenant, and the
/// consent of the destinations they hold (a destination opted out, by a STOP say, is not sent
/// to whatever its preferences say).
#[derive(Debug, Serialize, ToSchema)]
pub struct PreferencesAnswer {
    pub preferences: Vec<PreferenceShape>,
    pub destinations: Vec<ConsentNow>,
}

/// One change of a preference.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreferenceChangeBody {
    pub channel: ChannelName,
    /// `general` or one of the tenant's categories.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[a-z0-9][a-z0-9_-]*$",
        example = "billing"
    )]
    pub category: String,
    pub state: ConsentStateName,
}

/// `opted_in` or `opted_out`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConsentStateName {
    OptedIn,
    OptedOut,
}

/// The body of `PUT .../preferences`: the changes, applied together or not at all (at most
/// 300; the last one for a channel and category wins). Channels and categories not listed
/// keep theirs.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreferencesBody {
    #[schema(min_items = 1, max_items = 300)]
    pub preferences: Vec<PreferenceChangeBody>,
}

/// What happened to a delivery: `scheduled` (made, waiting for its time), `deferred` (waiting
/// again, until `next_attempt_at`: a retry, the provider account's slot or quiet hours),
/// `sent` (the provider accepted it), `delivered` (a receipt settled it), `failed`
/// (dead-lettered), `expired`, `cancelled`, `suppressed` (its destination or category opted
/// out), `held_ambiguous` (its outcome unknown: held for a receipt or an operator),
/// `redriven` (a dead letter fed again) and `rescheduled` (its time moved).
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryEventKindName {
    Scheduled,
    Deferred,
    Sent,
    Delivered,
    Failed,
    Expired,
    Cancelled,
    Suppressed,
    HeldAmbiguous,
    Redriven,
    Rescheduled,
}

pub fn event_kind_name(kind: nudge_ledger::DeliveryEventKind) -> DeliveryEventKindName {
    use nudge_ledger::DeliveryEventKind as K;
    match kind {
        K::Scheduled => DeliveryEventKindName::Scheduled,
        K::Deferred => DeliveryEventKindName::Deferred,
        K::Sent => DeliveryEventKindName::Sent,
        K::Delivered => DeliveryEventKindName::Delivered,
        K::Failed => DeliveryEventKindName::Failed,
        K::Expired => DeliveryEventKindName::Expired,
        K::Cancelled => DeliveryEventKindName::Cancelled,
        K::Suppressed => DeliveryEventKindName::Suppressed,
        K::HeldAmbiguous => DeliveryEventKindName::HeldAmbiguous,
        K::Redriven => DeliveryEventKindName::Redriven,
        K::Rescheduled => DeliveryEventKindName::Rescheduled,
    }
}

/// One event of a delivery. Ids, states, classes and times only: never a destination,
/// content or subscriber reference.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryEventShape {
    /// The tenant's cursor: positions only grow; give the last one seen as `after`.
    pub position: i64,
    /// The event's stable id: the same event read or pushed again has the same id.
    pub id: uuid::Uuid,
    pub kind: DeliveryEventKindName,
    pub delivery_id: uuid::Uuid,
    /// The delivery's own count of events, 1 for its first: the order per delivery.
    pub delivery_seq: i32,
    pub reminder_id: uuid::Uuid,
    /// The reminder's `event_id` as the client posted it.
    pub event_id: String,
    pub channel: ChannelName,
    /// The delivery's state in the ledger after the change (a `sent` delivery is `delivered`:
    /// the provider accepted it).
    pub state: String,
    /// Its state before (null for `scheduled` and a delivery made `suppressed`).
    pub previous_state: Option<String>,
    /// `new`, `retry` or `redrive`.
    pub lane: String,
    pub attempts: i32,
    /// The last attempt's class (`retryable`, `permanent`, `throttled`, ...), where one failed.
    pub error_class: Option<String>,
    /// Why it failed, waits or was not sent: the attempt's (`attempts_exhausted: http_503`,
    /// `http_503`, `contact_opted_out`), or for a wait without an attempt `rate_limited` (the
    /// provider account's rate or pause), `returned_unsent` (a worker stopped or was lost
    /// before sending), `quiet_hours` or `account_unavailable`.
    pub reason: Option<String>,
    /// When a waiting delivery is next due.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The provider's id of the message, once it accepted one.
    pub provider_message_id: Option<String>,
    /// The database's time of the change.
    pub occurred_at: DateTime<Utc>,
}

/// One page of a tenant's delivery events, oldest position first.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventsAnswer {
    pub events: Vec<DeliveryEventShape>,
    /// Ask again with `after` set to this: the last event's position, or the `after` asked
    /// with when the page is empty.
    pub next_after: i64,
    /// True when more events can be read at once; false when the page reached the newest.
    pub more: bool,
}
