//! `reminders load`: the bulk import a clinic uses to move from another system.
//!
//! The input is JSON Lines, one reminder per line, of at most [`MAX_LINE_BYTES`] (a longer
//! line is skipped without being held in memory, and rejected by number). Each line is parsed
//! here into a [`ReminderInput`] (the format shared with the intake, `nudge_ledger::input`); good lines are imported [`CHUNK_LINES`] input lines at a time,
//! one ledger transaction per chunk (`Ledger::import_reminders`: a few multi-row statements,
//! reminders with their encrypted destinations). Up to [`CHUNKS_IN_FLIGHT`] chunks are written
//! at once, each on its own connection, while the next lines are read and parsed; their lines
//! are reported in input order. A chunk that shares a (tenant, event id) or a (tenant,
//! subscriber) with a chunk still being written waits for it, so the first occurrence of an
//! event still wins and the later destination of a subscriber is still the one kept, as when
//! the chunks went one at a time. A bad line is rejected on its own, never half-written, and
//! the rest still load; a database failure stops the load at the first line of the chunk it
//! hit: the chunks before it committed, and chunks after it already being written may have
//! committed too (their lines are reported). Loading the same file again is safe: lines
//! already loaded count as already present.
//!
//! Must never: print a destination, subscriber reference or content. Rejections name the line
//! and the field; the only values they quote are tenant names, event ids and timestamps.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use chrono::Utc;
use nudge_domain::TenantId;
use nudge_domain::series::SeriesLimits;
use nudge_ledger::input::series::{MAX_PER_DAY, SeriesInput, SeriesProblem, is_series};
use nudge_ledger::input::{InputError, ReminderInput, TenantField};
use nudge_ledger::{
    AuditEntry, DestinationCipher, FallbackZones, ImportOutcome, ImportReminder, Ledger,
    LedgerError, SeriesOutcome,
};
use nudge_telemetry::error_chain;
use serde::Serialize;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};
use tokio::task::JoinHandle;

/// How far ahead a loaded series may start, and end after its start (the intake's default
/// `intake.max_schedule_ahead_days`).
const SERIES_AHEAD: chrono::TimeDelta = chrono::TimeDelta::days(400);

/// A progress line goes to the error stream after every this many input lines.
const PROGRESS_EVERY: u64 = 1000;

/// The longest input line accepted, in bytes (without its line end).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Input lines per ledger transaction. Divides [`PROGRESS_EVERY`]; progress lines count the
/// work committed so far (the chunks still being written come in later lines).
pub const CHUNK_LINES: u64 = 500;

/// Chunks being written at once, each its own transaction on its own connection (the
/// connection pool has room for them and a tenant lookup). Each chunk's transaction
/// alternates between the database and this process (sealing, encoding, reading answers):
/// with 3 at once both sides were mostly idle (7,500 reminders/s on 2 cores); with 6,
/// 13,400/s (100,000 lines, release build).
pub const CHUNKS_IN_FLIGHT: usize = 6;

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
    let clock = Arc::new(tokio::sync::OnceCell::new());
    let mut loader = Loader {
        ledger,
        clock,
        cipher,
        dry_run: options.dry_run,
        tenants: HashMap::new(),
        loaded_per_tenant: BTreeMap::new(),
        pending: Vec::new(),
        in_flight: VecDeque::new(),
        failed: None,
        hasher: RandomState::new(),
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
        clock: loader_clock,
        ..
    } = loader;

    write_summary(&summary, options.json, out)?;

    if !options.dry_run {
        let audit = match DatabaseClock::get(&loader_clock, ledger).await {
            Ok(clock) => ledger
                .record_audit(&AuditEntry {
                    at: clock.now(),
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
                .context("failed to record the load in the audit log"),
            Err(e) => Err(anyhow::Error::new(e).context("failed to read the database's clock")),
        };
        match (&stopped, audit) {
            (_, Ok(())) => {}
            (None, Err(e)) => return Err(e),
            // The stop is the error to report; this one is handled by logging it.
            (Some(_), Err(e)) => {
                tracing::error!(error.cause_chain = %error_chain(&*e), "audit row for a stopped load not written");
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

/// The database's clock, read once (with the first chunk written) and carried forward by
/// this machine's monotonic clock: the reminders, contacts and audit row a load writes are
/// dated by the database, whatever this machine's wall clock says, without a round trip per
/// chunk.
#[derive(Debug, Clone, Copy)]
struct DatabaseClock {
    at: chrono::DateTime<Utc>,
    read: std::time::Instant,
}

impl DatabaseClock {
    /// The load's clock, read from the database the first time it is needed.
    async fn get(
        cell: &tokio::sync::OnceCell<DatabaseClock>,
        ledger: &Ledger,
    ) -> Result<DatabaseClock, nudge_ledger::LedgerError> {
        cell.get_or_try_init(|| async {
            let at = ledger.clock(nudge_ledger::LedgerTime::Database).await?;
            Ok(DatabaseClock {
                at,
                read: std::time::Instant::now(),
            })
        })
        .await
        .copied()
    }

    fn now(&self) -> chrono::DateTime<Utc> {
        self.at
            + chrono::Duration::from_std(self.read.elapsed()).unwrap_or(chrono::Duration::zero())
    }
}

struct Loader<'a> {
    ledger: &'a Ledger,
    clock: Arc<tokio::sync::OnceCell<DatabaseClock>>,
    cipher: &'a DestinationCipher,
    dry_run: bool,
    /// Tenant ids by name, including names that are not tenants (`None`).
    tenants: HashMap<String, Option<TenantId>>,
    loaded_per_tenant: BTreeMap<String, u64>,
    summary: LoadSummary,
    /// Lines read since the last chunk was written, in order.
    pending: Vec<(u64, Pending)>,
    /// Chunks handed to the ledger and not reported yet, in input order.
    in_flight: VecDeque<Chunk>,
    /// The first chunk whose write failed: the load stops there.
    failed: Option<anyhow::Error>,
    hasher: RandomState,
}

/// A chunk of lines, being written (or with nothing to write), to be reported in order.
struct Chunk {
    lines: Vec<(u64, Pending)>,
    /// Hashes of the chunk's (tenant, event id) and (tenant, subscriber) pairs: a later chunk
    /// sharing one waits for this one.
    keys: HashSet<u64>,
    write: Option<JoinHandle<Result<Vec<ImportOutcome>, LedgerError>>>,
}

/// A line read and checked, waiting for its chunk to be written.
enum Pending {
    Rejected(LineError),
    /// Every check passed (dry run: nothing to write).
    Valid,
    Import {
        tenant: String,
        item: Box<ImportReminder>,
    },
    /// A series line, recorded when it was read (its own transaction).
    Recorded(Loaded),
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
pub(crate) enum Line {
    End,
    Bytes,
    TooLong,
}

/// Reads one line into `buf` (without its `\n`), holding at most `max` bytes of it: the rest
/// of a longer line is read and dropped.
pub(crate) async fn read_line(
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
                    if let Some(stopped) = self.finish(err).await? {
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
                        // The chunks already handed over finish first: they may have failed
                        // earlier in the input.
                        self.drain(err).await?;
                        if let Some(stopped) = self.failed.take() {
                            return Ok(Some(stopped));
                        }
                        let first = self.pending.first().map_or(line_no, |(n, _)| *n);
                        self.summary.stopped_at_line = Some(first);
                        return Ok(Some(stopped_at(e, first)));
                    }
                },
            }
            if line_no.is_multiple_of(CHUNK_LINES) {
                self.submit(err).await?;
                if self.failed.is_some() {
                    return self.finish(err).await;
                }
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
        self.finish(err).await
    }

    /// Parses a line and resolves its tenant; `Err` only when the tenant lookup failed (or,
    /// for a series line, recording it).
    async fn check_line(&mut self, bytes: &[u8]) -> anyhow::Result<Pending> {
        if bytes.windows(11).any(|w| w == b"\"series_id\"")
            && let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes)
            && is_series(&value)
        {
            return self.series_line(value).await;
        }
        let line = match ReminderInput::parse(bytes, TenantField::Required) {
            Ok(line) => line,
            Err(e) => return Ok(Pending::Rejected(e.into())),
        };
        if nudge_ledger::is_occurrence_event_id(&line.event_id) {
            return Ok(Pending::Rejected(LineError::ReservedEventId));
        }
        let tenant = line.tenant.clone().unwrap_or_default();
        let Some(tenant_id) = self.tenant_id(&tenant).await? else {
            return Ok(Pending::Rejected(LineError::UnknownTenant(tenant)));
        };
        // A local time without its own zone is read in the subscriber's, else the tenant's,
        // as the ledger has them now (one read, only for such a line).
        let zones = if line.needs_zone() {
            self.ledger
                .fallback_zones(tenant_id, &line.subscriber_ref, self.cipher)
                .await
                .context("failed to read the subscriber's and the tenant's time zones")?
        } else {
            FallbackZones::default()
        };
        let times = match line.resolve(zones.subscriber, zones.tenant) {
            Ok(times) => times,
            Err(e) => return Ok(Pending::Rejected(e.into())),
        };
        let item = match line.into_import(tenant_id, &times) {
            Ok(item) => item,
            Err(e) => return Ok(Pending::Rejected(e.into())),
        };
        if self.dry_run {
            return Ok(Pending::Valid);
        }
        Ok(Pending::Import {
            tenant,
            item: Box::new(item),
        })
    }

    /// A series line (`series_id` instead of `event_id`): checked as the intake checks a
    /// series, and recorded now, in its own transaction, with its digest taken over the line
    /// without `tenant` (the same series posted to the intake, or loaded again, is already
    /// present). Its first occurrences are created by the producer's windows.
    async fn series_line(&mut self, mut value: serde_json::Value) -> anyhow::Result<Pending> {
        let input = match SeriesInput::from_value(value.clone(), TenantField::Required) {
            Ok(input) => input,
            Err(problems) => return Ok(Pending::Rejected(LineError::Series(joined(&problems)))),
        };
        let tenant = input.tenant.clone().unwrap_or_default();
        let Some(tenant_id) = self.tenant_id(&tenant).await? else {
            return Ok(Pending::Rejected(LineError::UnknownTenant(tenant)));
        };
        let now = DatabaseClock::get(&self.clock, self.ledger)
            .await
            .context("failed to read the database's clock")?
            .now();
        let limits = SeriesLimits {
            max_ahead: SERIES_AHEAD,
            max_per_day: MAX_PER_DAY,
        };
        let (new, contacts) = match input.into_new(tenant_id, &limits, now + SERIES_AHEAD) {
            Ok(parts) => parts,
            Err(problems) => return Ok(Pending::Rejected(LineError::Series(joined(&problems)))),
        };
        if self.dry_run {
            return Ok(Pending::Valid);
        }
        if let serde_json::Value::Object(map) = &mut value {
            map.remove("tenant");
        }
        let canonical = serde_json::to_vec(&value).context("failed to read the line back")?;
        let digest = self
            .cipher
            .request_digest(tenant_id, &canonical)
            .context("failed to take the series' digest")?;
        let new = new.with_request_digest(digest);
        let outcome = self
            .ledger
            .create_series(&new, &contacts, self.cipher, now)
            .await
            .context("failed to record a series")?;
        Ok(match outcome {
            SeriesOutcome::Created { .. } => {
                *self.loaded_per_tenant.entry(tenant).or_default() += 1;
                Pending::Recorded(Loaded::New {
                    deliveries_created: 0,
                })
            }
            SeriesOutcome::AlreadyPresent { .. } => Pending::Recorded(Loaded::AlreadyPresent),
            SeriesOutcome::Conflict => Pending::Rejected(LineError::SeriesConflict {
                tenant,
                series_id: new.series_id().to_owned(),
            }),
            SeriesOutcome::UnknownTenant => Pending::Rejected(LineError::UnknownTenant(tenant)),
            SeriesOutcome::UnknownCategory => Pending::Rejected(LineError::UnknownCategory {
                tenant,
                category: new.category().to_string(),
            }),
        })
    }

    /// Hands the pending lines to the ledger as one chunk (its own transaction, written in
    /// the background), after the chunks it must follow, and reports the chunks that are done.
    async fn submit(&mut self, err: &mut impl Write) -> anyhow::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let lines = std::mem::take(&mut self.pending);
        let items: Vec<ImportReminder> = lines
            .iter()
            .filter_map(|(_, p)| match p {
                Pending::Import { item, .. } => Some((**item).clone()),
                _ => None,
            })
            .collect();
        let keys: HashSet<u64> = items
            .iter()
            .flat_map(|i| {
                let tenant = i.reminder.tenant_id().as_uuid();
                [
                    self.hasher
                        .hash_one((tenant, 0u8, i.reminder.event_id().as_str())),
                    self.hasher
                        .hash_one((tenant, 1u8, i.reminder.subscriber_ref().as_str())),
                ]
            })
            .collect();
        // Wait for room, and for every earlier chunk that shares a key with this one.
        while self.in_flight.len() >= CHUNKS_IN_FLIGHT
            || self.in_flight.iter().any(|c| !c.keys.is_disjoint(&keys))
        {
            self.complete_oldest(err).await?;
        }
        let write = (!items.is_empty() && self.failed.is_none()).then(|| {
            let ledger = self.ledger.clone();
            let cipher = self.cipher.clone();
            let clock = self.clock.clone();
            tokio::spawn(async move {
                let now = DatabaseClock::get(&clock, &ledger).await?.now();
                ledger.import_reminders(&items, &cipher, now).await
            })
        });
        self.in_flight.push_back(Chunk { lines, keys, write });
        // Chunks already written (or with nothing to write) are reported at once.
        while self
            .in_flight
            .front()
            .is_some_and(|c| c.write.as_ref().is_none_or(JoinHandle::is_finished))
        {
            self.complete_oldest(err).await?;
        }
        Ok(())
    }

    /// Hands over the last lines and waits for every chunk: `Ok(Some(error))` when one failed.
    async fn finish(&mut self, err: &mut impl Write) -> anyhow::Result<Option<anyhow::Error>> {
        if self.failed.is_none() {
            self.submit(err).await?;
        } else {
            self.pending.clear();
        }
        self.drain(err).await?;
        Ok(self.failed.take())
    }

    /// Waits for every chunk handed over, reporting each in order.
    async fn drain(&mut self, err: &mut impl Write) -> anyhow::Result<()> {
        while !self.in_flight.is_empty() {
            self.complete_oldest(err).await?;
        }
        Ok(())
    }

    /// Waits for the oldest chunk and reports its lines in order. A chunk whose write failed
    /// wrote nothing: the first such chunk is where the load stopped.
    async fn complete_oldest(&mut self, err: &mut impl Write) -> anyhow::Result<()> {
        let Some(chunk) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let written = match chunk.write {
            None if self.failed.is_some() => return Ok(()),
            None => Ok(Vec::new()),
            Some(write) => match write.await {
                Ok(result) => result.map_err(|e| anyhow::Error::new(e).context("failed to import")),
                Err(e) => Err(anyhow::Error::new(e).context("an import task failed")),
            },
        };
        let outcomes = match written {
            Ok(outcomes) => outcomes,
            Err(e) => {
                if self.failed.is_none() {
                    let first = chunk.lines.first().map_or(0, |(n, _)| *n);
                    self.summary.stopped_at_line = Some(first);
                    self.failed = Some(stopped_at(e, first));
                }
                return Ok(());
            }
        };
        self.report(chunk.lines, outcomes, err)
    }

    /// Reports a written chunk's lines in order.
    fn report(
        &mut self,
        lines: Vec<(u64, Pending)>,
        outcomes: Vec<ImportOutcome>,
        err: &mut impl Write,
    ) -> anyhow::Result<()> {
        let mut outcomes = outcomes.into_iter();
        for (line_no, pending) in lines {
            let result = match pending {
                Pending::Rejected(reason) => Err(reason),
                Pending::Valid => Ok(Loaded::Valid),
                Pending::Recorded(loaded) => Ok(loaded),
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
                    Some(ImportOutcome::UnknownCategory) => Err(LineError::UnknownCategory {
                        category: item.reminder.category().to_string(),
                        tenant,
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
        Ok(())
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

/// Why a line was rejected. Names the field; never carries a destination, subscriber
/// reference or content.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum LineError {
    #[error("line is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong,
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("unknown tenant {0:?}")]
    UnknownTenant(String),
    #[error("event_id {event_id:?} of tenant {tenant:?} is already used for a different reminder")]
    EventConflict { tenant: String, event_id: String },
    #[error("event_id {}", nudge_ledger::RESERVED_EVENT_ID)]
    ReservedEventId,
    /// A series line's problems, each `field: problem`.
    #[error("{0}")]
    Series(String),
    #[error("series_id {series_id:?} of tenant {tenant:?} is already used for a different series")]
    SeriesConflict { tenant: String, series_id: String },
    #[error("tenant {tenant:?} has no category {category:?} (nudgectl category create)")]
    UnknownCategory { tenant: String, category: String },
}

/// A series line's problems, each `field: problem`, in one line.
fn joined(problems: &[SeriesProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
