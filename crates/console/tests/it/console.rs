//! Logging in, reading every page, and acting: an operator's actions are the ledger's own,
//! audited with the reason given; a viewer's POST and a form without the session's CSRF
//! token are refused with 403 and write nothing; a revoked token ends its session.

use std::sync::Arc;

use chrono::Utc;
use nudge_console::{AppState, ConsoleMetrics, ConsoleSection, serve};
use nudge_domain::Channel;
use nudge_ledger::test_support::*;
use nudge_ledger::{ConsoleRole, Ledger};
use reqwest::StatusCode;
use reqwest::redirect::Policy;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const SESSION_KEY: &str = "c2Vzc2lvbi1rZXktb2YtdGhlLWNvbnNvbGUtdGVzdHMtMzItYnl0ZXMtYXQtbGVhc3Q=";

fn section() -> ConsoleSection {
    ConsoleSection {
        session_key: Some(nudge_config::Secret::new(SESSION_KEY)),
        secure_cookies: false,
        ..ConsoleSection::default()
    }
}

/// A console served on loopback, connected as `nudge_console`.
struct Console {
    base: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Console {
    async fn start(pool: &PgPool, section: ConsoleSection) -> Self {
        let ledger = connected_as(pool, "nudge_console").await;
        let state = AppState::new(ledger, &section, Arc::new(ConsoleMetrics::new())).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { serve(listener, state, stop).await.unwrap() }
        });
        Self { base, stop, task }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
    }
}

/// A browser: keeps cookies, does not follow redirects.
fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .cookie_store(true)
        .redirect(Policy::none())
        .build()
        .unwrap()
}

async fn token(owner: &Ledger, name: &str, role: ConsoleRole) -> (i64, String) {
    let made = owner
        .create_console_token(name, role, chrono::Duration::hours(1), &ops(Utc::now()))
        .await
        .unwrap();
    (made.token.id, made.secret.expose().to_owned())
}

async fn login(console: &Console, client: &reqwest::Client, secret: &str) {
    let answer = client
        .post(console.url("/login"))
        .form(&[("token", secret)])
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        StatusCode::SEE_OTHER,
        "login answered {answer:?}"
    );
    assert_eq!(answer.headers()["location"], "/");
}

async fn page(console: &Console, client: &reqwest::Client, path: &str) -> (StatusCode, String) {
    let answer = client.get(console.url(path)).send().await.unwrap();
    let status = answer.status();
    (status, answer.text().await.unwrap())
}

/// The CSRF token the page's forms carry.
fn csrf(html: &str) -> String {
    let at = html
        .find("name=\"csrf\" value=\"")
        .expect("the page has a form with a CSRF token")
        + "name=\"csrf\" value=\"".len();
    html[at..].split('"').next().unwrap().to_owned()
}

async fn audit_count(pool: &PgPool, action: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = $1")
        .bind(action)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_viewer_reads_every_page_and_every_action_of_theirs_is_refused(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let clinic = tenant(&owner).await;
    let now = db_now(&owner).await;
    let dead = dead_letter(
        &owner,
        clinic.id,
        "appt-dead",
        now,
        chrono::Duration::hours(1),
    )
    .await;
    owed(
        &owner,
        clinic.id,
        "appt-later",
        &[Channel::Email],
        now + chrono::Duration::hours(2),
    )
    .await;
    let (_, secret) = token(&owner, "vera", ConsoleRole::Viewer).await;
    let console = Console::start(&pool, section()).await;
    let client = browser();

    // Not logged in: every page sends the browser to the login page.
    let (status, _) = page(&console, &client, "/tenants").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    login(&console, &client, &secret).await;

    let (status, html) = page(&console, &client, "/").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    for channel in ["push", "email", "sms"] {
        assert!(
            html.contains(&format!("<th scope=\"row\">{channel}</th>")),
            "{html}"
        );
    }
    assert!(
        html.contains("console:vera"),
        "the page names who is logged in"
    );
    assert!(
        !html.contains("Drain</button>"),
        "a viewer is offered no action: {html}"
    );

    let (status, html) = page(&console, &client, "/tenants").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(html.contains("clinic-a"), "{html}");
    assert!(!html.contains("Pause intake"), "{html}");

    let (status, html) = page(&console, &client, "/dead-letters").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(
        html.contains("<code>http_400</code>"),
        "the stored reason is shown: {html}"
    );
    assert!(
        html.contains(&dead.to_string()),
        "a sample links to its trace: {html}"
    );

    let (status, html) = page(&console, &client, &format!("/trace?id={dead}")).await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(
        html.contains("appt-dead") && html.contains("dead_lettered"),
        "{html}"
    );
    let stored: String =
        sqlx::query_scalar("SELECT subscriber_ref FROM reminders WHERE event_id = 'appt-dead'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        !html.contains(&stored) && !html.contains("patient-0001"),
        "no subscriber reference, as posted or as stored, on the trace: {html}"
    );

    let (status, html) = page(&console, &client, "/trace?id=clinic-a/no-such-event").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{html}");
    let (status, _) = page(&console, &client, "/trace?id=not%20an%20id").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, html) = page(&console, &client, "/redrives").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(!html.contains("Dry run"), "{html}");

    let (status, html) = page(&console, &client, "/audit?actor=ops%40clinic").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(html.contains("tenant_create"), "{html}");
    let (status, html) = page(&console, &client, "/audit?action=no_such_action").await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains("No audit entry matches"), "{html}");

    // The viewer's own CSRF token, and still refused: nothing written.
    let csrf = csrf(&html);
    let before = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log")
        .fetch_one(&pool)
        .await
        .unwrap();
    for (path, form) in [
        (
            format!("/tenants/{}/intake", clinic.id),
            vec![("paused", "true")],
        ),
        ("/channels/sms/drain".to_owned(), vec![("draining", "true")]),
        (
            "/redrives/plan".to_owned(),
            vec![("channel", "sms"), ("rate", "5")],
        ),
        (
            "/redrives/execute".to_owned(),
            vec![("channel", "sms"), ("rate", "5")],
        ),
    ] {
        let mut fields = form;
        fields.push(("csrf", &csrf));
        fields.push(("reason", "trying"));
        let answer = client
            .post(console.url(&path))
            .form(&fields)
            .send()
            .await
            .unwrap();
        if path == "/logout" {
            // A viewer may log out: the one POST of theirs that is let through.
            assert_eq!(answer.status(), StatusCode::SEE_OTHER, "{path}");
        } else {
            assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{path}");
        }
    }
    let after = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, before, "a viewer's POST writes nothing");
    assert!(
        !owner
            .tenant(clinic.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    let draining: bool =
        sqlx::query_scalar("SELECT draining FROM channel_controls WHERE channel = 'sms'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!draining);
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_operator_pauses_and_drains_with_a_reason_and_the_audit_log_names_them(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let clinic = tenant(&owner).await;
    let (_, secret) = token(&owner, "otto", ConsoleRole::Operator).await;
    let console = Console::start(&pool, section()).await;
    let client = browser();
    login(&console, &client, &secret).await;
    let (_, html) = page(&console, &client, "/tenants").await;
    assert!(html.contains("Pause intake"), "{html}");
    let csrf = csrf(&html);
    let pause = format!("/tenants/{}/intake", clinic.id);

    // Without the session's CSRF token: refused, nothing written.
    for bad in ["", "not-the-token"] {
        let answer = client
            .post(console.url(&pause))
            .form(&[("paused", "true"), ("reason", "storm"), ("csrf", bad)])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    }
    assert_eq!(audit_count(&pool, "intake_pause").await, 0);
    // Without a reason: refused as bad input, nothing written.
    let answer = client
        .post(console.url(&pause))
        .form(&[("paused", "true"), ("reason", "  "), ("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    assert_eq!(audit_count(&pool, "intake_pause").await, 0);

    let answer = client
        .post(console.url(&pause))
        .form(&[
            ("paused", "true"),
            ("reason", "provider storm"),
            ("incident", "INC-7"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let location = answer.headers()["location"].to_str().unwrap().to_owned();
    assert!(location.starts_with("/tenants?notice="), "{location}");
    assert!(
        owner
            .tenant(clinic.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    let (actor, reason, incident): (String, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT actor, reason, incident FROM audit_log WHERE action = 'intake_pause'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(actor.starts_with("console:otto#"), "{actor}");
    assert_eq!(reason.as_deref(), Some("provider storm"));
    assert_eq!(incident.as_deref(), Some("INC-7"));
    let (status, html) = page(&console, &client, &location).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        html.contains("Intake of tenant") && html.contains("Resume intake"),
        "{html}"
    );

    // Resume, then drain SMS and end the drain: each the ledger's own change, audited.
    let answer = client
        .post(console.url(&pause))
        .form(&[
            ("paused", "false"),
            ("reason", "storm over"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert!(
        !owner
            .tenant(clinic.id)
            .await
            .unwrap()
            .unwrap()
            .intake_paused
    );
    for (draining, action) in [("true", "drain_on"), ("false", "drain_off")] {
        let answer = client
            .post(console.url("/channels/sms/drain"))
            .form(&[
                ("draining", draining),
                ("reason", "failover"),
                ("csrf", &csrf),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SEE_OTHER);
        assert_eq!(audit_count(&pool, action).await, 1, "{action}");
    }
    let (status, html) = page(
        &console,
        &client,
        &format!("/audit?actor={}", actor.replace('#', "%23")),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    for action in ["intake_pause", "intake_resume", "drain_on", "drain_off"] {
        assert!(html.contains(action), "{action} in {html}");
    }
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_operator_redrives_dead_letters_after_a_dry_run_and_can_pause_it(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let clinic = tenant(&owner).await;
    let now = db_now(&owner).await;
    for i in 0..3 {
        dead_letter(
            &owner,
            clinic.id,
            &format!("appt-{i}"),
            now,
            chrono::Duration::hours(1),
        )
        .await;
    }
    let (_, secret) = token(&owner, "otto", ConsoleRole::Operator).await;
    let console = Console::start(&pool, section()).await;
    let client = browser();
    login(&console, &client, &secret).await;
    let (_, html) = page(&console, &client, "/redrives").await;
    let csrf = csrf(&html);

    // Without the dry run's count: refused, nothing started.
    let answer = client
        .post(console.url("/redrives/execute"))
        .form(&[
            ("channel", "sms"),
            ("rate", "2"),
            ("reason", "blind"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    let answer = client
        .post(console.url("/redrives/plan"))
        .form(&[("channel", "sms"), ("rate", "2"), ("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let plan = answer.text().await.unwrap();
    assert!(plan.contains("Execute: redrive 3 deliveries"), "{plan}");
    let redrives: i64 = sqlx::query_scalar("SELECT count(*) FROM redrives")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(redrives, 0, "a dry run changes nothing");

    let answer = client
        .post(console.url("/redrives/execute"))
        .form(&[
            ("channel", "sms"),
            ("rate", "2"),
            ("tenant", ""),
            ("max_age_h", ""),
            ("limit", ""),
            ("canary", ""),
            ("planned", "3"),
            ("reason", "provider fixed"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let (id, selected, actor): (i64, i32, String) =
        sqlx::query_as("SELECT id, selected, actor FROM redrives")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(selected, 3);
    assert!(actor.starts_with("console:otto#"), "{actor}");
    assert_eq!(audit_count(&pool, "redrive_start").await, 1);
    let (_, html) = page(&console, &client, "/redrives").await;
    assert!(html.contains("<progress"), "{html}");
    assert!(html.contains(">Pause</button>"), "{html}");

    // A second one on the same channel is refused while the first is active.
    let answer = client
        .post(console.url("/redrives/execute"))
        .form(&[
            ("channel", "sms"),
            ("rate", "2"),
            ("planned", "3"),
            ("reason", "again"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::CONFLICT);

    let answer = client
        .post(console.url(&format!("/redrives/{id}/change")))
        .form(&[
            ("change", "pause"),
            ("reason", "look first"),
            ("csrf", &csrf),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let state: String = sqlx::query_scalar("SELECT state FROM redrives WHERE id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "paused");
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_revoked_or_unknown_token_opens_nothing(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    tenant(&owner).await;
    let (id, secret) = token(&owner, "vera", ConsoleRole::Viewer).await;
    let console = Console::start(&pool, section()).await;
    let client = browser();

    let answer = client
        .post(console.url("/login"))
        .form(&[("token", "nct_not-a-token")])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);

    login(&console, &client, &secret).await;
    let (status, _) = page(&console, &client, "/").await;
    assert_eq!(status, StatusCode::OK);
    let (_, revoked) = owner
        .revoke_console_token(id, &ops(Utc::now()))
        .await
        .unwrap()
        .unwrap();
    assert!(revoked);
    let (status, _) = page(&console, &client, "/").await;
    assert_eq!(
        status,
        StatusCode::SEE_OTHER,
        "the revoked token's session is over"
    );
    let answer = client
        .post(console.url("/login"))
        .form(&[("token", secret.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);

    // A cookie not signed with the session key is no session.
    let forged = reqwest::Client::builder()
        .redirect(Policy::none())
        .build()
        .unwrap()
        .get(console.url("/"))
        .header(
            "cookie",
            r#"nudge_console={"token":1,"actor":"console:x","role":"operator","csrf":"a","expires":4102444800}"#,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), StatusCode::SEE_OTHER);
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_proxy_user_is_let_in_only_where_the_header_is_configured(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    tenant(&owner).await;
    let off = Console::start(&pool, section()).await;
    let on = Console::start(
        &pool,
        ConsoleSection {
            trusted_header: Some("X-Forwarded-User".to_owned()),
            trusted_proxies: vec!["127.0.0.0/8".to_owned()],
            ..section()
        },
    )
    .await;
    let client = browser();
    let asked = |console: &Console| {
        client
            .get(console.url("/"))
            .header("x-forwarded-user", "pat")
            .send()
    };
    assert_eq!(asked(&off).await.unwrap().status(), StatusCode::SEE_OTHER);
    let answer = asked(&on).await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let csp = answer.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = answer.text().await.unwrap();
    assert!(html.contains("console:proxy:pat · viewer"), "{html}");
    // The proxy's user is a viewer here: refused an action even with the CSRF token.
    let answer = client
        .post(on.url("/channels/sms/drain"))
        .header("x-forwarded-user", "pat")
        .form(&[
            ("draining", "true"),
            ("reason", "x"),
            ("csrf", &csrf(&html)),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);
    off.stop().await;
    on.stop().await;
}

/// A login session's cookie, taken by hand (the caller sends it as it likes).
async fn session_cookie(console: &Console, secret: &str) -> String {
    let answer = reqwest::Client::builder()
        .redirect(Policy::none())
        .build()
        .unwrap()
        .post(console.url("/login"))
        .form(&[("token", secret)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let set = answer.headers()["set-cookie"].to_str().unwrap();
    set.split(';').next().unwrap().to_owned()
}

async fn with_cookie(console: &Console, cookie: &str, path: &str) -> StatusCode {
    reqwest::Client::builder()
        .redirect(Policy::none())
        .build()
        .unwrap()
        .get(console.url(path))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .status()
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_logout_ends_every_session_of_the_token_and_other_sites_cannot_post(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    tenant(&owner).await;
    let (_, secret) = token(&owner, "otto", ConsoleRole::Operator).await;
    let console = Console::start(&pool, section()).await;
    let kept = session_cookie(&console, &secret).await;
    assert_eq!(with_cookie(&console, &kept, "/").await, StatusCode::OK);

    // Another site's form: refused before anything reads it (a login included).
    let plain = reqwest::Client::builder()
        .redirect(Policy::none())
        .build()
        .unwrap();
    for (site, path) in [
        ("cross-site", "/login"),
        ("same-site", "/channels/sms/drain"),
    ] {
        let answer = plain
            .post(console.url(path))
            .header("sec-fetch-site", site)
            .header("cookie", &kept)
            .form(&[
                ("token", secret.as_str()),
                ("draining", "true"),
                ("reason", "x"),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::FORBIDDEN, "{site} {path}");
    }
    let answer = plain
        .post(console.url("/login"))
        .header("origin", "https://evil.example")
        .form(&[("token", secret.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::FORBIDDEN);

    // A notice without the console's signature is not shown.
    let answer = plain
        .get(console.url("/?notice=Session+expired%3A+paste+your+token+at+evil.example"))
        .header("cookie", &kept)
        .send()
        .await
        .unwrap();
    assert!(!answer.text().await.unwrap().contains("evil.example"));

    let client = browser();
    login(&console, &client, &secret).await;
    let (_, html) = page(&console, &client, "/").await;
    let answer = client
        .post(console.url("/logout"))
        .form(&[("csrf", csrf(&html))])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        with_cookie(&console, &kept, "/").await,
        StatusCode::SEE_OTHER,
        "a cookie kept from before the logout opens nothing"
    );
    // A new login works again.
    let fresh = session_cookie(&console, &secret).await;
    assert_eq!(with_cookie(&console, &fresh, "/").await, StatusCode::OK);
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn a_proxy_header_from_anywhere_but_the_proxy_is_ignored(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    tenant(&owner).await;
    let console = Console::start(
        &pool,
        ConsoleSection {
            trusted_header: Some("X-Forwarded-User".to_owned()),
            trusted_proxies: vec!["10.0.0.0/8".to_owned()],
            trusted_header_role: "operator".to_owned(),
            ..section()
        },
    )
    .await;
    let answer = browser()
        .get(console.url("/"))
        .header("x-forwarded-user", "mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        StatusCode::SEE_OTHER,
        "127.0.0.1 is not the proxy"
    );
    console.stop().await;
}

#[sqlx::test(migrator = "nudge_ledger::MIGRATOR")]
async fn an_operator_resumes_a_paused_tenant_and_sets_a_rate_as_the_console_role(pool: PgPool) {
    let owner = Ledger::from_pool(pool.clone());
    let clinic = tenant(&owner).await;
    owner
        .set_rate(
            &account("sms-main"),
            Channel::Sms,
            10.0,
            None,
            &ops(Utc::now()),
        )
        .await
        .unwrap();
    let (_, secret) = token(&owner, "otto", ConsoleRole::Operator).await;
    let console = Console::start(&pool, section()).await;
    let client = browser();
    login(&console, &client, &secret).await;
    let (_, html) = page(&console, &client, "/tenants").await;
    let csrf = csrf(&html);
    let intake = format!("/tenants/{}/intake", clinic.id);
    let pause = |paused: &'static str| {
        client
            .post(console.url(&intake))
            .form(&[
                ("paused", paused),
                ("reason", "storm"),
                ("csrf", csrf.as_str()),
            ])
            .send()
    };
    assert_eq!(pause("true").await.unwrap().status(), StatusCode::SEE_OTHER);
    // A reminder created during the pause, due now: the resume materialises its delivery,
    // writing what the console role may write.
    let now = db_now(&owner).await;
    let during = owner
        .create_reminder(
            &reminder(clinic.id, "during", &[Channel::Sms], now),
            &cipher(),
            now,
        )
        .await
        .unwrap();
    assert_eq!(
        pause("false").await.unwrap().status(),
        StatusCode::SEE_OTHER
    );
    let made: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE reminder_id = $1")
        .bind(during.id.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        made, 1,
        "the resume made the delivery of the reminder created while paused"
    );

    let (_, html) = page(&console, &client, "/").await;
    assert!(html.contains("Set rate"), "{html}");
    let answer = client
        .post(console.url("/rates"))
        .form(&[
            ("account", "sms-main"),
            ("channel", "sms"),
            ("rate", "3"),
            ("reason", "provider asked"),
            ("csrf", csrf.as_str()),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let (rate, by): (f64, String) = sqlx::query_as(
        "SELECT rate_per_second, changed_by FROM rate_buckets WHERE provider_account = 'sms-main'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rate, 3.0);
    assert!(by.starts_with("console:otto#"), "{by}");
    // A reason longer than the ledger takes is refused as bad input, not a server error.
    let long = "x".repeat(401);
    let answer = client
        .post(console.url("/rates"))
        .form(&[
            ("account", "sms-main"),
            ("channel", "sms"),
            ("rate", "4"),
            ("reason", long.as_str()),
            ("csrf", csrf.as_str()),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    console.stop().await;
}
