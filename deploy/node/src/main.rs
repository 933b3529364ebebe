//! `castellan-devnode`: a development-only stand-in for a kubelet and kube-proxy on a
//! machine without a container runtime.
//!
//! `castellan-devnode node` registers one Node and runs every Pod bound to it as local
//! processes; `castellan-devnode proxy` forwards Service ClusterIPs to ready pods. Both
//! talk to the API server like their real counterparts, so the scheduler, the
//! controller-manager and Castellan's operator see an ordinary cluster. The
//! `castellan-devnode sandbox` subcommand is internal: the node runs it in front of
//! every container to give it private bind mounts and its user (see `sandbox.rs`).
//!
//! Not for production: there is no isolation beyond a mount namespace, and every pod
//! shares the host's filesystem, network namespace and users. See docs/devnode.md.

#![forbid(unsafe_code)]

mod address;
mod container;
mod env;
mod events;
mod images;
mod lease;
mod logs;
mod node;
mod pod;
mod pods;
mod probe;
mod process_registry;
mod proxy;
mod reference;
mod sandbox;
mod server;
mod status;
mod volume;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "castellan-devnode",
    about = "Process-backed Kubernetes node for local development"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Register a Node and run the pods bound to it as local processes.
    Node(NodeArgs),
    /// Forward each Service ClusterIP:port (TCP) to the ready pods it selects.
    Proxy(ProxyArgs),
    /// Internal: set up a container's mounts and user, then exec its command.
    #[command(hide = true)]
    Sandbox(sandbox::SandboxArgs),
}

#[derive(clap::Args)]
pub struct NodeArgs {
    /// Kubeconfig used to reach the API server.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Node name.
    #[arg(long)]
    name: String,
    /// Node index (1..=150), for the default zone and pod addresses.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=150))]
    index: u8,
    /// Second octet of this node's pod addresses, 127.<octet>.0.0/16 (default: 100 +
    /// index). Each local cluster on a machine uses its own octets (deploy/local/nodes.sh).
    #[arg(long, value_parser = clap::value_parser!(u8).range(101..=255))]
    pod_octet: Option<u8>,
    /// Value of the `topology.kubernetes.io/zone` label (default: zone-<index>).
    #[arg(long)]
    zone: Option<String>,
    /// Directory for this node's state (pod volumes, logs, process records).
    #[arg(long)]
    state_dir: PathBuf,
    /// YAML file mapping image names to local executables (see docs/devnode.md).
    #[arg(long)]
    images: Option<PathBuf>,
    /// Port of the kubelet HTTPS server (`kubectl logs`); also published in the Node.
    #[arg(long)]
    kubelet_port: u16,
    /// PEM certificate of the kubelet server, signed by the cluster CA, with IP SAN 127.0.0.1.
    #[arg(long)]
    tls_cert: PathBuf,
    /// PEM private key of the kubelet server.
    #[arg(long)]
    tls_key: PathBuf,
    /// PEM CA whose client certificates the kubelet server accepts (the API server's).
    #[arg(long)]
    client_ca: PathBuf,
    /// Address this node reports as its InternalIP and listens on.
    #[arg(long, default_value = "127.0.0.1")]
    node_ip: Ipv4Addr,
    /// CPU capacity advertised.
    #[arg(long, default_value = "8")]
    cpu: String,
    /// Memory capacity advertised.
    #[arg(long, default_value = "16Gi")]
    memory: String,
    /// Maximum number of pods.
    #[arg(long, default_value_t = 110)]
    max_pods: u32,
    /// First restart back-off of a crashing container (doubles up to 5 minutes).
    #[arg(long, value_parser = parse_seconds, default_value = "10")]
    restart_backoff: Duration,
}

#[derive(clap::Args)]
pub struct ProxyArgs {
    /// Kubeconfig used to reach the API server.
    #[arg(long)]
    kubeconfig: PathBuf,
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    text.parse::<f64>()
        .ok()
        .filter(|seconds| *seconds >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{text:?} is not a number of seconds"))
}

/// Where pods reach the API server: the `KUBERNETES_SERVICE_HOST`/`PORT` they are given,
/// since the `kubernetes` Service has no endpoints on a loopback control plane.
#[derive(Clone, Debug)]
pub struct ApiServerAddress {
    pub host: String,
    pub port: u16,
}

/// Builds a client from an explicit kubeconfig file (never from the environment, so a
/// developer's own KUBECONFIG cannot point a dev node at a real cluster).
pub async fn client_from(
    kubeconfig: &std::path::Path,
) -> anyhow::Result<(kube::Client, ApiServerAddress)> {
    let file = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
    let config =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .with_context(|| format!("loading kubeconfig {}", kubeconfig.display()))?;
    let address = ApiServerAddress {
        host: config.cluster_url.host().unwrap_or("127.0.0.1").to_string(),
        port: config.cluster_url.port_u16().unwrap_or(443),
    };
    let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
    Ok((client, address))
}

fn main() -> anyhow::Result<()> {
    let command = match Cli::parse().command {
        // Before any runtime starts: the sandbox unshares its mount namespace and
        // changes user, which must happen in a single-threaded process.
        Command::Sandbox(args) => return sandbox::run(args),
        other => other,
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        match command {
            Command::Node(args) => pods::run_node(args).await,
            Command::Proxy(args) => proxy::run(args).await,
            Command::Sandbox(args) => sandbox::run(args),
        }
    })
}
