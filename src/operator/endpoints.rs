//! The operator's own HTTP endpoints: `/healthz` (the process answers), `/readyz` (the
//! Kubernetes API answers it) and `/metrics` (Prometheus text format).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use kube::Client;

/// Counters the controller updates and `/metrics` reports.
#[derive(Default)]
pub struct Metrics {
    pub reconciles: AtomicU64,
    pub reconcile_errors: AtomicU64,
    pub instances_created: AtomicU64,
    /// 1 while this replica holds the leader Lease.
    pub leader: AtomicU64,
}

impl Metrics {
    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self) -> String {
        let line = |name: &str, help: &str, value: u64| {
            format!("# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}\n")
        };
        [
            line(
                "castellan_reconciles_total",
                "DatabaseCluster reconciles run.",
                self.reconciles.load(Ordering::Relaxed),
            ),
            line(
                "castellan_reconcile_errors_total",
                "DatabaseCluster reconciles that failed (and were retried).",
                self.reconcile_errors.load(Ordering::Relaxed),
            ),
            line(
                "castellan_instances_created_total",
                "Database instance pods created.",
                self.instances_created.load(Ordering::Relaxed),
            ),
            format!(
                "# HELP castellan_leader Whether this operator replica is the leader.\n\
                 # TYPE castellan_leader gauge\ncastellan_leader {}\n",
                self.leader.load(Ordering::Relaxed)
            ),
        ]
        .concat()
    }
}

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

async fn render_metrics(State(shared): State<Arc<Shared>>) -> String {
    shared.metrics.render()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_in_prometheus_text_format() {
        let metrics = Metrics::default();
        Metrics::count(&metrics.reconciles);
        Metrics::count(&metrics.reconciles);
        Metrics::count(&metrics.reconcile_errors);
        let text = metrics.render();
        assert!(
            text.contains(
                "# TYPE castellan_reconciles_total counter\ncastellan_reconciles_total 2\n"
            )
        );
        assert!(text.contains("castellan_reconcile_errors_total 1\n"));
        assert!(text.contains("castellan_instances_created_total 0\n"));
    }
}
