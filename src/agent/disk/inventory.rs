//! Inventory: keeps one node's `BlockDevice` objects equal to what discovery found.
//!
//! `plan` is pure: from the devices seen now and the objects that exist, it decides
//! which objects to create or update and which to mark `Missing`; each `DiskActor`
//! (`machine`) plans its own device with it. `Inventory` is the thin shell that lists
//! the node's objects and applies one write with server-side apply under one field
//! manager. A device that returns is the same object again
//! because its name comes from its identity, not from its path.
//!
//! The agent owns `spec`, `status.lastSeen`, `status.observedGeneration`, and
//! `status.state`/`status.message` only while the state is its own (`Unclaimed`,
//! `Missing`, or none yet). Once a pool has set `Claimed`, `InUse` or `Failed`, the
//! agent leaves state and message to it, except to mark the disk `Missing` when it is
//! gone. It never writes `status.pool`; its one condition, `Degraded` while a disk's actor
//! keeps failing (`set_degraded`), is applied under the supervisor's own field manager.

use std::collections::BTreeMap;

use castellan_crds::block_device::{
    BlockDevice, BlockDeviceSpec, BlockDeviceState, BlockDeviceStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::observe::Observed;
use crate::kube_ops::{NODE_LABEL, apply_status};

/// Field manager of every write the agent makes.
pub const FIELD_MANAGER: &str = "castellan-agent";
/// The condition a supervisor sets on a disk whose actor keeps failing.
pub const DEGRADED: &str = "Degraded";
/// Field manager of the `Degraded` condition a failing disk actor gets (and loses):
/// the supervisor's, so that the inventory's and the pools' writes never touch it.
pub fn supervisor_manager(node: &str) -> String {
    format!("castellan-agent-supervisor/{node}")
}
/// `status.lastSeen` of an attached disk is refreshed at most this often, so an idle
/// node does not write every object on every rescan.
pub const LAST_SEEN_REFRESH: SignedDuration = SignedDuration::from_mins(10);

/// One object to write. `None` parts are left as they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    pub name: String,
    pub spec: Option<BlockDeviceSpec>,
    pub status: Option<BlockDeviceStatus>,
}

fn agent_owns_state(state: Option<BlockDeviceState>) -> bool {
    matches!(
        state,
        None | Some(BlockDeviceState::Unclaimed | BlockDeviceState::Missing)
    )
}

fn stale(last_seen: Option<&str>, now: Timestamp) -> bool {
    last_seen
        .and_then(|text| text.parse::<Timestamp>().ok())
        .is_none_or(|seen| now.duration_since(seen) >= LAST_SEEN_REFRESH)
}

/// What to write so that the node's objects (`existing`, all labelled with this node)
/// match the devices `observed` now. Idempotent: a plan applied, then planned again
/// from the result, is empty (until `LAST_SEEN_REFRESH` passes).
pub fn plan(
    observed: &[Observed],
    existing: &[BlockDevice],
    node: &str,
    now: Timestamp,
) -> Vec<Write> {
    let by_name: BTreeMap<String, &BlockDevice> = existing
        .iter()
        .map(|object| (object.name_any(), object))
        .collect();
    let now_text = now.to_string();
    let mut writes = Vec::new();

    for device in observed {
        let object = by_name.get(&device.name).copied();
        let labelled = object.is_some_and(|object| {
            object.labels().get(NODE_LABEL).map(String::as_str) == Some(node)
        });
        let spec_changed = object.is_none_or(|object| object.spec != device.spec) || !labelled;
        let status = object
            .and_then(|object| object.status.clone())
            .unwrap_or_default();

        let mut desired = BlockDeviceStatus {
            last_seen: Some(now_text.clone()),
            ..Default::default()
        };
        if agent_owns_state(status.state) {
            desired.state = Some(BlockDeviceState::Unclaimed);
            desired.message = device.refusal.clone();
        }
        let owned_changed = agent_owns_state(status.state)
            && (status.state != desired.state || status.message != desired.message);
        let generation_changed =
            object.and_then(|object| object.metadata.generation) != status.observed_generation;
        let status_due = spec_changed
            || owned_changed
            || generation_changed
            || stale(status.last_seen.as_deref(), now);

        if spec_changed || status_due {
            writes.push(Write {
                name: device.name.clone(),
                spec: spec_changed.then(|| device.spec.clone()),
                status: status_due.then_some(desired),
            });
        }
    }

    for (name, object) in &by_name {
        if observed.iter().any(|device| &device.name == name) {
            continue;
        }
        let status = object.status.clone().unwrap_or_default();
        if status.state == Some(BlockDeviceState::Missing) {
            continue;
        }
        writes.push(Write {
            name: name.clone(),
            spec: None,
            status: Some(BlockDeviceStatus {
                state: Some(BlockDeviceState::Missing),
                message: Some(format!(
                    "not attached to node {node} at the agent's last scan{}",
                    status
                        .last_seen
                        .as_deref()
                        .map(|seen| format!("; last seen {seen}"))
                        .unwrap_or_default()
                )),
                // Keep when it was last seen; the write itself is not a sighting.
                last_seen: status.last_seen.clone(),
                ..Default::default()
            }),
        });
    }
    writes
}

/// Why a write to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("listing the BlockDevices of node {node}: {source}")]
    List { node: String, source: kube::Error },
    #[error("applying the spec of BlockDevice {name}: {source}")]
    ApplySpec { name: String, source: kube::Error },
    #[error("applying the status of BlockDevice {name}: {source}")]
    ApplyStatus { name: String, source: kube::Error },
}

/// The API side of one node's inventory.
#[derive(Clone)]
pub struct Inventory {
    api: Api<BlockDevice>,
    node: String,
    /// The Node object, so a node's BlockDevices are deleted with it.
    owner: Option<OwnerReference>,
}

impl Inventory {
    pub fn new(client: Client, node: &str, owner: Option<OwnerReference>) -> Self {
        Self {
            api: Api::all(client),
            node: node.to_string(),
            owner,
        }
    }

    /// The node this inventory is of.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The node's objects as the API server has them now.
    pub async fn existing(&self) -> Result<Vec<BlockDevice>, InventoryError> {
        let selector = format!("{NODE_LABEL}={}", self.node);
        self.api
            .list(&ListParams::default().labels(&selector))
            .await
            .map(|list| list.items)
            .map_err(|source| InventoryError::List {
                node: self.node.clone(),
                source,
            })
    }

    /// Sets (`Some(message)`) or removes (`None`) the `Degraded` condition a failing
    /// disk actor gets, under the supervisor's own field manager: the inventory's and
    /// the pools' writes never touch it, and applying no condition removes it.
    pub async fn set_degraded(
        &self,
        device: &str,
        message: Option<&str>,
    ) -> Result<(), kube::Error> {
        let conditions: Vec<Condition> = message
            .map(|message| Condition {
                type_: DEGRADED.into(),
                status: "True".into(),
                reason: "ActorFailing".into(),
                message: message.to_string(),
                last_transition_time: Time(Timestamp::now()),
                observed_generation: None,
            })
            .into_iter()
            .collect();
        apply_status(
            &self.api,
            device,
            &supervisor_manager(&self.node),
            &json!({ "conditions": conditions }),
        )
        .await
        .map(drop)
    }

    /// Makes one write of the plan to the object, whose `metadata.generation` was
    /// `generation` when it was planned (`status.observedGeneration` says so).
    pub async fn apply(
        &self,
        write: &Write,
        generation: Option<i64>,
    ) -> Result<(), InventoryError> {
        // Force: the agent is the only writer of these fields, so a conflict can only
        // be a leftover from an older manager name, which the agent should take over.
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut generation = generation;
        if let Some(spec) = &write.spec {
            let object = BlockDevice {
                metadata: ObjectMeta {
                    name: Some(write.name.clone()),
                    labels: Some([(NODE_LABEL.to_string(), self.node.clone())].into()),
                    owner_references: self.owner.clone().map(|owner| vec![owner]),
                    ..ObjectMeta::default()
                },
                spec: spec.clone(),
                // Not sent: the spec and the status are applied apart.
                status: None,
            };
            let applied = self
                .api
                .patch(&write.name, &params, &Patch::Apply(&object))
                .await
                .map_err(|source| InventoryError::ApplySpec {
                    name: write.name.clone(),
                    source,
                })?;
            generation = applied.metadata.generation;
        }
        if let Some(status) = &write.status {
            let status = BlockDeviceStatus {
                observed_generation: generation,
                ..status.clone()
            };
            apply_status(&self.api, &write.name, FIELD_MANAGER, &status)
                .await
                .map_err(|source| InventoryError::ApplyStatus {
                    name: write.name.clone(),
                    source,
                })?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
pub(crate) mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    const NODE: &str = "node-a";

    fn now() -> Timestamp {
        "2026-11-30T12:00:00Z".parse().unwrap()
    }

    /// The spec of a loop disk at `path`.
    pub(crate) fn spec(path: &str) -> BlockDeviceSpec {
        BlockDeviceSpec {
            node_name: NODE.into(),
            path: path.into(),
            size_bytes: 1 << 30,
            model: None,
            serial: None,
            wwn: None,
            identity: "loopfile:/d@1".into(),
            rotational: false,
            signatures: vec![],
        }
    }

    fn observed(name: &str, path: &str, refusal: Option<&str>) -> Observed {
        Observed {
            name: name.into(),
            spec: spec(path),
            refusal: refusal.map(Into::into),
            facts: Default::default(),
        }
    }

    /// The object as the API server holds it after `write` was applied to `before`.
    fn applied(before: Option<BlockDevice>, write: &Write) -> BlockDevice {
        let mut object = before.unwrap_or_else(|| {
            let mut object = BlockDevice::new(&write.name, write.spec.clone().unwrap());
            object.metadata.generation = Some(0);
            object
        });
        if let Some(spec) = &write.spec {
            if object.spec != *spec || object.metadata.generation == Some(0) {
                object.metadata.generation = Some(object.metadata.generation.unwrap_or(0) + 1);
            }
            object.spec = spec.clone();
            object.metadata.labels = Some([(NODE_LABEL.to_string(), NODE.to_string())].into());
        }
        if let Some(status) = &write.status {
            let old = object.status.clone().unwrap_or_default();
            object.status = Some(BlockDeviceStatus {
                observed_generation: object.metadata.generation,
                state: status.state.or(old.state),
                message: if status.state.is_some() {
                    status.message.clone()
                } else {
                    old.message
                },
                last_seen: status.last_seen.clone(),
                pool: old.pool,
                conditions: old.conditions,
            });
        }
        object
    }

    fn object(name: &str, path: &str, state: BlockDeviceState, last_seen: &str) -> BlockDevice {
        BlockDevice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                generation: Some(1),
                labels: Some([(NODE_LABEL.to_string(), NODE.to_string())].into()),
                ..Default::default()
            },
            spec: spec(path),
            status: Some(BlockDeviceStatus {
                observed_generation: Some(1),
                state: Some(state),
                last_seen: Some(last_seen.into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_new_device_is_created_unclaimed_with_its_refusal_and_then_nothing_changes() {
        let seen = [observed("d1", "/dev/loop0", Some("has an ext4 filesystem"))];
        let writes = plan(&seen, &[], NODE, now());
        assert_eq!(writes.len(), 1);
        let status = writes[0].status.clone().unwrap();
        assert_eq!(writes[0].spec, Some(spec("/dev/loop0")));
        assert_eq!(status.state, Some(BlockDeviceState::Unclaimed));
        assert_eq!(status.message.as_deref(), Some("has an ext4 filesystem"));
        assert_eq!(status.last_seen.as_deref(), Some("2026-11-30T12:00:00Z"));

        let object = applied(None, &writes[0]);
        assert_eq!(plan(&seen, &[object], NODE, now()), []);
    }

    #[test]
    fn a_changed_path_or_a_missing_label_rewrites_the_spec() {
        let current = object(
            "d1",
            "/dev/loop0",
            BlockDeviceState::Unclaimed,
            "2026-11-30T11:59:00Z",
        );
        let writes = plan(
            &[observed("d1", "/dev/loop5", None)],
            std::slice::from_ref(&current),
            NODE,
            now(),
        );
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].spec, Some(spec("/dev/loop5")));
        assert!(
            writes[0].status.is_some(),
            "a new generation needs a new observedGeneration"
        );

        let mut unlabelled = current;
        unlabelled.metadata.labels = None;
        let writes = plan(
            &[observed("d1", "/dev/loop0", None)],
            &[unlabelled],
            NODE,
            now(),
        );
        assert_eq!(writes[0].spec, Some(spec("/dev/loop0")));
    }

    #[test]
    fn last_seen_is_refreshed_only_when_stale_or_unreadable() {
        let seen = [observed("d1", "/dev/loop0", None)];
        let fresh = object(
            "d1",
            "/dev/loop0",
            BlockDeviceState::Unclaimed,
            "2026-11-30T11:55:00Z",
        );
        assert_eq!(plan(&seen, &[fresh], NODE, now()), []);

        for last_seen in ["2026-11-30T11:50:00Z", "yesterday"] {
            let old = object("d1", "/dev/loop0", BlockDeviceState::Unclaimed, last_seen);
            let writes = plan(&seen, &[old], NODE, now());
            assert_eq!(writes.len(), 1, "{last_seen}");
            assert_eq!(writes[0].spec, None);
            assert_eq!(
                writes[0].status.as_ref().unwrap().last_seen.as_deref(),
                Some("2026-11-30T12:00:00Z")
            );
        }
    }

    #[test]
    fn a_changed_refusal_or_generation_rewrites_the_status() {
        let current = object(
            "d1",
            "/dev/loop0",
            BlockDeviceState::Unclaimed,
            "2026-11-30T11:59:00Z",
        );
        let writes = plan(
            &[observed(
                "d1",
                "/dev/loop0",
                Some("has a partition table (gpt)"),
            )],
            std::slice::from_ref(&current),
            NODE,
            now(),
        );
        assert_eq!(
            writes[0].status.as_ref().unwrap().message.as_deref(),
            Some("has a partition table (gpt)")
        );

        let mut behind = current;
        behind.metadata.generation = Some(2);
        let writes = plan(
            &[observed("d1", "/dev/loop0", None)],
            &[behind],
            NODE,
            now(),
        );
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].spec, None);
    }

    #[test]
    fn a_vanished_device_becomes_missing_once_keeping_when_it_was_last_seen() {
        let current = object(
            "d1",
            "/dev/loop0",
            BlockDeviceState::Unclaimed,
            "2026-11-30T11:59:00Z",
        );
        let writes = plan(&[], std::slice::from_ref(&current), NODE, now());
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].spec, None);
        let status = writes[0].status.clone().unwrap();
        assert_eq!(status.state, Some(BlockDeviceState::Missing));
        assert_eq!(status.last_seen.as_deref(), Some("2026-11-30T11:59:00Z"));
        assert!(status.message.unwrap().contains("node-a"));

        let missing = applied(Some(current), &writes[0]);
        assert_eq!(plan(&[], std::slice::from_ref(&missing), NODE, now()), []);

        // It returns, at another path: the same object, Unclaimed again.
        let writes = plan(
            &[observed("d1", "/dev/loop7", None)],
            &[missing],
            NODE,
            now(),
        );
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].name, "d1");
        assert_eq!(
            writes[0].status.as_ref().unwrap().state,
            Some(BlockDeviceState::Unclaimed)
        );
    }

    #[test]
    fn a_vanished_device_never_seen_gets_a_message_without_a_time() {
        let mut current = object("d1", "/dev/loop0", BlockDeviceState::Unclaimed, "x");
        current.status = None;
        let writes = plan(&[], &[current], NODE, now());
        let message = writes[0].status.as_ref().unwrap().message.clone().unwrap();
        assert!(!message.contains("last seen"), "{message}");
    }

    #[test]
    fn a_pool_owned_state_is_left_alone_while_present_but_missing_wins() {
        for state in [
            BlockDeviceState::Claimed,
            BlockDeviceState::InUse,
            BlockDeviceState::Failed,
        ] {
            let mut current = object("d1", "/dev/loop0", state, "2026-11-30T11:00:00Z");
            current.status.as_mut().unwrap().message = Some("pool says".into());
            let writes = plan(
                &[observed("d1", "/dev/loop0", Some("has a btrfs filesystem"))],
                std::slice::from_ref(&current),
                NODE,
                now(),
            );
            let status = writes[0].status.clone().unwrap();
            assert_eq!((status.state, status.message), (None, None), "{state:?}");
            let after = applied(Some(current.clone()), &writes[0]);
            assert_eq!(after.status.as_ref().unwrap().state, Some(state));
            assert_eq!(
                after.status.as_ref().unwrap().message.as_deref(),
                Some("pool says")
            );

            let writes = plan(&[], &[current], NODE, now());
            assert_eq!(
                writes[0].status.as_ref().unwrap().state,
                Some(BlockDeviceState::Missing)
            );
        }
    }
}
