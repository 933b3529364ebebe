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
//!   only when every instance is ready.
//!
//! Pure: `shell.rs` performs the effects and feeds their outcomes back as events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use castellan_actors::StateMachine;
use castellan_crds::DatabaseCluster;
use serde_json::Value;

use super::build;
use super::replica::{Command, InstanceView};

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
                let previous = state.views.insert(name.clone(), view.clone());
                state.stale.remove(&name);
                let changed =
                    previous.is_none_or(|p| p.ready != view.ready || p.reachable != view.reachable);
                if changed {
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
                let note = match (&command, outcome) {
                    (Command::Reload { .. }, Ok(_)) => {
                        Note::normal("Reloaded", format!("{instance} reloaded its configuration"))
                    }
                    (Command::Restart, Ok(_)) => {
                        Note::normal("Restarted", format!("{instance} restarted"))
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
    state.members.iter().find(|(_, member)| member.primary)
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
    let desired = desired_count(&cluster);
    let wanted = &cluster.spec.parameters;
    let busy = |state: &ClusterState, name: &str| {
        state.commands.contains_key(name) || state.stale.contains(name)
    };
    let mut planned: Vec<(String, Command)> = Vec::new();

    // Configuration: parameters everywhere, and on the primary the sync standbys among
    // the streaming ones that stay.
    for (name, member) in &state.members {
        let Some(view) = state.views.get(name).filter(|v| v.reachable) else {
            continue;
        };
        if busy(state, name) {
            continue;
        }
        let parameters_differ = view.parameters.as_ref() != Some(wanted);
        if member.primary {
            let staying: Vec<String> = view
                .standbys
                .iter()
                .filter(|standby| standby.streaming)
                .filter(|standby| {
                    state
                        .members
                        .get(&standby.name)
                        .is_some_and(|m| m.number <= desired)
                })
                .map(|standby| standby.name.clone())
                .collect();
            let sync_names = build::synchronous_standby_names(&cluster, &staying);
            if parameters_differ || view.sync_names != sync_names {
                planned.push((
                    name.clone(),
                    Command::Reload {
                        parameters: wanted.clone(),
                        sync_names: Some(sync_names),
                    },
                ));
            }
        } else if parameters_differ {
            planned.push((
                name.clone(),
                Command::Reload {
                    parameters: wanted.clone(),
                    sync_names: None,
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
                    },
                )
            })
            .collect()
    }

    fn view(name: &str, parameters: &[(&str, &str)]) -> InstanceView {
        InstanceView {
            name: name.into(),
            reachable: true,
            ready: true,
            parameters: Some(
                parameters
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..InstanceView::default()
        }
    }

    fn primary_view(standbys: &[&str], sync_names: &str) -> InstanceView {
        InstanceView {
            role: Some("primary".into()),
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

    /// A state with a settled 3-instance async cluster.
    fn settled(cluster: Arc<DatabaseCluster>, count: u32) -> ClusterState {
        let mut state = ClusterState {
            cluster: Some(cluster),
            members: members(count),
            ready: Some(true),
            ..ClusterState::default()
        };
        for n in 1..=count {
            let name = format!("db-{n}");
            state.views.insert(name.clone(), view(&name, &[]));
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
                        sync_names: Some("ANY 1 (\"db-2\")".into())
                    }
                ),
                (
                    "db-2".into(),
                    Command::Reload {
                        parameters: wanted,
                        sync_names: None
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
                    sync_names: Some("ANY 1 (\"db-2\")".into())
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
                    sync_names: Some("ANY 1 (\"db-2\")".into())
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
            state
                .views
                .insert(name.clone(), pending(view(&name, &params)));
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
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-1", &params)));
        assert!(commands(&effects).is_empty(), "all done: {effects:?}");
    }

    #[test]
    fn no_restart_while_an_instance_is_not_ready() {
        let params = [("max_connections", "150")];
        let mut state = settled(cluster(2, false, &params), 2);
        state
            .views
            .insert("db-1".into(), pending(view("db-1", &params)));
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
}
