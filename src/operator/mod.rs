//! `castellan operator`: the controllers.
//!
//! This first slice runs the `DatabaseCluster` controller directly: `reconcile`
//! creates what a cluster owns (Secrets, Services, volumes, pods) from pure builders
//! (`build`), keeps the primary's synchronous standbys in line through the instance
//! API, and writes status. The actor tree (`castellan-actors`), leader election,
//! metrics and tracing are the next steps of the DatabaseCluster issue; until then
//! reconcile does the (short) work itself.

pub mod build;
mod instance_client;
mod reconcile;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use castellan_crds::DatabaseCluster;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
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
}

pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let context = Arc::new(reconcile::Context {
        client: client.clone(),
        settings: build::Settings {
            postgres_uid: args.postgres_uid,
            postgres_gid: args.postgres_gid,
            image_tag: args.image_tag,
        },
    });
    tracing::info!("DatabaseCluster controller starting");
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
        Api::<PersistentVolumeClaim>::all(client),
        watcher::Config::default(),
    )
    .shutdown_on_signal()
    .run(reconcile::reconcile, error_policy, context)
    .for_each(|outcome| async move {
        if let Err(error) = outcome {
            tracing::warn!(error = %error, "reconcile failed");
        }
    })
    .await;
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
