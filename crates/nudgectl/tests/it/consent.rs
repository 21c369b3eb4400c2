//! `nudgectl consent show|export`: a subscriber's consent and its history, and a tenant's
//! history as JSON Lines, never with a destination.
#![allow(clippy::unwrap_used)]

use clap::Parser;
use nudge_domain::{Channel, ConsentState, ProviderAccount, SubscriberRef};
use nudge_ledger::{
    Destination, DestinationCipher, InboundKeyword, Ledger, LedgerTime, Operator, SubscriberKey,
};
use nudgectl::{Cli, execute};
use sqlx::PgPool;

fn cipher() -> DestinationCipher {
    DestinationCipher::new(&[7u8; 32]).with_subscriber_key(SubscriberKey::new(&[8u8; 32]))
}

async fn ctl(
    ledger: &Ledger,
    cipher: Option<&DestinationCipher>,
    args: &[&str],
) -> anyhow::Result<String> {
    let command =
        Cli::try_parse_from(std::iter::once("nudgectl").chain(args.iter().copied()))?.command;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    execute(ledger, "ops@clinic", cipher, command, &mut out, &mut err).await?;
    Ok(String::from_utf8(out)?)
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn consent_show_and_export_tell_who_changed_it_when_and_never_the_number(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let by = Operator::new("ops", Some("test"), chrono::Utc::now()).unwrap();
    let tenant = ledger.create_tenant("clinic-a", &by).await.unwrap();
    let account = ProviderAccount::parse("sms-main").unwrap();
    ledger
        .set_tenant_channel_account(tenant.id, Channel::Sms, Some(&account), &by)
        .await
        .unwrap();
    ledger
        .upsert_contact(
            tenant.id,
            &SubscriberRef::parse("patient-1").unwrap(),
            Channel::Sms,
            &Destination::new("+15550101"),
            &cipher(),
            chrono::Utc::now(),
        )
        .await
        .unwrap();
    let never = ctl(
        &ledger,
        Some(&cipher()),
        &["consent", "show", "clinic-a", "patient-1"],
    )
    .await
    .unwrap();
    assert!(never.contains("no consent recorded"), "{never}");

    for (state, word, sid) in [
        (ConsentState::OptedOut, "STOP", "twilio:SM1"),
        (ConsentState::OptedIn, "Start", "twilio:SM2"),
    ] {
        ledger
            .record_inbound_keyword(
                &cipher(),
                &InboundKeyword {
                    account: &account,
                    channel: Channel::Sms,
                    destination: &Destination::new("+15550101"),
                    state,
                    keyword: word,
                    provider_event: sid,
                    correlation_id: Some("corr-7"),
                },
                LedgerTime::Database,
            )
            .await
            .unwrap();
    }

    let shown = ctl(
        &ledger,
        Some(&cipher()),
        &["consent", "show", "clinic-a", "patient-1"],
    )
    .await
    .unwrap();
    assert!(shown.contains("opted_in"), "{shown}");
    assert!(shown.contains("inbound:sms-main"), "{shown}");
    let history: Vec<&str> = shown
        .lines()
        .skip_while(|l| !l.starts_with("history"))
        .filter(|l| l.contains("inbound_keyword"))
        .collect();
    assert_eq!(history.len(), 2, "{shown}");
    assert!(
        history[0].contains("opted_out") && history[0].contains("STOP"),
        "{shown}"
    );
    assert!(
        history[1].contains("opted_in") && history[1].contains("Start"),
        "{shown}"
    );
    assert!(!shown.contains("5550101"), "the number is shown: {shown}");

    let missing = ctl(
        &ledger,
        Some(&cipher()),
        &["consent", "show", "clinic-a", "patient-9"],
    )
    .await
    .unwrap_err();
    assert!(
        missing.to_string().contains("holds no destination"),
        "{missing}"
    );
    let keyless = ctl(&ledger, None, &["consent", "show", "clinic-a", "patient-1"])
        .await
        .unwrap_err();
    assert!(
        keyless.to_string().contains("crypto.subscriber_key"),
        "{keyless}"
    );

    let exported = ctl(&ledger, None, &["consent", "export", "clinic-a"])
        .await
        .unwrap();
    let lines: Vec<serde_json::Value> = exported
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{exported}");
    assert_eq!(lines[0]["state"], "opted_out");
    assert_eq!(lines[0]["source"], "inbound_keyword");
    assert_eq!(lines[0]["channel"], "sms");
    assert_eq!(lines[0]["keyword"], "STOP");
    assert_eq!(lines[1]["state"], "opted_in");
    assert_eq!(
        lines[0]["destination_digest"], lines[1]["destination_digest"],
        "one destination's entries share its digest"
    );
    assert_eq!(lines[0]["destination_digest"].as_str().unwrap().len(), 64);
    assert!(!exported.contains("5550101"), "{exported}");
    assert!(
        ctl(&ledger, None, &["consent", "export", "clinic-b"])
            .await
            .unwrap_err()
            .to_string()
            .contains("no tenant named")
    );
}
