//! The root of the operator's actor tree: one supervised `ClusterActor` per
//! `DatabaseCluster`, and the sink that marks a cluster `Degraded` when its actor keeps
//! failing (the actor cannot, being the one failing).

use std::sync::Arc;

use actix::prelude::*;
use castellan_actors::{ChildFailing, ChildKey, FailureSink, Supervisor};
use castellan_crds::DatabaseCluster;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;

use super::cluster::Note;
use super::cluster::shell::ClusterActor;
use super::cluster::{pass, plan};
use super::context::{Shared, edition, restart_policy};
use super::metrics::Metrics;

pub type Root = Supervisor<ClusterActor>;

/// The root's failure sink: a `ClusterActor` that keeps failing marks its cluster
/// `Degraded` with the reason (its actor cannot, being the one failing), and says so in
/// an Event. Runs on the tokio runtime, fed by the root supervisor.
pub async fn report_failing_clusters(
    shared: Arc<Shared>,
    mut failing: tokio::sync::mpsc::UnboundedReceiver<ChildFailing>,
    failed: Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
) {
    while let Some(report) = failing.recv().await {
        let Some((namespace, name)) = report.key.split_once('/') else {
            continue;
        };
        let clusters: kube::Api<DatabaseCluster> =
            kube::Api::namespaced(shared.client.clone(), namespace);
        let cluster = match clusters.get_opt(name).await {
            Ok(Some(cluster)) => cluster,
            Ok(None) => continue,
            Err(error) => {
                tracing::warn!(cluster = %report.key, %error, "could not read a failing cluster");
                continue;
            }
        };
        let reason = report.describe("the cluster's actor");
        tracing::error!(cluster = %report.key, %reason, "cluster actor failing");
        if let Ok(mut failed) = failed.lock() {
            failed.insert(report.key.clone(), edition(&cluster));
        }
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let status = json!({
            "phase": "Degraded",
            "conditions": [plan::degraded_condition(&cluster, Some(&reason), &now)],
        });
        if let Err(error) =
            pass::write_status_as(&shared.client, &cluster, &status, "castellan-supervisor").await
        {
            tracing::warn!(cluster = %report.key, %error, "could not mark the cluster Degraded");
        }
        shared
            .record(&cluster, Note::warning("Degraded", reason))
            .await;
    }
}

/// The root's sink as the supervisor sees it: counts every failure, and hands the
/// clusters that keep failing to [`report_failing_clusters`].
struct RootSink {
    failing: tokio::sync::mpsc::UnboundedSender<ChildFailing>,
    metrics: Arc<Metrics>,
}

impl FailureSink for RootSink {
    fn child_failing(&self, failing: ChildFailing) {
        self.metrics.actor_failing("clusters");
        self.failing.child_failing(failing);
    }

    fn child_failed(&self, _key: &ChildKey, _reason: &str) {
        self.metrics.actor_restarted("clusters");
    }
}

/// The root of the tree: one supervised `ClusterActor` per cluster key.
pub fn start_root(
    failing: tokio::sync::mpsc::UnboundedSender<ChildFailing>,
    metrics: Arc<Metrics>,
) -> Addr<Root> {
    Supervisor::new("clusters", restart_policy(), RootSink { failing, metrics }).start()
}
