//! Subscriber references at rest: stored as a keyed hash, and rows written before that
//! converted by `convert_plaintext_subscribers`, with their destinations re-sealed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use nudge_domain::{Channel, EventId, SubscriberRef, TenantId};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    Destination, DestinationCipher, ImportOutcome, ImportReminder, Ledger, LedgerError,
    NewReminder, SubscriberConversion,
};
use sqlx::PgPool;

/// The destination key of `test_support::cipher()`.
const DESTINATION_KEY: [u8; 32] = [42u8; 32];

fn aad(tenant: TenantId, channel: Channel, subscriber: &str) -> Vec<u8> {
    format!("destination:{tenant}:{channel}:{subscriber}").into_bytes()
}

/// A destination sealed as the ledger seals it (`nonce || ciphertext`).
fn seal(plain: &[u8], aad: &[u8]) -> Vec<u8> {
    let aead = XChaCha20Poly1305::new((&DESTINATION_KEY).into());
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let mut out = nonce.to_vec();
    out.extend(aead.encrypt(&nonce, Payload { msg: plain, aad }).unwrap());
    out
}

fn open(sealed: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
    let aead = XChaCha20Poly1305::new((&DESTINATION_KEY).into());
    let (nonce, ciphertext) = sealed.split_at(24);
    aead.decrypt(
        XNonce::from_slice(nonce),
        Payload {
            msg: ciphertext,
            aad,
        },
    )
    .ok()
}

/// What a reader that needs no subscriber key does (the worker): join a reminder to its
/// contact on the stored reference and open the destination with associated data built from
/// that stored value.
async fn destination_as_a_sender_reads_it(
    pool: &PgPool,
    tenant: TenantId,
    event: &str,
    channel: Channel,
) -> Option<String> {
    let row: Option<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT r.subscriber_ref, c.destination_ciphertext FROM reminders r
         JOIN contacts c ON c.tenant_id = r.tenant_id AND c.subscriber_ref = r.subscriber_ref
                        AND c.channel = $3
         WHERE r.tenant_id = $1 AND r.event_id = $2",
    )
    .bind(tenant.as_uuid())
    .bind(event)
    .bind(channel.as_str())
    .fetch_optional(pool)
    .await
    .unwrap();
    let (stored, sealed) = row?;
    open(&sealed, &aad(tenant, channel, &stored)).map(|p| String::from_utf8(p).unwrap())
}

fn item(tenant: TenantId, event: &str, subscriber: &str, phone: &str) -> ImportReminder {
    ImportReminder {
        reminder: NewReminder::new(
            tenant,
            EventId::parse(event).unwrap(),
            SubscriberRef::parse(subscriber).unwrap(),
            &[Channel::Sms],
            t0() + secs(3600),
            t0() + secs(7200),
        )
        .unwrap(),
        contacts: vec![(Channel::Sms, Destination::new(phone))],
    }
}

async fn dump(pool: &PgPool) -> String {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT r::text FROM reminders r UNION ALL SELECT c::text FROM contacts c",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.join("\n")
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_subscriber_ref_is_stored_only_as_a_keyed_hash_and_its_destination_still_opens(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;

    ledger
        .import_reminders(
            &[item(tenant.id, "e-1", "patient-0042", "+15550142")],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    let all = dump(&pool).await;
    assert!(
        !all.contains("patient-0042"),
        "plaintext reference at rest:\n{all}"
    );
    let keyed: Vec<bool> = sqlx::query_scalar(
        "SELECT subscriber_ref_keyed FROM reminders UNION ALL SELECT subscriber_ref_keyed FROM contacts",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(keyed, [true, true]);
    assert_eq!(
        destination_as_a_sender_reads_it(&pool, tenant.id, "e-1", Channel::Sms).await,
        Some("+15550142".to_owned())
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn writing_a_reminder_without_the_subscriber_key_is_refused(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    let only_destination_key = DestinationCipher::new(&DESTINATION_KEY);

    let err = ledger
        .import_reminders(
            &[item(tenant.id, "e-1", "patient-0042", "+15550142")],
            &only_destination_key,
            t0(),
        )
        .await
        .unwrap_err();

    assert!(matches!(err, LedgerError::SubscriberKeyMissing), "{err:?}");
    assert!(!err.to_string().contains("patient"), "{err}");
    assert_eq!(dump(&pool).await, "");
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn plaintext_rows_from_before_the_keyed_hash_are_converted_and_still_open(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    // Three subscribers as the previous version wrote them: plaintext reference, destination
    // sealed under associated data naming it.
    for i in 1..=3 {
        let subscriber = format!("patient-{i}");
        sqlx::query(
            "INSERT INTO contacts (tenant_id, subscriber_ref, channel, destination_ciphertext, updated_at)
             VALUES ($1, $2, 'sms', $3, $4)",
        )
        .bind(tenant.id.as_uuid())
        .bind(&subscriber)
        .bind(seal(
            format!("+1555010{i}").as_bytes(),
            &aad(tenant.id, Channel::Sms, &subscriber),
        ))
        .bind(t0())
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO reminders (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at, expires_at, created_at)
             VALUES (gen_random_uuid(), $1, $2, $3, ARRAY['sms'], $4, $5, $4)",
        )
        .bind(tenant.id.as_uuid())
        .bind(format!("e-{i}"))
        .bind(&subscriber)
        .bind(t0() + secs(3600))
        .bind(t0() + secs(7200))
        .execute(&pool)
        .await
        .unwrap();
    }
    // Subscriber 3 was imported again after the upgrade, with a new number: that one is kept.
    let again = ledger
        .import_reminders(
            &[item(tenant.id, "e-3b", "patient-3", "+15550199")],
            &cipher(),
            t0() + secs(60),
        )
        .await
        .unwrap();
    assert!(matches!(again[0], ImportOutcome::Created { .. }));
    // And posting an unconverted reminder again is still recognised as the same one.
    let same = ledger
        .import_reminders(
            &[item(tenant.id, "e-1", "patient-1", "+15550101")],
            &cipher(),
            t0() + secs(60),
        )
        .await
        .unwrap();
    assert!(
        matches!(same[0], ImportOutcome::AlreadyPresent { .. }),
        "{same:?}"
    );
    assert_eq!(ledger.plaintext_subscribers().await.unwrap(), 3);

    let mut passes = Vec::new();
    loop {
        let pass = ledger
            .convert_plaintext_subscribers(&cipher(), 2)
            .await
            .unwrap();
        if pass.subscribers == 0 {
            break;
        }
        passes.push(pass);
    }

    assert_eq!(passes.iter().map(|p| p.subscribers).sum::<u64>(), 3);
    assert_eq!(passes.len(), 2, "batches of at most two: {passes:?}");
    assert_eq!(passes.iter().map(|p| p.reminders).sum::<u64>(), 3);
    assert_eq!(ledger.plaintext_subscribers().await.unwrap(), 0);
    let all = dump(&pool).await;
    assert!(
        !all.contains("patient-"),
        "plaintext reference left:\n{all}"
    );
    for (event, phone) in [
        ("e-1", "+15550101"),
        ("e-2", "+15550102"),
        ("e-3", "+15550199"),
        ("e-3b", "+15550199"),
    ] {
        assert_eq!(
            destination_as_a_sender_reads_it(&pool, tenant.id, event, Channel::Sms).await,
            Some(phone.to_owned()),
            "{event}"
        );
    }
    assert_eq!(
        ledger
            .convert_plaintext_subscribers(&cipher(), 2)
            .await
            .unwrap(),
        SubscriberConversion::default()
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_batch_answers_per_reminder_and_writes_nothing_of_a_conflict(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let tenant = tenant(&ledger).await;
    ledger
        .import_reminders(
            &[item(tenant.id, "e-1", "patient-1", "+15550101")],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
    let mut due_now = item(tenant.id, "e-due", "patient-4", "+15550104");
    due_now.reminder = NewReminder::new(
        tenant.id,
        EventId::parse("e-due").unwrap(),
        SubscriberRef::parse("patient-4").unwrap(),
        &[Channel::Sms, Channel::Email],
        t0() - secs(1),
        t0() + secs(3600),
    )
    .unwrap();

    let outcomes = ledger
        .import_reminders(
            &[
                item(tenant.id, "e-2", "patient-2", "+15550102"),
                item(tenant.id, "e-1", "patient-1", "+15550101"),
                item(tenant.id, "e-1", "patient-9", "+15550109"),
                item(TenantId::new(), "e-3", "patient-3", "+15550103"),
                item(tenant.id, "e-2", "patient-2", "+15550102"),
                due_now,
            ],
            &cipher(),
            t0(),
        )
        .await
        .unwrap();

    assert!(matches!(
        outcomes[0],
        ImportOutcome::Created {
            deliveries_created: 0,
            ..
        }
    ));
    assert!(matches!(outcomes[1], ImportOutcome::AlreadyPresent { .. }));
    assert_eq!(outcomes[2], ImportOutcome::EventConflict);
    assert_eq!(outcomes[3], ImportOutcome::UnknownTenant);
    match (outcomes[0], outcomes[4]) {
        (ImportOutcome::Created { id, .. }, ImportOutcome::AlreadyPresent { id: again }) => {
            assert_eq!(id, again, "the first occurrence in the batch wins");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        outcomes[5],
        ImportOutcome::Created {
            deliveries_created: 2,
            ..
        }
    ));
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        deliveries, 2,
        "the reminder already due got its deliveries at once"
    );
    let contacts: i64 = sqlx::query_scalar("SELECT count(*) FROM contacts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(contacts, 3, "patient-1, -2 and -4; nothing of the conflict");
}

#[test]
fn content_must_be_a_json_object_of_bounded_size() {
    let reminder = NewReminder::new(
        TenantId::new(),
        EventId::parse("e").unwrap(),
        SubscriberRef::parse("p").unwrap(),
        &[Channel::Sms],
        t0(),
        t0() + secs(1),
    )
    .unwrap();
    assert!(
        reminder
            .clone()
            .with_content(br#"{"template": "x"}"#.to_vec())
            .is_ok()
    );
    for bad in [&b"not json"[..], b"[1, 2]", b"\"text\"", b"{\"a\": "] {
        let err = reminder.clone().with_content(bad.to_vec()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid input: content must be a JSON object"
        );
    }
    let huge = format!(
        "{{\"a\": \"{}\"}}",
        "x".repeat(nudge_ledger::MAX_CONTENT_BYTES)
    );
    let err = reminder.with_content(huge.into_bytes()).unwrap_err();
    assert!(err.to_string().contains("larger than"), "{err}");
}
