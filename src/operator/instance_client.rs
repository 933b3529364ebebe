//! The operator's side of the instance manager's HTTP API (`castellan instance`):
//! status reads and commands, over HTTP/1.1 (hyper) with mutual TLS to the pod's
//! address. JSON bodies, a deadline on everything. A command gets a connection of its
//! own; the reads and lease renewals each replica actor makes every second go over a
//! kept connection ([`call_kept`]), since a new one per call (TCP, and a TLS handshake,
//! resumed or not) was most of an idle operator's CPU (docs/benchmarks.md). What is
//! kept between calls is the verified TLS stream alone: hyper's side of a connection
//! (its request channel, 16 KiB once it has carried a few requests, and its 8 KiB write
//! and 4 KiB read buffers) is made for each call and dropped after it, which took
//! about 25 KiB per instance off the operator's memory.
//!
//! An address names the server as well as where it is: `<server-name>@<ip>:<port>`
//! ([`address`]). The pod is dialled at the IP, and its certificate must be valid for
//! the server name (`<cluster>.<namespace>.instance.castellan.io`), so a stale address
//! whose IP now belongs to another cluster's pod is refused rather than obeyed.
//!
//! The TLS configuration (Castellan's CAs, the operator's client certificate) is set
//! for the process at startup and again when the CA rotates ([`configure`]), so
//! callers only say what to call.

use std::io;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum InstanceApiError {
    #[error("calling {method} {path} on {address}: {source}")]
    Io {
        method: &'static str,
        path: String,
        address: String,
        source: std::io::Error,
    },
    #[error("calling {method} {path} on {address}: no answer within {timeout:?}")]
    Timeout {
        method: &'static str,
        path: String,
        address: String,
        timeout: Duration,
    },
    #[error("calling {method} {path} on {address}: status {status}: {body}")]
    Status {
        method: &'static str,
        path: String,
        address: String,
        status: u16,
        body: String,
    },
    #[error("calling {method} {path} on {address}: the answer is not JSON: {body}")]
    Body {
        method: &'static str,
        path: String,
        address: String,
        body: String,
    },
}

const TIMEOUT: Duration = Duration::from_secs(5);
/// Answers are small JSON documents; anything larger is not an instance manager's.
const MAX_BODY: usize = 1 << 20;

static TLS: RwLock<Option<Arc<rustls::ClientConfig>>> = RwLock::new(None);

/// Sets the TLS configuration every call from now on uses (calls under way finish
/// with the one they started with).
pub fn configure(config: rustls::ClientConfig) {
    let mut current = match TLS.write() {
        Ok(current) => current,
        Err(poisoned) => poisoned.into_inner(),
    };
    *current = Some(Arc::new(config));
}

fn configured() -> Option<Arc<rustls::ClientConfig>> {
    match TLS.read() {
        Ok(current) => current.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// The address of the instance API of a pod at `ip` whose certificate is valid for
/// `server_name`.
pub fn address(server_name: &str, ip: &str, port: i32) -> String {
    match ip.parse::<std::net::IpAddr>() {
        // Brackets for IPv6, as a socket address needs them.
        Ok(ip) => format!(
            "{server_name}@{}",
            std::net::SocketAddr::new(ip, u16::try_from(port).unwrap_or(0))
        ),
        Err(_) => format!("{server_name}@{ip}:{port}"),
    }
}

/// The instance API address of `pod`, an instance of `cluster` (its certificate is the
/// cluster's), once the pod has an IP.
pub fn pod_address(
    cluster: &castellan_crds::DatabaseCluster,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Option<String> {
    use kube::ResourceExt;
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let server_name = crate::pki::server_name(&cluster.name_any(), &namespace);
    let ip = pod.status.as_ref()?.pod_ip.as_ref()?;
    Some(address(
        &server_name,
        ip,
        crate::operator::build::INSTANCE_API_PORT,
    ))
}

/// Splits an address into the name to verify and where to connect.
fn target(address: &str) -> io::Result<(ServerName<'static>, &str)> {
    let (name, socket) = address.split_once('@').ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the address names no server to verify (expected <server-name>@<ip>:<port>)",
        )
    })?;
    let name = ServerName::try_from(name.to_owned()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a server name: {e}"),
        )
    })?;
    Ok((name, socket))
}

/// A connection to an instance, verified.
type Stream = tokio_rustls::client::TlsStream<TcpStream>;

/// Connects to the instance at `address` and verifies it is the one the address names.
async fn connect(tls: Arc<rustls::ClientConfig>, address: &str) -> io::Result<Stream> {
    let (name, socket) = target(address)?;
    let stream = TcpStream::connect(socket).await?;
    TlsConnector::from(tls).connect(name, stream).await
}

fn unconfigured() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "the operator's TLS configuration for the instance API is not set",
    )
}

/// An answer: its status and whole body.
type Answer = (hyper::StatusCode, Bytes);

/// Sends `request` and reads the whole answer, and whether the instance will close the
/// connection after it (`Connection: close`).
async fn send(
    sender: &mut SendRequest<Full<Bytes>>,
    request: hyper::Request<Full<Bytes>>,
) -> io::Result<(Answer, bool)> {
    let response = sender
        .send_request(request)
        .await
        .map_err(io::Error::other)?;
    let status = response.status();
    let closing = response
        .headers()
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("close"));
    let body = Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(io::Error::other)?
        .to_bytes();
    Ok(((status, body), closing))
}

/// Sends `request` over `stream` and reads the answer; the stream back when it may
/// carry another request (the instance keeps it open and sent nothing more).
async fn exchange_on(
    stream: Stream,
    request: hyper::Request<Full<Bytes>>,
) -> io::Result<(Answer, Option<Stream>)> {
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(io::Error::other)?;
    // Dropping the sender ends the connection once the answer is read; without
    // shutdown, it gives the stream back rather than closing it.
    let exchanged = async move { send(&mut sender, request).await };
    // The connection is driven here rather than spawned, so the caller's deadline
    // ends it too.
    let (exchanged, parts) = tokio::join!(exchanged, connection.without_shutdown());
    let (answer, closing) = exchanged?;
    let stream = match parts {
        Ok(parts) if !closing && parts.read_buf.is_empty() => Some(parts.io.into_inner()),
        _ => None,
    };
    Ok((answer, stream))
}

/// Connects, verifies the instance, sends one request and reads the answer.
async fn exchange(
    tls: Option<Arc<rustls::ClientConfig>>,
    address: &str,
    request: hyper::Request<Full<Bytes>>,
) -> io::Result<Answer> {
    let stream = connect(tls.ok_or_else(unconfigured)?, address).await?;
    let (answer, stream) = exchange_on(stream, request).await?;
    // Closed as hyper would have closed it: TLS close_notify, then the write side.
    if let Some(mut stream) = stream {
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
    }
    Ok(answer)
}

/// A kept connection is used for new requests this long after it was opened, then
/// closed: a renewed certificate or a changed trust on either side takes effect within
/// it, and each instance sees one handshake a minute instead of two a second.
const KEPT_FOR: Duration = Duration::from_secs(60);
/// At most this many idle connections are kept (one or two per instance: far more
/// than a node's clusters have).
const KEPT_AT_MOST: usize = 512;

/// An open connection between two requests.
struct Idle {
    stream: Stream,
    /// The configuration it was verified with: after a CA rotation's `configure`, the
    /// connections of the old one are not used again.
    tls: Arc<rustls::ClientConfig>,
    opened: Instant,
}

impl Idle {
    /// Within its time. Whether the instance closed it is found out when it is next
    /// used (nothing reads a kept stream between calls): [`exchange_kept`] then sends
    /// again on a new one.
    fn alive(&self) -> bool {
        self.opened.elapsed() < KEPT_FOR
    }

    /// Sends `request` over this connection to `address` and reads the answer; the
    /// connection is kept again when it may carry another request.
    async fn exchange(
        self,
        address: &str,
        request: hyper::Request<Full<Bytes>>,
    ) -> io::Result<Answer> {
        let Self {
            stream,
            tls,
            opened,
        } = self;
        let (answer, stream) = exchange_on(stream, request).await?;
        if let Some(stream) = stream {
            park(
                address,
                Self {
                    stream,
                    tls,
                    opened,
                },
            );
        }
        Ok(answer)
    }
}

/// The idle kept connections, by address.
static KEPT: Mutex<Vec<(String, Idle)>> = Mutex::new(Vec::new());

fn kept() -> std::sync::MutexGuard<'static, Vec<(String, Idle)>> {
    match KEPT.lock() {
        Ok(kept) => kept,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// An idle connection to `address` made with `tls`, if one is kept; those past their
/// time or of another configuration are dropped on the way.
fn take(address: &str, tls: &Arc<rustls::ClientConfig>) -> Option<Idle> {
    let mut kept = kept();
    kept.retain(|(_, idle)| Arc::ptr_eq(&idle.tls, tls) && idle.alive());
    let at = kept.iter().position(|(kept, _)| kept == address)?;
    Some(kept.swap_remove(at).1)
}

fn park(address: &str, idle: Idle) {
    let mut kept = kept();
    if idle.alive() && kept.len() < KEPT_AT_MOST {
        kept.push((address.to_owned(), idle));
    }
}

/// [`exchange`] over a kept connection when there is one, else a new one that is kept
/// afterwards. A request that fails on a kept connection (the instance closed it, or
/// restarted) is sent once more on a new one: only requests the instance may receive
/// twice come here.
async fn exchange_kept(
    tls: Option<Arc<rustls::ClientConfig>>,
    address: &str,
    request: impl Fn() -> io::Result<hyper::Request<Full<Bytes>>>,
) -> io::Result<Answer> {
    let tls = tls.ok_or_else(unconfigured)?;
    if let Some(idle) = take(address, &tls) {
        match idle.exchange(address, request()?).await {
            Ok(answer) => return Ok(answer),
            Err(error) => {
                tracing::debug!(%address, %error, "a kept connection to the instance failed: sending again on a new one");
            }
        }
    }
    let idle = Idle {
        stream: connect(tls.clone(), address).await?,
        tls,
        opened: Instant::now(),
    };
    idle.exchange(address, request()?).await
}

/// Sends one request and returns the JSON body of a 2xx answer.
pub async fn call(
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, InstanceApiError> {
    call_within(method, address, path, body, TIMEOUT).await
}

/// [`call`] with another deadline, for slow operations such as a restart.
pub async fn call_within(
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Value, InstanceApiError> {
    request(
        configured(),
        method,
        address,
        path,
        body,
        timeout,
        Reuse::Own,
    )
    .await
}

/// `GET path` with a TLS configuration of its own rather than the process' one: what
/// a CA rotation proves an instance's trust with.
pub async fn get_as(
    tls: Arc<rustls::ClientConfig>,
    address: &str,
    path: &str,
) -> Result<Value, InstanceApiError> {
    request(Some(tls), "GET", address, path, None, TIMEOUT, Reuse::Own).await
}

/// [`call_within`] over a connection kept between calls, for requests the instance may
/// receive twice with no harm (status reads, lease renewals), which are the ones made
/// every second. The deadline is at most [`TIMEOUT`].
pub async fn call_kept(
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Value, InstanceApiError> {
    let timeout = timeout.min(TIMEOUT);
    request(
        configured(),
        method,
        address,
        path,
        body,
        timeout,
        Reuse::Kept,
    )
    .await
}

/// Whether a request gets a connection of its own or may use a kept one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reuse {
    Own,
    Kept,
}

async fn request(
    tls: Option<Arc<rustls::ClientConfig>>,
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
    reuse: Reuse,
) -> Result<Value, InstanceApiError> {
    let io_error = |source| InstanceApiError::Io {
        method,
        path: path.to_owned(),
        address: address.to_owned(),
        source,
    };
    let span = tracing::info_span!("instance api call", %method, %path, %address);
    let payload = Bytes::from(body.map(Value::to_string).unwrap_or_default());
    let host = address.split_once('@').map_or(address, |(name, _)| name);
    // The trace context goes along, so the instance manager's span joins this trace.
    let context = span.in_scope(crate::telemetry::inject);
    let build = || {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        for (name, value) in &context {
            request = request.header(name, value);
        }
        request
            .body(Full::new(payload.clone()))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    };
    let exchanged = async {
        match reuse {
            Reuse::Own => exchange(tls, address, build()?).await,
            Reuse::Kept => exchange_kept(tls, address, build).await,
        }
    };
    let exchanged = tokio::time::timeout(timeout, exchanged).instrument(span);
    let (status, body) = match exchanged.await {
        Ok(Ok(answer)) => answer,
        Ok(Err(source)) => return Err(io_error(source)),
        Err(_) => {
            return Err(InstanceApiError::Timeout {
                method,
                path: path.to_owned(),
                address: address.to_owned(),
                timeout,
            });
        }
    };
    let body = String::from_utf8_lossy(&body).into_owned();
    if !status.is_success() {
        return Err(InstanceApiError::Status {
            method,
            path: path.to_owned(),
            address: address.to_owned(),
            status: status.as_u16(),
            body,
        });
    }
    serde_json::from_str(&body).map_err(|_| InstanceApiError::Body {
        method,
        path: path.to_owned(),
        address: address.to_owned(),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Authority, server_name, tls};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::SystemTime;

    #[test]
    fn addresses_name_the_server_and_bracket_ipv6() {
        assert_eq!(
            address("a.b.instance.castellan.io", "10.0.0.7", 8000),
            "a.b.instance.castellan.io@10.0.0.7:8000"
        );
        assert_eq!(
            address("a.b.instance.castellan.io", "fd00::7", 8000),
            "a.b.instance.castellan.io@[fd00::7]:8000"
        );
        assert!(target("10.0.0.7:8000").is_err(), "no name, no call");
    }

    /// A TLS server with the instance manager's TLS configuration, each of whose
    /// connections `handle` serves; and the count of connections it accepted.
    async fn serve_with<F, Fut>(
        config: rustls::ServerConfig,
        handle: F,
    ) -> (std::net::SocketAddr, Arc<AtomicUsize>)
    where
        F: Fn(tokio_rustls::server::TlsStream<TcpStream>) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listening");
        let bound = listener.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let (acceptor, handle) = (acceptor.clone(), handle.clone());
                tokio::spawn(async move {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        handle(stream).await;
                    }
                });
            }
        });
        (bound, accepted)
    }

    /// A one-route HTTPS server, and the count of connections it accepted.
    /// `keep_alive: false` closes each connection after its first answer.
    async fn serve(
        config: rustls::ServerConfig,
        keep_alive: bool,
    ) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let app = axum::Router::new().route(
            "/status",
            axum::routing::get(|headers: axum::http::HeaderMap| async move {
                axum::Json(serde_json::json!({
                    "host": headers.get("host").and_then(|h| h.to_str().ok()),
                }))
            }),
        );
        serve_with(config, move |stream| {
            let app = app.clone();
            async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(keep_alive)
                    .serve_connection(
                        TokioIo::new(stream),
                        hyper_util::service::TowerToHyperService::new(app),
                    )
                    .await;
            }
        })
        .await
    }

    #[tokio::test]
    async fn calls_verify_the_cluster_and_present_the_operator() {
        let now = SystemTime::now();
        let ca = Arc::new(Authority::generate(now).expect("ca"));
        let server = ca.issue_server("orders", "shop", now).expect("server");
        let dir = std::env::temp_dir().join(format!("client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("ca.crt"), ca.cert_pem()).expect("ca");
        std::fs::write(dir.join("tls.crt"), &server.cert_pem).expect("cert");
        std::fs::write(dir.join("tls.key"), &server.key_pem).expect("key");
        let config = tls::instance_server_config(
            &dir.join("ca.crt"),
            &dir.join("tls.crt"),
            &dir.join("tls.key"),
        )
        .expect("server config");
        let _ = std::fs::remove_dir_all(&dir);
        let (bound, accepted) = serve(config.clone(), true).await;
        let ip = bound.ip().to_string();
        let port = i32::from(bound.port());

        let unconfigured = call("GET", &address("x", &ip, port), "/status", None).await;
        assert!(
            matches!(&unconfigured, Err(InstanceApiError::Io { source, .. }) if source.kind() == io::ErrorKind::NotConnected),
            "{unconfigured:?}"
        );
        configure(
            tls::operator_client_config(&crate::pki::Trust::single(ca.clone()))
                .expect("client config"),
        );

        let right = address(&server_name("orders", "shop"), &ip, port);
        let answer = call("GET", &right, "/status", None)
            .await
            .expect("the operator reaches its cluster's instance");
        assert_eq!(answer["host"], "orders.shop.instance.castellan.io");

        let wrong = address(&server_name("orders", "other"), &ip, port);
        let refused = call("GET", &wrong, "/status", None).await;
        assert!(
            matches!(&refused, Err(InstanceApiError::Io { .. })),
            "an instance of another cluster is not trusted: {refused:?}"
        );
        let missing = call("GET", &right, "/nothing", None).await;
        assert!(
            matches!(missing, Err(InstanceApiError::Status { status: 404, .. })),
            "{missing:?}"
        );
        let own = accepted.load(Ordering::SeqCst);
        assert_eq!(
            own, 3,
            "every call above that connected had a connection of its own"
        );

        // Kept: three calls, one connection, answers and errors alike.
        for _ in 0..2 {
            let answer = call_kept("GET", &right, "/status", None, TIMEOUT)
                .await
                .expect("a kept call");
            assert_eq!(answer["host"], "orders.shop.instance.castellan.io");
        }
        let missing = call_kept("GET", &right, "/nothing", None, TIMEOUT).await;
        assert!(
            matches!(missing, Err(InstanceApiError::Status { status: 404, .. })),
            "{missing:?}"
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            own + 1,
            "one kept connection"
        );
        let refused = call_kept("GET", &wrong, "/status", None, TIMEOUT).await;
        assert!(
            matches!(&refused, Err(InstanceApiError::Io { .. })),
            "a kept connection is to the server the address names: {refused:?}"
        );

        // An instance that closes each connection after its answer (or restarted):
        // every call still gets through, on a new connection.
        let (closing, closes) = serve(config.clone(), false).await;
        let closing = address(
            &server_name("orders", "shop"),
            &closing.ip().to_string(),
            i32::from(closing.port()),
        );
        for _ in 0..3 {
            call_kept("GET", &closing, "/status", None, TIMEOUT)
                .await
                .expect("a call to an instance that closes its connections");
        }
        assert_eq!(closes.load(Ordering::SeqCst), 3);

        // A CA rotation's new configuration: no connection of the old one is used.
        configure(
            tls::operator_client_config(&crate::pki::Trust::single(ca)).expect("client config"),
        );
        call_kept("GET", &right, "/status", None, TIMEOUT)
            .await
            .expect("a kept call after the configuration changed");
        assert_eq!(accepted.load(Ordering::SeqCst), own + 3, "a new connection");

        // An instance that closes a kept connection while it is idle, without saying
        // so in its answer (it restarted): the next call finds out on the stream and
        // gets through on a new connection.
        let (dropping, drops) = serve_once(config).await;
        let dropping = address(
            &server_name("orders", "shop"),
            &dropping.ip().to_string(),
            i32::from(dropping.port()),
        );
        for _ in 0..3 {
            let answer = call_kept("GET", &dropping, "/status", None, TIMEOUT)
                .await
                .expect("a call after the instance dropped the kept connection");
            assert_eq!(answer["once"], true);
        }
        assert_eq!(drops.load(Ordering::SeqCst), 3);
    }

    /// A TLS server that answers the first request on each connection and then closes
    /// it, with no `Connection: close`; and the count of connections it accepted.
    async fn serve_once(config: rustls::ServerConfig) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        serve_with(config, |mut stream| async move {
            let mut head = Vec::new();
            let mut chunk = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&chunk[..n]),
                }
            }
            let body = r#"{"once":true}"#;
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.shutdown().await;
        })
        .await
    }
}
