//! Prometheus exposition shared by the three processes that serve metrics (operator,
//! instance manager, agent; names in docs/metrics.md): registries encoded in the
//! OpenMetrics text format by `prometheus-client`, and the plain-HTTP `/metrics`
//! server of the instance manager and the agent. What each process measures lives
//! with that process; this module only writes and serves it.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The content type of [`encode`]'s text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registries as one OpenMetrics exposition: several, so that metrics read at
/// scrape time can sit beside long-lived counters without being registered for good.
/// (Help texts are given without a final full stop: prometheus-client adds one.)
pub fn encode(registries: &[&Registry]) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in a metric
    // (an invalid name), which the unit tests of each registry would show.
    for registry in registries {
        if let Err(error) = prometheus_client::encoding::text::encode_registry(&mut text, registry)
        {
            tracing::error!(%error, "encoding metrics");
        }
    }
    let _ = prometheus_client::encoding::text::encode_eof(&mut text);
    text
}

/// A `/metrics` response of `text`.
pub fn response(text: String) -> impl IntoResponse {
    ([(CONTENT_TYPE, OPENMETRICS)], text)
}

/// Serves `/metrics` on `listener`, plain HTTP, answering each scrape with what
/// `render` returns, until the process ends.
pub async fn serve<F, R>(listener: tokio::net::TcpListener, render: R)
where
    R: Fn() -> F + Send + Sync + 'static,
    F: Future<Output = String> + Send + 'static,
{
    let render = Arc::new(render);
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move { response(render().await) }
        }),
    );
    let address = listener.local_addr().ok();
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(?address, %error, "the /metrics server stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge;

    #[test]
    fn registries_are_encoded_in_order_with_one_eof() {
        let (mut first, mut second) = (Registry::default(), Registry::default());
        let (up, down): (Gauge, Gauge) = (Gauge::default(), Gauge::default());
        up.set(1);
        first.register("castellan_first", "First", up);
        second.register("castellan_second", "Second", down);
        let text = encode(&[&first, &second]);
        let first_at = text.find("castellan_first 1").expect("first");
        let second_at = text.find("castellan_second 0").expect("second");
        assert!(first_at < second_at);
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.ends_with("# EOF\n"));
        assert!(text.contains("# HELP castellan_first First.\n"), "{text}");
    }
}
