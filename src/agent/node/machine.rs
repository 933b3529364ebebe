//! The `NodeActor`'s machine: when the node looks at its disks.
//!
//! Pure. Triggers (a uevent burst, the periodic timer, a pool's change, changed error
//! counters, a volume's allocation, a timer a pool asked for) start a look; a trigger
//! during a look makes exactly one more after it. A look that fails is retried after
//! an exponential back-off (1 s doubling to 30 s) rather than at the next trigger, and
//! a good look resets it. The pools' actors report what they need next (`Next`): a
//! look now (disks were released), a retry soon, or a look at a given time.

use std::time::Duration;

use castellan_actors::StateMachine;

use crate::agent::children::Next;

/// How soon a pool step that failed on something passing (a busy disk) is retried.
pub const RETRY_DELAY: Duration = Duration::from_secs(3);
/// First and longest delay before a failed look is tried again.
pub const LOOK_BACKOFF_MIN: Duration = Duration::from_secs(1);
pub const LOOK_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What prompted a look (logs and traces).
pub type Cause = &'static str;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Looking {
    Idle,
    /// A look runs; `again`: a trigger came meanwhile, look once more after it.
    Busy {
        again: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeState {
    pub looking: Looking,
    /// Looks failed in a row (the back-off's exponent).
    pub failures: u32,
}

impl NodeState {
    pub const fn new() -> Self {
        Self {
            looking: Looking::Idle,
            failures: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeEvent {
    Trigger(Cause),
    /// The look ended (its failure with why).
    Looked(Result<(), String>),
    /// A pool's pass asks for this.
    Asked(Next),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeEffect {
    /// Look at the disks, tell each disk and each pool; `Looked` comes back.
    Look(Cause),
    /// Trigger a look after this long (one timer: the soonest asked for wins).
    WakeIn(Duration),
}

pub struct NodeMachine;

impl StateMachine for NodeMachine {
    type State = NodeState;
    type Event = NodeEvent;
    type Effect = NodeEffect;

    fn transition(state: NodeState, event: NodeEvent) -> (NodeState, Vec<NodeEffect>) {
        match event {
            NodeEvent::Trigger(cause) => trigger(state, cause),
            NodeEvent::Looked(outcome) => match (state.looking, outcome) {
                // A late report of an earlier incarnation's look.
                (Looking::Idle, _) => (state, vec![]),
                (Looking::Busy { again: true }, Ok(())) => (
                    NodeState {
                        looking: Looking::Busy { again: false },
                        failures: 0,
                    },
                    vec![NodeEffect::Look("again")],
                ),
                (Looking::Busy { again: false }, Ok(())) => (NodeState::new(), vec![]),
                // Failed: the retry after the back-off also serves a trigger that came.
                (Looking::Busy { .. }, Err(_)) => {
                    let failures = state.failures.saturating_add(1);
                    (
                        NodeState {
                            looking: Looking::Idle,
                            failures,
                        },
                        vec![NodeEffect::WakeIn(backoff(failures))],
                    )
                }
            },
            NodeEvent::Asked(next) => {
                let (state, mut effects) = if next.look_again {
                    trigger(state, "released")
                } else {
                    (state, vec![])
                };
                effects.extend(next.look_in.map(NodeEffect::WakeIn));
                if next.retry_soon {
                    effects.push(NodeEffect::WakeIn(RETRY_DELAY));
                }
                (state, effects)
            }
        }
    }

    fn label(event: &NodeEvent) -> String {
        match event {
            NodeEvent::Trigger(cause) => format!("trigger: {cause}"),
            NodeEvent::Looked(Ok(())) => "looked".into(),
            NodeEvent::Looked(Err(_)) => "look failed".into(),
            NodeEvent::Asked(_) => "a pool asks".into(),
        }
    }
}

fn trigger(state: NodeState, cause: Cause) -> (NodeState, Vec<NodeEffect>) {
    match state.looking {
        Looking::Idle => (
            NodeState {
                looking: Looking::Busy { again: false },
                ..state
            },
            vec![NodeEffect::Look(cause)],
        ),
        Looking::Busy { .. } => (
            NodeState {
                looking: Looking::Busy { again: true },
                ..state
            },
            vec![],
        ),
    }
}

/// The delay before the look after `failures` failed ones.
fn backoff(failures: u32) -> Duration {
    let doubling = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
    LOOK_BACKOFF_MIN
        .saturating_mul(doubling)
        .min(LOOK_BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn busy(again: bool, failures: u32) -> NodeState {
        NodeState {
            looking: Looking::Busy { again },
            failures,
        }
    }

    #[test]
    fn idle_trigger_looks() {
        let (state, effects) =
            NodeMachine::transition(NodeState::new(), NodeEvent::Trigger("uevent"));
        assert_eq!(state, busy(false, 0));
        assert_eq!(effects, vec![NodeEffect::Look("uevent")]);
    }

    #[test]
    fn busy_trigger_makes_one_more_look_after_this_one() {
        let (state, effects) =
            NodeMachine::transition(busy(false, 0), NodeEvent::Trigger("uevent"));
        assert_eq!((state, effects.len()), (busy(true, 0), 0));
        let (state, effects) = NodeMachine::transition(state, NodeEvent::Trigger("periodic"));
        assert_eq!((state, effects.len()), (busy(true, 0), 0));
    }

    #[test]
    fn busy_looked_goes_idle_or_looks_again() {
        let (state, effects) = NodeMachine::transition(busy(false, 2), NodeEvent::Looked(Ok(())));
        assert_eq!((state, effects.len()), (NodeState::new(), 0));
        let (state, effects) = NodeMachine::transition(busy(true, 2), NodeEvent::Looked(Ok(())));
        assert_eq!(state, busy(false, 0));
        assert_eq!(effects, vec![NodeEffect::Look("again")]);
    }

    #[test]
    fn busy_look_failed_retries_after_a_growing_back_off() {
        let mut state = busy(true, 0);
        let mut delays = Vec::new();
        for _ in 0..7 {
            let (next, effects) = NodeMachine::transition(
                state,
                NodeEvent::Looked(Err("the API server is down".into())),
            );
            assert_eq!(next.looking, Looking::Idle);
            let [NodeEffect::WakeIn(delay)] = effects.as_slice() else {
                panic!("expected one wake-up, got {effects:?}");
            };
            delays.push(delay.as_secs());
            state = busy(false, next.failures);
        }
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn idle_looked_is_a_stale_report_and_ignored() {
        let (state, effects) = NodeMachine::transition(NodeState::new(), NodeEvent::Looked(Ok(())));
        assert_eq!((state, effects.len()), (NodeState::new(), 0));
    }

    #[test]
    fn asked_to_look_again_looks_or_queues_one() {
        let released = Next {
            look_again: true,
            ..Next::default()
        };
        let (state, effects) =
            NodeMachine::transition(NodeState::new(), NodeEvent::Asked(released));
        assert_eq!(state, busy(false, 0));
        assert_eq!(effects, vec![NodeEffect::Look("released")]);
        let (state, effects) = NodeMachine::transition(busy(false, 0), NodeEvent::Asked(released));
        assert_eq!((state, effects.len()), (busy(true, 0), 0));
    }

    #[test]
    fn asked_for_later_sets_timers_without_looking_now() {
        let later = Next {
            look_in: Some(Duration::from_secs(9)),
            retry_soon: true,
            ..Next::default()
        };
        let (state, effects) = NodeMachine::transition(NodeState::new(), NodeEvent::Asked(later));
        assert_eq!(state, NodeState::new());
        assert_eq!(
            effects,
            vec![
                NodeEffect::WakeIn(Duration::from_secs(9)),
                NodeEffect::WakeIn(RETRY_DELAY)
            ]
        );
        let (_, effects) =
            NodeMachine::transition(NodeState::new(), NodeEvent::Asked(Next::default()));
        assert!(effects.is_empty());
    }
}
