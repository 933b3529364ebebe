//! The node agent (`castellan agent`): finds this node's disks, keeps their
//! `BlockDevice` objects current, builds and repairs this node's part of every
//! matching `StoragePool`, and provisions its local volumes.
//!
//! It is an actor tree (see docs/storage.md), like the operator's: a `NodeActor`
//! (`node`) decides when to look at the disks and hands each look to a `DiskActor` per
//! block device (`disk`) and a `PoolMemberActor` per pool (`pool`); a `VolumeActor`
//! (`volume`) runs the provisioner. Each kind has a supervisor that restarts a failed
//! or panicked actor with back-off and reports one that keeps failing. This module is
//! the shell that wires them: it starts the tree and turns kernel uevents, the pools'
//! and volumes' changes, the error counters and the periodic timer into events, and
//! serves `/metrics` (`metrics`). Nothing here decides anything about a disk.

pub mod btrfs;
pub mod children;
pub mod disk;
pub mod host;
pub mod metrics;
pub mod node;
pub mod pool;
pub mod reported;
pub mod serial;
pub mod volume;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use castellan_crds::block_device::BlockDevice;
use castellan_crds::storage_pool::StoragePool;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use regex::Regex;
use tokio::sync::mpsc;

use actix::prelude::*;
use castellan_actors::{
    ActorSystem, ChildFailing, Event, MachineSpec, RestartPolicy, StartChild, Supervisor,
};
use children::{Ask, StorageLock};
use disk::inventory::Inventory;
use disk::observe::{AllowList, Sources};
use disk::shell::{DiskActor, report_failing_disks};
use disk::uevent;
use node::machine::{NodeEvent, NodeState};
use node::shell::{Current, NodeActor, NodeEffects, NodeParts, NodeSetup};
use pool::actor::{PoolMemberActor, report_failing_pools};
use pool::shell::{self as pools, Pools};
use serial::{SerialEvent, SerialState};
use volume::actor::{VolumeActor, VolumeEffects};
use volume::shell::Volumes;

/// The Node label PV node affinity matches.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// Node annotation holding the allow-list pattern when `--device-allow` is not given.
pub const DEVICE_ALLOW_ANNOTATION: &str = "castellan.io/device-allow";

/// `castellan agent` flags.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// The Node this agent runs on (in a DaemonSet: `spec.nodeName` via the downward API).
    #[arg(long)]
    pub node_name: String,
    /// Report only devices whose path, or loop backing file, matches this regular
    /// expression. Without it, the Node's `castellan.io/device-allow` annotation, and
    /// without that, every disk.
    #[arg(long)]
    pub device_allow: Option<String>,
    /// Seconds between full rescans, the fallback for missed uevents.
    #[arg(long, default_value_t = 30)]
    pub rescan_seconds: u64,
    /// Seconds a pool member may be missing before it counts as failed (a disk that
    /// comes back within them was only unplugged or slow to appear after a reboot).
    #[arg(long, env = "CASTELLAN_MISSING_GRACE_SECONDS", default_value_t = 300)]
    pub missing_grace_seconds: u64,
    /// Where pools are mounted: `<pool-root>/<node>/<pool>`.
    #[arg(long, default_value = btrfs::POOL_ROOT)]
    pub pool_root: PathBuf,
    /// Seconds between polls of the StoragePools' generations and of this node's
    /// BlockDevices; a new or changed pool, or a BlockDevice deleted, triggers a look.
    #[arg(long, default_value_t = 5)]
    pub pool_poll_seconds: u64,
    #[command(flatten)]
    pub log: crate::telemetry::LogArgs,
    /// Where `/metrics` is served (plain HTTP; docs/metrics.md). Default: port 9188
    /// of the pod's address (`POD_IP`), else of every address. Agents of several nodes
    /// on one host (the local cluster) each have their own pod address.
    #[arg(long, env = "CASTELLAN_METRICS_ADDRESS")]
    pub metrics_address: Option<std::net::SocketAddr>,
}

/// The agent's metrics port (docs/metrics.md).
const METRICS_PORT: u16 = 9188;

/// Where `/metrics` is served: the flag, else the pod's address, else every address.
fn metrics_address(
    flag: Option<std::net::SocketAddr>,
    pod_ip: Option<&str>,
) -> std::net::SocketAddr {
    flag.unwrap_or_else(|| {
        let ip = pod_ip
            .and_then(|ip| ip.parse().ok())
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        std::net::SocketAddr::new(ip, METRICS_PORT)
    })
}

/// Runs the agent until SIGINT or SIGTERM.
pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    // Logs as the flag says; traces over OTLP as the operator's (crate::telemetry).
    let _telemetry = crate::telemetry::init(
        "castellan-agent",
        args.log.log_format,
        &[("node", args.node_name.clone())],
    );
    crate::runtime()?.block_on(serve(args))
}

async fn serve(args: AgentArgs) -> anyhow::Result<()> {
    let node = args.node_name.clone();
    let client = crate::api_client::infer().await?;

    let node_object = Api::<Node>::all(client.clone())
        .get_opt(&node)
        .await
        .with_context(|| format!("reading Node {node}"))?;
    if node_object.is_none() {
        tracing::warn!(%node, "no Node object with this name: BlockDevices get no owner and are not deleted with the node");
    }
    // Read once: changing the annotation takes effect when the agent restarts.
    let pattern = allow_pattern(args.device_allow.as_deref(), node_object.as_ref());
    let allow = AllowList(
        pattern
            .as_deref()
            .map(Regex::new)
            .transpose()
            .with_context(|| format!("compiling the device allow-list {pattern:?}"))?,
    );
    let owner = node_object.as_ref().and_then(node_owner);
    let inventory = Inventory::new(client.clone(), &node, owner);
    let storage = StorageLock::default();
    let pools = Arc::new(Pools::new(
        client.clone(),
        &node,
        &args.pool_root,
        Duration::from_secs(args.missing_grace_seconds),
        storage.clone(),
    ));
    // PV node affinity matches the hostname label, which on real clusters may differ
    // from the Node's name.
    let hostname = node_object
        .as_ref()
        .and_then(|object| object.labels().get(HOSTNAME_LABEL).cloned())
        .unwrap_or_else(|| node.clone());
    let volumes = Arc::new(Volumes::new(
        client.clone(),
        (&node, &hostname),
        &args.pool_root,
        storage.clone(),
    ));
    tracing::info!(%node, allow = pattern.as_deref().unwrap_or("(every disk)"), rescan_seconds = args.rescan_seconds, "agent starting");
    // Metrics are worth less than storage: a port already taken is logged, and the
    // agent serves its disks without them.
    let metrics_address = metrics_address(
        args.metrics_address,
        std::env::var("POD_IP").ok().as_deref(),
    );
    let serving_metrics = match tokio::net::TcpListener::bind(metrics_address).await {
        Ok(listener) => {
            // The bound address: with port 0 (tests) the one the system chose.
            let address = listener.local_addr().unwrap_or(metrics_address);
            tracing::info!(%address, "serving /metrics");
            let sources = metrics::Sources {
                client: client.clone(),
                node: node.clone(),
                mounts: args.pool_root.join(&node),
            };
            Some(tokio::spawn(crate::exposition::serve(
                listener,
                move || {
                    let sources = sources.clone();
                    async move { metrics::scrape(&sources).await }
                },
            )))
        }
        Err(error) => {
            tracing::error!(address = %metrics_address, %error, "cannot serve /metrics; running without them");
            None
        }
    };

    // Open the socket before the first look, so a disk attached while it runs
    // still triggers a second one.
    let (triggers, mut changes) = mpsc::channel(1);
    let listener = uevent::Listener::open().context("listening for kernel uevents")?;
    let polling = tokio::spawn(poll_pools(
        client.clone(),
        node.clone(),
        Duration::from_secs(args.pool_poll_seconds.max(1)),
        triggers.clone(),
    ));
    let checking = tokio::spawn(watch_device_errors(
        args.pool_root.join(&node),
        Duration::from_secs(args.pool_poll_seconds.max(1)),
        triggers.clone(),
    ));
    let (volume_triggers, mut volume_changes) = mpsc::channel(1);
    let watching = tokio::spawn(watch_volumes(client.clone(), volume_triggers));
    let mut listening = tokio::spawn(listener.run(uevent::Debounce::default(), triggers));

    let (inbox, mut asked) = mpsc::unbounded_channel();
    let setup = NodeSetup {
        name: node.clone(),
        allow,
        sources: Sources::default(),
        inventory,
        pools,
        storage,
        inbox,
    };
    let tree = Tree::start(client, setup, volumes).await?;
    let (mut node_actor, mut volume_actor) = (tree.node, tree.volumes);

    // The node and volume actors make their first pass as they start.
    let period = Duration::from_secs(args.rescan_seconds.max(1));
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    // After a slow rescan, wait a full period again rather than catching up in a burst.
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    loop {
        tokio::select! {
            _ = interval.tick() => {
                node_actor.send(Event::root(NodeEvent::Trigger("periodic"))).await;
                volume_actor.send(Event::root(SerialEvent::Request("periodic"))).await;
            }
            Some(()) = changes.recv() => {
                node_actor.send(Event::root(NodeEvent::Trigger("uevent or pool change"))).await;
            }
            Some(()) = volume_changes.recv() => {
                volume_actor.send(Event::root(SerialEvent::Request("watch"))).await;
            }
            Some(ask) = asked.recv() => {
                let event = match ask {
                    Ask::Look(cause) => NodeEvent::Trigger(cause),
                    Ask::Next(next) => NodeEvent::Asked(next),
                };
                node_actor.send(Event::root(event)).await;
            }
            finished = &mut listening => {
                // Hotplug is what keeps objects current within seconds: without it the
                // agent would silently fall back to the slow timer, so stop and let the
                // supervisor (DaemonSet) restart it with a visible reason.
                return match finished {
                    Ok(Ok(())) => Err(anyhow::anyhow!("the uevent listener stopped")),
                    Ok(Err(error)) => Err(error).context("the uevent listener failed"),
                    Err(error) => Err(error).context("the uevent listener task panicked"),
                };
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate.recv() => break,
        }
    }
    tracing::info!(%node, "agent stopping");
    listening.abort();
    polling.abort();
    checking.abort();
    watching.abort();
    if let Some(serving) = serving_metrics {
        serving.abort();
    }
    tokio::task::spawn_blocking(move || tree.system.shutdown())
        .await
        .context("stopping the actor system")?
        .context("stopping the actor system")?;
    Ok(())
}

/// Restart behaviour of the agent's actors: quicker than the operator's, whose
/// cool-down of ten minutes would leave a disk or pool unattended too long.
fn restart_policy() -> RestartPolicy {
    RestartPolicy {
        min_delay: Duration::from_secs(1),
        max_delay: Duration::from_secs(30),
        factor: 2.0,
        max_failures: 5,
        window: Duration::from_secs(300),
        cool_down: Duration::from_secs(60),
    }
}

/// The agent's actor tree, running: a supervisor per kind of actor (the node, its
/// disks, its pools, its volume provisioner), each with the sink that reports the
/// children that keep failing, and the running node and volume actors.
struct Tree {
    system: ActorSystem,
    node: Current<NodeActor>,
    volumes: Current<VolumeActor>,
}

impl Tree {
    async fn start(
        client: Client,
        setup: NodeSetup,
        volumes: Arc<Volumes>,
    ) -> anyhow::Result<Self> {
        let system =
            ActorSystem::start("castellan-agent-actors").context("starting the actor system")?;
        let (disks_failing, disk_reports) = mpsc::unbounded_channel();
        let (pools_failing, pool_reports) = mpsc::unbounded_channel();
        let (node_failing, node_reports) = mpsc::unbounded_channel();
        let (volumes_failing, volume_reports) = mpsc::unbounded_channel();
        let (disks, pool_members, nodes, provisioners) = system
            .run(move || {
                (
                    Supervisor::<DiskActor>::new("disks", restart_policy(), disks_failing).start(),
                    Supervisor::<PoolMemberActor>::new("pools", restart_policy(), pools_failing)
                        .start(),
                    Supervisor::<NodeActor>::new("node", restart_policy(), node_failing).start(),
                    Supervisor::<VolumeActor>::new("volumes", restart_policy(), volumes_failing)
                        .start(),
                )
            })
            .await
            .context("starting the agent's supervisors")?;
        let runtime = tokio::runtime::Handle::current();
        let parts = Arc::new(NodeParts::new(setup, disks, pool_members, runtime.clone()));
        tokio::spawn(report_failing_disks(
            client,
            parts.inventory.clone(),
            disk_reports,
        ));
        tokio::spawn(report_failing_pools(parts.pools.clone(), pool_reports));
        tokio::spawn(log_failing("node", node_reports));
        tokio::spawn(log_failing("volumes", volume_reports));
        let name = parts.name.clone();
        let volume_effects = VolumeEffects::new(volumes, parts.inbox.clone(), runtime);
        nodes
            .send(StartChild {
                key: name.clone(),
                spec: MachineSpec {
                    initial: NodeState::new(),
                    effects: NodeEffects(parts),
                },
            })
            .await
            .context("starting the node's actor")?;
        provisioners
            .send(StartChild {
                key: VOLUMES.to_string(),
                spec: MachineSpec {
                    initial: SerialState::Idle,
                    effects: volume_effects,
                },
            })
            .await
            .context("starting the volume provisioner's actor")?;
        Ok(Self {
            system,
            node: Current::new(nodes, &name),
            volumes: Current::new(provisioners, VOLUMES),
        })
    }
}

/// The key of the one volume provisioner.
const VOLUMES: &str = "volumes";

/// A sink for the actors whose failures concern no object of their own (the node's
/// look, the volume provisioner: their objects report per pool and per volume).
async fn log_failing(kind: &'static str, mut failing: mpsc::UnboundedReceiver<ChildFailing>) {
    while let Some(report) = failing.recv().await {
        tracing::error!(kind, actor = %report.key, failures = report.failures, reason = %report.reason, retry_after_s = report.retry_after.as_secs(), "actor failing");
    }
}

/// Looks at the error counters of this node's mounted pools every `period` and asks
/// for a look when they change, so that a failing member shows on its BlockDevice and
/// the pool within seconds, not at the next scrub or periodic rescan (a read that
/// btrfs served from the other copy raises no uevent).
async fn watch_device_errors(mounts: PathBuf, period: Duration, triggers: mpsc::Sender<()>) {
    let mut last: Option<Vec<(String, String)>> = None;
    let mut interval = tokio::time::interval(period);
    loop {
        interval.tick().await;
        let dir = mounts.clone();
        let seen = tokio::task::spawn_blocking(move || {
            let mut seen = Vec::new();
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                for (path, errors) in pools::failing_members(&entry.path()) {
                    seen.push((path, errors.to_string()));
                }
            }
            seen.sort();
            seen
        })
        .await
        .unwrap_or_default();
        if last.as_ref() != Some(&seen) {
            if last.is_some() {
                tracing::info!(failing = ?seen, "pool members' error counters changed");
                // Full channel: a look is already due, which will see the change.
                let _ = triggers.try_send(());
            }
            last = Some(seen);
        }
    }
}

/// Triggers a look whenever the set of pools or one's spec changes (its generation),
/// or the set of this node's BlockDevices does (one deleted: a missing member given
/// up, or an object to write again), and once at start. A plain poll, not a watch: a
/// handful of small objects, and no stream plumbing to keep alive.
async fn poll_pools(client: Client, node: String, period: Duration, triggers: mpsc::Sender<()>) {
    let pools = Api::<StoragePool>::all(client.clone());
    let devices = Api::<BlockDevice>::all(client);
    let own = ListParams::default().labels(&format!("{}={node}", crate::kube_ops::NODE_LABEL));
    let mut last: Option<Vec<(String, Option<i64>)>> = None;
    let mut interval = tokio::time::interval(period);
    loop {
        interval.tick().await;
        let listed = futures::future::try_join(
            pools.list_metadata(&ListParams::default()),
            devices.list_metadata(&own),
        )
        .await;
        let generations = match listed {
            Ok((pools, devices)) => {
                let mut generations: Vec<(String, Option<i64>)> = pools
                    .items
                    .iter()
                    .map(|pool| (pool.uid().unwrap_or_default(), pool.metadata.generation))
                    .chain(
                        devices
                            .items
                            .iter()
                            .map(|device| (device.uid().unwrap_or_default(), None)),
                    )
                    .collect();
                generations.sort();
                generations
            }
            Err(error) => {
                tracing::warn!(%error, "polling StoragePools and this node's BlockDevices failed");
                continue;
            }
        };
        if last.as_ref() != Some(&generations) {
            if last.is_some() {
                // Full channel: a look is already due, which will see the change.
                let _ = triggers.try_send(());
            }
            last = Some(generations);
        }
    }
}

/// Triggers a volume pass on every change of a PersistentVolumeClaim or a
/// PersistentVolume (a watch: provisioning waits on the scheduler's choice, and a poll
/// would add its period to every pod start). Bursts coalesce in the one-slot channel.
async fn watch_volumes(client: Client, triggers: mpsc::Sender<()>) {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use kube::runtime::{WatchStreamExt, watcher};
    // With back-off: an unreachable API server must not make the watch spin.
    let claims = watcher(
        Api::<PersistentVolumeClaim>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .map(|event| event.map(drop));
    let volumes = watcher(
        Api::<PersistentVolume>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .map(|event| event.map(drop));
    let mut events = std::pin::pin!(futures::stream::select(claims, volumes));
    while let Some(event) = events.next().await {
        match event {
            // Full channel: a pass is already due, which will see the change.
            Ok(()) => drop(triggers.try_send(())),
            Err(error) => tracing::warn!(%error, "watching volumes failed; retrying"),
        }
    }
}

/// The allow-list pattern: the flag if given, else the Node's annotation, else none.
fn allow_pattern(flag: Option<&str>, node: Option<&Node>) -> Option<String> {
    flag.map(str::to_string)
        .or_else(|| node.and_then(|node| node.annotations().get(DEVICE_ALLOW_ANNOTATION).cloned()))
}

/// An owner reference to the Node, so its BlockDevices are garbage-collected with it.
fn node_owner(node: &Node) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: <Node as k8s_openapi::Resource>::API_VERSION.to_string(),
        kind: <Node as k8s_openapi::Resource>::KIND.to_string(),
        name: node.name_any(),
        uid: node.uid()?,
        ..Default::default()
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    #[test]
    fn metrics_listen_on_the_pod_address_unless_told_otherwise() {
        let flag: std::net::SocketAddr = "127.0.0.9:1234".parse().expect("an address");
        assert_eq!(metrics_address(Some(flag), Some("127.181.0.2")), flag);
        assert_eq!(
            metrics_address(None, Some("127.181.0.2")).to_string(),
            "127.181.0.2:9188"
        );
        assert_eq!(metrics_address(None, None).to_string(), "0.0.0.0:9188");
        assert_eq!(metrics_address(None, Some("")).to_string(), "0.0.0.0:9188");
    }

    fn node(annotation: Option<&str>, uid: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                uid: uid.map(Into::into),
                annotations: annotation.map(|pattern| {
                    [(DEVICE_ALLOW_ANNOTATION.to_string(), pattern.to_string())].into()
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn the_flag_wins_over_the_annotation_which_wins_over_nothing() {
        let annotated = node(Some("^/srv/n1/"), None);
        assert_eq!(
            allow_pattern(Some("^/dev/sdb$"), Some(&annotated)).as_deref(),
            Some("^/dev/sdb$")
        );
        assert_eq!(
            allow_pattern(None, Some(&annotated)).as_deref(),
            Some("^/srv/n1/")
        );
        assert_eq!(allow_pattern(None, Some(&node(None, None))), None);
        assert_eq!(allow_pattern(None, None), None);
    }

    #[test]
    fn the_owner_is_the_node_when_it_has_a_uid() {
        let owner = node_owner(&node(None, Some("u-1"))).unwrap();
        assert_eq!(
            (owner.api_version.as_str(), owner.kind.as_str()),
            ("v1", "Node")
        );
        assert_eq!((owner.name.as_str(), owner.uid.as_str()), ("n1", "u-1"));
        assert_eq!(owner.controller, None);
        assert_eq!(node_owner(&node(None, None)), None);
    }
}
