//! The Kubernetes names and writes that several controllers share, operator and node
//! agent alike: the labels and finalizers one of them sets and another reads, the field
//! manager of a node's entry in a pool's status, a status applied with server-side
//! apply, and a finalizer added or removed under the resource version it was read at.
//!
//! One copy, so that two writers of the same object cannot drift apart on a name or on
//! how a write is made. It decides nothing: which fields to write, and when, stays with
//! each caller, and so does what an error means to it (a 404 on a finalizer being
//! removed is "done" for one caller and a failure for another).

use std::fmt::Debug;

use kube::api::{Api, Patch, PatchParams};
use kube::core::object::HasStatus;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Label every object of a DatabaseCluster carries (its pods, Services, claims, and the
/// Backups its schedules make): the cluster's name.
pub const CLUSTER_LABEL: &str = "castellan.io/cluster";
/// Label of a database pod and its volume: the instance's name.
pub const INSTANCE_LABEL: &str = "castellan.io/instance";
/// Label naming the node a `BlockDevice` or a pool's PersistentVolume is on, to list
/// one node's objects.
pub const NODE_LABEL: &str = "castellan.io/node";
/// Label naming the pool a PersistentVolume was carved from.
pub const POOL_LABEL: &str = "castellan.io/pool";

/// Keeps a StoragePool until every node's part of it is released: by that node's agent
/// (`agent::pool::deletion`), or by the operator for a node that never comes back
/// (`operator::pools`).
pub const POOL_FINALIZER: &str = "castellan.io/pool";
/// Keeps a PersistentVolume until the agent has dealt with its subvolume.
pub const VOLUME_FINALIZER: &str = "castellan.io/volume";

/// Field manager of one node's entry in a StoragePool's `status.nodes`. The node's agent
/// applies its entry under it; the operator applies an empty status under it to release
/// a node that never comes back, and server-side apply then deletes what only this
/// manager owned.
pub fn node_entry_manager(node: &str) -> String {
    format!("castellan-agent/{node}")
}

/// `status` as the whole object that server-side apply to `K`'s status subresource
/// wants. apiVersion and kind come from the type, the one the `Api` it is sent through
/// serves, so the two cannot disagree.
pub fn status_object<K: Resource<DynamicType = ()>>(name: &str, status: &impl Serialize) -> Value {
    json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": { "name": name },
        "status": status,
    })
}

/// Applies `status` to the object `name` under `field_manager`, forcing. Each of
/// Castellan's field managers is the only writer of the status fields it applies, so a
/// conflict is ownership to take over (a leftover of an older manager name, or, when the
/// operator releases a node, that node's agent's entry), not another writer's opinion.
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    field_manager: &str,
    status: &impl Serialize,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned,
{
    apply_status_object(api, name, field_manager, status_object::<K>(name, status)).await
}

/// Applies `object`, a whole object for `K`'s status subresource such as
/// [`status_object`] or [`status_object_at`] make, under `field_manager`, forcing (as
/// [`apply_status`]).
pub async fn apply_status_object<K>(
    api: &Api<K>,
    name: &str,
    field_manager: &str,
    object: Value,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned,
{
    let params = PatchParams::apply(field_manager).force();
    api.patch_status(name, &params, &Patch::Apply(object)).await
}

/// [`status_object`] with the resource version it may be applied onto: server-side
/// apply takes it as a precondition. When anyone wrote the object since (another
/// manager's status, or this writer's own earlier write that the reader's cache had not
/// caught up with), the API server answers 409 Conflict instead of the write putting
/// back what was decided on stale fields.
pub fn status_object_at<K: Resource<DynamicType = ()>>(
    name: &str,
    resource_version: &str,
    status: &impl Serialize,
) -> Value {
    let mut object = status_object::<K>(name, status);
    object["metadata"]["resourceVersion"] = json!(resource_version);
    object
}

/// `object` with the status the API server holds now and the resource version it holds
/// it at; the rest (spec, metadata) stays as it was. A controller's object comes from
/// its cache, which may not yet hold the status its own previous pass wrote: decided on
/// that, a pass would redo what was done and write back what was replaced. One GET of
/// the status subresource; pair it with [`apply_status_onto`].
pub async fn with_current_status<K>(api: &Api<K>, object: &K) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + HasStatus + Clone + DeserializeOwned + Debug,
{
    let mut current = api.get_status(&object.name_any()).await?;
    let mut merged = object.clone();
    *merged.status_mut() = current.status_mut().take();
    merged.meta_mut().resource_version = current.meta_mut().resource_version.take();
    Ok(merged)
}

/// Applies `status` to `object` under `field_manager` (as [`apply_status`]), onto the
/// resource version `object` was read at ([`status_object_at`]): when anything wrote
/// the object since, the API server answers 409 Conflict and the caller's next pass
/// decides again on what is there.
pub async fn apply_status_onto<K>(
    api: &Api<K>,
    object: &K,
    field_manager: &str,
    status: &impl Serialize,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned,
{
    let name = object.name_any();
    // Objects read from the API server always carry one.
    let body = match object.resource_version() {
        Some(version) => status_object_at::<K>(&name, &version, status),
        None => status_object::<K>(&name, status),
    };
    apply_status_object(api, &name, field_manager, body).await
}

/// The merge patch that gives `object` the finalizers it has, with `finalizer` present
/// (added last) or not. A merge patch replaces the whole list, so it carries the
/// resource version the list was read at: when another writer changed the object
/// meanwhile, the API server refuses it with 409 Conflict instead of the patch undoing
/// that writer's finalizer.
pub fn finalizer_patch(object: &impl Resource, finalizer: &str, present: bool) -> Value {
    let mut finalizers: Vec<&str> = object
        .finalizers()
        .iter()
        .map(String::as_str)
        .filter(|f| *f != finalizer)
        .collect();
    if present {
        finalizers.push(finalizer);
    }
    json!({ "metadata": {
        "finalizers": finalizers,
        "resourceVersion": object.resource_version(),
    }})
}

/// Adds (`present`) or removes `finalizer` on `object` as it was read, with
/// [`finalizer_patch`]; a 409 Conflict means the object changed since.
pub async fn set_finalizer<K>(
    api: &Api<K>,
    object: &K,
    finalizer: &str,
    present: bool,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    api.patch(
        &object.name_any(),
        &PatchParams::default(),
        &Patch::Merge(finalizer_patch(object, finalizer, present)),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use castellan_crds::block_device::{BlockDevice, BlockDeviceState, BlockDeviceStatus};
    use k8s_openapi::api::core::v1::PersistentVolume;
    use kube::api::ObjectMeta;

    #[test]
    fn a_status_object_takes_its_api_version_and_kind_from_the_type() {
        let status = BlockDeviceStatus {
            state: Some(BlockDeviceState::Claimed),
            ..Default::default()
        };
        assert_eq!(
            status_object::<BlockDevice>("node-a-serial-1", &status),
            json!({
                "apiVersion": "castellan.io/v1alpha1",
                "kind": "BlockDevice",
                "metadata": { "name": "node-a-serial-1" },
                "status": { "state": "Claimed" },
            })
        );
        let core = status_object::<PersistentVolume>("pvc-1", &json!({}));
        assert_eq!(
            (&core["apiVersion"], &core["kind"]),
            (&json!("v1"), &json!("PersistentVolume"))
        );
    }

    #[test]
    fn a_status_object_at_a_version_carries_it_as_its_precondition() {
        assert_eq!(
            status_object_at::<BlockDevice>("node-a-serial-1", "42", &json!({})),
            json!({
                "apiVersion": "castellan.io/v1alpha1",
                "kind": "BlockDevice",
                "metadata": { "name": "node-a-serial-1", "resourceVersion": "42" },
                "status": {},
            })
        );
    }

    fn volume(finalizers: &[&str]) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("pvc-1".into()),
                resource_version: Some("42".into()),
                finalizers: Some(finalizers.iter().map(|f| f.to_string()).collect()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn adding_a_finalizer_keeps_the_others_and_the_version_read() {
        let patch = finalizer_patch(
            &volume(&["kubernetes.io/pv-protection"]),
            VOLUME_FINALIZER,
            true,
        );
        assert_eq!(
            patch,
            json!({ "metadata": {
                "finalizers": ["kubernetes.io/pv-protection", VOLUME_FINALIZER],
                "resourceVersion": "42",
            }})
        );
        // Present already: still once.
        let again = finalizer_patch(&volume(&[VOLUME_FINALIZER]), VOLUME_FINALIZER, true);
        assert_eq!(again["metadata"]["finalizers"], json!([VOLUME_FINALIZER]));
    }

    #[test]
    fn removing_a_finalizer_keeps_the_others_and_the_version_read() {
        let patch = finalizer_patch(
            &volume(&[VOLUME_FINALIZER, "kubernetes.io/pv-protection"]),
            VOLUME_FINALIZER,
            false,
        );
        assert_eq!(
            patch,
            json!({ "metadata": {
                "finalizers": ["kubernetes.io/pv-protection"],
                "resourceVersion": "42",
            }})
        );
        // The last one removed: an empty list.
        let last = finalizer_patch(&volume(&[VOLUME_FINALIZER]), VOLUME_FINALIZER, false);
        assert_eq!(last["metadata"]["finalizers"], json!([]));
    }
}
