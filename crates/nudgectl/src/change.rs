//! `reminders reschedule` and `reminders cancel`: an operator moves or cancels reminders by
//! event id, or from a file (JSON Lines, one event a line, the limits of `reminders load`),
//! with an answer per line and per channel: the intake's rules and answers
//! (`nudge_domain::change`, docs/decisions/0309-reschedule-and-truthful-cancel.md).
//!
//! A dry run unless `--execute`: each line is checked and its reminder looked up, nothing is
//! written. Executed, each line is one ledger transaction with its audit row (actor, reason).
//!
//! Must never: print a destination, subscriber reference or content; act without a reason.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::{CancelChange, Channel, ChannelChange, EventId, Revision};
use nudge_ledger::input::{ReminderInput, TenantField};
use nudge_ledger::{
    DestinationCipher, Ledger, LedgerTime, Operator, ReplacedBy, Replacement, RescheduleOutcome,
};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncBufRead, BufReader};

use crate::load::{Line, MAX_LINE_BYTES, read_line};

/// What to change: one event named on the command line, or the lines of a file.
#[derive(Debug)]
pub(crate) enum Source {
    One {
        tenant: String,
        event_id: String,
        /// Reschedule only: the new time, the new expiry (else the same length after the new
        /// time) and the revision (else the current + 1).
        at: Option<DateTime<Utc>>,
        expires_at: Option<DateTime<Utc>>,
        revision: Option<i64>,
    },
    File(std::path::PathBuf),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Reschedule,
    Cancel,
}

/// One line's answer, as printed (and as `--json` lists them).
#[derive(Debug, Serialize)]
struct LineAnswer {
    line: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    event_id: Option<String>,
    /// `rescheduled`, `unchanged`, `cancelled`, `would_reschedule`, `would_cancel` or
    /// `rejected`.
    outcome: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    channels: Vec<ChannelAnswer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

#[derive(Debug, Serialize)]
struct ChannelAnswer {
    channel: &'static str,
    answer: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    state: Option<String>,
}

impl LineAnswer {
    fn rejected(line: u64, detail: impl Into<String>) -> Self {
        Self {
            line,
            tenant: None,
            event_id: None,
            outcome: "rejected".to_owned(),
            channels: Vec::new(),
            detail: Some(detail.into()),
        }
    }

    fn text(&self) -> String {
        let mut text = format!("line {}:", self.line);
        if let (Some(tenant), Some(event)) = (&self.tenant, &self.event_id) {
            text.push_str(&format!(" {tenant}/{event}"));
        }
        text.push_str(&format!(" {}", self.outcome));
        for c in &self.channels {
            text.push_str(&format!(" {}={}", c.channel, c.answer));
            if let Some(state) = &c.state {
                text.push_str(&format!("({state})"));
            }
        }
        if let Some(detail) = &self.detail {
            text.push_str(&format!(": {detail}"));
        }
        text
    }
}

pub(crate) struct Options<'a> {
    pub kind: Kind,
    pub execute: bool,
    pub json: bool,
    pub by: &'a Operator,
}

/// Runs a reschedule or a cancel over `source`; fails (exit non-zero) when a line was rejected.
pub(crate) async fn run(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    source: Source,
    options: &Options<'_>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut answers = Vec::new();
    match source {
        Source::One {
            tenant,
            event_id,
            at,
            expires_at,
            revision,
        } => {
            let answer = match options.kind {
                Kind::Cancel => cancel_one(ledger, 1, &tenant, &event_id, options).await?,
                Kind::Reschedule => {
                    let Some(at) = at else {
                        anyhow::bail!("reminders reschedule --event needs --at (the new time)");
                    };
                    let revision = revision
                        .map(Revision::new)
                        .transpose()
                        .context("--revision must be 0 or more")?;
                    move_one(
                        ledger, cipher, &tenant, &event_id, at, expires_at, revision, options,
                    )
                    .await?
                }
            };
            answers.push(answer);
        }
        Source::File(path) => {
            let input: Box<dyn AsyncBufRead + Unpin + Send> = if path == Path::new("-") {
                Box::new(BufReader::new(tokio::io::stdin()))
            } else {
                Box::new(BufReader::new(
                    tokio::fs::File::open(&path)
                        .await
                        .with_context(|| format!("failed to open {}", path.display()))?,
                ))
            };
            file(ledger, cipher, input, options, &mut answers).await?;
        }
    }
    let rejected = answers.iter().filter(|a| a.outcome == "rejected").count();
    if options.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&answers)?)?;
    } else {
        for answer in &answers {
            writeln!(out, "{}", answer.text())?;
        }
        if !options.execute {
            writeln!(out, "dry run: nothing changed; add --execute to act")?;
        }
    }
    if rejected > 0 {
        anyhow::bail!("{rejected} line(s) rejected");
    }
    Ok(())
}

async fn file(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    mut input: impl AsyncBufRead + Unpin,
    options: &Options<'_>,
    answers: &mut Vec<LineAnswer>,
) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    let mut line_no = 0_u64;
    loop {
        let kind = read_line(&mut input, &mut buf, MAX_LINE_BYTES)
            .await
            .with_context(|| format!("failed to read line {}", line_no + 1))?;
        line_no += 1;
        match kind {
            Line::End => break,
            Line::TooLong => {
                answers.push(LineAnswer::rejected(
                    line_no,
                    format!("line is longer than {MAX_LINE_BYTES} bytes"),
                ));
                continue;
            }
            Line::Bytes => {}
        }
        let text = buf.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&buf);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let answer = match options.kind {
            Kind::Cancel => match cancel_line(text) {
                Ok((tenant, event)) => {
                    cancel_one(ledger, line_no, &tenant, &event, options).await?
                }
                Err(problem) => LineAnswer::rejected(line_no, problem),
            },
            Kind::Reschedule => replace_line(ledger, cipher, line_no, text, options).await?,
        };
        answers.push(answer);
    }
    Ok(())
}

/// A cancel line: `{"tenant": "...", "event_id": "..."}`, nothing else.
fn cancel_line(text: &[u8]) -> Result<(String, String), String> {
    let value: Value = serde_json::from_slice(text)
        .map_err(|e| format!("invalid JSON at column {}", e.column()))?;
    let Value::Object(map) = value else {
        return Err("expected a JSON object".to_owned());
    };
    if map.keys().any(|k| k != "tenant" && k != "event_id") {
        return Err("has a field other than tenant and event_id (not repeated)".to_owned());
    }
    let field = |name: &str| {
        map.get(name)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("{name} must be a string"))
    };
    Ok((field("tenant")?, field("event_id")?))
}

fn channel_answers(changes: &[(Channel, ChannelChange)]) -> Vec<ChannelAnswer> {
    changes
        .iter()
        .map(|(channel, change)| ChannelAnswer {
            channel: channel.as_str(),
            answer: change.as_str(),
            state: match change {
                ChannelChange::TooLate(s) => Some(s.as_str().to_owned()),
                _ => None,
            },
        })
        .collect()
}

async fn cancel_one(
    ledger: &Ledger,
    line: u64,
    tenant: &str,
    event: &str,
    options: &Options<'_>,
) -> anyhow::Result<LineAnswer> {
    let Some((tenant_id, event_id)) = lookup(ledger, tenant, event).await? else {
        return Ok(LineAnswer::rejected(
            line,
            format!("no event {tenant}/{event}"),
        ));
    };
    let mut answer = LineAnswer {
        line,
        tenant: Some(tenant.to_owned()),
        event_id: Some(event.to_owned()),
        outcome: String::new(),
        channels: Vec::new(),
        detail: None,
    };
    if !options.execute {
        let status = ledger.reminder_status(tenant_id, &event_id).await?;
        let Some(status) = status else {
            return Ok(LineAnswer::rejected(
                line,
                format!("no event {tenant}/{event}"),
            ));
        };
        answer.outcome = "would_cancel".to_owned();
        answer.channels = status
            .channels
            .iter()
            .map(|c| ChannelAnswer {
                channel: c.channel.as_str(),
                answer: "now",
                state: Some(
                    c.state
                        .map_or_else(|| "pending".to_owned(), |s| s.to_string()),
                ),
            })
            .collect();
        return Ok(answer);
    }
    let cancellation = ledger
        .cancel_reminder_as(tenant_id, &event_id, options.by, LedgerTime::Database)
        .await
        .context("failed to cancel the reminder")?;
    let Some(cancellation) = cancellation else {
        return Ok(LineAnswer::rejected(
            line,
            format!("no event {tenant}/{event}"),
        ));
    };
    answer.outcome = "cancelled".to_owned();
    answer.channels = cancellation
        .channels
        .iter()
        .map(|(channel, change)| ChannelAnswer {
            channel: channel.as_str(),
            answer: change.as_str(),
            state: CancelChange::state(*change).map(|s| s.as_str().to_owned()),
        })
        .collect();
    Ok(answer)
}

async fn lookup(
    ledger: &Ledger,
    tenant: &str,
    event: &str,
) -> anyhow::Result<Option<(nudge_domain::TenantId, EventId)>> {
    let Ok(event_id) = EventId::parse(event) else {
        return Ok(None);
    };
    let found = ledger
        .tenant_by_name(tenant)
        .await
        .context("failed to look up the tenant")?;
    Ok(found.map(|t| (t.id, event_id)))
}

#[allow(clippy::too_many_arguments)]
async fn move_one(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    tenant: &str,
    event: &str,
    at: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
    revision: Option<Revision>,
    options: &Options<'_>,
) -> anyhow::Result<LineAnswer> {
    let Some((tenant_id, event_id)) = lookup(ledger, tenant, event).await? else {
        return Ok(LineAnswer::rejected(
            1,
            format!("no event {tenant}/{event}"),
        ));
    };
    let Some(status) = ledger.reminder_status(tenant_id, &event_id).await? else {
        return Ok(LineAnswer::rejected(
            1,
            format!("no event {tenant}/{event}"),
        ));
    };
    let expires_at = expires_at.unwrap_or(at + (status.expires_at - status.scheduled_at));
    let mut answer = LineAnswer {
        line: 1,
        tenant: Some(tenant.to_owned()),
        event_id: Some(event.to_owned()),
        outcome: String::new(),
        channels: Vec::new(),
        detail: Some(format!(
            "from {} to {} (expires {})",
            status.scheduled_at.to_rfc3339(),
            at.to_rfc3339(),
            expires_at.to_rfc3339()
        )),
    };
    if !options.execute {
        answer.outcome = "would_reschedule".to_owned();
        return Ok(answer);
    }
    let outcome = ledger
        .move_reminder(
            tenant_id,
            &event_id,
            at,
            expires_at,
            revision,
            cipher,
            options.by,
            LedgerTime::Database,
        )
        .await
        .context("failed to reschedule the reminder")?;
    Ok(answered(answer, outcome))
}

/// A reschedule line: a `reminders load` line with `revision`, the whole reminder as it
/// should now be.
async fn replace_line(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    line: u64,
    text: &[u8],
    options: &Options<'_>,
) -> anyhow::Result<LineAnswer> {
    let input = match ReminderInput::parse(text, TenantField::Required) {
        Ok(input) => input,
        Err(e) => return Ok(LineAnswer::rejected(line, e.to_string())),
    };
    let Some(revision) = input.revision else {
        return Ok(LineAnswer::rejected(
            line,
            "revision is required: higher than the reminder's current one",
        ));
    };
    let tenant = input.tenant.clone().unwrap_or_default();
    let event = input.event_id.as_str().to_owned();
    let Some((tenant_id, _)) = lookup(ledger, &tenant, &event).await? else {
        return Ok(LineAnswer::rejected(
            line,
            format!("no event {tenant}/{event}"),
        ));
    };
    // The digest the intake takes of the same reminder: its JSON without tenant and revision.
    let mut value: Value = serde_json::from_slice(text).context("a parsed line is JSON")?;
    if let Value::Object(map) = &mut value {
        map.remove("tenant");
        map.remove("revision");
    }
    let digest = cipher
        .request_digest(tenant_id, &serde_json::to_vec(&value)?)
        .context("failed to digest the line")?;
    let zones = if input.needs_zone() {
        ledger
            .fallback_zones(tenant_id, &input.subscriber_ref, cipher)
            .await
            .context("failed to read the subscriber's and the tenant's time zones")?
    } else {
        nudge_ledger::FallbackZones::default()
    };
    let times = match input.resolve(zones.subscriber, zones.tenant) {
        Ok(times) => times,
        Err(e) => return Ok(LineAnswer::rejected(line, e.to_string())),
    };
    let mut item = match input.into_import(tenant_id, &times) {
        Ok(item) => item,
        Err(e) => return Ok(LineAnswer::rejected(line, e.to_string())),
    };
    item.reminder = item.reminder.with_request_digest(digest);
    let answer = LineAnswer {
        line,
        tenant: Some(tenant),
        event_id: Some(event),
        outcome: String::new(),
        channels: Vec::new(),
        detail: None,
    };
    if !options.execute {
        return Ok(LineAnswer {
            outcome: "would_reschedule".to_owned(),
            detail: Some(format!("revision {revision}")),
            ..answer
        });
    }
    let outcome = ledger
        .reschedule_reminder(
            &Replacement { item, revision },
            cipher,
            &ReplacedBy::Operator(options.by.clone()),
            LedgerTime::Database,
        )
        .await
        .context("failed to reschedule the reminder")?;
    Ok(answered(answer, outcome))
}

fn answered(mut answer: LineAnswer, outcome: RescheduleOutcome) -> LineAnswer {
    let rejected = |answer: LineAnswer, why: String| LineAnswer {
        outcome: "rejected".to_owned(),
        detail: Some(why),
        ..answer
    };
    match outcome {
        RescheduleOutcome::Applied(done) | RescheduleOutcome::Repeat(done) => {
            answer.outcome = if done
                .channels
                .iter()
                .all(|(_, c)| *c == ChannelChange::Unchanged)
            {
                "unchanged"
            } else {
                "rescheduled"
            }
            .to_owned();
            answer.channels = channel_answers(&done.channels);
            answer.detail = Some(format!(
                "revision {} at {}",
                done.revision,
                done.scheduled_at.to_rfc3339()
            ));
            answer
        }
        RescheduleOutcome::RevisionConflict { current } => rejected(
            answer,
            format!("revision conflict: the current revision is {current}"),
        ),
        RescheduleOutcome::Cancelled => rejected(answer, "the reminder is cancelled".to_owned()),
        RescheduleOutcome::SubscriberDiffers => {
            rejected(answer, "the reminder is for another subscriber".to_owned())
        }
        RescheduleOutcome::ScheduledInThePast => {
            rejected(answer, "scheduled_at is in the past".to_owned())
        }
        RescheduleOutcome::ExpiresInThePast => {
            rejected(answer, "expires_at is in the past".to_owned())
        }
        RescheduleOutcome::NotFound => rejected(answer, "no such event".to_owned()),
    }
}
