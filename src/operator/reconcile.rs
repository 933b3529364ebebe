//! The `DatabaseCluster` controller's reconcile: hand the desired state to the
//! cluster's actor and return. The actors (`shell.rs`, `cluster.rs`, `replica.rs`) do
//! the work; the periodic requeue keeps them fed after a restart.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::Addr;
use castellan_actors::{Event, RestartNow, StartChild, StopChild};
use castellan_crds::DatabaseCluster;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use tracing::Instrument;

use super::cluster::shell::cluster_spec;
use super::cluster::{ClusterEvent, Note};
use super::context::{Shared, edition, key};
use super::root::Root;

/// Annotation that makes the cluster's actor panic, for tests of the supervision tree;
/// honoured only when the operator runs with `--fault-injection`.
pub const INJECT_FAULT_ANNOTATION: &str = "castellan.io/inject-fault";

/// How often every cluster's actor is sent the desired state again: a pass then
/// catches what no watch reports (a user's Secret or StorageClass that appeared) and
/// brings the instances' positions in status up to date (`PROGRESS_REFRESH`). Each
/// pass is about 20 API requests, so this is what an idle cluster costs the API
/// server: at 5 s, 100 clusters made 340 requests a second.
const RESYNC: Duration = Duration::from_secs(30);

pub struct Context {
    pub shared: Arc<Shared>,
    pub root: Addr<Root>,
    pub fault_injection: bool,
    /// Clusters whose actor the root reported failing, with their [`edition`] then: a
    /// change to the cluster since restarts its actor without waiting.
    pub failing: Arc<Mutex<BTreeMap<String, String>>>,
    /// Clusters with an actor, so that deleted ones can be stopped.
    pub started: Mutex<std::collections::BTreeSet<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("handing DatabaseCluster {cluster} to its actor: {source}")]
    Mailbox {
        cluster: String,
        source: actix::MailboxError,
    },
}

/// Every reconcile is a span (the root of the trace of whatever it sets off).
pub async fn reconcile(
    cluster: Arc<DatabaseCluster>,
    context: Arc<Context>,
) -> Result<Action, Error> {
    let span = tracing::info_span!("reconcile", cluster = %key(&cluster));
    hand_over(cluster, context).instrument(span).await
}

async fn hand_over(cluster: Arc<DatabaseCluster>, context: Arc<Context>) -> Result<Action, Error> {
    let key = key(&cluster);
    let mailbox = |source| Error::Mailbox {
        cluster: key.clone(),
        source,
    };
    if cluster.metadata.deletion_timestamp.is_some() {
        // Owner references delete everything the cluster owns.
        stop(&context, &key).await;
        return Ok(Action::await_change());
    }
    if let Ok(mut started) = context.started.lock() {
        started.insert(key.clone());
    }
    let spec = cluster_spec(&context.shared, &cluster);
    let actor = context
        .root
        .send(StartChild {
            key: key.clone(),
            spec,
        })
        .await
        .map_err(mailbox)?;
    let Some(actor) = actor else {
        // The actor waits out a back-off after failing. If the cluster changed since it
        // was reported failing, try again now rather than after the pause.
        let changed = context.failing.lock().is_ok_and(|mut failing| {
            let changed = failing
                .get(&key)
                .is_some_and(|seen| *seen != edition(&cluster));
            if changed {
                failing.remove(&key);
            }
            changed
        });
        if changed {
            let restarted = context
                .root
                .send(RestartNow { key: key.clone() })
                .await
                .map_err(mailbox)?;
            if restarted {
                let note = Note::normal(
                    "ActorRestarted",
                    "the cluster changed; its actor was restarted without waiting".into(),
                );
                context.shared.record(&cluster, note).await;
            }
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        return Ok(Action::requeue(RESYNC));
    };
    let fault = context
        .fault_injection
        .then(|| cluster.annotations().get(INJECT_FAULT_ANNOTATION).cloned())
        .flatten();
    let event = match fault {
        Some(what) => ClusterEvent::InjectedFault(what),
        None => ClusterEvent::Desired(cluster),
    };
    actor.do_send(Event::new(event));
    Ok(Action::requeue(RESYNC))
}

/// Stops the actor of a cluster that is gone.
pub async fn stop(context: &Context, key: &str) {
    if let Ok(mut started) = context.started.lock() {
        started.remove(key);
    }
    if let Ok(mut failing) = context.failing.lock() {
        failing.remove(key);
    }
    let _ = context
        .root
        .send(StopChild {
            key: key.to_owned(),
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> DatabaseCluster {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1", "kind": "DatabaseCluster",
            "metadata": {"name": "db", "namespace": "ns", "generation": 1, "resourceVersion": "10"},
            "spec": {"engine": "postgresql", "version": "15", "storage": {"size": "1Gi"}},
        }))
        .expect("a valid cluster")
    }

    #[test]
    fn the_edition_follows_spec_and_annotations_but_not_status_writes() {
        let before = cluster();
        let mut status_written = cluster();
        status_written.metadata.resource_version = Some("11".into());
        status_written.status = Some(Default::default());
        assert_eq!(edition(&before), edition(&status_written));
        let mut annotated = cluster();
        annotated
            .annotations_mut()
            .insert(INJECT_FAULT_ANNOTATION.into(), "x".into());
        assert_ne!(edition(&before), edition(&annotated));
        let mut edited = cluster();
        edited.metadata.generation = Some(2);
        assert_ne!(edition(&before), edition(&edited));
        assert_eq!(key(&before), "ns/db");
    }
}
