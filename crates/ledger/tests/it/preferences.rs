//! Categories and a subscriber's preferences (decision 0506): a reminder names one of its
//! tenant's categories, a category switched off on a channel is suppressed at materialisation
//! and at the fence, a required one cannot be switched off but a STOP still stops it, an
//! erasure deletes the preferences and leaves their history naming no one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use nudge_domain::series::{Series, SeriesLimits};
use nudge_domain::{
    AdmissionSettings, Category, Channel, ConsentSource, ConsentState, ContactFlag, DeliveryState,
    ExpiresAfter, IdempotencySupport, LocalTime, SubscriberRef, TenantId, Zone,
};
use nudge_ledger::test_support::*;
use nudge_ledger::{
    CategoryCreated, Destination, FenceRefused, ImportOutcome, ImportReminder, InboundKeyword,
    LeaseOutcome, Ledger, LedgerError, LedgerTime, NewSeries, Operator, PreferenceAuthor,
    PreferenceChange, SendSlot, SeriesOutcome,
};
use sqlx::PgPool;

const NUMBER: &str = "+15550100100";
const PATIENT: &str = "patient-0001";

fn category(name: &str) -> Category {
    Category::parse(name).unwrap()
}

fn patient() -> SubscriberRef {
    SubscriberRef::parse(PATIENT).unwrap()
}

async fn with_number(ledger: &Ledger, tenant: TenantId) {
    ledger
        .upsert_contact(
            tenant,
            &patient(),
            Channel::Sms,
            &Destination::new(NUMBER),
            &cipher(),
            t0(),
        )
        .await
        .unwrap();
}

async fn set(
    ledger: &Ledger,
    tenant: TenantId,
    changes: &[(Channel, &str, ConsentState)],
) -> Result<u64, LedgerError> {
    let changes: Vec<PreferenceChange> = changes
        .iter()
        .map(|(channel, name, state)| PreferenceChange {
            channel: *channel,
            category: category(name),
            state: *state,
        })
        .collect();
    ledger
        .set_preferences(
            &cipher(),
            tenant,
            &patient(),
            &changes,
            &PreferenceAuthor {
                source: ConsentSource::Api,
                actor: "api:clinic-a",
                correlation_id: Some("corr-p"),
            },
            LedgerTime::Database,
        )
        .await
}

/// Creates an SMS reminder of `category` due at t0 and materialises it; its delivery's state.
async fn due_now(ledger: &Ledger, tenant: TenantId, event: &str, name: &str) -> DeliveryState {
    let id = ledger
        .create_reminder(
            &reminder(tenant, event, &[Channel::Sms], t0()).with_category(category(name)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap()
        .id;
    ledger.materialise_reminder(tenant, id, t0()).await.unwrap();
    let status = ledger
        .reminder_status(tenant, &nudge_domain::EventId::parse(event).unwrap())
        .await
        .unwrap()
        .unwrap();
    status.channels[0].state.unwrap()
}

async fn history_len(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM consent_history")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_reminder_names_one_of_its_tenants_categories(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("appointments are legal notices"), t0()).unwrap();
    assert_eq!(
        ledger
            .create_category(clinic.id, &category("appointment"), true, &by)
            .await
            .unwrap(),
        CategoryCreated::Created
    );
    assert_eq!(
        ledger
            .create_category(clinic.id, &category("appointment"), true, &by)
            .await
            .unwrap(),
        CategoryCreated::AlreadyPresent
    );
    assert!(matches!(
        ledger
            .create_category(clinic.id, &category("appointment"), false, &by)
            .await,
        Err(LedgerError::InvalidInput(_))
    ));
    assert!(matches!(
        ledger
            .create_category(clinic.id, &Category::general(), false, &by)
            .await,
        Err(LedgerError::InvalidInput(_))
    ));
    let names: Vec<(String, bool)> = ledger
        .categories(clinic.id)
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.name.to_string(), c.required))
        .collect();
    assert_eq!(
        names,
        [
            ("general".to_owned(), false),
            ("appointment".to_owned(), true)
        ]
    );

    // A batch: the unknown category is refused on its own, the others are written.
    let items: Vec<ImportReminder> = [("r1", "general"), ("r2", "billing"), ("r3", "appointment")]
        .into_iter()
        .map(|(event, name)| ImportReminder {
            reminder: reminder(clinic.id, event, &[Channel::Sms], t0() + secs(3600))
                .with_category(category(name)),
            contacts: vec![(Channel::Sms, Destination::new(NUMBER))],
        })
        .collect();
    let outcomes = ledger
        .import_reminders(&items, &cipher(), t0())
        .await
        .unwrap();
    assert!(matches!(outcomes[0], ImportOutcome::Created { .. }));
    assert_eq!(outcomes[1], ImportOutcome::UnknownCategory);
    assert!(matches!(outcomes[2], ImportOutcome::Created { .. }));
    let single: Result<_, _> = ledger
        .create_reminder(
            &reminder(clinic.id, "r4", &[Channel::Sms], t0()).with_category(category("billing")),
            &cipher(),
            t0(),
        )
        .await;
    assert!(matches!(single, Err(LedgerError::UnknownCategory(c)) if c == "billing"));
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_category_switched_off_is_suppressed_on_its_channel_only(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("billing"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("billing"), false, &by)
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    assert_eq!(
        set(
            &ledger,
            clinic.id,
            &[(Channel::Sms, "billing", ConsentState::OptedOut)]
        )
        .await
        .unwrap(),
        1
    );
    // The same again writes nothing.
    assert_eq!(
        set(
            &ledger,
            clinic.id,
            &[(Channel::Sms, "billing", ConsentState::OptedOut)]
        )
        .await
        .unwrap(),
        0
    );
    assert_eq!(history_len(&pool).await, 1);
    assert_eq!(
        due_now(&ledger, clinic.id, "bill-1", "billing").await,
        DeliveryState::Suppressed
    );
    assert_eq!(
        due_now(&ledger, clinic.id, "note-1", "general").await,
        DeliveryState::Scheduled
    );
    let status = ledger.status(t0()).await.unwrap();
    let sms = status.iter().find(|s| s.channel == Channel::Sms).unwrap();
    assert_eq!(sms.suppressed, 1, "status counts what was suppressed");
    let prefs = ledger
        .subscriber_preferences(&cipher(), clinic.id, &patient())
        .await
        .unwrap()
        .unwrap();
    let off: Vec<(Channel, String, Option<ConsentSource>)> = prefs
        .entries
        .iter()
        .filter(|p| p.state == ConsentState::OptedOut)
        .map(|p| (p.channel, p.category.to_string(), p.source))
        .collect();
    assert_eq!(
        off,
        [(Channel::Sms, "billing".to_owned(), Some(ConsentSource::Api))]
    );
    assert_eq!(
        prefs.entries.len(),
        3 * 2,
        "every channel by every category"
    );

    // Back on: sent again.
    set(
        &ledger,
        clinic.id,
        &[(Channel::Sms, "billing", ConsentState::OptedIn)],
    )
    .await
    .unwrap();
    assert_eq!(
        due_now(&ledger, clinic.id, "bill-2", "billing").await,
        DeliveryState::Scheduled
    );
    let page = ledger
        .subscriber_consent(&cipher(), clinic.id, &patient(), None, 100)
        .await
        .unwrap()
        .unwrap();
    let seen: Vec<(Option<&str>, ConsentState, &str, Option<&str>)> = page
        .entries
        .iter()
        .map(|(_, _, e)| {
            (
                e.category.as_deref(),
                e.state,
                e.actor.as_str(),
                e.correlation_id.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (
                Some("billing"),
                ConsentState::OptedOut,
                "api:clinic-a",
                Some("corr-p")
            ),
            (
                Some("billing"),
                ConsentState::OptedIn,
                "api:clinic-a",
                Some("corr-p")
            ),
        ]
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_required_category_stays_on_but_a_stop_still_stops_it(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("legal notices"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("appointment"), true, &by)
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    // Refused whole: the optional change in the same request is not written either.
    let refused = set(
        &ledger,
        clinic.id,
        &[
            (Channel::Email, "general", ConsentState::OptedOut),
            (Channel::Sms, "appointment", ConsentState::OptedOut),
        ],
    )
    .await;
    assert!(matches!(refused, Err(LedgerError::CategoryRequired(c)) if c == "appointment"));
    assert!(matches!(
        set(
            &ledger,
            clinic.id,
            &[(Channel::Sms, "billing", ConsentState::OptedOut)]
        )
        .await,
        Err(LedgerError::UnknownCategory(c)) if c == "billing"
    ));
    assert_eq!(history_len(&pool).await, 0, "nothing written");
    assert_eq!(
        due_now(&ledger, clinic.id, "appt-1", "appointment").await,
        DeliveryState::Scheduled
    );

    ledger
        .announce_default_account(Channel::Sms, &account("main"), at(t0()))
        .await
        .unwrap();
    ledger
        .record_inbound_keyword(
            &cipher(),
            &InboundKeyword {
                account: &account("main"),
                channel: Channel::Sms,
                destination: &Destination::new(NUMBER),
                state: ConsentState::OptedOut,
                keyword: "STOP",
                provider_event: "twilio:SM1",
                correlation_id: None,
            },
            at(t0()),
        )
        .await
        .unwrap();
    assert_eq!(
        due_now(&ledger, clinic.id, "appt-2", "appointment").await,
        DeliveryState::Suppressed
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_category_switched_off_while_sends_wait_for_their_slots_stops_them(pool: PgPool) {
    const WAITING: usize = 10;
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("billing"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("billing"), false, &by)
        .await
        .unwrap();
    ledger
        .ensure_bucket(&account("main"), Channel::Sms, 10.0, 1, t0())
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    for i in 0..=WAITING {
        let id = ledger
            .create_reminder(
                &reminder(clinic.id, &format!("b{i}"), &[Channel::Sms], t0())
                    .with_category(category("billing")),
                &cipher(),
                t0(),
            )
            .await
            .unwrap()
            .id;
        ledger
            .materialise_reminder(clinic.id, id, t0())
            .await
            .unwrap();
    }
    let due = claim_all(&ledger, t0()).await;
    assert_eq!(due.len(), WAITING + 1);
    let routes = routes(IdempotencySupport::Honoured);
    let settings = AdmissionSettings {
        max_wait: Duration::from_secs(10),
        ..AdmissionSettings::default()
    };
    let cipher = cipher();
    let batch = batch_of(
        Channel::Sms,
        "worker-1",
        &routes,
        &settings,
        &cipher,
        at(t0()),
    );
    let pointers: Vec<_> = due.iter().map(|d| d.message_pointer()).collect();
    let waiting: Vec<_> = ledger
        .lease_batch(&batch, &pointers)
        .await
        .unwrap()
        .outcomes
        .into_iter()
        .filter_map(|o| match o {
            LeaseOutcome::Leased {
                lease,
                slot: SendSlot::At { reserved_at, .. },
                ..
            } => Some((lease, reserved_at)),
            _ => None,
        })
        .collect();
    assert_eq!(waiting.len(), WAITING);

    set(
        &ledger,
        clinic.id,
        &[(Channel::Sms, "billing", ConsentState::OptedOut)],
    )
    .await
    .unwrap();
    for (lease, reserved_at) in &waiting {
        let fenced = ledger
            .fence(
                lease,
                *reserved_at,
                LEASE,
                Duration::from_secs(10),
                at(t0() + secs(2)),
            )
            .await
            .unwrap();
        assert_eq!(fenced, Err(FenceRefused::OptedOut));
        let record = ledger.delivery(lease.id).await.unwrap().unwrap();
        assert_eq!(record.state, DeliveryState::Suppressed);
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_erasure_deletes_the_preferences_and_their_history_names_no_one(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    with_number(&ledger, clinic.id).await;
    set(
        &ledger,
        clinic.id,
        &[(Channel::Email, "general", ConsentState::OptedOut)],
    )
    .await
    .unwrap();
    let erasure = ledger
        .erase_subscriber(
            clinic.id,
            &patient(),
            &cipher(),
            &Operator::new("ops", Some("erasure request"), t0()).unwrap(),
            at(t0() + secs(1)),
        )
        .await
        .unwrap();
    assert_eq!(erasure.preferences_deleted, 1);
    assert_eq!(history_len(&pool).await, 1, "the history stays");
    let linked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM consent_history h
         WHERE EXISTS (SELECT 1 FROM subscriber_preferences p WHERE p.subject = h.subject)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        linked, 0,
        "no preference row names the entry's subject any more"
    );
    assert!(
        ledger
            .subscriber_preferences(&cipher(), clinic.id, &patient())
            .await
            .unwrap()
            .is_none()
    );
    // The history stays append-only for preferences' entries too.
    let err = sqlx::query("UPDATE consent_history SET state = 'opted_in'")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("consent is never removed"),
        "{err}"
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_series_names_a_category_its_occurrences_carry(pool: PgPool) {
    let ledger = Ledger::from_pool(pool.clone());
    let clinic = tenant(&ledger).await;
    let rule = "FREQ=DAILY;COUNT=3";
    let series = |id: &str, name: &str| {
        NewSeries::new(
            clinic.id,
            id,
            patient(),
            &[Channel::Sms],
            Series::parse(
                rule,
                LocalTime::parse("2026-11-29T08:00:00").unwrap(),
                Zone::parse("Europe/Berlin").unwrap(),
                &SeriesLimits {
                    max_ahead: chrono::TimeDelta::days(366),
                    max_per_day: 24,
                },
            )
            .unwrap(),
            rule,
            ExpiresAfter::from_secs(86_400 * 7).unwrap(),
        )
        .unwrap()
        .with_category(category(name))
        .with_request_digest(id.as_bytes().to_vec())
    };
    let contacts = vec![(Channel::Sms, Destination::new(NUMBER))];
    assert_eq!(
        ledger
            .create_series(&series("med", "medication"), &contacts, &cipher(), t0())
            .await
            .unwrap(),
        SeriesOutcome::UnknownCategory
    );
    let by = Operator::new("ops", Some("medication"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("medication"), false, &by)
        .await
        .unwrap();
    let created = ledger
        .create_series(&series("med", "medication"), &contacts, &cipher(), t0())
        .await
        .unwrap();
    assert!(
        matches!(created, SeriesOutcome::Created { .. }),
        "{created:?}"
    );
    // A window of two days creates its occurrences.
    ledger
        .materialise_window(clinic.id, t0(), t0() + secs(2 * 86_400), t0())
        .await
        .unwrap();
    let categories: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT category FROM reminders WHERE series_key IS NOT NULL")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        categories,
        ["medication"],
        "the occurrences carry the series' category"
    );
}

/// A reminder due later, materialised now: created owed whatever its consent says, so that
/// what changes before its time decides.
async fn due_later(ledger: &Ledger, tenant: TenantId, event: &str, name: &str) -> DeliveryState {
    let id = ledger
        .create_reminder(
            &reminder(tenant, event, &[Channel::Sms], t0() + secs(600))
                .with_category(category(name)),
            &cipher(),
            t0(),
        )
        .await
        .unwrap()
        .id;
    ledger.materialise_reminder(tenant, id, t0()).await.unwrap();
    let status = ledger
        .reminder_status(tenant, &nudge_domain::EventId::parse(event).unwrap())
        .await
        .unwrap()
        .unwrap();
    status.channels[0].state.unwrap()
}

/// The flag the lease of the tenant's due SMS delivery carries at `now`.
async fn lease_flag(ledger: &Ledger, now: chrono::DateTime<chrono::Utc>) -> Option<ContactFlag> {
    let due = claim_all(ledger, now).await;
    assert_eq!(due.len(), 1);
    match lease(ledger, &due[0], now).await {
        LeaseOutcome::Leased { material, .. } => material.unwrap().contact_flag,
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_opt_in_before_the_reminders_time_sends_it_though_it_was_opted_out_when_made(
    pool: PgPool,
) {
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("billing"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("billing"), false, &by)
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    set(
        &ledger,
        clinic.id,
        &[(Channel::Sms, "billing", ConsentState::OptedOut)],
    )
    .await
    .unwrap();
    // Opted out when made, due in ten minutes: created owed.
    assert_eq!(
        due_later(&ledger, clinic.id, "bill-later", "billing").await,
        DeliveryState::Scheduled
    );
    // Back on before its time: sent.
    set(
        &ledger,
        clinic.id,
        &[(Channel::Sms, "billing", ConsentState::OptedIn)],
    )
    .await
    .unwrap();
    assert_eq!(lease_flag(&ledger, t0() + secs(600)).await, None);
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_category_switched_off_after_its_delivery_was_made_is_seen_by_the_lease(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("billing"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("billing"), false, &by)
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    assert_eq!(
        due_later(&ledger, clinic.id, "bill-later", "billing").await,
        DeliveryState::Scheduled
    );
    set(
        &ledger,
        clinic.id,
        &[(Channel::Sms, "billing", ConsentState::OptedOut)],
    )
    .await
    .unwrap();
    assert_eq!(
        lease_flag(&ledger, t0() + secs(600)).await,
        Some(ContactFlag::OptedOut)
    );
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn switching_a_required_category_off_and_on_again_in_one_request_is_accepted(pool: PgPool) {
    let ledger = Ledger::from_pool(pool);
    let clinic = tenant(&ledger).await;
    let by = Operator::new("ops", Some("legal notices"), t0()).unwrap();
    ledger
        .create_category(clinic.id, &category("appointment"), true, &by)
        .await
        .unwrap();
    with_number(&ledger, clinic.id).await;
    let written = set(
        &ledger,
        clinic.id,
        &[
            (Channel::Sms, "appointment", ConsentState::OptedOut),
            (Channel::Sms, "appointment", ConsentState::OptedIn),
        ],
    )
    .await
    .unwrap();
    assert_eq!(written, 1, "the last of the two, an explicit opt-in");
}
