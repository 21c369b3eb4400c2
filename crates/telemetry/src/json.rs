//! JSON log lines that carry the service name.

use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::fmt::format::{Format, Json, JsonFields, Writer};
use tracing_subscriber::fmt::{self as tfmt, FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// One JSON object per line: `service`, then (when `trace_ids`, inside a recorded span)
/// `trace_id` and `span_id`, then `timestamp`, `level`, `fields`, `target`, `span`, `spans`.
pub(crate) fn json_layer<S, W>(service: &'static str, trace_ids: bool, writer: W) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + 'static,
{
    let format = tfmt::format()
        .json()
        .with_current_span(true)
        .with_span_list(true);
    tfmt::layer()
        .fmt_fields(JsonFields::new())
        .event_format(WithService::new(service, format).with_trace_ids(trace_ids))
        .with_writer(writer)
}

/// Wraps the JSON event format and puts `"service":"<name>"` first in every object.
///
/// tracing-subscriber's JSON format has no hook for static fields, and a root span would not
/// follow events onto other threads or tasks; rewriting the line's opening brace is the one
/// approach that covers every event.
#[derive(Debug)]
struct WithService {
    /// `"service":"<name>"`, JSON-escaped once at start-up.
    field: String,
    inner: Format<Json>,
    trace_ids: bool,
}

impl WithService {
    fn new(service: &'static str, inner: Format<Json>) -> Self {
        let field = format!("\"service\":{}", serde_json::Value::from(service));
        Self {
            field,
            inner,
            trace_ids: false,
        }
    }

    fn with_trace_ids(mut self, trace_ids: bool) -> Self {
        self.trace_ids = trace_ids;
        self
    }
}

impl<S, N> FormatEvent<S, N> for WithService
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let ids = if self.trace_ids {
            crate::otel::current_ids()
                .map(|(trace, span)| format!(",\"trace_id\":\"{trace}\",\"span_id\":\"{span}\""))
                .unwrap_or_default()
        } else {
            String::new()
        };
        match line.strip_prefix('{') {
            Some(rest) if rest.starts_with('}') => write!(writer, "{{{}{ids}{rest}", self.field),
            Some(rest) => write!(writer, "{{{}{ids},{rest}", self.field),
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex, PoisonError};

    use serde_json::Value;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Buffer {
        fn contents(&self) -> String {
            let bytes = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    impl io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;

        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    #[test]
    fn every_json_line_is_one_object_with_the_service_level_target_fields_and_span() {
        let buffer = Buffer::default();
        let subscriber =
            tracing_subscriber::registry().with(json_layer("nudge-test", false, buffer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("lease", delivery_id = 7);
            let _entered = span.enter();
            tracing::info!(delay_ms = 12, "leased");
            tracing::warn!("second");
        });

        let output = buffer.contents();
        let lines: Vec<Value> = output
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("not JSON lines ({e}): {output}"));
        assert_eq!(lines.len(), 2, "{output}");

        let first = &lines[0];
        assert_eq!(first["service"], "nudge-test");
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["target"], module_path!());
        assert!(first["timestamp"].is_string(), "{first}");
        assert_eq!(first["fields"]["message"], "leased");
        assert_eq!(first["fields"]["delay_ms"], 12);
        assert_eq!(first["span"]["name"], "lease");
        assert_eq!(first["span"]["delivery_id"], 7);
        assert_eq!(lines[1]["service"], "nudge-test");
        assert_eq!(lines[1]["level"], "WARN");
    }

    #[test]
    fn the_service_name_is_json_escaped() {
        let with = WithService::new("a\"b", tfmt::format().json());
        assert_eq!(with.field, r#""service":"a\"b""#);
    }
}
