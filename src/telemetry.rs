//! Logs and traces of the long-running processes (operator, instance manager, node
//! agent).
//!
//! Logs: one format per process, chosen by `--log-format` / `CASTELLAN_LOG_FORMAT`
//! (`json`, the default, or `text`), filtered by `RUST_LOG` (default `info`). A JSON
//! line is one flat object ([`JsonLine`]): `timestamp`, `level`, `target`, `message`,
//! the event's fields, the fields of the spans it happened in (so a reconcile's lines
//! carry `cluster`), the process' identity (an instance manager's `cluster`,
//! `namespace` and `instance`, an agent's `node`) and the `trace_id`/`span_id` of the
//! span, which are the ids its trace is exported under.
//! Traces: every `tracing` span is also an OpenTelemetry span, exported over OTLP/HTTP
//! when the standard variables say where (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`
//! and `OTEL_BSP_*` are read by the SDK). Without them nothing is exported, but spans
//! still get ids, so that the log lines of one reconcile or one request can be told
//! apart. Trace context crosses processes as W3C `traceparent` headers ([`inject`],
//! [`extract`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde_json::{Map, Value};
use tracing::dispatcher::WeakDispatch;
use tracing::{Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// How a process writes its log lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, for log collectors and `kubectl castellan logs`.
    #[default]
    Json,
    /// Human-readable lines (coloured on a terminal).
    Text,
}

/// The logging flag every long-running process takes (flattened into its arguments).
#[derive(Clone, Debug, clap::Args)]
pub struct LogArgs {
    /// How log lines are written on stderr.
    #[arg(long, env = "CASTELLAN_LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,
}

/// Flushes and stops the trace exporter when dropped (at the end of `main`).
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            eprintln!("castellan: flushing traces at exit: {error}");
        }
    }
}

fn exporting() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()))
}

/// Installs logging in `format`, with `identity` (the process' own name-value pairs,
/// such as an instance manager's cluster and instance) on every JSON line, and trace
/// export when configured. `service` names the process in traces unless
/// `OTEL_SERVICE_NAME` says otherwise.
pub fn init(
    service: &'static str,
    format: LogFormat,
    identity: &[(&'static str, String)],
) -> Telemetry {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json_line = JsonLine::new(identity);
    let installed = json_line.installed();
    let json_logs = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer()
            .fmt_fields(JsonFields::new())
            .event_format(json_line)
            .with_writer(std::io::stderr)
    });
    let text_logs = (format == LogFormat::Text).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
    });
    let provider = build_provider(service);
    let traces = tracing_opentelemetry::layer().with_tracer(provider.tracer("castellan"));
    tracing_subscriber::registry()
        .with(filter)
        .with(json_logs)
        .with(text_logs)
        .with(traces)
        .init();
    let _ = installed.set(tracing::dispatcher::get_default(|dispatch| {
        dispatch.downgrade()
    }));
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    Telemetry { provider }
}

/// The JSON line of one event: flat, so that `jq 'select(.cluster == "orders")'` finds
/// a cluster's lines whichever span or process wrote them.
pub struct JsonLine {
    identity: Map<String, Value>,
    /// The subscriber this format is part of, once installed: spans' OpenTelemetry
    /// ids are read through it. (`Span::current()` cannot be used while formatting: an
    /// event being dispatched makes the thread's dispatcher read as none.)
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

impl JsonLine {
    pub fn new(identity: &[(&'static str, String)]) -> Self {
        let identity = identity
            .iter()
            .map(|(name, value)| ((*name).to_owned(), Value::String(value.clone())))
            .collect();
        Self {
            identity,
            dispatch: Arc::default(),
        }
    }

    /// Where to say which subscriber the format is installed in.
    fn installed(&self) -> Arc<OnceLock<WeakDispatch>> {
        self.dispatch.clone()
    }

    /// The ids of the span `id` as its trace is exported.
    fn ids(&self, id: &tracing::span::Id) -> Option<opentelemetry::trace::SpanContext> {
        let dispatch = self.dispatch.get()?.upgrade()?;
        let context = tracing_opentelemetry::get_otel_context(id, &dispatch)?;
        let span = context.span().span_context().clone();
        span.is_valid().then_some(span)
    }
}

/// The names a line's own keys take; an event or span field of the same name is
/// written with a `field.` prefix instead of hiding them.
const RESERVED: [&str; 7] = [
    "timestamp",
    "level",
    "target",
    "message",
    "span",
    "trace_id",
    "span_id",
];

impl<S, N> FormatEvent<S, N> for JsonLine
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
        // The span's OpenTelemetry ids first: reading them may build the span's
        // context, which takes its extensions for writing; the loop below reads them.
        let current = ctx.lookup_current().map(|span| span.id());
        let ids = current.and_then(|id| self.ids(&id));
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            Value::String(jiff::Timestamp::now().to_string()),
        );
        line.insert(
            "level".into(),
            Value::String(event.metadata().level().to_string()),
        );
        line.insert(
            "target".into(),
            Value::String(event.metadata().target().to_owned()),
        );
        for (name, value) in &self.identity {
            line.insert(name.clone(), value.clone());
        }
        if let Some(scope) = ctx.event_scope() {
            let mut innermost = None;
            for span in scope.from_root() {
                innermost = Some(span.name());
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(fields) {
                    insert_fields(&mut line, fields);
                }
            }
            if let Some(name) = innermost {
                line.insert("span".into(), Value::String(name.to_owned()));
            }
        }
        let mut fields = FieldVisitor::default();
        event.record(&mut fields);
        if let Some(message) = fields.message.take() {
            line.insert("message".into(), Value::String(message));
        }
        insert_fields(&mut line, fields.fields);
        if let Some(span) = ids {
            line.insert(
                "trace_id".into(),
                Value::String(span.trace_id().to_string()),
            );
            line.insert("span_id".into(), Value::String(span.span_id().to_string()));
        }
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Adds `fields` to `line`, a later one replacing an earlier one of the same name (an
/// inner span's `cluster` wins over an outer one's), but never a line's own key.
fn insert_fields(line: &mut Map<String, Value>, fields: Map<String, Value>) {
    for (name, value) in fields {
        if RESERVED.contains(&name.as_str()) {
            line.insert(format!("field.{name}"), value);
        } else {
            line.insert(name, value);
        }
    }
}

/// An event's fields as JSON values, its `message` apart.
#[derive(Default)]
struct FieldVisitor {
    message: Option<String>,
    fields: Map<String, Value>,
}

impl FieldVisitor {
    fn put(&mut self, field: &tracing::field::Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(text) => text,
                other => other.to_string(),
            });
        } else {
            self.fields.insert(field.name().to_owned(), value);
        }
    }
}

impl tracing::field::Visit for FieldVisitor {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.put(field, Value::String(value.to_owned()));
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.put(field, Value::Bool(value));
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.put(field, Value::from(value));
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.put(field, Value::from(value));
    }
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.put(field, Value::from(value));
    }
    fn record_error(
        &mut self,
        field: &tracing::field::Field,
        value: &(dyn std::error::Error + 'static),
    ) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }
}

/// The tracer provider: exporting over OTLP when configured, else giving spans their
/// ids only.
fn build_provider(service: &'static str) -> SdkTracerProvider {
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service);
    }
    let builder = SdkTracerProvider::builder().with_resource(resource.build());
    if !exporting() {
        return builder.build();
    }
    match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(exporter) => builder.with_batch_exporter(exporter).build(),
        Err(error) => {
            eprintln!(
                "castellan: traces will not be exported: building the OTLP span exporter: {error}"
            );
            builder.build()
        }
    }
}

/// The trace context of the current span as HTTP headers (`traceparent`, …).
pub fn inject() -> HashMap<String, String> {
    let mut headers = HashMap::new();
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut headers);
    headers
}

/// Makes `span` a child of the trace context in `headers`, if they carry one.
pub fn extract(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    let carrier: HashMap<String, String> = headers
        .iter()
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect();
    let context = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(context);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The lines a subscriber with [`JsonLine`] wrote, parsed.
    fn lines_of(run: impl FnOnce()) -> Vec<Map<String, Value>> {
        let written = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = written.clone();
        let line = JsonLine::new(&[("instance", "orders-1".to_owned())]);
        let installed = line.installed();
        let layer = tracing_subscriber::fmt::layer()
            .fmt_fields(JsonFields::new())
            .event_format(line)
            .with_writer(move || Sink(sink.clone()));
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(layer)
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let dispatch = tracing::Dispatch::new(subscriber);
        let _ = installed.set(dispatch.downgrade());
        tracing::dispatcher::with_default(&dispatch, run);
        let text = String::from_utf8(written.lock().expect("sink").clone()).expect("utf-8");
        text.lines()
            .map(|line| serde_json::from_str(line).expect("every line is one JSON object"))
            .collect()
    }

    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("sink").extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_is_flat_with_the_spans_fields_the_identity_and_the_trace_ids() {
        let lines = lines_of(|| {
            tracing::info!("outside any span");
            let span = tracing::info_span!("reconcile", cluster = "shop/orders");
            let _entered = span.enter();
            tracing::warn!(lag_bytes = 42u64, message = "replica behind");
        });
        assert_eq!(lines.len(), 2);
        let outside = &lines[0];
        assert_eq!(outside["message"], "outside any span");
        assert_eq!(outside["level"], "INFO");
        assert_eq!(outside["instance"], "orders-1");
        assert!(outside.get("trace_id").is_none(), "no span, no trace");
        let inside = &lines[1];
        assert_eq!(inside["message"], "replica behind");
        assert_eq!(inside["level"], "WARN");
        assert_eq!(inside["cluster"], "shop/orders");
        assert_eq!(inside["span"], "reconcile");
        assert_eq!(inside["lag_bytes"], 42);
        assert_eq!(inside["instance"], "orders-1");
        let trace = inside["trace_id"].as_str().expect("a trace id");
        assert_eq!(trace.len(), 32);
        assert_ne!(trace, "0".repeat(32));
        assert_eq!(inside["span_id"].as_str().map(str::len), Some(16));
        assert!(
            inside["timestamp"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z'))
        );
    }

    #[test]
    fn a_field_named_like_a_lines_own_key_does_not_replace_it() {
        let lines = lines_of(|| tracing::info!(level = "fine", "checked"));
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["field.level"], "fine");
    }
}
