//! A cluster made from a backup (`bootstrap.recovery`), as the cluster machine sees it:
//! the first instance starts on an empty volume and waits; the machine sends it the
//! backup to restore (resolved by the pass, `operator::restore`) once, and the
//! `Restored` condition follows it until the instance is primary. Until then the
//! cluster has never had data: nothing can be failed over to.

use castellan_crds::DatabaseCluster;

use super::state::{Assessment, ClusterEffect, ClusterState, Note, primary};
use crate::operator::replica::Command;

/// The cluster is to be restored and has no data yet.
pub fn awaiting_restore(cluster: &DatabaseCluster) -> bool {
    cluster
        .spec
        .bootstrap
        .as_ref()
        .is_some_and(|b| b.recovery.is_some())
        && !cluster
            .status
            .as_ref()
            .and_then(|s| s.initialized)
            .unwrap_or(false)
}

/// The restore to send to the primary: once its view shows an empty volume that has
/// not been asked for one yet.
pub fn restore_command(state: &ClusterState) -> Option<(String, Command)> {
    let request = state.restore.as_ref()?.as_ref().ok()?;
    let (name, _) = primary(state)?;
    let view = state.views.get(name).filter(|v| v.reachable)?;
    let waiting = view.role.is_none() && view.problem.is_none() && view.restoring.is_none();
    waiting.then(|| (name.clone(), Command::Restore(Box::new(request.clone()))))
}

/// `Restored`, for a cluster with `bootstrap.recovery`: true once its first instance
/// holds the restored data.
pub fn restore_assessment(state: &ClusterState) -> Option<Assessment> {
    let cluster = state.cluster.as_ref()?;
    cluster.spec.bootstrap.as_ref()?.recovery.as_ref()?;
    if !awaiting_restore(cluster) || state.views.values().any(|v| v.role.is_some()) {
        return Some(Assessment::new(
            true,
            "Restored",
            "the cluster was restored from its backup and runs on its own timeline",
        ));
    }
    if let Some(Err(reason)) = &state.restore {
        return Some(Assessment::new(false, "RestoreWaiting", reason));
    }
    let doing = primary(state)
        .and_then(|(name, _)| state.views.get(name))
        .and_then(|v| v.restoring.clone());
    Some(match doing {
        Some(what) => Assessment::new(false, "Restoring", what),
        None => Assessment::new(
            false,
            "Pending",
            "waiting for the first instance to start and take the backup to restore",
        ),
    })
}

/// One Warning when the restore cannot go ahead (a target outside the archive, a
/// backup that is not complete), and one when a running restore fails.
pub fn record_restore_changes(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let failing = match &state.restore {
        Some(Err(reason)) => Some(("RestoreRefused", reason.clone())),
        _ => primary(state)
            .and_then(|(name, _)| state.views.get(name))
            .and_then(|v| v.restoring.clone())
            .filter(|what| what.starts_with("the restore failed"))
            .map(|what| ("RestoreFailed", what)),
    };
    let key = failing.as_ref().map(|(_, message)| message.clone());
    if key == state.restore_warned {
        return;
    }
    if let Some((reason, message)) = failing {
        effects.push(ClusterEffect::Record(Note::warning(reason, message)));
    }
    state.restore_warned = key;
}
