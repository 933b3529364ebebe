//! The `ClusterActor`'s machine: one per `DatabaseCluster`. `reconcile` hands it the
//! desired state and returns; the machine decides what happens next and in which
//! order:
//!
//! - converge the owned objects (Secrets, Services, budgets, volumes, pods) and write
//!   status, one pass at a time, again if the spec changed meanwhile, with back-off
//!   after a failure and `Degraded` after [`DEGRADED_AFTER`] failures in a row;
//! - keep one `ReplicaActor` per instance (they report what their instance looks like);
//! - keep the primary's synchronous standbys in line with the streaming standbys that
//!   stay, and remove a surplus instance only once the primary no longer names it;
//! - bring every instance's parameters to the spec by reload, then restart the
//!   instances that need it one at a time, replicas first and the primary last, each
//!   only when every instance is ready;
//! - keep the primary's lease while it serves, and fail over when it does not
//!   (`failover.rs` decides whom and when): stop renewing, take it out of `-rw`, wait
//!   for its lease to end, promote the most advanced replica that is safe, and rejoin
//!   the old primary as a replica when it comes back. An instance that runs as primary
//!   without being the primary is a split brain: it is demoted at once;
//! - fence and unfence instances as `castellan.io/fenced-instances` asks.
//!
//! Pure: `shell.rs` performs the effects and feeds their outcomes back as events. The
//! machine has no clock: it takes the time from the instance views it is sent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use castellan_actors::StateMachine;
use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::DataDurability;
use kube::ResourceExt;
use serde_json::Value;

use super::build;
use super::failover::{self, Choice, LEASE_DURATION, Quorum};
use super::replica::{Command, InstanceView};
use crate::instance_api::{LeaseGrant, PromoteRequest, RunningRole};

/// Annotation naming the instances to fence: a JSON list of pod names, or `["*"]` for
/// all of them (the form CloudNativePG's `cnpg.io/fencedInstances` uses). A fenced
/// instance's server is stopped and stays stopped, its data untouched; a fenced primary
/// is not failed over.
pub const FENCED_ANNOTATION: &str = "castellan.io/fenced-instances";

/// Annotation asking for a switchover to the named instance: a one-shot request that
/// the operator carries out (or refuses, saying why in an Event) and then removes.
/// Draining the primary's node asks for one by itself.
pub const SWITCHOVER_ANNOTATION: &str = "castellan.io/switchover-to";

/// How long a switchover waits for its target to receive the old primary's last WAL
/// before it gives up and lets failover choose the most advanced replica instead.
pub const SWITCHOVER_CATCH_UP: Duration = Duration::from_secs(30);

/// Consecutive failed passes after which the cluster is `Degraded`.
pub const DEGRADED_AFTER: u32 = 3;
/// Longest wait between retries of a failing pass.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// One instance as the last pass found it.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub number: u32,
    /// `ip:port` of the instance API, once the pod has an address.
    pub address: Option<String>,
    pub primary: bool,
    /// Its node is cordoned (being drained).
    pub cordoned: bool,
}

/// What a successful pass found.
#[derive(Clone, Debug, PartialEq)]
pub struct Converged {
    pub members: BTreeMap<String, Member>,
    /// Every desired instance exists and is ready.
    pub ready: bool,
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
}

/// A condition's status, reason and message, decided by the machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Assessment {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Assessment {
    fn new(status: bool, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
        }
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
    pub blocked: Option<String>,
}

/// A Kubernetes Event to record on the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
    /// The instance (pod) it is about, recorded as the Event's related object, so
    /// that the same step on two instances is two Events rather than one series.
    pub instance: Option<String>,
}

impl Note {
    pub fn normal(reason: &'static str, message: String) -> Self {
        Self {
            warning: false,
            reason,
            message,
            instance: None,
        }
    }

    pub fn warning(reason: &'static str, message: String) -> Self {
        Self {
            warning: true,
            reason,
            message,
            instance: None,
        }
    }

    /// The same Event, about one instance.
    pub fn about(mut self, instance: &str) -> Self {
        self.instance = Some(instance.to_owned());
        self
    }
}

pub struct ClusterMachine;

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
    pub views: BTreeMap<String, InstanceView>,
    /// The command running on each instance.
    pub commands: BTreeMap<String, Command>,
    /// Instances whose last view predates their last command.
    pub stale: BTreeSet<String>,
    /// Whether the last pass found the cluster ready.
    pub ready: Option<bool>,
    /// The primary: the only instance granted the lease. Status' `currentPrimary`.
    pub primary: Option<String>,
    /// When this machine saw its first instance view (leases a previous operator
    /// granted end one lease after it).
    pub began: Option<SystemTime>,
    /// The latest time an event carried.
    pub now: Option<SystemTime>,
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
    pub switchover: Option<Switchover>,
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

#[derive(Debug)]
pub enum ClusterEvent {
    /// From reconcile: the cluster as the API server has it now.
    Desired(Arc<DatabaseCluster>),
    /// A pass finished.
    Converged(Result<Converged, String>),
    /// From a `ReplicaActor`: its instance's latest view.
    Observed(InstanceView),
    /// From a `ReplicaActor`: a command finished.
    Finished {
        instance: String,
        command: Command,
        outcome: Result<Value, String>,
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
    Converge(ConvergeOrder),
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
    /// Renew an instance's primary lease.
    Grant {
        instance: String,
        grant: LeaseGrant,
    },
}

impl StateMachine for ClusterMachine {
    type State = ClusterState;
    type Event = ClusterEvent;
    type Effect = ClusterEffect;

    fn label(event: &ClusterEvent) -> String {
        match event {
            ClusterEvent::Desired(cluster) => {
                format!("Desired(generation {:?})", cluster.metadata.generation)
            }
            ClusterEvent::Converged(Ok(_)) => "Converged".into(),
            ClusterEvent::Converged(Err(error)) => format!("ConvergeFailed({error})"),
            ClusterEvent::Observed(view) => format!("Observed({})", view.name),
            ClusterEvent::Finished {
                instance, command, ..
            } => format!("Finished({} of {instance})", command.name()),
            ClusterEvent::Retry => "Retry".into(),
            ClusterEvent::ReplicaFailing { instance, .. } => format!("ReplicaFailing({instance})"),
            ClusterEvent::InjectedFault(_) => "InjectedFault".into(),
        }
    }

    fn transition(
        mut state: ClusterState,
        event: ClusterEvent,
    ) -> (ClusterState, Vec<ClusterEffect>) {
        let mut effects = Vec::new();
        match event {
            ClusterEvent::Desired(cluster) => {
                state.cluster = Some(cluster);
                converge(&mut state, &mut effects);
                // A spec change reaches the instances at once, as part of this trace.
                plan_commands(&mut state, &mut effects);
            }
            ClusterEvent::Retry => {
                if !state.converging {
                    converge(&mut state, &mut effects);
                }
            }
            ClusterEvent::Converged(Ok(found)) => {
                state.converging = false;
                state.failures = 0;
                if let Some(reason) = state.degraded.take() {
                    effects.push(ClusterEffect::Record(Note::normal(
                        "Recovered",
                        format!("reconciling works again after: {reason}"),
                    )));
                }
                if state.ready != Some(found.ready) {
                    if found.ready {
                        effects.push(ClusterEffect::Record(Note::normal(
                            "ClusterReady",
                            "every instance is ready".to_owned(),
                        )));
                    } else if state.ready == Some(true) {
                        effects.push(ClusterEffect::Record(Note::warning(
                            "InstancesNotReady",
                            "not every instance is ready".to_owned(),
                        )));
                    }
                    state.ready = Some(found.ready);
                }
                state.members = found.members;
                if state.primary.is_none() {
                    state.primary = state
                        .members
                        .iter()
                        .find(|(_, member)| member.primary)
                        .map(|(name, _)| name.clone());
                }
                let members = &state.members;
                state.views.retain(|name, _| members.contains_key(name));
                state.commands.retain(|name, _| members.contains_key(name));
                state.stale.retain(|name| members.contains_key(name));
                effects.push(ClusterEffect::Track(
                    state
                        .members
                        .iter()
                        .map(|(name, member)| (name.clone(), member.address.clone()))
                        .collect(),
                ));
                if std::mem::take(&mut state.again) {
                    converge(&mut state, &mut effects);
                }
                plan_commands(&mut state, &mut effects);
            }
            ClusterEvent::Converged(Err(reason)) => {
                state.converging = false;
                state.failures += 1;
                if state.failures >= DEGRADED_AFTER && state.degraded.is_none() {
                    effects.push(ClusterEffect::Record(Note::warning(
                        "Degraded",
                        format!("{} passes failed in a row: {reason}", state.failures),
                    )));
                    state.degraded = Some(reason);
                } else if state.degraded.is_some() {
                    state.degraded = Some(reason);
                }
                effects.push(ClusterEffect::RetryAfter(retry_delay(state.failures)));
            }
            ClusterEvent::Observed(view) => {
                let name = view.name.clone();
                if !state.members.contains_key(&name) {
                    // A report from an instance that is gone.
                    return (state, effects);
                }
                state.now = Some(state.now.map_or(view.at, |now| now.max(view.at)));
                state.began.get_or_insert(view.at);
                let previous = state.views.insert(name.clone(), view.clone());
                state.stale.remove(&name);
                let changed = previous.is_none_or(|p| {
                    p.ready != view.ready
                        || p.reachable != view.reachable
                        || p.role != view.role
                        || p.fenced != view.fenced
                });
                let roles = |state: &ClusterState| {
                    (
                        state.primary.clone(),
                        state.failover.clone(),
                        state.switchover.clone(),
                    )
                };
                let before = roles(&state);
                supervise_primary(&mut state, &mut effects, &name);
                let primary_changed = before != roles(&state);
                if synchronous_changed(&mut state, &mut effects) || changed || primary_changed {
                    converge(&mut state, &mut effects);
                }
                plan_commands(&mut state, &mut effects);
            }
            ClusterEvent::Finished {
                instance,
                command,
                outcome,
            } => {
                state.commands.remove(&instance);
                state.stale.insert(instance.clone());
                if state.switchover.is_some()
                    && matches!(command, Command::Promote(_) | Command::Demote)
                {
                    switchover_step_done(&mut state, &mut effects, &instance, &command, outcome);
                    return (state, effects);
                }
                if let Command::Promote(_) = &command {
                    finish_promotion(&mut state, &mut effects, &instance, &outcome);
                    return (state, effects);
                }
                let note = match (&command, outcome) {
                    (Command::Reload { .. }, Ok(_)) => {
                        Note::normal("Reloaded", format!("{instance} reloaded its configuration"))
                    }
                    (Command::Restart, Ok(_)) => {
                        Note::normal("Restarted", format!("{instance} restarted"))
                    }
                    (Command::Demote, Ok(_)) => Note::normal(
                        "Rejoining",
                        format!("{instance} stopped as primary and rejoins as a replica"),
                    ),
                    (Command::Fence(true), Ok(_)) => Note::normal(
                        "Fenced",
                        format!("{instance} is fenced: its server is stopped"),
                    ),
                    (Command::Fence(false), Ok(_)) => {
                        Note::normal("Unfenced", format!("{instance} is no longer fenced"))
                    }
                    (Command::Promote(_), Ok(_)) => {
                        Note::normal("Promoted", format!("{instance} was promoted"))
                    }
                    (command, Err(error)) => Note::warning(
                        "CommandFailed",
                        format!("{} of {instance} failed: {error}", command.name()),
                    ),
                };
                effects.push(ClusterEffect::Record(note.about(&instance)));
            }
            ClusterEvent::ReplicaFailing { instance, reason } => {
                effects.push(ClusterEffect::Record(
                    Note::warning(
                        "ReplicaActorFailing",
                        format!("the actor watching {instance} keeps failing: {reason}"),
                    )
                    .about(&instance),
                ));
            }
            ClusterEvent::InjectedFault(what) => {
                panic!("injected fault: {what}");
            }
        }
        (state, effects)
    }
}

/// Whether the primary's Castellan slots differ from one per instance in `wanted`: one
/// is missing, or one that no standby uses belongs to no instance (removable).
fn slots_differ(view: &InstanceView, wanted: &[String]) -> bool {
    use crate::instance_api::slot_name;
    let wanted: BTreeSet<String> = wanted.iter().map(|name| slot_name(name)).collect();
    let ours = view
        .slots
        .iter()
        .filter(|slot| slot.name.starts_with("castellan_"));
    wanted
        .iter()
        .any(|slot| !view.slots.iter().any(|s| &s.name == slot))
        || ours
            .into_iter()
            .any(|slot| !slot.active && !wanted.contains(&slot.name))
}

/// Starts a pass, or marks that another is needed once the running one ends.
fn converge(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let Some(cluster) = state.cluster.clone() else {
        return;
    };
    if state.converging {
        state.again = true;
        return;
    }
    state.converging = true;
    effects.push(ClusterEffect::Converge(ConvergeOrder {
        remove: removable(state, &cluster),
        views: state.views.values().cloned().collect(),
        degraded: state.degraded.clone(),
        primary: state.primary.clone(),
        failover: state
            .failover
            .as_ref()
            .map(|f| FailoverStatus {
                from: f.from.clone(),
                target: f.target.clone(),
                switchover: false,
            })
            .or_else(|| {
                state.switchover.as_ref().map(|s| FailoverStatus {
                    from: s.from.clone(),
                    target: Some(s.to.clone()),
                    switchover: true,
                })
            }),
        primary_condition: primary_assessment(state),
        synchronous_condition: synchronous_assessment(state, &cluster),
        cluster,
    }));
}

/// 1 s, 2 s, 4 s … up to [`MAX_RETRY_DELAY`].
pub fn retry_delay(failures: u32) -> Duration {
    let seconds = 1u64 << failures.saturating_sub(1).min(5);
    Duration::from_secs(seconds).min(MAX_RETRY_DELAY)
}

fn desired_count(cluster: &DatabaseCluster) -> u32 {
    u32::try_from(cluster.spec.replicas.max(1)).unwrap_or(1)
}

fn primary(state: &ClusterState) -> Option<(&String, &Member)> {
    match &state.primary {
        Some(name) => state.members.get_key_value(name),
        None => state.members.iter().find(|(_, member)| member.primary),
    }
}

/// The instances `castellan.io/fenced-instances` names (every member for `"*"`).
pub fn fenced_instances(
    cluster: &DatabaseCluster,
    members: &BTreeMap<String, Member>,
) -> BTreeSet<String> {
    let Some(value) = cluster.annotations().get(FENCED_ANNOTATION) else {
        return BTreeSet::new();
    };
    let names: Vec<String> = serde_json::from_str(value).unwrap_or_default();
    if names.iter().any(|name| name == "*") {
        return members.keys().cloned().collect();
    }
    names.into_iter().collect()
}

/// `spec.failover.delay`, or the default.
fn failover_delay(cluster: &DatabaseCluster) -> Duration {
    cluster
        .spec
        .failover
        .as_ref()
        .and_then(|f| f.delay())
        .unwrap_or(failover::DEFAULT_DELAY)
}

/// Whether acknowledged commits must never be lost: `sync` with `required` durability.
fn durability_required(cluster: &DatabaseCluster) -> bool {
    build::synchronous(cluster)
        && cluster
            .spec
            .replication
            .as_ref()
            .and_then(|r| r.data_durability)
            .unwrap_or_default()
            == DataDurability::Required
}

/// Why the primary is not serving, or `None` when it is. The delay applies to what may
/// pass by itself (an unreachable instance, a server restarting); an empty volume or a
/// primary that runs as a replica will not.
fn unavailability(view: Option<&InstanceView>) -> Option<(String, bool)> {
    let Some(view) = view else {
        return Some(("it has not been observed".to_owned(), false));
    };
    if let Some(problem) = &view.problem {
        return Some((problem.clone(), true));
    }
    if !view.reachable {
        let error = view.error.clone().unwrap_or_default();
        return Some((
            format!("its instance manager does not answer ({error})"),
            false,
        ));
    }
    match view.role {
        Some(RunningRole::Replica) if view.running => {
            Some(("it runs as a replica".to_owned(), true))
        }
        _ if view.serving_as_primary() => None,
        _ => Some((
            view.error
                .clone()
                .unwrap_or_else(|| "its server does not accept connections".to_owned()),
            false,
        )),
    }
}

/// Keeps the primary's lease while it serves, and fails over when it does not: the
/// heart of high availability. Called on every instance view (`observed` is whose).
fn supervise_primary(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>, observed: &str) {
    let (Some(cluster), Some(now), Some(primary)) =
        (state.cluster.clone(), state.now, state.primary.clone())
    else {
        return;
    };
    let fenced = fenced_instances(&cluster, &state.members);
    let view = state.views.get(&primary).cloned();

    // The primary's view: renew its lease (while it is the primary and no failover
    // replaces it), remember its quorum, and note since when it does not serve.
    if observed == primary {
        if let Some(view) = view.as_ref().filter(|v| v.reachable) {
            if view.role == Some(RunningRole::Primary) {
                state.quorum = Quorum::parse(&view.sync_names).or(state.quorum.take());
            }
            // A switchover asked for now starts before this view would renew the lease.
            if state.switchover.is_none()
                && state.failover.is_none()
                && unavailability(Some(view)).is_none()
            {
                start_switchover(state, effects, &cluster, now);
            }
            let renew = state.failover.is_none()
                && state.switchover.is_none()
                && view.problem.is_none()
                && view.role != Some(RunningRole::Replica);
            if renew {
                let grant = LeaseGrant::starting(view.at, LEASE_DURATION);
                state.leased_until = state.leased_until.max(Some(grant.valid_until()));
                effects.push(ClusterEffect::Grant {
                    instance: primary.clone(),
                    grant,
                });
            }
        }
        match unavailability(view.as_ref()) {
            None => state.unavailable_since = None,
            Some(_) => {
                state
                    .unavailable_since
                    .get_or_insert(view.as_ref().map_or(now, |v| v.at));
            }
        }
    }

    demote_strays(state, effects, &primary);

    if fenced.contains(&primary) {
        // A fenced primary is the user's decision: no failover replaces it.
        state.unavailable_since = None;
        return;
    }

    // A failover that has not chosen yet gives way to the old primary if it is back:
    // it has every commit, and nothing else could be promoted meanwhile.
    if let Some(failover) = &state.failover
        && failover.target.is_none()
        && failover.blocked.is_some()
        && view.as_ref().is_some_and(|v| {
            v.reachable && v.role == Some(RunningRole::Primary) && v.problem.is_none()
        })
    {
        effects.push(ClusterEffect::Record(Note::normal(
            "FailoverCancelled",
            format!("{primary} is back before any replica could be promoted; it stays primary"),
        )));
        state.failover = None;
        return;
    }

    if state.switchover.is_some() {
        advance_switchover(state, effects);
        return;
    }
    if state.failover.is_none() {
        let Some((reason, at_once)) = unavailability(view.as_ref()) else {
            return;
        };
        let since = state.unavailable_since.unwrap_or(now);
        let waited = now.duration_since(since).unwrap_or_default();
        if !at_once && waited < failover_delay(&cluster) {
            return;
        }
        effects.push(ClusterEffect::Record(Note::warning(
            "FailingOver",
            format!(
                "the primary {primary} has not served for {:.1}s: {reason}; it no longer \
                 gets the lease, and a replica is promoted once its lease has ended",
                waited.as_secs_f64()
            ),
        )));
        state.failover = Some(Failover {
            from: primary.clone(),
            reason,
            started: now,
            target: None,
            blocked: None,
        });
    }
    promote_when_safe(state, effects, &cluster, now);
}

/// The failover's next step: wait for the old primary's lease, then promote the
/// replica `failover::choose` picks.
fn promote_when_safe(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    cluster: &DatabaseCluster,
    now: SystemTime,
) {
    let Some(failover) = state.failover.clone() else {
        return;
    };
    if failover.target.is_some() {
        return;
    }
    let began = state.began.unwrap_or(now);
    let choice = match failover::leases_may_run(now, state.leased_until, began) {
        Some(until) => Choice::Wait(format!(
            "waiting {:.1}s more for the lease of {} to end, so that it has stopped taking \
             writes before another instance is promoted",
            until.duration_since(now).unwrap_or_default().as_secs_f64(),
            failover.from
        )),
        None => {
            let candidates: Vec<&InstanceView> = state
                .views
                .iter()
                .filter(|(name, _)| **name != failover.from && state.members.contains_key(*name))
                .map(|(_, view)| view)
                .collect();
            failover::choose(
                &candidates,
                state.quorum.as_ref(),
                durability_required(cluster),
            )
        }
    };
    match choice {
        Choice::Wait(reason) => {
            let lease_wait = reason.starts_with("waiting");
            if !lease_wait && failover.blocked.as_deref() != Some(reason.as_str()) {
                effects.push(ClusterEffect::Record(Note::warning(
                    "FailoverBlocked",
                    reason.clone(),
                )));
            }
            if let Some(f) = state.failover.as_mut() {
                f.blocked = Some(reason);
            }
        }
        Choice::Promote { instance, lsn } => {
            let grant = LeaseGrant::starting(now, LEASE_DURATION);
            state.leased_until = state.leased_until.max(Some(grant.valid_until()));
            let slots = state
                .members
                .keys()
                .filter(|name| **name != instance)
                .cloned()
                .collect();
            effects.push(ClusterEffect::Record(
                Note::normal(
                    "Promoting",
                    format!(
                        "promoting {instance} (WAL received up to {lsn}) to replace {}",
                        failover.from
                    ),
                )
                .about(&instance),
            ));
            let command = Command::Promote(PromoteRequest {
                lease: grant,
                slots,
            });
            state.commands.insert(instance.clone(), command.clone());
            effects.push(ClusterEffect::Command {
                instance: instance.clone(),
                command,
            });
            if let Some(f) = state.failover.as_mut() {
                f.target = Some(instance);
                f.blocked = None;
            }
        }
    }
}

/// Starts a switchover when one is asked for (the annotation) or needed (the primary's
/// node is being drained), to a streaming replica; refuses a request it cannot honour.
fn start_switchover(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    cluster: &DatabaseCluster,
    now: SystemTime,
) {
    let Some(primary) = state.primary.clone() else {
        return;
    };
    let requested = cluster.annotations().get(SWITCHOVER_ANNOTATION).cloned();
    let primary_view = state.views.get(&primary).cloned();
    let streaming = |name: &str| {
        primary_view
            .as_ref()
            .is_some_and(|v| v.standbys.iter().any(|s| s.name == name && s.streaming))
    };
    let eligible = |state: &ClusterState, name: &str| {
        state.members.get(name).is_some_and(|m| !m.cordoned)
            && state.views.get(name).is_some_and(failover::promotable)
            && streaming(name)
    };
    let (to, cause) = match requested {
        Some(to) if to == primary => {
            effects.push(ClusterEffect::ClearSwitchover);
            return;
        }
        Some(to) => {
            if !eligible(state, &to) || state.commands.contains_key(&to) {
                effects.push(ClusterEffect::Record(Note::warning(
                    "SwitchoverRefused",
                    format!(
                        "cannot switch over to {to}: it must be a member that runs as a \
                         streaming replica, unfenced, on a node that is not cordoned"
                    ),
                )));
                effects.push(ClusterEffect::ClearSwitchover);
                return;
            }
            (to, format!("asked for by {SWITCHOVER_ANNOTATION}"))
        }
        None => {
            let draining = state.members.get(&primary).is_some_and(|m| m.cordoned);
            if !draining {
                return;
            }
            // The most advanced streaming replica off the drained node.
            let mut candidates: Vec<&InstanceView> = state
                .views
                .values()
                .filter(|v| v.name != primary && eligible(state, &v.name))
                .collect();
            candidates.sort_by(|a, b| b.receive_lsn.cmp(&a.receive_lsn).then(a.name.cmp(&b.name)));
            let Some(best) = candidates.first() else {
                return;
            };
            (
                best.name.clone(),
                "the primary's node is being drained".to_owned(),
            )
        }
    };
    if state.commands.contains_key(&primary) {
        return;
    }
    effects.push(ClusterEffect::Record(Note::normal(
        "Switchover",
        format!("switching over from {primary} to {to} ({cause}): stopping {primary} cleanly"),
    )));
    state.switchover = Some(Switchover {
        from: primary.clone(),
        to,
        cause,
        started: now,
        stage: SwitchoverStage::Demoting,
    });
    state.commands.insert(primary.clone(), Command::Demote);
    effects.push(ClusterEffect::Command {
        instance: primary,
        command: Command::Demote,
    });
}

/// Promotes the switchover's target once it has received the old primary's last WAL,
/// or hands over to failover if it does not within [`SWITCHOVER_CATCH_UP`].
fn advance_switchover(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let (Some(switchover), Some(now)) = (state.switchover.clone(), state.now) else {
        return;
    };
    let SwitchoverStage::CatchingUp { checkpoint } = switchover.stage else {
        return;
    };
    let received = state
        .views
        .get(&switchover.to)
        .filter(|v| failover::promotable(v))
        .and_then(|v| v.receive_lsn.max(v.lsn));
    if received.is_some_and(|lsn| lsn > checkpoint) {
        let grant = LeaseGrant::starting(now, LEASE_DURATION);
        state.leased_until = state.leased_until.max(Some(grant.valid_until()));
        let slots = state
            .members
            .keys()
            .filter(|name| **name != switchover.to)
            .cloned()
            .collect();
        let command = Command::Promote(PromoteRequest {
            lease: grant,
            slots,
        });
        state
            .commands
            .insert(switchover.to.clone(), command.clone());
        effects.push(ClusterEffect::Command {
            instance: switchover.to.clone(),
            command,
        });
        if let Some(s) = state.switchover.as_mut() {
            s.stage = SwitchoverStage::Promoting;
        }
    } else if now.duration_since(switchover.started).unwrap_or_default() > SWITCHOVER_CATCH_UP {
        effects.push(ClusterEffect::Record(Note::warning(
            "SwitchoverFailed",
            format!(
                "{} did not receive {}'s last WAL ({checkpoint}) within {}s; failing over to \
                 the most advanced replica instead",
                switchover.to,
                switchover.from,
                SWITCHOVER_CATCH_UP.as_secs()
            ),
        )));
        state.switchover = None;
        effects.push(ClusterEffect::ClearSwitchover);
        state.failover = Some(Failover {
            from: switchover.from,
            reason: "a switchover could not complete".to_owned(),
            started: now,
            target: None,
            blocked: None,
        });
    }
}

/// A switchover's demotion or promotion finished.
fn switchover_step_done(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    instance: &str,
    command: &Command,
    outcome: Result<Value, String>,
) {
    let Some(switchover) = state.switchover.clone() else {
        return;
    };
    match (command, outcome) {
        (Command::Demote, Ok(answer)) if instance == switchover.from => {
            let checkpoint = answer["checkpointLsn"]
                .as_str()
                .and_then(crate::instance_api::Lsn::parse);
            match checkpoint {
                Some(checkpoint) => {
                    if let Some(s) = state.switchover.as_mut() {
                        s.stage = SwitchoverStage::CatchingUp { checkpoint };
                    }
                    advance_switchover(state, effects);
                }
                None => {
                    // Stopped, but where it stopped is unknown: only failover's rules
                    // (the most advanced replica) are safe now.
                    state.switchover = None;
                    effects.push(ClusterEffect::ClearSwitchover);
                    state.failover = Some(Failover {
                        from: switchover.from,
                        reason: "stopped for a switchover without a known checkpoint".to_owned(),
                        started: state.now.unwrap_or(switchover.started),
                        target: None,
                        blocked: None,
                    });
                }
            }
        }
        (Command::Demote, Err(error)) => {
            // The old primary may still run: it keeps its role (and its lease resumes).
            effects.push(ClusterEffect::Record(Note::warning(
                "SwitchoverFailed",
                format!(
                    "stopping {} for the switchover failed: {error}; it stays primary",
                    switchover.from
                ),
            )));
            state.switchover = None;
            effects.push(ClusterEffect::ClearSwitchover);
        }
        (Command::Promote(_), Ok(_)) if instance == switchover.to => {
            let took = state
                .now
                .and_then(|now| now.duration_since(switchover.started).ok())
                .unwrap_or_default();
            effects.push(ClusterEffect::Record(
                Note::normal(
                    "SwitchedOver",
                    format!(
                        "{} is the primary in place of {} ({}); writes paused {:.1}s",
                        switchover.to,
                        switchover.from,
                        switchover.cause,
                        took.as_secs_f64()
                    ),
                )
                .about(&switchover.to),
            ));
            state.primary = Some(switchover.to);
            state.switchover = None;
            state.unavailable_since = None;
            state.quorum = None;
            effects.push(ClusterEffect::ClearSwitchover);
            converge(state, effects);
        }
        (Command::Promote(_), Err(error)) => {
            effects.push(ClusterEffect::Record(Note::warning(
                "SwitchoverFailed",
                format!(
                    "promoting {} failed: {error}; failing over to the most advanced replica",
                    switchover.to
                ),
            )));
            state.switchover = None;
            effects.push(ClusterEffect::ClearSwitchover);
            state.failover = Some(Failover {
                from: switchover.from,
                reason: "a switchover's promotion failed".to_owned(),
                started: state.now.unwrap_or(switchover.started),
                target: None,
                blocked: None,
            });
        }
        _ => {}
    }
}

/// The outcome of a promotion: the target is the primary, or the failover chooses again.
fn finish_promotion(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    instance: &str,
    outcome: &Result<Value, String>,
) {
    match outcome {
        Ok(_) => {
            let took = match (&state.failover, state.now) {
                (Some(f), Some(now)) => now.duration_since(f.started).unwrap_or_default(),
                _ => Duration::ZERO,
            };
            let from = state
                .failover
                .take()
                .map(|f| format!(" in place of {} ({})", f.from, f.reason))
                .unwrap_or_default();
            effects.push(ClusterEffect::Record(
                Note::normal(
                    "FailedOver",
                    format!(
                        "{instance} is the primary{from}; {:.1}s after the failover began",
                        took.as_secs_f64()
                    ),
                )
                .about(instance),
            ));
            state.primary = Some(instance.to_owned());
            state.unavailable_since = None;
            state.quorum = None;
            // The old primary's view must not be mistaken for the new one's.
            converge(state, effects);
        }
        Err(error) => {
            effects.push(ClusterEffect::Record(
                Note::warning(
                    "PromotionFailed",
                    format!("promoting {instance} failed: {error}; choosing again"),
                )
                .about(instance),
            ));
            if let Some(f) = state.failover.as_mut() {
                f.target = None;
            }
        }
    }
}

/// Instances that must follow the primary but do not: one running as primary (a split
/// brain: demoted at once, whatever else happens), one that holds primary data or an
/// empty volume and waits (a former primary, a rebuilt one: demoted, that is rewound
/// or filled, once there is a primary to follow).
fn demote_strays(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>, primary: &str) {
    let target = state
        .failover
        .as_ref()
        .and_then(|f| f.target.clone())
        .or_else(|| state.switchover.as_ref().map(|s| s.to.clone()));
    let primary_serves = state
        .views
        .get(primary)
        .is_some_and(InstanceView::serving_as_primary);
    let strays: Vec<(String, bool)> = state
        .views
        .iter()
        .filter(|(name, _)| name.as_str() != primary && Some(*name) != target.as_ref())
        .filter(|(name, _)| {
            state.members.contains_key(*name) && !state.commands.contains_key(*name)
        })
        .filter_map(|(name, view)| {
            let split_brain =
                view.reachable && view.role == Some(RunningRole::Primary) && view.running;
            let waiting = view.reachable
                && (view.role == Some(RunningRole::Primary)
                    || (view.role.is_none() && view.problem.is_some()));
            (split_brain || (waiting && primary_serves)).then(|| (name.clone(), split_brain))
        })
        .collect();
    for (name, split_brain) in strays {
        if split_brain && state.split_brains.insert(name.clone()) {
            effects.push(ClusterEffect::Record(
                Note::warning(
                    "SplitBrain",
                    format!(
                        "{name} runs as a primary but {primary} is the primary: it gets no \
                         lease, is kept out of -rw and is demoted now"
                    ),
                )
                .about(&name),
            ));
        }
        state.commands.insert(name.clone(), Command::Demote);
        effects.push(ClusterEffect::Command {
            instance: name,
            command: Command::Demote,
        });
    }
    let views = &state.views;
    state.split_brains.retain(|name| {
        views
            .get(name)
            .is_some_and(|v| v.role == Some(RunningRole::Primary))
    });
}

/// The `PrimaryAvailable` condition.
fn primary_assessment(state: &ClusterState) -> Assessment {
    let Some(primary) = &state.primary else {
        return Assessment::default();
    };
    if let Some(failover) = &state.failover {
        let message = match (&failover.target, &failover.blocked) {
            (Some(target), _) => format!("failing over from {}: promoting {target}", failover.from),
            (None, Some(blocked)) => format!(
                "failing over from {} ({}): {blocked}",
                failover.from, failover.reason
            ),
            (None, None) => format!("failing over from {}: {}", failover.from, failover.reason),
        };
        let reason = if failover
            .blocked
            .as_deref()
            .is_some_and(|b| !b.starts_with("waiting"))
        {
            "FailoverBlocked"
        } else {
            "FailingOver"
        };
        return Assessment::new(false, reason, message);
    }
    if let Some(cluster) = &state.cluster
        && fenced_instances(cluster, &state.members).contains(primary)
    {
        return Assessment::new(false, "Fenced", format!("the primary {primary} is fenced"));
    }
    if !state.split_brains.is_empty() {
        let names: Vec<&str> = state.split_brains.iter().map(String::as_str).collect();
        return Assessment::new(
            false,
            "SplitBrain",
            format!(
                "{} also run(s) as primary and are being demoted; -rw routes to {primary} only",
                names.join(", ")
            ),
        );
    }
    match unavailability(state.views.get(primary)) {
        None => Assessment::new(
            true,
            "Available",
            format!("{primary} serves as the primary"),
        ),
        Some((reason, _)) => {
            Assessment::new(false, "PrimaryUnavailable", format!("{primary}: {reason}"))
        }
    }
}

/// The standbys the primary's quorum should name, among those that stay: the streaming
/// ones; with `required` durability also those it names already, so that a standby
/// that stops streaming keeps commits waiting rather than silently dropping out.
fn quorum_standbys(state: &ClusterState, cluster: &DatabaseCluster) -> Vec<String> {
    let Some((primary_name, _)) = primary(state) else {
        return Vec::new();
    };
    let Some(view) = state.views.get(primary_name).filter(|v| v.reachable) else {
        return Vec::new();
    };
    let desired = desired_count(cluster);
    let stays = |name: &str| {
        name != primary_name && state.members.get(name).is_some_and(|m| m.number <= desired)
    };
    let mut names: BTreeSet<String> = view
        .standbys
        .iter()
        .filter(|standby| standby.streaming && stays(&standby.name))
        .map(|standby| standby.name.clone())
        .collect();
    if durability_required(cluster)
        && let Some(quorum) = Quorum::parse(&view.sync_names)
    {
        names.extend(quorum.standbys.into_iter().filter(|name| stays(name)));
    }
    names.into_iter().collect()
}

/// The `SynchronousReplication` condition (sync mode only): enough standbys stream for
/// the quorum commits ask for.
fn synchronous_assessment(state: &ClusterState, cluster: &DatabaseCluster) -> Option<Assessment> {
    if !build::synchronous(cluster) {
        return None;
    }
    let wanted = usize::try_from(
        cluster
            .spec
            .replication
            .as_ref()
            .and_then(|r| r.sync_replicas)
            .unwrap_or(1)
            .max(1),
    )
    .unwrap_or(1);
    let (primary_name, _) = primary(state)?;
    let view = state.views.get(primary_name).filter(|v| v.reachable)?;
    let streaming = view.standbys.iter().filter(|s| s.streaming).count();
    if streaming >= wanted {
        return Some(Assessment::new(
            true,
            "QuorumStreaming",
            format!("{streaming} standbys stream; commits wait for {wanted}"),
        ));
    }
    Some(if durability_required(cluster) {
        Assessment::new(
            false,
            "CommitsWaiting",
            format!(
                "only {streaming} of the {wanted} synchronous standbys commits wait for \
                 stream: commits wait until enough do (dataDurability: required)"
            ),
        )
    } else {
        Assessment::new(
            false,
            "ReducedDurability",
            format!(
                "only {streaming} of the {wanted} synchronous standbys stream: commits return \
                 with fewer confirmations (dataDurability: preferred)"
            ),
        )
    })
}

/// Whether the synchronous condition flipped since last seen, with an Event saying so.
fn synchronous_changed(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) -> bool {
    let Some(cluster) = state.cluster.clone() else {
        return false;
    };
    let Some(assessment) = synchronous_assessment(state, &cluster) else {
        return false;
    };
    let before = state.synchronous_ok.replace(assessment.status);
    let flipped = before != Some(assessment.status);
    if flipped && !assessment.status {
        effects.push(ClusterEffect::Record(Note::warning(
            assessment.reason,
            assessment.message,
        )));
    } else if flipped && before.is_some() {
        effects.push(ClusterEffect::Record(Note::normal(
            "QuorumStreaming",
            assessment.message,
        )));
    }
    flipped
}

/// Surplus instances (numbered above the desired count, never the primary) that the
/// primary does not wait for: asynchronous clusters at once; synchronous ones once the
/// primary's view shows its standby names without them.
fn removable(state: &ClusterState, cluster: &DatabaseCluster) -> Vec<String> {
    let desired = desired_count(cluster);
    let primary_sync_names = primary(state)
        .and_then(|(name, _)| state.views.get(name))
        .filter(|view| view.reachable)
        .map(|view| view.sync_names.as_str());
    let synchronous = build::synchronous(cluster);
    state
        .members
        .iter()
        .filter(|(_, member)| member.number > desired && !member.primary)
        .filter(|(name, _)| match primary_sync_names {
            Some(names) => !names.contains(&format!("\"{name}\"")),
            None => !synchronous,
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// The commands the instances need now, for those not already running one.
fn plan_commands(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let Some(cluster) = state.cluster.clone() else {
        return;
    };
    let wanted = &cluster.spec.parameters;
    let busy = |state: &ClusterState, name: &str| {
        state.commands.contains_key(name) || state.stale.contains(name)
    };
    let mut planned: Vec<(String, Command)> = Vec::new();

    // Fencing as the annotation asks, before anything else is asked of an instance.
    let fenced = fenced_instances(&cluster, &state.members);
    for name in state.members.keys() {
        let Some(view) = state.views.get(name).filter(|v| v.reachable) else {
            continue;
        };
        let wanted_fenced = fenced.contains(name);
        if view.fenced != wanted_fenced && !busy(state, name) {
            planned.push((name.clone(), Command::Fence(wanted_fenced)));
        }
    }

    // Configuration: parameters everywhere, and on the primary the sync standbys and
    // the slots of the instances that follow it.
    let primary_name = primary(state).map(|(name, _)| name.clone());
    for name in state.members.keys() {
        let Some(view) = state.views.get(name).filter(|v| v.reachable) else {
            continue;
        };
        if busy(state, name) || planned.iter().any(|(n, _)| n == name) {
            continue;
        }
        let parameters_differ = view.parameters.as_ref() != Some(wanted);
        let is_primary = primary_name.as_deref() == Some(name.as_str());
        if is_primary && view.serving_as_primary() && state.failover.is_none() {
            let staying = quorum_standbys(state, &cluster);
            let sync_names = build::synchronous_standby_names(&cluster, &staying);
            let slots: Vec<String> = state
                .members
                .keys()
                .filter(|member| *member != name)
                .cloned()
                .collect();
            if parameters_differ || view.sync_names != sync_names || slots_differ(view, &slots) {
                planned.push((
                    name.clone(),
                    Command::Reload {
                        parameters: wanted.clone(),
                        sync_names: Some(sync_names),
                        slots: Some(slots),
                    },
                ));
            }
        } else if parameters_differ && !is_primary {
            planned.push((
                name.clone(),
                Command::Reload {
                    parameters: wanted.clone(),
                    sync_names: None,
                    slots: None,
                },
            ));
        }
    }

    // Rolling restart: one instance at a time, only when nothing else is in flight and
    // every instance is ready with the wanted parameters; replicas first, primary last.
    let settled = planned.is_empty()
        && state.commands.is_empty()
        && state.stale.is_empty()
        && !state.members.is_empty()
        && state.members.keys().all(|name| {
            state
                .views
                .get(name)
                .is_some_and(|v| v.ready && v.parameters.as_ref() == Some(wanted))
        });
    if settled {
        let pending = |name: &String| {
            state
                .views
                .get(name)
                .is_some_and(|v| !v.pending_restart.is_empty())
        };
        let next = state
            .members
            .iter()
            .filter(|(name, member)| !member.primary && pending(name))
            .chain(
                state
                    .members
                    .iter()
                    .filter(|(name, member)| member.primary && pending(name)),
            )
            .map(|(name, _)| name.clone())
            .next();
        if let Some(name) = next {
            let parameters = state.views[&name].pending_restart.join(", ");
            effects.push(ClusterEffect::Record(
                Note::normal(
                    "RollingRestart",
                    format!("restarting {name} to apply {parameters}"),
                )
                .about(&name),
            ));
            planned.push((name, Command::Restart));
        }
    }

    for (instance, command) in planned {
        state.commands.insert(instance.clone(), command.clone());
        effects.push(ClusterEffect::Command { instance, command });
    }
}

#[cfg(test)]
mod tests {
    use castellan_crds::database_cluster::{
        DatabaseClusterSpec, Engine, Replication, ReplicationMode,
    };
    use serde_json::json;

    use super::super::replica::StandbyView;
    use super::*;
    use crate::instance_api::{Lsn, Slot, slot_name};

    fn cluster(replicas: i32, sync: bool, parameters: &[(&str, &str)]) -> Arc<DatabaseCluster> {
        let mut spec: DatabaseClusterSpec = serde_json::from_value(json!({
            "engine": "postgresql", "version": "15", "replicas": replicas,
            "storage": {"size": "1Gi"},
        }))
        .expect("a valid spec");
        spec.engine = Engine::Postgresql;
        spec.replication = sync.then_some(Replication {
            mode: ReplicationMode::Sync,
            sync_replicas: Some(1),
            data_durability: None,
        });
        spec.parameters = parameters
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut cluster = DatabaseCluster::new("db", spec);
        cluster.metadata.namespace = Some("default".into());
        cluster.metadata.generation = Some(1);
        Arc::new(cluster)
    }

    fn members(count: u32) -> BTreeMap<String, Member> {
        (1..=count)
            .map(|n| {
                (
                    format!("db-{n}"),
                    Member {
                        number: n,
                        address: Some(format!("127.0.0.{n}:8000")),
                        primary: n == 1,
                        cordoned: false,
                    },
                )
            })
            .collect()
    }

    fn view(name: &str, parameters: &[(&str, &str)]) -> InstanceView {
        InstanceView {
            name: name.into(),
            at: at(0),
            reachable: true,
            ready: true,
            running: true,
            role: Some(RunningRole::Replica),
            lsn: Lsn::parse("0/3000000"),
            receive_lsn: Lsn::parse("0/3000000"),
            parameters: Some(
                parameters
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..InstanceView::default()
        }
    }

    /// The operator's clock `seconds` into a test.
    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + seconds)
    }

    fn primary_view(standbys: &[&str], sync_names: &str) -> InstanceView {
        InstanceView {
            role: Some(RunningRole::Primary),
            leased: true,
            slots: standbys
                .iter()
                .map(|s| Slot {
                    name: slot_name(s),
                    active: true,
                    ..Slot::default()
                })
                .collect(),
            standbys: standbys
                .iter()
                .map(|s| StandbyView {
                    name: (*s).into(),
                    streaming: true,
                    lag_bytes: Some(0),
                })
                .collect(),
            sync_names: sync_names.into(),
            ..view("db-1", &[])
        }
    }

    /// A state with a settled cluster of `count` instances: db-1 serves as primary
    /// with every other instance streaming, in the quorum the spec asks for.
    fn settled(cluster: Arc<DatabaseCluster>, count: u32) -> ClusterState {
        let standbys: Vec<String> = (2..=count).map(|n| format!("db-{n}")).collect();
        let names: Vec<&str> = standbys.iter().map(String::as_str).collect();
        let desired = desired_count(&cluster) as usize;
        let staying: Vec<String> = standbys
            .iter()
            .take(desired.saturating_sub(1))
            .cloned()
            .collect();
        let sync_names = build::synchronous_standby_names(&cluster, &staying);
        let mut state = ClusterState {
            cluster: Some(cluster),
            members: members(count),
            ready: Some(true),
            primary: Some("db-1".into()),
            began: Some(at(0)),
            now: Some(at(0)),
            ..ClusterState::default()
        };
        state
            .views
            .insert("db-1".into(), primary_view(&names, &sync_names));
        for name in &standbys {
            state.views.insert(name.clone(), view(name, &[]));
        }
        state
    }

    fn step(state: ClusterState, event: ClusterEvent) -> (ClusterState, Vec<ClusterEffect>) {
        ClusterMachine::transition(state, event)
    }

    fn commands(effects: &[ClusterEffect]) -> Vec<(String, Command)> {
        effects
            .iter()
            .filter_map(|e| match e {
                ClusterEffect::Command { instance, command } => {
                    Some((instance.clone(), command.clone()))
                }
                _ => None,
            })
            .collect()
    }

    fn notes(effects: &[ClusterEffect]) -> Vec<&'static str> {
        effects
            .iter()
            .filter_map(|e| match e {
                ClusterEffect::Record(note) => Some(note.reason),
                _ => None,
            })
            .collect()
    }

    fn converge_order(effects: &[ClusterEffect]) -> Option<&ConvergeOrder> {
        effects.iter().find_map(|e| match e {
            ClusterEffect::Converge(order) => Some(order),
            _ => None,
        })
    }

    #[test]
    fn desired_starts_a_pass_when_idle() {
        let (state, effects) = step(
            ClusterState::default(),
            ClusterEvent::Desired(cluster(1, false, &[])),
        );
        assert!(state.converging);
        assert!(converge_order(&effects).is_some());
    }

    #[test]
    fn desired_during_a_pass_asks_for_another_afterwards() {
        let state = ClusterState {
            converging: true,
            ..ClusterState::default()
        };
        let (state, effects) = step(state, ClusterEvent::Desired(cluster(2, false, &[])));
        assert!(state.again && effects.is_empty());
        let found = Converged {
            members: members(1),
            ready: false,
        };
        let (state, effects) = step(state, ClusterEvent::Converged(Ok(found)));
        assert!(state.converging && !state.again);
        assert!(converge_order(&effects).is_some());
    }

    #[test]
    fn a_pass_tracks_its_members_and_announces_readiness_once() {
        let state = ClusterState {
            cluster: Some(cluster(2, false, &[])),
            converging: true,
            ..ClusterState::default()
        };
        let found = Converged {
            members: members(2),
            ready: true,
        };
        let (state, effects) = step(state, ClusterEvent::Converged(Ok(found.clone())));
        assert!(!state.converging);
        assert_eq!(notes(&effects), vec!["ClusterReady"]);
        let tracked = effects.iter().find_map(|e| match e {
            ClusterEffect::Track(t) => Some(t.clone()),
            _ => None,
        });
        assert_eq!(
            tracked,
            Some(vec![
                ("db-1".into(), Some("127.0.0.1:8000".into())),
                ("db-2".into(), Some("127.0.0.2:8000".into()))
            ])
        );
        let state = ClusterState {
            converging: true,
            ..state
        };
        let (_, effects) = step(state, ClusterEvent::Converged(Ok(found)));
        assert!(notes(&effects).is_empty(), "no second ClusterReady");
    }

    #[test]
    fn losing_readiness_is_a_warning() {
        let state = ClusterState {
            converging: true,
            ..settled(cluster(2, false, &[]), 2)
        };
        let found = Converged {
            members: members(2),
            ready: false,
        };
        let (_, effects) = step(state, ClusterEvent::Converged(Ok(found)));
        assert_eq!(notes(&effects), vec!["InstancesNotReady"]);
    }

    #[test]
    fn failures_back_off_and_degrade_after_the_limit() {
        let mut state = ClusterState {
            cluster: Some(cluster(1, false, &[])),
            ..ClusterState::default()
        };
        let mut delays = Vec::new();
        for n in 1..=DEGRADED_AFTER + 1 {
            state.converging = true;
            let (next, effects) = step(state, ClusterEvent::Converged(Err(format!("boom {n}"))));
            state = next;
            for effect in &effects {
                if let ClusterEffect::RetryAfter(delay) = effect {
                    delays.push(delay.as_secs());
                }
            }
            let expect_note = n == DEGRADED_AFTER;
            assert_eq!(
                notes(&effects) == vec!["Degraded"],
                expect_note,
                "pass {n}: {effects:?}"
            );
        }
        assert_eq!(delays, vec![1, 2, 4, 8]);
        assert_eq!(
            state.degraded.as_deref(),
            Some("boom 4"),
            "keeps the latest reason"
        );
        assert!(!state.converging);
        // The retry timer starts the next pass, which carries the reason into status.
        let (state, effects) = step(state, ClusterEvent::Retry);
        assert_eq!(
            converge_order(&effects)
                .and_then(|o| o.degraded.clone())
                .as_deref(),
            Some("boom 4")
        );
        // And a good pass recovers.
        let found = Converged {
            members: members(1),
            ready: true,
        };
        let (state, effects) = step(state, ClusterEvent::Converged(Ok(found)));
        assert_eq!(notes(&effects), vec!["Recovered", "ClusterReady"]);
        assert_eq!((state.failures, state.degraded), (0, None));
    }

    #[test]
    fn retry_delays_are_capped() {
        assert_eq!(retry_delay(1), Duration::from_secs(1));
        assert_eq!(retry_delay(6), Duration::from_secs(30));
        assert_eq!(retry_delay(100), MAX_RETRY_DELAY);
    }

    #[test]
    fn retry_during_a_pass_does_nothing() {
        let state = ClusterState {
            cluster: Some(cluster(1, false, &[])),
            converging: true,
            ..ClusterState::default()
        };
        let (state, effects) = step(state, ClusterEvent::Retry);
        assert!(effects.is_empty() && !state.again);
    }

    #[test]
    fn a_view_that_changes_readiness_starts_a_pass() {
        let mut down = view("db-2", &[]);
        down.ready = false;
        let state = settled(cluster(2, false, &[]), 2);
        let (state, effects) = step(state, ClusterEvent::Observed(down.clone()));
        assert!(state.converging && converge_order(&effects).is_some());
        // The same view again does not.
        let mut again = state;
        again.converging = false;
        let (_, effects) = step(again, ClusterEvent::Observed(down));
        assert!(converge_order(&effects).is_none());
        // Nor does a report from an instance that is gone.
        let gone = settled(cluster(2, false, &[]), 2);
        let (_, effects) = step(gone, ClusterEvent::Observed(view("db-9", &[])));
        assert!(effects.is_empty());
    }

    #[test]
    fn changed_parameters_are_reloaded_everywhere_with_sync_names_on_the_primary() {
        let mut state = settled(cluster(2, true, &[("work_mem", "8MB")]), 2);
        state
            .views
            .insert("db-1".into(), primary_view(&["db-2"], "ANY 1 (\"db-2\")"));
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        let wanted = BTreeMap::from([("work_mem".to_owned(), "8MB".to_owned())]);
        assert_eq!(
            commands(&effects),
            vec![
                (
                    "db-1".into(),
                    Command::Reload {
                        parameters: wanted.clone(),
                        sync_names: Some("ANY 1 (\"db-2\")".into()),
                        slots: Some(vec!["db-2".into()])
                    }
                ),
                (
                    "db-2".into(),
                    Command::Reload {
                        parameters: wanted,
                        sync_names: None,
                        slots: None
                    }
                ),
            ]
        );
        // Nothing is sent twice while they run.
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert!(commands(&effects).is_empty());
    }

    #[test]
    fn a_spec_change_is_reloaded_as_soon_as_it_is_desired() {
        let state = settled(cluster(2, false, &[]), 2);
        let (_, effects) = step(
            state,
            ClusterEvent::Desired(cluster(2, false, &[("work_mem", "8MB")])),
        );
        assert!(converge_order(&effects).is_some());
        assert_eq!(
            commands(&effects)
                .iter()
                .map(|(name, _)| name.as_str())
                .collect::<Vec<_>>(),
            vec!["db-1", "db-2"]
        );
    }

    #[test]
    fn a_new_streaming_standby_joins_the_quorum() {
        let mut state = settled(cluster(2, true, &[]), 2);
        state
            .views
            .insert("db-1".into(), primary_view(&["db-2"], ""));
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert_eq!(
            commands(&effects),
            vec![(
                "db-1".into(),
                Command::Reload {
                    parameters: BTreeMap::new(),
                    sync_names: Some("ANY 1 (\"db-2\")".into()),
                    slots: Some(vec!["db-2".into()])
                }
            )]
        );
    }

    #[test]
    fn a_surplus_sync_standby_leaves_the_quorum_before_it_is_removed() {
        // Scaled 3 → 2: db-3 is surplus but the primary still names it.
        let mut state = settled(cluster(2, true, &[]), 3);
        state.views.insert(
            "db-1".into(),
            primary_view(&["db-2", "db-3"], "ANY 1 (\"db-2\", \"db-3\")"),
        );
        let (mut state, effects) = step(state, ClusterEvent::Desired(cluster(2, true, &[])));
        assert_eq!(
            converge_order(&effects).map(|o| o.remove.clone()),
            Some(vec![]),
            "db-3 stays while the primary names it"
        );
        assert_eq!(
            commands(&effects),
            vec![(
                "db-1".into(),
                Command::Reload {
                    parameters: BTreeMap::new(),
                    sync_names: Some("ANY 1 (\"db-2\")".into()),
                    slots: Some(vec!["db-2".into(), "db-3".into()])
                }
            )]
        );
        // Once the primary shows the new names, the next pass removes db-3.
        state.commands.clear();
        state.converging = false;
        state.views.insert(
            "db-1".into(),
            primary_view(&["db-2", "db-3"], "ANY 1 (\"db-2\")"),
        );
        let (_, effects) = step(state, ClusterEvent::Retry);
        assert_eq!(
            converge_order(&effects).map(|o| o.remove.clone()),
            Some(vec!["db-3".to_owned()])
        );
    }

    #[test]
    fn surplus_async_replicas_go_at_once_but_never_the_primary() {
        let mut state = settled(cluster(1, false, &[]), 3);
        state.views.clear();
        let (_, effects) = step(state, ClusterEvent::Retry);
        assert_eq!(
            converge_order(&effects).map(|o| o.remove.clone()),
            Some(vec!["db-2".to_owned(), "db-3".to_owned()])
        );
    }

    #[test]
    fn sync_surplus_waits_while_the_primary_is_unknown() {
        let mut state = settled(cluster(1, true, &[]), 2);
        state.views.clear();
        let (_, effects) = step(state, ClusterEvent::Retry);
        assert_eq!(
            converge_order(&effects).map(|o| o.remove.clone()),
            Some(vec![])
        );
    }

    fn pending(mut view: InstanceView) -> InstanceView {
        view.pending_restart = vec!["max_connections".into()];
        view
    }

    #[test]
    fn rolling_restart_goes_replicas_first_one_at_a_time_primary_last() {
        let params = [("max_connections", "150")];
        let mut state = settled(cluster(3, false, &params), 3);
        for n in 1..=3 {
            let name = format!("db-{n}");
            let fresh = match n {
                1 => InstanceView {
                    parameters: view(&name, &params).parameters,
                    ..primary_view(&["db-2", "db-3"], "")
                },
                _ => view(&name, &params),
            };
            state.views.insert(name.clone(), pending(fresh));
        }
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(pending(view("db-3", &params))),
        );
        assert_eq!(commands(&effects), vec![("db-2".into(), Command::Restart)]);
        assert_eq!(notes(&effects), vec!["RollingRestart"]);
        // Nothing else while it runs …
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(pending(view("db-3", &params))),
        );
        assert!(commands(&effects).is_empty());
        // … nor after it finished, until a fresh view of it arrives.
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-2".into(),
                command: Command::Restart,
                outcome: Ok(json!({"restarted": true})),
            },
        );
        assert_eq!(notes(&effects), vec!["Restarted"]);
        assert!(commands(&effects).is_empty());
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-2", &params)));
        assert_eq!(commands(&effects), vec![("db-3".into(), Command::Restart)]);
        let (state, _) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-3".into(),
                command: Command::Restart,
                outcome: Ok(Value::Null),
            },
        );
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-3", &params)));
        assert_eq!(commands(&effects), vec![("db-1".into(), Command::Restart)]);
        let (state, _) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: Command::Restart,
                outcome: Ok(Value::Null),
            },
        );
        let done = InstanceView {
            parameters: view("db-1", &params).parameters,
            ..primary_view(&["db-2", "db-3"], "")
        };
        let (_, effects) = step(state, ClusterEvent::Observed(done));
        assert!(commands(&effects).is_empty(), "all done: {effects:?}");
    }

    #[test]
    fn no_restart_while_an_instance_is_not_ready() {
        let params = [("max_connections", "150")];
        let mut state = settled(cluster(2, false, &params), 2);
        let primary = InstanceView {
            parameters: view("db-1", &params).parameters,
            ..primary_view(&["db-2"], "")
        };
        state.views.insert("db-1".into(), pending(primary));
        let mut down = pending(view("db-2", &params));
        down.ready = false;
        let (_, effects) = step(state, ClusterEvent::Observed(down));
        assert!(commands(&effects).is_empty());
    }

    #[test]
    fn a_failed_command_is_a_warning_and_frees_the_instance() {
        let mut state = settled(cluster(1, false, &[]), 1);
        state.commands.insert("db-1".into(), Command::Restart);
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: Command::Restart,
                outcome: Err("no answer".into()),
            },
        );
        assert_eq!(notes(&effects), vec!["CommandFailed"]);
        assert!(state.commands.is_empty() && state.stale.contains("db-1"));
    }

    #[test]
    fn members_that_left_are_forgotten() {
        let mut state = settled(cluster(1, false, &[]), 2);
        state.converging = true;
        state.commands.insert("db-2".into(), Command::Restart);
        let found = Converged {
            members: members(1),
            ready: true,
        };
        let (state, _) = step(state, ClusterEvent::Converged(Ok(found)));
        assert!(!state.views.contains_key("db-2") && state.commands.is_empty());
    }

    #[test]
    fn a_failing_replica_actor_is_a_warning() {
        let event = ClusterEvent::ReplicaFailing {
            instance: "db-2".into(),
            reason: "panicked".into(),
        };
        let (_, effects) = step(settled(cluster(2, false, &[]), 2), event);
        assert_eq!(notes(&effects), vec!["ReplicaActorFailing"]);
    }

    #[test]
    #[should_panic(expected = "injected fault: test")]
    fn an_injected_fault_panics() {
        let _ = step(
            ClusterState::default(),
            ClusterEvent::InjectedFault("test".into()),
        );
    }

    // ---- The primary: lease, failover, split brain, fencing, switchover ----

    fn unreachable(name: &str, seconds: u64) -> InstanceView {
        InstanceView::unreachable(name, at(seconds), "connection refused".into())
    }

    fn grants(effects: &[ClusterEffect]) -> Vec<(String, LeaseGrant)> {
        effects
            .iter()
            .filter_map(|e| match e {
                ClusterEffect::Grant { instance, grant } => Some((instance.clone(), *grant)),
                _ => None,
            })
            .collect()
    }

    fn at_lsn(mut view: InstanceView, seconds: u64, lsn: &str) -> InstanceView {
        view.at = at(seconds);
        view.lsn = Lsn::parse(lsn);
        view.receive_lsn = Lsn::parse(lsn);
        view
    }

    /// The state with no pass running (as if the last one finished).
    fn idle(mut state: ClusterState) -> ClusterState {
        state.converging = false;
        state
    }

    /// Steps through `events` with every pass finishing at once; the effects of all.
    fn steps(
        mut state: ClusterState,
        events: Vec<ClusterEvent>,
    ) -> (ClusterState, Vec<ClusterEffect>) {
        let mut all = Vec::new();
        for event in events {
            state.converging = false;
            let (next, effects) = step(state, event);
            state = next;
            all.extend(effects);
        }
        (state, all)
    }

    /// A settled 3-instance cluster (sync when asked) whose primary stopped answering
    /// at second 1; the replicas, db-3 the most advanced, are seen at `seconds`.
    fn primary_lost(sync: bool, seconds: u64) -> (ClusterState, Vec<ClusterEffect>) {
        let state = settled(cluster(3, sync, &[]), 3);
        steps(
            state,
            vec![
                ClusterEvent::Observed(unreachable("db-1", 1)),
                ClusterEvent::Observed(at_lsn(view("db-3", &[]), seconds, "0/6000000")),
                ClusterEvent::Observed(at_lsn(view("db-2", &[]), seconds, "0/5000000")),
            ],
        )
    }

    #[test]
    fn a_serving_primary_gets_a_lease_from_its_view_and_replicas_do_not() {
        let state = settled(cluster(3, false, &[]), 3);
        let mut primary = state.views["db-1"].clone();
        primary.at = at(7);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        let granted = grants(&effects);
        assert_eq!(granted.len(), 1);
        assert_eq!(granted[0].0, "db-1");
        assert_eq!(granted[0].1.valid_until(), at(7) + LEASE_DURATION);
        assert_eq!(state.leased_until, Some(at(7) + LEASE_DURATION));
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert!(grants(&effects).is_empty());
    }

    #[test]
    fn a_primary_waiting_for_its_lease_gets_one() {
        let state = settled(cluster(1, false, &[]), 1);
        let mut waiting = primary_view(&[], "");
        waiting.ready = false;
        waiting.running = false;
        waiting.leased = false;
        let (_, effects) = step(state, ClusterEvent::Observed(waiting));
        assert_eq!(grants(&effects).len(), 1);
    }

    #[test]
    fn a_short_outage_is_not_a_failover() {
        let (state, effects) = primary_lost(false, 3);
        assert!(!notes(&effects).contains(&"FailingOver"));
        assert!(state.failover.is_none());
        assert_eq!(state.unavailable_since, Some(at(1)));
        // It comes back: the clock starts over.
        let back = InstanceView {
            at: at(4),
            ..primary_view(&["db-2", "db-3"], "")
        };
        let (state, effects) = step(state, ClusterEvent::Observed(back));
        assert!(state.unavailable_since.is_none());
        assert_eq!(grants(&effects).len(), 1);
    }

    #[test]
    fn after_the_delay_the_most_advanced_replica_is_promoted_once_the_lease_ended() {
        // Last lease granted at second 0 (settled), ending at 4 s; the delay is 5 s.
        let (state, effects) = primary_lost(false, 6);
        assert_eq!(notes(&effects), vec!["FailingOver", "Promoting"]);
        let promoted = commands(&effects);
        assert_eq!(promoted.len(), 1);
        assert_eq!(promoted[0].0, "db-3", "the most advanced replica");
        let Command::Promote(request) = &promoted[0].1 else {
            panic!("a promotion: {promoted:?}")
        };
        assert_eq!(request.lease.valid_until(), at(6) + LEASE_DURATION);
        assert_eq!(request.slots, vec!["db-1".to_owned(), "db-2".to_owned()]);
        let failover = state.failover.clone().expect("failing over");
        assert_eq!(failover.target.as_deref(), Some("db-3"));
        assert_eq!(
            state.primary.as_deref(),
            Some("db-1"),
            "not before it is done"
        );
        // No lease for the old primary while it fails over, even if it answers.
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(InstanceView {
                at: at(7),
                ..primary_view(&[], "")
            }),
        );
        assert!(grants(&effects).is_empty());
        // Promoted: the new primary is the primary, status follows.
        let (state, effects) = step(
            idle(state),
            ClusterEvent::Finished {
                instance: "db-3".into(),
                command: promoted[0].1.clone(),
                outcome: Ok(json!({"changed": true})),
            },
        );
        assert_eq!(state.primary.as_deref(), Some("db-3"));
        assert!(state.failover.is_none());
        assert_eq!(notes(&effects), vec!["FailedOver"]);
        let order = converge_order(&effects).expect("a pass writes the new primary");
        assert_eq!(order.primary.as_deref(), Some("db-3"));
        assert!(
            order.primary_condition.status
                || order.primary_condition.reason == "PrimaryUnavailable"
        );
    }

    #[test]
    fn no_promotion_while_the_old_lease_may_run() {
        let mut state = settled(cluster(3, false, &[]), 3);
        // A grant that ends late (a slow poll): promotion waits for it.
        state.leased_until = Some(at(20));
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-1", 1)));
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 10, "0/5000000")),
        );
        assert_eq!(notes(&effects), vec!["FailingOver"]);
        assert!(commands(&effects).is_empty());
        let blocked = state.failover.as_ref().and_then(|f| f.blocked.clone());
        assert!(blocked.is_some_and(|b| b.contains("lease")));
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 21, "0/5000000")),
        );
        assert_eq!(commands(&effects).len(), 1);
    }

    #[test]
    fn a_new_operator_waits_one_lease_before_promoting() {
        // No grant of its own yet: grants of the previous operator may still run.
        let mut state = settled(cluster(2, false, &[]), 2);
        state.leased_until = None;
        state.began = Some(at(100));
        state.now = Some(at(100));
        state.unavailable_since = Some(at(90));
        let (state, effects) = step(state, ClusterEvent::Observed(unreachable("db-1", 101)));
        assert_eq!(notes(&effects), vec!["FailingOver"]);
        assert!(commands(&effects).is_empty());
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 105, "0/5000000")),
        );
        assert!(matches!(commands(&effects)[..], [(_, Command::Promote(_))]));
    }

    #[test]
    fn required_durability_waits_for_the_quorum_and_says_why() {
        // ANY 1 (db-2, db-3): with db-3 unreachable nothing proves db-2 has every commit.
        let state = settled(cluster(3, true, &[]), 3);
        assert_eq!(state.views["db-1"].sync_names, "ANY 1 (\"db-2\", \"db-3\")");
        let primary = state_view_at(&state, "db-1", 0);
        let (state, effects) = steps(
            state,
            vec![
                ClusterEvent::Observed(primary),
                ClusterEvent::Observed(unreachable("db-1", 1)),
                ClusterEvent::Observed(unreachable("db-3", 1)),
                ClusterEvent::Observed(at_lsn(view("db-2", &[]), 7, "0/5000000")),
            ],
        );
        assert_eq!(notes(&effects), vec!["FailingOver", "FailoverBlocked"]);
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| matches!(c, Command::Promote(_)))
        );
        assert_eq!(primary_assessment(&state).reason, "FailoverBlocked");
        // db-3 answers again: both seen, the most advanced is promoted.
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-3", &[]), 8, "0/6000000")),
        );
        assert!(matches!(&commands(&effects)[..], [(name, Command::Promote(_))] if name == "db-3"));
    }

    fn state_view_at(state: &ClusterState, name: &str, seconds: u64) -> InstanceView {
        InstanceView {
            at: at(seconds),
            ..state.views[name].clone()
        }
    }

    #[test]
    fn preferred_durability_promotes_what_it_can_see() {
        let mut spec = (*cluster(3, true, &[])).clone();
        if let Some(replication) = spec.spec.replication.as_mut() {
            replication.data_durability = Some(DataDurability::Preferred);
        }
        let state = settled(Arc::new(spec), 3);
        let (state, _) = step(
            state,
            ClusterEvent::Observed(state_view_at(&settled(cluster(3, true, &[]), 3), "db-1", 0)),
        );
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-1", 1)));
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-3", 1)));
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 7, "0/5000000")),
        );
        assert!(matches!(&commands(&effects)[..], [(name, Command::Promote(_))] if name == "db-2"));
    }

    #[test]
    fn a_failed_promotion_chooses_again() {
        let (state, effects) = primary_lost(false, 6);
        let promote = commands(&effects)[0].1.clone();
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-3".into(),
                command: promote,
                outcome: Err("timed out".into()),
            },
        );
        assert_eq!(notes(&effects), vec!["PromotionFailed"]);
        assert_eq!(state.primary.as_deref(), Some("db-1"));
        assert!(state.failover.as_ref().is_some_and(|f| f.target.is_none()));
    }

    #[test]
    fn an_empty_primary_volume_fails_over_without_the_delay() {
        let state = settled(cluster(2, false, &[]), 2);
        let lost = InstanceView {
            at: at(5),
            reachable: true,
            problem: Some("the volume is empty".into()),
            ..InstanceView::default()
        };
        let lost = InstanceView {
            name: "db-1".into(),
            ..lost
        };
        let (_, effects) = step(state, ClusterEvent::Observed(lost));
        assert_eq!(notes(&effects), vec!["FailingOver", "Promoting"]);
        assert!(grants(&effects).is_empty(), "no lease for an empty volume");
    }

    #[test]
    fn a_primary_running_as_replica_fails_over_at_once() {
        let state = settled(cluster(2, false, &[]), 2);
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-1", &[]), 5, "0/1000000")),
        );
        assert_eq!(notes(&effects)[0], "FailingOver");
    }

    #[test]
    fn a_split_brain_is_reported_and_demoted_at_once() {
        let state = settled(cluster(3, false, &[]), 3);
        let rogue = InstanceView {
            name: "db-2".into(),
            ..primary_view(&[], "")
        };
        let (state, effects) = step(state, ClusterEvent::Observed(rogue.clone()));
        assert_eq!(notes(&effects), vec!["SplitBrain"]);
        assert_eq!(commands(&effects), vec![("db-2".into(), Command::Demote)]);
        assert!(grants(&effects).is_empty(), "never a lease for it");
        let order = primary_assessment(&state);
        assert_eq!(order.reason, "SplitBrain");
        // Reported once, not on every view.
        let mut again = state;
        again.commands.clear();
        let (_, effects) = step(again, ClusterEvent::Observed(rogue));
        assert!(notes(&effects).is_empty());
    }

    #[test]
    fn a_former_primary_waiting_for_a_lease_is_demoted_once_the_primary_serves() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.primary = Some("db-2".into());
        state.views.insert(
            "db-2".into(),
            InstanceView {
                name: "db-2".into(),
                ..primary_view(&["db-1"], "")
            },
        );
        let waiting = InstanceView {
            name: "db-1".into(),
            reachable: true,
            role: Some(RunningRole::Primary),
            ..InstanceView::default()
        };
        let (_, effects) = step(state.clone(), ClusterEvent::Observed(waiting.clone()));
        assert_eq!(commands(&effects), vec![("db-1".into(), Command::Demote)]);
        assert!(notes(&effects).is_empty(), "rejoining is no split brain");
        // Without a serving primary to follow, it waits.
        let mut down = state;
        down.views.insert("db-2".into(), unreachable("db-2", 0));
        let (_, effects) = step(down, ClusterEvent::Observed(waiting));
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| *c == Command::Demote)
        );
    }

    #[test]
    fn a_failover_gives_way_to_the_old_primary_when_nothing_can_be_promoted() {
        let state = settled(cluster(2, false, &[]), 2);
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-1", 1)));
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-2", 1)));
        let (state, effects) = step(state, ClusterEvent::Observed(unreachable("db-2", 8)));
        assert!(notes(&effects).contains(&"FailoverBlocked"));
        assert!(state.failover.is_some());
        let back = InstanceView {
            at: at(9),
            ready: false,
            running: false,
            ..primary_view(&[], "")
        };
        let (state, effects) = step(state, ClusterEvent::Observed(back));
        assert_eq!(notes(&effects), vec!["FailoverCancelled"]);
        assert!(state.failover.is_none());
    }

    fn annotated(cluster: &Arc<DatabaseCluster>, key: &str, value: &str) -> Arc<DatabaseCluster> {
        let mut cluster = (**cluster).clone();
        cluster.annotations_mut().insert(key.into(), value.into());
        Arc::new(cluster)
    }

    #[test]
    fn fencing_follows_the_annotation_and_a_fenced_primary_is_not_failed_over() {
        let plain = cluster(2, false, &[]);
        let state = settled(annotated(&plain, FENCED_ANNOTATION, r#"["db-2"]"#), 2);
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert_eq!(
            commands(&effects),
            vec![("db-2".into(), Command::Fence(true))]
        );
        // Everyone: the primary too; it is not replaced.
        let mut all = settled(annotated(&plain, FENCED_ANNOTATION, r#"["*"]"#), 2);
        all.commands.clear();
        let (all, _) = step(all, ClusterEvent::Observed(unreachable("db-1", 1)));
        let (all, effects) = step(
            all,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 30, "0/1")),
        );
        assert!(all.failover.is_none() && !notes(&effects).contains(&"FailingOver"));
        assert_eq!(primary_assessment(&all).reason, "Fenced");
        // Unfenced when the annotation goes.
        let mut fenced = view("db-2", &[]);
        fenced.fenced = true;
        let mut later = state;
        later.commands.clear();
        later.stale.clear();
        later.cluster = Some(plain);
        let (_, effects) = step(later, ClusterEvent::Observed(fenced));
        assert_eq!(
            commands(&effects),
            vec![("db-2".into(), Command::Fence(false))]
        );
    }

    #[test]
    fn a_switchover_stops_the_primary_waits_for_its_last_wal_then_promotes() {
        let plain = cluster(3, false, &[]);
        let state = settled(annotated(&plain, SWITCHOVER_ANNOTATION, "db-2"), 3);
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(idle(state), ClusterEvent::Observed(primary));
        assert_eq!(notes(&effects), vec!["Switchover"]);
        assert_eq!(commands(&effects), vec![("db-1".into(), Command::Demote)]);
        assert!(
            grants(&effects).is_empty(),
            "no more leases for the old primary"
        );
        let order = converge_order(&effects).expect("the old primary leaves -rw");
        assert!(order.failover.as_ref().is_some_and(|f| f.switchover));
        // Stopped at 0/7000028: the target must receive past it.
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: Command::Demote,
                outcome: Ok(json!({"fenced": false, "checkpointLsn": "0/7000028"})),
            },
        );
        assert!(commands(&effects).is_empty(), "db-2 is at 0/3000000");
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 2, "0/70000A0")),
        );
        let promoted = commands(&effects);
        assert!(matches!(&promoted[..], [(name, Command::Promote(_))] if name == "db-2"));
        let (state, effects) = step(
            idle(state),
            ClusterEvent::Finished {
                instance: "db-2".into(),
                command: promoted[0].1.clone(),
                outcome: Ok(json!({"changed": true})),
            },
        );
        assert_eq!(state.primary.as_deref(), Some("db-2"));
        assert!(state.switchover.is_none());
        assert_eq!(notes(&effects), vec!["SwitchedOver"]);
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, ClusterEffect::ClearSwitchover))
        );
    }

    #[test]
    fn a_switchover_to_an_instance_that_cannot_take_over_is_refused() {
        let plain = cluster(2, false, &[]);
        let state = settled(annotated(&plain, SWITCHOVER_ANNOTATION, "db-7"), 2);
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert_eq!(notes(&effects), vec!["SwitchoverRefused"]);
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, ClusterEffect::ClearSwitchover))
        );
        assert!(state.switchover.is_none());
    }

    #[test]
    fn a_switchover_whose_target_does_not_catch_up_becomes_a_failover() {
        let plain = cluster(3, false, &[]);
        let state = settled(annotated(&plain, SWITCHOVER_ANNOTATION, "db-2"), 3);
        let (state, _) = step(
            state.clone(),
            ClusterEvent::Observed(state_view_at(&state, "db-1", 1)),
        );
        let (state, _) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: Command::Demote,
                outcome: Ok(json!({"checkpointLsn": "0/9000000"})),
            },
        );
        let late = 2 + SWITCHOVER_CATCH_UP.as_secs();
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), late, "0/5000000")),
        );
        assert!(notes(&effects).contains(&"SwitchoverFailed"));
        assert!(state.switchover.is_none());
        assert!(state.failover.is_some());
    }

    #[test]
    fn draining_the_primarys_node_switches_over_to_a_replica_elsewhere() {
        let mut state = settled(cluster(3, false, &[]), 3);
        if let Some(member) = state.members.get_mut("db-1") {
            member.cordoned = true;
        }
        if let Some(member) = state.members.get_mut("db-3") {
            member.cordoned = true;
        }
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert_eq!(notes(&effects), vec!["Switchover"]);
        assert_eq!(
            state.switchover.as_ref().map(|s| s.to.as_str()),
            Some("db-2")
        );
    }

    #[test]
    fn with_required_durability_a_named_standby_that_stops_streaming_stays_named() {
        let mut state = settled(cluster(3, true, &[]), 3);
        let mut primary = primary_view(&["db-2", "db-3"], "ANY 1 (\"db-2\", \"db-3\")");
        primary.standbys.retain(|s| s.name == "db-2");
        state.views.insert("db-1".into(), primary.clone());
        let (_, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert!(
            commands(&effects).is_empty(),
            "db-3 stays in the quorum: {effects:?}"
        );
        // Preferred drops it.
        let mut spec = (*cluster(3, true, &[])).clone();
        if let Some(replication) = spec.spec.replication.as_mut() {
            replication.data_durability = Some(DataDurability::Preferred);
        }
        let mut state = settled(Arc::new(spec), 3);
        state.views.insert("db-1".into(), primary.clone());
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(matches!(
            &commands(&effects)[..],
            [(_, Command::Reload { sync_names: Some(names), .. })] if names == "ANY 1 (\"db-2\")"
        ));
    }

    #[test]
    fn too_few_streaming_standbys_is_a_condition_and_an_event() {
        let state = settled(cluster(2, true, &[]), 2);
        let mut alone = primary_view(&["db-2"], "ANY 1 (\"db-2\")");
        alone.standbys.clear();
        let (state, effects) = steps(
            state.clone(),
            vec![
                ClusterEvent::Observed(state_view_at(&state, "db-1", 0)),
                ClusterEvent::Observed(alone),
            ],
        );
        assert_eq!(notes(&effects), vec!["CommitsWaiting"]);
        let order = converge_order(&effects).expect("status shows it");
        assert!(
            order
                .synchronous_condition
                .as_ref()
                .is_some_and(|a| a.status)
        );
        assert_eq!(
            synchronous_assessment(&state, state.cluster.as_ref().expect("cluster"))
                .map(|a| a.reason),
            Some("CommitsWaiting")
        );
        let (_, effects) = steps(
            state,
            vec![ClusterEvent::Observed(primary_view(
                &["db-2"],
                "ANY 1 (\"db-2\")",
            ))],
        );
        assert_eq!(notes(&effects), vec!["QuorumStreaming"]);
    }

    #[test]
    fn the_primary_is_told_to_make_missing_slots() {
        let mut state = settled(cluster(2, false, &[]), 2);
        let mut primary = primary_view(&["db-2"], "");
        primary.slots.clear();
        state.views.insert("db-1".into(), primary.clone());
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(matches!(
            &commands(&effects)[..],
            [(_, Command::Reload { slots: Some(slots), .. })] if slots == &vec!["db-2".to_owned()]
        ));
    }
}
