//! Traces end to end: the producer and the worker export spans over OTLP/HTTP (protobuf) to a
//! small receiver run by the test, and one reminder's delivery, throttled once and then
//! delivered, is one trace from the relay's publish through the broker and the worker to the
//! provider request (which carried the same W3C context), with both attempts in it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use chrono::Utc;
use nudge_domain::Channel;
use nudge_e2e::{TestEnv, WorkerOptions, count_in, keys_report};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use serde_json::json;

/// One exported span, flattened: its service, ids, name, kind and string attributes.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    attributes: HashMap<String, String>,
}

type Received = Arc<Mutex<Vec<Span>>>;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

async fn receive(State(received): State<Received>, body: Bytes) -> &'static str {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
    let mut spans = received.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .map(|a| text(a.value.as_ref().and_then(|v| v.value.as_ref())))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                spans.push(Span {
                    service: service.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    attributes: span
                        .attributes
                        .iter()
                        .map(|a| {
                            (
                                a.key.clone(),
                                text(a.value.as_ref().and_then(|v| v.value.as_ref())),
                            )
                        })
                        .collect(),
                });
            }
        }
    }
    ""
}

/// An OTLP/HTTP receiver on a loopback port: `POST /v1/traces`. Returns its base URL.
async fn receiver(received: Received) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(received);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_delivery_is_one_trace_from_the_publish_to_the_provider_request_with_every_attempt() {
    let received: Received = Arc::default();
    let mut env = TestEnv::start("traces").await.unwrap();
    env.otlp_endpoint = Some(receiver(received.clone()).await);
    let tenant = env.tenant("clinic-traces", 2).await.unwrap();
    env.script(
        "sms-main",
        json!({
            "sequence": [{"status": 429, "retry_after": "1"}],
            "default": {"status": 202}
        }),
    )
    .await
    .unwrap();
    env.start_producer("producer").unwrap();
    env.start_worker(
        Channel::Sms,
        "sms",
        &WorkerOptions::for_channel(Channel::Sms),
    )
    .unwrap();
    let now = Utc::now();
    let created = env
        .reminder(
            tenant,
            "traced",
            &[Channel::Sms],
            now,
            now + chrono::Duration::minutes(10),
        )
        .await
        .unwrap();
    let ledger = env.ledger.clone();
    env.wait_for(
        "the reminder to be delivered after one 429",
        Duration::from_secs(60),
        || {
            let ledger = ledger.clone();
            async move {
                let delivered = count_in(&ledger, "delivered").await?;
                Ok((delivered == 1).then_some(()))
            }
        },
    )
    .await;
    let delivery = env.ledger.deliveries_of_reminder(created.id).await.unwrap()[0].clone();
    let keys = keys_report(env.stub_keys().await.unwrap()).unwrap();
    // Stopping flushes the batch exporters.
    for (name, code) in env.stop_all(Duration::from_secs(15)) {
        assert_eq!(code, Some(0), "{name} stopped cleanly on SIGTERM");
    }

    let trace_id = delivery.id.as_uuid().simple().to_string();
    let spans: Vec<Span> = received
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .cloned()
        .collect();
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
    let publishes = named("publish sms");
    let processes = named("process work.sms");
    let requests = named("POST");
    assert_eq!(publishes.len(), 2, "one publish per attempt: {spans:#?}");
    assert_eq!(
        processes.len(),
        2,
        "one process span per attempt: {spans:#?}"
    );
    assert_eq!(
        requests.len(),
        2,
        "one provider request per attempt: {spans:#?}"
    );

    // Producer -> broker -> worker -> provider, parent to child, in one trace.
    for publish in &publishes {
        assert_eq!(publish.service, "nudge-producer");
        assert_eq!(publish.attributes["messaging.system"], "rabbitmq");
        assert_eq!(publish.attributes["messaging.operation.type"], "send");
        assert_eq!(
            publish.attributes["messaging.destination.name"],
            "nudge.work"
        );
        assert_eq!(publish.attributes["delivery_id"], delivery.id.to_string());
    }
    // Both attempts hang under the same (delivery) parent: linked.
    assert_eq!(publishes[0].parent_span_id, publishes[1].parent_span_id);
    assert_ne!(publishes[0].parent_span_id, "");
    for process in &processes {
        assert_eq!(process.service, "nudge-sms");
        assert_eq!(process.attributes["messaging.system"], "rabbitmq");
        assert_eq!(process.attributes["messaging.operation.type"], "process");
        assert!(
            publishes
                .iter()
                .any(|p| p.span_id == process.parent_span_id),
            "the process span joins a publish through the message's traceparent: {spans:#?}"
        );
        assert!(!process.attributes["correlation_id"].is_empty());
    }
    let mut statuses = Vec::new();
    for request in &requests {
        assert_eq!(request.service, "nudge-sms");
        assert_eq!(request.attributes["http.request.method"], "POST");
        assert_eq!(request.attributes["server.address"], "127.0.0.1");
        statuses.push(request.attributes["http.response.status_code"].clone());
        assert!(
            processes
                .iter()
                .any(|p| p.span_id == request.parent_span_id),
            "the provider request is a child of a process span: {spans:#?}"
        );
    }
    statuses.sort();
    assert_eq!(statuses, ["202", "429"]);

    // The provider saw the same context: the request span's own id as parent.
    let sent: Vec<String> = keys
        .keys
        .iter()
        .flat_map(|k| k.requests.iter().filter_map(|r| r.traceparent.clone()))
        .collect();
    assert_eq!(sent.len(), 2, "{keys:?}");
    for traceparent in &sent {
        let parts: Vec<&str> = traceparent.split('-').collect();
        assert_eq!(parts[1], trace_id, "{traceparent}");
        assert!(
            requests.iter().any(|r| r.span_id == parts[2]),
            "{traceparent} names a provider request span"
        );
    }

    // The worker's log lines inside the attempt carry the trace and span ids.
    let log = std::fs::read_to_string(env.dir.join("sms.log")).unwrap();
    let attempt_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("attempt finished"))
        .collect();
    assert_eq!(attempt_lines.len(), 2, "{log}");
    for line in attempt_lines {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(line["trace_id"], trace_id.as_str(), "{line}");
        assert!(
            processes
                .iter()
                .any(|p| line["span_id"] == p.span_id.as_str()),
            "{line}"
        );
    }

    // No destination, subscriber reference or content in any span.
    let everything: Vec<String> = received
        .lock()
        .unwrap()
        .iter()
        .flat_map(|s| s.attributes.values().cloned().chain([s.name.clone()]))
        .collect();
    for phi in ["dest-sms-traced", "sub-traced", "appointment"] {
        assert!(
            !everything.iter().any(|v| v.contains(phi)),
            "{phi} found in an exported span"
        );
    }
}
