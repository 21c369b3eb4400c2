//! Incident operations per channel: drain mode, ownership, rollback, and the incident export.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Subcommand;
use nudge_domain::Channel;
use nudge_ledger::{Ledger, LedgerTime};

use crate::{operator, require_reason};

pub const DRAIN_HELP: &str = "\
Drain a channel: finish the work already owed, schedule nothing new.

While a channel drains, reminders keep being recorded (intake and bulk loads answer as usual) \
but no delivery is created for the channel: the producer's windows and the intake withhold \
them. Its redrive lane is closed (a running redrive waits). Workers go on sending what is \
already owed, at the rate their buckets admit, and every attempt made meanwhile carries the \
drain's --incident. `nudgectl status` shows the drain, what remains and the (B + N) / R \
estimate.

`drain off` ends the drain, then creates the withheld deliveries whose time has come or whose \
window already ran (later ones follow with their windows); if that second step fails, running \
`drain off` again finishes it. Both are audited.";

#[derive(Debug, Subcommand)]
pub enum DrainCommand {
    /// Start draining a channel: nothing new is scheduled for it; owed work finishes.
    On {
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this drain is part of: its attempts carry it.
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
    /// End a drain: the withheld work is scheduled now.
    Off {
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
}

pub const OWNER_HELP: &str = "\
Hand a channel's work to another sender, for teams moving to or from nudge.

Every delivery has an owner (`nudge` unless handed over). nudge's relay publishes and its \
workers lease only the deliveries of their configured owner (producer.owner, worker.owner). \
`owner set` moves the channel's owed work that no worker is sending (scheduled, queued, \
waiting to retry) and the channel's new work to the new owner, and remembers the owner it \
replaced (where `rollback` returns the work). Sends in flight finish with the worker that \
holds them; running `owner set` again with the same owner moves those that came back owed. \
Nothing is deleted and no counter is reset. Audited.";

#[derive(Debug, Subcommand)]
pub enum OwnerCommand {
    /// Hand a channel's owed and new work to NAME.
    #[command(long_about = OWNER_HELP)]
    Set {
        /// push, email or sms.
        #[arg(long)]
        channel: Channel,
        /// The new owner: 1 to 64 of [a-z0-9_-].
        #[arg(long, value_name = "NAME")]
        to: String,
        /// Why: recorded in the audit log.
        #[arg(long)]
        reason: String,
        /// The incident this is part of (audit log).
        #[arg(long, value_name = "ID")]
        incident: Option<String>,
    },
    /// Every channel's owner, previous owner and drain state.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub const ROLLBACK_HELP: &str = "\
Give a channel back to the sender it came from, safely: every rate bucket of the channel is set \
to 0 (no new sends: audited per bucket, the old rates are in the audit rows; not when the \
channel goes back to this sender itself), the channel's owed \
work and new work go back to its previous owner (no new leases by nudge), then it waits, up to \
--wait, for the sends in flight to finish or their leases to expire, and hands back what they \
left owed. Nothing is deleted and no counter reset. Exits non-zero, saying what is left, if \
sends are still in flight after --wait.";

pub const EXPORT_HELP: &str = "\
Write every attempt made under an incident (a redrive's or a drain's --incident) as JSON \
Lines, in order: ids (attempt, delivery, reminder, tenant), channel, lane, attempt number, \
times, outcome class, HTTP status, Retry-After seen and whether valid, delay chosen, next \
state and time, reason code, provider account and message id, worker, correlation id. Never a \
destination, content or subscriber reference. Read in pages of 1000, so memory stays flat \
whatever the incident's size; a summary line goes to stderr.";

/// `drain on|off`.
pub async fn drain(
    ledger: &Ledger,
    actor: &str,
    command: DrainCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let (channel, on, reason, incident) = match command {
        DrainCommand::On {
            channel,
            reason,
            incident,
        } => (channel, true, reason, incident),
        DrainCommand::Off {
            channel,
            reason,
            incident,
        } => (channel, false, reason, incident),
    };
    require_reason(&reason)?;
    let by = operator(ledger, actor, Some(&reason))
        .await?
        .with_incident(incident.as_deref())
        .context("invalid --incident")?;
    let change = ledger
        .set_draining(channel, on, &by, LedgerTime::Database)
        .await
        .context("failed to change the drain")?;
    match (on, change.changed) {
        (true, true) => writeln!(
            out,
            "{channel}: draining; nothing new is scheduled for it, owed work finishes \
             (`nudgectl status` shows what remains)"
        )?,
        (true, false) => writeln!(out, "{channel}: already draining; nothing changed")?,
        (false, true) => writeln!(
            out,
            "{channel}: drain ended; {} withheld deliveries scheduled now",
            change.released
        )?,
        (false, false) => writeln!(
            out,
            "{channel}: not draining; {} withheld deliveries scheduled now",
            change.released
        )?,
    }
    Ok(())
}

/// `owner set|list`.
pub async fn owner(
    ledger: &Ledger,
    actor: &str,
    command: OwnerCommand,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    match command {
        OwnerCommand::Set {
            channel,
            to,
            reason,
            incident,
        } => {
            require_reason(&reason)?;
            let by = operator(ledger, actor, Some(&reason))
                .await?
                .with_incident(incident.as_deref())
                .context("invalid --incident")?;
            let change = ledger
                .set_channel_owner(channel, &to, &by)
                .await
                .context("failed to change the owner")?;
            writeln!(
                out,
                "{channel}: owner {} -> {to}; {} owed deliveries moved{}",
                change.previous,
                change.moved,
                if change.in_flight > 0 {
                    format!(
                        ", {} being sent by {} finish first (run this again to move any that \
                         come back owed)",
                        change.in_flight, change.previous
                    )
                } else {
                    String::new()
                }
            )?;
        }
        OwnerCommand::List { json } => {
            let controls = ledger
                .channel_controls()
                .await
                .context("failed to read the channel controls")?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &controls)?;
                writeln!(out)?;
            } else {
                writeln!(
                    out,
                    "{:<7} {:<16} {:<16} {:<9} {:<14} changed",
                    "channel", "owner", "previous", "draining", "incident"
                )?;
                for c in &controls {
                    writeln!(
                        out,
                        "{:<7} {:<16} {:<16} {:<9} {:<14} {} by {}{}",
                        c.channel.as_str(),
                        c.owner,
                        c.previous_owner.as_deref().unwrap_or("-"),
                        if c.draining { "yes" } else { "no" },
                        c.drain_incident.as_deref().unwrap_or("-"),
                        crate::rate::timestamp(c.changed_at),
                        c.changed_by,
                        c.change_reason
                            .as_deref()
                            .map_or_else(String::new, |r| format!(": {r}"))
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// How often rollback looks at the sends in flight.
const ROLLBACK_POLL: Duration = Duration::from_secs(1);

/// `rollback --channel C`.
pub async fn rollback(
    ledger: &Ledger,
    actor: &str,
    channel: Channel,
    reason: &str,
    incident: Option<&str>,
    wait: Duration,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    require_reason(reason)?;
    let by = operator(ledger, actor, Some(reason))
        .await?
        .with_incident(incident)
        .context("invalid --incident")?;
    let controls = ledger
        .channel_controls()
        .await
        .context("failed to read the channel controls")?;
    let control = controls
        .iter()
        .find(|c| c.channel == channel)
        .context("the channel has no control row (migrations not applied?)")?;
    let Some(back_to) = control.previous_owner.clone() else {
        bail!(
            "{channel} has had no other owner than {} to roll back to; to stop sending only, \
             use `nudgectl rate set ACCOUNT {channel} 0 --reason ...`",
            control.owner
        );
    };
    if back_to == control.owner {
        bail!("{channel} is already owned by {back_to}");
    }

    // 1. No new sends by the sender giving the work back. Rolling back *to* this sender
    //    (nudge taking a channel back) must not stop its own buckets.
    if back_to == ledger.sender() {
        writeln!(
            out,
            "{channel}: handing back to {back_to}, this sender: its rate buckets are left as they are"
        )?;
        let stopped: Vec<String> = ledger
            .rate_buckets()
            .await
            .context("failed to read the rate buckets")?
            .iter()
            .filter(|b| b.channel == channel && b.rate_per_second == 0.0)
            .map(|b| b.account.to_string())
            .collect();
        if !stopped.is_empty() {
            writeln!(
                out,
                "{channel}: at rate 0, so sending nothing yet: {} (an earlier rollback's rates \
                 are in the audit log; `nudgectl rate set ACCOUNT {channel} R --reason ...`)",
                stopped.join(", ")
            )?;
        }
    } else {
        let buckets = ledger
            .rate_buckets()
            .await
            .context("failed to read the rate buckets")?;
        let mut stopped = 0;
        for bucket in buckets.iter().filter(|b| b.channel == channel) {
            ledger
                .set_rate(&bucket.account, channel, 0.0, None, &by)
                .await
                .with_context(|| format!("failed to set {}'s rate to 0", bucket.account))?;
            stopped += 1;
        }
        writeln!(
            out,
            "{channel}: {stopped} rate buckets set to 0 (their rates before are in the audit log)"
        )?;
    }
    // 2. No new leases: the owed work goes back.
    let change = ledger
        .set_channel_owner(channel, &back_to, &by)
        .await
        .context("failed to hand the work back")?;
    writeln!(
        out,
        "{channel}: owner {} -> {back_to}; {} owed deliveries handed back",
        change.previous, change.moved
    )?;
    // 3. The sends in flight finish, or their leases expire and are reaped.
    let started = Instant::now();
    loop {
        let sending = ledger
            .sending(channel)
            .await
            .context("failed to count the sends in flight")?;
        if sending == 0 {
            break;
        }
        if started.elapsed() >= wait {
            let swept = ledger
                .set_channel_owner(channel, &back_to, &by)
                .await
                .context("failed to hand back what came back owed")?;
            bail!(
                "{sending} {channel} sends still in flight after {} s ({} more handed back); \
                 run `nudgectl owner set --channel {channel} --to {back_to} --reason ...` once \
                 they finish or their leases expire",
                wait.as_secs(),
                swept.moved
            );
        }
        writeln!(out, "{channel}: waiting for {sending} sends in flight")?;
        tokio::time::sleep(ROLLBACK_POLL).await;
    }
    // 4. What those sends left owed goes back too.
    let swept = ledger
        .set_channel_owner(channel, &back_to, &by)
        .await
        .context("failed to hand back what came back owed")?;
    writeln!(
        out,
        "{channel}: rolled back to {back_to}: nothing in flight, {} more handed back",
        swept.moved
    )?;
    Ok(())
}

/// Attempts per page of the export.
const EXPORT_PAGE: u32 = 1_000;

/// `export attempts --incident ID`: JSON Lines to `out`; returns how many.
pub async fn export_attempts(
    ledger: &Ledger,
    incident: &str,
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let mut after = 0;
    let mut written = 0;
    loop {
        let page = ledger
            .incident_attempts(incident, after, EXPORT_PAGE)
            .await
            .context("failed to read the incident's attempts")?;
        for attempt in &page {
            serde_json::to_writer(&mut *out, attempt)?;
            writeln!(out)?;
            written += 1;
        }
        match page.last() {
            Some(last) if page.len() == EXPORT_PAGE as usize => after = last.id,
            _ => break,
        }
    }
    out.flush()?;
    Ok(written)
}

/// How long `tenant pause` waits for every producer to acknowledge, and which producers count
/// as running (acknowledged a pass this recently).
pub const PRODUCER_ALIVE: Duration = Duration::from_secs(30);

/// After a flag changed: waits, up to `wait`, until every producer that ran recently has
/// started a schedule pass after the change (so it honours the flag). Says what it saw.
pub async fn await_producers(
    ledger: &Ledger,
    wait: Duration,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let changed_at = ledger
        .clock(LedgerTime::Database)
        .await
        .context("failed to read the database's clock")?;
    let alive_since =
        changed_at - chrono::Duration::from_std(PRODUCER_ALIVE).unwrap_or(chrono::Duration::zero());
    let started = Instant::now();
    loop {
        let acks = ledger
            .producer_acks(alive_since)
            .await
            .context("failed to read the producers' acknowledgements")?;
        if acks.is_empty() {
            writeln!(
                out,
                "no producer has run in the last {} s: the change applies when one starts",
                PRODUCER_ALIVE.as_secs()
            )?;
            return Ok(());
        }
        let behind: Vec<&str> = acks
            .iter()
            .filter(|ack| ack.pass_started_at < changed_at)
            .map(|ack| ack.instance.as_str())
            .collect();
        if behind.is_empty() {
            writeln!(
                out,
                "acknowledged by {} producer(s) within {} ms",
                acks.len(),
                started.elapsed().as_millis()
            )?;
            return Ok(());
        }
        if started.elapsed() >= wait {
            writeln!(
                out,
                "not yet acknowledged after {} s by: {} (the flag is recorded; a producer \
                 honours it at its next schedule pass)",
                wait.as_secs(),
                behind.join(", ")
            )?;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
