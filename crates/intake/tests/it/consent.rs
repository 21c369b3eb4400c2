//! A subscriber's consent through the API: each destination's as it stands and its history,
//! paged, with the keyword, the source and the time of each change, and no destination.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use axum::http::StatusCode;
use nudge_domain::{Channel, ConsentState, ProviderAccount};
use nudge_ledger::{Destination, InboundKeyword, LedgerTime};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::api::{Intake, assert_no_phi, cipher, intake_at, now, operator};

const HISTORY: &str = "/v1/tenants/clinic/subscribers/patient-42/consent-history";

async fn keyword(intake: &Intake, state: ConsentState, word: &str, sid: &str) {
    let account = ProviderAccount::parse("sms-main").unwrap();
    intake
        .ledger
        .record_inbound_keyword(
            &cipher(),
            &InboundKeyword {
                account: &account,
                channel: Channel::Sms,
                destination: &Destination::new("+15550100100"),
                state,
                keyword: word,
                provider_event: sid,
                correlation_id: None,
            },
            LedgerTime::Database,
        )
        .await
        .unwrap();
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_subscribers_consent_and_its_history_are_read_back_paged_without_the_destination(
    pool: PgPool,
) {
    let intake = intake_at(pool, Arc::new(now)).await;
    let tenant = intake
        .ledger
        .tenant_by_name("clinic")
        .await
        .unwrap()
        .unwrap();
    intake
        .ledger
        .set_tenant_channel_account(
            tenant.id,
            Channel::Sms,
            Some(&ProviderAccount::parse("sms-main").unwrap()),
            &operator(),
        )
        .await
        .unwrap();
    // Not posted yet: nothing to read.
    let missing = intake.call("GET", HISTORY, &Value::Null).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.text);

    let put = intake
        .call(
            "PUT",
            "/v1/tenants/clinic/subscribers/patient-42/contacts",
            &json!({"destinations": {"sms": "+1 555 010 0100", "email": "pat@example.org"}}),
        )
        .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);
    keyword(&intake, ConsentState::OptedOut, "STOP", "twilio:SM1").await;
    keyword(&intake, ConsentState::OptedIn, "start", "twilio:SM2").await;
    keyword(&intake, ConsentState::OptedOut, "Quit", "twilio:SM3").await;

    let first = intake
        .call("GET", &format!("{HISTORY}?limit=2"), &Value::Null)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_no_phi(&first.text);
    assert_eq!(
        first.body["current"],
        json!([{"channel": "sms", "state": "opted_out", "source": "inbound_keyword",
                "changed_at": first.body["current"][0]["changed_at"]}])
    );
    let words: Vec<&str> = first.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["keyword"].as_str().unwrap())
        .collect();
    assert_eq!(words, ["STOP", "start"]);
    assert_eq!(first.body["entries"][0]["actor"], "inbound:sms-main");
    let next = first.body["next_after"].as_i64().expect("a next page");

    let second = intake
        .call(
            "GET",
            &format!("{HISTORY}?after={next}&limit=2"),
            &Value::Null,
        )
        .await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.text);
    let entries = second.body["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["keyword"], "Quit");
    assert_eq!(entries[0]["state"], "opted_out");
    assert!(second.body["next_after"].is_null());

    for query in ["?after=-1", "?limit=0", "?limit=501", "?page=2", "?after=x"] {
        let bad = intake
            .call("GET", &format!("{HISTORY}{query}"), &Value::Null)
            .await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{query}: {}", bad.text);
    }

    // Erased: nothing to read; the number's opt-out stays (decision 0505).
    let erased = intake
        .call(
            "DELETE",
            "/v1/tenants/clinic/subscribers/patient-42",
            &Value::Null,
        )
        .await;
    assert_eq!(erased.status, StatusCode::OK, "{}", erased.text);
    let gone = intake.call("GET", HISTORY, &Value::Null).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    let kept = intake
        .ledger
        .destination_consent(
            &cipher(),
            tenant.id,
            Channel::Sms,
            &Destination::new("+15550100100"),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.state, ConsentState::OptedOut);
}
