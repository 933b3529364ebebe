//! The Kubernetes API client of the operator, the node agent and the plugin.
//!
//! kube's own `Client::try_from(Config)` speaks HTTP/1.1 only and keeps every
//! connection a burst of requests opened: hyper's pool has no per-host limit, so an
//! operator restarted onto 100 clusters, whose cluster actors all make their first
//! requests at once, held 130 TLS connections to the API server afterwards, each with
//! its buffers (docs/benchmarks.md, "Restarting onto 100 clusters"). kube 5 builds its
//! hyper client itself and exposes none of its settings, so this module builds the
//! same stack (base URI, authentication, extra headers over kube's rustls
//! configuration) around a hyper client of its own that:
//!
//! - offers HTTP/2 by ALPN, as client-go does: every watch and request is a stream of
//!   one connection, whatever the burst (an API server without HTTP/2, or a plain-HTTP
//!   URL, gets HTTP/1.1 as before);
//! - sends HTTP/2 PINGs every 30 s, also while idle, and drops the connection when one
//!   is not answered within 15 s (client-go's `ReadIdleTimeout` and `PingTimeout`), so
//!   that a dead connection is noticed by every watch on it at once instead of at the
//!   watches' server-side timeout;
//! - keeps at most a few idle HTTP/1.1 connections, for 30 s, with TCP keep-alive.
//!
//! Left out of kube's stack: its `debug` HTTP span per request (the tracing filter
//! never records it), its retry of 5xx answers (off by default) and the expiry of an
//! exec plugin's client certificate (kube's `Config` does not expose it; bearer tokens
//! from exec plugins and from a mounted service account token are refreshed as before,
//! by kube's authentication layer).

use std::time::Duration;

use anyhow::Context;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::{Body, ConfigExt};
use kube::{Client, Config};
use tower::{BoxError, ServiceBuilder};

/// How often an HTTP/2 connection is pinged, and how long an answer may take.
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);
/// Idle HTTP/1.1 connections kept, and for how long (an HTTP/2 connection is one).
const MAX_IDLE_CONNECTIONS: usize = 4;
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// A client from the environment: in-cluster service account, or `KUBECONFIG`.
pub async fn infer() -> anyhow::Result<Client> {
    let config = Config::infer()
        .await
        .context("finding the Kubernetes API (in-cluster service account or KUBECONFIG)")?;
    from_config(config)
}

/// A client for `config`.
pub fn from_config(config: Config) -> anyhow::Result<Client> {
    let what = format!("building the API client for {}", config.cluster_url);
    build(config).context(what)
}

fn build(config: Config) -> anyhow::Result<Client> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    tcp.set_keepalive(Some(TCP_KEEPALIVE));
    tcp.set_nodelay(true);
    let mut https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls::pki_types::ServerName::try_from(name.clone())
            .with_context(|| format!("tls-server-name {name:?} is no server name"))?;
        https = https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let https = https.enable_all_versions().wrap_connector(tcp);
    let hyper: HyperClient<_, Body> = HyperClient::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
        .pool_idle_timeout(IDLE_TIMEOUT)
        .http2_keep_alive_interval(PING_INTERVAL)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn builds_for_a_plain_http_server() {
        let config = Config::new("http://127.0.0.1:1".parse().expect("a URL"));
        let client = from_config(config).expect("a client");
        assert_eq!(client.default_namespace(), "default");
    }

    #[tokio::test]
    async fn refuses_a_tls_server_name_that_is_none() {
        let mut config = Config::new("https://127.0.0.1:1".parse().expect("a URL"));
        config.tls_server_name = Some("not a name".into());
        let Err(error) = from_config(config) else {
            panic!("an invalid tls-server-name was accepted");
        };
        let error = format!("{error:#}");
        assert!(error.contains("tls-server-name"), "{error}");
        assert!(error.contains("https://127.0.0.1:1"), "{error}");
    }
}
