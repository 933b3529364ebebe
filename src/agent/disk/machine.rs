//! The `DiskActor`'s machine: one block device of the node through its lifecycle —
//! discovered → unclaimed (or refused) → claimed → member → missing/failed → released.
//!
//! Pure. On each look the node's actor tells every disk what was seen of it (or that
//! it was not seen) and what its `BlockDevice` object says now; the disk decides its
//! write with `inventory::plan` (the same decision for one device as for all) and
//! asks its shell to make it. Claims, membership and failure are the pools' to set
//! (`pool::shell`); the disk follows them in its phase. A write that fails puts the
//! machine in a failed state: the actor stops and its supervisor restarts it with
//! back-off, reporting it (`Degraded` on the object) once it keeps failing; the first
//! good look of a later incarnation clears that condition again.

use std::fmt;

use castellan_actors::StateMachine;
use castellan_crds::block_device::{BlockDevice, BlockDeviceState};
use k8s_openapi::jiff::Timestamp;

use super::inventory::{self, DEGRADED, Write};
use super::observe::Observed;

/// Where a disk is in its lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskPhase {
    /// Seen, no object yet (before its first write).
    Discovered,
    /// Free for a pool.
    Unclaimed,
    /// Not usable: it carries data, is mounted, removable… (the object says why).
    Refused,
    /// A pool took it and is building on it.
    Claimed,
    /// A pool's member.
    Member,
    /// Not attached at the latest look.
    Missing,
    /// A pool found it failing (errors, or missing past the grace period).
    Failed,
    /// A pool let it go (deleted, or replaced it): unclaimed again.
    Released,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskState {
    pub phase: DiskPhase,
    /// The object carries a `Degraded` condition from an earlier incarnation, to clear
    /// after this one's first good write.
    pub degraded: bool,
    /// Why this incarnation cannot go on (a write failed).
    pub failed: Option<String>,
}

impl DiskState {
    pub const fn new() -> Self {
        Self {
            phase: DiskPhase::Discovered,
            degraded: false,
            failed: None,
        }
    }
}

/// What one look found of one disk.
#[derive(Clone, Debug)]
pub struct Sighting {
    pub node: String,
    /// What the look saw; `None`: not attached.
    pub observed: Option<Observed>,
    /// The disk's object as the API server had it before the look's writes.
    pub object: Option<BlockDevice>,
    pub now: Timestamp,
}

/// Held while a disk's work for a look is outstanding; dropped when it is done (or
/// the actor died), which is what the look waits for before the pools' passes.
pub struct Done(pub tokio::sync::oneshot::Sender<()>);

impl Done {
    /// The work is done (dropping it says the same, for whatever reason).
    pub fn finish(self) {
        // The look may have stopped waiting; nothing to tell then.
        let _ = self.0.send(());
    }
}

impl fmt::Debug for Done {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Done")
    }
}

#[derive(Debug)]
pub enum DiskEvent {
    Seen(Box<Sighting>, Done),
    /// The write asked for ended.
    Written(Result<(), String>),
}

#[derive(Debug)]
pub enum DiskEffect {
    /// Apply `write` to the object (of `generation`), then drop `done`.
    Write {
        write: Box<Write>,
        generation: Option<i64>,
        done: Done,
    },
    /// Remove the supervisor's `Degraded` condition.
    ClearDegraded,
}

pub struct DiskMachine;

impl StateMachine for DiskMachine {
    type State = DiskState;
    type Event = DiskEvent;
    type Effect = DiskEffect;

    fn transition(state: DiskState, event: DiskEvent) -> (DiskState, Vec<DiskEffect>) {
        if state.failed.is_some() {
            return (state, vec![]); // stopping for a restart
        }
        match event {
            DiskEvent::Seen(sighting, done) => seen(state, *sighting, done),
            DiskEvent::Written(Ok(())) if state.degraded => (
                DiskState {
                    degraded: false,
                    ..state
                },
                vec![DiskEffect::ClearDegraded],
            ),
            DiskEvent::Written(Ok(())) => (state, vec![]),
            DiskEvent::Written(Err(reason)) => (
                DiskState {
                    failed: Some(reason),
                    ..state
                },
                vec![],
            ),
        }
    }

    fn label(event: &DiskEvent) -> String {
        match event {
            DiskEvent::Seen(sighting, _) if sighting.observed.is_some() => "seen".into(),
            DiskEvent::Seen(..) => "not seen".into(),
            DiskEvent::Written(Ok(())) => "written".into(),
            DiskEvent::Written(Err(_)) => "write failed".into(),
        }
    }

    fn failure(state: &DiskState) -> Option<String> {
        state.failed.clone()
    }
}

fn seen(state: DiskState, sighting: Sighting, done: Done) -> (DiskState, Vec<DiskEffect>) {
    let Sighting {
        node,
        observed,
        object,
        now,
    } = sighting;
    let write = inventory::plan(observed.as_slice(), object.as_slice(), &node, now)
        .into_iter()
        .next();
    let status = object.as_ref().and_then(|object| object.status.as_ref());
    let degraded = status.is_some_and(|status| {
        status
            .conditions
            .iter()
            .any(|condition| condition.type_ == DEGRADED)
    });
    // The state after the write: the write's own when it sets one, else the object's.
    let (after, message) = match write
        .as_ref()
        .and_then(|write| write.status.as_ref())
        .filter(|status| status.state.is_some())
    {
        Some(written) => (written.state, written.message.as_deref()),
        None => (
            status.and_then(|status| status.state),
            status.and_then(|status| status.message.as_deref()),
        ),
    };
    let phase = phase_after(state.phase, after, message.is_some());
    match write {
        Some(write) => (
            DiskState {
                phase,
                degraded,
                failed: None,
            },
            vec![DiskEffect::Write {
                write: Box::new(write),
                generation: object.and_then(|object| object.metadata.generation),
                done,
            }],
        ),
        // Nothing to write: the look's work for this disk is done (`done` drops).
        None => (
            DiskState {
                phase,
                degraded: false,
                failed: None,
            },
            if degraded {
                vec![DiskEffect::ClearDegraded]
            } else {
                vec![]
            },
        ),
    }
}

/// The phase for the object's state after a look; `refused`: an unclaimed disk's
/// message says why it is not usable.
fn phase_after(before: DiskPhase, state: Option<BlockDeviceState>, refused: bool) -> DiskPhase {
    match state {
        None => DiskPhase::Discovered,
        Some(BlockDeviceState::Unclaimed) if refused => DiskPhase::Refused,
        Some(BlockDeviceState::Unclaimed)
            if matches!(
                before,
                DiskPhase::Claimed | DiskPhase::Member | DiskPhase::Failed
            ) =>
        {
            DiskPhase::Released
        }
        Some(BlockDeviceState::Unclaimed) => DiskPhase::Unclaimed,
        Some(BlockDeviceState::Claimed) => DiskPhase::Claimed,
        Some(BlockDeviceState::InUse) => DiskPhase::Member,
        Some(BlockDeviceState::Missing) => DiskPhase::Missing,
        Some(BlockDeviceState::Failed) => DiskPhase::Failed,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
pub(crate) mod tests {
    use super::*;
    use castellan_crds::block_device::BlockDeviceStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    fn observed(refusal: Option<&str>) -> Observed {
        observed_named("disk-a", refusal)
    }

    /// A disk seen now on node `n1`.
    pub(crate) fn observed_named(name: &str, refusal: Option<&str>) -> Observed {
        Observed {
            name: name.into(),
            spec: inventory::tests::spec("/dev/loop7"),
            refusal: refusal.map(Into::into),
            facts: Default::default(),
        }
    }

    fn object(state: BlockDeviceState, degraded: bool, now: Timestamp) -> BlockDevice {
        let seen = observed(None);
        let mut object = BlockDevice::new("disk-a", seen.spec);
        object.metadata = ObjectMeta {
            name: Some("disk-a".into()),
            generation: Some(3),
            labels: Some([(crate::kube_ops::NODE_LABEL.to_string(), "n1".to_string())].into()),
            ..Default::default()
        };
        object.status = Some(BlockDeviceStatus {
            observed_generation: Some(3),
            state: Some(state),
            last_seen: Some(now.to_string()),
            conditions: if degraded {
                vec![Condition {
                    type_: DEGRADED.into(),
                    status: "True".into(),
                    reason: "ActorFailing".into(),
                    message: "x".into(),
                    last_transition_time: Time(now),
                    observed_generation: None,
                }]
            } else {
                vec![]
            },
            ..Default::default()
        });
        object
    }

    fn seen_event(
        observed: Option<Observed>,
        object: Option<BlockDevice>,
        now: Timestamp,
    ) -> (DiskEvent, tokio::sync::oneshot::Receiver<()>) {
        let (done, wait) = tokio::sync::oneshot::channel();
        let sighting = Sighting {
            node: "n1".into(),
            observed,
            object,
            now,
        };
        (DiskEvent::Seen(Box::new(sighting), Done(done)), wait)
    }

    fn with_phase(phase: DiskPhase) -> DiskState {
        DiskState {
            phase,
            ..DiskState::new()
        }
    }

    #[test]
    fn discovered_seen_without_an_object_writes_it_unclaimed() {
        let (event, mut wait) = seen_event(Some(observed(None)), None, Timestamp::now());
        let (state, effects) = DiskMachine::transition(DiskState::new(), event);
        assert_eq!(state.phase, DiskPhase::Unclaimed);
        let [
            DiskEffect::Write {
                write, generation, ..
            },
        ] = effects.as_slice()
        else {
            panic!("expected one write, got {effects:?}");
        };
        assert!(write.spec.is_some());
        assert_eq!(*generation, None);
        // The token travels with the write: the look waits until it is made.
        assert!(
            wait.try_recv()
                .is_err_and(|error| error == tokio::sync::oneshot::error::TryRecvError::Empty)
        );
    }

    #[test]
    fn discovered_seen_with_a_refusal_is_refused() {
        let (event, _wait) =
            seen_event(Some(observed(Some("carries ext4"))), None, Timestamp::now());
        let (state, _) = DiskMachine::transition(DiskState::new(), event);
        assert_eq!(state.phase, DiskPhase::Refused);
    }

    #[test]
    fn unclaimed_seen_unchanged_writes_nothing_and_is_done_at_once() {
        let now = Timestamp::now();
        let current = object(BlockDeviceState::Unclaimed, false, now);
        let (event, mut wait) = seen_event(Some(observed(None)), Some(current), now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Unclaimed), event);
        assert_eq!(state.phase, DiskPhase::Unclaimed);
        assert!(effects.is_empty());
        assert!(
            wait.try_recv()
                .is_err_and(|error| error == tokio::sync::oneshot::error::TryRecvError::Closed)
        );
    }

    #[test]
    fn claimed_and_member_follow_the_pools_state() {
        let now = Timestamp::now();
        for (state, phase) in [
            (BlockDeviceState::Claimed, DiskPhase::Claimed),
            (BlockDeviceState::InUse, DiskPhase::Member),
            (BlockDeviceState::Failed, DiskPhase::Failed),
        ] {
            let (event, _wait) =
                seen_event(Some(observed(None)), Some(object(state, false, now)), now);
            let (after, effects) = DiskMachine::transition(with_phase(DiskPhase::Unclaimed), event);
            assert_eq!(after.phase, phase);
            assert!(effects.is_empty(), "the pool's state is left alone");
        }
    }

    #[test]
    fn member_not_seen_becomes_missing() {
        let now = Timestamp::now();
        let (event, _wait) =
            seen_event(None, Some(object(BlockDeviceState::InUse, false, now)), now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Member), event);
        assert_eq!(state.phase, DiskPhase::Missing);
        let [DiskEffect::Write { write, .. }] = effects.as_slice() else {
            panic!("expected one write, got {effects:?}");
        };
        assert_eq!(
            write.status.as_ref().and_then(|status| status.state),
            Some(BlockDeviceState::Missing)
        );
    }

    #[test]
    fn missing_and_still_not_seen_writes_nothing() {
        let now = Timestamp::now();
        let (event, _wait) = seen_event(
            None,
            Some(object(BlockDeviceState::Missing, false, now)),
            now,
        );
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Missing), event);
        assert_eq!(state.phase, DiskPhase::Missing);
        assert!(effects.is_empty());
    }

    #[test]
    fn member_unclaimed_again_is_released_then_unclaimed() {
        let now = Timestamp::now();
        let current = object(BlockDeviceState::Unclaimed, false, now);
        let (event, _wait) = seen_event(Some(observed(None)), Some(current.clone()), now);
        let (state, _) = DiskMachine::transition(with_phase(DiskPhase::Member), event);
        assert_eq!(state.phase, DiskPhase::Released);
        let (event, _wait) = seen_event(Some(observed(None)), Some(current), now);
        let (state, _) = DiskMachine::transition(state, event);
        assert_eq!(state.phase, DiskPhase::Unclaimed);
    }

    #[test]
    fn claimed_or_failed_unclaimed_again_is_released() {
        let now = Timestamp::now();
        for before in [DiskPhase::Claimed, DiskPhase::Failed] {
            let current = object(BlockDeviceState::Unclaimed, false, now);
            let (event, _wait) = seen_event(Some(observed(None)), Some(current), now);
            let (state, _) = DiskMachine::transition(with_phase(before), event);
            assert_eq!(state.phase, DiskPhase::Released, "from {before:?}");
        }
    }

    /// The refusal is checked first: a disk a pool let go that still carries data says
    /// why it cannot be used, not that it was released.
    #[test]
    fn a_member_let_go_with_data_on_it_is_refused() {
        let now = Timestamp::now();
        let mut current = object(BlockDeviceState::Unclaimed, false, now);
        if let Some(status) = current.status.as_mut() {
            status.message = Some("carries btrfs".into());
        }
        let (event, _wait) = seen_event(Some(observed(Some("carries btrfs"))), Some(current), now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Member), event);
        assert_eq!(state.phase, DiskPhase::Refused);
        assert!(effects.is_empty());
    }

    #[test]
    fn missing_seen_again_is_written_unclaimed() {
        let now = Timestamp::now();
        let current = object(BlockDeviceState::Missing, false, now);
        let (event, _wait) = seen_event(Some(observed(None)), Some(current), now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Missing), event);
        assert_eq!(state.phase, DiskPhase::Unclaimed);
        let [
            DiskEffect::Write {
                write, generation, ..
            },
        ] = effects.as_slice()
        else {
            panic!("expected one write, got {effects:?}");
        };
        let status = write.status.as_ref().unwrap();
        assert_eq!(
            (status.state, status.last_seen.as_deref()),
            (
                Some(BlockDeviceState::Unclaimed),
                Some(now.to_string().as_str())
            )
        );
        // The write is of the object as it was read.
        assert_eq!(*generation, Some(3));
    }

    #[test]
    fn an_unclaimed_disk_is_refused_while_a_refusal_lasts_and_unclaimed_after() {
        let now = Timestamp::now();
        let free = object(BlockDeviceState::Unclaimed, false, now);
        let (event, _wait) = seen_event(Some(observed(Some("mounted at /mnt"))), Some(free), now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Unclaimed), event);
        assert_eq!(state.phase, DiskPhase::Refused);
        let [DiskEffect::Write { write, .. }] = effects.as_slice() else {
            panic!("expected one write, got {effects:?}");
        };
        let written = write.status.as_ref().unwrap();
        assert_eq!(written.message.as_deref(), Some("mounted at /mnt"));

        let mut refused = object(BlockDeviceState::Unclaimed, false, now);
        if let Some(status) = refused.status.as_mut() {
            status.message = Some("mounted at /mnt".into());
        }
        let (event, _wait) = seen_event(Some(observed(None)), Some(refused), now);
        let (state, effects) = DiskMachine::transition(state, event);
        assert_eq!(state.phase, DiskPhase::Unclaimed);
        let [DiskEffect::Write { write, .. }] = effects.as_slice() else {
            panic!("expected one write, got {effects:?}");
        };
        let written = write.status.as_ref().unwrap();
        assert_eq!(
            (written.state, written.message.as_deref()),
            (Some(BlockDeviceState::Unclaimed), None)
        );
    }

    /// A state of `None` is the agent's to set: seen, the disk is written `Unclaimed`;
    /// not seen, `Missing`. Only with neither an object nor a sighting (the object was
    /// deleted while the disk was away) is there no state at all, and the disk is
    /// `Discovered` again, with nothing to write until it is seen.
    #[test]
    fn an_object_without_a_state_takes_the_agents_and_without_an_object_it_is_discovered() {
        let now = Timestamp::now();
        let mut stateless = object(BlockDeviceState::Unclaimed, false, now);
        if let Some(status) = stateless.status.as_mut() {
            status.state = None;
        }
        for (seen, phase, written) in [
            (
                Some(observed(None)),
                DiskPhase::Unclaimed,
                BlockDeviceState::Unclaimed,
            ),
            (None, DiskPhase::Missing, BlockDeviceState::Missing),
        ] {
            let (event, _wait) = seen_event(seen, Some(stateless.clone()), now);
            let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Released), event);
            assert_eq!(state.phase, phase);
            let [DiskEffect::Write { write, .. }] = effects.as_slice() else {
                panic!("expected one write, got {effects:?}");
            };
            assert_eq!(write.status.as_ref().unwrap().state, Some(written));
        }

        let (event, mut wait) = seen_event(None, None, now);
        let (state, effects) = DiskMachine::transition(with_phase(DiskPhase::Missing), event);
        assert_eq!(state.phase, DiskPhase::Discovered);
        assert!(effects.is_empty());
        assert!(
            wait.try_recv()
                .is_err_and(|error| error == tokio::sync::oneshot::error::TryRecvError::Closed)
        );
    }

    #[test]
    fn a_failed_write_fails_the_actor_and_nothing_more_happens() {
        let (state, effects) = DiskMachine::transition(
            with_phase(DiskPhase::Unclaimed),
            DiskEvent::Written(Err("applying the status: 500".into())),
        );
        assert!(effects.is_empty());
        assert_eq!(
            DiskMachine::failure(&state).as_deref(),
            Some("applying the status: 500")
        );
        let (event, _wait) = seen_event(Some(observed(None)), None, Timestamp::now());
        let (after, effects) = DiskMachine::transition(state.clone(), event);
        assert_eq!((after, effects.len()), (state, 0));
    }

    #[test]
    fn a_degraded_disk_is_cleared_after_the_first_good_write() {
        let now = Timestamp::now();
        // Stale lastSeen: a write is due.
        let mut current = object(BlockDeviceState::Unclaimed, true, now);
        if let Some(status) = current.status.as_mut() {
            status.last_seen = Some("2000-01-01T00:00:00Z".into());
        }
        let (event, _wait) = seen_event(Some(observed(None)), Some(current), now);
        let (state, effects) = DiskMachine::transition(DiskState::new(), event);
        assert!(state.degraded);
        assert!(matches!(effects.as_slice(), [DiskEffect::Write { .. }]));
        let (state, effects) = DiskMachine::transition(state, DiskEvent::Written(Ok(())));
        assert!(!state.degraded);
        assert!(matches!(effects.as_slice(), [DiskEffect::ClearDegraded]));
        let (_, effects) = DiskMachine::transition(state, DiskEvent::Written(Ok(())));
        assert!(effects.is_empty());
    }

    #[test]
    fn a_degraded_disk_with_nothing_to_write_is_cleared_at_once() {
        let now = Timestamp::now();
        let current = object(BlockDeviceState::Unclaimed, true, now);
        let (event, _wait) = seen_event(Some(observed(None)), Some(current), now);
        let (state, effects) = DiskMachine::transition(DiskState::new(), event);
        assert!(!state.degraded);
        assert!(matches!(effects.as_slice(), [DiskEffect::ClearDegraded]));
    }
}
