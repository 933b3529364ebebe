//! The machine of an actor that runs one pass at a time: the `VolumeActor` (a pass
//! over the node's volumes), and the passes of a `PoolMemberActor`, whose lifecycle
//! (`pool::lifecycle`) follows these rules for them.
//!
//! Pure. A request while a pass runs is kept, the latest replacing any earlier one
//! (it carries the newer view), and run when the pass ends: requests coalesce, and
//! a burst of uevents or watch events costs at most one more pass. A pass that fails
//! puts the machine in `Failed`, which stops the actor as failed: its supervisor
//! restarts it with back-off and reports it once it keeps failing.

use std::fmt::Debug;
use std::marker::PhantomData;

use castellan_actors::StateMachine;

/// A one-pass-at-a-time machine taking requests `R` and producing outcomes `O`.
pub struct Serial<R, O>(PhantomData<fn() -> (R, O)>);

#[derive(Clone, Debug, PartialEq)]
pub enum SerialState<R> {
    /// No pass runs.
    Idle,
    /// A pass runs; `pending` is the request that came meanwhile, run next.
    Running { pending: Option<R> },
    /// The latest pass failed, with why: the actor stops and is restarted.
    Failed { reason: String },
}

#[derive(Debug, PartialEq)]
pub enum SerialEvent<R, O> {
    /// Run a pass with this request (now, or after the running one).
    Request(R),
    /// The running pass ended.
    Finished(Result<O, String>),
}

#[derive(Debug, PartialEq)]
pub enum SerialEffect<R, O> {
    /// Start a pass; its end comes back as `Finished`.
    Run(R),
    /// Tell whoever waits what a pass did.
    Report(O),
}

impl<R, O> StateMachine for Serial<R, O>
where
    R: Clone + Debug + Unpin + Send + 'static,
    O: Clone + Debug + Unpin + Send + 'static,
{
    type State = SerialState<R>;
    type Event = SerialEvent<R, O>;
    type Effect = SerialEffect<R, O>;

    fn transition(state: Self::State, event: Self::Event) -> (Self::State, Vec<Self::Effect>) {
        use SerialEffect::{Report, Run};
        use SerialEvent::{Finished, Request};
        use SerialState::{Failed, Idle, Running};
        match (state, event) {
            (Idle, Request(request)) => (Running { pending: None }, vec![Run(request)]),
            // The newer request replaces the older: it carries the newer view.
            (Running { .. }, Request(request)) => (
                Running {
                    pending: Some(request),
                },
                vec![],
            ),
            (Running { pending: None }, Finished(Ok(outcome))) => (Idle, vec![Report(outcome)]),
            (
                Running {
                    pending: Some(request),
                },
                Finished(Ok(outcome)),
            ) => (
                Running { pending: None },
                vec![Report(outcome), Run(request)],
            ),
            (Running { .. }, Finished(Err(reason))) => (Failed { reason }, vec![]),
            // No pass runs: a late report of an earlier incarnation's pass.
            (Idle, Finished(_)) => (Idle, vec![]),
            // Stopping for a restart: nothing more happens in this incarnation.
            (Failed { reason }, _) => (Failed { reason }, vec![]),
        }
    }

    /// The variant only: requests carry whole objects.
    fn label(event: &Self::Event) -> String {
        match event {
            SerialEvent::Request(_) => "request".into(),
            SerialEvent::Finished(Ok(_)) => "finished".into(),
            SerialEvent::Finished(Err(_)) => "failed".into(),
        }
    }

    fn failure(state: &Self::State) -> Option<String> {
        match state {
            SerialState::Failed { reason } => Some(reason.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type M = Serial<&'static str, u32>;
    type S = SerialState<&'static str>;

    fn step(
        state: S,
        event: SerialEvent<&'static str, u32>,
    ) -> (S, Vec<SerialEffect<&'static str, u32>>) {
        M::transition(state, event)
    }

    #[test]
    fn idle_request_runs_a_pass() {
        let (state, effects) = step(S::Idle, SerialEvent::Request("a"));
        assert_eq!(state, S::Running { pending: None });
        assert_eq!(effects, vec![SerialEffect::Run("a")]);
    }

    #[test]
    fn running_request_is_kept_the_latest_replacing_the_earlier() {
        let running = S::Running { pending: Some("a") };
        let (state, effects) = step(running, SerialEvent::Request("b"));
        assert_eq!(state, S::Running { pending: Some("b") });
        assert!(effects.is_empty());
    }

    #[test]
    fn running_finished_reports_and_goes_idle() {
        let running = S::Running { pending: None };
        let (state, effects) = step(running, SerialEvent::Finished(Ok(7)));
        assert_eq!(state, S::Idle);
        assert_eq!(effects, vec![SerialEffect::Report(7)]);
    }

    #[test]
    fn running_finished_with_a_pending_request_reports_and_runs_it() {
        let running = S::Running { pending: Some("b") };
        let (state, effects) = step(running, SerialEvent::Finished(Ok(7)));
        assert_eq!(state, S::Running { pending: None });
        assert_eq!(
            effects,
            vec![SerialEffect::Report(7), SerialEffect::Run("b")]
        );
    }

    #[test]
    fn running_failed_is_a_failure_of_the_actor() {
        let running = S::Running { pending: Some("b") };
        let (state, effects) = step(running, SerialEvent::Finished(Err("no disk".into())));
        assert_eq!(
            state,
            S::Failed {
                reason: "no disk".into()
            }
        );
        assert!(effects.is_empty());
        assert_eq!(M::failure(&state).as_deref(), Some("no disk"));
        assert_eq!(M::failure(&S::Idle), None);
    }

    #[test]
    fn idle_finished_is_a_stale_report_and_ignored() {
        let (state, effects) = step(S::Idle, SerialEvent::Finished(Ok(2)));
        assert_eq!(state, S::Idle);
        assert!(effects.is_empty());
    }

    #[test]
    fn failed_stays_failed_whatever_comes() {
        let failed = S::Failed { reason: "x".into() };
        let (state, effects) = step(failed.clone(), SerialEvent::Request("a"));
        assert_eq!((state, effects.is_empty()), (failed.clone(), true));
        let (state, effects) = step(failed.clone(), SerialEvent::Finished(Ok(1)));
        assert_eq!((state, effects.is_empty()), (failed, true));
    }
}
