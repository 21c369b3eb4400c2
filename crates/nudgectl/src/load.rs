//! `reminders load`: the bulk import a clinic uses to move from another system.
//!
//! The input is JSON Lines, one reminder per line, of at most [`MAX_LINE_BYTES`] (a longer
//! line is skipped without being held in memory, and rejected by number). Each line is parsed
//! here into a [`ReminderLine`]; good lines are imported [`CHUNK_LINES`] input lines at a time,
//! one ledger transaction per chunk (`Ledger::import_reminders`: a few multi-row statements,
//! reminders with their encrypted destinations). A bad line is rejected on its own, never
//! half-written, and the rest still load; a database failure stops the load at the first line
//! of the chunk it hit, the chunks before it committed. Loading the same file again is safe:
//! lines already loaded count as already present.
//!
//! Must never: print a destination, subscriber reference or content. Rejections name the line
//! and the field; the only values they quote are tenant names, event ids and timestamps.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, Utc};
use nudge_domain::{Channel, EventId, IdError, SubscriberRef, TenantId};
use nudge_ledger::{
    AuditEntry, Destination, DestinationCipher, ImportOutcome, ImportReminder, Ledger, LedgerError,
    MAX_CONTENT_BYTES, MAX_DESTINATION_BYTES, NewReminder,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::error::Category;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

/// A progress line goes to the error stream after every this many input lines.
const PROGRESS_EVERY: u64 = 1000;

/// The longest input line accepted, in bytes (without its line end).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Input lines per ledger transaction. Divides [`PROGRESS_EVERY`], so progress lines report
/// committed work.
pub const CHUNK_LINES: u64 = 500;

/// What the operator asked for, besides the input.
#[derive(Debug)]
pub(crate) struct LoadOptions {
    pub dry_run: bool,
    pub json: bool,
    pub reason: Option<String>,
}

/// Counts for the summary line, the `--json` summary and the audit row.
#[derive(Debug, Default, Serialize)]
struct LoadSummary {
    file: String,
    dry_run: bool,
    /// Non-blank lines processed (loaded, already present or rejected).
    lines: u64,
    /// Lines that passed every check (in a dry run: would be loaded).
    valid: u64,
    loaded: u64,
    already_present: u64,
    rejected: u64,
    /// Deliveries created at once, for reminders already due or in a window that has run.
    deliveries_created: u64,
    rejected_lines: Vec<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped_at_line: Option<u64>,
}

/// Loads `file` (`-` is standard input): see the module documentation.
pub(crate) async fn load(
    ledger: &Ledger,
    actor: &str,
    cipher: &DestinationCipher,
    file: &Path,
    options: LoadOptions,
    out: &mut impl Write,
    err: &mut impl Write,
) -> anyhow::Result<()> {
    let (input, name): (Box<dyn AsyncBufRead + Unpin + Send>, String) = if file == Path::new("-") {
        (
            Box::new(BufReader::new(tokio::io::stdin())),
            "<stdin>".to_owned(),
        )
    } else {
        let opened = tokio::fs::File::open(file)
            .await
            .with_context(|| format!("failed to open {}", file.display()))?;
        (Box::new(BufReader::new(opened)), file.display().to_string())
    };
    let mut loader = Loader {
        ledger,
        cipher,
        dry_run: options.dry_run,
        tenants: HashMap::new(),
        loaded_per_tenant: BTreeMap::new(),
        pending: Vec::new(),
        summary: LoadSummary {
            file: name,
            dry_run: options.dry_run,
            ..LoadSummary::default()
        },
    };
    let stopped = loader.run(input, err).await?;
    let Loader {
        summary,
        loaded_per_tenant,
        ..
    } = loader;

    write_summary(&summary, options.json, out)?;

    if !options.dry_run {
        let audit = ledger
            .record_audit(&AuditEntry {
                at: Utc::now(),
                actor: actor.to_owned(),
                action: "reminders_load".into(),
                target: None,
                reason: options.reason,
                incident: None,
                details: serde_json::json!({
                    "file": summary.file,
                    "lines": summary.lines,
                    "loaded": summary.loaded,
                    "already_present": summary.already_present,
                    "rejected": summary.rejected,
                    "deliveries_created": summary.deliveries_created,
                    "loaded_per_tenant": loaded_per_tenant,
                    "stopped_at_line": summary.stopped_at_line,
                }),
            })
            .await
            .context("failed to record the load in the audit log");
        match (&stopped, audit) {
            (_, Ok(())) => {}
            (None, Err(e)) => return Err(e),
            // The stop is the error to report; this one is handled by logging it.
            (Some(_), Err(e)) => {
                tracing::error!(error.cause_chain = ?e, "audit row for a stopped load not written");
            }
        }
    }
    if let Some(error) = stopped {
        return Err(error);
    }
    if summary.rejected > 0 {
        let next = if summary.dry_run {
            "fix them before loading"
        } else {
            "fix them and load the file again: lines already loaded count as already present"
        };
        anyhow::bail!(
            "{} of {} lines rejected (listed as `line N: reason`); {next}",
            summary.rejected,
            summary.lines
        );
    }
    Ok(())
}

fn write_summary(summary: &LoadSummary, json: bool, out: &mut impl Write) -> anyhow::Result<()> {
    if json {
        serde_json::to_writer_pretty(&mut *out, summary)?;
        writeln!(out)?;
        return Ok(());
    }
    if summary.dry_run {
        writeln!(
            out,
            "dry run: {} valid, {} rejected (of {} lines); nothing written",
            summary.valid, summary.rejected, summary.lines
        )?;
    } else {
        writeln!(
            out,
            "loaded {} new, {} already present, {} rejected (of {} lines)",
            summary.loaded, summary.already_present, summary.rejected, summary.lines
        )?;
        if summary.deliveries_created > 0 {
            writeln!(
                out,
                "deliveries created at once: {} (reminders already due, or in a window the \
                 producer has run)",
                summary.deliveries_created
            )?;
        }
    }
    if let Some(line) = summary.stopped_at_line {
        writeln!(out, "stopped at line {line}, before the end of the input")?;
    }
    Ok(())
}

struct Loader<'a> {
    ledger: &'a Ledger,
    cipher: &'a DestinationCipher,
    dry_run: bool,
    /// Tenant ids by name, including names that are not tenants (`None`).
    tenants: HashMap<String, Option<TenantId>>,
    loaded_per_tenant: BTreeMap<String, u64>,
    summary: LoadSummary,
    /// Lines read since the last chunk was written, in order.
    pending: Vec<(u64, Pending)>,
}

/// A line read and checked, waiting for its chunk to be written.
enum Pending {
    Rejected(LineError),
    /// Every check passed (dry run: nothing to write).
    Valid,
    Import {
        tenant: String,
        item: ImportReminder,
    },
}

/// What one good line did.
enum Loaded {
    New {
        deliveries_created: u64,
    },
    AlreadyPresent,
    /// Dry run: every check passed, nothing written.
    Valid,
}

/// One line of input: its bytes, or how long it was when over [`MAX_LINE_BYTES`].
enum Line {
    End,
    Bytes,
    TooLong,
}

/// Reads one line into `buf` (without its `\n`), holding at most `max` bytes of it: the rest
/// of a longer line is read and dropped.
async fn read_line(
    input: &mut (impl AsyncBufRead + Unpin),
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Line> {
    buf.clear();
    let mut too_long = false;
    let mut read_any = false;
    loop {
        let available = input.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (read_any, too_long) {
                (false, _) => Line::End,
                (true, true) => Line::TooLong,
                (true, false) => Line::Bytes,
            });
        }
        read_any = true;
        let (chunk, found_end) = match available.iter().position(|b| *b == b'\n') {
            Some(i) => (&available[..i], true),
            None => (available, false),
        };
        if !too_long {
            if buf.len() + chunk.len() > max + 1 {
                // One byte over is allowed for a `\r` that is stripped below.
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        let used = chunk.len() + usize::from(found_end);
        input.consume(used);
        if found_end {
            if !too_long && buf.last() == Some(&b'\r') {
                buf.pop();
            }
            if buf.len() > max {
                too_long = true;
                buf.clear();
            }
            return Ok(if too_long { Line::TooLong } else { Line::Bytes });
        }
    }
}

impl Loader<'_> {
    /// Reads and loads every line. `Ok(Some(error))` when the load stopped early on an
    /// infrastructure failure (the summary says where); `Err` when the error stream failed.
    async fn run(
        &mut self,
        mut input: impl AsyncBufRead + Unpin,
        err: &mut impl Write,
    ) -> anyhow::Result<Option<anyhow::Error>> {
        let mut buf = Vec::new();
        let mut line_no: u64 = 0;
        loop {
            let read = read_line(&mut input, &mut buf, MAX_LINE_BYTES).await;
            let line_kind = match read {
                Ok(Line::End) => break,
                Ok(kind) => kind,
                Err(e) => {
                    if let Some(stopped) = self.flush(err).await? {
                        return Ok(Some(stopped));
                    }
                    self.summary.stopped_at_line = Some(line_no + 1);
                    return Ok(Some(anyhow::Error::new(e).context(format!(
                        "failed to read {} at line {}",
                        self.summary.file,
                        line_no + 1
                    ))));
                }
            };
            line_no += 1;
            let mut line = buf.as_slice();
            if line_no == 1 {
                line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
            }
            match line_kind {
                Line::TooLong => self
                    .pending
                    .push((line_no, Pending::Rejected(LineError::LineTooLong))),
                _ if line.iter().all(u8::is_ascii_whitespace) => {}
                _ => match self.check_line(line).await {
                    Ok(pending) => self.pending.push((line_no, pending)),
                    Err(e) => {
                        let first = self.pending.first().map_or(line_no, |(n, _)| *n);
                        self.summary.stopped_at_line = Some(first);
                        return Ok(Some(stopped_at(e, first)));
                    }
                },
            }
            if line_no.is_multiple_of(CHUNK_LINES)
                && let Some(stopped) = self.flush(err).await?
            {
                return Ok(Some(stopped));
            }
            if line_no.is_multiple_of(PROGRESS_EVERY) {
                let s = &self.summary;
                writeln!(
                    err,
                    "progress: {line_no} lines read, {} new, {} already present, {} rejected",
                    s.loaded, s.already_present, s.rejected
                )?;
            }
        }
        self.flush(err).await
    }

    /// Parses a line and resolves its tenant; `Err` only when the tenant lookup failed.
    async fn check_line(&mut self, bytes: &[u8]) -> anyhow::Result<Pending> {
        let line = match ReminderLine::parse(bytes) {
            Ok(line) => line,
            Err(e) => return Ok(Pending::Rejected(e)),
        };
        let Some(tenant_id) = self.tenant_id(&line.tenant).await? else {
            return Ok(Pending::Rejected(LineError::UnknownTenant(line.tenant)));
        };
        let mut reminder = match NewReminder::new(
            tenant_id,
            line.event_id.clone(),
            line.subscriber_ref,
            &line.channels,
            line.scheduled_at,
            line.expires_at,
        ) {
            Ok(reminder) => reminder,
            Err(e) => return Ok(Pending::Rejected(refused(e))),
        };
        if let Some(content) = line.content {
            reminder = match reminder.with_content(content) {
                Ok(reminder) => reminder,
                Err(e) => return Ok(Pending::Rejected(refused(e))),
            };
        }
        if self.dry_run {
            return Ok(Pending::Valid);
        }
        Ok(Pending::Import {
            tenant: line.tenant,
            item: ImportReminder {
                reminder,
                contacts: line.destinations,
            },
        })
    }

    /// Writes the pending chunk in one transaction and reports its lines in order.
    /// `Ok(Some(error))` when the database failed: nothing of the chunk was written.
    async fn flush(&mut self, err: &mut impl Write) -> anyhow::Result<Option<anyhow::Error>> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let items: Vec<ImportReminder> = self
            .pending
            .iter()
            .filter_map(|(_, p)| match p {
                Pending::Import { item, .. } => Some(item.clone()),
                _ => None,
            })
            .collect();
        let mut outcomes = if items.is_empty() {
            Vec::new()
        } else {
            match self
                .ledger
                .import_reminders(&items, self.cipher, Utc::now())
                .await
            {
                Ok(outcomes) => outcomes,
                Err(e) => {
                    let first = self.pending[0].0;
                    self.summary.stopped_at_line = Some(first);
                    self.pending.clear();
                    let e = anyhow::Error::new(e).context("failed to import");
                    return Ok(Some(stopped_at(e, first)));
                }
            }
        }
        .into_iter();
        for (line_no, pending) in std::mem::take(&mut self.pending) {
            let result = match pending {
                Pending::Rejected(reason) => Err(reason),
                Pending::Valid => Ok(Loaded::Valid),
                Pending::Import { tenant, item } => match outcomes.next() {
                    Some(ImportOutcome::Created {
                        deliveries_created, ..
                    }) => {
                        *self.loaded_per_tenant.entry(tenant).or_default() += 1;
                        Ok(Loaded::New { deliveries_created })
                    }
                    Some(ImportOutcome::AlreadyPresent { .. }) => Ok(Loaded::AlreadyPresent),
                    Some(ImportOutcome::EventConflict) => Err(LineError::EventConflict {
                        tenant,
                        event_id: item.reminder.event_id().as_str().to_owned(),
                    }),
                    Some(ImportOutcome::UnknownTenant) | None => {
                        Err(LineError::UnknownTenant(tenant))
                    }
                },
            };
            self.summary.lines += 1;
            match result {
                Ok(loaded) => {
                    self.summary.valid += 1;
                    match loaded {
                        Loaded::New { deliveries_created } => {
                            self.summary.loaded += 1;
                            self.summary.deliveries_created += deliveries_created;
                        }
                        Loaded::AlreadyPresent => self.summary.already_present += 1,
                        Loaded::Valid => {}
                    }
                }
                Err(reason) => {
                    self.summary.rejected += 1;
                    self.summary.rejected_lines.push(line_no);
                    writeln!(err, "line {line_no}: {reason}")?;
                }
            }
        }
        Ok(None)
    }

    async fn tenant_id(&mut self, name: &str) -> anyhow::Result<Option<TenantId>> {
        if let Some(cached) = self.tenants.get(name) {
            return Ok(*cached);
        }
        let id = self
            .ledger
            .tenant_by_name(name)
            .await
            .context("failed to look up a tenant")?
            .map(|t| t.id);
        self.tenants.insert(name.to_owned(), id);
        Ok(id)
    }
}

/// The load stopped at `line`: the lines before it were processed.
fn stopped_at(error: anyhow::Error, line: u64) -> anyhow::Error {
    error.context(format!(
        "load stopped at line {line}; the lines before it were processed (see the summary) \
         and loading the file again is safe"
    ))
}

/// The ledger's refusal of a value this module already checks (kept as a rejection, in
/// case the ledger's rules are ever stricter).
fn refused(error: LedgerError) -> LineError {
    match error {
        LedgerError::InvalidInput(reason) => LineError::Refused(reason),
        _ => LineError::Refused("not accepted by the ledger"),
    }
}

/// Why a line was rejected. Names the field; never carries a destination, subscriber
/// reference or content.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum LineError {
    #[error("line is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    #[error("destinations.{0} is longer than {MAX_DESTINATION_BYTES} bytes")]
    DestinationTooLong(Channel),
    #[error("content is longer than {MAX_CONTENT_BYTES} bytes (as JSON text)")]
    ContentTooLong,
    #[error("invalid JSON at column {column}: {problem}")]
    Syntax { column: usize, problem: String },
    #[error("expected a JSON object")]
    NotAnObject,
    /// A missing, unknown or repeated field, as serde words it.
    #[error("{0}")]
    Fields(String),
    #[error("{field} must be {expected}")]
    WrongType {
        field: String,
        expected: &'static str,
    },
    #[error("{field}: {source}")]
    Invalid {
        field: &'static str,
        source: IdError,
    },
    #[error("tenant must be 1 to 200 bytes")]
    TenantName,
    #[error("channels must list at least one of push, email, sms")]
    NoChannels,
    #[error("channels[{index}] is not one of push, email, sms")]
    UnknownChannel { index: usize },
    #[error("channels lists {0} twice")]
    DuplicateChannel(Channel),
    #[error("{field} is not an RFC 3339 timestamp with an offset, e.g. 2026-11-30T09:00:00Z")]
    Timestamp { field: &'static str },
    #[error("expires_at must be after scheduled_at")]
    ExpiresNotAfterScheduled,
    #[error("destinations.{0} is missing")]
    MissingDestination(Channel),
    #[error("destinations.{0} is empty")]
    EmptyDestination(Channel),
    #[error("destinations.{0} is given but {0} is not in channels")]
    UnlistedDestination(Channel),
    #[error("destinations has a key that is not one of push, email, sms")]
    UnknownDestinationChannel,
    #[error("unknown tenant {0:?}")]
    UnknownTenant(String),
    #[error("event_id {event_id:?} of tenant {tenant:?} is already used for a different reminder")]
    EventConflict { tenant: String, event_id: String },
    #[error("refused by the ledger: {0}")]
    Refused(&'static str),
}

impl LineError {
    fn wrong_type(field: impl Into<String>, expected: &'static str) -> Self {
        Self::WrongType {
            field: field.into(),
            expected,
        }
    }

    fn from_json(error: &serde_json::Error) -> Self {
        // serde_json appends the position; the rest of a syntax message never quotes input.
        let text = error.to_string();
        let suffix = format!(" at line {} column {}", error.line(), error.column());
        let problem = text.strip_suffix(&suffix).unwrap_or(&text);
        match error.classify() {
            Category::Data => {
                // A key is quoted back as written: keep a stray control character from
                // breaking the one-line-per-rejection output.
                let mut fields = String::with_capacity(problem.len());
                for c in problem.chars() {
                    if c.is_control() {
                        fields.extend(c.escape_debug());
                    } else {
                        fields.push(c);
                    }
                }
                Self::Fields(fields)
            }
            Category::Syntax | Category::Eof | Category::Io => Self::Syntax {
                column: error.column(),
                problem: problem.to_owned(),
            },
        }
    }
}

/// One line as written: every field is taken as raw JSON so that a value of the wrong type
/// is reported by field name here, not by serde, whose messages quote the value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLine {
    tenant: Value,
    event_id: Value,
    subscriber_ref: Value,
    channels: Value,
    scheduled_at: Value,
    expires_at: Value,
    destinations: Value,
    #[serde(default)]
    content: Option<Value>,
}

/// One line, checked: every listed channel has a non-empty destination and no other channel
/// has one; `expires_at` is after `scheduled_at`; `content` is a JSON object, kept as its
/// JSON bytes.
struct ReminderLine {
    tenant: String,
    event_id: EventId,
    subscriber_ref: SubscriberRef,
    channels: Vec<Channel>,
    scheduled_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    destinations: Vec<(Channel, Destination)>,
    content: Option<Vec<u8>>,
}

impl fmt::Debug for ReminderLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReminderLine")
            .field("tenant", &self.tenant)
            .field("event_id", &self.event_id)
            .field("subscriber_ref", &self.subscriber_ref)
            .field("channels", &self.channels)
            .field("scheduled_at", &self.scheduled_at)
            .field("expires_at", &self.expires_at)
            .field("destinations", &self.destinations)
            .field("content", &self.content.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl ReminderLine {
    fn parse(bytes: &[u8]) -> Result<Self, LineError> {
        // Checked first so that serde's type error for a bare value (which quotes it) never
        // happens: inside an object every field is a `Value`, which takes any JSON.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(LineError::NotAnObject);
        }
        let raw: RawLine = serde_json::from_slice(bytes).map_err(|e| LineError::from_json(&e))?;

        let tenant = string(&raw.tenant, "tenant")?;
        if tenant.is_empty() || tenant.len() > 200 {
            return Err(LineError::TenantName);
        }
        let event_id = EventId::parse(string(&raw.event_id, "event_id")?).map_err(|source| {
            LineError::Invalid {
                field: "event_id",
                source,
            }
        })?;
        let subscriber_ref = SubscriberRef::parse(string(&raw.subscriber_ref, "subscriber_ref")?)
            .map_err(|source| LineError::Invalid {
            field: "subscriber_ref",
            source,
        })?;
        let channels = channels(&raw.channels)?;
        let scheduled_at = timestamp(&raw.scheduled_at, "scheduled_at")?;
        let expires_at = timestamp(&raw.expires_at, "expires_at")?;
        if expires_at <= scheduled_at {
            return Err(LineError::ExpiresNotAfterScheduled);
        }
        let destinations = destinations(&raw.destinations, &channels)?;
        let content = match raw.content {
            None | Some(Value::Null) => None,
            Some(content @ Value::Object(_)) => {
                let content = content.to_string().into_bytes();
                if content.len() > MAX_CONTENT_BYTES {
                    return Err(LineError::ContentTooLong);
                }
                Some(content)
            }
            Some(_) => return Err(LineError::wrong_type("content", "a JSON object")),
        };
        Ok(Self {
            tenant: tenant.to_owned(),
            event_id,
            subscriber_ref,
            channels,
            scheduled_at,
            expires_at,
            destinations,
            content,
        })
    }
}

fn string<'v>(value: &'v Value, field: &'static str) -> Result<&'v str, LineError> {
    value
        .as_str()
        .ok_or_else(|| LineError::wrong_type(field, "a string"))
}

fn channels(value: &Value) -> Result<Vec<Channel>, LineError> {
    let items = value
        .as_array()
        .ok_or_else(|| LineError::wrong_type("channels", "an array of channel names"))?;
    if items.is_empty() {
        return Err(LineError::NoChannels);
    }
    let mut channels = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let channel: Channel = item
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or(LineError::UnknownChannel { index })?;
        if channels.contains(&channel) {
            return Err(LineError::DuplicateChannel(channel));
        }
        channels.push(channel);
    }
    Ok(channels)
}

fn timestamp(value: &Value, field: &'static str) -> Result<DateTime<Utc>, LineError> {
    let text = string(value, field)?;
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| LineError::Timestamp { field })
}

fn destinations(
    value: &Value,
    channels: &[Channel],
) -> Result<Vec<(Channel, Destination)>, LineError> {
    let given = value.as_object().ok_or_else(|| {
        LineError::wrong_type("destinations", "an object of channel name to destination")
    })?;
    let mut destinations = Vec::with_capacity(channels.len());
    for &channel in channels {
        let value = given
            .get(channel.as_str())
            .ok_or(LineError::MissingDestination(channel))?;
        let text = value
            .as_str()
            .ok_or_else(|| LineError::wrong_type(format!("destinations.{channel}"), "a string"))?;
        if text.trim().is_empty() {
            return Err(LineError::EmptyDestination(channel));
        }
        if text.len() > MAX_DESTINATION_BYTES {
            return Err(LineError::DestinationTooLong(channel));
        }
        destinations.push((channel, Destination::new(text)));
    }
    // Any other key is a mistake: a destination for a channel the reminder does not use,
    // or not a channel at all (not quoted: it could be a destination typed in the wrong place).
    for key in given.keys() {
        let channel: Channel = key
            .parse()
            .map_err(|_| LineError::UnknownDestinationChannel)?;
        if !channels.contains(&channel) {
            return Err(LineError::UnlistedDestination(channel));
        }
    }
    Ok(destinations)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"tenant": "clinic-a", "event_id": "appt-123", "subscriber_ref": "patient-42", "channels": ["sms", "email"], "scheduled_at": "2026-11-30T09:00:00Z", "expires_at": "2026-11-30T10:30:00+01:00", "destinations": {"sms": "+15550100", "email": "a@example.org"}, "content": {"template": "appointment"}}"#;

    fn with(field: &str, value: Value) -> Vec<u8> {
        let mut line: serde_json::Map<String, Value> = serde_json::from_str(GOOD).unwrap();
        if value.is_null() {
            line.remove(field);
        } else {
            line.insert(field.to_owned(), value);
        }
        serde_json::to_vec(&line).unwrap()
    }

    fn reason(bytes: &[u8]) -> String {
        let err = ReminderLine::parse(bytes).unwrap_err().to_string();
        for secret in ["+15550100", "a@example.org", "patient-42", "appointment"] {
            assert!(!err.contains(secret), "{err} shows {secret}");
        }
        err
    }

    #[test]
    fn a_good_line_parses_with_its_channels_destinations_and_content() {
        let line = ReminderLine::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(line.tenant, "clinic-a");
        assert_eq!(line.event_id.as_str(), "appt-123");
        assert_eq!(line.subscriber_ref.as_str(), "patient-42");
        assert_eq!(line.channels, [Channel::Sms, Channel::Email]);
        assert_eq!(line.expires_at.to_rfc3339(), "2026-11-30T09:30:00+00:00");
        let dests: Vec<_> = line
            .destinations
            .iter()
            .map(|(c, d)| (*c, d.expose()))
            .collect();
        assert_eq!(
            dests,
            [
                (Channel::Sms, "+15550100"),
                (Channel::Email, "a@example.org")
            ]
        );
        assert_eq!(
            line.content.as_deref(),
            Some(br#"{"template":"appointment"}"#.as_slice())
        );
        assert!(!format!("{line:?}").contains("appointment"));
    }

    #[test]
    fn content_is_optional() {
        let line = ReminderLine::parse(&with("content", Value::Null)).unwrap();
        assert!(line.content.is_none());
        assert_eq!(
            reason(&with("content", serde_json::json!("appointment"))),
            "content must be a JSON object"
        );
    }

    #[test]
    fn broken_json_is_reported_by_column() {
        assert_eq!(
            reason(br#"{"tenant" "clinic-a"}"#),
            "invalid JSON at column 11: expected `:`"
        );
        assert!(reason(br#"{"tenant": "#).starts_with("invalid JSON at column 11: EOF"));
        assert_eq!(reason(b"[1, 2]"), "expected a JSON object");
        assert_eq!(reason(br#""+15550100""#), "expected a JSON object");
    }

    #[test]
    fn unknown_and_missing_fields_are_named() {
        let unknown = reason(&with("subscriber", serde_json::json!("x")));
        assert!(
            unknown.starts_with("unknown field `subscriber`, expected one of"),
            "{unknown}"
        );
        assert_eq!(
            reason(&with("expires_at", Value::Null)),
            "missing field `expires_at`"
        );
    }

    #[test]
    fn a_value_of_the_wrong_type_names_the_field_without_quoting_the_value() {
        assert_eq!(
            reason(&with("subscriber_ref", serde_json::json!(15550100))),
            "subscriber_ref must be a string"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": 15550100, "email": "a@example.org"})
            )),
            "destinations.sms must be a string"
        );
        assert_eq!(
            reason(&with("subscriber_ref", serde_json::json!("patient 42"))),
            "subscriber_ref: subscriber reference has a character not allowed at byte 7: \
             printable ASCII without whitespace"
        );
    }

    #[test]
    fn every_listed_channel_needs_a_destination_and_no_other_may_have_one() {
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"email": "a@example.org"})
            )),
            "destinations.sms is missing"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": " ", "email": "a@example.org"})
            )),
            "destinations.sms is empty"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": "+15550100", "email": "a@example.org", "push": "tok"})
            )),
            "destinations.push is given but push is not in channels"
        );
        assert_eq!(
            reason(&with(
                "destinations",
                serde_json::json!({"sms": "+15550100", "email": "a@example.org", "+15550100": "sms"})
            )),
            "destinations has a key that is not one of push, email, sms"
        );
    }

    #[test]
    fn channels_must_be_known_and_listed_once() {
        assert_eq!(
            reason(&with("channels", serde_json::json!([]))),
            "channels must list at least one of push, email, sms"
        );
        assert_eq!(
            reason(&with("channels", serde_json::json!(["sms", "fax"]))),
            "channels[1] is not one of push, email, sms"
        );
        assert_eq!(
            reason(&with("channels", serde_json::json!(["sms", "sms"]))),
            "channels lists sms twice"
        );
    }

    #[test]
    fn timestamps_need_an_offset_and_expiry_after_the_schedule() {
        assert_eq!(
            reason(&with(
                "scheduled_at",
                serde_json::json!("2026-11-30T09:00:00")
            )),
            "scheduled_at is not an RFC 3339 timestamp with an offset, e.g. 2026-11-30T09:00:00Z"
        );
        assert_eq!(
            reason(&with(
                "expires_at",
                serde_json::json!("2026-11-30T08:59:59Z")
            )),
            "expires_at must be after scheduled_at"
        );
    }

    #[test]
    fn a_control_character_in_an_unknown_key_stays_on_one_line() {
        let r = reason(&with("a\nb", serde_json::json!(1)));
        assert!(!r.contains('\n'), "{r}");
        assert!(r.starts_with("unknown field `a\\nb`"), "{r}");
    }
}
