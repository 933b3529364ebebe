//! The StoragePool releaser: carries out a pool's [`machine::RELEASE_ANNOTATION`] for
//! nodes that never come back (see `machine`). Only with `--release-pools` (the chart
//! sets it for a cluster-wide operator): it needs rights on the cluster-scoped pools and
//! volumes that a namespaced operator does not have.
//!
//! Its writes: the named node's status entry is removed by applying an empty status
//! under that node's agent's field manager (server-side apply then deletes what only
//! that manager owned), volumes are let go by a merge patch of their finalizers (with
//! the resourceVersion read, so a concurrent change fails rather than being undone) and
//! deleted, and the pool's annotation and finalizer are removed the same way.

pub mod machine;

use std::sync::Arc;
use std::time::Duration;

use castellan_crds::storage_pool::StoragePool;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::cluster::Note;
use super::cluster::plan::NodeHealth;
use super::context::Shared;
use crate::kube_ops::{
    NODE_LABEL, POOL_FINALIZER, POOL_LABEL, VOLUME_FINALIZER, apply_status, finalizer_patch,
    node_entry_manager, set_finalizer,
};
use machine::{Observed, RELEASE_ANNOTATION, Volume};

#[derive(Debug, thiserror::Error)]
#[error("{what} for StoragePool {pool}: {source}")]
pub struct Error {
    what: String,
    pool: String,
    source: kube::Error,
}

fn kube_error(what: impl Into<String>, pool: &str) -> impl FnOnce(kube::Error) -> Error {
    let (what, pool) = (what.into(), pool.to_owned());
    move |source| Error { what, pool, source }
}

/// Runs until the process is asked to stop.
pub async fn run(client: Client, shared: Arc<Shared>) {
    tracing::info!("StoragePool releaser starting");
    Controller::new(Api::<StoragePool>::all(client), watcher::Config::default())
        .shutdown_on_signal()
        .run(
            reconcile,
            |_, error, _| {
                tracing::warn!(%error, "releasing a pool's node failed; retrying");
                Action::requeue(Duration::from_secs(10))
            },
            shared,
        )
        .for_each(|outcome| async move {
            if let Err(error) = outcome {
                tracing::debug!(%error, "pool release pass");
            }
        })
        .await;
}

async fn reconcile(pool: Arc<StoragePool>, shared: Arc<Shared>) -> Result<Action, Error> {
    let Some(requested) = pool.annotations().get(RELEASE_ANNOTATION).cloned() else {
        return Ok(Action::await_change());
    };
    let name = pool.name_any();
    let client = &shared.client;
    let named = machine::named(&requested);
    let ready = named
        .iter()
        .filter_map(|node| {
            let found = shared.nodes.get(&ObjectRef::new(node))?;
            Some((node.clone(), NodeHealth::of(&found).ready))
        })
        .collect();
    let volumes_api: Api<PersistentVolume> = Api::all(client.clone());
    let pvs = volumes_api
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await
        .map_err(kube_error("listing the pool's volumes", &name))?;
    let mut volumes = Vec::new();
    for pv in &pvs.items {
        volumes.push(Volume {
            name: pv.name_any(),
            node: pv.labels().get(NODE_LABEL).cloned().unwrap_or_default(),
            claim: existing_claim(client, pv).await,
        });
    }
    let observed = Observed {
        requested: Some(requested),
        entries: pool
            .status
            .as_ref()
            .map(|status| {
                status
                    .nodes
                    .iter()
                    .map(|entry| entry.node.clone())
                    .collect()
            })
            .unwrap_or_default(),
        ready,
        volumes,
        deleting: pool.meta().deletion_timestamp.is_some(),
        has_finalizer: pool.finalizers().iter().any(|f| f == POOL_FINALIZER),
    };
    let plan = machine::decide(&observed);
    let pools: Api<StoragePool> = Api::all(client.clone());
    let reference = pool.object_ref(&());
    for node in &plan.release {
        apply_status(&pools, &name, &node_entry_manager(node), &json!({}))
            .await
            .map_err(kube_error(format!("removing node {node}'s entry"), &name))?;
    }
    for volume in &plan.drop_volumes {
        let Some(pv) = pvs.items.iter().find(|pv| pv.name_any() == *volume) else {
            continue;
        };
        set_finalizer(&volumes_api, pv, VOLUME_FINALIZER, false)
            .await
            .map_err(kube_error(format!("letting volume {volume} go"), &name))?;
        match volumes_api.delete(volume, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(kube_error(format!("deleting volume {volume}"), &name)(
                    error,
                ));
            }
        }
    }
    // One patch for the annotation and the finalizer, under the resource version read.
    let mut patch = if plan.remove_finalizer {
        finalizer_patch(&*pool, POOL_FINALIZER, false)
    } else {
        json!({ "metadata": { "resourceVersion": pool.resource_version() } })
    };
    patch["metadata"]["annotations"] = json!({ RELEASE_ANNOTATION: null });
    pools
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_error("removing the release request", &name))?;
    tracing::info!(pool = %name, release = ?plan.release, refused = ?plan.refused, dropped = ?plan.drop_volumes, kept = ?plan.kept_volumes, finalizer_removed = plan.remove_finalizer, "released nodes of a pool");
    for node in &plan.release {
        let mut message = format!("released node {node}'s part of the pool (its status entry");
        let dropped: Vec<&String> = plan
            .drop_volumes
            .iter()
            .filter(|v| {
                observed
                    .volumes
                    .iter()
                    .any(|o| &o.name == *v && o.node == *node)
            })
            .collect();
        if !dropped.is_empty() {
            message.push_str(&format!(
                "; its volumes without claims, deleted: {}",
                dropped
                    .iter()
                    .map(|v| v.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        message.push(')');
        if plan.remove_finalizer {
            message.push_str("; nothing of the deleted pool is left, so it goes");
        }
        shared
            .record_at(&reference, Note::normal("NodeReleased", message))
            .await;
    }
    for (node, why) in &plan.refused {
        shared
            .record_at(
                &reference,
                Note::warning("NodeReleaseRefused", format!("not released {node}: {why}")),
            )
            .await;
    }
    if !plan.kept_volumes.is_empty() {
        let kept: Vec<String> = plan
            .kept_volumes
            .iter()
            .map(|(volume, claim)| format!("{volume} (claim {claim})"))
            .collect();
        shared
            .record_at(
                &reference,
                Note::warning(
                    "VolumesKept",
                    format!(
                        "volumes on released nodes still have claims and were kept: {}; delete the claims, then annotate {RELEASE_ANNOTATION} again to let them go",
                        kept.join(", ")
                    ),
                ),
            )
            .await;
    }
    Ok(Action::await_change())
}

/// `namespace/name` of the claim `pv` is bound to, if that claim exists.
async fn existing_claim(client: &Client, pv: &PersistentVolume) -> Option<String> {
    let reference = pv.spec.as_ref()?.claim_ref.as_ref()?;
    let (namespace, name) = (reference.namespace.clone()?, reference.name.clone()?);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
    match claims.get_opt(&name).await {
        Ok(None) => None,
        // Present, or unknown (an error): kept, never deleted on a guess.
        Ok(Some(claim)) if claim.uid() != reference.uid && reference.uid.is_some() => None,
        _ => Some(format!("{namespace}/{name}")),
    }
}
