//! `castellan operator`: the `DatabaseCluster` controller and its actor tree.
//!
//! kube-rs' controller watches the clusters and what they own, and the Nodes (kept in a
//! store for the passes; a node's readiness or cordon changing reconciles every
//! cluster); `reconcile` only hands each cluster's desired state to its `ClusterActor`
//! (one per cluster, under the root supervisor in `root.rs`, each with one
//! `ReplicaActor` per instance). Each actor has a folder with its pure machine beside
//! its shell (`cluster/`, `replica/`); what they share without acting is `context.rs`.
//! Objects are built by `build.rs`; what a pass over a cluster should do is decided by
//! `cluster/plan.rs` (its `VolumesBound` condition by `cluster/volumes.rs`) and done by
//! `cluster/pass.rs`; the instance API is called by `instance_client.rs` (mutual TLS
//! with the certificates of `certificates.rs`). One replica of the operator acts at a
//! time (`leader.rs`); `/healthz`, `/readyz` and `/metrics` are `endpoints.rs`, the
//! metrics themselves `metrics.rs`.
//! Beside it, under the same lease: the `Backup` controller (`backup/`) and the
//! `BackupSchedule` controller (`schedule/`).

pub mod backup;
pub mod build;
mod catalog;
mod certificates;
pub mod cluster;
mod context;
mod endpoints;
mod instance_client;
mod leader;
mod metrics;
mod object_store;
mod pools;
mod reconcile;
mod replica;
mod restore;
mod root;
mod rotation;
mod schedule;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use castellan_crds::DatabaseCluster;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Node, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

/// Name of the leader Lease.
const LEASE: &str = "castellan-operator";

/// Settings of `castellan operator`.
#[derive(Clone, Debug, clap::Args)]
pub struct OperatorArgs {
    /// uid the database processes run as.
    #[arg(long, env = "CASTELLAN_POSTGRES_UID", default_value_t = 26)]
    pub postgres_uid: i64,
    /// gid the database processes run as.
    #[arg(long, env = "CASTELLAN_POSTGRES_GID", default_value_t = 26)]
    pub postgres_gid: i64,
    /// Tag of the images a new image catalog names (`<image>:<tag>-pg<major>`).
    #[arg(long, env = "CASTELLAN_IMAGE_TAG", default_value = env!("CARGO_PKG_VERSION"))]
    pub image_tag: String,
    /// The operator's own namespace: its leader Lease and the CA Secret `castellan-ca`.
    #[arg(long, env = "POD_NAMESPACE", default_value = "castellan-system")]
    pub namespace: String,
    /// A CA the user brings instead of Castellan's own: a `kubernetes.io/tls` Secret in
    /// the operator's namespace with `tls.crt` and `tls.key` of a CA certificate (for
    /// example one cert-manager made for a `Certificate` with `isCA: true`). Castellan
    /// reads it and never writes it.
    #[arg(long, env = "CASTELLAN_CA_SECRET")]
    pub ca_secret: Option<String>,
    /// The image catalog: a ConfigMap in the operator's namespace whose keys are
    /// PostgreSQL major versions and values the instance images that run them. Made
    /// with the images `make images` builds when there is none.
    #[arg(long, env = "CASTELLAN_IMAGE_CATALOG", default_value = catalog::CATALOG)]
    pub image_catalog: String,
    /// This replica's name in the leader Lease; the pod name in a cluster.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Where `/healthz`, `/readyz` and `/metrics` are served.
    #[arg(
        long,
        env = "CASTELLAN_METRICS_ADDRESS",
        default_value = "127.0.0.1:8080"
    )]
    pub metrics_address: std::net::SocketAddr,
    #[command(flatten)]
    pub log: crate::telemetry::LogArgs,
    /// Manage only the clusters of this namespace (default: every namespace).
    #[arg(long, env = "WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// A Secret (in each cluster's namespace) whose key `headers` holds the
    /// `OTEL_EXPORTER_OTLP_HEADERS` the instance managers export with, such as an
    /// authorization token. Referenced from the pods, never copied into them; without
    /// it they export without headers.
    #[arg(long, env = "CASTELLAN_OTLP_HEADERS_SECRET")]
    pub otlp_headers_secret: Option<String>,
    /// Carry out `castellan.io/release-nodes` on StoragePools: release the part of a
    /// pool on nodes that never come back. Needs rights on the cluster-scoped pools and
    /// volumes; the chart turns it on for a cluster-wide operator.
    #[arg(long, env = "CASTELLAN_RELEASE_POOLS", default_value_t = false)]
    pub release_pools: bool,
    /// Honour the `castellan.io/inject-fault` annotation (tests of the supervision
    /// tree). Off in production.
    #[arg(long, env = "CASTELLAN_FAULT_INJECTION", default_value_t = false)]
    pub fault_injection: bool,
}

pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let client = crate::api_client::infer().await?;
    let metrics = Arc::new(metrics::Metrics::default());
    let serving = endpoints::serve(args.metrics_address, client.clone(), metrics.clone());
    tokio::spawn(async move {
        if let Err(error) = serving.await {
            tracing::error!(error = %format!("{error:#}"), "the operator's endpoints stopped");
        }
    });
    // Only one replica acts: wait for the Lease, and stop acting if it is lost.
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("castellan-operator-{}", std::process::id()));
    let mut lost = leader::acquire(client.clone(), &args.namespace, LEASE, &identity).await;
    metrics.set_leader(true);
    // The CAs, and the operator's client certificate for the instance API.
    let trust = certificates::ensure_trust(&client, &args.namespace, args.ca_secret.as_deref())
        .await
        .context("setting up Castellan's CA")?;
    instance_client::configure(
        crate::pki::tls::operator_client_config(&trust)
            .context("setting up the operator's client certificate")?,
    );
    // A pass reads its pods' nodes (drains, lost nodes) from this store of every Node,
    // kept by one watch that runs with the controller (below).
    let (nodes, nodes_writer) = reflector::store();
    // The image catalog, made with the defaults if there is none, and kept by a watch
    // of that one ConfigMap.
    catalog::ensure(
        &client,
        &args.namespace,
        &args.image_catalog,
        &args.image_tag,
    )
    .await
    .with_context(|| {
        format!(
            "making the image catalog {}/{}",
            args.namespace, args.image_catalog
        )
    })?;
    let (images, images_writer) = reflector::store();
    // A catalog edit (a new minor to roll out, a major made available) reaches every
    // cluster at once, not at its next resync.
    let (catalog_edited, catalog_edits) = futures::channel::mpsc::unbounded::<()>();
    tokio::spawn(
        watcher(
            Api::<ConfigMap>::namespaced(client.clone(), &args.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", args.image_catalog)),
        )
        .default_backoff()
        .reflect(images_writer)
        .for_each(move |event| {
            match event {
                Err(error) => {
                    tracing::warn!(%error, "watching the image catalog failed; retrying");
                }
                Ok(
                    watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone,
                ) => {
                    let _ = catalog_edited.unbounded_send(());
                }
                Ok(_) => {}
            }
            async {}
        }),
    );
    let catalog_source = format!("{}/{}", args.namespace, args.image_catalog);
    let shared = Arc::new(context::Shared::new(
        client.clone(),
        metrics,
        build::Settings {
            postgres_uid: args.postgres_uid,
            postgres_gid: args.postgres_gid,
            telemetry_env: build::telemetry_env_from(std::env::vars()),
            otlp_headers_secret: args.otlp_headers_secret.clone(),
        },
        &identity,
        trust,
        nodes,
        (images, catalog_source),
    ));
    let system = castellan_actors::ActorSystem::start("castellan-actors")
        .context("starting the actor system")?;
    let (failing_tx, failing_rx) = tokio::sync::mpsc::unbounded_channel();
    let root_metrics = shared.metrics.clone();
    let root = system
        .run(move || root::start_root(failing_tx, root_metrics))
        .await
        .context("starting the root actor")?;
    let failing = Arc::new(Mutex::new(BTreeMap::new()));
    tokio::spawn(root::report_failing_clusters(
        shared.clone(),
        failing_rx,
        failing.clone(),
    ));
    let context = Arc::new(reconcile::Context {
        shared,
        root,
        fault_injection: args.fault_injection,
        failing,
        started: Mutex::new(BTreeSet::new()),
    });
    let backups = backup::run(
        context.shared.clone(),
        watched(&client, &args),
        watched(&client, &args),
    );
    // Backup schedules act under the same lease, beside the clusters.
    let schedules = schedule::run(
        watched(&client, &args),
        watched(&client, &args),
        context.shared.clone(),
    );
    // The CA rotates under the same lease; a CA the user brings is theirs to rotate.
    let rotation = match &args.ca_secret {
        None => Some(tokio::spawn(rotation::run(
            context.shared.clone(),
            args.namespace.clone(),
            watched(&client, &args),
        ))),
        Some(secret) => {
            tracing::info!(%secret, "the CA is the user's: Castellan does not rotate it");
            None
        }
    };
    // Pools of nodes that never come back are released under the same lease.
    let releaser = args
        .release_pools
        .then(|| tokio::spawn(pools::run(client.clone(), context.shared.clone())));
    tracing::info!("DatabaseCluster controller starting");
    // The clusters' cache keeps no managedFields: nothing reads them, and with the
    // status Castellan applies they were about half of each cluster's copy (here and
    // in its actor's state).
    let (clusters, clusters_writer) = reflector::store();
    let cluster_changes = watcher(watched(&client, &args), watcher::Config::default())
        .default_backoff()
        .modify(|cluster: &mut DatabaseCluster| cluster.managed_fields_mut().clear())
        .reflect(clusters_writer)
        .applied_objects();
    let controller = Controller::for_stream(cluster_changes, clusters);
    // Deleted clusters (no finalizer: owner references clean up) never reach
    // reconcile; their actors are stopped when they leave the controller's cache.
    tokio::spawn(stop_deleted(controller.store(), context.clone()));
    let controller = async {
        controller
            .owns(watched::<Pod>(&client, &args), owned())
            .owns(watched::<Service>(&client, &args), owned())
            .owns(watched::<Secret>(&client, &args), owned())
            .owns(watched::<PersistentVolumeClaim>(&client, &args), owned())
            .owns(watched::<PodDisruptionBudget>(&client, &args), owned())
            // A node that is cordoned or turns NotReady concerns whichever cluster has
            // an instance there; such changes are rare, so every cluster is reconciled.
            .reconcile_all_on(node_changes(Api::all(client.clone()), nodes_writer))
            .reconcile_all_on(catalog_edits)
            .shutdown_on_signal()
            .run(reconcile::reconcile, error_policy, context)
            .for_each(|outcome| async move {
                if let Err(error) = outcome {
                    tracing::warn!(error = %error, "reconcile failed");
                }
            })
            .await
    };
    tokio::select! {
        ((), (), ()) = async { tokio::join!(controller, backups, schedules) } => {}
        reason = &mut lost => {
            let reason = reason.unwrap_or_else(|e| format!("the lease keeper stopped: {e}"));
            anyhow::bail!("lost leadership ({reason}); exiting so that only one operator acts");
        }
    }
    tracing::info!("DatabaseCluster controller stopped");
    if let Some(rotation) = rotation {
        rotation.abort();
    }
    if let Some(releaser) = releaser {
        releaser.abort();
    }
    // Stop renewing before giving the lease up, or the renewal would take it back.
    lost.abort();
    tokio::task::spawn_blocking(move || system.shutdown())
        .await
        .context("stopping the actor system")?
        .context("stopping the actor system")?;
    leader::release(client, &args.namespace, LEASE, &identity).await;
    Ok(())
}

/// The watch of objects a cluster owns: only those Castellan labelled as its own
/// (every object `build` makes carries the label), so that the API server sends the
/// operator nothing of other programs' Secrets, pods or Services, not even their
/// metadata (`owns` watches metadata only).
fn owned() -> watcher::Config {
    watcher::Config::default().labels(&build::managed_selector())
}

/// The API of `K` in the watched namespace, or in all of them.
fn watched<K>(client: &Client, args: &OperatorArgs) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match &args.watch_namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    }
}

/// Keeps the store of Nodes behind `writer` current, and yields whenever a node is
/// first seen or its readiness or cordon changes: all a pass reads of a node. The
/// store is updated before the change is yielded, so the reconcile it sets off sees
/// it. A failing watch is retried with back-off.
fn node_changes(nodes: Api<Node>, writer: Writer<Node>) -> impl Stream<Item = ()> + Send {
    watcher(nodes, watcher::Config::default())
        .default_backoff()
        // Managed fields and image lists are most of a Node's size, and never read.
        .modify(|node| {
            node.managed_fields_mut().clear();
            if let Some(status) = node.status.as_mut() {
                status.images = None;
            }
        })
        .reflect(writer)
        .applied_objects()
        .predicate_filter(node_health, PredicateConfig::default())
        .filter_map(|node| async move {
            match node {
                Ok(_) => Some(()),
                Err(error) => {
                    tracing::warn!(%error, "watching Nodes failed; retrying");
                    None
                }
            }
        })
}

/// What a pass reads of `node`, hashed for [`WatchStreamExt::predicate_filter`].
fn node_health(node: &Node) -> Option<u64> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    cluster::plan::NodeHealth::of(node).hash(&mut hasher);
    Some(hasher.finish())
}

/// Every few seconds, stops the actors of clusters that are no longer in the cache.
async fn stop_deleted(
    store: kube::runtime::reflector::Store<DatabaseCluster>,
    context: Arc<reconcile::Context>,
) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        if store.wait_until_ready().await.is_err() {
            return;
        }
        let present: BTreeSet<String> = store.state().iter().map(|c| context::key(c)).collect();
        let gone: Vec<String> = context
            .started
            .lock()
            .map(|started| started.difference(&present).cloned().collect())
            .unwrap_or_default();
        for key in gone {
            tracing::info!(cluster = %key, "cluster deleted; stopping its actor");
            reconcile::stop(&context, &key).await;
        }
    }
}

fn error_policy(
    _cluster: Arc<DatabaseCluster>,
    error: &reconcile::Error,
    _context: Arc<reconcile::Context>,
) -> Action {
    tracing::warn!(error = %error, "reconcile will be retried");
    Action::requeue(Duration::from_secs(5))
}
