//! The primary's supervision, part of the `ClusterActor`'s machine: its lease, failover
//! when it stops serving (whom and when: `failover.rs`), the demotion of former
//! primaries and split brains, fencing, and the `PrimaryAvailable` condition. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use castellan_crds::DatabaseCluster;
use kube::ResourceExt;
use serde_json::Value;

use super::failover::{self, Choice, LEASE_DURATION, Quorum};
use super::state::*;
use crate::instance_api::{LeaseGrant, RunningRole};
use crate::operator::replica::{Command, InstanceView};

use super::switchover::{advance_switchover, start_switchover};

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
pub(super) fn failover_delay(cluster: &DatabaseCluster) -> Duration {
    cluster
        .spec
        .failover
        .as_ref()
        .and_then(|f| f.delay())
        .unwrap_or(failover::DEFAULT_DELAY)
}

/// Why the primary `name` is not serving, or `None` when it is, from its latest view
/// and its node's `Ready` condition. The delay applies to what may pass by itself (an
/// unreachable instance, a server restarting, a node the node controller lost); an
/// empty volume or a primary that runs as a replica will not.
pub(super) fn unavailability(state: &ClusterState, name: &str) -> Option<(String, bool)> {
    let view = state.views.get(name);
    let Some(view) = view else {
        return Some(("it has not been observed".to_owned(), false));
    };
    if let Some(problem) = &view.problem {
        return Some((problem.clone(), true));
    }
    // The node controller gave up on the node (its kubelet stopped reporting for the
    // grace period): even a primary that still answers runs where nothing manages it.
    if state.members.get(name).is_some_and(|m| !m.node_ready) {
        return Some(("its node is not Ready".to_owned(), false));
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
pub(super) fn supervise_primary(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    observed: &str,
) {
    let (Some(cluster), Some(now), Some(primary)) =
        (state.cluster.clone(), state.now, state.primary.clone())
    else {
        return;
    };
    let fenced = fenced_instances(&cluster, &state.members);
    let view = state.views.get(&primary).cloned();
    // The primary's latest view asked for before its last command finished (its
    // promotion, say) shows it as it was, a replica: no failover is decided on it,
    // whoever's view arrived now, until a view of the primary asked for afterwards.
    let stale = view
        .as_ref()
        .is_some_and(|v| state.settled_at.get(&primary).is_some_and(|at| v.at <= *at));
    if stale && observed == primary {
        return;
    }

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
                && unavailability(state, &primary).is_none()
            {
                start_switchover(state, effects, &cluster, now);
            }
            // A failover that no replica could carry out yet leaves the lease alone.
            let renew = state.failover.as_ref().is_none_or(|f| !f.withholds_lease())
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
        match unavailability(state, &primary) {
            None => state.unavailable_since = None,
            Some(_) => {
                state
                    .unavailable_since
                    .get_or_insert(view.as_ref().map_or(now, |v| v.at));
            }
        }
    }

    demote_strays(state, effects, &primary);

    // A cluster being restored has no data anywhere else: nothing to fail over to.
    if super::restoring::awaiting_restore(&cluster) {
        state.unavailable_since = None;
        return;
    }

    // A major upgrade stops the instances on purpose, then starts the upgraded primary
    // while the replicas are copied from it: nothing to fail over to meanwhile.
    if super::upgrade::suspends_failover(&cluster) {
        state.unavailable_since = None;
        return;
    }

    if fenced.contains(&primary) {
        // A fenced primary is the user's decision: no failover replaces it.
        state.unavailable_since = None;
        return;
    }

    // A failover that has not chosen yet gives way to the old primary if it is back:
    // it has every commit, and nothing else could be promoted meanwhile.
    if let Some(failover) = &state.failover
        && failover.target.is_none()
        // Blocked for want of a candidate, not merely waiting for the lease to end: a
        // primary that keeps failing must not cancel its own failover each time.
        && matches!(failover.blocked, Some(Waiting::ForCandidate(_)))
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
        if stale {
            return;
        }
        // With no other member there is nothing a failover could promote: the
        // condition says the primary does not serve (PrimaryUnavailable), and no
        // failover starts that could only be blocked, and then cancelled, at each of
        // a lone primary's hiccups (an Event storm on a busy node).
        if !state.members.keys().any(|name| *name != primary) {
            return;
        }
        let Some((reason, at_once)) = unavailability(state, &primary) else {
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
                "the primary {primary} has not served for {:.1}s: {reason}; once a replica \
                 can replace it, it no longer gets the lease, and the replica is promoted \
                 when the lease has ended",
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
pub(super) fn promote_when_safe(
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
    // Candidates first: while none could replace the primary, it keeps its lease
    // (withholding it would only stop a primary that may be merely slow, and make the
    // outage certain). Once one could, the lease is withheld, and the choice is made
    // again when the lease has ended and the positions can no longer move.
    let candidates: Vec<&InstanceView> = state
        .views
        .iter()
        .filter(|(name, _)| **name != failover.from && state.members.contains_key(*name))
        .map(|(_, view)| &**view)
        .collect();
    let choice = match failover::choose(
        &candidates,
        state.quorum.as_ref(),
        durability_required(cluster),
    ) {
        Choice::Wait(reason) => Err(Waiting::ForCandidate(reason)),
        Choice::Promote { instance, lsn } => {
            let began = state.began.unwrap_or(now);
            match failover::leases_may_run(now, state.leased_until, began) {
                Some(until) => Err(Waiting::ForLease(format!(
                    "waiting {:.1}s more for the lease of {} to end, so that it has stopped \
                     taking writes before another instance is promoted",
                    until.duration_since(now).unwrap_or_default().as_secs_f64(),
                    failover.from
                ))),
                None => Ok((instance, lsn)),
            }
        }
    };
    match choice {
        Err(waiting) => {
            if matches!(waiting, Waiting::ForCandidate(_))
                && failover.blocked.as_ref() != Some(&waiting)
            {
                effects.push(ClusterEffect::Record(Note::warning(
                    "FailoverBlocked",
                    waiting.message().to_owned(),
                )));
            }
            if let Some(f) = state.failover.as_mut() {
                f.blocked = Some(waiting);
            }
        }
        Ok((instance, lsn)) => {
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
            state.promote(effects, &instance, now);
            if let Some(f) = state.failover.as_mut() {
                f.target = Some(instance);
                f.blocked = None;
            }
        }
    }
}

/// The outcome of a promotion: the target is the primary, or the failover chooses again.
pub(super) fn finish_promotion(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    instance: &str,
    command: &Command,
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
            // Until the new primary reports its own, the quorum it was promoted with.
            state.quorum = promoted_quorum(command);
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
pub(super) fn demote_strays(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    primary: &str,
) {
    let target = state
        .failover
        .as_ref()
        .and_then(|f| f.target.clone())
        .or_else(|| state.switchover.as_ref().map(|s| s.to.clone()));
    let primary_serves = state
        .views
        .get(primary)
        .is_some_and(|view| view.serving_as_primary());
    let strays: Vec<(String, bool)> = state
        .views
        .iter()
        .filter(|(name, _)| name.as_str() != primary && Some(*name) != target.as_ref())
        .filter(|(name, _)| {
            state.members.contains_key(*name) && !state.commands.contains_key(*name)
        })
        // A view asked for before the instance's last command finished (a demotion,
        // say) shows it as it was: no decision is taken on it.
        .filter(|(name, view)| state.settled_at.get(*name).is_none_or(|at| view.at > *at))
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
pub(super) fn primary_assessment(state: &ClusterState) -> Assessment {
    let Some(primary) = &state.primary else {
        return Assessment::default();
    };
    if let Some(failover) = &state.failover {
        let message = match (&failover.target, &failover.blocked) {
            (Some(target), _) => format!("failing over from {}: promoting {target}", failover.from),
            (None, Some(blocked)) => format!(
                "failing over from {} ({}): {}",
                failover.from,
                failover.reason,
                blocked.message()
            ),
            (None, None) => format!("failing over from {}: {}", failover.from, failover.reason),
        };
        let reason = if failover
            .blocked
            .as_ref()
            .is_some_and(|b| matches!(b, Waiting::ForCandidate(_)))
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
    match unavailability(state, primary) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use castellan_crds::database_cluster::DataDurability;
    use serde_json::json;

    use super::super::fixtures::*;
    use super::super::state::*;
    use super::*;
    use crate::instance_api::RunningRole;
    use crate::operator::replica::{Command, InstanceView};

    #[test]
    fn a_serving_primary_gets_a_lease_from_its_view_and_replicas_do_not() {
        let state = settled(cluster(3, false, &[]), 3);
        let mut primary = (*state.views["db-1"]).clone();
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
                at: at(0),
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
        // A view of db-3 asked for before its promotion finished still shows a
        // replica: no failover is decided on it.
        let before = InstanceView {
            at: at(6),
            ..(*state.views["db-3"]).clone()
        };
        let (state, effects) = step(idle(state), ClusterEvent::Observed(before));
        assert!(state.failover.is_none(), "{effects:?}");
        assert!(!notes(&effects).contains(&"FailingOver"));
        // Nor on another instance's view arriving meanwhile: db-3's latest view is
        // still the one from before.
        let other = at_lsn(view("db-2", &[]), 8, "0/5000000");
        let (state, effects) = step(idle(state), ClusterEvent::Observed(other));
        assert!(state.failover.is_none(), "{effects:?}");
        // One asked for afterwards is believed: a primary that runs as a replica is
        // failed over at once.
        let after = InstanceView {
            at: at(9),
            ..(*state.views["db-3"]).clone()
        };
        let (state, effects) = step(idle(state), ClusterEvent::Observed(after));
        assert!(notes(&effects).contains(&"FailingOver"), "{effects:?}");
        assert_eq!(state.failover.map(|f| f.from).as_deref(), Some("db-3"));
    }

    #[test]
    fn a_primary_on_a_node_gone_not_ready_is_failed_over_after_the_delay() {
        let mut state = settled(cluster(3, false, &[]), 3);
        if let Some(member) = state.members.get_mut("db-1") {
            member.node_ready = false;
        }
        // It still answers: the clock starts, no lease beyond that is decided yet.
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(state_view_at(
                &settled(cluster(3, false, &[]), 3),
                "db-1",
                1,
            )),
        );
        assert!(!notes(&effects).contains(&"FailingOver"));
        assert_eq!(state.unavailable_since, Some(at(1)));
        assert_eq!(
            primary_assessment(&state).message,
            "db-1: its node is not Ready"
        );
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 7, "0/5000000")),
        );
        assert!(notes(&effects).contains(&"FailingOver"), "{effects:?}");
        assert!(
            state
                .failover
                .is_some_and(|f| f.reason == "its node is not Ready")
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
        assert!(matches!(blocked, Some(Waiting::ForLease(ref b)) if b.contains("lease")));
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
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-3", &[]), 8, "0/6000000")),
        );
        let promoted = commands(&effects);
        let [(name, Command::Promote(request))] = &promoted[..] else {
            panic!("db-3 promoted: {promoted:?}");
        };
        assert_eq!(name, "db-3");
        // Its first commit already waits for the others: the quorum comes with the
        // promotion, and is the one the next failover must satisfy.
        assert_eq!(
            request.synchronous_standby_names.as_deref(),
            Some("ANY 1 (\"db-1\", \"db-2\")")
        );
        let command = promoted[0].1.clone();
        let (state, _) = step(
            idle(state),
            ClusterEvent::Finished {
                instance: "db-3".into(),
                command,
                outcome: Ok(json!({"changed": true})),
                at: at(9),
            },
        );
        assert_eq!(state.primary.as_deref(), Some("db-3"));
        let quorum = state.quorum.expect("the promoted quorum");
        assert_eq!(quorum.count, 1);
        assert_eq!(
            quorum.standbys.into_iter().collect::<Vec<_>>(),
            vec!["db-1".to_owned(), "db-2".to_owned()]
        );
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
        assert!(matches!(&commands(&effects)[..],
            [(name, Command::Promote(request))]
                if name == "db-2" && request.synchronous_standby_names.is_none()));
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
                at: at(0),
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
            Box::new(InstanceView {
                name: "db-2".into(),
                ..primary_view(&["db-1"], "")
            }),
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
        down.views
            .insert("db-2".into(), Box::new(unreachable("db-2", 0)));
        let (_, effects) = step(down, ClusterEvent::Observed(waiting));
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| *c == Command::Demote)
        );
    }

    #[test]
    fn a_primary_no_replica_could_replace_keeps_its_lease_until_one_could() {
        let state = settled(cluster(2, false, &[]), 2);
        let starting = |seconds| InstanceView {
            at: at(seconds),
            ready: false,
            error: Some("the database system is starting up".into()),
            ..primary_view(&[], "")
        };
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-2", 1)));
        let (state, effects) = step(state, ClusterEvent::Observed(starting(1)));
        assert_eq!(grants(&effects).len(), 1, "not yet a failover");
        // Past the delay: a failover, blocked, and the primary keeps its lease (it
        // may be merely slow; stopping it would make the outage certain).
        let (state, effects) = step(state, ClusterEvent::Observed(starting(7)));
        assert_eq!(notes(&effects), vec!["FailingOver", "FailoverBlocked"]);
        let (state, effects) = step(state, ClusterEvent::Observed(starting(8)));
        assert_eq!(grants(&effects).len(), 1, "{effects:?}");
        assert_eq!(state.leased_until, Some(at(8) + LEASE_DURATION));
        // A replica that could replace it: the lease is withheld from now on, and the
        // replica is promoted once the last grant has ended.
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 9, "0/5000000")),
        );
        assert!(commands(&effects).is_empty());
        let blocked = state.failover.as_ref().and_then(|f| f.blocked.clone());
        assert!(matches!(blocked, Some(Waiting::ForLease(_))), "{blocked:?}");
        let (state, effects) = step(state, ClusterEvent::Observed(starting(10)));
        assert!(grants(&effects).is_empty());
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(at_lsn(view("db-2", &[]), 13, "0/5000000")),
        );
        assert!(matches!(commands(&effects)[..], [(_, Command::Promote(_))]));
    }

    #[test]
    fn a_lone_primary_that_does_not_serve_is_unavailable_but_never_failed_over() {
        let state = settled(cluster(0, false, &[]), 1);
        let (state, _) = step(state, ClusterEvent::Observed(unreachable("db-1", 1)));
        let (state, effects) = step(state, ClusterEvent::Observed(unreachable("db-1", 30)));
        assert!(notes(&effects).is_empty(), "{effects:?}");
        assert!(state.failover.is_none());
        let assessment = primary_assessment(&state);
        assert!(!assessment.status);
        assert_eq!(assessment.reason, "PrimaryUnavailable");
        // Back: available again, and nothing was recorded on the way.
        let back = InstanceView {
            at: at(31),
            ..primary_view(&[], "")
        };
        let (state, effects) = step(state, ClusterEvent::Observed(back));
        assert!(notes(&effects).is_empty(), "{effects:?}");
        assert_eq!(primary_assessment(&state).reason, "Available");
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
}
