//! Pools: the shell that makes this node's part of every matching `StoragePool` real.
//!
//! After each look at the disks it reads the pools, the Node's labels and the node's
//! `BlockDevice` objects, asks `claim` what each pool takes, asks `pool` what to do,
//! runs the commands (`wipefs`, `mkfs.btrfs`, `mount`, `btrfs …`) and writes back:
//! the claimed disks' `BlockDevice` status (`Claimed`/`InUse` and `status.pool`), this
//! node's entry of the pool's `status.nodes`, and the pool's StorageClass.
//!
//! Ownership of fields, so that writers never undo each other: the inventory owns
//! `Unclaimed`/`Missing`; this module sets `Claimed`/`InUse`, `status.pool` and the
//! message with its own field manager (`castellan-agent-pools/<node>`), forcing, and
//! only for disks that are attached (a missing disk stays `Missing`). Each node applies
//! only its own `status.nodes` entry under `castellan-agent/<node>`; the list-map keyed
//! by node keeps the entries of different nodes apart. Totals, phase and conditions
//! (`totals`) are applied by whichever agent wrote last, under one field manager,
//! guarded by the resource version they were computed from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use castellan_crds::block_device::{BlockDevice, BlockDeviceState, BlockDeviceStatus};
use castellan_crds::storage_pool::StoragePool;
use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Reporter};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use super::claim::{self, Candidate};
use super::deletion;
use super::health;
use super::lifecycle::{OnStep, PassEnd, Settled, StepKind};
use super::machine::{self as pool, Blocked, Filesystem, Outcome, Repair, Step};
use super::replace::{Ended, Progress, Replacements};
use super::scrub::{self, Scrubs};
use super::storage_class;
use super::totals;
use crate::agent::btrfs::{self, Show, Usage};
use crate::agent::children::{Next, StorageLock};
use crate::agent::disk::observe::{Observed, Sources, still_the_disk};
use crate::agent::disk::probe::SignatureKind;
use crate::agent::host::{self, run};
use crate::agent::reported::Reported;
use crate::cadence::Cadence;
use crate::events::Recorder;
use crate::kube_ops::{
    self, NODE_LABEL, POOL_FINALIZER, POOL_LABEL, apply_status, node_entry_manager, status_object,
};
use castellan_crds::storage_pool::PoolScrubStatus;

/// Field manager of the StorageClass writes (the same on every node: same content).
pub const CLASS_FIELD_MANAGER: &str = "castellan-agent";
/// Field manager of the pool-wide totals and conditions (one for all nodes: every
/// write is guarded by the resource version it was computed from).
pub const TOTALS_FIELD_MANAGER: &str = "castellan-agent-totals";

/// Why a pass over the pools failed before it could judge them.
#[derive(Debug, thiserror::Error)]
pub enum PoolsError {
    #[error("listing StoragePools: {0}")]
    ListPools(kube::Error),
    #[error("reading StoragePool {name}: {source}")]
    ReadPool { name: String, source: kube::Error },
    /// Reported in the node's entry; an error as well, so that the pool's actor backs
    /// off and tries again rather than waiting for the next look.
    #[error("building pool {pool}: {message}")]
    Steps { pool: String, message: String },
    #[error("reading Node {node}: {source}")]
    ReadNode { node: String, source: kube::Error },
    #[error("listing the BlockDevices of node {node}: {source}")]
    ListDevices { node: String, source: kube::Error },
    #[error("applying {what} of {name}: {source}")]
    Apply {
        what: &'static str,
        name: String,
        source: kube::Error,
    },
}

/// A Node's labels.
pub type Labels = BTreeMap<String, String>;

/// How often a running replacement or scrub is looked at.
const BACKGROUND_LOOK: Duration = Duration::from_secs(2);

/// Field manager of the `Deleting` condition (the same content from every node).
pub const DELETION_FIELD_MANAGER: &str = "castellan-agent-deletion";
/// The condition a pool being deleted carries.
pub const DELETING_CONDITION: &str = "Deleting";

/// The API side and the command runner of the node's pools.
pub struct Pools {
    client: Client,
    node: String,
    root: PathBuf,
    recorder: Recorder,
    /// Refusals already reported, one Event per reason.
    reported: Reported,
    /// How long a member may be missing before it counts as failed.
    missing_grace: Duration,
    /// When this agent first saw each missing member missing (after a restart it
    /// counts again from its first look: later, never earlier).
    missing_since: Mutex<BTreeMap<(String, String), Instant>>,
    /// Failed members being replaced.
    replacements: Arc<Replacements>,
    /// Scrubs running.
    scrubs: Scrubs,
    /// The node's storage lock (see `pass`).
    storage: StorageLock,
}

impl Pools {
    pub fn new(
        client: Client,
        node: &str,
        root: &Path,
        missing_grace: Duration,
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
            root: root.to_path_buf(),
            reported: Reported::default(),
            missing_grace,
            missing_since: Mutex::new(BTreeMap::new()),
            replacements: Arc::default(),
            scrubs: Scrubs::default(),
            storage,
        }
    }

    /// The pools and this Node's labels, read for a look: the node's actor keeps one
    /// `PoolMemberActor` per pool listed here.
    pub async fn list(&self) -> Result<(Vec<StoragePool>, Labels), PoolsError> {
        let pools = Api::<StoragePool>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(PoolsError::ListPools)?;
        if pools.items.is_empty() {
            return Ok((Vec::new(), Labels::new()));
        }
        let labels = Api::<Node>::all(self.client.clone())
            .get_opt(&self.node)
            .await
            .map_err(|source| PoolsError::ReadNode {
                node: self.node.clone(),
                source,
            })?
            .map(|node| node.labels().clone())
            .unwrap_or_default();
        Ok((pools.items, labels))
    }

    /// One pass over one pool with the devices of the latest look: build, repair and
    /// report this node's part of it, release it when the pool is being deleted, or
    /// remove this node's entry when the pool no longer selects the node.
    ///
    /// Passes hold the node's storage lock throughout: the claims of two pools, and the
    /// inventory's writes, must each see the others' results.
    pub async fn pass(
        &self,
        pool: &StoragePool,
        labels: &Labels,
        observed: &[Observed],
        on_step: OnStep,
    ) -> Result<PassEnd, PoolsError> {
        let _storage = self.storage.lock().await;
        if pool.metadata.deletion_timestamp.is_some() {
            return self.delete(pool, observed, &on_step).await;
        }
        let settled = |settled| PassEnd {
            settled,
            next: Next::default(),
        };
        match claim::selects_node(pool.spec.node_selector.as_ref(), labels) {
            Ok(false) => {
                self.leave(pool).await?;
                return Ok(settled(Settled::Left));
            }
            Ok(true) => {}
            Err(error) => {
                let status = failed_status(&self.node, format!("the pool's spec: {error}"));
                self.apply_node_status(pool, &status).await?;
                return Ok(settled(Settled::Blocked));
            }
        }
        let devices = self.devices().await?;
        let (look_in, settled) = self
            .reconcile_pool(pool, observed, &devices, on_step)
            .await?;
        Ok(PassEnd {
            settled,
            next: Next {
                look_in,
                ..Next::default()
            },
        })
    }

    /// Marks this node's entry of `pool` Failed with `message` (the pool's actor keeps
    /// failing; its next good pass overwrites this).
    pub async fn report_failing(&self, pool: &str, message: String) -> Result<(), PoolsError> {
        let pool = Api::<StoragePool>::all(self.client.clone())
            .get(pool)
            .await
            .map_err(|source| PoolsError::ReadPool {
                name: pool.to_string(),
                source,
            })?;
        self.apply_node_status(&pool, &failed_status(&self.node, message))
            .await
    }

    /// This node's part of deleting `pool` (see `deletion`): disks released → look at
    /// them again; a step failed (a disk still busy) → try again soon.
    async fn delete(
        &self,
        pool: &StoragePool,
        observed: &[Observed],
        on_step: &OnStep,
    ) -> Result<PassEnd, PoolsError> {
        let deleting = PassEnd {
            settled: Settled::Deleting,
            next: Next::default(),
        };
        let retry_soon = PassEnd {
            next: Next {
                retry_soon: true,
                ..Next::default()
            },
            ..deleting
        };
        let name = pool.name_any();
        let class = pool.spec.storage_class.name.clone();
        let volumes = self.pool_volumes(&name).await?;
        let mount_path = btrfs::mount_path(&self.root, &self.node, &name);
        let mounted = {
            let path = mount_path.clone();
            blocking(true, move || host::is_mount_point(&path)).await
        };
        let label = btrfs::label(&name);
        let members: Vec<deletion::Member> = self
            .devices()
            .await?
            .iter()
            .filter(|device| {
                device
                    .status
                    .as_ref()
                    .and_then(|status| status.pool.as_deref())
                    == Some(name.as_str())
            })
            .map(|device| {
                let seen = observed.iter().find(|o| o.name == device.name_any());
                deletion::Member {
                    block_device: device.name_any(),
                    path: seen.map_or(device.spec.path.clone(), |seen| seen.spec.path.clone()),
                    attached: seen.is_some(),
                    carries_label: seen.is_some_and(|seen| {
                        seen.facts.signatures.iter().any(|signature| {
                            signature.name == "btrfs"
                                && signature.label.as_deref() == Some(label.as_str())
                        })
                    }),
                }
            })
            .collect();
        let listed = pool
            .status
            .as_ref()
            .is_some_and(|status| status.nodes.iter().any(|entry| entry.node == self.node));
        let steps = match deletion::decide(
            &name,
            &class,
            &volumes,
            mounted.then(|| mount_path.clone()),
            &members,
            listed,
        ) {
            deletion::Deletion::Blocked(message) => {
                self.apply_deleting(pool, "VolumesExist", &message).await?;
                if self.first_report(&pool.uid().unwrap_or_default(), &message) {
                    tracing::warn!(node = %self.node, pool = %name, %message, "pool deletion blocked");
                    self.event(
                        pool,
                        EventType::Warning,
                        ("DeletionBlocked", "Delete"),
                        message,
                    )
                    .await;
                }
                return Ok(deleting);
            }
            deletion::Deletion::Release(steps) => steps,
        };
        if !steps.is_empty() {
            on_step(StepKind::Release);
            tracing::info!(node = %self.node, pool = %name, ?steps, "releasing the deleted pool");
            self.apply_deleting(
                pool,
                "Releasing",
                &format!("pool {name} is being released on every node"),
            )
            .await?;
        }
        for step in &steps {
            match step {
                deletion::Step::Unmount(path) => {
                    let path = path.clone();
                    let unmounted = blocking(Err("unmounting panicked".to_string()), move || {
                        run("umount", &[&path.to_string_lossy()]).map(drop)
                    })
                    .await;
                    if let Err(message) = unmounted {
                        // Busy (a pod still uses a volume): tried again soon.
                        tracing::error!(node = %self.node, pool = %name, %message, "unmounting the deleted pool failed");
                        return Ok(retry_soon);
                    }
                }
                deletion::Step::Wipe { path, block_device } => {
                    let (path, block_device, node) =
                        (path.clone(), block_device.clone(), self.node.clone());
                    let wiped = blocking(Err("wiping panicked".to_string()), move || {
                        still_the_disk(&node, &path, &block_device, &Sources::default())?;
                        // Forgotten first: the kernel must not keep a stale btrfs member.
                        let _ = run("btrfs", &["device", "scan", "--forget", &path]);
                        run("wipefs", &["--all", &path]).map(drop)
                    })
                    .await;
                    if let Err(message) = wiped {
                        tracing::error!(node = %self.node, pool = %name, %message, "wiping a released disk failed");
                        return Ok(retry_soon);
                    }
                }
                deletion::Step::Release(device) => self.release_device(device).await?,
                deletion::Step::Leave => self.leave(pool).await?,
            }
        }
        let fresh = Api::<StoragePool>::all(self.client.clone())
            .get_opt(&name)
            .await
            .map_err(|source| PoolsError::Apply {
                what: "the finalizer (reading)",
                name: format!("StoragePool {name}"),
                source,
            })?;
        if let Some(fresh) = fresh {
            let entries = fresh.status.as_ref().map_or(0, |status| status.nodes.len());
            if deletion::finalizer_removable(entries, volumes.len())
                && fresh.finalizers().iter().any(|f| f == POOL_FINALIZER)
            {
                self.set_finalizer(&fresh, false).await?;
                tracing::info!(node = %self.node, pool = %name, "pool released on every node; finalizer removed");
            }
        }
        // Every step done: nothing of the pool is left on this node.
        Ok(PassEnd {
            settled: Settled::Released,
            next: Next {
                look_again: !steps.is_empty(),
                ..Next::default()
            },
        })
    }

    async fn pool_volumes(&self, pool: &str) -> Result<Vec<String>, PoolsError> {
        Api::<PersistentVolume>::all(self.client.clone())
            .list_metadata(&ListParams::default().labels(&format!("{POOL_LABEL}={pool}")))
            .await
            .map(|list| list.items.iter().map(|pv| pv.name_any()).collect())
            .map_err(|source| PoolsError::Apply {
                what: "the volumes (listing)",
                name: format!("StoragePool {pool}"),
                source,
            })
    }

    /// Adds or removes the pool's finalizer, guarded by the resource version read.
    async fn set_finalizer(&self, pool: &StoragePool, present: bool) -> Result<(), PoolsError> {
        let name = pool.name_any();
        let pools = Api::<StoragePool>::all(self.client.clone());
        match kube_ops::set_finalizer(&pools, pool, POOL_FINALIZER, present).await {
            Ok(_) => Ok(()),
            // Another node removed it and the pool is gone: done.
            Err(kube::Error::Api(status)) if status.code == 404 && !present => Ok(()),
            // Another node changed the pool meanwhile: the next pass reads it again.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                tracing::info!(node = %self.node, pool = %name, "the pool changed while setting its finalizer; retrying on the next pass");
                Ok(())
            }
            Err(source) => Err(PoolsError::Apply {
                what: "the finalizer",
                name: format!("StoragePool {name}"),
                source,
            }),
        }
    }

    /// The pool-wide `Deleting` condition (same content from every node, one manager).
    async fn apply_deleting(
        &self,
        pool: &StoragePool,
        reason: &str,
        message: &str,
    ) -> Result<(), PoolsError> {
        let name = pool.name_any();
        let existing = pool.status.as_ref().and_then(|status| {
            status
                .conditions
                .iter()
                .find(|c| c.type_ == DELETING_CONDITION)
        });
        if existing.is_some_and(|c| c.reason == reason && c.message == message) {
            return Ok(());
        }
        let since = existing.filter(|c| c.status == "True").map_or_else(
            || Timestamp::now().to_string(),
            |c| c.last_transition_time.0.to_string(),
        );
        let status = json!({ "conditions": [{
            "type": DELETING_CONDITION,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "observedGeneration": pool.metadata.generation,
        }]});
        apply_status(
            &Api::<StoragePool>::all(self.client.clone()),
            &name,
            DELETION_FIELD_MANAGER,
            &status,
        )
        .await
        .map(drop)
        .map_err(|source| PoolsError::Apply {
            what: "the Deleting condition",
            name: format!("StoragePool {name}"),
            source,
        })
    }

    /// Gives a released disk back to the inventory: applying an empty status under the
    /// pool pass's field manager drops `state`, `pool` and `message`, and the
    /// inventory's next look writes `Unclaimed` with what it sees now.
    async fn release_device(&self, device: &str) -> Result<(), PoolsError> {
        let manager = format!("castellan-agent-pools/{}", self.node);
        apply_status(
            &Api::<BlockDevice>::all(self.client.clone()),
            device,
            &manager,
            &json!({}),
        )
        .await
        .map(drop)
        .map_err(|source| PoolsError::Apply {
            what: "the status (releasing)",
            name: format!("BlockDevice {device}"),
            source,
        })
    }

    /// Whether `message` is new for this object (and remembers it).
    fn first_report(&self, uid: &str, message: &str) -> bool {
        self.reported.first(uid, message)
    }

    async fn event(
        &self,
        pool: &StoragePool,
        kind: EventType,
        (reason, action): (&str, &str),
        note: String,
    ) {
        let event = Event {
            type_: kind,
            reason: reason.to_string(),
            note: Some(crate::events::note(&note)),
            action: action.to_string(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &pool.object_ref(&())).await {
            tracing::warn!(node = %self.node, pool = %pool.name_any(), %error, "publishing an Event failed");
        }
    }

    async fn devices(&self) -> Result<Vec<BlockDevice>, PoolsError> {
        Api::<BlockDevice>::all(self.client.clone())
            .list(&ListParams::default().labels(&format!("{NODE_LABEL}={}", self.node)))
            .await
            .map(|list| list.items)
            .map_err(|source| PoolsError::ListDevices {
                node: self.node.clone(),
                source,
            })
    }

    async fn reconcile_pool(
        &self,
        pool: &StoragePool,
        observed: &[Observed],
        devices: &[BlockDevice],
        on_step: OnStep,
    ) -> Result<(Option<Duration>, Settled), PoolsError> {
        let name = pool.name_any();
        if !pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
            // Before anything is built: a pool deleted later must be released first.
            self.set_finalizer(pool, true).await?;
        }
        let label = btrfs::label(&name);
        let candidates: Vec<Candidate<'_>> = devices
            .iter()
            .map(|device| {
                let seen = observed.iter().find(|o| o.name == device.name_any());
                let status = device.status.as_ref();
                // The filesystem is the truth about membership (see `pool`).
                let carries_label = seen.is_some_and(|seen| {
                    seen.facts.signatures.iter().any(|signature| {
                        signature.kind == SignatureKind::Filesystem
                            && signature.name == "btrfs"
                            && signature.label.as_deref() == Some(label.as_str())
                    })
                });
                let pool_of = claim::membership(
                    &name,
                    seen.is_some(),
                    carries_label,
                    status.and_then(|status| status.pool.as_deref()),
                );
                Candidate {
                    block_device: device.metadata.name.as_deref().unwrap_or_default(),
                    path: seen.map_or(device.spec.path.as_str(), |seen| seen.spec.path.as_str()),
                    size_bytes: u64::try_from(device.spec.size_bytes).unwrap_or(0),
                    state: if seen.is_some() {
                        status.and_then(|status| status.state)
                    } else {
                        Some(BlockDeviceState::Missing)
                    },
                    pool: pool_of,
                    facts: seen.map(|seen| seen.facts.borrow()).unwrap_or_default(),
                }
            })
            .collect();
        let decision = match claim::decide(&name, &pool.spec, &self.node, &candidates) {
            Ok(decision) => decision,
            Err(error) => {
                let status = failed_status(&self.node, format!("the pool's spec: {error}"));
                return self
                    .apply_node_status(pool, &status)
                    .await
                    .map(|()| (None, Settled::Blocked));
            }
        };
        let missing_paths: Vec<(String, String)> = decision
            .missing_members
            .iter()
            .filter_map(|member| {
                devices
                    .iter()
                    .find(|device| device.name_any() == *member)
                    .map(|device| (member.clone(), device.spec.path.clone()))
            })
            .collect();
        let (missing_failed, look_in) = self.missing_for_long(&name, &decision.missing_members);

        let mount_path = btrfs::mount_path(&self.root, &self.node, &name);
        let (filesystem, failing) = {
            let mount_path = mount_path.clone();
            let members = decision.claims.iter().any(|claim| claim.member);
            // Unmounted on a panic: never build over what might be there.
            blocking((Filesystem::Unmounted, Vec::new()), move || {
                let filesystem = inspect(&mount_path, members);
                let failing = match &filesystem {
                    Filesystem::Mounted(_) => failing_members(&mount_path),
                    _ => Vec::new(),
                };
                (filesystem, failing)
            })
            .await
        };
        let mounted = match &filesystem {
            Filesystem::Mounted(show) => Some(show.clone()),
            _ => None,
        };
        let progress = {
            let (replacements, pool, path) =
                (self.replacements.clone(), name.clone(), mount_path.clone());
            let show = mounted.clone();
            blocking(Progress::None, move || {
                replacements.progress(&pool, &path, show.as_ref())
            })
            .await
        };
        let mut replacement = None;
        let (mut replaced, mut ended) = (false, false);
        match progress {
            Progress::None => {}
            Progress::Running(status) => replacement = Some(status),
            Progress::Ended(result) => {
                (replaced, ended) = (result.result.is_ok(), true);
                self.replacement_ended(pool, observed, &mount_path, result, &on_step)
                    .await?;
            }
        }
        let missing_sizes: Vec<(String, u64)> = missing_failed
            .iter()
            .filter_map(|member| {
                let device = devices.iter().find(|device| device.name_any() == *member)?;
                Some((
                    member.clone(),
                    u64::try_from(device.spec.size_bytes).unwrap_or(0),
                ))
            })
            .collect();
        let replace_error = self.replacements.recent_failure(&name);
        let repair = Repair {
            failed: mounted
                .as_ref()
                .map(|show| pool::failed_members(show, &failing, &missing_sizes))
                .unwrap_or_default(),
            hold: replace_error.is_some(),
        };
        let planned = pool::plan(&name, pool.spec.layout, &decision, &filesystem, &repair);
        let current: Vec<pool::DeviceState<'_>> = devices
            .iter()
            .map(|device| {
                let status = device.status.as_ref();
                (
                    device.metadata.name.as_deref().unwrap_or_default(),
                    status.and_then(|status| status.state),
                    status.and_then(|status| status.pool.as_deref()),
                )
            })
            .collect();
        let mut error = None;
        if let Ok(steps) = &planned
            && !steps.is_empty()
        {
            for device in pool::to_mark_claimed(&name, &decision, steps, &current) {
                self.apply_device(
                    &device,
                    BlockDeviceState::Claimed,
                    Some(&name),
                    format!("claimed by pool {name}; joining its filesystem"),
                )
                .await?;
            }
            tracing::info!(node = %self.node, pool = %name, ?steps, "building the pool");
            let run = Run {
                node: self.node.clone(),
                pool: name.clone(),
                mount_path: mount_path.clone(),
                replacements: self.replacements.clone(),
                on_step,
            };
            let to_run = steps.clone();
            match blocking(Err("the pool steps panicked".to_string()), move || {
                run.steps(&to_run)
            })
            .await
            {
                Ok(()) => {
                    if let Some(Step::Replace {
                        failed,
                        path,
                        block_device,
                    }) = steps.last()
                    {
                        let status = castellan_crds::storage_pool::PoolReplacement {
                            failed: format!("{} (devid {})", failed.name, failed.devid),
                            block_device: block_device.clone(),
                            path: path.clone(),
                            progress: None,
                        };
                        let note = format!(
                            "replacing {} by {path} ({block_device}) on node {}",
                            status.failed, self.node
                        );
                        self.event(pool, EventType::Normal, ("DiskReplacing", "Replace"), note)
                            .await;
                        replacement = Some(status);
                    }
                }
                Err(message) => {
                    tracing::error!(node = %self.node, pool = %name, %message, "a pool step failed");
                    error = Some(message);
                }
            }
        }
        let (show, usage, allocated_bytes, failing) = {
            let path = mount_path.clone();
            blocking((None, None, 0, Vec::new()), move || {
                current_filesystem(&path)
            })
            .await
        };
        for (path, errors) in &failing {
            // By what is attached at that path: a member whose superblock is among what
            // it lost carries no label any more and is no claim of the pool's.
            let Some(device) = observed
                .iter()
                .find(|device| &device.spec.path == path)
                .map(|device| device.name.as_str())
            else {
                continue;
            };
            let failed = current.iter().any(|(name, state, _)| {
                *name == device && *state == Some(BlockDeviceState::Failed)
            });
            if !failed {
                let message = format!(
                    "member of pool {name} with {errors} counted by btrfs (btrfs device stats); replace it"
                );
                tracing::warn!(node = %self.node, pool = %name, %device, %path, %errors, "a pool member is failing");
                self.apply_device(device, BlockDeviceState::Failed, Some(&name), message)
                    .await?;
            }
            let uid = pool.metadata.uid.clone().unwrap_or_default();
            let note = format!(
                "{path} ({device}) on node {} reports {errors}: pool {name} is degraded there",
                self.node
            );
            if self.first_report(&uid, &format!("failing {device}")) {
                self.event(pool, EventType::Warning, ("DiskFailing", "Monitor"), note)
                    .await;
            }
        }
        // The missing members a replacement made unnecessary: no longer the pool's.
        if replaced && show.as_ref().is_some_and(|show| show.missing() == 0) {
            for member in &missing_failed {
                self.release_device(member).await?;
            }
        }
        for device in pool::to_mark_in_use(&name, &decision, show.as_ref(), &failing, &current) {
            self.apply_device(
                &device,
                BlockDeviceState::InUse,
                Some(&name),
                format!("member of pool {name}, mounted at {}", mount_path.display()),
            )
            .await?;
        }
        // As the status will show them: the counters read after the steps.
        let failed_now = show
            .as_ref()
            .map(|show| pool::failed_members(show, &failing, &missing_sizes))
            .unwrap_or_default();
        let blocked = planned.err();
        let mut status = pool::node_status(
            &self.node,
            &decision,
            &missing_paths,
            &Outcome {
                show: show.as_ref(),
                usage: usage.as_ref(),
                blocked: blocked.as_ref(),
                error: error.as_deref(),
                allocated_bytes,
                failing: &failing,
                missing_failed: &missing_failed,
                failed: &failed_now,
                replacement: replacement.as_ref(),
                replace_error: replace_error.as_deref(),
            },
        );
        match &blocked {
            Some(Blocked::Shortfall(shortfall)) => {
                tracing::warn!(node = %self.node, pool = %name, %shortfall, "pool not built");
            }
            Some(Blocked::MembersMissing(members)) => {
                tracing::warn!(node = %self.node, pool = %name, ?members, "every member of the pool is missing; waiting for them");
            }
            None => {}
        }
        // A member whose superblock is among what it lost is no claim of the pool's
        // any more: name its BlockDevice by what is attached at its path.
        for disk in status
            .disks
            .iter_mut()
            .filter(|d| d.block_device.is_empty())
        {
            if let Some(seen) = observed.iter().find(|seen| seen.spec.path == disk.path) {
                disk.block_device = seen.name.clone();
            }
        }
        let mut scrub_look = None;
        if show.is_some() {
            // A scrub is useful on a healthy pool only: a failed member is replaced
            // first, and btrfs runs a scrub or a replacement, not both.
            let may_run =
                status.health.as_deref() == Some(pool::HEALTHY) && replacement.is_none() && !ended;
            let (scrub, look) = self.scrub(pool, &mount_path, may_run).await;
            status.scrub = scrub;
            scrub_look = look;
        }
        self.apply_node_status(pool, &status).await?;
        if let Err(error) =
            health::apply(&self.client, &self.recorder, (&self.node, &name), &status).await
        {
            tracing::warn!(node = %self.node, pool = %name, %error, "telling the volumes their pool's health failed");
        }
        self.apply_totals(&name).await?;
        self.apply_storage_class(pool).await?;
        // A replacement runs or just ended: look again for its progress, its end and
        // the status after it, which nothing else announces.
        let background = (replacement.is_some() || ended).then_some(BACKGROUND_LOOK);
        if let Some(message) = error {
            return Err(PoolsError::Steps {
                pool: name,
                message,
            });
        }
        let settled = Settled::of(
            blocked.is_some(),
            replacement.is_some(),
            status.health.as_deref(),
        );
        let look = [look_in, background, scrub_look]
            .into_iter()
            .flatten()
            .min();
        Ok((look, settled))
    }

    /// The node's scrub of `pool` (see `scrub`): its status, started when due and
    /// `may_run`, and when to look again (while it runs, or at the next slot).
    async fn scrub(
        &self,
        pool: &StoragePool,
        mount_path: &Path,
        may_run: bool,
    ) -> (Option<PoolScrubStatus>, Option<Duration>) {
        let name = pool.name_any();
        let mut status = pool
            .status
            .as_ref()
            .and_then(|status| status.nodes.iter().find(|entry| entry.node == self.node))
            .and_then(|entry| entry.scrub.clone())
            .unwrap_or_default();
        let now = Timestamp::now();
        let mut running = false;
        match self.scrubs.progress(&name) {
            scrub::Progress::Running => running = true,
            scrub::Progress::Ended(phase, result) => {
                let (kind, reason) = match phase {
                    scrub::SUCCEEDED => (EventType::Normal, "ScrubFinished"),
                    scrub::REPAIRED => (EventType::Warning, "ScrubRepaired"),
                    _ => (EventType::Warning, "ScrubFailed"),
                };
                let note = format!("scrub on node {}: {result}", self.node);
                tracing::info!(node = %self.node, pool = %name, phase, %result, "scrub ended");
                self.event(pool, kind, (reason, "Scrub"), note).await;
                status.phase = Some(phase.to_string());
                status.result = Some(result);
                status.last_finished = Some(now.to_string());
            }
            scrub::Progress::None => {
                if status.phase.as_deref() == Some(scrub::RUNNING) {
                    status.phase = Some(scrub::FAILED.to_string());
                    status.result = Some(
                        "interrupted: the agent restarted while it ran (the next slot scrubs again)"
                            .to_string(),
                    );
                }
            }
        }
        let spec = pool.spec.scrub.clone().unwrap_or_default();
        let schedule = spec
            .schedule
            .as_deref()
            .unwrap_or(castellan_crds::storage_pool::DEFAULT_SCRUB_SCHEDULE);
        let cadence = match Cadence::parse(schedule, None, now) {
            Ok(cadence) if !spec.suspend => cadence,
            Ok(_) => {
                status.next = Some("none: scrub.suspend is true".to_string());
                return (Some(status), running.then_some(BACKGROUND_LOOK));
            }
            Err(error) => {
                status.next = Some(format!("none: scrub.{error}"));
                return (Some(status), running.then_some(BACKGROUND_LOOK));
            }
        };
        let last = status
            .last_started
            .as_deref()
            .and_then(|time| time.parse::<Timestamp>().ok());
        let since = pool
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(now, |time| time.0);
        let plan = scrub::plan(&cadence, last, since, now, may_run && !running);
        if plan.start {
            status.last_started = Some(now.to_string());
            status.last_finished = None;
            match self.scrubs.start(&name, mount_path) {
                Ok(()) => {
                    running = true;
                    status.phase = Some(scrub::RUNNING.to_string());
                    status.result = None;
                    let note = format!("scrubbing pool {name} on node {}", self.node);
                    self.event(pool, EventType::Normal, ("ScrubStarted", "Scrub"), note)
                        .await;
                }
                Err(error) => {
                    status.phase = Some(scrub::FAILED.to_string());
                    status.result = Some(error);
                }
            }
        }
        status.next = plan.next.map(|next| next.to_string());
        let look = if running {
            Some(BACKGROUND_LOOK)
        } else {
            plan.next.and_then(|next| {
                let seconds = next.duration_since(now).as_secs_f64().max(1.0);
                Duration::try_from_secs_f64(seconds).ok()
            })
        };
        (Some(status), look)
    }

    /// Reports a replacement that ended. After a success the new disk is used whole
    /// and what a degraded mount wrote singly is mirrored again; the replaced disk, if
    /// still attached, stays `Failed` with what replaced it.
    async fn replacement_ended(
        &self,
        pool: &StoragePool,
        observed: &[Observed],
        mount_path: &Path,
        ended: Ended,
        on_step: &OnStep,
    ) -> Result<(), PoolsError> {
        let name = pool.name_any();
        let what = format!(
            "{} (devid {}) by {} ({})",
            ended.failed.name, ended.failed.devid, ended.path, ended.block_device
        );
        if let Err(message) = ended.result {
            tracing::error!(node = %self.node, pool = %name, %what, %message, "replacing a failed member failed");
            let note = format!("replacing {what} on node {} failed: {message}", self.node);
            self.event(
                pool,
                EventType::Warning,
                ("DiskReplaceFailed", "Replace"),
                note,
            )
            .await;
            return Ok(());
        }
        self.replacements.forget_failure(&name);
        tracing::info!(node = %self.node, pool = %name, %what, took_seconds = ended.took.as_secs_f64(), "replaced a failed member");
        let note = format!(
            "replaced {what} on node {} in {:.1} s",
            self.node,
            ended.took.as_secs_f64()
        );
        self.event(pool, EventType::Normal, ("DiskReplaced", "Replace"), note)
            .await;
        if let Some(old) = observed
            .iter()
            .find(|device| device.spec.path == ended.failed.name)
        {
            // No longer the pool's: detaching it, as the message invites, must not
            // make it a missing member.
            let message = format!(
                "failed member of pool {name}, replaced by {} ({}); it holds none of the pool's data and can be detached",
                ended.path, ended.block_device
            );
            self.apply_device(&old.name, BlockDeviceState::Failed, None, message)
                .await?;
        }
        let present = {
            let path = mount_path.to_path_buf();
            blocking(None, move || mounted_show(&path)).await
        }
        .map_or(0, |show| {
            show.devices.iter().filter(|d| d.path.is_some()).count()
        });
        let (data, metadata) = btrfs::profiles(pool.spec.layout, present);
        let run = Run {
            node: self.node.clone(),
            pool: name.clone(),
            mount_path: mount_path.to_path_buf(),
            replacements: self.replacements.clone(),
            on_step: on_step.clone(),
        };
        let steps = [
            Step::Resize {
                devid: ended.failed.devid,
            },
            Step::Balance { data, metadata },
        ];
        if let Err(message) = blocking(Err("the pool steps panicked".to_string()), move || {
            run.steps(&steps)
        })
        .await
        {
            tracing::warn!(node = %self.node, pool = %name, %message, "settling the pool after a replacement failed");
        }
        Ok(())
    }

    /// Of pool `pool`'s `missing` members (not attached), those missing for longer than
    /// the grace period, and when the next one's grace ends. A member back is forgotten.
    fn missing_for_long(&self, pool: &str, missing: &[String]) -> (Vec<String>, Option<Duration>) {
        let now = Instant::now();
        let Ok(mut since) = self.missing_since.lock() else {
            return (Vec::new(), None);
        };
        since.retain(|(of, member), _| of != pool || missing.contains(member));
        let mut expired = Vec::new();
        let mut next: Option<Duration> = None;
        for member in missing {
            let first = *since
                .entry((pool.to_string(), member.clone()))
                .or_insert(now);
            match pool::missing_verdict(now.duration_since(first), self.missing_grace) {
                Ok(()) => expired.push(member.clone()),
                Err(left) => next = Some(next.map_or(left, |next| next.min(left))),
            }
        }
        (expired, next)
    }

    /// Removes this node's entry from a pool that no longer selects it: applying no
    /// entry under the node's field manager releases the entry, and server-side apply
    /// deletes what no manager owns. The filesystem, its mount and the disks' `InUse`
    /// are kept: leaving a selector must never destroy data implicitly.
    async fn leave(&self, pool: &StoragePool) -> Result<(), PoolsError> {
        let listed = pool
            .status
            .as_ref()
            .is_some_and(|status| status.nodes.iter().any(|entry| entry.node == self.node));
        if !listed {
            return Ok(());
        }
        let name = pool.name_any();
        tracing::info!(node = %self.node, pool = %name, "the pool no longer selects this node; removing its status entry");
        apply_status(
            &Api::<StoragePool>::all(self.client.clone()),
            &name,
            &node_entry_manager(&self.node),
            &json!({}),
        )
        .await
        .map_err(|source| PoolsError::Apply {
            what: "this node's status (removing it)",
            name: format!("StoragePool {name}"),
            source,
        })?;
        self.apply_totals(&name).await
    }

    /// Recomputes the pool-wide status from every node's entry and applies it with the
    /// resource version read as a precondition: another node's entry written in
    /// between makes the write fail with a conflict, and it is computed again.
    async fn apply_totals(&self, name: &str) -> Result<(), PoolsError> {
        let api = Api::<StoragePool>::all(self.client.clone());
        let mut attempts = 0;
        loop {
            attempts += 1;
            let pool = api.get(name).await.map_err(|source| PoolsError::Apply {
                what: "the totals (reading)",
                name: format!("StoragePool {name}"),
                source,
            })?;
            let status = pool.status.clone().unwrap_or_default();
            let totals = totals::compute(
                &status.nodes,
                pool.metadata.generation,
                &status.conditions,
                Timestamp::now(),
            );
            let current = (
                status.capacity.as_deref(),
                status.allocated.as_deref(),
                status.free.as_deref(),
                status.ready_nodes,
                status.phase.as_deref(),
                // Only the conditions the totals own (not `Deleting`).
                &status
                    .conditions
                    .iter()
                    .filter(|c| c.type_ != DELETING_CONDITION)
                    .cloned()
                    .collect::<Vec<_>>(),
                status.observed_generation,
            );
            let wanted = (
                Some(totals.capacity.as_str()),
                Some(totals.allocated.as_str()),
                Some(totals.free.as_str()),
                Some(totals.ready_nodes),
                Some(totals.phase),
                &totals.conditions,
                pool.metadata.generation,
            );
            if current == wanted {
                return Ok(());
            }
            let mut object = status_object::<StoragePool>(
                name,
                &json!({
                    "observedGeneration": pool.metadata.generation,
                    "capacity": totals.capacity,
                    "allocated": totals.allocated,
                    "free": totals.free,
                    "readyNodes": totals.ready_nodes,
                    "phase": totals.phase,
                    "conditions": totals.conditions,
                }),
            );
            // The precondition: a conflict, not a lost entry, when another node wrote.
            object["metadata"]["resourceVersion"] = json!(pool.resource_version());
            let params = PatchParams::apply(TOTALS_FIELD_MANAGER).force();
            match api
                .patch_status(name, &params, &Patch::Apply(&object))
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(response)) if response.code == 409 && attempts < 5 => {
                    tracing::debug!(node = %self.node, pool = %name, "totals conflict; recomputing");
                }
                Err(source) => {
                    return Err(PoolsError::Apply {
                        what: "the totals",
                        name: format!("StoragePool {name}"),
                        source,
                    });
                }
            }
        }
    }

    async fn apply_device(
        &self,
        device: &str,
        state: BlockDeviceState,
        pool: Option<&str>,
        message: String,
    ) -> Result<(), PoolsError> {
        let status = BlockDeviceStatus {
            state: Some(state),
            pool: pool.map(str::to_string),
            message: Some(message),
            ..Default::default()
        };
        let manager = format!("castellan-agent-pools/{}", self.node);
        apply_status(
            &Api::<BlockDevice>::all(self.client.clone()),
            device,
            &manager,
            &status,
        )
        .await
        .map(drop)
        .map_err(|source| PoolsError::Apply {
            what: "the status",
            name: format!("BlockDevice {device}"),
            source,
        })
    }

    async fn apply_node_status(
        &self,
        pool: &StoragePool,
        status: &castellan_crds::storage_pool::PoolNodeStatus,
    ) -> Result<(), PoolsError> {
        let name = pool.name_any();
        apply_status(
            &Api::<StoragePool>::all(self.client.clone()),
            &name,
            &node_entry_manager(&self.node),
            &json!({ "nodes": [status] }),
        )
        .await
        .map(drop)
        .map_err(|source| PoolsError::Apply {
            what: "this node's status",
            name: format!("StoragePool {name}"),
            source,
        })
    }

    async fn apply_storage_class(&self, pool: &StoragePool) -> Result<(), PoolsError> {
        // A typed object serializes its own apiVersion and kind.
        let class = storage_class::build(pool);
        let name = pool.spec.storage_class.name.clone();
        Api::<StorageClass>::all(self.client.clone())
            .patch(
                &name,
                &PatchParams::apply(CLASS_FIELD_MANAGER).force(),
                &Patch::Apply(&class),
            )
            .await
            .map(drop)
            .map_err(|source| PoolsError::Apply {
                what: "the StorageClass",
                name: format!("{name} of StoragePool {}", pool.name_any()),
                source,
            })
    }
}

fn failed_status(node: &str, message: String) -> castellan_crds::storage_pool::PoolNodeStatus {
    castellan_crds::storage_pool::PoolNodeStatus {
        node: node.to_string(),
        health: Some(pool::FAILED.to_string()),
        message: Some(message),
        ..Default::default()
    }
}

/// Runs blocking work (commands, the mount table) off the async runtime. A panic
/// there is a bug: reported, and the work's `fallback` is used.
async fn blocking<T: Send + 'static>(fallback: T, work: impl FnOnce() -> T + Send + 'static) -> T {
    // In the caller's span: a pool's commands are part of its trace.
    let span = tracing::Span::current();
    match tokio::task::spawn_blocking(move || span.in_scope(work)).await {
        Ok(value) => value,
        Err(error) => {
            tracing::error!(%error, "pool work panicked");
            fallback
        }
    }
}

/// What the pool's filesystem looks like now.
fn inspect(mount_path: &Path, members: bool) -> Filesystem {
    if let Some(show) = mounted_show(mount_path) {
        return Filesystem::Mounted(show);
    }
    if members {
        Filesystem::Unmounted
    } else {
        Filesystem::Absent
    }
}

fn mounted_show(mount_path: &Path) -> Option<Show> {
    if !host::is_mount_point(mount_path) {
        return None;
    }
    let path = mount_path.to_string_lossy();
    run("btrfs", &["filesystem", "show", "--raw", &path])
        .ok()
        .and_then(|text| btrfs::parse_show(&text))
}

/// `btrfs filesystem show` and `usage` of the mounted pool, if mounted, and the bytes
/// allocated to its volumes (the sum of their quotas).
fn current_filesystem(mount_path: &Path) -> (Option<Show>, Option<Usage>, u64, Failing) {
    let Some(show) = mounted_show(mount_path) else {
        return (None, None, 0, Vec::new());
    };
    let path = mount_path.to_string_lossy();
    let usage = run("btrfs", &["filesystem", "usage", "-b", &path])
        .ok()
        .and_then(|text| btrfs::parse_usage(&text));
    let allocated = crate::agent::volume::shell::allocated_bytes(mount_path).unwrap_or(0);
    (Some(show), usage, allocated, failing_members(mount_path))
}

/// The members of the pool mounted at `mount_path` whose btrfs error counters are
/// above zero, by path.
type Failing = Vec<(String, btrfs::DeviceErrors)>;

/// `btrfs device stats` of a mounted pool, the members with errors only (none when the
/// command fails: a pool that cannot be read is reported by its other checks).
pub fn failing_members(mount_path: &Path) -> Failing {
    device_stats(mount_path)
        .into_iter()
        .filter(|(_, errors)| errors.any())
        .collect()
}

/// `btrfs device stats` of a mounted pool, every member by path (none when the
/// command fails).
pub fn device_stats(mount_path: &Path) -> BTreeMap<String, btrfs::DeviceErrors> {
    run("btrfs", &["device", "stats", &mount_path.to_string_lossy()])
        .map(|text| btrfs::parse_device_stats(&text))
        .unwrap_or_default()
}

/// What running one pool's steps on this node needs.
struct Run {
    node: String,
    pool: String,
    mount_path: PathBuf,
    replacements: Arc<Replacements>,
    /// Told each step as it starts.
    on_step: OnStep,
}

impl Run {
    /// Runs the steps in order, stopping at the first failure, whose error is returned.
    fn steps(&self, steps: &[Step]) -> Result<(), String> {
        let Run {
            node,
            pool,
            mount_path,
            replacements,
            on_step,
        } = self;
        let mount = mount_path.to_string_lossy().into_owned();
        for step in steps {
            let _span = tracing::info_span!("pool step", ?step).entered();
            on_step(StepKind::of(step));
            match step {
                Step::Wipe { path, block_device } => {
                    still_the_disk(node, path, block_device, &Sources::default())?;
                    run("wipefs", &["--all", path])?;
                }
                Step::Resize { devid } => {
                    run(
                        "btrfs",
                        &["filesystem", "resize", &format!("{devid}:max"), &mount],
                    )?;
                }
                Step::Replace {
                    failed,
                    path,
                    block_device,
                } => {
                    still_the_disk(node, path, block_device, &Sources::default())?;
                    replacements.start(pool, mount_path, failed, (path, block_device))?;
                }
                Step::Mkfs(args) => {
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    run("mkfs.btrfs", &args)?;
                }
                Step::Mount { devices, degraded } => {
                    host::create_dir_all(mount_path)
                        .map_err(|error| format!("creating mount point {mount}: {error}"))?;
                    let mut scan = vec!["device", "scan"];
                    scan.extend(devices.iter().map(String::as_str));
                    run("btrfs", &scan)?;
                    let first = devices
                        .first()
                        .ok_or_else(|| format!("mounting {mount}: no device to mount"))?;
                    let mut args = vec!["-t", "btrfs"];
                    if *degraded {
                        args.extend(["-o", "degraded"]);
                    }
                    args.extend([first.as_str(), mount.as_str()]);
                    run("mount", &args)?;
                }
                Step::EnableQuota => {
                    run("btrfs", &["quota", "enable", &mount])?;
                }
                Step::AddDevices(paths) => {
                    let mut args = vec!["device", "add"];
                    args.extend(paths.iter().map(String::as_str));
                    args.push(&mount);
                    run("btrfs", &args)?;
                }
                Step::Balance { data, metadata } => {
                    let data = format!("-dconvert={data},soft");
                    let metadata = format!("-mconvert={metadata},soft");
                    run(
                        "btrfs",
                        &["balance", "start", "--bg", &data, &metadata, &mount],
                    )?;
                }
            }
        }
        Ok(())
    }
}
