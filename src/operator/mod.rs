//! `castellan operator`: the controllers.
//!
//! This first slice runs the `DatabaseCluster` controller directly: `reconcile`
//! creates what a cluster owns (Secrets, Services, volumes, pods) from pure builders
//! (`build`), keeps the primary's synchronous standbys in line through the instance
//! API, and writes status. The actor tree (`castellan-actors`), leader election,
//! metrics and tracing are the next steps of the DatabaseCluster issue; until then
//! reconcile does the (short) work itself.

pub mod build;
mod endpoints;
mod instance_client;
mod leader;
mod reconcile;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use castellan_crds::DatabaseCluster;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client};

/// Settings of `castellan operator`.
#[derive(Clone, Debug, clap::Args)]
pub struct OperatorArgs {
    /// uid the database processes run as.
    #[arg(long, env = "CASTELLAN_POSTGRES_UID", default_value_t = 26)]
    pub postgres_uid: i64,
    /// gid the database processes run as.
    #[arg(long, env = "CASTELLAN_POSTGRES_GID", default_value_t = 26)]
    pub postgres_gid: i64,
    /// Tag of the instance image.
    #[arg(long, env = "CASTELLAN_IMAGE_TAG", default_value = env!("CARGO_PKG_VERSION"))]
    pub image_tag: String,
    /// Namespace of the leader Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "castellan-system")]
    pub namespace: String,
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
}

pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let metrics = Arc::new(endpoints::Metrics::default());
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
    let lost = leader::acquire(
        client.clone(),
        &args.namespace,
        "castellan-operator",
        &identity,
    )
    .await;
    metrics
        .leader
        .store(1, std::sync::atomic::Ordering::Relaxed);
    let context = Arc::new(reconcile::Context {
        metrics,
        client: client.clone(),
        settings: build::Settings {
            postgres_uid: args.postgres_uid,
            postgres_gid: args.postgres_gid,
            image_tag: args.image_tag,
        },
    });
    tracing::info!("DatabaseCluster controller starting");
    let controller = async {
        Controller::new(
            Api::<DatabaseCluster>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(Api::<Pod>::all(client.clone()), watcher::Config::default())
        .owns(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(
            Api::<Secret>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .owns(
            Api::<PodDisruptionBudget>::all(client),
            watcher::Config::default(),
        )
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
        () = controller => {}
        reason = lost => {
            let reason = reason.unwrap_or_else(|e| format!("the lease keeper stopped: {e}"));
            anyhow::bail!("lost leadership ({reason}); exiting so that only one operator acts");
        }
    }
    tracing::info!("DatabaseCluster controller stopped");
    Ok(())
}

fn error_policy(
    _cluster: Arc<DatabaseCluster>,
    error: &reconcile::Error,
    _context: Arc<reconcile::Context>,
) -> Action {
    tracing::warn!(error = %error, "reconcile will be retried");
    Action::requeue(Duration::from_secs(5))
}
