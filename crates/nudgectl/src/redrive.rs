//! `nudgectl redrive`: the dry run, the execute, and a redrive's status, pause, resume and
//! cancel. The ledger does the selection and the janitor the feeding (`nudge_ledger`'s
//! `redrive` module); this is the operator's view of it.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::Utc;
use clap::{Args, Subcommand};
use nudge_domain::{Channel, RedriveId};
use nudge_ledger::{
    Ledger, LedgerTime, RedriveFilter, RedrivePlan, RedriveState, RedriveStatus, StartedRedrive,
};

use crate::{find_tenant, operator, require_reason};

/// The window the default rate looks back over.
pub const OBSERVED_WINDOW: Duration = Duration::from_secs(300);

pub const REDRIVE_HELP: &str = "\
Send dead-lettered deliveries again, paced, without recreating the burst. A dry run unless \
--execute.

The dry run prints, per channel, the deliveries a redrive would take, by age band (age counts \
from the reminder's scheduled time), and those it leaves out with why: ambiguous (it may have \
been sent: never resent automatically), already waiting in an active redrive, expired, tenant \
paused, older than --max-age, would expire before its turn at the redrive's rate (the eligible \
go earliest deadline first, the k-th at now + (k - 1) / rate), over --limit. Then the most \
common stored reasons and the expected drain time (eligible / rate). Nothing changes.

--execute (needs --channel and --reason) selects the same way at that instant, records the \
redrive (filters, rate, counts, operator, --incident) and prints its id. Nothing is sent by \
nudgectl: the janitor feeds the items at the rate, each back to retry_wait in the redrive lane \
with its original id, idempotency key and attempt history (the next attempt is a new one; the \
retry policy's attempt limit counts from the redrive). Workers admit redrive traffic through \
the bucket's recovery share, behind the reserve for new work. One redrive per channel may be \
active.

The rate defaults to half the channel's observed successful sends per second over the last \
5 minutes; with none observed, give --rate. A --rate above the sum of the channel's bucket \
rates is refused (admission would not let it go faster).

A running redrive pauses itself, recording why, when a provider account of the channel \
answers more than janitor's redrive.max_throttled_ratio of its attempts with 429, or the \
channel's oldest due new delivery has waited longer than redrive.max_new_work_age_s. \
--canary N feeds N first and goes on only once all N settled without a 429, a 5xx or an \
unknown outcome; otherwise it pauses. `redrive resume ID` goes on (past a failed canary too).

Examples:
  nudgectl redrive --channel sms --max-age 6h
  nudgectl redrive --channel sms --max-age 6h --canary 20 --execute --reason \"provider back\" \\
      --incident INC-42 --follow
  nudgectl redrive status 7 --follow";

/// The dry run and execute's options.
#[derive(Debug, Args)]
pub struct RedriveArgs {
    /// Only this channel (push, email or sms); required with --execute.
    #[arg(long)]
    pub channel: Option<Channel>,
    /// Only this tenant (its name).
    #[arg(long, value_name = "NAME")]
    pub tenant: Option<String>,
    /// Leave out reminders scheduled longer ago than this, e.g. 90m, 6h, 2d.
    #[arg(long, value_name = "AGE", value_parser = humantime::parse_duration)]
    pub max_age: Option<Duration>,
    /// Take at most this many (earliest deadline first).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Sends per second for the redrive. Default: half the observed successful rate.
    #[arg(long, value_name = "PER_SECOND")]
    pub rate: Option<f64>,
    /// Feed N first; go on only if all N settle without a 429, 5xx or unknown outcome.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub canary: Option<u32>,
    /// Start it (otherwise a dry run).
    #[arg(long, requires = "reason", requires = "channel")]
    pub execute: bool,
    /// Why: recorded with the redrive and in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
    /// The incident this is part of: recorded on the redrive, its audit rows and attempts.
    #[arg(long, value_name = "ID")]
    pub incident: Option<String>,
    /// After --execute, show its progress until it finishes or pauses.
    #[arg(long, requires = "execute")]
    pub follow: bool,
    /// Print JSON instead of a report.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum RedriveCommand {
    /// One redrive's progress (or every recent one): state, fed, skipped, what the fed
    /// deliveries became, why it paused.
    Status {
        /// The redrive's id; without it, the most recent redrives.
        id: Option<RedriveId>,
        /// Show progress until it finishes, is cancelled or pauses.
        #[arg(long, requires = "id")]
        follow: bool,
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
    /// Pause a running redrive by hand (what it already fed carries on).
    Pause {
        id: RedriveId,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of.
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
    /// Resume a paused redrive at its rate (no catching up for the time paused).
    Resume {
        id: RedriveId,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of.
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
    /// Stop feeding: items not yet fed stay dead-lettered (redrivable later).
    Cancel {
        id: RedriveId,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of.
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
}

/// The dry run or the execute.
pub async fn plan_or_execute(
    ledger: &Ledger,
    actor: &str,
    args: RedriveArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    if args.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        bail!("--rate must be a number of sends per second above 0");
    }
    let tenant = match &args.tenant {
        Some(name) => Some(find_tenant(ledger, name).await?.id),
        None => None,
    };
    let channels = match args.channel {
        Some(channel) => vec![channel],
        None => Channel::ALL.to_vec(),
    };
    if !args.execute {
        let mut plans = Vec::new();
        for channel in channels {
            let rate = match rate_for(ledger, channel, args.rate).await {
                Ok(rate) => rate,
                Err(e) if args.channel.is_none() => {
                    plans.push(PlanOrWhy::NoRate {
                        channel,
                        why: format!("{e:#}"),
                    });
                    continue;
                }
                Err(e) => return Err(e),
            };
            let filter = RedriveFilter {
                channel,
                tenant,
                max_age: args.max_age,
                limit: args.limit,
            };
            let plan = ledger
                .plan_redrive(&filter, rate.per_second, LedgerTime::Database)
                .await
                .context("failed to plan the redrive")?;
            plans.push(PlanOrWhy::Plan { plan, rate });
        }
        return write_plans(&plans, args.json, out);
    }

    let channel = args
        .channel
        .context("--execute needs --channel: a redrive runs at one channel's rate")?;
    let reason = args.reason.as_deref().unwrap_or_default();
    require_reason(reason)?;
    let rate = rate_for(ledger, channel, args.rate).await?;
    let by = operator(ledger, actor, Some(reason))
        .await?
        .with_incident(args.incident.as_deref())
        .context("invalid --incident")?;
    let filter = RedriveFilter {
        channel,
        tenant,
        max_age: args.max_age,
        limit: args.limit,
    };
    let StartedRedrive { id, plan } = ledger
        .execute_redrive(
            &filter,
            rate.per_second,
            args.canary,
            &by,
            LedgerTime::Database,
        )
        .await
        .context("failed to start the redrive")?;
    if args.json {
        serde_json::to_writer_pretty(
            &mut *out,
            &serde_json::json!({"id": id, "plan": plan, "rate_source": rate.source}),
        )?;
        writeln!(out)?;
    } else {
        write_plan(&plan, &rate, out)?;
        writeln!(
            out,
            "redrive {id} started: {} deliveries at {}/s; the janitor feeds them \
             (`nudgectl redrive status {id}`)",
            plan.eligible,
            fmt_rate(rate.per_second)
        )?;
    }
    if args.follow {
        follow(ledger, id, out).await?;
    }
    Ok(())
}

/// The rate chosen, and where it came from.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChosenRate {
    pub per_second: f64,
    pub source: String,
}

async fn rate_for(
    ledger: &Ledger,
    channel: Channel,
    given: Option<f64>,
) -> anyhow::Result<ChosenRate> {
    let buckets = ledger
        .rate_buckets()
        .await
        .context("failed to read the rate buckets")?;
    let ceiling: Option<f64> = {
        let of_channel: Vec<f64> = buckets
            .iter()
            .filter(|b| b.channel == channel)
            .map(|b| b.rate_per_second)
            .collect();
        (!of_channel.is_empty()).then(|| of_channel.iter().sum())
    };
    if let Some(rate) = given {
        if let Some(ceiling) = ceiling.filter(|c| rate > *c) {
            bail!(
                "--rate {rate} is above {channel}'s bucket rates ({}/s in all): admission \
                 would not let the redrive go faster",
                fmt_rate(ceiling)
            );
        }
        return Ok(ChosenRate {
            per_second: rate,
            source: "given".to_owned(),
        });
    }
    let observed = ledger
        .observed_success_rate(channel, OBSERVED_WINDOW, LedgerTime::Database)
        .await
        .context("failed to read the observed rate")?;
    if observed <= 0.0 {
        bail!(
            "no successful {channel} sends in the last {} s to take half of: give --rate",
            OBSERVED_WINDOW.as_secs()
        );
    }
    Ok(ChosenRate {
        per_second: observed / 2.0,
        source: format!(
            "half the observed {}/s successful rate over the last {} s",
            fmt_rate(observed),
            OBSERVED_WINDOW.as_secs()
        ),
    })
}

enum PlanOrWhy {
    Plan { plan: RedrivePlan, rate: ChosenRate },
    NoRate { channel: Channel, why: String },
}

fn write_plans(plans: &[PlanOrWhy], json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    if json {
        let doc: Vec<serde_json::Value> = plans
            .iter()
            .map(|p| match p {
                PlanOrWhy::Plan { plan, rate } => {
                    serde_json::json!({"plan": plan, "rate_source": rate.source})
                }
                PlanOrWhy::NoRate { channel, why } => {
                    serde_json::json!({"channel": channel, "no_rate": why})
                }
            })
            .collect();
        serde_json::to_writer_pretty(
            &mut *out,
            &serde_json::json!({"dry_run": true, "channels": doc}),
        )?;
        writeln!(out)?;
        return Ok(());
    }
    for p in plans {
        match p {
            PlanOrWhy::Plan { plan, rate } => write_plan(plan, rate, out)?,
            PlanOrWhy::NoRate { channel, why } => writeln!(out, "{channel}: {why}")?,
        }
        writeln!(out)?;
    }
    writeln!(
        out,
        "dry run: nothing changed; add --channel C --execute --reason \"...\" to start one"
    )?;
    Ok(())
}

fn write_plan(plan: &RedrivePlan, rate: &ChosenRate, out: &mut impl Write) -> anyhow::Result<()> {
    writeln!(
        out,
        "{}: redrive at {}/s ({})",
        plan.channel,
        fmt_rate(rate.per_second),
        rate.source
    )?;
    let bands: Vec<String> = plan
        .eligible_by_age
        .iter()
        .map(|(band, n)| format!("{band} {n}"))
        .collect();
    writeln!(
        out,
        "  eligible: {}{}",
        plan.eligible,
        if bands.is_empty() {
            String::new()
        } else {
            format!(" (by age: {})", bands.join(", "))
        }
    )?;
    let excluded: Vec<String> = plan
        .excluded
        .iter()
        .map(|(why, n)| format!("{} {n}", why.as_str()))
        .collect();
    writeln!(
        out,
        "  excluded: {}",
        if excluded.is_empty() {
            "none".to_owned()
        } else {
            excluded.join(", ")
        }
    )?;
    for r in &plan.reasons {
        writeln!(out, "  reason: {:>7}  {}", r.count, r.reason)?;
    }
    writeln!(
        out,
        "  expected drain: {}",
        fmt_duration(plan.expected_drain_s)
    )?;
    Ok(())
}

/// `redrive status|pause|resume|cancel`.
pub async fn command(
    ledger: &Ledger,
    actor: &str,
    command: RedriveCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    match command {
        RedriveCommand::Status {
            id: Some(id),
            follow: true,
            ..
        } => follow(ledger, id, out).await,
        RedriveCommand::Status {
            id: Some(id), json, ..
        } => {
            let status = ledger
                .redrive_status(id)
                .await
                .context("failed to read the redrive")?
                .with_context(|| format!("no redrive with id {id}"))?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &status)?;
                writeln!(out)?;
            } else {
                write_status(&status, out)?;
            }
            Ok(())
        }
        RedriveCommand::Status { id: None, json, .. } => {
            let all = ledger
                .redrives(20)
                .await
                .context("failed to read the redrives")?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &all)?;
                writeln!(out)?;
            } else if all.is_empty() {
                writeln!(out, "no redrives yet")?;
            } else {
                for status in &all {
                    write_status(status, out)?;
                }
            }
            Ok(())
        }
        RedriveCommand::Pause {
            id,
            reason,
            incident,
        } => change(ledger, actor, id, &reason, incident, Change::Pause, out).await,
        RedriveCommand::Resume {
            id,
            reason,
            incident,
        } => change(ledger, actor, id, &reason, incident, Change::Resume, out).await,
        RedriveCommand::Cancel {
            id,
            reason,
            incident,
        } => change(ledger, actor, id, &reason, incident, Change::Cancel, out).await,
    }
}

#[derive(Clone, Copy)]
enum Change {
    Pause,
    Resume,
    Cancel,
}

async fn change(
    ledger: &Ledger,
    actor: &str,
    id: RedriveId,
    reason: &str,
    incident: Option<String>,
    change: Change,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    require_reason(reason)?;
    let by = operator(ledger, actor, Some(reason))
        .await?
        .with_incident(incident.as_deref())
        .context("invalid --incident")?;
    let (done, verb) = match change {
        Change::Pause => (
            ledger.pause_redrive(id, &by, LedgerTime::Database).await,
            "paused",
        ),
        Change::Resume => (
            ledger.resume_redrive(id, &by, LedgerTime::Database).await,
            "resumed",
        ),
        Change::Cancel => (
            ledger.cancel_redrive(id, &by, LedgerTime::Database).await,
            "cancelled",
        ),
    };
    done.with_context(|| format!("failed to change redrive {id}"))?;
    writeln!(out, "redrive {id} {verb}")?;
    Ok(())
}

fn write_status(s: &RedriveStatus, out: &mut impl Write) -> anyhow::Result<()> {
    writeln!(
        out,
        "redrive {} ({}) {}: {} of {} fed, {} skipped, {}/s{}",
        s.id,
        s.channel,
        s.state.as_str(),
        s.fed,
        s.selected,
        s.skipped,
        fmt_rate(s.rate_per_second),
        if s.state.is_active() {
            format!(", about {} left to feed", fmt_duration(s.remaining_s))
        } else {
            String::new()
        }
    )?;
    writeln!(
        out,
        "  by {} at {}: {}{}",
        s.actor,
        crate::rate::timestamp(s.created_at),
        s.reason,
        s.incident
            .as_deref()
            .map_or_else(String::new, |i| format!(" (incident {i})"))
    )?;
    if let Some(canary) = s.canary {
        writeln!(
            out,
            "  canary: {canary}, {}",
            s.canary_passed_at.map_or_else(
                || "not passed yet".to_owned(),
                |t| format!("passed at {}", crate::rate::timestamp(t))
            )
        )?;
    }
    if let Some(why) = &s.pause_reason {
        writeln!(out, "  paused: {why}")?;
    }
    if !s.fed_by_state.is_empty() {
        let states: Vec<String> = s
            .fed_by_state
            .iter()
            .map(|(state, n)| format!("{state} {n}"))
            .collect();
        writeln!(out, "  fed now: {}", states.join(", "))?;
    }
    if !s.skipped_by_reason.is_empty() {
        let skipped: Vec<String> = s
            .skipped_by_reason
            .iter()
            .map(|(why, n)| format!("{why} {n}"))
            .collect();
        writeln!(out, "  skipped: {}", skipped.join(", "))?;
    }
    Ok(())
}

/// How often `--follow` reads the redrive again.
const FOLLOW_EVERY: Duration = Duration::from_secs(2);

/// Prints a progress line every two seconds until the redrive is finished or cancelled with
/// nothing it fed still in flight, or pauses (then says why).
async fn follow(ledger: &Ledger, id: RedriveId, out: &mut impl Write) -> anyhow::Result<()> {
    loop {
        let s = ledger
            .redrive_status(id)
            .await
            .context("failed to read the redrive")?
            .with_context(|| format!("no redrive with id {id}"))?;
        let in_flight: u64 = ["retry_wait", "queued", "sending"]
            .iter()
            .filter_map(|state| s.fed_by_state.get(*state))
            .sum();
        let delivered = s.fed_by_state.get("delivered").copied().unwrap_or(0);
        writeln!(
            out,
            "{} {} {}/{} fed, {} skipped, {} delivered, {} in flight ({})",
            Utc::now().format("%H:%M:%S"),
            progress_bar(s.fed + s.skipped, s.selected, 30),
            s.fed,
            s.selected,
            s.skipped,
            delivered,
            in_flight,
            s.state.as_str()
        )?;
        out.flush()?;
        match s.state {
            RedriveState::Paused => {
                writeln!(
                    out,
                    "redrive {id} paused: {}; `nudgectl redrive resume {id} --reason ...` goes on",
                    s.pause_reason.as_deref().unwrap_or("no reason recorded")
                )?;
                return Ok(());
            }
            RedriveState::Finished | RedriveState::Cancelled if in_flight == 0 => {
                writeln!(out, "redrive {id} {}", s.state.as_str())?;
                write_status(&s, out)?;
                return Ok(());
            }
            _ => {}
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

fn progress_bar(done: u64, total: u64, width: usize) -> String {
    let filled = (done.min(total) * width as u64)
        .checked_div(total)
        .map_or(width, |f| usize::try_from(f).unwrap_or(width));
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

fn fmt_rate(rate: f64) -> String {
    let s = format!("{rate:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn fmt_duration(seconds: f64) -> String {
    let secs = seconds.max(0.0).ceil() as u64;
    if secs < 60 {
        format!("{secs} s")
    } else {
        format!(
            "{secs} s ({})",
            humantime::format_duration(Duration::from_secs(secs))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fills_with_progress() {
        assert_eq!(progress_bar(0, 10, 10), "[----------]");
        assert_eq!(progress_bar(5, 10, 10), "[#####-----]");
        assert_eq!(progress_bar(10, 10, 10), "[##########]");
        assert_eq!(progress_bar(0, 0, 4), "[####]");
    }

    #[test]
    fn rates_and_durations_read_plainly() {
        assert_eq!(fmt_rate(20.0), "20");
        assert_eq!(fmt_rate(0.125), "0.125");
        assert_eq!(fmt_duration(12.2), "13 s");
        assert_eq!(fmt_duration(3_700.0), "3700 s (1h 1m 40s)");
    }
}
