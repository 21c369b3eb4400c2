//! Traces over OTLP (HTTP/protobuf, batch exporter) when `telemetry.otlp_endpoint` is set, and
//! W3C trace context in and out of the process.
//!
//! A delivery's trace: its trace id is the delivery id (16 bytes), and its root span id is
//! derived from that id ([`delivery_context`]). The root stands for the delivery itself, which
//! no single process owns, and is never exported; every attempt's spans hang under it (the
//! relay's publish, the worker's process span joined through the message's `traceparent`
//! header, the provider request that carries the same header on), so a delivery is one trace
//! and its retried attempts are siblings in it.
//!
//! Spans carry ids and classes only (delivery id, channel, correlation id, account): never a
//! destination, subscriber reference or content.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::TelemetryError;

/// The W3C header name, in AMQP headers and on provider requests.
pub const TRACEPARENT: &str = "traceparent";

/// The tracer provider exporting to `{endpoint}/v1/traces`, named `service`.
pub(crate) fn provider(
    service: &'static str,
    endpoint: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .build()
        .map_err(|e| TelemetryError::Otlp(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .with_attributes([KeyValue::new("service.namespace", "nudge")])
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

pub(crate) fn tracer(
    provider: &SdkTracerProvider,
    service: &'static str,
) -> opentelemetry_sdk::trace::Tracer {
    provider.tracer(service)
}

/// The `traceparent` of `span`, when it is recorded by an OpenTelemetry layer (export on).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// Makes `span` a child of the context a `traceparent` header carries; an invalid header
/// is ignored (the span then starts its own trace).
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str) {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The remote context every span of the delivery `delivery_id` descends from: trace id = the
/// id, span id derived from it, sampled.
pub fn delivery_context(delivery_id: [u8; 16]) -> Context {
    let mut half = [0u8; 8];
    for (i, b) in half.iter_mut().enumerate() {
        *b = delivery_id[i] ^ delivery_id[i + 8] ^ 0x5a;
    }
    let span_id = match u64::from_be_bytes(half) {
        0 => SpanId::from(1u64),
        n => SpanId::from(n),
    };
    let context = SpanContext::new(
        TraceId::from(u128::from_be_bytes(delivery_id)),
        span_id,
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    Context::new().with_remote_span_context(context)
}

/// Makes `span` part of the delivery's trace ([`delivery_context`]).
pub fn set_delivery_parent(span: &tracing::Span, delivery_id: [u8; 16]) {
    let _ = span.set_parent(delivery_context(delivery_id));
}

/// `(trace_id, span_id)` of the current span in hex, when one is recorded (for log lines).
pub(crate) fn current_ids() -> Option<(String, String)> {
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid()
        .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_context_carries_the_delivery_id_as_its_trace_id() {
        let id = [7u8; 16];
        let cx = delivery_context(id);
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid());
        assert!(sc.is_remote());
        assert_eq!(sc.trace_id().to_string(), "07".repeat(16));
        assert_eq!(
            delivery_context(id).span().span_context().span_id(),
            sc.span_id()
        );
    }
}
