//! The directories of a major upgrade on the primary's volume, and what to do given
//! what they hold. Pure: the shell (`shell.rs`) looks, this decides, the shell acts.
//!
//! ```text
//! <volume>/pgdata                 the live data directory (the instance's PGDATA)
//! <volume>/pgdata-next            the new cluster while pg_upgrade builds it
//! <volume>/pgdata-next.complete   written once pgdata-next is whole (a Record)
//! <volume>/pgdata-previous        the old cluster after the swap, for a rollback
//! <volume>/pgdata-rolled-back     the new cluster while a rollback removes it
//! <volume>/upgrade.json           what the last upgrade did (a Record)
//! ```
//!
//! Every step is a rename or a removal of something that can be made again, so a run
//! killed at any point is resumed or cleaned up by running it again; the live data
//! directory is never removed, and neither is `pgdata-previous` by anything but
//! `forget-previous`.

use std::path::{Path, PathBuf};

/// The paths on one volume.
#[derive(Clone, Debug)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn live(&self) -> PathBuf {
        self.root.join("pgdata")
    }

    pub fn next(&self) -> PathBuf {
        self.root.join("pgdata-next")
    }

    pub fn complete(&self) -> PathBuf {
        self.root.join("pgdata-next.complete")
    }

    pub fn previous(&self) -> PathBuf {
        self.root.join("pgdata-previous")
    }

    pub fn rolled_back(&self) -> PathBuf {
        self.root.join("pgdata-rolled-back")
    }

    pub fn record(&self) -> PathBuf {
        self.root.join("upgrade.json")
    }

    /// pg_upgrade's sockets: on the volume, short (a socket path has at most 107
    /// bytes), reachable by its user only.
    pub fn sockets(&self) -> PathBuf {
        self.root.join("upgrade-sockets")
    }
}

/// What one of the directories holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holds {
    Missing,
    /// A directory with nothing in it (an instance manager that found `pgdata` missing
    /// makes it before it waits for the operator).
    Empty,
    /// Something without `PG_VERSION`: not a cluster.
    Other,
    /// A cluster of this major (its `PG_VERSION`).
    Major(String),
}

impl Holds {
    fn is(&self, major: &str) -> bool {
        matches!(self, Holds::Major(held) if held == major)
    }

    fn absent(&self) -> bool {
        matches!(self, Holds::Missing | Holds::Empty)
    }

    fn describe(&self, name: &str) -> String {
        match self {
            Holds::Missing => format!("{name} is missing"),
            Holds::Empty => format!("{name} is empty"),
            Holds::Other => format!("{name} holds no PostgreSQL cluster (no PG_VERSION)"),
            Holds::Major(major) => format!("{name} holds PostgreSQL {major}"),
        }
    }
}

/// What the volume holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub live: Holds,
    pub next: Holds,
    /// `pgdata-next.complete` exists.
    pub next_complete: bool,
    pub previous: Holds,
}

impl Seen {
    fn describe(&self) -> String {
        format!(
            "{}, {}{}, {}",
            self.live.describe("pgdata"),
            self.next.describe("pgdata-next"),
            if self.next_complete {
                " (marked complete)"
            } else {
                ""
            },
            self.previous.describe("pgdata-previous")
        )
    }
}

/// What `upgrade run` does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpgradePlan {
    /// The upgrade happened: report it again.
    Done,
    /// pg_upgrade finished and `pgdata` was moved to `pgdata-previous`, then the run
    /// stopped: move `pgdata-next` to `pgdata` (an empty `pgdata` removed first).
    FinishSwap,
    /// Upgrade from the start, removing what a stopped run left in `pgdata-next`.
    Upgrade { leftover_next: bool },
    /// Nothing to do safely; why.
    Refuse(String),
}

pub fn plan_upgrade(seen: &Seen, from: &str, to: &str) -> UpgradePlan {
    if seen.live.is(to) && seen.previous.is(from) {
        return UpgradePlan::Done;
    }
    let complete = seen.next_complete && seen.next.is(to);
    if complete && seen.live.absent() && seen.previous.is(from) {
        return UpgradePlan::FinishSwap;
    }
    // A complete pgdata-next beside a live pgdata is never swapped in: the old server
    // may have run on pgdata since (the operator gave up and started it), and its
    // writes would be lost. It is made again.
    if seen.live.is(from) {
        if seen.previous != Holds::Missing {
            return UpgradePlan::Refuse(format!(
                "{} from an earlier upgrade (its rollback window): run `castellan upgrade \
                 forget-previous` first; nothing was changed",
                seen.previous.describe("pgdata-previous")
            ));
        }
        return UpgradePlan::Upgrade {
            leftover_next: seen.next != Holds::Missing || seen.next_complete,
        };
    }
    UpgradePlan::Refuse(format!(
        "cannot upgrade from PostgreSQL {from} to {to}: {}; nothing was changed",
        seen.describe()
    ))
}

/// What `upgrade rollback` (back from `from`, the new major, to `to`, the old one)
/// does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RollbackPlan {
    /// `pgdata` holds `to` and nothing is kept beside it: report it again (after
    /// removing what a stopped rollback left).
    Done,
    /// Move `pgdata` (when it holds `from`) aside and `pgdata-previous` to `pgdata`.
    Swap {
        live_present: bool,
    },
    Refuse(String),
}

pub fn plan_rollback(seen: &Seen, from: &str, to: &str) -> RollbackPlan {
    if seen.previous.is(to) {
        if seen.live.is(from) {
            return RollbackPlan::Swap { live_present: true };
        }
        if seen.live.absent() {
            return RollbackPlan::Swap {
                live_present: false,
            };
        }
    }
    if seen.live.is(to) && seen.previous == Holds::Missing {
        return RollbackPlan::Done;
    }
    RollbackPlan::Refuse(format!(
        "cannot roll back from PostgreSQL {from} to {to}: {}; nothing was changed",
        seen.describe()
    ))
}

/// Why `forget-previous` must not remove `pgdata-previous`, if it must not: when
/// `pgdata` holds no cluster, the previous one may be the only copy of the data.
pub fn forget_refusal(seen: &Seen) -> Option<String> {
    match (&seen.previous, &seen.live) {
        (Holds::Missing, _) | (_, Holds::Major(_)) => None,
        _ => Some(format!(
            "not removing pgdata-previous: {}, so it may be the only copy of the data",
            seen.live.describe("pgdata")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn major(m: &str) -> Holds {
        Holds::Major(m.into())
    }

    fn seen(live: Holds, next: Holds, next_complete: bool, previous: Holds) -> Seen {
        Seen {
            live,
            next,
            next_complete,
            previous,
        }
    }

    #[test]
    fn an_upgrade_starts_resumes_or_reports_itself_done() {
        use Holds::*;
        use UpgradePlan::*;
        let cases = [
            (
                seen(major("15"), Missing, false, Missing),
                Upgrade {
                    leftover_next: false,
                },
            ),
            // Killed during initdb or pg_upgrade: start again.
            (
                seen(major("15"), Other, false, Missing),
                Upgrade {
                    leftover_next: true,
                },
            ),
            (
                seen(major("15"), major("18"), false, Missing),
                Upgrade {
                    leftover_next: true,
                },
            ),
            // Killed after marking complete, before the first rename: the old server may
            // have run since, so it is made again rather than swapped in.
            (
                seen(major("15"), major("18"), true, Missing),
                Upgrade {
                    leftover_next: true,
                },
            ),
            (
                seen(major("15"), Missing, true, Missing),
                Upgrade {
                    leftover_next: true,
                },
            ),
            // Killed between the renames (and an instance manager may have made pgdata).
            (seen(Missing, major("18"), true, major("15")), FinishSwap),
            (seen(Empty, major("18"), true, major("15")), FinishSwap),
            (seen(major("18"), Missing, false, major("15")), Done),
            (seen(major("18"), Missing, true, major("15")), Done),
        ];
        for (seen, plan) in cases {
            assert_eq!(plan_upgrade(&seen, "15", "18"), plan, "{seen:?}");
        }
    }

    #[test]
    fn an_upgrade_refuses_what_it_did_not_make() {
        use Holds::*;
        for seen in [
            // The previous upgrade's rollback window is still open.
            seen(major("15"), Missing, false, major("14")),
            seen(major("14"), Missing, false, Missing),
            seen(Missing, Missing, false, Missing),
            seen(Other, Missing, false, Missing),
            // pgdata-next not marked complete: never swapped in.
            seen(Missing, major("18"), false, major("15")),
            seen(major("18"), Missing, false, Missing),
            seen(major("18"), Missing, false, major("14")),
        ] {
            let plan = plan_upgrade(&seen, "15", "18");
            let UpgradePlan::Refuse(message) = plan else {
                panic!("{seen:?}: {plan:?}");
            };
            assert!(message.contains("nothing was changed"), "{message}");
        }
        let UpgradePlan::Refuse(message) =
            plan_upgrade(&seen(major("14"), Missing, false, Missing), "15", "18")
        else {
            panic!("refused");
        };
        assert!(message.contains("pgdata holds PostgreSQL 14"), "{message}");
    }

    #[test]
    fn a_rollback_swaps_back_resumes_or_reports_itself_done() {
        use Holds::*;
        use RollbackPlan::*;
        let cases = [
            (
                seen(major("18"), Missing, false, major("15")),
                Swap { live_present: true },
            ),
            (
                seen(Missing, Missing, false, major("15")),
                Swap {
                    live_present: false,
                },
            ),
            (
                seen(Empty, Missing, false, major("15")),
                Swap {
                    live_present: false,
                },
            ),
            (seen(major("15"), Missing, false, Missing), Done),
            // A rollback of an upgrade stopped between its renames.
            (
                seen(Missing, major("18"), true, major("15")),
                Swap {
                    live_present: false,
                },
            ),
        ];
        for (seen, plan) in cases {
            assert_eq!(plan_rollback(&seen, "18", "15"), plan, "{seen:?}");
        }
        for seen in [
            seen(major("18"), Missing, false, Missing),
            seen(major("15"), Missing, false, major("15")),
            seen(Other, Missing, false, major("15")),
        ] {
            assert!(
                matches!(plan_rollback(&seen, "18", "15"), Refuse(_)),
                "{seen:?}"
            );
        }
    }

    #[test]
    fn the_previous_data_is_forgotten_only_beside_a_live_cluster() {
        use Holds::*;
        assert_eq!(
            forget_refusal(&seen(major("18"), Missing, false, major("15"))),
            None
        );
        assert_eq!(
            forget_refusal(&seen(Missing, Missing, false, Missing)),
            None
        );
        assert!(forget_refusal(&seen(Missing, Missing, false, major("15"))).is_some());
        assert!(forget_refusal(&seen(Empty, major("18"), true, major("15"))).is_some());
    }
}
