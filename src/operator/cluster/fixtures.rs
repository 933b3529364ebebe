//! What the cluster machine's tests share: a cluster spec, members, instance views
//! at a chosen second, and ways to step the machine and read its effects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use castellan_actors::StateMachine;
use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::{DatabaseClusterSpec, Engine, Replication, ReplicationMode};
use kube::ResourceExt;
use serde_json::json;

use super::machine::ClusterMachine;
use super::state::*;
use crate::instance_api::{LeaseGrant, Lsn, RunningRole, Slot, slot_name};
use crate::operator::build;
use crate::operator::replica::{Command, InstanceView, StandbyView};

pub fn cluster(replicas: i32, sync: bool, parameters: &[(&str, &str)]) -> Arc<DatabaseCluster> {
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

pub fn members(count: u32) -> BTreeMap<String, Member> {
    (1..=count)
        .map(|n| {
            (
                format!("db-{n}"),
                Member {
                    number: n,
                    address: Some(format!("127.0.0.{n}:8000")),
                    primary: n == 1,
                    cordoned: false,
                    node_ready: true,
                    outdated: false,
                },
            )
        })
        .collect()
}

pub fn view(name: &str, parameters: &[(&str, &str)]) -> InstanceView {
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
        release: Some("15.18".into()),
        ..InstanceView::default()
    }
}

/// The operator's clock `seconds` into a test.
pub fn at(seconds: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + seconds)
}

pub fn primary_view(standbys: &[&str], sync_names: &str) -> InstanceView {
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
pub fn settled(cluster: Arc<DatabaseCluster>, count: u32) -> ClusterState {
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
        .insert("db-1".into(), Box::new(primary_view(&names, &sync_names)));
    for name in &standbys {
        state.views.insert(name.clone(), Box::new(view(name, &[])));
    }
    state
}

pub fn step(state: ClusterState, event: ClusterEvent) -> (ClusterState, Vec<ClusterEffect>) {
    ClusterMachine::transition(state, event)
}

pub fn commands(effects: &[ClusterEffect]) -> Vec<(String, Command)> {
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

pub fn notes(effects: &[ClusterEffect]) -> Vec<&'static str> {
    effects
        .iter()
        .filter_map(|e| match e {
            ClusterEffect::Record(note) => Some(note.reason),
            _ => None,
        })
        .collect()
}

pub fn converge_order(effects: &[ClusterEffect]) -> Option<&ConvergeOrder> {
    effects.iter().find_map(|e| match e {
        ClusterEffect::Converge(order) => Some(order.as_ref()),
        _ => None,
    })
}

pub fn pending(mut view: InstanceView) -> InstanceView {
    view.pending_restart = vec!["max_connections".into()];
    view
}

pub fn unreachable(name: &str, seconds: u64) -> InstanceView {
    InstanceView::unreachable(name, at(seconds), "connection refused".into())
}

pub fn grants(effects: &[ClusterEffect]) -> Vec<(String, LeaseGrant)> {
    effects
        .iter()
        .filter_map(|e| match e {
            ClusterEffect::Grant { instance, grant } => Some((instance.clone(), *grant)),
            _ => None,
        })
        .collect()
}

pub fn at_lsn(mut view: InstanceView, seconds: u64, lsn: &str) -> InstanceView {
    view.at = at(seconds);
    view.lsn = Lsn::parse(lsn);
    view.receive_lsn = Lsn::parse(lsn);
    view
}

/// The state with no pass running (as if the last one finished).
pub fn idle(mut state: ClusterState) -> ClusterState {
    state.converging = false;
    state
}

/// Steps through `events` with every pass finishing at once; the effects of all.
pub fn steps(
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
pub fn primary_lost(sync: bool, seconds: u64) -> (ClusterState, Vec<ClusterEffect>) {
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

pub fn state_view_at(state: &ClusterState, name: &str, seconds: u64) -> InstanceView {
    InstanceView {
        at: at(seconds),
        ..(*state.views[name]).clone()
    }
}

pub fn annotated(cluster: &Arc<DatabaseCluster>, key: &str, value: &str) -> Arc<DatabaseCluster> {
    let mut cluster = (**cluster).clone();
    cluster.annotations_mut().insert(key.into(), value.into());
    Arc::new(cluster)
}
