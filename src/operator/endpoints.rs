//! The operator's own HTTP endpoints: `/healthz` (the process answers), `/readyz` (the
//! Kubernetes API answers it) and `/metrics` (OpenMetrics text of `metrics.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use kube::Client;

use super::metrics::Metrics;

struct Shared {
    client: Client,
    metrics: Arc<Metrics>,
}

async fn readyz(State(shared): State<Arc<Shared>>) -> (StatusCode, String) {
    match tokio::time::timeout(Duration::from_secs(3), shared.client.apiserver_version()).await {
        Ok(Ok(_)) => (StatusCode::OK, "ok\n".to_owned()),
        Ok(Err(error)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Kubernetes API: {error}\n"),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "Kubernetes API: no answer within 3s\n".to_owned(),
        ),
    }
}

async fn render_metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    crate::exposition::response(shared.metrics.render())
}

/// Serves the endpoints on `address` until the process ends.
pub async fn serve(
    address: SocketAddr,
    client: Client,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listening on {address} for /healthz, /readyz and /metrics"))?;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(Arc::new(Shared { client, metrics }));
    tracing::info!(%address, "serving /healthz, /readyz and /metrics");
    axum::serve(listener, app)
        .await
        .context("serving the operator's endpoints")
}
