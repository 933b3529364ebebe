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
//! - fence and unfence instances as `castellan.io/fenced-instances` asks;
//! - restart or reload every instance once per value of `castellan.io/restart` /
//!   `castellan.io/reload` (`actions.rs`).
//!
//! Pure: `shell.rs` performs the effects and feeds their outcomes back as events. The
//! machine has no clock: it takes the time from the instance views it is sent.

use std::collections::BTreeSet;
use std::time::Duration;

use castellan_actors::StateMachine;
use castellan_crds::DatabaseCluster;
use serde_json::Value;

use super::actions::{DeclaredAction, command_finished, follow_requests};
use super::archiving::{archive_assessment, archiving_changed, wanted_archive};
use super::parameters::{parameters_assessment, parameters_changed, refused};
use super::primary::{fenced_instances, finish_promotion, primary_assessment, supervise_primary};
use super::quorum::{quorum_standbys, synchronous_assessment, synchronous_changed};
use super::restoring::{record_restore_changes, restore_assessment, restore_command};
use super::state::*;
use super::switchover::switchover_step_done;
use crate::operator::build;
use crate::operator::replica::{Command, InstanceView};

pub struct ClusterMachine;

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
                // The conditions the next pass writes may flip with the spec (parameters
                // corrected, a quorum asked for): their Events come with them, not with the
                // next report of an instance.
                record_flips(&mut state, &mut effects);
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
                    } else if state.ready == Some(true) && found.planned_outage {
                        // A major upgrade stops them on purpose: no alarm.
                        effects.push(ClusterEffect::Record(Note::normal(
                            "InstancesStopped",
                            "instances stopped for the major upgrade (see status.upgrade)"
                                .to_owned(),
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
                if let Some(archive) = found.archive {
                    state.archive = Some(archive);
                }
                state.restore = found.restore;
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
                state
                    .settled_at
                    .retain(|name, _| members.contains_key(name));
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
                let previous = state.views.insert(name.clone(), Box::new(view.clone()));
                state.stale.remove(&name);
                // Anything status shows changed, or its positions and lag are long
                // overdue (the resync's pass brings them every PROGRESS_REFRESH; this is
                // for when no resync comes).
                let changed = previous.is_none_or(|p| !p.moved_only(&view));
                let progress_due = state.progress_at.is_none_or(|at| {
                    view.at.duration_since(at).unwrap_or_default() >= 2 * PROGRESS_REFRESH
                });
                let before = roles(&state);
                supervise_primary(&mut state, &mut effects, &name);
                let primary_changed = before != roles(&state);
                let flipped = record_flips(&mut state, &mut effects);
                if flipped || changed || primary_changed || progress_due {
                    converge(&mut state, &mut effects);
                }
                plan_commands(&mut state, &mut effects);
            }
            ClusterEvent::Finished {
                instance,
                command,
                outcome,
                at,
            } => {
                state.commands.remove(&instance);
                state.stale.insert(instance.clone());
                // Views are dated from when they were asked for: any asked for before
                // the answer came may predate the command's effect.
                state
                    .settled_at
                    .insert(instance.clone(), state.now.map_or(at, |now| now.max(at)));
                let before = roles(&state);
                if state.switchover.is_some()
                    && matches!(command, Command::Promote(_) | Command::Demote)
                {
                    switchover_step_done(&mut state, &mut effects, &instance, &command, outcome);
                } else if let Command::Promote(_) = &command {
                    finish_promotion(&mut state, &mut effects, &instance, &command, &outcome);
                } else {
                    let succeeded = outcome.is_ok();
                    record_outcome(&mut effects, &instance, &command, outcome);
                    command_finished(&mut state, &mut effects, &instance, &command, succeeded);
                }
                // A new primary, or a failover or switchover that began or ended, is
                // written by a pass (status, labels) at once.
                if before != roles(&state) {
                    converge(&mut state, &mut effects);
                }
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

/// The Event for a command's outcome.
fn record_outcome(
    effects: &mut Vec<ClusterEffect>,
    instance: &str,
    command: &Command,
    outcome: Result<Value, String>,
) {
    let note = match (command, outcome) {
        (Command::Reload { .. }, Ok(_)) => {
            Note::normal("Reloaded", format!("{instance} reloaded its configuration"))
        }
        (Command::Restart, Ok(_)) => Note::normal("Restarted", format!("{instance} restarted")),
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
        (Command::Restore(request), Ok(_)) => Note::normal(
            "Restoring",
            format!(
                "{instance} restores base backup {} of the cluster archived under {}",
                request.backup_id, request.source.prefix
            ),
        ),
        // A promotion's outcome is the failover's or the switchover's to report
        // (`FailedOver`, `SwitchedOver`); it never comes here.
        (Command::Promote(_), Ok(_)) => return,
        (command, Err(error)) => Note::warning(
            "CommandFailed",
            format!("{} of {instance} failed: {error}", command.name()),
        ),
    };
    effects.push(ClusterEffect::Record(note.about(instance)));
}

/// What a pass must write when it changes: the primary, a failover, a switchover.
fn roles(state: &ClusterState) -> (Option<String>, Option<Failover>, Option<Switchover>) {
    (
        state.primary.clone(),
        state.failover.clone(),
        state.switchover.clone(),
    )
}

/// Starts a pass, or marks that another is needed once the running one ends.
/// Records an Event for each condition of the machine's own assessments that flipped,
/// and says whether any did.
fn record_flips(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) -> bool {
    let synchronous = synchronous_changed(state, effects);
    let archiving = archiving_changed(state, effects);
    let parameters = parameters_changed(state, effects);
    synchronous || archiving || parameters
}

pub(super) fn converge(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let Some(cluster) = state.cluster.clone() else {
        return;
    };
    if state.converging {
        state.again = true;
        return;
    }
    state.converging = true;
    let refresh_progress = match (state.progress_at, state.now) {
        (Some(at), Some(now)) => now.duration_since(at).unwrap_or_default() >= PROGRESS_REFRESH,
        _ => true,
    };
    if refresh_progress {
        state.progress_at = state.now;
    }
    effects.push(ClusterEffect::Converge(Box::new(ConvergeOrder {
        refresh_progress,
        remove: removable(state, &cluster),
        views: state.views.values().map(|view| (**view).clone()).collect(),
        degraded: state.degraded.clone(),
        primary: state.primary.clone(),
        failover: state
            .failover
            .as_ref()
            .map(|f| FailoverStatus {
                from: f.from.clone(),
                target: f.target.clone(),
                switchover: false,
                lease_withheld: f.withholds_lease(),
            })
            .or_else(|| {
                state.switchover.as_ref().map(|s| FailoverStatus {
                    from: s.from.clone(),
                    target: Some(s.to.clone()),
                    switchover: true,
                    lease_withheld: true,
                })
            }),
        primary_condition: primary_assessment(state),
        synchronous_condition: synchronous_assessment(state, &cluster),
        archive_condition: archive_assessment(state),
        restore_condition: restore_assessment(state),
        parameters_condition: parameters_assessment(state),
        cluster,
    })));
}

/// 1 s, 2 s, 4 s … up to [`MAX_RETRY_DELAY`].
pub fn retry_delay(failures: u32) -> Duration {
    let seconds = 1u64 << failures.saturating_sub(1).min(5);
    Duration::from_secs(seconds).min(MAX_RETRY_DELAY)
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
    if let Some((name, command)) = restore_command(state)
        && !busy(state, &name)
    {
        planned.push((name, command));
    }
    record_restore_changes(state, effects);
    follow_requests(state, effects);

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
        // An instance that refused exactly this set keeps its last good one: asking
        // again would get the same answer.
        let parameters_differ = view.parameters.as_ref() != Some(wanted) && !refused(view, wanted);
        // Network access follows spec.tls.allowPlaintext, spec.enableSuperuserAccess and
        // spec.pgHba (a manager that does not report it is not asked).
        let access = build::access(&cluster);
        let access_differs = view.access.as_ref().is_some_and(|now| *now != access);
        // The archive setting goes along only to an instance that lacks it.
        let archive = wanted_archive(state)
            .filter(|a| view.archive.fingerprint.as_deref() != Some(a.fingerprint.as_str()))
            .cloned()
            .map(Box::new);
        let is_primary = primary_name.as_deref() == Some(name.as_str());
        // `castellan.io/reload`: the same reload, whether or not anything changed.
        let reload_owed = state
            .declared
            .rollout(DeclaredAction::Reload)
            .is_some_and(|r| r.owes(name));
        if is_primary && view.serving_as_primary() && state.failover.is_none() {
            let staying = quorum_standbys(state, &cluster);
            let sync_names = build::synchronous_standby_names(&cluster, &staying);
            let slots: Vec<String> = state
                .members
                .keys()
                .filter(|member| *member != name)
                .cloned()
                .collect();
            if parameters_differ
                || reload_owed
                || access_differs
                || archive.is_some()
                || view.sync_names != sync_names
                || slots_differ(view, &slots)
            {
                planned.push((
                    name.clone(),
                    Command::Reload {
                        parameters: wanted.clone(),
                        sync_names: Some(sync_names),
                        slots: Some(slots),
                        archive,
                        access,
                    },
                ));
            }
        } else if (parameters_differ || reload_owed || access_differs || archive.is_some())
            && !is_primary
        {
            planned.push((
                name.clone(),
                Command::Reload {
                    parameters: wanted.clone(),
                    sync_names: None,
                    slots: None,
                    archive,
                    access,
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
        // Parameters waiting for a restart, or a `castellan.io/restart` not yet done.
        let restart = state.declared.rollout(DeclaredAction::Restart);
        let pending = |name: &String| {
            restart.is_some_and(|r| r.owes(name))
                || state
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
            let why = match restart {
                Some(r) if parameters.is_empty() => {
                    format!(
                        "as {}={} asks",
                        DeclaredAction::Restart.annotation(),
                        r.value
                    )
                }
                _ => format!("to apply {parameters}"),
            };
            effects.push(ClusterEffect::Record(
                Note::normal("RollingRestart", format!("restarting {name} {why}")).about(&name),
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

    use serde_json::json;

    use super::super::fixtures::*;
    use super::super::machine::*;

    use crate::instance_api::Access;
    use crate::operator::replica::{Command, InstanceView};
    use std::collections::BTreeMap;

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
    fn moved_positions_start_a_pass_only_when_due_and_other_changes_at_once() {
        let state = idle(settled(cluster(1, false, &[]), 2));
        // The first pass writes positions as they are.
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        let order = converge_order(&effects).expect("a first pass");
        assert!(order.refresh_progress);
        assert_eq!(state.progress_at, Some(at(1)));
        // The heartbeat moved the primary's position: nothing to write yet.
        let state = idle(state);
        let moved = at_lsn(state_view_at(&state, "db-1", 5), 5, "0/6000000");
        let (state, effects) = step(state, ClusterEvent::Observed(moved));
        assert!(converge_order(&effects).is_none(), "{effects:?}");
        // Something status shows changed: a pass at once, positions kept unless written.
        let reloaded = InstanceView {
            pending_restart: vec!["shared_buffers".into()],
            ..state_view_at(&state, "db-1", 6)
        };
        let (state, effects) = step(state, ClusterEvent::Observed(reloaded));
        let order = converge_order(&effects).expect("a pass for the change");
        assert!(!order.refresh_progress);
        // Past PROGRESS_REFRESH, the resync's pass writes them.
        let state = idle(state);
        let due = 1 + PROGRESS_REFRESH.as_secs();
        let view = state_view_at(&state, "db-1", due);
        let (state, _) = step(state, ClusterEvent::Observed(view));
        let (state, effects) = step(idle(state), ClusterEvent::Desired(cluster(1, false, &[])));
        let order = converge_order(&effects).expect("the resync's pass");
        assert!(order.refresh_progress);
        assert_eq!(state.progress_at, Some(at(due)));
        // With no resync, an instance's report starts a pass once they are long overdue.
        let state = idle(state);
        let overdue = due + 2 * PROGRESS_REFRESH.as_secs();
        let view = state_view_at(&state, "db-1", overdue - 1);
        let (state, effects) = step(state, ClusterEvent::Observed(view));
        assert!(converge_order(&effects).is_none(), "{effects:?}");
        let view = state_view_at(&state, "db-1", overdue);
        let (_, effects) = step(state, ClusterEvent::Observed(view));
        assert!(converge_order(&effects).expect("overdue").refresh_progress);
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
            planned_outage: false,
            archive: None,
            restore: None,
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
            planned_outage: false,
            archive: None,
            restore: None,
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
            planned_outage: false,
            archive: None,
            restore: None,
        };
        let (_, effects) = step(state.clone(), ClusterEvent::Converged(Ok(found.clone())));
        assert_eq!(notes(&effects), vec!["InstancesNotReady"]);
        let planned = Converged {
            planned_outage: true,
            ..found
        };
        let (_, effects) = step(state, ClusterEvent::Converged(Ok(planned)));
        assert_eq!(
            notes(&effects),
            vec!["InstancesStopped"],
            "a major upgrade's stop is no Warning"
        );
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
            planned_outage: false,
            archive: None,
            restore: None,
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
        state.views.insert(
            "db-1".into(),
            Box::new(primary_view(&["db-2"], "ANY 1 (\"db-2\")")),
        );
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
                        slots: Some(vec!["db-2".into()]),
                        archive: None,
                        access: Access::default(),
                    }
                ),
                (
                    "db-2".into(),
                    Command::Reload {
                        parameters: wanted,
                        sync_names: None,
                        slots: None,
                        archive: None,
                        access: Access::default(),
                    }
                ),
            ]
        );
        // Nothing is sent twice while they run.
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert!(commands(&effects).is_empty());
    }

    #[test]
    fn allowing_plain_text_is_reloaded_where_an_instance_reports_otherwise() {
        let mut cluster = (*cluster(2, false, &[])).clone();
        cluster.spec.tls = Some(castellan_crds::database_cluster::TlsPolicy {
            allow_plaintext: true,
            server_certificate: None,
        });
        let mut state = settled(std::sync::Arc::new(cluster), 2);
        let allowing = Access {
            allow_plaintext: true,
            ..Access::default()
        };
        let mut primary = primary_view(&["db-2"], "");
        primary.access = Some(allowing.clone());
        state.views.insert("db-1".into(), Box::new(primary));
        let mut refusing = view("db-2", &[]);
        refusing.access = Some(Access::default());
        let (_, effects) = step(state.clone(), ClusterEvent::Observed(refusing));
        assert_eq!(
            commands(&effects),
            vec![(
                "db-2".into(),
                Command::Reload {
                    parameters: BTreeMap::new(),
                    sync_names: None,
                    slots: None,
                    archive: None,
                    access: allowing,
                }
            )],
            "only the instance that differs is asked"
        );
        // A manager that does not report the setting is not asked for it.
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
            .insert("db-1".into(), Box::new(primary_view(&["db-2"], "")));
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert_eq!(
            commands(&effects),
            vec![(
                "db-1".into(),
                Command::Reload {
                    parameters: BTreeMap::new(),
                    sync_names: Some("ANY 1 (\"db-2\")".into()),
                    slots: Some(vec!["db-2".into()]),
                    archive: None,
                    access: Access::default(),
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
            Box::new(primary_view(
                &["db-2", "db-3"],
                "ANY 1 (\"db-2\", \"db-3\")",
            )),
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
                    slots: Some(vec!["db-2".into(), "db-3".into()]),
                    archive: None,
                    access: Access::default(),
                }
            )]
        );
        // Once the primary shows the new names, the next pass removes db-3.
        state.commands.clear();
        state.converging = false;
        state.views.insert(
            "db-1".into(),
            Box::new(primary_view(&["db-2", "db-3"], "ANY 1 (\"db-2\")")),
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
            state.views.insert(name.clone(), Box::new(pending(fresh)));
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
                at: at(0),
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
                at: at(0),
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
                at: at(0),
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
        state
            .views
            .insert("db-1".into(), Box::new(pending(primary)));
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
                at: at(0),
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
            planned_outage: false,
            archive: None,
            restore: None,
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

    #[test]
    fn the_primary_is_told_to_make_missing_slots() {
        let mut state = settled(cluster(2, false, &[]), 2);
        let mut primary = primary_view(&["db-2"], "");
        primary.slots.clear();
        state.views.insert("db-1".into(), Box::new(primary.clone()));
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(matches!(
            &commands(&effects)[..],
            [(_, Command::Reload { slots: Some(slots), .. })] if slots == &vec!["db-2".to_owned()]
        ));
    }
}
