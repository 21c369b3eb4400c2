//! `consent show|export`: the consent of a subscriber's destinations and its history, and a
//! tenant's whole consent history as JSON Lines. Never prints a destination: the export names
//! each by its keyed digest, which groups its entries and reveals nothing without the key.

use std::io::Write;

use anyhow::{Context, bail};
use nudge_domain::SubscriberRef;
use nudge_ledger::{CONSENT_PAGE_MAX, DestinationCipher, Ledger};

use crate::table::{Align, write_table};

pub const HELP: &str = "\
Consent: whether a patient's destination may be reached (a patient's STOP or START to an
account's number, a provider's opt-out), kept per tenant and destination whatever subscriber
it was posted for, and a subscriber's preferences per channel and category (a clinic's
PUT .../preferences), with one append-only history (docs/decisions/0505, 0506).

  consent show TENANT SUBSCRIBER_REF   each of the subscriber's destinations as it stands, the
                                       preferences they changed (channel and category), and the
                                       history of both: when, from where, who, the keyword
  consent export TENANT                the tenant's whole history as JSON Lines, oldest first,
                                       each destination as its keyed digest (never the number),
                                       each preference by its subject (a random id) and category

`show` needs crypto.destination_key and crypto.subscriber_key (subscriber references are
stored as a keyed hash); `export` needs neither.";

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// `consent show TENANT SUBSCRIBER_REF`.
pub async fn show(
    ledger: &Ledger,
    cipher: &DestinationCipher,
    tenant: &str,
    subscriber: &str,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let subscriber =
        SubscriberRef::parse(subscriber).map_err(|e| anyhow::anyhow!("SUBSCRIBER_REF: {e}"))?;
    let mut after = None;
    let mut current = None;
    let mut rows = Vec::new();
    loop {
        let Some(page) = ledger
            .subscriber_consent(cipher, id, &subscriber, after, CONSENT_PAGE_MAX)
            .await
            .context("failed to read the subscriber's consent")?
        else {
            bail!(
                "this subscriber holds no destination and has no preference in tenant {tenant} \
                 (never posted, or erased)"
            );
        };
        current.get_or_insert(page.current);
        for (_, channel, e) in page.entries {
            rows.push(vec![
                time(e.recorded_at),
                channel.to_string(),
                e.category.unwrap_or_else(|| "-".to_owned()),
                e.state.to_string(),
                e.source.to_string(),
                e.actor,
                e.keyword.unwrap_or_else(|| "-".to_owned()),
                e.correlation_id.unwrap_or_else(|| "-".to_owned()),
            ]);
        }
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let current = current.unwrap_or_default();
    if current.is_empty() {
        writeln!(
            out,
            "no consent recorded for this subscriber's destinations: every channel may be sent to"
        )?;
    } else {
        let now: Vec<Vec<String>> = current
            .into_iter()
            .map(|(channel, c)| {
                vec![
                    channel.to_string(),
                    c.state.to_string(),
                    c.source.to_string(),
                    c.actor,
                    time(c.changed_at),
                ]
            })
            .collect();
        write_table(
            out,
            "",
            &[
                ("channel", Align::Left),
                ("state", Align::Left),
                ("source", Align::Left),
                ("actor", Align::Left),
                ("since", Align::Left),
            ],
            &now,
        )?;
    }
    let preferences = ledger
        .subscriber_preferences(cipher, id, &subscriber)
        .await
        .context("failed to read the subscriber's preferences")?
        .map(|p| p.entries)
        .unwrap_or_default();
    let changed: Vec<Vec<String>> = preferences
        .into_iter()
        .filter(|p| p.source.is_some())
        .map(|p| {
            vec![
                p.channel.to_string(),
                p.category.to_string(),
                if p.required { "yes" } else { "no" }.to_owned(),
                p.state.to_string(),
                p.source.map(|s| s.to_string()).unwrap_or_default(),
                p.actor.unwrap_or_default(),
                p.changed_at.map(time).unwrap_or_default(),
            ]
        })
        .collect();
    if changed.is_empty() {
        writeln!(
            out,
            "\nno preference changed: every category is on for every channel"
        )?;
    } else {
        writeln!(out, "\npreferences changed (every other one is on):")?;
        write_table(
            out,
            "",
            &[
                ("channel", Align::Left),
                ("category", Align::Left),
                ("required", Align::Left),
                ("state", Align::Left),
                ("source", Align::Left),
                ("actor", Align::Left),
                ("since", Align::Left),
            ],
            &changed,
        )?;
    }
    if !rows.is_empty() {
        writeln!(out, "\nhistory, oldest first:")?;
        write_table(
            out,
            "",
            &[
                ("at", Align::Left),
                ("channel", Align::Left),
                ("category", Align::Left),
                ("state", Align::Left),
                ("source", Align::Left),
                ("actor", Align::Left),
                ("keyword", Align::Left),
                ("correlation id", Align::Left),
            ],
            &rows,
        )?;
    }
    Ok(())
}

/// `consent export TENANT`: one JSON object per line, page by page.
pub async fn export(ledger: &Ledger, tenant: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let id = crate::find_tenant(ledger, tenant).await?.id;
    let mut after = 0;
    loop {
        let page = ledger
            .consent_history_page(id, after, CONSENT_PAGE_MAX)
            .await
            .context("failed to read the consent history")?;
        let Some(last) = page.last() else {
            return Ok(());
        };
        after = last.id;
        for entry in &page {
            serde_json::to_writer(&mut *out, entry)?;
            writeln!(out)?;
        }
    }
}
