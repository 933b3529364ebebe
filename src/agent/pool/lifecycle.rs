//! The `PoolMemberActor`'s machine: this node's part of one `StoragePool` through its
//! lifecycle — planning → wiping → formatting or adding → mounting → healthy or
//! degraded (→ replacing a failed member) → deleting → released (or left, when the
//! pool no longer selects the node), and blocked while nothing can be built.
//!
//! Pure. The work is the pool shell's pass (`shell::Pools::pass`), one at a time
//! ([`Serial`]: a request while a pass runs is kept and run next, the newer replacing
//! the older). While a pass runs it reports each kind of step it starts (`Step`), and
//! its end says where the node's part now stands (`Settled`, from what it wrote to
//! status); both move the phase. A pass that fails puts the machine in `Failed`: the
//! actor stops and its supervisor restarts it with back-off, marking the node's entry
//! `Failed` once it keeps failing. Each change of phase is an effect (`Entered`), which
//! the shell logs in the pass's trace.

use std::fmt::{self, Debug};
use std::marker::PhantomData;
use std::sync::Arc;

use castellan_actors::StateMachine;

use super::machine::{DEGRADED, HEALTHY, Step};
use crate::agent::children::Next;
use crate::agent::serial::{Serial, SerialEffect, SerialEvent, SerialState};

/// Where this node's part of the pool is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberPhase {
    /// No pass has ended yet in this incarnation.
    Planning,
    /// Nothing can be built: too few clean disks, the spec, or every member missing
    /// (the node's status entry says which).
    Blocked,
    /// Removing old signatures from a disk the pool was allowed to wipe.
    Wiping,
    /// `mkfs.btrfs` on the claimed disks.
    Formatting,
    /// Adding disks to the mounted filesystem (and rebalancing or resizing).
    Adding,
    /// Mounting the filesystem and enabling quotas.
    Mounting,
    /// `btrfs replace` copies a failed member onto a new disk.
    Replacing,
    Healthy,
    /// Mounted, with a member missing or failing.
    Degraded,
    /// The pool is being deleted: unmounting, wiping and releasing its disks here.
    Deleting,
    /// The deleted pool holds nothing on this node any more.
    Released,
    /// The pool no longer selects this node (its filesystem and disks are kept).
    Left,
    /// The latest pass failed: the actor stops and is restarted.
    Failed,
}

impl fmt::Display for MemberPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Debug::fmt(self, f)
    }
}

/// The kind of step a running pass starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Wipe,
    Mkfs,
    /// `btrfs device add`, a balance to the layout's profiles, or a resize.
    Add,
    /// Mount, or enable quotas.
    Mount,
    Replace,
    /// A step of releasing a deleted pool.
    Release,
}

impl StepKind {
    pub const fn of(step: &Step) -> Self {
        match step {
            Step::Wipe { .. } => Self::Wipe,
            Step::Mkfs(_) => Self::Mkfs,
            Step::AddDevices(_) | Step::Balance { .. } | Step::Resize { .. } => Self::Add,
            Step::Mount { .. } | Step::EnableQuota => Self::Mount,
            Step::Replace { .. } => Self::Replace,
        }
    }

    const fn phase(self) -> MemberPhase {
        match self {
            Self::Wipe => MemberPhase::Wiping,
            Self::Mkfs => MemberPhase::Formatting,
            Self::Add => MemberPhase::Adding,
            Self::Mount => MemberPhase::Mounting,
            Self::Replace => MemberPhase::Replacing,
            Self::Release => MemberPhase::Deleting,
        }
    }
}

/// Where a running pass reports the steps it starts.
pub type OnStep = Arc<dyn Fn(StepKind) + Send + Sync>;

/// Where a pass that ended left the node's part of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    Blocked,
    Healthy,
    Degraded,
    /// A replacement runs in the background.
    Replacing,
    /// Deleting, not done here yet (volumes left, or a disk still busy).
    Deleting,
    Released,
    Left,
}

impl Settled {
    /// From the node's entry a pass wrote: nothing built (`blocked`), a replacement
    /// running, else its health (`Pending`: nothing claimed yet, so blocked too).
    pub fn of(blocked: bool, replacing: bool, health: Option<&str>) -> Self {
        match (blocked, replacing, health) {
            (true, _, _) => Self::Blocked,
            (false, true, _) => Self::Replacing,
            (false, false, Some(HEALTHY)) => Self::Healthy,
            (false, false, Some(DEGRADED)) => Self::Degraded,
            _ => Self::Blocked,
        }
    }

    const fn phase(self) -> MemberPhase {
        match self {
            Self::Blocked => MemberPhase::Blocked,
            Self::Healthy => MemberPhase::Healthy,
            Self::Degraded => MemberPhase::Degraded,
            Self::Replacing => MemberPhase::Replacing,
            Self::Deleting => MemberPhase::Deleting,
            Self::Released => MemberPhase::Released,
            Self::Left => MemberPhase::Left,
        }
    }
}

/// The end of a good pass: where it left the pool, and what it asks of the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassEnd {
    pub settled: Settled,
    pub next: Next,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemberState<R> {
    pub phase: MemberPhase,
    pub pass: SerialState<R>,
}

impl<R> MemberState<R> {
    pub const fn new() -> Self {
        Self {
            phase: MemberPhase::Planning,
            pass: SerialState::Idle,
        }
    }
}

impl<R> Default for MemberState<R> {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug, PartialEq)]
pub enum MemberEvent<R> {
    /// Run a pass with this request (now, or after the running one).
    Request(R),
    /// The running pass starts a step of this kind.
    Step(StepKind),
    /// The running pass ended.
    Finished(Result<PassEnd, String>),
}

#[derive(Debug, PartialEq)]
pub enum MemberEffect<R> {
    /// Start a pass; its steps come back as `Step`, its end as `Finished`.
    Run(R),
    /// Tell the node what the pass needs next.
    Report(Next),
    /// The phase changed.
    Entered { from: MemberPhase, to: MemberPhase },
}

/// The machine of one pool's actor on the node, for requests `R`.
pub struct PoolMember<R>(PhantomData<fn() -> R>);

type Pass<R> = Serial<R, PassEnd>;

impl<R> StateMachine for PoolMember<R>
where
    R: Clone + Debug + Unpin + Send + 'static,
{
    type State = MemberState<R>;
    type Event = MemberEvent<R>;
    type Effect = MemberEffect<R>;

    fn transition(state: Self::State, event: Self::Event) -> (Self::State, Vec<Self::Effect>) {
        let MemberState { phase, pass } = state;
        let running = matches!(pass, SerialState::Running { .. });
        let (to, pass, done) = match event {
            MemberEvent::Request(request) => {
                let (pass, done) = Pass::<R>::transition(pass, SerialEvent::Request(request));
                (phase, pass, done)
            }
            // A step of a pass that is not this incarnation's: nothing to follow.
            MemberEvent::Step(_) if !running => (phase, pass, vec![]),
            MemberEvent::Step(kind) => (kind.phase(), pass, vec![]),
            MemberEvent::Finished(outcome) => {
                let settled = outcome.as_ref().ok().map(|end| end.settled);
                let (pass, done) = Pass::<R>::transition(pass, SerialEvent::Finished(outcome));
                let to = match (&pass, settled) {
                    (SerialState::Failed { .. }, _) => MemberPhase::Failed,
                    // A stale end (no pass ran) settles nothing.
                    (_, Some(settled)) if running => settled.phase(),
                    _ => phase,
                };
                (to, pass, done)
            }
        };
        let mut effects = Vec::new();
        if to != phase {
            effects.push(MemberEffect::Entered { from: phase, to });
        }
        effects.extend(done.into_iter().map(|effect| match effect {
            SerialEffect::Run(request) => MemberEffect::Run(request),
            SerialEffect::Report(end) => MemberEffect::Report(end.next),
        }));
        (MemberState { phase: to, pass }, effects)
    }

    /// The variant only: requests carry whole objects.
    fn label(event: &Self::Event) -> String {
        match event {
            MemberEvent::Request(_) => "request".into(),
            MemberEvent::Step(kind) => format!("step {kind:?}"),
            MemberEvent::Finished(Ok(end)) => format!("finished {:?}", end.settled),
            MemberEvent::Finished(Err(_)) => "failed".into(),
        }
    }

    fn failure(state: &Self::State) -> Option<String> {
        Pass::<R>::failure(&state.pass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type M = PoolMember<&'static str>;
    type S = MemberState<&'static str>;
    type Effect = MemberEffect<&'static str>;
    use MemberPhase::*;

    fn at(phase: MemberPhase, pass: SerialState<&'static str>) -> S {
        MemberState { phase, pass }
    }

    fn running(phase: MemberPhase) -> S {
        at(phase, SerialState::Running { pending: None })
    }

    fn end(settled: Settled) -> MemberEvent<&'static str> {
        MemberEvent::Finished(Ok(PassEnd {
            settled,
            next: Next::default(),
        }))
    }

    fn entered(from: MemberPhase, to: MemberPhase) -> Effect {
        MemberEffect::Entered { from, to }
    }

    #[test]
    fn a_new_member_plans_and_its_first_request_runs_a_pass() {
        let (state, effects) = M::transition(S::new(), MemberEvent::Request("look"));
        assert_eq!(state, running(Planning));
        assert_eq!(effects, vec![MemberEffect::Run("look")]);
    }

    #[test]
    fn building_goes_through_wiping_formatting_and_mounting_to_healthy() {
        let mut state = running(Planning);
        let mut phases = Vec::new();
        for kind in [StepKind::Wipe, StepKind::Mkfs, StepKind::Mount] {
            let (next, effects) = M::transition(state, MemberEvent::Step(kind));
            assert_eq!(
                effects,
                vec![entered(
                    phases.last().copied().unwrap_or(Planning),
                    next.phase
                )]
            );
            phases.push(next.phase);
            state = next;
        }
        assert_eq!(phases, [Wiping, Formatting, Mounting]);
        let (state, effects) = M::transition(state, end(Settled::Healthy));
        assert_eq!(state, at(Healthy, SerialState::Idle));
        assert_eq!(
            effects,
            vec![
                entered(Mounting, Healthy),
                MemberEffect::Report(Next::default())
            ]
        );
    }

    #[test]
    fn a_disk_joining_a_healthy_pool_is_adding_then_healthy_again() {
        let (state, effects) = M::transition(running(Healthy), MemberEvent::Step(StepKind::Add));
        assert_eq!(
            (state.phase, effects),
            (Adding, vec![entered(Healthy, Adding)])
        );
        let (state, _) = M::transition(state, end(Settled::Healthy));
        assert_eq!(state.phase, Healthy);
    }

    #[test]
    fn a_pass_that_changes_nothing_keeps_the_phase_without_an_entry() {
        let (state, effects) = M::transition(running(Healthy), end(Settled::Healthy));
        assert_eq!(state, at(Healthy, SerialState::Idle));
        assert_eq!(effects, vec![MemberEffect::Report(Next::default())]);
    }

    #[test]
    fn a_member_failing_makes_it_degraded_and_a_replacement_replacing_then_healthy() {
        let (state, effects) = M::transition(running(Healthy), end(Settled::Degraded));
        assert_eq!(state.phase, Degraded);
        assert_eq!(effects[0], entered(Healthy, Degraded));
        let state = at(Degraded, SerialState::Running { pending: None });
        let (state, effects) = M::transition(state, MemberEvent::Step(StepKind::Replace));
        assert_eq!(
            (state.phase, effects),
            (Replacing, vec![entered(Degraded, Replacing)])
        );
        // The replacement runs in the background: the pass ends with it running…
        let (state, effects) = M::transition(state, end(Settled::Replacing));
        assert_eq!(state.phase, Replacing);
        assert_eq!(effects, vec![MemberEffect::Report(Next::default())]);
        // …and a later pass finds it done.
        let (state, _) = M::transition(
            at(Replacing, SerialState::Idle),
            MemberEvent::Request("look"),
        );
        let (state, effects) = M::transition(state, end(Settled::Healthy));
        assert_eq!(state.phase, Healthy);
        assert_eq!(effects[0], entered(Replacing, Healthy));
    }

    #[test]
    fn a_pool_that_cannot_be_built_is_blocked_until_a_pass_builds_it() {
        let (state, effects) = M::transition(running(Planning), end(Settled::Blocked));
        assert_eq!(state.phase, Blocked);
        assert_eq!(effects[0], entered(Planning, Blocked));
        let (state, _) = M::transition(running(Blocked), MemberEvent::Step(StepKind::Mkfs));
        assert_eq!(state.phase, Formatting);
    }

    #[test]
    fn deleting_releases_the_disks_and_ends_released() {
        let (state, effects) =
            M::transition(running(Healthy), MemberEvent::Step(StepKind::Release));
        assert_eq!(
            (state.phase, effects),
            (Deleting, vec![entered(Healthy, Deleting)])
        );
        // A disk still busy: still deleting after the pass.
        let (state, effects) = M::transition(state, end(Settled::Deleting));
        assert_eq!((state.phase, effects.len()), (Deleting, 1));
        let (state, effects) = M::transition(running(Deleting), end(Settled::Released));
        assert_eq!(state.phase, Released);
        assert_eq!(effects[0], entered(Deleting, Released));
    }

    #[test]
    fn a_node_the_pool_no_longer_selects_is_left() {
        let (state, effects) = M::transition(running(Degraded), end(Settled::Left));
        assert_eq!(state.phase, Left);
        assert_eq!(effects[0], entered(Degraded, Left));
    }

    #[test]
    fn a_failed_pass_is_the_actors_failure_whatever_the_phase() {
        for phase in [Planning, Formatting, Healthy, Deleting] {
            let (state, effects) = M::transition(
                running(phase),
                MemberEvent::Finished(Err("mkfs.btrfs: device busy".into())),
            );
            assert_eq!(state.phase, Failed);
            assert_eq!(effects, vec![entered(phase, Failed)]);
            assert_eq!(
                M::failure(&state).as_deref(),
                Some("mkfs.btrfs: device busy")
            );
        }
        assert_eq!(M::failure(&running(Healthy)), None);
    }

    #[test]
    fn a_request_while_a_pass_runs_is_run_after_it() {
        let (state, effects) = M::transition(running(Mounting), MemberEvent::Request("newer"));
        assert_eq!(
            state,
            at(
                Mounting,
                SerialState::Running {
                    pending: Some("newer")
                }
            )
        );
        assert!(effects.is_empty());
        let (state, effects) = M::transition(state, end(Settled::Healthy));
        assert_eq!(state, running(Healthy));
        assert_eq!(
            effects,
            vec![
                entered(Mounting, Healthy),
                MemberEffect::Report(Next::default()),
                MemberEffect::Run("newer"),
            ]
        );
    }

    #[test]
    fn steps_and_ends_of_no_running_pass_are_stale_and_ignored() {
        let idle = at(Healthy, SerialState::Idle);
        let (state, effects) = M::transition(idle.clone(), MemberEvent::Step(StepKind::Mkfs));
        assert_eq!((state, effects), (idle.clone(), vec![]));
        let (state, effects) = M::transition(idle.clone(), end(Settled::Blocked));
        assert_eq!((state, effects), (idle, vec![]));
    }

    #[test]
    fn a_failed_member_stays_failed_whatever_comes() {
        let failed = at(Failed, SerialState::Failed { reason: "x".into() });
        for event in [
            MemberEvent::Request("a"),
            MemberEvent::Step(StepKind::Mount),
            end(Settled::Healthy),
        ] {
            let (state, effects) = M::transition(failed.clone(), event);
            // A step from the dead pass moves no phase: the pass is no longer running.
            assert_eq!((state, effects), (failed.clone(), vec![]));
        }
    }

    #[test]
    fn a_pass_settles_by_what_it_wrote() {
        assert_eq!(Settled::of(true, false, Some(HEALTHY)), Settled::Blocked);
        assert_eq!(Settled::of(false, true, Some(DEGRADED)), Settled::Replacing);
        assert_eq!(Settled::of(false, false, Some(HEALTHY)), Settled::Healthy);
        assert_eq!(Settled::of(false, false, Some(DEGRADED)), Settled::Degraded);
        assert_eq!(Settled::of(false, false, Some("Pending")), Settled::Blocked);
        assert_eq!(Settled::of(false, false, None), Settled::Blocked);
    }

    #[test]
    fn every_step_names_its_phase() {
        let kinds = [
            (
                Step::Wipe {
                    path: "/dev/a".into(),
                    block_device: "a".into(),
                },
                Wiping,
            ),
            (Step::Mkfs(vec![]), Formatting),
            (Step::AddDevices(vec![]), Adding),
            (
                Step::Balance {
                    data: "raid1",
                    metadata: "raid1",
                },
                Adding,
            ),
            (Step::Resize { devid: 2 }, Adding),
            (
                Step::Mount {
                    devices: vec![],
                    degraded: false,
                },
                Mounting,
            ),
            (Step::EnableQuota, Mounting),
        ];
        for (step, phase) in kinds {
            assert_eq!(StepKind::of(&step).phase(), phase, "{step:?}");
        }
        assert_eq!(StepKind::Release.phase(), Deleting);
        assert_eq!(StepKind::Replace.phase(), Replacing);
    }
}
