//! The `ClusterActor` machine's state, events and effects, and the small questions
//! every part of the machine asks of its state (who is primary, how many instances are
//! wanted). Types only, and pure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use castellan_crds::DatabaseCluster;
use serde_json::Value;

use super::failover::Quorum;
use crate::instance_api::{ArchiveConfig, LeaseGrant, PromoteRequest, RestoreRequest};
use crate::operator::replica::{Command, InstanceView};

/// Annotation naming the instances to fence: a JSON list of pod names, or `["*"]` for
/// all of them (the form CloudNativePG's `cnpg.io/fencedInstances` uses). A fenced
/// instance's server is stopped and stays stopped, its data untouched; a fenced primary
/// is not failed over.
pub const FENCED_ANNOTATION: &str = "castellan.io/fenced-instances";

/// Consecutive failed passes after which the cluster is `Degraded`.
pub const DEGRADED_AFTER: u32 = 3;

/// Longest wait between retries of a failing pass.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// How stale status' positions and lag may get (`instances[].lsn`, `lagBytes`,
/// `lagSeconds`, the slots' `retainedWalBytes`): they move with every write, the
/// primary's heartbeat included, and writing each move would make every idle cluster
/// a status write (and a watch event, and a pass) a second. The instances' metrics
/// are live.
pub const PROGRESS_REFRESH: Duration = Duration::from_secs(30);

/// One instance as the last pass found it.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub number: u32,
    /// `ip:port` of the instance API, once the pod has an address.
    pub address: Option<String>,
    pub primary: bool,
    /// Its node is cordoned (being drained).
    pub cordoned: bool,
    /// Its node's `Ready` condition is True, or the node is not known. A node that
    /// stopped reporting (a lost machine) turns NotReady once the node controller's
    /// grace period ends.
    pub node_ready: bool,
    /// Its pod runs another image than the catalog's for its major: a minor update
    /// is due (replicas are replaced, the primary switched over first).
    pub outdated: bool,
}

/// What a successful pass found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Converged {
    pub members: BTreeMap<String, Member>,
    /// Every desired instance exists and is ready.
    pub ready: bool,
    /// Instances are down on purpose: a major upgrade stopped them (`status.upgrade`).
    pub planned_outage: bool,
    /// The WAL archive setting the pass read (`spec.backup` and its credentials), or
    /// why it could not; `None` when the pass did not read it.
    pub archive: Option<Result<ArchiveConfig, String>>,
    /// With `bootstrap.recovery` and no data yet: the restore for the first instance.
    pub restore: Option<Result<RestoreRequest, String>>,
}

/// What a pass is asked to do.
#[derive(Clone, Debug)]
pub struct ConvergeOrder {
    pub cluster: Arc<DatabaseCluster>,
    /// The latest view of each instance, for status.
    pub views: Vec<InstanceView>,
    /// Surplus instances that may go now (the primary no longer waits for them).
    pub remove: Vec<String>,
    /// Why the cluster is degraded, if it is.
    pub degraded: Option<String>,
    /// The primary the machine decided on; `None` before it knows (the pass then takes
    /// status' `currentPrimary`).
    pub primary: Option<String>,
    /// During a failover or switchover: the instance being replaced, and the one being
    /// promoted.
    pub failover: Option<FailoverStatus>,
    /// Whether the primary serves, and why not.
    pub primary_condition: Assessment,
    /// With `mode: sync`: whether commits get the quorum they ask for.
    pub synchronous_condition: Option<Assessment>,
    /// With `spec.backup`: whether WAL reaches the object store.
    pub archive_condition: Option<Assessment>,
    /// With `bootstrap.recovery`: whether the restore is done.
    pub restore_condition: Option<Assessment>,
    /// Whether PostgreSQL takes `spec.parameters` on every instance.
    pub parameters_condition: Option<Assessment>,
    /// Write the instances' positions and lag as viewed now; otherwise keep those
    /// status shows, unless the pass writes status anyway.
    pub refresh_progress: bool,
}

/// A condition's status, reason and message, decided by the machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Assessment {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Assessment {
    pub(crate) fn new(status: bool, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
        }
    }

    /// Records this assessment's status in `last` and says whether it flipped, with an
    /// Event when it did: a Warning with its reason when it turned false, a Normal
    /// `recovered` when it turned true again (not when first seen true).
    pub(super) fn record_flip(
        self,
        last: &mut Option<bool>,
        recovered: &'static str,
        effects: &mut Vec<ClusterEffect>,
    ) -> bool {
        let before = last.replace(self.status);
        if before == Some(self.status) {
            return false;
        }
        if !self.status {
            effects.push(ClusterEffect::Record(Note::warning(
                self.reason,
                self.message,
            )));
        } else if before == Some(false) {
            effects.push(ClusterEffect::Record(Note::normal(recovered, self.message)));
        }
        true
    }
}

impl Default for Assessment {
    fn default() -> Self {
        Self::new(false, "Unknown", "the primary has not been observed yet")
    }
}

/// A failover as status shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct FailoverStatus {
    pub from: String,
    pub target: Option<String>,
    /// A switchover rather than a failover.
    pub switchover: bool,
    /// The old primary no longer gets the lease: it is on its way out. A failover
    /// that no replica could carry out yet leaves it the lease (and `-rw`).
    pub lease_withheld: bool,
}

/// A failover in progress.
#[derive(Clone, Debug, PartialEq)]
pub struct Failover {
    /// The primary being replaced.
    pub from: String,
    pub reason: String,
    pub started: SystemTime,
    /// The instance being promoted, once chosen.
    pub target: Option<String>,
    /// Why nothing can be promoted yet.
    pub blocked: Option<Waiting>,
}

impl Failover {
    /// Whether the old primary's lease is withheld: from the first moment a replica
    /// could replace it. Until then it keeps it: it may be merely slow, and stopping
    /// it would make the outage certain.
    pub fn withholds_lease(&self) -> bool {
        !matches!(self.blocked, Some(Waiting::ForCandidate(_)))
    }
}

/// Why a failover has not promoted anyone yet.
#[derive(Clone, Debug, PartialEq)]
pub enum Waiting {
    /// The old primary's lease may still run: a matter of seconds, by design.
    ForLease(String),
    /// No replica can be shown safe to promote: the cluster is blocked until one can.
    ForCandidate(String),
}

impl Waiting {
    pub fn message(&self) -> &str {
        match self {
            Waiting::ForLease(message) | Waiting::ForCandidate(message) => message,
        }
    }
}

/// A Kubernetes Event to record on the cluster (or on a backup schedule).
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
    /// The object it is about (an instance's pod, a schedule's Backup), recorded as
    /// the Event's related object, so that the same step on two of them is two Events
    /// rather than one series: a series keeps its first Event's message.
    pub related: Option<Related>,
}

/// The related object of an Event, in the recorded object's namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct Related {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub name: String,
}

impl Note {
    pub fn normal(reason: &'static str, message: String) -> Self {
        Self {
            warning: false,
            reason,
            message,
            related: None,
        }
    }

    pub fn warning(reason: &'static str, message: String) -> Self {
        Self {
            warning: true,
            reason,
            message,
            related: None,
        }
    }

    /// The same Event, about one instance.
    pub fn about(self, instance: &str) -> Self {
        self.about_object("v1", "Pod", instance)
    }

    /// The same Event, about another object of the namespace.
    pub fn about_object(
        mut self,
        api_version: &'static str,
        kind: &'static str,
        name: &str,
    ) -> Self {
        self.related = Some(Related {
            api_version,
            kind,
            name: name.to_owned(),
        });
        self
    }
}

#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    /// The latest desired state.
    pub cluster: Option<Arc<DatabaseCluster>>,
    /// A pass is running.
    pub converging: bool,
    /// The desired state or the instances changed during the running pass.
    pub again: bool,
    /// Failed passes in a row.
    pub failures: u32,
    pub degraded: Option<String>,
    pub members: BTreeMap<String, Member>,
    /// Boxed: a map's leaf node has room for eleven values, and an `InstanceView` is
    /// over 500 bytes, so one view unboxed took about 6 KiB per cluster.
    pub views: BTreeMap<String, Box<InstanceView>>,
    /// The command running on each instance.
    pub commands: BTreeMap<String, Command>,
    /// Instances whose last view predates their last command.
    pub stale: BTreeSet<String>,
    /// When each instance's last command finished (the latest time seen then): a view
    /// asked for before that shows the instance as it was before the command.
    pub settled_at: BTreeMap<String, SystemTime>,
    /// Whether the last pass found the cluster ready.
    pub ready: Option<bool>,
    /// The primary: the only instance granted the lease. Status' `currentPrimary`.
    pub primary: Option<String>,
    /// When this machine saw its first instance view (leases a previous operator
    /// granted end one lease after it).
    pub began: Option<SystemTime>,
    /// The latest time an event carried.
    pub now: Option<SystemTime>,
    /// When a pass last wrote the instances' positions and lag ([`PROGRESS_REFRESH`]).
    pub progress_at: Option<SystemTime>,
    /// The end of the latest lease granted (to whichever instance).
    pub leased_until: Option<SystemTime>,
    /// Since when the primary has not been serving.
    pub unavailable_since: Option<SystemTime>,
    pub failover: Option<Failover>,
    /// The primary's last synchronous quorum, for deciding whom failover may promote.
    pub quorum: Option<Quorum>,
    /// Instances reported as split brains (one Event each).
    pub split_brains: BTreeSet<String>,
    /// Whether the synchronous quorum was last found satisfied.
    pub synchronous_ok: Option<bool>,
    /// The WAL archive setting every instance should have (from the last pass), or why
    /// it could not be read.
    pub archive: Option<Result<ArchiveConfig, String>>,
    /// Whether archiving was last found working.
    pub archiving_ok: Option<bool>,
    /// Whether no instance refused the spec's parameters, when last found.
    pub parameters_ok: Option<bool>,
    /// WAL waiting for the archive has reached a quarter of the primary's volume (one
    /// Warning per episode).
    pub wal_piling: bool,
    pub switchover: Option<Switchover>,
    /// With `bootstrap.recovery`, before the cluster has data: the restore the pass
    /// resolved for the first instance, or why it cannot go ahead.
    pub restore: Option<Result<RestoreRequest, String>>,
    /// The restore problem last reported with a Warning.
    pub restore_warned: Option<String>,
    /// `castellan.io/restart` and `castellan.io/reload` being carried out.
    pub declared: super::actions::Declared,
}

#[derive(Debug)]
pub enum ClusterEvent {
    /// From reconcile: the cluster as the API server has it now.
    Desired(Arc<DatabaseCluster>),
    /// A pass finished.
    Converged(Result<Converged, String>),
    /// From a `ReplicaActor`: its instance's latest view.
    Observed(InstanceView),
    /// From a `ReplicaActor`: a command finished, its answer received `at` (a view
    /// asked for before then may show the instance as it was before the command).
    Finished {
        instance: String,
        command: Command,
        outcome: Result<Value, String>,
        at: SystemTime,
    },
    /// The retry timer after a failed pass fired.
    Retry,
    /// A `ReplicaActor` keeps failing (its supervisor gave up for a while).
    ReplicaFailing { instance: String, reason: String },
    /// A fault injected on purpose (`castellan.io/inject-fault`, only with
    /// `--fault-injection`): the machine panics, as a bug would make it.
    InjectedFault(String),
}

#[derive(Debug)]
pub enum ClusterEffect {
    Converge(Box<ConvergeOrder>),
    /// Run exactly these `ReplicaActor`s (instance, API address); stop the others.
    Track(Vec<(String, Option<String>)>),
    Command {
        instance: String,
        command: Command,
    },
    Record(Note),
    RetryAfter(Duration),
    /// Remove the switchover request: it was carried out or refused.
    ClearSwitchover,
    /// Record a declared action's value as handled: set `annotation` to `value`.
    Acknowledge {
        annotation: &'static str,
        value: String,
    },
    /// Renew an instance's primary lease.
    Grant {
        instance: String,
        grant: LeaseGrant,
    },
}

/// Whether acknowledged commits must never be lost: `sync` with `required` durability.
pub(super) fn durability_required(cluster: &DatabaseCluster) -> bool {
    crate::operator::build::synchronous(cluster)
        && cluster
            .spec
            .replication
            .as_ref()
            .and_then(|r| r.data_durability)
            .unwrap_or_default()
            == castellan_crds::database_cluster::DataDurability::Required
}

pub(super) fn desired_count(cluster: &DatabaseCluster) -> u32 {
    u32::try_from(cluster.spec.replicas.max(1)).unwrap_or(1)
}

pub(super) fn primary(state: &ClusterState) -> Option<(&String, &Member)> {
    match &state.primary {
        Some(name) => state.members.get_key_value(name),
        None => state.members.iter().find(|(_, member)| member.primary),
    }
}

/// A switchover in progress: the old primary is stopped cleanly (its standbys receive
/// all its WAL), the target is promoted once it has received it, and the old primary
/// rejoins as a replica. No lease needs to run out: the stop is confirmed.
#[derive(Clone, Debug, PartialEq)]
pub struct Switchover {
    pub from: String,
    pub to: String,
    /// Why: the annotation, or a drain.
    pub cause: String,
    pub started: SystemTime,
    pub stage: SwitchoverStage,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SwitchoverStage {
    /// The old primary is being stopped.
    Demoting,
    /// Stopped at this checkpoint; waiting for the target to receive past it.
    CatchingUp {
        checkpoint: crate::instance_api::Lsn,
    },
    /// The target is being promoted.
    Promoting,
}

/// The quorum a promotion put in force, if it named one.
pub fn promoted_quorum(command: &Command) -> Option<Quorum> {
    match command {
        Command::Promote(request) => request
            .synchronous_standby_names
            .as_deref()
            .and_then(Quorum::parse),
        _ => None,
    }
}

impl ClusterState {
    /// Sends `instance` the promotion: its first lease from `now` (recorded, so no other
    /// promotion happens before it ends), a slot for every other member to follow it,
    /// and, when acknowledged commits must not be lost, the quorum of the other
    /// instances that stay, in force from its first commit.
    pub fn promote(&mut self, effects: &mut Vec<ClusterEffect>, instance: &str, now: SystemTime) {
        let grant = LeaseGrant::starting(now, super::failover::LEASE_DURATION);
        self.leased_until = self.leased_until.max(Some(grant.valid_until()));
        let slots: Vec<String> = self
            .members
            .keys()
            .filter(|name| name.as_str() != instance)
            .cloned()
            .collect();
        let synchronous_standby_names = self
            .cluster
            .as_deref()
            .filter(|cluster| durability_required(cluster))
            .map(|cluster| {
                let desired = desired_count(cluster);
                let staying: Vec<String> = slots
                    .iter()
                    .filter(|name| self.members.get(*name).is_some_and(|m| m.number <= desired))
                    .cloned()
                    .collect();
                crate::operator::build::synchronous_standby_names(cluster, &staying)
            });
        let command = Command::Promote(PromoteRequest {
            lease: grant,
            slots,
            synchronous_standby_names,
        });
        self.commands.insert(instance.to_owned(), command.clone());
        effects.push(ClusterEffect::Command {
            instance: instance.to_owned(),
            command,
        });
    }

    /// Gives up a switchover that cannot complete: the request is cleared and failover's
    /// rules (the most advanced replica, once the lease has ended) take over from `from`.
    pub fn hand_to_failover(
        &mut self,
        effects: &mut Vec<ClusterEffect>,
        from: String,
        reason: &str,
        now: SystemTime,
    ) {
        self.switchover = None;
        effects.push(ClusterEffect::ClearSwitchover);
        self.failover = Some(Failover {
            from,
            reason: reason.to_owned(),
            started: now,
            target: None,
            blocked: None,
        });
    }
}
