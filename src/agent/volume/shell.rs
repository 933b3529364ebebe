//! Volumes: the shell of the node's local-volume provisioner and resizer.
//!
//! Each pass reads this node's mounted pools (capacity from `btrfs filesystem usage`,
//! subvolumes and quotas from `btrfs qgroup show`), the claims of the pools'
//! StorageClasses and the PVs this node made, asks `volume::plan` what to do and does
//! it: `btrfs subvolume create` + `btrfs qgroup limit` + a `local` PV pre-bound to the
//! claim (the PV controller of kube-controller-manager then binds the claim), a higher
//! quota + PV capacity + claim status on expansion, `btrfs subvolume delete` + PV
//! deletion on release. Refusals are Warning Events on the claim.
//!
//! Expansion: kube-controller-manager's expand controller finds no expandable in-tree
//! plugin for a `local` PV (the local plugin only expands on the node), emits
//! `ExternalExpanding` ("waiting for an external controller to expand this PVC") and
//! leaves the claim alone. The agent then does what the CSI external-resizer does:
//! marks the claim `Resizing` (`allocatedResourceStatuses.storage:
//! ControllerResizeInProgress`, `allocatedResources`), raises the quota, sets the PV's
//! capacity, and finishes the claim (`status.capacity`, resize conditions and status
//! cleared). A quota needs no filesystem step on the node, so there is no
//! `FileSystemResizePending` stage.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use castellan_crds::storage_pool::{ReclaimPolicy, StoragePool};
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::machine::{
    self as volume, Action, Claim, ClaimKey, PROVISIONED_BY_ANNOTATION, PROVISIONER, PoolOnNode,
    Reclaim, SELECTED_NODE_ANNOTATION, VOLUMES_DIR, Volume,
};
use crate::agent::btrfs;
use crate::agent::children::StorageLock;
use crate::agent::host::{self, run};
use crate::agent::pool::totals;
use crate::agent::reported::Reported;
use crate::events::Recorder;
use crate::kube_ops::{NODE_LABEL, POOL_LABEL, VOLUME_FINALIZER, set_finalizer};
use castellan_crds::quantity::parse_bytes;

/// Why a pass failed before it could decide anything.
#[derive(Debug, thiserror::Error)]
pub enum VolumesError {
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        source: kube::Error,
    },
}

/// The provisioner of one node.
pub struct Volumes {
    client: Client,
    node: String,
    /// The Node's `kubernetes.io/hostname` label, which PV node affinity matches.
    hostname: String,
    root: PathBuf,
    recorder: Recorder,
    /// Refusals already reported, so a claim gets one Event per reason, not one per pass.
    reported: Reported,
    /// The node's storage lock, held through a pass (see `crate::agent::StorageLock`).
    storage: StorageLock,
}

impl Volumes {
    pub fn new(
        client: Client,
        (node, hostname): (&str, &str),
        root: &Path,
        storage: StorageLock,
    ) -> Self {
        let reporter = Reporter {
            controller: "castellan-agent".into(),
            instance: Some(node.to_string()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            node: node.to_string(),
            hostname: hostname.to_string(),
            root: root.to_path_buf(),
            reported: Reported::default(),
            storage,
        }
    }

    /// One pass. Returns whether something changed on a pool (so that its status is
    /// reported again).
    pub async fn reconcile(&self) -> Result<bool, VolumesError> {
        let _storage = self.storage.lock().await;
        let pools = Api::<StoragePool>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|source| VolumesError::List {
                what: "StoragePools",
                source,
            })?;
        let mut on_node = Vec::new();
        for pool in &pools.items {
            let mount = btrfs::mount_path(&self.root, &self.node, &pool.name_any());
            let inspected = tokio::task::spawn_blocking(move || inspect(&mount))
                .await
                .ok()
                .flatten();
            let Some((capacity_bytes, subvolumes)) = inspected else {
                continue;
            };
            on_node.push(PoolOnNode {
                pool: pool.name_any(),
                class: pool.spec.storage_class.name.clone(),
                reclaim: match pool.spec.storage_class.reclaim_policy {
                    ReclaimPolicy::Delete => Reclaim::Delete,
                    ReclaimPolicy::Retain => Reclaim::Retain,
                },
                capacity_bytes,
                subvolumes,
            });
        }
        let volumes = self.volumes().await?;
        if on_node.is_empty() && volumes.is_empty() {
            return Ok(false);
        }
        let classes: BTreeSet<&str> = on_node.iter().map(|pool| pool.class.as_str()).collect();
        let claim_objects = Api::<PersistentVolumeClaim>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|source| VolumesError::List {
                what: "PersistentVolumeClaims",
                source,
            })?
            .items;
        let claims: Vec<Claim> = claim_objects
            .iter()
            .filter(|claim| {
                claim
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.storage_class_name.as_deref())
                    .is_some_and(|class| classes.contains(class))
            })
            .map(claim_of)
            .collect();
        let decided: Vec<Volume> = volumes.iter().filter_map(volume_of).collect();
        let actions = volume::plan(&self.node, &on_node, &claims, &decided);
        let changed = !actions.is_empty();
        for action in actions {
            if let Err(error) = self.perform(&action, &claim_objects, &volumes).await {
                tracing::error!(node = %self.node, ?action, %error, "a volume action failed");
            }
        }
        Ok(changed)
    }

    async fn volumes(&self) -> Result<Vec<PersistentVolume>, VolumesError> {
        Api::<PersistentVolume>::all(self.client.clone())
            .list(&ListParams::default().labels(&format!("{NODE_LABEL}={}", self.node)))
            .await
            .map(|list| list.items)
            .map_err(|source| VolumesError::List {
                what: "PersistentVolumes",
                source,
            })
    }

    async fn perform(
        &self,
        action: &Action,
        claims: &[PersistentVolumeClaim],
        volumes: &[PersistentVolume],
    ) -> Result<(), String> {
        let claim_object = |key: &ClaimKey| {
            claims
                .iter()
                .find(|claim| claim.uid().as_deref() == Some(key.uid.as_str()))
        };
        match action {
            Action::Provision {
                claim,
                pool,
                class,
                volume,
                size_bytes,
                reclaim,
            } => {
                let path = self.subvolume_path(pool, volume);
                let size = *size_bytes;
                let at = path.clone();
                blocking(move || create_subvolume(&at, size)).await?;
                let object = claim_object(claim)
                    .ok_or_else(|| format!("claim {}/{} vanished", claim.namespace, claim.name))?;
                let pv = build_volume(
                    &self.node,
                    &self.hostname,
                    pool,
                    class,
                    volume,
                    &path,
                    size,
                    *reclaim,
                    object,
                );
                match Api::<PersistentVolume>::all(self.client.clone())
                    .create(&PostParams::default(), &pv)
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(error) => {
                        return Err(format!("creating PersistentVolume {volume}: {error}"));
                    }
                }
                tracing::info!(node = %self.node, claim = %format!("{}/{}", claim.namespace, claim.name), %volume, size_bytes = size, path = %path.display(), "volume provisioned");
                self.event(
                    object,
                    EventType::Normal,
                    "Provisioned",
                    format!(
                        "subvolume {} of pool {pool} on node {} with a quota of {size} bytes, as PersistentVolume {volume}",
                        path.display(),
                        self.node
                    ),
                )
                .await;
                Ok(())
            }
            Action::Refuse { claim, message } => {
                let Some(object) = claim_object(claim) else {
                    return Ok(());
                };
                if self.first_report(&claim.uid, message) {
                    tracing::warn!(node = %self.node, claim = %format!("{}/{}", claim.namespace, claim.name), %message, "volume refused");
                    self.event(
                        object,
                        EventType::Warning,
                        "ProvisioningFailed",
                        message.clone(),
                    )
                    .await;
                }
                // Hand the claim back to the scheduler, as the CSI external-provisioner
                // does: another node may have the room this one lacks.
                let patch = json!({"metadata": {"annotations": {SELECTED_NODE_ANNOTATION: null}}});
                Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), &claim.namespace)
                    .patch(&claim.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(drop)
                    .map_err(|error| {
                        format!(
                            "removing the selected node of claim {}/{}: {error}",
                            claim.namespace, claim.name
                        )
                    })
            }
            Action::Expand {
                claim,
                pool,
                volume,
                size_bytes,
            } => {
                let size = *size_bytes;
                let quantity = Quantity(totals::quantity(size));
                let object = claim_object(claim)
                    .ok_or_else(|| format!("claim {}/{} vanished", claim.namespace, claim.name))?;
                // The claim's other conditions (`Unused`, …) belong to other controllers:
                // the list is rewritten with only the resize ones changed, guarded by the
                // resource version read.
                let mut conditions = without_resize_conditions(object);
                conditions.push(json!({"type": "Resizing", "status": "True",
                    "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()}));
                let resizing = json!({
                    "metadata": {"resourceVersion": object.resource_version()},
                    "status": {
                        "allocatedResources": {"storage": quantity},
                        "allocatedResourceStatuses": {"storage": "ControllerResizeInProgress"},
                        "conditions": conditions,
                    },
                });
                let marked =
                    Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), &claim.namespace)
                        .patch_status(
                            &claim.name,
                            &PatchParams::default(),
                            &Patch::Merge(&resizing),
                        )
                        .await
                        .map_err(|error| {
                            format!(
                                "marking claim {}/{} Resizing: {error}",
                                claim.namespace, claim.name
                            )
                        })?;
                let path = self.subvolume_path(pool, volume);
                let at = path.clone();
                blocking(move || set_quota(&at, size)).await?;
                let capacity = json!({"spec": {"capacity": {"storage": quantity}}});
                Api::<PersistentVolume>::all(self.client.clone())
                    .patch(volume, &PatchParams::default(), &Patch::Merge(&capacity))
                    .await
                    .map_err(|error| {
                        format!("setting the capacity of PersistentVolume {volume}: {error}")
                    })?;
                self.finish_expansion(claim, size, &marked).await?;
                tracing::info!(node = %self.node, claim = %format!("{}/{}", claim.namespace, claim.name), %volume, size_bytes = size, "volume expanded");
                if let Some(object) = claim_object(claim) {
                    self.event(
                        object,
                        EventType::Normal,
                        "VolumeResizeSuccessful",
                        format!("quota of {} raised to {size} bytes", path.display()),
                    )
                    .await;
                }
                Ok(())
            }
            Action::FinishExpansion { claim, size_bytes } => {
                let object = claim_object(claim)
                    .ok_or_else(|| format!("claim {}/{} vanished", claim.namespace, claim.name))?;
                self.finish_expansion(claim, *size_bytes, object).await
            }
            Action::RefuseExpansion { claim, message } => {
                if let Some(object) = claim_object(claim)
                    && self.first_report(&claim.uid, message)
                {
                    tracing::warn!(node = %self.node, claim = %format!("{}/{}", claim.namespace, claim.name), %message, "expansion refused");
                    self.event(
                        object,
                        EventType::Warning,
                        "VolumeResizeFailed",
                        message.clone(),
                    )
                    .await;
                }
                Ok(())
            }
            Action::Delete {
                pool,
                volume,
                subvolume,
            } => {
                if *subvolume {
                    let path = self.subvolume_path(pool, volume);
                    let mount = btrfs::mount_path(&self.root, &self.node, pool);
                    blocking(move || delete_subvolume(&path, &mount)).await?;
                }
                self.remove_finalizer(volume, volumes).await?;
                match Api::<PersistentVolume>::all(self.client.clone())
                    .delete(volume, &DeleteParams::default())
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(error) => {
                        return Err(format!("deleting PersistentVolume {volume}: {error}"));
                    }
                }
                tracing::info!(node = %self.node, %volume, %pool, "volume deleted");
                Ok(())
            }
            Action::Release { volume } => {
                self.remove_finalizer(volume, volumes).await?;
                tracing::info!(node = %self.node, %volume, "PersistentVolume deleted; its subvolume is retained");
                Ok(())
            }
        }
    }

    /// Ends a resize the way the expand controller's `MarkFSResizeFinished` does: the
    /// new capacity, no storage entry in `allocatedResourceStatuses`, no resize
    /// condition (other conditions kept), guarded by `current`'s resource version.
    async fn finish_expansion(
        &self,
        claim: &ClaimKey,
        size: u64,
        current: &PersistentVolumeClaim,
    ) -> Result<(), String> {
        let quantity = Quantity(totals::quantity(size));
        let done = json!({
            "metadata": {"resourceVersion": current.resource_version()},
            "status": {
                "capacity": {"storage": quantity},
                "allocatedResources": {"storage": quantity},
                "allocatedResourceStatuses": null,
                "conditions": without_resize_conditions(current),
            },
        });
        Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), &claim.namespace)
            .patch_status(&claim.name, &PatchParams::default(), &Patch::Merge(&done))
            .await
            .map(drop)
            .map_err(|error| {
                format!(
                    "setting the capacity of claim {}/{}: {error}",
                    claim.namespace, claim.name
                )
            })
    }

    async fn remove_finalizer(
        &self,
        volume: &str,
        volumes: &[PersistentVolume],
    ) -> Result<(), String> {
        let Some(object) = volumes.iter().find(|pv| pv.name_any() == volume) else {
            return Ok(());
        };
        if !object.finalizers().iter().any(|f| f == VOLUME_FINALIZER) {
            return Ok(());
        }
        let volumes = Api::<PersistentVolume>::all(self.client.clone());
        match set_finalizer(&volumes, object, VOLUME_FINALIZER, false).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(format!(
                "removing the finalizer of PersistentVolume {volume}: {error}"
            )),
        }
    }

    fn subvolume_path(&self, pool: &str, volume: &str) -> PathBuf {
        btrfs::mount_path(&self.root, &self.node, pool)
            .join(VOLUMES_DIR)
            .join(volume)
    }

    /// Whether `message` is new for this claim (and remembers it).
    fn first_report(&self, uid: &str, message: &str) -> bool {
        self.reported.first(uid, message)
    }

    async fn event(
        &self,
        claim: &PersistentVolumeClaim,
        kind: EventType,
        reason: &str,
        note: String,
    ) {
        let reference: ObjectReference = claim.object_ref(&());
        let event = Event {
            type_: kind,
            reason: reason.to_string(),
            note: Some(crate::events::note(&note)),
            action: "Provision".to_string(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &reference).await {
            tracing::warn!(node = %self.node, claim = %claim.name_any(), %error, "publishing an Event failed");
        }
    }
}

/// The claim's resize conditions, set and cleared by resizers.
const RESIZE_CONDITIONS: [&str; 4] = [
    "Resizing",
    "FileSystemResizePending",
    "ControllerResizeError",
    "NodeResizeError",
];

/// The claim's conditions without the resize ones, as JSON for a status patch.
fn without_resize_conditions(claim: &PersistentVolumeClaim) -> Vec<serde_json::Value> {
    claim
        .status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|condition| !RESIZE_CONDITIONS.contains(&condition.type_.as_str()))
        .filter_map(|condition| serde_json::to_value(condition).ok())
        .collect()
}

/// Bytes promised to volumes in the pool mounted at `mount` (the sum of their quotas),
/// for the pool's status; `None` when it cannot be read.
pub fn allocated_bytes(mount: &Path) -> Option<u64> {
    let path = mount.to_string_lossy();
    let text = run("btrfs", &["qgroup", "show", "-re", "--raw", &path]).ok()?;
    let quotas = btrfs::parse_volume_quotas(&text)?;
    Some(quotas.values().map(|limit| limit.unwrap_or(0)).sum())
}

/// Capacity and volumes of the pool mounted at `mount`; `None` when it is not mounted
/// here or cannot be read (then nothing is provisioned from it).
fn inspect(mount: &Path) -> Option<(u64, BTreeMap<String, Option<u64>>)> {
    if !host::is_mount_point(mount) {
        return None;
    }
    let path = mount.to_string_lossy();
    let usage = run("btrfs", &["filesystem", "usage", "-b", &path])
        .ok()
        .and_then(|text| btrfs::parse_usage(&text))?;
    let quotas = run("btrfs", &["qgroup", "show", "-re", "--raw", &path])
        .ok()
        .and_then(|text| btrfs::parse_volume_quotas(&text))?;
    Some((usage.usable_bytes(), quotas))
}

fn create_subvolume(path: &Path, size_bytes: u64) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        host::create_dir_all(parent)?;
    }
    if !host::exists(path) {
        run("btrfs", &["subvolume", "create", &path.to_string_lossy()])?;
    }
    set_quota(path, size_bytes)
}

fn set_quota(path: &Path, size_bytes: u64) -> Result<(), String> {
    run(
        "btrfs",
        &[
            "qgroup",
            "limit",
            &size_bytes.to_string(),
            &path.to_string_lossy(),
        ],
    )
    .map(drop)
}

fn delete_subvolume(path: &Path, mount: &Path) -> Result<(), String> {
    if host::exists(path) {
        run("btrfs", &["subvolume", "delete", &path.to_string_lossy()])?;
    }
    // The deleted subvolume's qgroup stays behind as `<stale>` until cleared; it no
    // longer counts (see `btrfs::parse_volume_quotas`), so a failure here is harmless.
    if let Err(error) = run(
        "btrfs",
        &["qgroup", "clear-stale", &mount.to_string_lossy()],
    ) {
        tracing::debug!(%error, "clearing stale qgroups failed");
    }
    Ok(())
}

async fn blocking(
    work: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Result<(), String> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|error| Err(format!("volume work panicked: {error}")))
}

fn quantity_bytes(quantity: Option<&Quantity>) -> Option<u64> {
    quantity.and_then(|quantity| parse_bytes(&quantity.0))
}

fn claim_of(claim: &PersistentVolumeClaim) -> Claim {
    let spec = claim.spec.as_ref();
    Claim {
        namespace: claim.namespace().unwrap_or_default(),
        name: claim.name_any(),
        uid: claim.uid().unwrap_or_default(),
        class: spec.and_then(|spec| spec.storage_class_name.clone()),
        selected_node: claim.annotations().get(SELECTED_NODE_ANNOTATION).cloned(),
        request_bytes: quantity_bytes(
            spec.and_then(|spec| spec.resources.as_ref())
                .and_then(|resources| resources.requests.as_ref())
                .and_then(|requests| requests.get("storage")),
        ),
        volume_name: spec
            .and_then(|spec| spec.volume_name.clone())
            .filter(|name| !name.is_empty()),
        status_capacity_bytes: quantity_bytes(
            claim
                .status
                .as_ref()
                .and_then(|status| status.capacity.as_ref())
                .and_then(|capacity| capacity.get("storage")),
        ),
        block: spec.and_then(|spec| spec.volume_mode.as_deref()) == Some("Block"),
        data_source: spec
            .is_some_and(|spec| spec.data_source.is_some() || spec.data_source_ref.is_some()),
        deleting: claim.meta().deletion_timestamp.is_some(),
    }
}

/// A PV of this node's, if it carries a pool label (PVs by others are not ours).
fn volume_of(pv: &PersistentVolume) -> Option<Volume> {
    let pool = pv.labels().get(POOL_LABEL)?.clone();
    let spec = pv.spec.as_ref();
    Some(Volume {
        name: pv.name_any(),
        pool,
        claim_uid: spec
            .and_then(|spec| spec.claim_ref.as_ref())
            .and_then(|reference| reference.uid.clone()),
        capacity_bytes: quantity_bytes(
            spec.and_then(|spec| spec.capacity.as_ref())
                .and_then(|capacity| capacity.get("storage")),
        )
        .unwrap_or(0),
        phase: pv.status.as_ref().and_then(|status| status.phase.clone()),
        reclaim: match spec.and_then(|spec| spec.persistent_volume_reclaim_policy.as_deref()) {
            Some("Retain") => Reclaim::Retain,
            _ => Reclaim::Delete,
        },
        deleting: pv.meta().deletion_timestamp.is_some(),
        finalizer: pv
            .finalizers()
            .iter()
            .any(|finalizer| finalizer == VOLUME_FINALIZER),
    })
}

/// The `local` PV for a claim, pre-bound to it (claimRef with uid) so that the PV
/// controller binds exactly this claim, with node affinity to this node.
#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename them
pub fn build_volume(
    node: &str,
    hostname: &str,
    pool: &str,
    class: &str,
    volume: &str,
    path: &Path,
    size_bytes: u64,
    reclaim: Reclaim,
    claim: &PersistentVolumeClaim,
) -> PersistentVolume {
    let access_modes = claim
        .spec
        .as_ref()
        .and_then(|spec| spec.access_modes.clone())
        .filter(|modes| !modes.is_empty())
        .unwrap_or_else(|| vec!["ReadWriteOnce".to_string()]);
    let object = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": volume,
            "labels": { NODE_LABEL: node, POOL_LABEL: pool },
            "annotations": { PROVISIONED_BY_ANNOTATION: PROVISIONER },
            "finalizers": [VOLUME_FINALIZER],
        },
        "spec": {
            "capacity": { "storage": totals::quantity(size_bytes) },
            "accessModes": access_modes,
            "volumeMode": "Filesystem",
            "persistentVolumeReclaimPolicy": match reclaim { Reclaim::Delete => "Delete", Reclaim::Retain => "Retain" },
            "storageClassName": class,
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": claim.namespace(),
                "name": claim.name_any(),
                "uid": claim.uid(),
            },
            "local": { "path": path.to_string_lossy() },
            "nodeAffinity": { "required": { "nodeSelectorTerms": [{ "matchExpressions": [{
                "key": "kubernetes.io/hostname", "operator": "In", "values": [hostname],
            }]}]}},
        },
    });
    // The JSON above is a literal PersistentVolume; it cannot fail to deserialize.
    serde_json::from_value(object).unwrap_or_default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    #[test]
    fn resize_conditions_go_and_the_others_stay() {
        let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "data"},
            "status": {"conditions": [
                {"type": "Resizing", "status": "True"},
                {"type": "Unused", "status": "False", "reason": "PodUsingPVC"},
                {"type": "FileSystemResizePending", "status": "True"},
            ]},
        }))
        .unwrap();
        let kept = without_resize_conditions(&claim);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0]["type"], "Unused");
        assert_eq!(kept[0]["reason"], "PodUsingPVC");
        assert!(without_resize_conditions(&PersistentVolumeClaim::default()).is_empty());
    }

    #[test]
    fn the_volume_is_a_local_pv_pre_bound_to_the_claim_on_this_node() {
        let claim = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                namespace: Some("db".into()),
                uid: Some("u-1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let pv = build_volume(
            "node-1",
            "node-1.example",
            "fast",
            "castellan-fast",
            "pvc-u-1",
            Path::new("/pools/node-1/fast/volumes/pvc-u-1"),
            1 << 30,
            Reclaim::Retain,
            &claim,
        );
        let value = serde_json::to_value(&pv).unwrap();
        assert_eq!(value["metadata"]["name"], "pvc-u-1");
        assert_eq!(value["metadata"]["labels"][NODE_LABEL], "node-1");
        assert_eq!(value["metadata"]["labels"][POOL_LABEL], "fast");
        assert_eq!(value["metadata"]["finalizers"][0], VOLUME_FINALIZER);
        assert_eq!(
            value["metadata"]["annotations"][PROVISIONED_BY_ANNOTATION],
            PROVISIONER
        );
        assert_eq!(value["spec"]["capacity"]["storage"], "1Gi");
        assert_eq!(value["spec"]["accessModes"][0], "ReadWriteOnce");
        assert_eq!(value["spec"]["persistentVolumeReclaimPolicy"], "Retain");
        assert_eq!(value["spec"]["storageClassName"], "castellan-fast");
        assert_eq!(value["spec"]["claimRef"]["uid"], "u-1");
        assert_eq!(value["spec"]["claimRef"]["namespace"], "db");
        assert_eq!(
            value["spec"]["local"]["path"],
            "/pools/node-1/fast/volumes/pvc-u-1"
        );
        let term = &value["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"]
            [0];
        assert_eq!(term["key"], "kubernetes.io/hostname");
        assert_eq!(term["values"][0], "node-1.example");
        // Round trip: what the agent parses back is what it wrote.
        let parsed = volume_of(&pv).unwrap();
        assert_eq!(parsed.pool, "fast");
        assert_eq!(parsed.claim_uid.as_deref(), Some("u-1"));
        assert_eq!(parsed.capacity_bytes, 1 << 30);
        assert_eq!(parsed.reclaim, Reclaim::Retain);
        assert!(parsed.finalizer && !parsed.deleting);
    }
}
