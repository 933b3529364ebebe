//! Logs and traces of the long-running processes (operator, instance manager, node
//! agent).
//!
//! Logs: JSON lines on stderr, filtered by `RUST_LOG` (default `info`).
//! Traces: every `tracing` span is also an OpenTelemetry span, exported over OTLP/HTTP
//! when the standard variables say where (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`
//! and `OTEL_BSP_*` are read by the SDK). Without them nothing is exported. Trace
//! context crosses processes as W3C `traceparent` headers ([`inject`], [`extract`]).

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Flushes and stops the trace exporter when dropped (at the end of `main`).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
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

/// Installs logging (JSON lines), and trace export when configured. `service` names
/// the process in traces unless `OTEL_SERVICE_NAME` says otherwise.
pub fn init(service: &'static str) -> Telemetry {
    init_with(service, true)
}

/// [`init`], with logs as JSON lines or as text (coloured on a terminal).
pub fn init_with(service: &'static str, json: bool) -> Telemetry {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json_logs = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
    });
    let text_logs = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
    });
    let provider = exporting()
        .then(|| build_provider(service))
        .and_then(|built| match built {
            Ok(provider) => Some(provider),
            Err(error) => {
                eprintln!("castellan: traces will not be exported: {error:#}");
                None
            }
        });
    let traces = provider
        .as_ref()
        .map(|provider| tracing_opentelemetry::layer().with_tracer(provider.tracer("castellan")));
    tracing_subscriber::registry()
        .with(filter)
        .with(json_logs)
        .with(text_logs)
        .with(traces)
        .init();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    Telemetry { provider }
}

fn build_provider(service: &'static str) -> anyhow::Result<SdkTracerProvider> {
    use anyhow::Context as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("building the OTLP span exporter")?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service);
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
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
