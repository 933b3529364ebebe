//! The synchronous quorum, part of the `ClusterActor`'s machine: which standbys the
//! primary's `synchronous_standby_names` holds under `dataDurability`, and the
//! `SynchronousReplication` condition. Pure.

use std::collections::BTreeSet;

use castellan_crds::DatabaseCluster;

use super::failover::Quorum;
use super::state::*;
use crate::operator::build;

/// The standbys the primary's quorum should name, among those that stay: the streaming
/// ones; with `required` durability also those it names already, so that a standby
/// that stops streaming keeps commits waiting rather than silently dropping out.
pub(super) fn quorum_standbys(state: &ClusterState, cluster: &DatabaseCluster) -> Vec<String> {
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
pub(super) fn synchronous_assessment(
    state: &ClusterState,
    cluster: &DatabaseCluster,
) -> Option<Assessment> {
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
pub(super) fn synchronous_changed(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
) -> bool {
    let Some(cluster) = state.cluster.clone() else {
        return false;
    };
    let Some(assessment) = synchronous_assessment(state, &cluster) else {
        return false;
    };
    assessment.record_flip(&mut state.synchronous_ok, "QuorumStreaming", effects)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use castellan_crds::database_cluster::DataDurability;

    use super::super::fixtures::*;

    use super::*;
    use crate::operator::replica::Command;

    #[test]
    fn with_required_durability_a_named_standby_that_stops_streaming_stays_named() {
        let mut state = settled(cluster(3, true, &[]), 3);
        let mut primary = primary_view(&["db-2", "db-3"], "ANY 1 (\"db-2\", \"db-3\")");
        primary.standbys.retain(|s| s.name == "db-2");
        state.views.insert("db-1".into(), Box::new(primary.clone()));
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
        state.views.insert("db-1".into(), Box::new(primary.clone()));
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
}
