//! `schedule set`: when the producer materialises a tenant's reminders.
//!
//! The cron expression is parsed here with the producer's own dialect (the `cron` crate), so
//! an expression the producer would refuse never reaches the ledger.

use std::fmt;
use std::io::Write;
use std::str::FromStr;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use nudge_ledger::Ledger;

const EXAMPLES: &str = "6 or 7 fields, seconds first, e.g. \"0 * * * * *\" (every minute) \
                        or \"0 0 7 * * Mon-Fri\" (07:00 UTC on weekdays)";

/// The ledger's limit on a stored expression.
const MAX_LEN: usize = 200;

/// A cron expression the producer can run: the `cron` crate's dialect (6 or 7 fields,
/// seconds first, evaluated in UTC), 1 to 200 bytes, surrounding whitespace removed.
#[derive(Debug, Clone)]
pub struct CronExpr {
    text: String,
    // Boxed: a parsed schedule is a few hundred bytes, and this travels inside `Command`.
    schedule: Box<cron::Schedule>,
}

/// Why a cron expression was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CronExprError {
    #[error("not a cron expression ({reason}); expected {EXAMPLES}")]
    Syntax { reason: String },
    #[error("a cron expression must be 1 to {MAX_LEN} bytes; expected {EXAMPLES}")]
    Length,
}

impl CronExpr {
    pub fn parse(text: &str) -> Result<Self, CronExprError> {
        let text = text.trim();
        if text.is_empty() || text.len() > MAX_LEN {
            return Err(CronExprError::Length);
        }
        let schedule = cron::Schedule::from_str(text).map_err(|e| CronExprError::Syntax {
            reason: one_line(&e.to_string()),
        })?;
        Ok(Self {
            text: text.to_owned(),
            schedule: Box::new(schedule),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The first tick strictly after `now`; `None` when the expression never fires again
    /// (a past year, or a date that does not exist such as 30 February).
    pub fn next_after(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.schedule.after(&now).next()
    }
}

/// The cron crate reports `expression \n caret \n message`; an operator reads one line:
/// `at column N: message`.
fn one_line(report: &str) -> String {
    let lines: Vec<&str> = report.lines().collect();
    if let [_, caret, message @ ..] = lines.as_slice()
        && let Some(at) = caret.find('^')
        && caret.trim() == "^"
    {
        let message = message.join(" ");
        let message = message.trim();
        let message = if message.is_empty() {
            "unexpected text"
        } else {
            message
        };
        return format!("at column {}: {message}", at + 1);
    }
    lines.join(" ")
}

impl FromStr for CronExpr {
    type Err = CronExprError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for CronExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

pub(crate) async fn set(
    ledger: &Ledger,
    actor: &str,
    tenant: &str,
    cron: &CronExpr,
    window_seconds: u32,
    reason: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    crate::require_reason(reason)?;
    let by = crate::operator(ledger, actor, Some(reason)).await?;
    let Some(next_tick) = cron.next_after(by.at()) else {
        bail!("the cron expression \"{cron}\" never fires after now; expected {EXAMPLES}");
    };
    let tenant = crate::find_tenant(ledger, tenant).await?;
    ledger
        .set_schedule(tenant.id, cron.as_str(), window_seconds, &by)
        .await
        .context("failed to set the schedule")?;
    writeln!(
        out,
        "tenant {}: schedule \"{cron}\" with a {window_seconds} s window; next tick {}",
        tenant.name,
        next_tick.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    #[test]
    fn a_six_field_expression_with_seconds_parses_and_is_stored_trimmed() {
        let cron = CronExpr::parse("  */5 * * * * *  ").unwrap();
        assert_eq!(cron.as_str(), "*/5 * * * * *");
        let now = Utc.with_ymd_and_hms(2026, 11, 30, 9, 0, 2).unwrap();
        assert_eq!(
            cron.next_after(now),
            Some(Utc.with_ymd_and_hms(2026, 11, 30, 9, 0, 5).unwrap())
        );
    }

    #[test]
    fn text_that_is_not_cron_is_refused_with_an_example() {
        let err = CronExpr::parse("not a cron").unwrap_err().to_string();
        assert!(err.starts_with("not a cron expression ("), "{err}");
        assert!(err.contains("\"0 * * * * *\""), "{err}");
        assert!(!err.contains('\n'), "{err}");
        let five = CronExpr::parse("0 * * * *").unwrap_err().to_string();
        assert!(
            five.starts_with("not a cron expression (at column 10: unexpected text)"),
            "{five}"
        );
        assert!(matches!(CronExpr::parse("   "), Err(CronExprError::Length)));
        assert!(matches!(
            CronExpr::parse(&"*".repeat(201)),
            Err(CronExprError::Length)
        ));
    }

    #[test]
    fn an_expression_for_a_past_year_never_fires() {
        let cron = CronExpr::parse("0 0 0 1 1 * 2020").unwrap();
        let now = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
        assert_eq!(cron.next_after(now), None);
    }
}
