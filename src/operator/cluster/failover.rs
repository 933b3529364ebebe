//! Whom to promote, and when it is safe: the pure rules of failover, used by the
//! `ClusterActor`'s machine (`cluster.rs`). No I/O and no clock: the machine passes
//! the time its events carry.
//!
//! The safety argument (`docs/failover.md`) rests on three rules checked here:
//! 1. **Lease:** no instance is promoted before every lease the operator granted to
//!    another instance has ended (plus [`CLOCK_SKEW`]), and before [`LEASE_DURATION`]
//!    has passed since this operator began (a previous operator's grants end by then).
//!    A primary stops its server when its lease ends, so two primaries never run.
//! 2. **Quorum:** with `ANY k (s1 … sn)`, a commit was acknowledged once k of the n
//!    standbys had it, so any n − k + 1 of them include one that has every acknowledged
//!    commit. In `sync` mode with `dataDurability: required`, promotion waits until that
//!    many of the named standbys report their position.
//! 3. **Most advanced:** the candidate is the reachable replica with the highest
//!    received (then replayed) WAL position; among the standbys counted for the
//!    quorum, it holds every acknowledged commit.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use crate::instance_api::{Lsn, RunningRole};

use crate::operator::replica::InstanceView;

/// How long a lease grant runs. The primary renews it every [`crate::operator::replica::POLL_INTERVAL`]
/// (1 s), so three renewals may fail in a row before a healthy primary stops.
pub const LEASE_DURATION: Duration = Duration::from_secs(4);

/// Margin for clocks that disagree between the operator and the instances (the grant's
/// end is a wall-clock time, see `LeaseGrant`).
pub const CLOCK_SKEW: Duration = Duration::from_millis(500);

/// Default `spec.failover.delay`: how long the primary may be unavailable before
/// another instance is promoted. A killed server is restarted in place within about a
/// second and a restarted instance manager is back within a few; five seconds lets
/// both recover without a failover, and is longer than [`LEASE_DURATION`] +
/// [`CLOCK_SKEW`], so a failover never waits for the lease on top of the delay.
pub const DEFAULT_DELAY: Duration = Duration::from_secs(5);

/// A synchronous quorum as PostgreSQL writes it: `ANY k ("a", "b", …)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quorum {
    pub count: usize,
    pub standbys: BTreeSet<String>,
}

impl Quorum {
    /// Parses `synchronous_standby_names` as Castellan writes it; `None` when it names
    /// no standby (asynchronous).
    pub fn parse(names: &str) -> Option<Self> {
        let rest = names.trim().strip_prefix("ANY ")?;
        let (count, list) = rest.split_once(' ')?;
        let count: usize = count.trim().parse().ok()?;
        let list = list.trim().strip_prefix('(')?.strip_suffix(')')?;
        let standbys: BTreeSet<String> = list
            .split(',')
            .map(|name| name.trim().trim_matches('"').to_owned())
            .filter(|name| !name.is_empty())
            .collect();
        (count > 0 && !standbys.is_empty()).then_some(Self { count, standbys })
    }

    /// How many of the named standbys must be seen to be sure one has every
    /// acknowledged commit: n − k + 1.
    pub fn needed(&self) -> usize {
        (self.standbys.len() + 1).saturating_sub(self.count)
    }
}

/// Whether a lease may still be running anywhere: until every grant has ended, and for
/// one lease after this operator began (grants of a previous operator).
pub fn leases_may_run(
    now: SystemTime,
    leased_until: Option<SystemTime>,
    began: SystemTime,
) -> Option<SystemTime> {
    let until = leased_until
        .unwrap_or(began)
        .max(began + LEASE_DURATION)
        .checked_add(CLOCK_SKEW)?;
    (now < until).then_some(until)
}

/// An instance's WAL position for choosing: received, else replayed.
fn position(view: &InstanceView) -> (Lsn, Lsn) {
    let replay = view.lsn.unwrap_or_default();
    (view.receive_lsn.unwrap_or(replay).max(replay), replay)
}

/// A replica that may be promoted: it answered, runs as a replica, is not fenced and
/// reports where it is.
pub fn promotable(view: &InstanceView) -> bool {
    view.reachable
        && view.role == Some(RunningRole::Replica)
        && view.running
        && !view.fenced
        && view.lsn.is_some()
}

/// What a failover may do now.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// Promote this instance.
    Promote { instance: String, lsn: Lsn },
    /// Nothing may be promoted yet; the reason, for status and an Event.
    Wait(String),
}

/// Chooses the replica to promote among `views` (the instances other than the failed
/// primary). `quorum` is the primary's last synchronous quorum; `required` says whether
/// acknowledged commits must be proven present (`dataDurability: required`).
pub fn choose(views: &[&InstanceView], quorum: Option<&Quorum>, required: bool) -> Choice {
    let mut candidates: Vec<&&InstanceView> = views.iter().filter(|v| promotable(v)).collect();
    // Highest received position first, then replayed, then the name for a stable order.
    candidates.sort_by(|a, b| {
        position(b)
            .cmp(&position(a))
            .then_with(|| a.name.cmp(&b.name))
    });
    if let (Some(quorum), true) = (quorum, required) {
        let seen = candidates
            .iter()
            .filter(|v| quorum.standbys.contains(&v.name))
            .count();
        if seen < quorum.needed() {
            return Choice::Wait(format!(
                "dataDurability is required: {seen} of the synchronous standbys ({}) can be \
                 seen, and {} are needed to be sure one has every acknowledged commit \
                 (ANY {} of {}); waiting for them rather than risk losing commits",
                quorum
                    .standbys
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
                quorum.needed(),
                quorum.count,
                quorum.standbys.len(),
            ));
        }
    }
    match candidates.first() {
        Some(best) => Choice::Promote {
            instance: best.name.clone(),
            lsn: position(best).0,
        },
        None => Choice::Wait(
            "no replica can be promoted: none is reachable, running and unfenced".to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn replica(name: &str, receive: &str, replay: &str) -> InstanceView {
        InstanceView {
            name: name.into(),
            reachable: true,
            ready: true,
            running: true,
            role: Some(RunningRole::Replica),
            lsn: Lsn::parse(replay),
            receive_lsn: Lsn::parse(receive),
            ..InstanceView::default()
        }
    }

    #[test]
    fn quorums_parse_as_castellan_writes_them() {
        let quorum = Quorum::parse("ANY 1 (\"db-2\", \"db-3\")").expect("a quorum");
        assert_eq!(quorum.count, 1);
        assert_eq!(quorum.standbys.len(), 2);
        assert_eq!(quorum.needed(), 2);
        let three = Quorum::parse("ANY 2 (\"a\", \"b\", \"c\")").expect("a quorum");
        assert_eq!(three.needed(), 2);
        assert_eq!(Quorum::parse(""), None);
        assert_eq!(Quorum::parse("ANY 0 (\"a\")"), None);
    }

    #[test]
    fn the_most_advanced_replica_is_chosen() {
        let a = replica("db-2", "0/3000000", "0/2000000");
        let b = replica("db-3", "0/3000100", "0/1000000");
        assert_eq!(
            choose(&[&a, &b], None, true),
            Choice::Promote {
                instance: "db-3".into(),
                lsn: Lsn(0x300_0100)
            }
        );
    }

    #[test]
    fn equal_positions_choose_by_replay_then_name() {
        let a = replica("db-3", "0/3000000", "0/3000000");
        let b = replica("db-2", "0/3000000", "0/3000000");
        let c = replica("db-4", "0/3000000", "0/2000000");
        let Choice::Promote { instance, .. } = choose(&[&a, &b, &c], None, true) else {
            panic!("a choice")
        };
        assert_eq!(instance, "db-2");
    }

    #[test]
    fn unreachable_fenced_or_primary_instances_are_not_candidates() {
        let mut gone = replica("db-2", "0/9000000", "0/9000000");
        gone.reachable = false;
        let mut fenced = replica("db-3", "0/9000000", "0/9000000");
        fenced.fenced = true;
        let mut primary = replica("db-4", "0/9000000", "0/9000000");
        primary.role = Some(RunningRole::Primary);
        let mut stopped = replica("db-5", "0/9000000", "0/9000000");
        stopped.running = false;
        let ok = replica("db-6", "0/1000000", "0/1000000");
        let Choice::Promote { instance, .. } =
            choose(&[&gone, &fenced, &primary, &stopped, &ok], None, true)
        else {
            panic!("a choice")
        };
        assert_eq!(instance, "db-6");
        assert!(matches!(
            choose(&[&gone, &fenced], None, true),
            Choice::Wait(_)
        ));
    }

    #[test]
    fn required_durability_waits_for_enough_of_the_quorum() {
        let quorum = Quorum::parse("ANY 1 (\"db-2\", \"db-3\")").expect("a quorum");
        let a = replica("db-2", "0/3000000", "0/3000000");
        let mut b = replica("db-3", "0/4000000", "0/4000000");
        b.reachable = false;
        // One of two standbys seen with ANY 1: the unseen one may hold the last commit.
        let Choice::Wait(reason) = choose(&[&a, &b], Some(&quorum), true) else {
            panic!("must wait")
        };
        assert!(reason.contains("1 of the synchronous standbys"), "{reason}");
        // Preferred durability promotes what it can see.
        assert!(matches!(
            choose(&[&a, &b], Some(&quorum), false),
            Choice::Promote { .. }
        ));
        // Both seen: the most advanced.
        b.reachable = true;
        let Choice::Promote { instance, .. } = choose(&[&a, &b], Some(&quorum), true) else {
            panic!("a choice")
        };
        assert_eq!(instance, "db-3");
    }

    #[test]
    fn with_two_of_three_any_two_suffice() {
        let quorum = Quorum::parse("ANY 2 (\"a\", \"b\", \"c\")").expect("a quorum");
        let a = replica("a", "0/3000000", "0/3000000");
        let b = replica("b", "0/3000010", "0/3000000");
        let mut c = replica("c", "0/3000020", "0/3000000");
        c.reachable = false;
        assert!(matches!(
            choose(&[&a, &b, &c], Some(&quorum), true),
            Choice::Promote { ref instance, .. } if instance == "b"
        ));
    }

    #[test]
    fn leases_run_until_the_last_grant_and_one_lease_past_the_start() {
        let began = UNIX_EPOCH + Duration::from_secs(1000);
        // Just started: a previous operator's grant may run for one lease.
        assert!(leases_may_run(began + Duration::from_secs(1), None, began).is_some());
        assert!(
            leases_may_run(
                began + LEASE_DURATION + CLOCK_SKEW + Duration::from_millis(1),
                None,
                began
            )
            .is_none()
        );
        // A grant of our own that ends later holds promotion back until it ends.
        let granted = began + Duration::from_secs(60);
        assert!(leases_may_run(granted, Some(granted), began).is_some());
        assert!(leases_may_run(granted + CLOCK_SKEW, Some(granted), began).is_none());
    }
}
