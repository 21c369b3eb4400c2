//! `nudgectl`, the operator's command line: migrations, tenants (pause, routes, schedules),
//! bulk reminder loads, rate buckets, status, the drain estimate, and the read-only trace,
//! dead-letter and retention-plan views.
//!
//! Every command that changes operator state leaves an audit row with the actor and the
//! reason. Output meant for scripts is available as JSON (`--json`); human output goes to
//! stdout, errors to stderr with their whole chain. It must never print a destination,
//! subscriber reference or message content.

mod category;
mod change;
mod config;
mod consent;
mod console;
mod dlq;
mod estimate;
mod events;
mod load;
mod operations;
mod rate;
mod redrive;
mod replication;
mod restore;
mod retention;
mod schedule;
mod series;
mod status;
mod table;
mod trace;
mod webhook;

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};
use nudge_domain::{Channel, DeliveryId, ProviderAccount, TZDB_VERSION, Zone};
use nudge_ledger::{
    ChannelStatus, DestinationCipher, Ledger, LedgerTime, Operator, Tenant, TraceId,
};

pub use config::CtlConfig;
pub use operations::{DrainCommand, OwnerCommand};
pub use rate::{RateError, RatePerSecond};
pub use redrive::{RedriveArgs, RedriveCommand};
pub use restore::RestoreCommand;
pub use retention::RetentionCommand;
pub use schedule::{CronExpr, CronExprError};

#[derive(Debug, Parser)]
#[command(
    name = "nudgectl",
    version,
    about = "Operate nudge: apply migrations, manage tenants, their schedules and provider routes, \
             bulk-load reminders, set rate buckets, inspect delivery status, estimate drains, trace \
             reminders and list dead letters.",
    long_about = "Operate nudge: apply migrations, manage tenants, their schedules and provider \
        routes, bulk-load reminders, set provider rate buckets, inspect delivery status, \
        estimate how long a backlog takes to drain, trace a reminder's deliveries and list \
        dead-lettered work.\n\n\
        Configuration comes from defaults, then the TOML file given by --config or NUDGE_CONFIG, \
        then NUDGE_* environment variables (e.g. NUDGE_DATABASE__URL)."
)]
pub struct Cli {
    /// TOML configuration file (overrides NUDGE_CONFIG).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Who is acting, recorded in the audit log with every change.
    #[arg(long, global = true, env = "NUDGE_ACTOR", default_value_t = default_actor())]
    pub actor: String,

    #[command(subcommand)]
    pub command: Command,
}

fn default_actor() -> String {
    std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned())
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply every pending database migration (safe to repeat).
    Migrate,
    /// Create and manage tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Bulk-load reminders (a clinic moving from another system).
    #[command(subcommand)]
    Reminders(RemindersCommand),
    /// A tenant's recurring reminders (series): list, show, cancel.
    #[command(subcommand, long_about = series::HELP)]
    Series(SeriesCommand),
    /// Consent: a subscriber's destinations as they stand and their history; a tenant's
    /// history as JSON Lines.
    #[command(subcommand, long_about = consent::HELP)]
    Consent(ConsentCommand),
    /// Who may log in to nudge-console: make a viewer's or an operator's token (shown once),
    /// list them, revoke one.
    #[command(subcommand, long_about = console::HELP)]
    Console(console::ConsoleCommand),
    /// A tenant's delivery events (what its client is told) as JSON Lines: replay from a
    /// position or a time, or tail them as they come.
    #[command(subcommand, long_about = events::HELP)]
    Events(EventsCommand),
    /// A tenant's categories (what its reminders are about): create one, required or not;
    /// list them.
    #[command(subcommand, long_about = category::HELP)]
    Category(CategoryCommand),
    /// Set when the producer materialises a tenant's reminders.
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Set and list the shared rate buckets (one per provider account + channel).
    #[command(subcommand)]
    Rate(RateCommand),
    /// Per-channel counts of owed, in-flight, dead-lettered and ambiguous deliveries, the
    /// rate buckets, the tenants with live work (the latest first), the deliveries that wait
    /// for their tenant's own provider account, and the version of the IANA tz database built
    /// in. With `nudgectl.require_synchronous_standby` set, a warning when the server reports
    /// no synchronous standby.
    #[command(long_about = STATUS_HELP)]
    Status {
        /// Print the per-channel counts as a JSON array instead of the tables (the buckets
        /// are in `rate list --json`); each channel carries its rows of the tenant tables.
        #[arg(long)]
        json: bool,
        /// Show at most this many tenant and channel pairs, the latest first (1 to 1000).
        #[arg(long, default_value_t = 20,
              value_parser = clap::value_parser!(u32).range(1..=1000))]
        tenants: u32,
    },
    /// Estimate how long each channel's owed work takes to drain at its buckets' rate, and
    /// which deliveries would expire before their turn.
    #[command(long_about = ESTIMATE_HELP)]
    EstimateDrain {
        /// Only this channel: push, email or sms.
        #[arg(long)]
        channel: Option<Channel>,
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
    /// Send dead-lettered deliveries again at a controlled rate (a dry run unless --execute);
    /// `redrive status|pause|resume|cancel ID` manage one.
    #[command(long_about = redrive::REDRIVE_HELP, args_conflicts_with_subcommands = true)]
    Redrive {
        #[command(flatten)]
        args: RedriveArgs,
        #[command(subcommand)]
        action: Option<RedriveCommand>,
    },
    /// Show a reminder's deliveries, every attempt, and whether lateness came from
    /// scheduling, provider throttling or a lease before eligibility.
    #[command(long_about = trace::HELP)]
    Trace {
        /// A delivery id, a reminder id, or TENANT/EVENT_ID.
        #[arg(value_name = "ID")]
        id: TraceId,
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
    /// Inspect dead-lettered and ambiguous deliveries.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Drain a channel (finish owed work, schedule nothing new), or end the drain.
    #[command(subcommand, long_about = operations::DRAIN_HELP)]
    Drain(DrainCommand),
    /// Which sender owns each channel's work; hand it over.
    #[command(subcommand)]
    Owner(OwnerCommand),
    /// Give a channel back to its previous owner: rate 0, no new leases, wait for the sends in
    /// flight, hand back what is owed.
    #[command(long_about = operations::ROLLBACK_HELP)]
    Rollback {
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
        /// How long to wait for the sends in flight, e.g. 90s, 5m.
        #[arg(long, value_name = "DURATION", default_value = "2m",
              value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    },
    /// Export records for an incident review.
    #[command(subcommand)]
    Export(ExportCommand),
    /// What retention would delete now, and what it keeps and why (read-only).
    #[command(subcommand)]
    Retention(RetentionCommand),
    /// A ledger restored from a backup: whether it is (status), and reconciling it so the
    /// workers start again without sending twice (reconcile, a dry run unless --execute).
    #[command(subcommand)]
    Restore(RestoreCommand),
}

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Every attempt made under an incident, as JSON Lines, without PHI.
    #[command(long_about = operations::EXPORT_HELP)]
    Attempts {
        /// The incident id given to redrive, drain or rollback.
        #[arg(long, value_name = "ID")]
        incident: String,
        /// Write to this file instead of stdout.
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead-lettered and ambiguous deliveries counted by channel, state, reason and age, with
    /// sample ids and what an active redrive already holds; then the dead-letter records.
    #[command(long_about = dlq::LIST_HELP)]
    List {
        /// Only this channel: push, email or sms.
        #[arg(long)]
        channel: Option<Channel>,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// One delivery's history: times, state, attempts and findings, as `trace` shows them.
    #[command(long_about = dlq::SHOW_HELP)]
    Show {
        /// The delivery id.
        #[arg(value_name = "DELIVERY_ID")]
        id: DeliveryId,
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
}

const STATUS_HELP: &str = "\
What is owed and in flight now, read-only, with the database's clock.

Per channel: scheduled, due (its time has come), queued (published, waiting for a worker), \
sending, retry_wait, quiet_hours (of retry_wait: deferred to the end of the subscriber's quiet \
hours), dead_lettered, ambiguous, expired_quiet (settled expired because their quiet hours \
outlasted them, as long as retention keeps them), suppressed (settled without a send because the \
destination opted out or the category was switched off, as long as retention keeps them), and \
oldest_due_s (how long the oldest eligible \
delivery has waited; deferred work is not eligible). Then the rate buckets. Then the tenants with live work, the latest first \
(by their oldest eligible delivery's age, then by what waits for an account, then by what is \
due), at most --tenants of them: each tenant's own lateness, not the channel's average, with \
the account it is routed to ((default): the workers' default). Then the deliveries that wait \
for their tenant's own provider account because no running worker has it (retry_wait, reason \
account_unavailable): per tenant and channel, how many, how long the oldest has been owed, \
when the next is looked at again, and whether a worker has the account now. They are never \
sent through another account; they expire at their expiry.

--json prints the channel array, each channel with its counts as above plus \"tenants\": \
[{\"tenant_id\", \"tenant\", \"channel\", \"account\", \"due\", \"queued\", \"sending\", \
\"backoff\", \"awaiting_account\", \"quiet_hours\", \"oldest_eligible_age_s\"}] (its rows among the --tenants \
latest) and \"awaiting_account\": [{\"tenant_id\", \"tenant\", \"channel\", \"account\", \
\"deliveries\", \"oldest_scheduled_age_s\", \"next_look_at\", \"held_now\"}].";

const ESTIMATE_HELP: &str = "\
Estimate how long each channel's owed work takes to drain at its buckets' rate, and which \
deliveries would expire before their turn. Read-only.

B is what is owed now: deliveries scheduled, waiting to retry or queued whose time has come, \
plus those being sent. R is the sum of the effective rates of the channel's rate buckets that \
are not paused (each bucket is listed, with why it does not count). N is what falls due during \
the drain: deliveries whose next attempt comes in that time, plus reminders scheduled then that \
have no delivery yet. The floor is T = (B + N) / R seconds, found by recounting N over T until T \
stops growing, up to 7 days. It is a floor: failed sends, 429 slowdowns and lane reserves only \
make the drain longer. With R = 0 the backlog will not drain, and the report says why. A channel \
without any bucket is not limited by admission and has no floor.

Expiring before their turn: the owed deliveries in send order (those in flight first, then by \
next attempt and id), the k-th sent at now + k / R, counting those whose expiry comes first; \
up to 10 delivery ids are listed (ids only).

--json prints {\"now\", \"channels\": [{\"channel\", \"backlog\", \"backlog_due\", \
\"backlog_sending\", \"limited\", \"rate_per_second\", \"arrivals\", \"horizon_s\", \"drains\", \
\"floor_s\", \"converged\", \"capped\", \"iterations\", \"stalled_reason\", \"buckets\", \
\"expiring\": {\"count\", \"delivery_ids\", \"walked\", \"complete\"}}]}.";

#[derive(Debug, Subcommand)]
pub enum RateCommand {
    /// Set a bucket's rate (0 stops sending: the rollback switch); takes effect within a second.
    #[command(long_about = rate::SET_HELP)]
    Set {
        /// Provider account: 1 to 64 of [a-z0-9_-], starting with a letter or digit.
        account: ProviderAccount,
        /// The channel: push, email or sms.
        channel: Channel,
        /// Sends per second, from 0 to 1000000; 0 stops sending on this bucket (rollback).
        #[arg(value_name = "PER_SECOND", allow_negative_numbers = true)]
        per_second: RatePerSecond,
        /// Sends allowed back to back, at least 1 (0 only with rate 0). Default: keep the
        /// bucket's, or max(1, ceil(PER_SECOND)) for a new bucket.
        #[arg(long, value_name = "N")]
        burst: Option<u32>,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Clear a bucket's pause (a provider's Retry-After), keeping its rate; audited.
    #[command(long_about = rate::RESUME_HELP)]
    Resume {
        /// Provider account: 1 to 64 of [a-z0-9_-], starting with a letter or digit.
        account: ProviderAccount,
        /// The channel: push, email or sms.
        channel: Channel,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Every bucket: rate, burst, effective rate, pause, and who changed it, when and why.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant (or show the existing one of that name); prints its id.
    Create {
        /// Unique tenant name, 1 to 200 bytes.
        name: String,
    },
    /// Stop intake and new run intents for a tenant, then wait (bounded) until every running
    /// producer has acknowledged it. Work already owed continues.
    Pause {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
        /// How long to wait for the producers' acknowledgement (0s: do not wait).
        #[arg(long, value_name = "DURATION", default_value = "10s",
              value_parser = humantime::parse_duration)]
        ack_timeout: std::time::Duration,
    },
    /// Let a paused tenant take new work again.
    Resume {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
    /// Route a tenant's channel to a provider account, or back to the channel's default.
    #[command(
        long_about = "Route a tenant's channel to a provider account, or back to the channel's \
            default account with --default. The route is stored in the ledger per tenant and \
            channel; the account it replaces is kept in the audit row. A tenant on its own \
            account is only ever sent through that account: while it is suspended, its bucket \
            paused or closed, or no running worker has it, the tenant's deliveries wait \
            (`status` shows them) and expire at their expiry; they never go through the \
            default or another tenant's account."
    )]
    Route {
        /// Tenant name.
        name: String,
        /// The channel to route: push, email or sms.
        channel: Channel,
        /// Provider account: 1 to 64 of [a-z0-9_-], starting with a letter or digit.
        #[arg(required_unless_present = "default", conflicts_with = "default")]
        account: Option<ProviderAccount>,
        /// Use the channel's default account instead of a tenant-specific one.
        #[arg(long)]
        default: bool,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// The tenant's signing secrets for the intake's `Nudge-Signature` (at most two at once).
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Where nudge-events pushes the tenant's delivery events (Standard Webhooks).
    #[command(
        subcommand,
        long_about = "Where nudge-events pushes the tenant's delivery events: batches in \
            position order, signed as Standard Webhooks (webhook-id, webhook-timestamp, \
            webhook-signature) with a secret shown once, at least once (each event's id tells \
            a client it has seen it). A failed batch is retried as it was; a webhook failing for \
            events.disable_after_s is disabled, its events wait, and `enable` resumes after the \
            last batch the endpoint acknowledged. `show` says where it stands."
    )]
    Webhook(webhook::WebhookCommand),
    /// Quiet hours: per channel, a daily window of the subscriber's wall-clock time in which
    /// nothing is sent on it.
    #[command(
        subcommand,
        long_about = "Quiet hours: per channel, a daily window of the subscriber's wall-clock \
            time (21:00-08:00) in which nothing is sent on that channel. A delivery that falls \
            due inside it waits for its end (state retry_wait, reason quiet_hours); one whose \
            expiry comes first settles expired with the reason quiet_hours. Never dropped, \
            never sent inside the window: the fence checks it with the database's clock. The \
            window is read in the subscriber's zone, else the tenant's default zone (which a \
            window needs: nudgectl tenant set --time-zone). A subscriber may have their own \
            window or none (PUT .../contacts, quiet_hours); a reminder may ignore them \
            (\"quiet_hours\": \"ignore\") only where the tenant allows it (nudgectl tenant set \
            --quiet-hours-ignorable true)."
    )]
    QuietHours(QuietHoursCommand),
    /// Set a tenant's scheduling settings: its claim weight, its cap on an account's rate, its
    /// default time zone. Each is audited; given together, each is applied and audited in turn.
    #[command(
        long_about = "Set a tenant's scheduling settings (at least one). --weight is the \
            tenant's share of each claim of due work beside the other tenants with due work on \
            the same channel: the relay hands work out in weighted turns per tenant, oldest \
            first within a tenant, so one tenant's backlog never makes another's reminders \
            wait behind it. Default 1; a tenant with weight 3 gets three deliveries per turn \
            where one with weight 1 gets one; the turns carry over from claim to claim. \
            --max-share caps the tenant at a share of the rate of every rate-limited provider \
            account (one with a bucket) it sends through, even when it is alone on it (0.5: at most half); 1 removes the \
            cap. --time-zone is the tenant's default IANA zone (Europe/Berlin): a reminder's \
            scheduled_local is read in the reminder's own time_zone, else its subscriber's, \
            else this one; with none of them it is refused. Names are checked against the tz \
            database built into nudge (its version: `nudgectl status`), never the host's. \
            --clear-time-zone removes it. --quiet-hours-ignorable true lets the tenant's \
            reminders say \"quiet_hours\": \"ignore\" (urgent classes, such as a cancelled \
            appointment); false (the default) refuses them. Each change is audited with the \
            value it replaced.",
        group(clap::ArgGroup::new("setting").required(true).multiple(true)
            .args(["weight", "max_share", "time_zone", "clear_time_zone",
                   "quiet_hours_ignorable"]))
    )]
    Set {
        /// Tenant name.
        name: String,
        /// Share of each claim, 1 to 1000 (default for every tenant: 1).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        weight: Option<u32>,
        /// The most the tenant may take of an account's rate, above 0 and at most 1 (1: no
        /// cap, the default).
        #[arg(long, value_name = "SHARE")]
        max_share: Option<f64>,
        /// The tenant's default IANA time zone, e.g. Europe/Berlin (none by default).
        #[arg(long, value_parser = parse_zone, conflicts_with = "clear_time_zone")]
        time_zone: Option<Zone>,
        /// Remove the tenant's default time zone.
        #[arg(long)]
        clear_time_zone: bool,
        /// Whether the tenant's reminders may ignore quiet hours (default false).
        #[arg(long, value_name = "true|false")]
        quiet_hours_ignorable: Option<bool>,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum QuietHoursCommand {
    /// Set the tenant's quiet hours on one channel (replacing any it had).
    Set {
        /// Tenant name.
        name: String,
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// Start of the window, HH:MM or HH:MM:SS, wall-clock time (inclusive).
        #[arg(long, value_name = "HH:MM")]
        from: String,
        /// End of the window (exclusive); not after --from: it ends the next day.
        #[arg(long, value_name = "HH:MM")]
        to: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Remove the tenant's quiet hours on one channel.
    Clear {
        /// Tenant name.
        name: String,
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Show the tenant's zone, quiet hours per channel, and whether reminders may ignore them.
    Show {
        /// Tenant name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Add a new signing secret and print it, once: it is stored only encrypted. The old one
    /// stays valid until `retire`, so the client can switch without downtime. Refused while
    /// the tenant already has two. Needs crypto.destination_key; sealed with
    /// crypto.tenant_secret_key when it is set (as it should be: the workers hold the
    /// destination key).
    Rotate {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Drop every signing secret of the tenant but the newest (once the client signs with it).
    Retire {
        name: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum RemindersCommand {
    /// Import reminders from a JSON Lines file, one reminder per line; `-` reads stdin.
    #[command(long_about = LOAD_HELP)]
    Load {
        /// JSON Lines file, or `-` for standard input.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Check every line (including that its tenant exists) and write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// Why, recorded in the audit log (optional: loading adds, it never removes).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Move reminders to a new time: one by --tenant and --event with --at, or every line of
    /// --file (a `reminders load` line with `revision`: the whole reminder as it should now
    /// be). A dry run unless --execute.
    #[command(long_about = RESCHEDULE_HELP)]
    Reschedule {
        #[command(flatten)]
        target: ChangeTarget,
        /// The new time (RFC 3339), with --event.
        #[arg(long, requires = "event")]
        at: Option<DateTime<Utc>>,
        /// The new expiry, with --event (default: as long after --at as it was).
        #[arg(long, requires = "at")]
        expires_at: Option<DateTime<Utc>>,
        /// The new revision, with --event (default: the current one + 1).
        #[arg(long, requires = "event")]
        revision: Option<i64>,
    },
    /// Cancel reminders: one by --tenant and --event, or every line of --file
    /// (`{"tenant": ..., "event_id": ...}`). Answers per channel cancelled, too_late or
    /// already_settled. A dry run unless --execute.
    Cancel {
        #[command(flatten)]
        target: ChangeTarget,
    },
}

/// What `reminders reschedule` and `reminders cancel` act on, and how.
#[derive(Debug, clap::Args)]
pub struct ChangeTarget {
    /// The tenant of --event.
    #[arg(long, requires = "event", conflicts_with = "file")]
    pub tenant: Option<String>,
    /// One event id (with --tenant).
    #[arg(long, requires = "tenant", conflicts_with = "file")]
    pub event: Option<String>,
    /// JSON Lines, one event a line (at most 64 KiB a line); `-` reads stdin.
    #[arg(long, value_name = "FILE", required_unless_present = "event")]
    pub file: Option<PathBuf>,
    /// Act (without it, a dry run: each line checked and its reminder looked up).
    #[arg(long)]
    pub execute: bool,
    /// Print the answers as JSON.
    #[arg(long)]
    pub json: bool,
    /// Why: recorded in the audit log with every change.
    #[arg(long)]
    pub reason: String,
}

const RESCHEDULE_HELP: &str = "\
Move reminders to a new time, with the intake's rules (docs/decisions/0309): each owed delivery
not yet being sent moves (its key and attempts kept), one being sent or settled is answered
too_late with its state, and nothing is ever both moved and sent.

One reminder: --tenant T --event E --at TIME [--expires-at TIME] [--revision N]; its channels,
destinations and content are kept. From a file: each line is a `reminders load` line with a
`revision` higher than the reminder's current one, the whole reminder as it should now be.

A dry run unless --execute. Each line is answered on its own (`line N: tenant/event outcome
channel=answer(state) ...`); exit status is 0 only when no line was rejected. Every change is
audited with --actor and --reason in its own transaction.";

const LOAD_HELP: &str = "\
Import reminders from a JSON Lines file, one reminder per line; `-` reads stdin.

Each line is one JSON object:
  {\"tenant\": \"clinic-a\", \"event_id\": \"appt-123\", \"subscriber_ref\": \"patient-42\",
   \"channels\": [\"sms\", \"email\"],
   \"scheduled_at\": \"2026-11-30T09:00:00Z\", \"expires_at\": \"2026-11-30T10:00:00Z\",
   \"destinations\": {\"sms\": \"+15550100\", \"email\": \"a@example.org\"},
   \"content\": {\"template\": \"appointment\"}}
Every listed channel needs a non-empty destination, and only listed channels may have one.
Timestamps are RFC 3339 with an offset; expires_at must be after scheduled_at. `content` is
optional (any JSON object); so is `revision` (the reminder's first revision, 0 when absent; a
reschedule must give a higher one). Unknown fields are an error. Blank lines are skipped.

A line with `series_id` instead of `event_id` is a recurring reminder, in the fields of
POST /v1/tenants/{tenant}/series (`time_zone`, `start_local`, `rrule`, `expires_after_s`, ...)
plus `tenant`: recorded when it is read, in its own transaction; its occurrences are created by
the producer's windows. It may start and end at most 400 days ahead; a rule is refused by its
kind, never quoted.

Each line is imported in its own transaction (the reminder and its encrypted destinations),
so a bad line writes nothing and the good lines still load. Re-posting an event id with the
same reminder counts as already present, so loading a file again is safe; re-using it for a
different reminder rejects the line. Reminders already due are created with their deliveries
and sent right away. A paused tenant's reminders are stored and materialise when it resumes.

Rejected lines go to stderr as `line N: reason`, naming the field, never a destination,
subscriber reference or content; a progress line follows every 1000 lines. At the end stdout
has `loaded N new, M already present, K rejected (of T lines)` (or JSON with --json). Exit
status is 0 only when no line was rejected. The load is recorded in the audit log.

Needs crypto.destination_key (NUDGE_CRYPTO__DESTINATION_KEY), the key the workers use, also
for --dry-run, so that a clean dry run means the load can run.";

#[derive(Debug, Subcommand)]
pub enum CategoryCommand {
    /// Create a category of a tenant (audited). Creating it again as it is changes nothing.
    Create {
        /// Tenant name.
        tenant: String,
        /// 1 to 64 of lower-case letters, digits, `_` and `-` (not `general`, which every
        /// tenant has).
        name: String,
        /// Subscribers cannot switch it off through the preferences API (a STOP still stops
        /// its SMS).
        #[arg(long)]
        required: bool,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
    /// A tenant's categories, `general` first.
    List {
        /// Tenant name.
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConsentCommand {
    /// Each of a subscriber's destinations as it stands (opted in or out, from where, since
    /// when) and their history, oldest first. Needs crypto.subscriber_key.
    Show {
        /// Tenant name.
        tenant: String,
        /// The client's reference of the subscriber.
        subscriber_ref: String,
    },
    /// The tenant's whole consent history as JSON Lines, oldest first; each destination as its
    /// keyed digest, never the destination.
    Export {
        /// Tenant name.
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Every event after a position (or from a time) up to the newest, then exit.
    Replay {
        /// Tenant name.
        #[arg(long)]
        tenant: String,
        /// A position (the cursor: events after it) or an RFC 3339 time (events from it on);
        /// the first kept when omitted.
        #[arg(long, value_name = "CURSOR|TIME", value_parser = events::parse_from)]
        from: Option<events::From>,
    },
    /// New events as they are numbered, until Ctrl-C, --for or --limit.
    Tail {
        /// Tenant name.
        #[arg(long)]
        tenant: String,
        /// Start after this position or from this RFC 3339 time instead of the newest.
        #[arg(long, value_name = "CURSOR|TIME", value_parser = events::parse_from)]
        from: Option<events::From>,
        /// Stop after this many seconds (1 to 86400).
        #[arg(long = "for", value_name = "SECONDS",
              value_parser = clap::value_parser!(u64).range(1..=86_400))]
        for_seconds: Option<u64>,
        /// Stop after this many events (1 to 1000000).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        limit: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SeriesCommand {
    /// A tenant's series, newest first.
    List {
        /// Tenant name.
        tenant: String,
        /// Show at most this many (1 to 10000).
        #[arg(long, default_value_t = 100,
              value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
    /// One series: its rule, zone and start, counts and its next occurrences.
    Show {
        /// Tenant name.
        tenant: String,
        /// The client's series id.
        series_id: String,
    },
    /// Cancel a series: no occurrence is created any more; those created and not sent are
    /// cancelled with their deliveries. Audited.
    Cancel {
        /// Tenant name.
        tenant: String,
        /// The client's series id.
        series_id: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ScheduleCommand {
    /// Set (replace) a tenant's schedule: a cron expression and a look-ahead window.
    #[command(
        long_about = "Set (replace) a tenant's schedule. At each tick of the cron expression \
            the producer materialises the tenant's reminders scheduled in the next window. The \
            expression is in the producer's dialect: 6 or 7 fields, seconds first, evaluated in \
            UTC, e.g. \"0 * * * * *\" (every minute) or \"0 0 7 * * Mon-Fri\"."
    )]
    Set {
        /// Tenant name.
        name: String,
        /// Cron expression, seconds first, e.g. "0 * * * * *".
        #[arg(long, value_name = "EXPR")]
        cron: CronExpr,
        /// How far ahead each tick looks, 1 to 604800 (7 days).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=604_800))]
        window_seconds: u32,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
    },
}

/// What the operator reads when a command failed: the whole chain, once, and first, when the
/// ledger is away or read-only (a failover or restart under way), that it is that and not the
/// command.
pub fn failure_message(e: &anyhow::Error) -> String {
    let chain = format!("error: {e:#}");
    if nudge_ledger::is_unavailable(e.as_ref()) {
        format!(
            "the ledger is away or read-only (PostgreSQL restarting, or a failover under way: \
             database.url must reach the primary); the command did not complete: run it again \
             once the ledger answers\n{chain}"
        )
    } else {
        chain
    }
}

/// Runs one command to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let config: CtlConfig = nudge_config::load(cli.config.as_deref(), CtlConfig::SECTIONS)
        .context("failed to load configuration")?;
    // Operator output is the table; logs only speak up for warnings unless asked.
    let _telemetry = nudge_telemetry::init("nudgectl", &config.telemetry)
        .context("failed to initialise logging")?;
    let ledger = Ledger::connect(&nudge_config::DatabaseConfig {
        // `reminders load` writes CHUNKS_IN_FLIGHT chunks at once, each on its own connection,
        // besides a tenant lookup.
        max_connections: u32::try_from(load::CHUNKS_IN_FLIGHT)
            .unwrap_or(u32::MAX)
            .saturating_add(2),
        ..config.database.clone()
    })
    .await
    .context("failed to connect to the database (database.url)")?;
    let subscriber_key = config.crypto.subscriber_key_bytes()?;
    let tenant_secret_key = config.crypto.tenant_secret_key_bytes()?;
    let cipher = match config.crypto.destination_key_bytes()? {
        Some(key) => {
            let mut cipher = DestinationCipher::new(&key);
            if let Some(subscriber) = subscriber_key {
                cipher = cipher.with_subscriber_key(nudge_ledger::SubscriberKey::new(&subscriber));
            }
            if let Some(secrets) = tenant_secret_key {
                cipher = cipher.with_tenant_secret_key(&secrets);
            }
            Some(cipher)
        }
        None if subscriber_key.is_some() => bail!(
            "crypto.subscriber_key is set without crypto.destination_key: writing or \
             converting subscriber references needs both"
        ),
        None if tenant_secret_key.is_some() => bail!(
            "crypto.tenant_secret_key is set without crypto.destination_key: signing secrets \
             sealed before the tenant secret key open only with the destination key"
        ),
        None => None,
    };
    let mut command = cli.command;
    if let Command::Retention(RetentionCommand::Plan { policy, .. }) = &mut command {
        *policy = Some(config.retention.policy()?);
    }
    // `status --json` keeps its stdout for the JSON: the warning goes to stderr there.
    let standby_check = match &command {
        Command::Status { json, .. } if config.nudgectl.require_synchronous_standby => Some(*json),
        _ => None,
    };
    let mut out = std::io::stdout().lock();
    // Unlocked: log lines may share stderr, and a load can take a while.
    let mut err = std::io::stderr();
    execute(
        &ledger,
        &cli.actor,
        cipher.as_ref(),
        command,
        &mut out,
        &mut err,
    )
    .await?;
    if let Some(json) = standby_check {
        let standby = replication::SynchronousStandby::read(ledger.pool())
            .await
            .context("failed to read the server's replication state")?;
        if let Some(warning) = standby.warning() {
            if json {
                writeln!(err, "{warning}")?;
            } else {
                writeln!(out, "\n{warning}")?;
            }
        }
    }
    Ok(())
}

/// Subscribers converted per transaction by `migrate`.
const CONVERSION_BATCH: u32 = 500;

/// After the schema: converts subscriber references still stored in plaintext (rows written
/// before the keyed hash), batch by batch, when both keys are configured; otherwise says how
/// many remain and what converts them.
async fn convert_subscribers(
    ledger: &Ledger,
    cipher: Option<&DestinationCipher>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let Some(cipher) = cipher.filter(|c| c.has_subscriber_key()) else {
        let remaining = ledger
            .plaintext_subscribers()
            .await
            .context("failed to count plaintext subscriber references")?;
        if remaining > 0 {
            writeln!(
                err,
                "{remaining} subscribers are still stored in plaintext: run `nudgectl migrate` \
                 again with crypto.destination_key and crypto.subscriber_key set to convert them"
            )?;
        }
        return Ok(());
    };
    let (mut subscribers, mut contacts, mut reminders) = (0, 0, 0);
    loop {
        let pass = ledger
            .convert_plaintext_subscribers(cipher, CONVERSION_BATCH)
            .await
            .with_context(|| {
                format!(
                    "failed to convert subscriber references after {subscribers} subscribers \
                     (running migrate again resumes)"
                )
            })?;
        if pass.subscribers == 0 {
            break;
        }
        subscribers += pass.subscribers;
        contacts += pass.contacts;
        reminders += pass.reminders;
    }
    if subscribers > 0 {
        writeln!(
            out,
            "subscriber references converted to their keyed hash: {subscribers} subscribers \
             ({contacts} contacts re-encrypted, {reminders} reminders)"
        )?;
    }
    Ok(())
}

/// After the schema: seals again under `crypto.tenant_secret_key` the signing and webhook
/// secrets still sealed with the destination key, when the tenant secret key is configured; otherwise says
/// how many remain and what seals them again.
async fn reseal_tenant_secrets(
    ledger: &Ledger,
    cipher: Option<&DestinationCipher>,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let Some(cipher) = cipher.filter(|c| c.has_tenant_secret_key()) else {
        let remaining = ledger
            .tenant_secrets_sealed_with_destination_key()
            .await
            .context("failed to count tenant secrets sealed with the destination key")?;
        if remaining > 0 {
            writeln!(
                err,
                "{remaining} tenant secrets (signing or webhook) are sealed with the destination \
                 key, which the workers hold: set crypto.tenant_secret_key (here, on the intake \
                 and on nudge-events) and run `nudgectl migrate` again to seal them under it"
            )?;
        }
        return Ok(());
    };
    let resealed = ledger
        .reseal_tenant_secrets(cipher)
        .await
        .context("failed to seal tenant secrets again (running migrate again resumes)")?;
    if resealed > 0 {
        writeln!(
            out,
            "tenant secrets (signing and webhook) sealed again under crypto.tenant_secret_key: \
             {resealed}"
        )?;
    }
    Ok(())
}

/// Executes a command against a ledger, writing operator output to `out` and per-item
/// problems and progress (the rejected lines of a load) to `err`.
///
/// `cipher` is built from `crypto.destination_key`; only `reminders load` needs it.
pub async fn execute(
    ledger: &Ledger,
    actor: &str,
    cipher: Option<&DestinationCipher>,
    command: Command,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            ledger
                .migrate()
                .await
                .context("failed to apply migrations")?;
            writeln!(out, "migrations applied")?;
            convert_subscribers(ledger, cipher, out, err).await?;
            reseal_tenant_secrets(ledger, cipher, out, err).await?;
        }
        Command::Tenant(TenantCommand::Create { name }) => {
            let tenant = ledger
                .create_tenant(&name, &operator(ledger, actor, None).await?)
                .await
                .context("failed to create tenant")?;
            writeln!(out, "{}", tenant.id)?;
        }
        Command::Tenant(TenantCommand::Pause {
            name,
            reason,
            incident,
            ack_timeout,
        }) => {
            set_paused(
                ledger,
                actor,
                &name,
                true,
                &reason,
                incident.as_deref(),
                out,
            )
            .await?;
            if !ack_timeout.is_zero() {
                operations::await_producers(ledger, ack_timeout, out).await?;
            }
        }
        Command::Tenant(TenantCommand::Resume {
            name,
            reason,
            incident,
        }) => {
            set_paused(
                ledger,
                actor,
                &name,
                false,
                &reason,
                incident.as_deref(),
                out,
            )
            .await?;
        }
        Command::Tenant(TenantCommand::Route {
            name,
            channel,
            account,
            default,
            reason,
        }) => {
            let account = match (account, default) {
                (Some(account), false) => Some(account),
                (None, true) => None,
                _ => bail!("give exactly one of ACCOUNT or --default"),
            };
            route(ledger, actor, &name, channel, account, &reason, out).await?;
        }
        Command::Tenant(TenantCommand::Set {
            name,
            weight,
            max_share,
            time_zone,
            clear_time_zone,
            quiet_hours_ignorable,
            reason,
        }) => {
            require_reason(&reason)?;
            let share = max_share
                .map(|s| {
                    nudge_domain::MaxShare::new(s)
                        .map_err(|e| anyhow::anyhow!("--max-share {s}: {e}"))
                })
                .transpose()?;
            let by = operator(ledger, actor, Some(&reason)).await?;
            let tenant = find_tenant(ledger, &name).await?;
            if clear_time_zone
                && !ledger
                    .tenant_quiet_hours(tenant.id)
                    .await
                    .context("failed to read the tenant's quiet hours")?
                    .is_empty()
            {
                bail!(
                    "tenant {name} has quiet hours, which are read in its zone for a subscriber \
                     without one: clear them first (nudgectl tenant quiet-hours clear)"
                );
            }
            if let Some(weight) = weight {
                let previous = ledger
                    .set_tenant_weight(tenant.id, weight, &by)
                    .await
                    .context("failed to set the tenant's weight")?
                    .with_context(|| format!("no tenant named {name}"))?;
                writeln!(out, "tenant {name}: weight {weight} (was {previous})")?;
            }
            if let Some(share) = share {
                let previous = ledger
                    .set_tenant_max_share(tenant.id, share, &by)
                    .await
                    .context("failed to set the tenant's maximum share")?
                    .with_context(|| format!("no tenant named {name}"))?;
                let shown = |s: Option<f64>| s.map_or_else(|| "none".to_owned(), |s| s.to_string());
                writeln!(
                    out,
                    "tenant {name}: max share {} (was {})",
                    shown(share.map(nudge_domain::MaxShare::get)),
                    shown(previous)
                )?;
            }
            if time_zone.is_some() || clear_time_zone {
                let previous = ledger
                    .set_tenant_time_zone(tenant.id, time_zone, &by)
                    .await
                    .context("failed to set the tenant's time zone")?
                    .with_context(|| format!("no tenant named {name}"))?;
                let shown = |zone: Option<Zone>| zone.map_or("none", |z| z.name());
                writeln!(
                    out,
                    "tenant {name}: time zone {} (was {}; tz database {TZDB_VERSION})",
                    shown(time_zone),
                    shown(previous),
                )?;
            }
            if let Some(ignorable) = quiet_hours_ignorable {
                let previous = ledger
                    .set_tenant_quiet_hours_ignorable(tenant.id, ignorable, &by)
                    .await
                    .context("failed to set whether reminders may ignore quiet hours")?
                    .with_context(|| format!("no tenant named {name}"))?;
                writeln!(
                    out,
                    "tenant {name}: reminders may ignore quiet hours: {ignorable} (was {previous})"
                )?;
            }
        }
        Command::Tenant(TenantCommand::QuietHours(command)) => {
            quiet_hours(ledger, actor, command, out).await?;
        }
        Command::Tenant(TenantCommand::Webhook(command)) => {
            webhook::run(ledger, cipher, actor, command, out, err).await?;
        }
        Command::Tenant(TenantCommand::Secret(SecretCommand::Rotate { name, reason })) => {
            let Some(cipher) = cipher else {
                bail!(
                    "tenant secret rotate needs crypto.destination_key \
                     (NUDGE_CRYPTO__DESTINATION_KEY): signing secrets are stored encrypted \
                     with the key the intake uses"
                );
            };
            let tenant = find_tenant(ledger, &name).await?;
            let secret = ledger
                .rotate_signing_secret(
                    tenant.id,
                    cipher,
                    &operator(ledger, actor, Some(&reason)).await?,
                )
                .await
                .context("failed to rotate the signing secret")?;
            writeln!(out, "{}", secret.expose())?;
            writeln!(
                err,
                "the new signing secret of tenant {name:?} is printed above, once: give it to \
                 the client; the previous one stays valid until `nudgectl tenant secret retire`"
            )?;
        }
        Command::Tenant(TenantCommand::Secret(SecretCommand::Retire { name, reason })) => {
            let tenant = find_tenant(ledger, &name).await?;
            let retired = ledger
                .retire_signing_secret(tenant.id, &operator(ledger, actor, Some(&reason)).await?)
                .await
                .context("failed to retire the signing secret")?;
            writeln!(
                out,
                "retired {retired} signing secret(s) of tenant {name:?}; the newest stays"
            )?;
        }
        Command::Reminders(RemindersCommand::Load {
            file,
            dry_run,
            json,
            reason,
        }) => {
            if reason.as_deref().is_some_and(|r| r.trim().is_empty()) {
                bail!("--reason, when given, must say why (it is recorded in the audit log)");
            }
            let Some(cipher) = cipher else {
                bail!(
                    "reminders load needs crypto.destination_key (NUDGE_CRYPTO__DESTINATION_KEY): \
                     destinations and content are stored encrypted with the key the workers use"
                );
            };
            if !cipher.has_subscriber_key() {
                bail!(
                    "reminders load needs crypto.subscriber_key (NUDGE_CRYPTO__SUBSCRIBER_KEY): \
                     subscriber references are stored as a keyed hash"
                );
            }
            let options = load::LoadOptions {
                dry_run,
                json,
                reason,
            };
            load::load(ledger, actor, cipher, &file, options, out, err).await?;
        }
        Command::Reminders(RemindersCommand::Reschedule {
            target,
            at,
            expires_at,
            revision,
        }) => {
            change_reminders(
                ledger,
                cipher,
                actor,
                change::Kind::Reschedule,
                target,
                (at, expires_at, revision),
                out,
            )
            .await?;
        }
        Command::Reminders(RemindersCommand::Cancel { target }) => {
            change_reminders(
                ledger,
                cipher,
                actor,
                change::Kind::Cancel,
                target,
                (None, None, None),
                out,
            )
            .await?;
        }
        Command::Consent(ConsentCommand::Show {
            tenant,
            subscriber_ref,
        }) => {
            let Some(cipher) = cipher.filter(|c| c.has_subscriber_key()) else {
                bail!(
                    "consent show needs crypto.destination_key and crypto.subscriber_key \
                     (NUDGE_CRYPTO__DESTINATION_KEY, NUDGE_CRYPTO__SUBSCRIBER_KEY): subscriber \
                     references are stored as a keyed hash"
                );
            };
            consent::show(ledger, cipher, &tenant, &subscriber_ref, out).await?;
        }
        Command::Consent(ConsentCommand::Export { tenant }) => {
            consent::export(ledger, &tenant, out).await?;
        }
        Command::Console(command) => {
            console::run(ledger, actor, command, out, err).await?;
        }
        Command::Events(EventsCommand::Replay { tenant, from }) => {
            events::replay(ledger, &tenant, from, out, err).await?;
        }
        Command::Events(EventsCommand::Tail {
            tenant,
            from,
            for_seconds,
            limit,
        }) => {
            events::tail(ledger, &tenant, from, for_seconds, limit, out, err).await?;
        }
        Command::Category(CategoryCommand::Create {
            tenant,
            name,
            required,
            reason,
        }) => {
            category::create(ledger, actor, &tenant, &name, required, &reason, out).await?;
        }
        Command::Category(CategoryCommand::List { tenant }) => {
            category::list(ledger, &tenant, out).await?;
        }
        Command::Series(SeriesCommand::List { tenant, limit }) => {
            series::list(ledger, &tenant, limit, out).await?;
        }
        Command::Series(SeriesCommand::Show { tenant, series_id }) => {
            series::show(ledger, &tenant, &series_id, out).await?;
        }
        Command::Series(SeriesCommand::Cancel {
            tenant,
            series_id,
            reason,
        }) => {
            series::cancel(ledger, actor, &tenant, &series_id, &reason, out).await?;
        }
        Command::Schedule(ScheduleCommand::Set {
            name,
            cron,
            window_seconds,
            reason,
        }) => {
            schedule::set(ledger, actor, &name, &cron, window_seconds, &reason, out).await?;
        }
        Command::Rate(RateCommand::Set {
            account,
            channel,
            per_second,
            burst,
            reason,
        }) => {
            rate::set(
                ledger, actor, &account, channel, per_second, burst, &reason, out,
            )
            .await?;
        }
        Command::Rate(RateCommand::Resume {
            account,
            channel,
            reason,
        }) => {
            rate::resume(ledger, actor, &account, channel, &reason, out).await?;
        }
        Command::Rate(RateCommand::List { json }) => {
            rate::list(ledger, json, out).await?;
        }
        Command::Status { json, tenants } => {
            let now = database_now(ledger).await?;
            let status = ledger.status(now).await.context("failed to read status")?;
            let view = status::TenantView::read(ledger, tenants, now).await?;
            if json {
                // The shape scripts rely on: an array of channels. Buckets: `rate list --json`.
                serde_json::to_writer_pretty(&mut *out, &status::json(&status, &view))?;
                writeln!(out)?;
            } else {
                let buckets = ledger
                    .rate_buckets()
                    .await
                    .context("failed to read the rate buckets")?;
                write_status_table(&status, out)?;
                writeln!(out)?;
                rate::write_bucket_table(&buckets, out)?;
                writeln!(out)?;
                status::write(&view, out)?;
                writeln!(
                    out,
                    "\ntime zones: IANA tz database {TZDB_VERSION}, built in (the host's \
                     zoneinfo and TZ are not read)"
                )?;
                for s in status.iter().filter(|s| s.draining) {
                    writeln!(
                        out,
                        "\n{} draining since {}{}; nothing new is scheduled for it. What remains:",
                        s.channel,
                        s.drain_started_at
                            .map_or_else(|| "-".to_owned(), rate::timestamp),
                        s.drain_incident
                            .as_deref()
                            .map_or_else(String::new, |i| format!(" (incident {i})")),
                    )?;
                    estimate::estimate_drain(
                        ledger,
                        Some(s.channel),
                        false,
                        database_now(ledger).await?,
                        out,
                    )
                    .await?;
                }
            }
        }
        Command::EstimateDrain { channel, json } => {
            estimate::estimate_drain(ledger, channel, json, database_now(ledger).await?, out)
                .await?;
        }
        Command::Drain(command) => operations::drain(ledger, actor, command, out).await?,
        Command::Owner(command) => operations::owner(ledger, actor, command, out).await?,
        Command::Rollback {
            channel,
            reason,
            incident,
            wait,
        } => {
            operations::rollback(
                ledger,
                actor,
                channel,
                &reason,
                incident.as_deref(),
                wait,
                out,
            )
            .await?;
        }
        Command::Export(ExportCommand::Attempts { incident, output }) => {
            let written = match output {
                Some(path) => {
                    let file = std::fs::File::create(&path)
                        .with_context(|| format!("failed to create {}", path.display()))?;
                    let mut file = std::io::BufWriter::new(file);
                    operations::export_attempts(ledger, &incident, &mut file).await?
                }
                None => operations::export_attempts(ledger, &incident, out).await?,
            };
            writeln!(err, "{written} attempts exported for incident {incident}")?;
        }
        Command::Redrive { args, action } => match action {
            Some(action) => redrive::command(ledger, actor, action, out).await?,
            None => redrive::plan_or_execute(ledger, actor, args, out).await?,
        },
        Command::Trace { id, json } => {
            trace::trace(ledger, &id, json, database_now(ledger).await?, out, err).await?;
        }
        Command::Dlq(DlqCommand::List { channel, json }) => {
            dlq::list(ledger, channel, json, database_now(ledger).await?, out).await?;
        }
        Command::Dlq(DlqCommand::Show { id, json }) => {
            dlq::show(ledger, id, json, database_now(ledger).await?, out, err).await?;
        }
        Command::Retention(RetentionCommand::Plan { json, policy }) => {
            retention::plan(ledger, policy, json, out).await?;
        }
        Command::Restore(command) => restore::command(ledger, actor, command, out).await?,
    }
    Ok(())
}

async fn set_paused(
    ledger: &Ledger,
    actor: &str,
    name: &str,
    paused: bool,
    reason: &str,
    incident: Option<&str>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    require_reason(reason)?;
    let by = operator(ledger, actor, Some(reason))
        .await?
        .with_incident(incident)
        .context("invalid --incident")?;
    let tenant = find_tenant(ledger, name).await?;
    if !ledger
        .set_intake_paused(tenant.id, paused, &by)
        .await
        .context("failed to set the intake pause")?
    {
        bail!("no tenant named {name:?}");
    }
    writeln!(
        out,
        "tenant {name}: intake {}",
        if paused { "paused" } else { "resumed" }
    )?;
    Ok(())
}

async fn route(
    ledger: &Ledger,
    actor: &str,
    name: &str,
    channel: Channel,
    account: Option<ProviderAccount>,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    require_reason(reason)?;
    let by = operator(ledger, actor, Some(reason)).await?;
    let tenant = find_tenant(ledger, name).await?;
    ledger
        .set_tenant_channel_account(tenant.id, channel, account.as_ref(), &by)
        .await
        .context("failed to set the route")?;
    match account {
        Some(account) => writeln!(out, "tenant {name}: {channel} routed to account {account}")?,
        None => writeln!(
            out,
            "tenant {name}: {channel} routed to the channel's default account"
        )?,
    }
    Ok(())
}

/// The database's clock: every time condition of a read (due, expired, ages) is the
/// database's, as for the processes; this machine's clock may be anything.
pub(crate) async fn database_now(ledger: &Ledger) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    ledger
        .clock(LedgerTime::Database)
        .await
        .context("failed to read the database's clock")
}

/// Who makes a change, and why, stamped with the database's clock (never this machine's: a
/// skewed or set-back clock would date the audit row, and the change's own timestamps, where
/// retention may delete them): the ledger writes the change's audit row from it in the
/// change's own transaction.
pub(crate) async fn operator(
    ledger: &Ledger,
    actor: &str,
    reason: Option<&str>,
) -> anyhow::Result<Operator> {
    let now = database_now(ledger).await?;
    Operator::new(actor, reason, now)
        .context("the change cannot be audited: --actor (NUDGE_ACTOR) must name who acts")
}

/// `reminders reschedule` and `reminders cancel`.
async fn change_reminders(
    ledger: &Ledger,
    cipher: Option<&DestinationCipher>,
    actor: &str,
    kind: change::Kind,
    target: ChangeTarget,
    (at, expires_at, revision): (Option<DateTime<Utc>>, Option<DateTime<Utc>>, Option<i64>),
    out: &mut impl Write,
) -> anyhow::Result<()> {
    require_reason(&target.reason)?;
    let Some(cipher) = cipher.filter(|c| c.has_subscriber_key()) else {
        bail!(
            "reminders reschedule and cancel need crypto.destination_key and \
             crypto.subscriber_key (NUDGE_CRYPTO__DESTINATION_KEY, NUDGE_CRYPTO__SUBSCRIBER_KEY)"
        );
    };
    let source = match (target.tenant, target.event, target.file) {
        (Some(tenant), Some(event_id), None) => change::Source::One {
            tenant,
            event_id,
            at,
            expires_at,
            revision,
        },
        (None, None, Some(file)) => change::Source::File(file),
        _ => bail!("give --tenant and --event, or --file"),
    };
    let by = operator(ledger, actor, Some(&target.reason)).await?;
    let options = change::Options {
        kind,
        execute: target.execute,
        json: target.json,
        by: &by,
    };
    change::run(ledger, cipher, source, &options, out).await
}

/// `nudgectl tenant quiet-hours set|clear|show`.
async fn quiet_hours(
    ledger: &Ledger,
    actor: &str,
    command: QuietHoursCommand,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let shown =
        |h: Option<nudge_domain::QuietHours>| h.map_or("none".to_owned(), |h| h.to_string());
    match command {
        QuietHoursCommand::Set {
            name,
            channel,
            from,
            to,
            reason,
        } => {
            require_reason(&reason)?;
            let hours = nudge_domain::QuietHours::parse(&from, &to)
                .map_err(|e| anyhow::anyhow!("--from {from} --to {to}: {e}"))?;
            let by = operator(ledger, actor, Some(&reason)).await?;
            let tenant = find_tenant(ledger, &name).await?;
            let previous = ledger
                .set_tenant_quiet_hours(tenant.id, channel, Some(hours), &by)
                .await
                .context("failed to set the tenant's quiet hours")?
                .with_context(|| format!("no tenant named {name}"))?;
            writeln!(
                out,
                "tenant {name}: quiet hours on {channel} {hours} in the subscriber's zone, else \
                 {} (was {})",
                tenant.time_zone.map_or("none", |z| z.name()),
                shown(previous)
            )?;
        }
        QuietHoursCommand::Clear {
            name,
            channel,
            reason,
        } => {
            require_reason(&reason)?;
            let by = operator(ledger, actor, Some(&reason)).await?;
            let tenant = find_tenant(ledger, &name).await?;
            let previous = ledger
                .set_tenant_quiet_hours(tenant.id, channel, None, &by)
                .await
                .context("failed to clear the tenant's quiet hours")?
                .with_context(|| format!("no tenant named {name}"))?;
            writeln!(
                out,
                "tenant {name}: no quiet hours on {channel} (was {})",
                shown(previous)
            )?;
        }
        QuietHoursCommand::Show { name } => {
            let tenant = find_tenant(ledger, &name).await?;
            let windows = ledger
                .tenant_quiet_hours(tenant.id)
                .await
                .context("failed to read the tenant's quiet hours")?;
            writeln!(
                out,
                "tenant {name}: zone {} (tz database {TZDB_VERSION}); reminders may ignore \
                 quiet hours: {}",
                tenant.time_zone.map_or("none", |z| z.name()),
                tenant.quiet_hours_ignorable
            )?;
            for channel in Channel::ALL {
                let hours = windows.iter().find(|(c, _)| *c == channel).map(|(_, h)| *h);
                writeln!(out, "  {:<6} {}", channel.as_str(), shown(hours))?;
            }
        }
    }
    Ok(())
}

/// A `--time-zone` value: an IANA name the built-in tz database knows.
fn parse_zone(name: &str) -> Result<Zone, nudge_domain::UnknownZone> {
    Zone::parse(name)
}

/// Every change names why; the reason goes to the audit log.
pub(crate) fn require_reason(reason: &str) -> anyhow::Result<()> {
    if reason.trim().is_empty() {
        bail!("--reason must say why (it is recorded in the audit log)");
    }
    Ok(())
}

pub(crate) async fn find_tenant(ledger: &Ledger, name: &str) -> anyhow::Result<Tenant> {
    ledger
        .tenant_by_name(name)
        .await
        .context("failed to look up the tenant")?
        .with_context(|| format!("no tenant named {name:?}"))
}

fn write_status_table(status: &[ChannelStatus], out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<7} {:>9} {:>7} {:>7} {:>7} {:>10} {:>11} {:>13} {:>9} {:>13} {:>10} {:>14}",
        "channel",
        "scheduled",
        "due",
        "queued",
        "sending",
        "retry_wait",
        "quiet_hours",
        "dead_lettered",
        "ambiguous",
        "expired_quiet",
        "suppressed",
        "oldest_due_s"
    )?;
    for s in status {
        writeln!(
            out,
            "{:<7} {:>9} {:>7} {:>7} {:>7} {:>10} {:>11} {:>13} {:>9} {:>13} {:>10} {:>14}",
            s.channel.as_str(),
            s.scheduled,
            s.due,
            s.queued,
            s.sending,
            s.retry_wait,
            s.quiet_hours,
            s.dead_lettered,
            s.ambiguous,
            s.expired_quiet_hours,
            s.suppressed,
            s.oldest_eligible_age_s
                .map_or_else(|| "-".to_owned(), |a| a.to_string()),
        )?;
    }
    Ok(())
}
