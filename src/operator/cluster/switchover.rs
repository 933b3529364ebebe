//! Switchover, part of the `ClusterActor`'s machine: asked for by annotation, or by a
//! drain of the primary's node. The old primary is stopped cleanly, the target promoted
//! once it has received all its WAL, and the old primary follows it. Pure.

use std::time::{Duration, SystemTime};

use castellan_crds::DatabaseCluster;
use kube::ResourceExt;
use serde_json::Value;

use super::failover;
use super::state::*;
use crate::operator::replica::{Command, InstanceView};

/// Annotation asking for a switchover to the named instance: a one-shot request that
/// the operator carries out (or refuses, saying why in an Event) and then removes.
/// Draining the primary's node asks for one by itself.
pub const SWITCHOVER_ANNOTATION: &str = "castellan.io/switchover-to";

/// How long a switchover waits for its target to receive the old primary's last WAL
/// before it gives up and lets failover choose the most advanced replica instead.
pub const SWITCHOVER_CATCH_UP: Duration = Duration::from_secs(30);

/// Starts a switchover when one is asked for (the annotation) or needed (the primary's
/// node is being drained), to a streaming replica; refuses a request it cannot honour.
pub(super) fn start_switchover(
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
            && state
                .views
                .get(name)
                .is_some_and(|view| failover::promotable(view))
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
            // A minor update: the replicas run the new image, the primary does not.
            let updating = state.members.get(&primary).is_some_and(|m| m.outdated)
                && state.members.len() > 1
                && state
                    .members
                    .iter()
                    .all(|(name, m)| *name == primary || !m.outdated);
            if !draining && !updating {
                return;
            }
            // The most advanced streaming replica off the drained node (on the new
            // image, for an update).
            let mut candidates: Vec<&InstanceView> = state
                .views
                .values()
                .map(|view| &**view)
                .filter(|v| v.name != primary && eligible(state, &v.name))
                .filter(|v| !state.members.get(&v.name).is_some_and(|m| m.outdated))
                .collect();
            candidates.sort_by(|a, b| b.receive_lsn.cmp(&a.receive_lsn).then(a.name.cmp(&b.name)));
            let Some(best) = candidates.first() else {
                return;
            };
            let cause = if draining {
                "the primary's node is being drained"
            } else {
                "a minor update: the replicas run the new image, the primary is replaced next"
            };
            (best.name.clone(), cause.to_owned())
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
pub(super) fn advance_switchover(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
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
        state.promote(effects, &switchover.to, now);
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
        state.hand_to_failover(
            effects,
            switchover.from,
            "a switchover could not complete",
            now,
        );
    }
}

/// A switchover's demotion or promotion finished.
pub(super) fn switchover_step_done(
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
                    let now = state.now.unwrap_or(switchover.started);
                    state.hand_to_failover(
                        effects,
                        switchover.from,
                        "stopped for a switchover without a known checkpoint",
                        now,
                    );
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
            state.quorum = promoted_quorum(command);
            effects.push(ClusterEffect::ClearSwitchover);
        }
        (Command::Promote(_), Err(error)) => {
            effects.push(ClusterEffect::Record(Note::warning(
                "SwitchoverFailed",
                format!(
                    "promoting {} failed: {error}; failing over to the most advanced replica",
                    switchover.to
                ),
            )));
            let now = state.now.unwrap_or(switchover.started);
            state.hand_to_failover(
                effects,
                switchover.from,
                "a switchover's promotion failed",
                now,
            );
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {

    use serde_json::json;

    use super::super::fixtures::*;

    use super::*;
    use crate::operator::replica::Command;

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
                at: at(0),
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
                at: at(0),
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
                at: at(0),
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
    fn a_minor_update_switches_over_once_every_replica_runs_the_new_image() {
        let outdated = |state: &mut ClusterState, names: &[&str]| {
            for (name, member) in &mut state.members {
                member.outdated = names.contains(&name.as_str());
            }
        };
        // A replica still on the old image: no switchover yet.
        let mut state = settled(cluster(3, false, &[]), 3);
        outdated(&mut state, &["db-1", "db-3"]);
        let primary = state_view_at(&state, "db-1", 1);
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(notes(&effects).is_empty(), "{effects:?}");
        // Both replicas updated: to one of them.
        let mut state = settled(cluster(3, false, &[]), 3);
        outdated(&mut state, &["db-1"]);
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert_eq!(notes(&effects), vec!["Switchover"]);
        let switchover = state.switchover.as_ref().expect("a switchover");
        assert!(
            switchover.cause.contains("minor update"),
            "{}",
            switchover.cause
        );
        assert_ne!(switchover.to, "db-1");
        // Nothing outdated: nothing.
        let state = settled(cluster(3, false, &[]), 3);
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(notes(&effects).is_empty() && state.switchover.is_none());
        // A lone primary is not switched over (the pass restarts it in place).
        let mut state = settled(cluster(1, false, &[]), 1);
        outdated(&mut state, &["db-1"]);
        let primary = state_view_at(&state, "db-1", 1);
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(notes(&effects).is_empty() && state.switchover.is_none());
    }
}
