//! The `ReplicaActor`'s machine: one per database instance, child of its cluster's
//! actor. It watches its instance through the instance manager's `/status` every
//! [`POLL_INTERVAL`] and reports each view to the cluster, and it runs the cluster's
//! commands to that instance (reload, restart) one at a time, reporting their outcome.
//!
//! Pure: the shell (`shell.rs`) performs the effects and feeds their outcomes back.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use castellan_actors::StateMachine;
use serde_json::Value;

/// How often an instance's status is read.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

/// An instance as its instance manager last described it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InstanceView {
    pub name: String,
    /// The instance API answered.
    pub reachable: bool,
    /// Accepting connections in its role.
    pub ready: bool,
    /// `primary` or `replica`, as the instance manager runs it.
    pub role: Option<String>,
    pub lsn: Option<String>,
    pub lag_seconds: Option<f64>,
    /// A primary's standbys, from `pg_stat_replication`.
    pub standbys: Vec<StandbyView>,
    /// `synchronous_standby_names` in force.
    pub sync_names: String,
    /// The server parameters its configuration was written with.
    pub parameters: Option<BTreeMap<String, String>>,
    /// Parameters whose new value waits for a restart.
    pub pending_restart: Vec<String>,
    /// Why it could not be read, when it could not.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StandbyView {
    pub name: String,
    pub streaming: bool,
    pub lag_bytes: Option<i64>,
}

impl InstanceView {
    /// The view of `name` from its `/status` answer.
    pub fn from_status(name: &str, status: &Value) -> Self {
        let strings = |value: &Value| -> Vec<String> {
            value
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        };
        Self {
            name: name.to_owned(),
            reachable: true,
            ready: status["ready"].as_bool().unwrap_or(false),
            role: status["role"].as_str().map(str::to_owned),
            lsn: status["lsn"].as_str().map(str::to_owned),
            lag_seconds: status["lagSeconds"].as_f64(),
            standbys: status["standbys"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|standby| {
                    Some(StandbyView {
                        name: standby["name"].as_str()?.to_owned(),
                        streaming: standby["state"] == "streaming",
                        lag_bytes: standby["lagBytes"].as_i64(),
                    })
                })
                .collect(),
            sync_names: status["synchronousStandbyNames"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            parameters: serde_json::from_value(status["parameters"].clone()).ok(),
            pending_restart: strings(&status["pendingRestart"]),
            error: status["error"].as_str().map(str::to_owned),
        }
    }

    /// The view of an instance whose API did not answer.
    pub fn unreachable(name: &str, error: String) -> Self {
        Self {
            name: name.to_owned(),
            error: Some(error),
            ..Self::default()
        }
    }
}

/// A change the cluster asks of one instance.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Rewrite the configuration and reload: parameters, and on a primary the
    /// synchronous standby names.
    Reload {
        parameters: BTreeMap<String, String>,
        sync_names: Option<String>,
    },
    /// Restart PostgreSQL (for parameters that need it).
    Restart,
}

impl Command {
    pub fn name(&self) -> &'static str {
        match self {
            Command::Reload { .. } => "reload",
            Command::Restart => "restart",
        }
    }
}

pub struct ReplicaMachine;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplicaState {
    pub name: String,
    /// `ip:port` of its instance API, once the pod has an address.
    pub address: Option<String>,
    /// Polling started (it runs for the actor's life once started).
    pub polling: bool,
    /// The command being run, and those waiting behind it.
    pub running: Option<Command>,
    pub queued: VecDeque<Command>,
}

impl ReplicaState {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }
}

#[derive(Debug)]
pub enum ReplicaEvent {
    /// From the cluster: the pod's current instance API address.
    Track(Option<String>),
    /// The poll timer fired.
    Poll,
    /// A status read finished; `next_poll` when it was the polling loop's.
    Polled {
        outcome: Result<Value, String>,
        next_poll: bool,
    },
    /// From the cluster: run a command (queued behind a running one).
    Run(Command),
    /// A command finished.
    Ran(Result<Value, String>),
}

#[derive(Debug, PartialEq)]
pub enum ReplicaEffect {
    /// Read `/status` at the address; `next_poll` when it is the polling loop's read
    /// (its outcome schedules the next one), not an extra read.
    Fetch { address: String, next_poll: bool },
    /// Send the command to the instance API at the address.
    Call(String, Command),
    /// Tell the cluster what the instance looks like now.
    Report(InstanceView),
    /// Tell the cluster how a command ended.
    Finished {
        command: Command,
        outcome: Result<Value, String>,
    },
    /// Deliver `Poll` after the delay.
    PollAfter(Duration),
}

impl StateMachine for ReplicaMachine {
    type State = ReplicaState;
    type Event = ReplicaEvent;
    type Effect = ReplicaEffect;

    fn label(event: &ReplicaEvent) -> String {
        match event {
            ReplicaEvent::Track(address) => format!("Track({address:?})"),
            ReplicaEvent::Poll => "Poll".into(),
            ReplicaEvent::Polled { outcome: Ok(_), .. } => "Polled".into(),
            ReplicaEvent::Polled {
                outcome: Err(error),
                ..
            } => format!("PollFailed({error})"),
            ReplicaEvent::Run(command) => format!("Run({})", command.name()),
            ReplicaEvent::Ran(outcome) => format!("Ran(ok: {})", outcome.is_ok()),
        }
    }

    fn transition(
        mut state: ReplicaState,
        event: ReplicaEvent,
    ) -> (ReplicaState, Vec<ReplicaEffect>) {
        let mut effects = Vec::new();
        match event {
            ReplicaEvent::Track(address) => {
                let moved = address.is_some() && address != state.address;
                state.address = address;
                if !state.polling {
                    state.polling = true;
                    effects.push(fetch_or_wait(&state));
                } else if let Some(address) = state.address.clone().filter(|_| moved) {
                    // A new address: look now rather than at the next poll.
                    effects.push(ReplicaEffect::Fetch {
                        address,
                        next_poll: false,
                    });
                }
                // A command may have waited for the address.
                start_next(&mut state, &mut effects);
            }
            ReplicaEvent::Poll => effects.push(fetch_or_wait(&state)),
            ReplicaEvent::Polled { outcome, next_poll } => {
                let view = match outcome {
                    Ok(status) => InstanceView::from_status(&state.name, &status),
                    Err(error) => InstanceView::unreachable(&state.name, error),
                };
                effects.push(ReplicaEffect::Report(view));
                if next_poll {
                    effects.push(ReplicaEffect::PollAfter(POLL_INTERVAL));
                }
            }
            ReplicaEvent::Run(command) => {
                if state.running.as_ref() != Some(&command) && !state.queued.contains(&command) {
                    state.queued.push_back(command);
                }
                start_next(&mut state, &mut effects);
            }
            ReplicaEvent::Ran(outcome) => {
                if let Some(command) = state.running.take() {
                    effects.push(ReplicaEffect::Finished { command, outcome });
                }
                start_next(&mut state, &mut effects);
            }
        }
        (state, effects)
    }
}

fn fetch_or_wait(state: &ReplicaState) -> ReplicaEffect {
    match &state.address {
        Some(address) => ReplicaEffect::Fetch {
            address: address.clone(),
            next_poll: true,
        },
        None => ReplicaEffect::PollAfter(POLL_INTERVAL),
    }
}

/// Starts the next queued command when none runs and the instance has an address.
fn start_next(state: &mut ReplicaState, effects: &mut Vec<ReplicaEffect>) {
    if state.running.is_some() {
        return;
    }
    let Some(address) = state.address.clone() else {
        return;
    };
    if let Some(command) = state.queued.pop_front() {
        effects.push(ReplicaEffect::Call(address, command.clone()));
        state.running = Some(command);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn step(state: ReplicaState, event: ReplicaEvent) -> (ReplicaState, Vec<ReplicaEffect>) {
        ReplicaMachine::transition(state, event)
    }

    fn tracked() -> ReplicaState {
        ReplicaState {
            address: Some("127.0.0.9:8000".into()),
            polling: true,
            ..ReplicaState::new("db-2")
        }
    }

    fn reload() -> Command {
        Command::Reload {
            parameters: BTreeMap::from([("work_mem".into(), "8MB".into())]),
            sync_names: None,
        }
    }

    #[test]
    fn first_track_with_an_address_starts_polling() {
        let (state, effects) = step(
            ReplicaState::new("db-2"),
            ReplicaEvent::Track(Some("a:8000".into())),
        );
        assert!(state.polling);
        assert_eq!(effects, vec![fetch("a:8000", true)]);
    }

    #[test]
    fn first_track_without_an_address_waits_and_polls_later() {
        let (state, effects) = step(ReplicaState::new("db-2"), ReplicaEvent::Track(None));
        assert!(state.polling);
        assert_eq!(effects, vec![ReplicaEffect::PollAfter(POLL_INTERVAL)]);
    }

    fn fetch(address: &str, next_poll: bool) -> ReplicaEffect {
        ReplicaEffect::Fetch {
            address: address.into(),
            next_poll,
        }
    }

    #[test]
    fn a_later_track_with_a_new_address_reads_once_without_a_second_loop() {
        let (state, effects) = step(tracked(), ReplicaEvent::Track(Some("b:8000".into())));
        assert_eq!(state.address.as_deref(), Some("b:8000"));
        assert_eq!(effects, vec![fetch("b:8000", false)]);
    }

    #[test]
    fn a_later_track_with_the_same_address_does_nothing() {
        let (state, effects) = step(
            tracked(),
            ReplicaEvent::Track(Some("127.0.0.9:8000".into())),
        );
        assert_eq!(state, tracked());
        assert!(effects.is_empty(), "one polling loop only: {effects:?}");
    }

    #[test]
    fn poll_fetches_from_the_current_address() {
        let (_, effects) = step(tracked(), ReplicaEvent::Poll);
        assert_eq!(effects, vec![fetch("127.0.0.9:8000", true)]);
    }

    #[test]
    fn an_extra_read_reports_without_scheduling_a_poll() {
        let polled = ReplicaEvent::Polled {
            outcome: Err("refused".into()),
            next_poll: false,
        };
        let (_, effects) = step(tracked(), polled);
        assert_eq!(
            effects,
            vec![ReplicaEffect::Report(InstanceView::unreachable(
                "db-2",
                "refused".into()
            ))]
        );
    }

    #[test]
    fn a_read_status_is_reported_and_the_next_poll_scheduled() {
        let status = json!({
            "ready": true, "role": "primary", "lsn": "0/3000060", "lagSeconds": 0.0,
            "standbys": [{"name": "db-1", "state": "streaming", "lagBytes": 0},
                         {"name": "db-3", "state": "catchup", "lagBytes": 4096}],
            "synchronousStandbyNames": "ANY 1 (\"db-1\")",
            "parameters": {"work_mem": "8MB"},
            "pendingRestart": ["max_connections"],
        });
        let polled = ReplicaEvent::Polled {
            outcome: Ok(status),
            next_poll: true,
        };
        let (_, effects) = step(tracked(), polled);
        let ReplicaEffect::Report(view) = &effects[0] else {
            panic!("expected a report first: {effects:?}")
        };
        assert!(view.reachable && view.ready);
        assert_eq!(view.role.as_deref(), Some("primary"));
        assert_eq!(view.standbys.len(), 2);
        assert!(view.standbys[0].streaming && !view.standbys[1].streaming);
        assert_eq!(view.standbys[1].lag_bytes, Some(4096));
        assert_eq!(view.sync_names, "ANY 1 (\"db-1\")");
        assert_eq!(view.parameters.as_ref().map(BTreeMap::len), Some(1));
        assert_eq!(view.pending_restart, vec!["max_connections".to_owned()]);
        assert_eq!(effects[1], ReplicaEffect::PollAfter(POLL_INTERVAL));
    }

    #[test]
    fn a_failed_read_is_reported_as_unreachable() {
        let polled = ReplicaEvent::Polled {
            outcome: Err("refused".into()),
            next_poll: true,
        };
        let (_, effects) = step(tracked(), polled);
        assert_eq!(
            effects[0],
            ReplicaEffect::Report(InstanceView::unreachable("db-2", "refused".into()))
        );
        assert_eq!(effects[1], ReplicaEffect::PollAfter(POLL_INTERVAL));
    }

    #[test]
    fn a_command_runs_at_once_when_idle() {
        let (state, effects) = step(tracked(), ReplicaEvent::Run(Command::Restart));
        assert_eq!(state.running, Some(Command::Restart));
        assert_eq!(
            effects,
            vec![ReplicaEffect::Call(
                "127.0.0.9:8000".into(),
                Command::Restart
            )]
        );
    }

    #[test]
    fn a_command_waits_for_the_address() {
        let (state, effects) = step(
            ReplicaState::new("db-2"),
            ReplicaEvent::Run(Command::Restart),
        );
        assert!(effects.is_empty());
        let (state, effects) = step(state, ReplicaEvent::Track(Some("a:8000".into())));
        assert_eq!(state.running, Some(Command::Restart));
        assert!(effects.contains(&ReplicaEffect::Call("a:8000".into(), Command::Restart)));
    }

    #[test]
    fn commands_queue_behind_the_running_one_without_duplicates() {
        let (state, _) = step(tracked(), ReplicaEvent::Run(reload()));
        let (state, effects) = step(state, ReplicaEvent::Run(Command::Restart));
        assert!(effects.is_empty());
        let (state, effects) = step(state, ReplicaEvent::Run(Command::Restart));
        assert!(effects.is_empty());
        let (state, _) = step(state, ReplicaEvent::Run(reload()));
        assert_eq!(state.queued, VecDeque::from([Command::Restart]));
        let (state, effects) = step(state, ReplicaEvent::Ran(Ok(json!({"reloaded": true}))));
        assert_eq!(
            effects,
            vec![
                ReplicaEffect::Finished {
                    command: reload(),
                    outcome: Ok(json!({"reloaded": true}))
                },
                ReplicaEffect::Call("127.0.0.9:8000".into(), Command::Restart),
            ]
        );
        assert_eq!(state.running, Some(Command::Restart));
    }

    #[test]
    fn a_failed_command_is_reported_with_its_reason() {
        let (state, _) = step(tracked(), ReplicaEvent::Run(Command::Restart));
        let (state, effects) = step(state, ReplicaEvent::Ran(Err("timed out".into())));
        assert_eq!(
            effects,
            vec![ReplicaEffect::Finished {
                command: Command::Restart,
                outcome: Err("timed out".into())
            }]
        );
        assert_eq!(state.running, None);
    }

    #[test]
    fn a_late_outcome_without_a_running_command_changes_nothing() {
        let (state, effects) = step(tracked(), ReplicaEvent::Ran(Ok(Value::Null)));
        assert!(effects.is_empty());
        assert_eq!(state, tracked());
    }
}
