//! The stub served in-process on 127.0.0.1:0, driven over real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used)] // A failed unwrap is a failed test, with its location.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use nudge_domain::ProviderAccount;
use provider_stub::{AnswerKind, KeysReport, Script, Stats, StubState, WebhookName, WebhookReport};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

struct Stub {
    base: String,
    state: StubState,
    client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Stub {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = StubState::new();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(provider_stub::serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Self {
            base,
            state,
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            stop: Some(stop),
            task,
        }
    }

    async fn script(&self, account: &str, script: Value) {
        let r = self
            .client
            .put(format!("{}/admin/accounts/{account}", self.base))
            .json(&script)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "{}", r.text().await.unwrap());
    }

    fn send(&self, account: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(format!("{}/accounts/{account}/v1/messages", self.base))
            .json(&json!({"channel": "sms", "to": "+15550100", "content": {"text": "hi"}}));
        if let Some(key) = key {
            req = req.header("Idempotency-Key", key);
        }
        req
    }

    async fn status_of(&self, account: &str, key: Option<&str>) -> (u16, Option<String>, Value) {
        let r = self.send(account, key).send().await.unwrap();
        let status = r.status().as_u16();
        let retry_after = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = r.json().await.unwrap();
        (status, retry_after, body)
    }

    async fn stats(&self) -> Stats {
        self.client
            .get(format!("{}/stats", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn keys(&self) -> KeysReport {
        self.client
            .get(format!("{}/stats/keys", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the server stops within 5 s of shutdown")
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn a_key_gets_its_sequence_in_order_and_then_the_default() {
    let stub = Stub::start().await;
    stub.script(
        "sms-main",
        json!({"sequence": [{"status": 429, "retry_after": "3"}, {"status": 503}]}),
    )
    .await;

    let (s1, ra1, _) = stub.status_of("sms-main", Some("k1")).await;
    assert_eq!((s1, ra1.as_deref()), (429, Some("3")));
    // Another key starts at the beginning of the sequence.
    let (s, _, _) = stub.status_of("sms-main", Some("k2")).await;
    assert_eq!(s, 429);
    let (s2, ra2, _) = stub.status_of("sms-main", Some("k1")).await;
    assert_eq!((s2, ra2), (503, None));
    let (s3, _, body) = stub.status_of("sms-main", Some("k1")).await;
    assert_eq!(s3, 202);
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));

    let stats = stub.stats().await;
    let acct = &stats.accounts["sms-main"];
    assert_eq!(acct.requests, 4);
    assert_eq!(acct.unique_keys, 2);
    assert_eq!(acct.accepted, 1);
    assert_eq!(acct.by_status.get(&429), Some(&2));
    assert_eq!(acct.by_status.get(&503), Some(&1));
    assert_eq!(acct.by_status.get(&202), Some(&1));
    assert_eq!(acct.rate_limited, 0, "scripted 429s are not the bucket's");
    assert_eq!(stats.total, *acct);
    stub.stop().await;
}

#[tokio::test]
async fn each_scripted_retry_after_form_is_sent_as_asked() {
    let stub = Stub::start().await;
    stub.script(
        "push-main",
        json!({"sequence": [
            {"status": 429, "retry_after": "120"},
            {"status": 429, "retry_after": "@http_date+30"},
            {"status": 429, "retry_after": "@rfc850+30"},
            {"status": 429, "retry_after": "@asctime+30"},
            {"status": 429, "retry_after": "soon"},
            {"status": 429},
        ]}),
    )
    .await;
    let before = std::time::SystemTime::now();
    let mut got = Vec::new();
    for _ in 0..6 {
        let (status, ra, _) = stub.status_of("push-main", Some("k")).await;
        assert_eq!(status, 429);
        got.push(ra);
    }
    assert_eq!(got[0].as_deref(), Some("120"));
    let imf = got[1].as_deref().unwrap();
    assert!(imf.ends_with(" GMT") && imf.contains(", "), "{imf}");
    let rfc850 = got[2].as_deref().unwrap();
    assert!(rfc850.contains('-') && rfc850.ends_with(" GMT"), "{rfc850}");
    let asctime = got[3].as_deref().unwrap();
    assert!(!asctime.contains("GMT"), "{asctime}");
    for date in [imf, rfc850, asctime] {
        let at = httpdate::parse_http_date(date).unwrap();
        assert!(at >= before + Duration::from_secs(29), "{date}");
        assert!(at <= before + Duration::from_secs(40), "{date}");
    }
    assert_eq!(got[4].as_deref(), Some("soon"));
    assert_eq!(got[5], None);
    stub.stop().await;
}

#[tokio::test]
async fn an_accepted_key_gets_the_same_id_again_and_counts_a_duplicate() {
    let stub = Stub::start().await;
    let (s1, _, b1) = stub.status_of("email-main", Some("key-a")).await;
    let (s2, _, b2) = stub.status_of("email-main", Some("key-a")).await;
    let (_, _, other) = stub.status_of("email-main", Some("key-b")).await;
    assert_eq!((s1, s2), (202, 202));
    assert_eq!(b1["id"], b2["id"]);
    assert_ne!(b1["id"], other["id"]);

    let acct = &stub.stats().await.accounts["email-main"];
    assert_eq!(acct.requests, 3);
    assert_eq!(acct.unique_keys, 2);
    assert_eq!(acct.accepted, 2);
    assert_eq!(acct.duplicates, 1);
    stub.stop().await;
}

#[tokio::test]
async fn a_duplicate_does_not_consume_the_sequence() {
    let stub = Stub::start().await;
    stub.script(
        "sms-main",
        json!({"sequence": [{"status": 202}], "default": {"status": 500}}),
    )
    .await;
    for _ in 0..3 {
        let (s, _, _) = stub.status_of("sms-main", Some("k")).await;
        assert_eq!(s, 202);
    }
    let report = stub.keys().await;
    let kinds: Vec<AnswerKind> = report
        .get("sms-main", "k")
        .unwrap()
        .requests
        .iter()
        .map(|r| r.kind)
        .collect();
    assert_eq!(
        kinds,
        [
            AnswerKind::Scripted,
            AnswerKind::Duplicate,
            AnswerKind::Duplicate
        ]
    );
    stub.stop().await;
}

#[tokio::test]
async fn a_bucket_of_five_a_second_with_burst_one_accepts_no_more_than_one_plus_five_per_second_elapsed()
 {
    let stub = Stub::start().await;
    stub.script(
        "sms-main",
        json!({"rate_limit": {"per_second": 5, "burst": 1}}),
    )
    .await;
    let mut statuses = Vec::new();
    let start = Instant::now();
    for n in 0..6 {
        let (s, ra, _) = stub.status_of("sms-main", Some(&format!("k{n}"))).await;
        if s == 429 {
            let secs: u64 = ra.as_deref().unwrap().parse().unwrap();
            assert_eq!(secs, 1, "a wait under 200 ms rounds up to one second");
        }
        statuses.push(s);
    }
    let elapsed = start.elapsed();
    assert_eq!(statuses[0], 202);
    // The bucket's bound over any interval L: burst + rate * L requests. Six requests on
    // loopback take a few milliseconds, so exactly one is accepted; a slower machine is
    // allowed one more per 200 ms it took, and no more (a burst of 5 would accept all six).
    let accepted = statuses.iter().filter(|&&s| s == 202).count() as u64;
    let bound = 1 + (elapsed.as_secs_f64() * 5.0).floor() as u64;
    assert!(
        accepted <= bound,
        "accepted {accepted} of 6 in {elapsed:?}: past burst 1 + 5/s ({bound}); {statuses:?}"
    );
    let limited = 6 - accepted;
    let acct = &stub.stats().await.accounts["sms-main"];
    assert_eq!(acct.rate_limited, limited);
    assert_eq!(acct.accepted, accepted);
    stub.stop().await;
}

#[tokio::test]
async fn a_bucket_429_carries_retry_after_in_each_configured_form() {
    let stub = Stub::start().await;
    for (account, form) in [
        ("a-delta", "delta"),
        ("a-date", "http_date"),
        ("a-none", "none"),
        ("a-bad", "malformed"),
    ] {
        stub.script(
            account,
            json!({"rate_limit": {"per_second": 1, "burst": 1, "retry_after": form}}),
        )
        .await;
    }
    async fn second(stub: &Stub, account: &str) -> Option<String> {
        let (first, _, _) = stub.status_of(account, Some("a")).await;
        assert_eq!(first, 202);
        let (s, ra, _) = stub.status_of(account, Some("b")).await;
        assert_eq!(s, 429, "{account}");
        ra
    }
    assert_eq!(second(&stub, "a-delta").await.as_deref(), Some("1"));
    let date = second(&stub, "a-date").await.unwrap();
    let at = httpdate::parse_http_date(&date).unwrap();
    assert!(
        at > std::time::SystemTime::now() - Duration::from_secs(1),
        "{date}"
    );
    assert_eq!(second(&stub, "a-none").await, None);
    assert_eq!(second(&stub, "a-bad").await.as_deref(), Some("soon"));
    stub.stop().await;
}

#[tokio::test]
async fn the_busiest_second_counts_every_request_in_a_burst() {
    let stub = Stub::start().await;
    let start = Instant::now();
    for n in 0..7 {
        stub.status_of("push-main", Some(&format!("k{n}"))).await;
    }
    let elapsed = start.elapsed();
    let stats = stub.stats().await;
    // Seven requests in well under a second on loopback; on a machine too slow for that the
    // count could be lower, which is what the assertion message would show.
    assert!(elapsed < Duration::from_millis(900), "{elapsed:?}");
    assert_eq!(stats.accounts["push-main"].max_requests_in_any_second, 7);
    assert_eq!(stats.total.max_requests_in_any_second, 7);
    stub.stop().await;
}

#[tokio::test]
async fn a_hang_holds_the_connection_until_the_client_gives_up() {
    let stub = Stub::start().await;
    stub.script("sms-main", json!({"sequence": [{"hang": true}]}))
        .await;
    let start = Instant::now();
    let err = stub
        .send("sms-main", Some("k"))
        .timeout(Duration::from_millis(300))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(start.elapsed() < Duration::from_secs(5));

    let acct = &stub.stats().await.accounts["sms-main"];
    assert_eq!(acct.hung, 1);
    assert_eq!(
        acct.accepted, 1,
        "a 202 hang is a send whose answer was lost"
    );
    assert!(acct.by_status.is_empty(), "{:?}", acct.by_status);
    // The retry with the same key learns the message went out.
    let (s, _, body) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!(s, 202);
    assert_eq!(body["id"], "msg_1");
    stub.stop().await;
}

#[tokio::test]
async fn shutdown_releases_a_held_request_instead_of_waiting_out_the_hang() {
    let stub = Stub::start().await;
    stub.script("sms-main", json!({"default": {"hang": true}}))
        .await;
    let held = tokio::spawn(stub.send("sms-main", Some("k")).send());
    let deadline = Instant::now() + Duration::from_secs(5);
    while stub.state.stats().total.hung == 0 {
        assert!(Instant::now() < deadline, "the request never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stub.stop().await;
    let answer = held.await.unwrap();
    if let Ok(r) = answer {
        assert_eq!(r.status(), 504);
    }
}

#[tokio::test]
async fn a_delayed_step_answers_after_its_delay() {
    let stub = Stub::start().await;
    stub.script(
        "sms-main",
        json!({"sequence": [{"status": 500, "delay_ms": 250}]}),
    )
    .await;
    let start = Instant::now();
    let (s, _, _) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!(s, 500);
    assert!(start.elapsed() >= Duration::from_millis(250));
    stub.stop().await;
}

#[tokio::test]
async fn stats_keys_lists_each_request_time_and_status_with_accepted_at() {
    let stub = Stub::start().await;
    stub.script(
        "sms-main",
        json!({"sequence": [{"status": 429, "retry_after": "1"}]}),
    )
    .await;
    let before = Utc::now() - chrono::TimeDelta::milliseconds(1);
    stub.status_of("sms-main", Some("nudge-key-1")).await;
    stub.status_of("sms-main", Some("nudge-key-1")).await;
    let after = Utc::now() + chrono::TimeDelta::milliseconds(1);

    // The raw JSON: timestamps in RFC 3339 UTC with exactly millisecond precision.
    let raw: Value = stub
        .client
        .get(format!("{}/stats/keys", stub.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let entry = &raw["keys"][0];
    assert_eq!(entry["account"], "sms-main");
    assert_eq!(entry["key"], "nudge-key-1");
    for r in entry["requests"].as_array().unwrap() {
        let at = r["at"].as_str().unwrap();
        assert_eq!(at.len(), "2026-11-29T20:29:05.123Z".len(), "{at}");
        assert!(at.ends_with('Z') && at.as_bytes()[19] == b'.', "{at}");
    }

    let report: KeysReport = serde_json::from_value(raw).unwrap();
    let key = report.get("sms-main", "nudge-key-1").unwrap();
    let statuses: Vec<u16> = key.requests.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [429, 202]);
    let times: Vec<DateTime<Utc>> = key.requests.iter().map(|r| r.at).collect();
    assert!(times[0] <= times[1]);
    assert!(times[0] >= before && times[1] <= after, "{times:?}");
    assert_eq!(key.accepted_at, Some(times[1]));
    assert_eq!(key.message_id.as_deref(), Some("msg_1"));
    stub.stop().await;
}

#[tokio::test]
async fn a_script_requiring_a_key_refuses_a_request_without_one() {
    let stub = Stub::start().await;
    stub.script("sms-main", json!({"require_idempotency_key": true}))
        .await;
    let (s, _, body) = stub.status_of("sms-main", None).await;
    assert_eq!(s, 400);
    assert!(body["error"].as_str().unwrap().contains("Idempotency-Key"));
    let (s, _, _) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!(s, 202);
    let acct = &stub.stats().await.accounts["sms-main"];
    assert_eq!(acct.without_key, 1);
    stub.stop().await;
}

#[tokio::test]
async fn a_request_with_a_malformed_body_gets_400_without_using_the_sequence() {
    let stub = Stub::start().await;
    stub.script("sms-main", json!({"sequence": [{"status": 503}]}))
        .await;
    let r = stub
        .client
        .post(format!("{}/accounts/sms-main/v1/messages", stub.base))
        .header("Idempotency-Key", "k")
        .json(&json!({"channel": "fax", "to": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (s, _, _) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!(s, 503);
    stub.stop().await;
}

#[tokio::test]
async fn an_account_without_a_script_accepts_and_a_bad_name_is_refused() {
    let stub = Stub::start().await;
    let (s, _, _) = stub.status_of("never-scripted", Some("k")).await;
    assert_eq!(s, 202);
    let (s, _, _) = stub.status_of("Bad%20Name", Some("k")).await;
    assert_eq!(s, 400);
    stub.stop().await;
}

#[tokio::test]
async fn an_invalid_script_is_refused_with_a_reason() {
    let stub = Stub::start().await;
    let r = stub
        .client
        .put(format!("{}/admin/accounts/sms-main", stub.base))
        .json(&json!({"sequence": [{"status": 99}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("99"), "{body}");
    let script: Script = stub
        .client
        .get(format!("{}/admin/accounts/sms-main", stub.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(script, Script::default());
    stub.stop().await;
}

#[tokio::test]
async fn reset_forgets_scripts_keys_and_counters() {
    let stub = Stub::start().await;
    stub.script("sms-main", json!({"default": {"status": 500}}))
        .await;
    stub.status_of("sms-main", Some("k")).await;
    let r = stub
        .client
        .post(format!("{}/admin/reset", stub.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(stub.stats().await, Stats::default());
    assert!(stub.keys().await.keys.is_empty());
    let (s, _, body) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!((s, body["id"].as_str()), (202, Some("msg_1")));
    stub.stop().await;
}

#[tokio::test]
async fn the_library_api_sets_scripts_and_reads_stats_without_http() {
    let stub = Stub::start().await;
    let script: Script = serde_json::from_value(json!({"sequence": [{"status": 400}]})).unwrap();
    stub.state
        .set_script(ProviderAccount::parse("sms-main").unwrap(), script);
    let (s, _, _) = stub.status_of("sms-main", Some("k")).await;
    assert_eq!(s, 400);
    assert_eq!(stub.state.stats(), stub.stats().await);
    assert_eq!(stub.state.stats().accounts["sms-main"].accepted, 0);
    let healthz = stub
        .client
        .get(format!("{}/healthz", stub.base))
        .send()
        .await
        .unwrap();
    assert_eq!(healthz.status(), 200);
    stub.stop().await;
}

impl Stub {
    async fn webhook(&self, name: &str) -> WebhookReport {
        let r = self
            .client
            .get(format!("{}/stats/webhooks/{name}", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }
}

#[tokio::test]
async fn a_webhook_post_is_kept_byte_for_byte_with_its_signature_headers_and_read_back_in_order() {
    let stub = Stub::start().await;
    // Bodies exactly as sent: the reader checks a signature over these bytes, so no
    // re-serialisation (spacing, key order, escapes) may change them.
    let bodies = [
        r#"{"type":"delivery.events","data":{"events":[{"position":1,"kind":"sent"}]}}"#,
        "{ \"b\" : 2,\n  \"a\": \"\\u00e9\" }",
    ];
    for (n, body) in bodies.iter().enumerate() {
        let r = stub
            .client
            .post(format!("{}/webhooks/demo-events", stub.base))
            .header("content-type", "application/json")
            .header("webhook-id", format!("msg_{n}"))
            .header("webhook-timestamp", "1700000000")
            .header("webhook-signature", "v1,c2lnbmF0dXJl v1,b2xkZXI=")
            .header("authorization", "Bearer not-kept")
            .body(*body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }

    let report = stub.webhook("demo-events").await;
    assert_eq!(report.name, "demo-events");
    assert_eq!(report.refused_full, 0);
    let kept: Vec<&str> = report.requests.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(kept, bodies);
    let first = &report.requests[0];
    assert_eq!(first.headers["webhook-id"], "msg_0");
    assert_eq!(first.headers["webhook-timestamp"], "1700000000");
    assert_eq!(
        first.headers["webhook-signature"],
        "v1,c2lnbmF0dXJl v1,b2xkZXI="
    );
    assert_eq!(first.headers["content-type"], "application/json");
    assert!(
        !first.headers.contains_key("authorization"),
        "{:?}",
        first.headers
    );
    assert!(first.at <= report.requests[1].at);
    // Each name is its own receiver; one never posted to has received nothing.
    assert!(stub.webhook("other").await.requests.is_empty());
    // The library reads the same record.
    let name = WebhookName::parse("demo-events").unwrap();
    assert_eq!(stub.state.webhook(&name), report);
    stub.stop().await;
}

#[tokio::test]
async fn a_webhook_with_a_bad_name_or_a_body_that_is_not_utf8_is_refused_and_not_kept() {
    let stub = Stub::start().await;
    let post = |path: &str, body: Vec<u8>| {
        stub.client
            .post(format!("{}{path}", stub.base))
            .body(body)
            .send()
    };
    let r = post("/webhooks/Demo", b"{}".to_vec()).await.unwrap();
    assert_eq!(r.status(), 400);
    let r = post("/webhooks/demo", vec![0xff, 0xfe]).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"], "the body must be UTF-8");
    assert!(stub.webhook("demo").await.requests.is_empty());
    let r = stub
        .client
        .get(format!("{}/stats/webhooks/a.b", stub.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    stub.stop().await;
}

#[tokio::test]
async fn reset_forgets_what_the_webhooks_were_sent() {
    let stub = Stub::start().await;
    let r = stub
        .client
        .post(format!("{}/webhooks/demo", stub.base))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(stub.webhook("demo").await.requests.len(), 1);
    let r = stub
        .client
        .post(format!("{}/admin/reset", stub.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert!(stub.webhook("demo").await.requests.is_empty());
    stub.stop().await;
}
