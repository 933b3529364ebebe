//! The node's main loop: register the Node, keep its Lease and status fresh, serve the
//! kubelet API, and keep one worker (`pod.rs`) per Pod bound to this node, telling it
//! about updates and deletion.
//!
//! Stopping the node (SIGTERM or SIGINT) kills every container process at once and
//! leaves the Node and its pods as they are, as a machine that lost power would; the
//! controller-manager notices through the Lease. Started again with the same state
//! directory, the node kills what a crash may have left behind and runs its pods anew.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::runtime::watcher::{self, Event};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::address::AddressPool;
use crate::events::PodEvents;
use crate::images::Images;
use crate::node::NodeIdentity;
use crate::pod::{self, PodChannels};
use crate::process_registry::ProcessRegistry;
use crate::{ApiServerAddress, NodeArgs, lease, node, server};

/// What every pod worker of this node shares.
pub struct NodeContext {
    pub client: kube::Client,
    pub identity: NodeIdentity,
    pub state_dir: PathBuf,
    pub images: Images,
    pub registry: ProcessRegistry,
    pub addresses: AddressPool,
    pub api_server: ApiServerAddress,
    pub restart_backoff: Duration,
    pub events: PodEvents,
    pod_dirs: Mutex<BTreeMap<(String, String), PathBuf>>,
    /// Log files of the container runs in progress: `kubectl logs -f` ends with the run.
    live_logs: Mutex<HashSet<PathBuf>>,
    shutting_down: AtomicBool,
}

impl NodeContext {
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub fn register_pod_dir(&self, key: (String, String), dir: PathBuf) {
        self.pod_dirs().insert(key, dir);
    }

    pub fn forget_pod_dir(&self, key: &(String, String)) {
        self.pod_dirs().remove(key);
    }

    /// The state directory of the pod `namespace/name` running here, for its logs.
    pub fn pod_dir(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        self.pod_dirs()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Marks the run writing `log_file` as in progress (or over).
    pub fn set_log_live(&self, log_file: &std::path::Path, live: bool) {
        // Whole-entry inserts and removes: a poisoned set is still consistent.
        let mut live_logs = self
            .live_logs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if live {
            live_logs.insert(log_file.to_path_buf());
        } else {
            live_logs.remove(log_file);
        }
    }

    /// Whether a container run is still writing `log_file`.
    pub fn is_log_live(&self, log_file: &std::path::Path) -> bool {
        let live_logs = self
            .live_logs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        live_logs.contains(log_file)
    }

    fn pod_dirs(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), PathBuf>> {
        // Inserts and removes of whole entries cannot leave the map half-changed.
        self.pod_dirs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

struct PodHandle {
    pod: watch::Sender<Pod>,
    stop: watch::Sender<Option<Duration>>,
}

pub async fn run_node(args: NodeArgs) -> anyhow::Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        anyhow::bail!(
            "castellan-devnode node must run as root: it bind-mounts volumes and switches to pods' users"
        );
    }
    let (client, api_server) = crate::client_from(&args.kubeconfig).await?;
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating state directory {}", args.state_dir.display()))?;
    let registry = ProcessRegistry::open(&args.state_dir)?;
    let killed = registry.kill_leftovers()?;
    if killed > 0 {
        tracing::info!(killed, "killed container processes left by a previous run");
    }
    let images = match &args.images {
        Some(path) => Images::load(path)?,
        None => Images::default(),
    };
    let identity = NodeIdentity {
        name: args.name.clone(),
        zone: args
            .zone
            .clone()
            .unwrap_or_else(|| format!("zone-{}", args.index)),
        address: args.node_ip,
        kubelet_port: args.kubelet_port,
        cpu: args.cpu.clone(),
        memory: args.memory.clone(),
        max_pods: args.max_pods,
    };
    let nodes: Api<Node> = Api::all(client.clone());
    node::register(&nodes, &identity).await?;
    let node_uid = nodes
        .get(&identity.name)
        .await
        .with_context(|| format!("reading Node {}", identity.name))?
        .metadata
        .uid;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    tokio::spawn(lease::keep_renewing(
        leases,
        identity.name.clone(),
        node_uid,
    ));
    tokio::spawn(node::heartbeat(nodes, identity.clone()));

    let context = Arc::new(NodeContext {
        client: client.clone(),
        identity,
        state_dir: args.state_dir.clone(),
        images,
        registry,
        addresses: AddressPool::new(args.pod_octet.unwrap_or(100 + args.index)),
        api_server,
        restart_backoff: args.restart_backoff,
        events: PodEvents::new(client.clone(), &args.name),
        pod_dirs: Mutex::new(BTreeMap::new()),
        live_logs: Mutex::new(HashSet::new()),
        shutting_down: AtomicBool::new(false),
    });
    let tls = server::TlsFiles {
        certificate: args.tls_cert.clone(),
        key: args.tls_key.clone(),
        client_ca: args.client_ca.clone(),
    };
    let listener = server::bind(args.node_ip, args.kubelet_port).await?;
    tokio::spawn(server::serve(listener, tls, context.clone()));
    tracing::info!(node = args.name, "node registered; running its pods");

    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    tokio::select! {
        result = run_pods(context.clone()) => result,
        _ = terminate.recv() => shut_down(&context),
        _ = interrupt.recv() => shut_down(&context),
    }
}

/// A lost machine: every container process dies at once, nothing is reported.
fn shut_down(context: &NodeContext) -> anyhow::Result<()> {
    context.shutting_down.store(true, Ordering::SeqCst);
    let killed = context.registry.kill_leftovers()?;
    tracing::info!(killed, "node stopping: killed every container process");
    Ok(())
}

async fn run_pods(context: Arc<NodeContext>) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::all(context.client.clone());
    let config =
        watcher::Config::default().fields(&format!("spec.nodeName={}", context.identity.name));
    let mut events = watcher::watcher(pods, config).boxed();
    let mut handles: HashMap<String, PodHandle> = HashMap::new();
    let (done_tx, mut done) = mpsc::unbounded_channel::<String>();
    // Pods seen in the current (re)list, to stop those that vanished meanwhile.
    let mut listed: Option<Vec<String>> = None;
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { anyhow::bail!("the pod watch ended") };
                match event {
                    Ok(Event::Init) => listed = Some(Vec::new()),
                    Ok(Event::InitApply(pod)) => {
                        if let (Some(listed), Some(uid)) = (listed.as_mut(), pod.metadata.uid.clone()) {
                            listed.push(uid);
                        }
                        apply(&context, &mut handles, &done_tx, pod);
                    }
                    Ok(Event::InitDone) => {
                        if let Some(listed) = listed.take() {
                            for (uid, handle) in &handles {
                                if !listed.contains(uid) {
                                    let _ = handle.stop.send(Some(Duration::ZERO));
                                }
                            }
                        }
                        remove_orphaned_pod_dirs(&context, &handles);
                    }
                    Ok(Event::Apply(pod)) => apply(&context, &mut handles, &done_tx, pod),
                    Ok(Event::Delete(pod)) => {
                        if let Some(handle) = pod.metadata.uid.as_ref().and_then(|uid| handles.get(uid)) {
                            // Gone from the API (force-deleted): no grace is left to give.
                            let _ = handle.pod.send(pod.clone());
                            let _ = handle.stop.send(Some(Duration::ZERO));
                        }
                    }
                    Err(error) => {
                        tracing::warn!("watching pods: {error}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            Some(uid) = done.recv() => { handles.remove(&uid); }
        }
    }
}

/// Removes the state of pods that vanished from the API while this node was down
/// (force-deleted, or their namespace was): no worker will ever clean them up.
fn remove_orphaned_pod_dirs(context: &NodeContext, handles: &HashMap<String, PodHandle>) {
    let pods_dir = context.state_dir.join("pods");
    let Ok(entries) = std::fs::read_dir(&pods_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(uid) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !handles.contains_key(&uid) {
            tracing::info!(uid, "removing the state of a pod that no longer exists");
            crate::volume::remove_pod_dir(&entry.path());
        }
    }
}

fn apply(
    context: &Arc<NodeContext>,
    handles: &mut HashMap<String, PodHandle>,
    done: &mpsc::UnboundedSender<String>,
    pod: Pod,
) {
    let Some(uid) = pod.metadata.uid.clone() else {
        return;
    };
    let deleting = pod.metadata.deletion_timestamp.is_some();
    if let Some(handle) = handles.get(&uid) {
        let grace = pod::grace_period(&pod);
        let _ = handle.pod.send(pod);
        if deleting && handle.stop.borrow().is_none() {
            let _ = handle.stop.send(Some(grace));
        }
        return;
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref());
    let finished = matches!(phase, Some("Succeeded" | "Failed"));
    if finished && !deleting {
        // Done before this node (re)started: nothing to run, as a kubelet would.
        return;
    }
    let stop_now = deleting.then(|| pod::grace_period(&pod));
    let (pod_tx, pod_rx) = watch::channel(pod);
    let (stop_tx, stop_rx) = watch::channel(stop_now);
    handles.insert(
        uid.clone(),
        PodHandle {
            pod: pod_tx,
            stop: stop_tx,
        },
    );
    let context = context.clone();
    let done = done.clone();
    tokio::spawn(async move {
        pod::run(
            context,
            PodChannels {
                pod: pod_rx,
                stop: stop_rx,
            },
        )
        .await;
        let _ = done.send(uid);
    });
}
