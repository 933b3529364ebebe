//! The node's kubelet API over HTTPS, as much of it as `kubectl logs` needs:
//! `GET /containerLogs/{namespace}/{pod}/{container}` with `previous`, `follow`,
//! `tailLines` and `limitBytes`, plus `/healthz`.
//!
//! The API server connects with its kubelet client certificate and checks this server's
//! certificate against the cluster CA, so the server presents a certificate signed by
//! that CA (with an IP SAN for the node's address) and requires client certificates
//! signed by it.

use std::convert::Infallible;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::net::TcpListener;

use crate::logs;
use crate::pods::NodeContext;

type Body = BoxBody<Bytes, Infallible>;

const FOLLOW_POLL: Duration = Duration::from_millis(250);

pub struct TlsFiles {
    pub certificate: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

pub async fn bind(address: Ipv4Addr, port: u16) -> anyhow::Result<TcpListener> {
    TcpListener::bind((address, port))
        .await
        .with_context(|| format!("listening on {address}:{port} for the kubelet API"))
}

fn tls_config(files: &TlsFiles) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certificates = CertificateDer::pem_file_iter(&files.certificate)
        .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading certificate {}", files.certificate.display()))?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("reading private key {}", files.key.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(&files.client_ca)
        .with_context(|| format!("reading CA {}", files.client_ca.display()))?
    {
        let ca = ca.with_context(|| format!("reading CA {}", files.client_ca.display()))?;
        roots
            .add(ca)
            .with_context(|| format!("adding CA {}", files.client_ca.display()))?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .context("building the client certificate verifier")?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certificates, key)
        .context("loading the kubelet server certificate")?;
    Ok(config)
}

/// Serves until the process ends; a bad TLS setup is logged and ends only the server.
pub async fn serve(listener: TcpListener, files: TlsFiles, node: Arc<NodeContext>) {
    let config = match tls_config(&files) {
        Ok(config) => Arc::new(config),
        Err(error) => {
            tracing::error!("kubelet API disabled: {error:#}");
            return;
        }
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!("accepting a kubelet API connection: {error}");
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let node = node.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::debug!(%peer, "TLS handshake: {error}");
                    return;
                }
            };
            let service = hyper::service::service_fn(move |request| {
                let node = node.clone();
                async move { Ok::<_, Infallible>(handle(&node, request).await) }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, "kubelet API connection: {error}");
            }
        });
    }
}

fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(message.into())).boxed());
    *response.status_mut() = status;
    response
}

/// Query options of a log request, as the API server passes them on.
#[derive(Debug, Default, PartialEq)]
struct LogOptions {
    previous: bool,
    follow: bool,
    tail_lines: Option<usize>,
    limit_bytes: Option<usize>,
}

fn log_options(query: Option<&str>) -> LogOptions {
    let mut options = LogOptions::default();
    for pair in query.unwrap_or_default().split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        match key {
            "previous" => options.previous = value == "true" || value == "1",
            "follow" => options.follow = value == "true" || value == "1",
            "tailLines" => options.tail_lines = value.parse().ok(),
            "limitBytes" => options.limit_bytes = value.parse().ok(),
            _ => {}
        }
    }
    options
}

async fn handle(
    node: &Arc<NodeContext>,
    request: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let path = request.uri().path().to_string();
    if path == "/healthz" {
        return text(StatusCode::OK, "ok");
    }
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let ["containerLogs", namespace, pod, container] = parts.as_slice() else {
        return text(
            StatusCode::NOT_FOUND,
            format!("castellan-devnode does not serve {path}"),
        );
    };
    let options = log_options(request.uri().query());
    let Some(pod_dir) = node.pod_dir(namespace, pod) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("pod {namespace}/{pod} is not running on this node"),
        );
    };
    let Some(file) = logs::log_file(&pod_dir, container, options.previous) else {
        let which = if options.previous {
            "previous terminated"
        } else {
            "current"
        };
        return text(
            StatusCode::BAD_REQUEST,
            format!("{which} container \"{container}\" in pod \"{pod}\" has no log"),
        );
    };
    let contents = match tokio::fs::read(&file).await {
        Ok(contents) => contents,
        Err(error) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading {}: {error}", file.display()),
            );
        }
    };
    let mut body = logs::tail(&contents, options.tail_lines).to_vec();
    if let Some(limit) = options.limit_bytes {
        body.truncate(limit);
    }
    if !options.follow || options.previous {
        return Response::new(Full::new(Bytes::from(body)).boxed());
    }
    let offset = contents.len() as u64;
    let stream = follow(node.clone(), file, offset, Bytes::from(body));
    Response::new(BodyExt::boxed(StreamBody::new(stream)))
}

/// The log's new bytes as they are written, until the container's run is over.
fn follow(
    node: Arc<NodeContext>,
    file: PathBuf,
    offset: u64,
    first: Bytes,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send {
    futures::stream::unfold((Some(first), offset), move |(first, offset)| {
        let file = file.clone();
        let node = node.clone();
        async move {
            if let Some(first) = first {
                return Some((Ok(Frame::data(first)), (None, offset)));
            }
            loop {
                // Asked before reading, so that what a run writes just before it ends is
                // still read once more.
                let live = node.is_log_live(&file);
                if let Some(chunk) = read_from(&file, offset)
                    .await
                    .filter(|chunk| !chunk.is_empty())
                {
                    let next = offset + chunk.len() as u64;
                    return Some((Ok(Frame::data(Bytes::from(chunk))), (None, next)));
                }
                if !live {
                    return None;
                }
                tokio::time::sleep(FOLLOW_POLL).await;
            }
        }
    })
}

async fn read_from(file: &Path, offset: u64) -> Option<Vec<u8>> {
    let mut handle = tokio::fs::File::open(file).await.ok()?;
    handle.seek(std::io::SeekFrom::Start(offset)).await.ok()?;
    let mut chunk = Vec::new();
    handle.read_to_end(&mut chunk).await.ok()?;
    Some(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_log_options() {
        assert_eq!(
            log_options(Some("follow=true&tailLines=5&previous=false")),
            LogOptions {
                previous: false,
                follow: true,
                tail_lines: Some(5),
                limit_bytes: None
            }
        );
        assert_eq!(log_options(None), LogOptions::default());
    }
}
