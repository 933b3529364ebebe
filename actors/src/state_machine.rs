//! The functional core and its thin shell. A [`StateMachine`] is pure —
//! `transition(state, event) -> (state, effects)`, no I/O — and an [`Effects`] executor
//! performs the effects it asks for. [`MachineActor`] is the generic actor that joins the
//! two: it feeds each [`Event`] into the machine inside a tracing span, hands the
//! effects to the executor, and answers with the new state. A concrete actor of the tree
//! is therefore a state machine plus an executor, and nothing else.
//!
//! The shell catches a panic in either half at the handler boundary, records it on its
//! [`ChildLink`] and stops, so its supervisor restarts it from its spec.

use std::fmt::Debug;

use actix::prelude::*;
use tracing::{error, info_span};

use crate::supervisor::{Child, ChildKey, ChildLink, Shutdown, catch_panic};

/// A pure state machine: every transition is a function of the state and the event.
pub trait StateMachine: 'static {
    type State: Clone + Debug + Unpin + Send + 'static;
    type Event: Debug + Unpin + Send + 'static;
    type Effect: Debug + 'static;

    fn transition(state: Self::State, event: Self::Event) -> (Self::State, Vec<Self::Effect>);

    /// A short name of the event for its span (by default its `Debug` text; override
    /// it when events carry large values).
    fn label(event: &Self::Event) -> String {
        format!("{event:?}")
    }

    /// Why the actor in `state` cannot go on, if it cannot: the shell then stops it as
    /// failed, and its supervisor restarts it with back-off (and reports it once it
    /// keeps failing). By default no state is a failure.
    fn failure(_state: &Self::State) -> Option<String> {
        None
    }
}

/// Performs effects: the only place a machine's actor touches the outside world.
pub trait Effects<M: StateMachine>: Unpin + 'static {
    /// Performs one effect. Slow work is spawned (or handed to another actor) and its
    /// outcome comes back as an event through `events`; this call must not block.
    fn execute(&mut self, effect: M::Effect, events: &Recipient<Event<M>>);

    /// Called when an incarnation of the actor starts (the first time and after every
    /// restart), e.g. to ask for the event that brings a fresh state up to date.
    fn started(&mut self, _events: &Recipient<Event<M>>) {}
}

/// An event for a [`MachineActor`]; the reply is the state after the transition, or
/// `None` if the transition or an effect panicked (the actor is then stopping).
///
/// It carries the span it was sent from: the actor handles it in a child span, so one
/// operation is one trace through the tree (and, through the instance API's trace
/// context, across processes).
pub struct Event<M: StateMachine> {
    pub event: M::Event,
    pub cause: tracing::Span,
}

impl<M: StateMachine> Event<M> {
    /// An event caused by whatever the current span describes.
    pub fn new(event: M::Event) -> Self {
        Self {
            event,
            cause: tracing::Span::current(),
        }
    }

    /// An event that starts a trace of its own (a timer firing, say).
    pub fn root(event: M::Event) -> Self {
        Self {
            event,
            cause: tracing::Span::none(),
        }
    }
}

/// Answered with whether the machine took the event and runs on: not with its state,
/// which would be a copy per event that almost every sender drops (`GetState` asks).
impl<M: StateMachine> Message for Event<M> {
    type Result = bool;
}

/// What a supervisor needs to (re)build a [`MachineActor`].
#[derive(Debug, Clone)]
pub struct MachineSpec<S, X> {
    pub initial: S,
    pub effects: X,
}

/// The generic shell around a [`StateMachine`] and its [`Effects`] executor.
pub struct MachineActor<M: StateMachine, X: Effects<M>> {
    key: ChildKey,
    /// `None` only after a panic, when the actor is stopping and has no valid state.
    state: Option<M::State>,
    effects: X,
    link: ChildLink,
}

impl<M: StateMachine, X: Effects<M>> MachineActor<M, X> {
    pub fn new(link: ChildLink, initial: M::State, effects: X) -> Self {
        Self {
            key: link.key().to_owned(),
            state: Some(initial),
            effects,
            link,
        }
    }
}

impl<M: StateMachine, X: Effects<M>> Actor for MachineActor<M, X> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let events = ctx.address().recipient();
        self.effects.started(&events);
    }
}

/// Current state without an event (status, tests).
pub struct GetState<M: StateMachine>(std::marker::PhantomData<fn() -> M>);

impl<M: StateMachine> Message for GetState<M> {
    type Result = Option<M::State>;
}

impl<M: StateMachine> Default for GetState<M> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M: StateMachine, X: Effects<M>> Handler<Event<M>> for MachineActor<M, X> {
    type Result = bool;

    fn handle(&mut self, event: Event<M>, ctx: &mut Self::Context) -> Self::Result {
        let span = info_span!(parent: &event.cause, "actor event", actor = %self.key, event = %M::label(&event.event));
        let _entered = span.enter();
        let Some(state) = self.state.take() else {
            return false;
        };
        let events = ctx.address().recipient();
        let effects = &mut self.effects;
        let outcome = catch_panic(move || {
            let (next, to_perform) = M::transition(state, event.event);
            for effect in to_perform {
                effects.execute(effect, &events);
            }
            next
        });
        match outcome {
            Ok(next) => {
                if let Some(reason) = M::failure(&next) {
                    error!(actor = %self.key, %reason, "state machine actor failed; stopping for restart");
                    self.link.fail(reason);
                    ctx.stop();
                    return false;
                }
                self.state = Some(next);
                true
            }
            Err(reason) => {
                error!(actor = %self.key, %reason, "state machine actor failed; stopping for restart");
                self.link.fail(reason);
                ctx.stop();
                false
            }
        }
    }
}

impl<M: StateMachine, X: Effects<M>> Handler<GetState<M>> for MachineActor<M, X> {
    type Result = Option<M::State>;

    fn handle(&mut self, _: GetState<M>, _ctx: &mut Self::Context) -> Self::Result {
        self.state.clone()
    }
}

impl<M: StateMachine, X: Effects<M>> Handler<Shutdown> for MachineActor<M, X> {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

impl<M, X> Child for MachineActor<M, X>
where
    M: StateMachine,
    X: Effects<M> + Clone + Send,
{
    type Spec = MachineSpec<M::State, X>;

    fn build(_key: &ChildKey, spec: &Self::Spec, link: ChildLink) -> Self {
        Self::new(link, spec.initial.clone(), spec.effects.clone())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;
    use crate::supervisor::{
        ChildFailing, ChildStatus, GetChild, GetChildStatus, RestartPolicy, StartChild, Supervisor,
    };

    /// A small machine in the shape of the operator's: one run with bounded retries.
    struct Run;

    const MAX_ATTEMPTS: u32 = 3;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum RunState {
        Idle,
        Running { attempt: u32 },
        Succeeded,
        Failed { reason: String },
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum RunEvent {
        Start,
        Finished,
        Errored(String),
        /// A bug in the machine, to exercise the shell's panic boundary.
        Bug,
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum RunEffect {
        Launch { attempt: u32 },
        Report(String),
    }

    impl StateMachine for Run {
        type State = RunState;
        type Event = RunEvent;
        type Effect = RunEffect;

        fn transition(state: RunState, event: RunEvent) -> (RunState, Vec<RunEffect>) {
            match (state, event) {
                (_, RunEvent::Bug) => panic!("bug in the run machine"),
                (RunState::Idle, RunEvent::Start) => (
                    RunState::Running { attempt: 1 },
                    vec![RunEffect::Launch { attempt: 1 }],
                ),
                (RunState::Running { .. }, RunEvent::Finished) => (
                    RunState::Succeeded,
                    vec![RunEffect::Report("succeeded".into())],
                ),
                (RunState::Running { attempt }, RunEvent::Errored(_)) if attempt < MAX_ATTEMPTS => {
                    (
                        RunState::Running {
                            attempt: attempt + 1,
                        },
                        vec![RunEffect::Launch {
                            attempt: attempt + 1,
                        }],
                    )
                }
                (RunState::Running { .. }, RunEvent::Errored(reason)) => (
                    RunState::Failed {
                        reason: reason.clone(),
                    },
                    vec![RunEffect::Report(reason)],
                ),
                // Anything else is stale or duplicate: ignore it.
                (state, _) => (state, Vec::new()),
            }
        }

        fn failure(state: &RunState) -> Option<String> {
            match state {
                RunState::Failed { reason } => Some(reason.clone()),
                _ => None,
            }
        }
    }

    #[test]
    fn idle_start_launches_first_attempt() {
        assert_eq!(
            Run::transition(RunState::Idle, RunEvent::Start),
            (
                RunState::Running { attempt: 1 },
                vec![RunEffect::Launch { attempt: 1 }]
            )
        );
    }

    #[test]
    fn running_finished_succeeds_and_reports() {
        assert_eq!(
            Run::transition(RunState::Running { attempt: 2 }, RunEvent::Finished),
            (
                RunState::Succeeded,
                vec![RunEffect::Report("succeeded".into())]
            )
        );
    }

    #[test]
    fn running_errored_below_limit_retries() {
        assert_eq!(
            Run::transition(
                RunState::Running { attempt: 1 },
                RunEvent::Errored("timeout".into())
            ),
            (
                RunState::Running { attempt: 2 },
                vec![RunEffect::Launch { attempt: 2 }]
            )
        );
    }

    #[test]
    fn running_errored_at_limit_fails_with_reason() {
        assert_eq!(
            Run::transition(
                RunState::Running {
                    attempt: MAX_ATTEMPTS
                },
                RunEvent::Errored("bucket gone".into())
            ),
            (
                RunState::Failed {
                    reason: "bucket gone".into()
                },
                vec![RunEffect::Report("bucket gone".into())]
            )
        );
    }

    #[test]
    fn stale_events_change_nothing() {
        let finished = RunState::Succeeded;
        let failed = RunState::Failed { reason: "x".into() };
        let cases = [
            (RunState::Idle, RunEvent::Finished),
            (RunState::Idle, RunEvent::Errored("x".into())),
            (RunState::Running { attempt: 1 }, RunEvent::Start),
            (finished.clone(), RunEvent::Start),
            (finished.clone(), RunEvent::Finished),
            (finished, RunEvent::Errored("x".into())),
            (failed.clone(), RunEvent::Start),
            (failed.clone(), RunEvent::Finished),
            (failed, RunEvent::Errored("y".into())),
        ];
        for (state, event) in cases {
            assert_eq!(
                Run::transition(state.clone(), event.clone()),
                (state.clone(), Vec::new()),
                "{state:?} + {event:?}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "bug in the run machine")]
    fn bug_event_panics() {
        let _ = Run::transition(RunState::Idle, RunEvent::Bug);
    }

    /// Records effects; a launch of attempt 1 errors and a later one finishes, fed back
    /// as events the way a real executor reports slow work.
    #[derive(Clone, Default)]
    struct Recorder {
        performed: Arc<Mutex<Vec<RunEffect>>>,
        /// Every launch errors.
        always_errs: bool,
        /// Incarnations started.
        starts: Arc<Mutex<u32>>,
    }

    impl Effects<Run> for Recorder {
        fn started(&mut self, _events: &Recipient<Event<Run>>) {
            *self.starts.lock().unwrap() += 1;
        }

        fn execute(&mut self, effect: RunEffect, events: &Recipient<Event<Run>>) {
            if let RunEffect::Launch { attempt } = effect {
                let outcome = if attempt == 1 || self.always_errs {
                    RunEvent::Errored("first try fails".into())
                } else {
                    RunEvent::Finished
                };
                events.do_send(Event::new(outcome));
            }
            self.performed.lock().unwrap().push(effect);
        }
    }

    fn spec(recorder: &Recorder) -> MachineSpec<RunState, Recorder> {
        MachineSpec {
            initial: RunState::Idle,
            effects: recorder.clone(),
        }
    }

    fn policy() -> RestartPolicy {
        RestartPolicy {
            min_delay: Duration::from_millis(10),
            ..RestartPolicy::default()
        }
    }

    type RunActor = MachineActor<Run, Recorder>;

    async fn wait_for_state(addr: &Addr<RunActor>, wanted: &RunState) {
        for _ in 0..2000 {
            if addr.send(GetState::default()).await.unwrap().as_ref() == Some(wanted) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("never reached {wanted:?}");
    }

    /// Waits until `key` runs again after its first restart; its status then.
    async fn restarted_once(parent: &Addr<Supervisor<RunActor>>, key: &str) -> ChildStatus {
        for _ in 0..2000 {
            let status = parent
                .send(GetChildStatus { key: key.into() })
                .await
                .unwrap()
                .unwrap();
            if status.running && status.restarts == 1 {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{key} was not restarted once");
    }

    /// The running incarnation of `key` begins afresh, from its spec.
    async fn assert_fresh(parent: &Addr<Supervisor<RunActor>>, key: &str) {
        let fresh = parent.send(GetChild::new(key)).await.unwrap().unwrap();
        assert_eq!(
            fresh.send(GetState::default()).await.unwrap(),
            Some(RunState::Idle)
        );
    }

    #[actix_rt::test]
    async fn shell_runs_transitions_and_effects_feed_back_events() {
        let (sink, _reports) = mpsc::unbounded_channel::<ChildFailing>();
        let parent = Supervisor::<RunActor>::new("runs", policy(), sink).start();
        let recorder = Recorder::default();
        let run = parent
            .send(StartChild {
                key: "nightly".into(),
                spec: spec(&recorder),
            })
            .await
            .unwrap()
            .expect("child started");

        assert!(run.send(Event::new(RunEvent::Start)).await.unwrap());
        wait_for_state(&run, &RunState::Succeeded).await;
        assert_eq!(
            *recorder.performed.lock().unwrap(),
            vec![
                RunEffect::Launch { attempt: 1 },
                RunEffect::Launch { attempt: 2 },
                RunEffect::Report("succeeded".into()),
            ]
        );
    }

    #[actix_rt::test]
    async fn a_failed_state_stops_the_actor_and_the_supervisor_restarts_it() {
        let (sink, _reports) = mpsc::unbounded_channel::<ChildFailing>();
        let parent = Supervisor::<RunActor>::new("runs", policy(), sink).start();
        let recorder = Recorder {
            always_errs: true,
            ..Recorder::default()
        };
        let run = parent
            .send(StartChild {
                key: "nightly".into(),
                spec: spec(&recorder),
            })
            .await
            .unwrap()
            .expect("child started");
        assert_eq!(*recorder.starts.lock().unwrap(), 1);
        run.do_send(Event::new(RunEvent::Start));

        let status = restarted_once(&parent, "nightly").await;
        assert_eq!(status.last_failure.as_deref(), Some("first try fails"));
        // The new incarnation was started (its executor told) and begins afresh.
        assert_eq!(*recorder.starts.lock().unwrap(), 2);
        assert_fresh(&parent, "nightly").await;
    }

    #[actix_rt::test]
    async fn shell_catches_a_panicking_transition_and_is_rebuilt_from_its_spec() {
        let (sink, _reports) = mpsc::unbounded_channel::<ChildFailing>();
        let parent = Supervisor::<RunActor>::new("runs", policy(), sink).start();
        let recorder = Recorder::default();
        let run = parent
            .send(StartChild {
                key: "nightly".into(),
                spec: spec(&recorder),
            })
            .await
            .unwrap()
            .expect("child started");

        // The handler returns (the event not taken) instead of unwinding through actix.
        assert!(!run.send(Event::new(RunEvent::Bug)).await.unwrap());

        let status = restarted_once(&parent, "nightly").await;
        assert_eq!(
            status.last_failure.as_deref(),
            Some("panicked: bug in the run machine")
        );
        assert_fresh(&parent, "nightly").await;
        assert!(
            run.send(GetState::default()).await.is_err(),
            "old one is gone"
        );
    }
}
