//! The `ReplicaActor`'s machine: one per database instance, child of its cluster's
//! actor. It watches its instance through the instance manager's `/status` every
//! [`POLL_INTERVAL`] and reports each view to the cluster, and it runs the cluster's
//! commands to that instance (reload, restart) one at a time, reporting their outcome.
//!
//! Pure: the shell (`shell.rs`) performs the effects and feeds their outcomes back.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime};

use castellan_actors::StateMachine;
use serde_json::Value;

use crate::instance_api::{
    Access, ArchiveConfig, ArchiveReport, LeaseGrant, Lsn, PromoteRequest, RestoreRequest,
    RunningRole, StatusReport,
};

/// How often an instance's status is read. It is also how often the primary's lease
/// is renewed (`failover::LEASE_DURATION` is a few of these).
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// An instance as its instance manager last described it.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceView {
    pub name: String,
    /// When it was read (the operator's clock).
    pub at: SystemTime,
    /// The instance API answered.
    pub reachable: bool,
    /// Accepting connections in its role.
    pub ready: bool,
    /// The server runs (and answered).
    pub running: bool,
    /// The role its data is in, as its manager reports it: the truth about the
    /// instance, whatever its pod's labels say.
    pub role: Option<RunningRole>,
    pub fenced: bool,
    /// It holds the primary lease.
    pub leased: bool,
    /// Why it cannot start, when it cannot (an empty volume where data should be).
    pub problem: Option<String>,
    /// Write position on a primary, replay position on a replica.
    pub lsn: Option<Lsn>,
    /// Last position a replica received.
    pub receive_lsn: Option<Lsn>,
    pub timeline: Option<i64>,
    pub lag_seconds: Option<f64>,
    /// A primary's standbys, from `pg_stat_replication`.
    pub standbys: Vec<StandbyView>,
    /// A primary's replication slots.
    pub slots: Vec<crate::instance_api::Slot>,
    /// `synchronous_standby_names` in force.
    pub sync_names: String,
    /// The server parameters its configuration was written with.
    pub parameters: Option<BTreeMap<String, String>>,
    /// Parameters whose new value waits for a restart.
    pub pending_restart: Vec<String>,
    /// The last set of parameters it refused (PostgreSQL would not take them), and why.
    pub refused_parameters: Option<crate::instance_api::RefusedParameters>,
    /// Why it could not be read, when it could not.
    pub error: Option<String>,
    /// What its WAL archiving has done.
    pub archive: ArchiveReport,
    /// What a restore into its empty volume is doing, once asked for.
    pub restoring: Option<String>,
    /// Who may connect to it how (absent: its manager does not say).
    pub access: Option<Access>,
    /// The PostgreSQL release its binaries carry, such as `15.18`.
    pub release: Option<String>,
}

impl Default for InstanceView {
    fn default() -> Self {
        Self {
            name: String::new(),
            at: SystemTime::UNIX_EPOCH,
            reachable: false,
            ready: false,
            running: false,
            role: None,
            fenced: false,
            leased: false,
            problem: None,
            lsn: None,
            receive_lsn: None,
            timeline: None,
            lag_seconds: None,
            standbys: Vec::new(),
            slots: Vec::new(),
            sync_names: String::new(),
            parameters: None,
            pending_restart: Vec::new(),
            refused_parameters: None,
            error: None,
            archive: ArchiveReport::default(),
            restoring: None,
            access: None,
            release: None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StandbyView {
    pub name: String,
    pub streaming: bool,
    pub lag_bytes: Option<i64>,
}

impl InstanceView {
    /// Whether `other` differs from this view only in what moves with every write
    /// (positions, lag, WAL kept for slots) and in when it was read. Such a change is
    /// written to status at most every `PROGRESS_REFRESH`; any other is written at once.
    pub fn moved_only(&self, other: &InstanceView) -> bool {
        fn still(view: &InstanceView) -> InstanceView {
            InstanceView {
                at: SystemTime::UNIX_EPOCH,
                lsn: view.lsn.map(|_| Lsn(0)),
                receive_lsn: view.receive_lsn.map(|_| Lsn(0)),
                lag_seconds: view.lag_seconds.map(|_| 0.0),
                standbys: view
                    .standbys
                    .iter()
                    .map(|s| StandbyView {
                        lag_bytes: s.lag_bytes.map(|_| 0),
                        ..s.clone()
                    })
                    .collect(),
                slots: view
                    .slots
                    .iter()
                    .map(|s| crate::instance_api::Slot {
                        retained_bytes: s.retained_bytes.map(|_| 0),
                        ..s.clone()
                    })
                    .collect(),
                ..view.clone()
            }
        }
        still(self) == still(other)
    }

    /// The view of `name` from its `/status` report, read at `at`.
    pub fn from_report(name: &str, at: SystemTime, report: StatusReport) -> Self {
        let server = report.server.unwrap_or_default();
        let answered = report.error.is_none();
        Self {
            name: name.to_owned(),
            at,
            reachable: true,
            ready: report.ready,
            running: answered,
            role: report.role,
            fenced: report.fenced,
            leased: report.lease_remaining_ms.is_some(),
            problem: report.problem,
            lsn: server.lsn.as_deref().and_then(Lsn::parse),
            receive_lsn: server.receive_lsn.as_deref().and_then(Lsn::parse),
            timeline: server.timeline,
            lag_seconds: server.lag_seconds,
            standbys: server
                .standbys
                .into_iter()
                .map(|standby| StandbyView {
                    streaming: standby.state == "streaming",
                    lag_bytes: standby.lag_bytes,
                    name: standby.name,
                })
                .collect(),
            slots: server.slots,
            sync_names: server.synchronous_standby_names,
            parameters: Some(report.parameters),
            pending_restart: server.pending_restart,
            refused_parameters: report.refused_parameters,
            error: report.error,
            archive: report.archive,
            restoring: report.restoring,
            access: report.access,
            release: report.release,
        }
    }

    /// The view of an instance whose API did not answer at `at`.
    pub fn unreachable(name: &str, at: SystemTime, error: String) -> Self {
        Self {
            name: name.to_owned(),
            at,
            error: Some(error),
            ..Self::default()
        }
    }

    /// A running primary with its lease: the instance writes can go to.
    pub fn serving_as_primary(&self) -> bool {
        self.reachable && self.ready && self.role == Some(RunningRole::Primary)
    }
}

/// A change the cluster asks of one instance.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Rewrite the configuration and reload: parameters, and on a primary the
    /// synchronous standby names and the slots to keep.
    Reload {
        parameters: BTreeMap<String, String>,
        sync_names: Option<String>,
        slots: Option<Vec<String>>,
        /// The WAL archive setting, when the instance does not have it yet (boxed: it
        /// is large and rare).
        archive: Option<Box<ArchiveConfig>>,
        /// Who may connect how (`spec.tls.allowPlaintext`,
        /// `spec.enableSuperuserAccess`, `spec.pgHba`).
        access: Access,
    },
    /// Restart PostgreSQL (for parameters that need it).
    Restart,
    /// Become primary.
    Promote(PromoteRequest),
    /// Stop as primary and follow the current one (pg_rewind), or fill an empty volume
    /// from it.
    Demote,
    /// Stop the server and keep it stopped (true), or let it run again.
    Fence(bool),
    /// Fill the empty volume from a backup (the first instance of a restored cluster).
    Restore(Box<RestoreRequest>),
}

impl Command {
    pub fn name(&self) -> &'static str {
        match self {
            Command::Reload { .. } => "reload",
            Command::Restart => "restart",
            Command::Promote(_) => "promote",
            Command::Demote => "demote",
            Command::Fence(true) => "fence",
            Command::Fence(false) => "unfence",
            Command::Restore(_) => "restore",
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
    /// The poll timer fired at this time.
    Poll(SystemTime),
    /// A status read finished at `at`; `next_poll` when it was the polling loop's.
    Polled {
        outcome: Result<Box<StatusReport>, String>,
        at: SystemTime,
        next_poll: bool,
    },
    /// From the cluster: renew this instance's primary lease.
    Grant(LeaseGrant),
    /// From the cluster: run a command (queued behind a running one).
    Run(Command),
    /// A command finished, its answer received `at`.
    Ran {
        outcome: Result<Value, String>,
        at: SystemTime,
    },
}

#[derive(Debug, PartialEq)]
pub enum ReplicaEffect {
    /// Read `/status` at the address; `next_poll` when it is the polling loop's read
    /// (its outcome schedules the next one), not an extra read.
    Fetch { address: String, next_poll: bool },
    /// Send the command to the instance API at the address.
    Call(String, Command),
    /// Tell the cluster what the instance looks like now.
    Report(Box<InstanceView>),
    /// Tell the cluster how a command ended, and when.
    Finished {
        command: Command,
        outcome: Result<Value, String>,
        at: SystemTime,
    },
    /// Deliver `Poll` after the delay.
    PollAfter(Duration),
    /// Send a lease grant to the instance API at the address (its outcome only logged:
    /// the cluster counts a grant as given whether or not it arrives).
    Lease(String, LeaseGrant),
}

impl StateMachine for ReplicaMachine {
    type State = ReplicaState;
    type Event = ReplicaEvent;
    type Effect = ReplicaEffect;

    fn label(event: &ReplicaEvent) -> String {
        match event {
            ReplicaEvent::Track(address) => format!("Track({address:?})"),
            ReplicaEvent::Poll(_) => "Poll".into(),
            ReplicaEvent::Polled { outcome: Ok(_), .. } => "Polled".into(),
            ReplicaEvent::Polled {
                outcome: Err(error),
                ..
            } => format!("PollFailed({error})"),
            ReplicaEvent::Run(command) => format!("Run({})", command.name()),
            ReplicaEvent::Grant(_) => "Grant".into(),
            ReplicaEvent::Ran { outcome, .. } => format!("Ran(ok: {})", outcome.is_ok()),
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
            ReplicaEvent::Poll(at) => {
                if state.address.is_none() {
                    // No address (a pod being made, or gone): that is news too. A view
                    // left from before would hide that the instance is not there.
                    effects.push(ReplicaEffect::Report(Box::new(InstanceView::unreachable(
                        &state.name,
                        at,
                        "its pod has no address".to_owned(),
                    ))));
                }
                effects.push(fetch_or_wait(&state));
            }
            ReplicaEvent::Polled {
                outcome,
                at,
                next_poll,
            } => {
                let view = match outcome {
                    Ok(report) => InstanceView::from_report(&state.name, at, *report),
                    Err(error) => InstanceView::unreachable(&state.name, at, error),
                };
                effects.push(ReplicaEffect::Report(Box::new(view)));
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
            ReplicaEvent::Grant(grant) => {
                if let Some(address) = state.address.clone() {
                    effects.push(ReplicaEffect::Lease(address, grant));
                }
            }
            ReplicaEvent::Ran { outcome, at } => {
                if let Some(command) = state.running.take() {
                    effects.push(ReplicaEffect::Finished {
                        command,
                        outcome,
                        at,
                    });
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
    use crate::instance_api::{ServerStatus, Standby};

    fn at() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(100)
    }

    fn step(state: ReplicaState, event: ReplicaEvent) -> (ReplicaState, Vec<ReplicaEffect>) {
        ReplicaMachine::transition(state, event)
    }

    fn ran(outcome: Result<Value, String>) -> ReplicaEvent {
        ReplicaEvent::Ran {
            outcome,
            at: SystemTime::UNIX_EPOCH,
        }
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
            slots: None,
            archive: None,
            access: Access::default(),
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
        let (_, effects) = step(tracked(), ReplicaEvent::Poll(at()));
        assert_eq!(effects, vec![fetch("127.0.0.9:8000", true)]);
    }

    #[test]
    fn an_extra_read_reports_without_scheduling_a_poll() {
        let polled = ReplicaEvent::Polled {
            outcome: Err("refused".into()),
            at: at(),
            next_poll: false,
        };
        let (_, effects) = step(tracked(), polled);
        assert_eq!(
            effects,
            vec![ReplicaEffect::Report(Box::new(InstanceView::unreachable(
                "db-2",
                at(),
                "refused".into()
            )))]
        );
    }

    #[test]
    fn a_read_status_is_reported_and_the_next_poll_scheduled() {
        let standby = |name: &str, state: &str, lag: i64| Standby {
            name: name.into(),
            state: state.into(),
            lag_bytes: Some(lag),
            ..Standby::default()
        };
        let report = StatusReport {
            instance: "db-2".into(),
            role: Some(RunningRole::Primary),
            ready: true,
            lease_remaining_ms: Some(3000),
            parameters: BTreeMap::from([("work_mem".into(), "8MB".into())]),
            server: Some(ServerStatus {
                lsn: Some("0/3000060".into()),
                lag_seconds: Some(0.0),
                standbys: vec![
                    standby("db-1", "streaming", 0),
                    standby("db-3", "catchup", 4096),
                ],
                synchronous_standby_names: "ANY 1 (\"db-1\")".into(),
                pending_restart: vec!["max_connections".into()],
                ..ServerStatus::default()
            }),
            ..StatusReport::default()
        };
        let polled = ReplicaEvent::Polled {
            outcome: Ok(Box::new(report)),
            at: at(),
            next_poll: true,
        };
        let (_, effects) = step(tracked(), polled);
        let ReplicaEffect::Report(view) = &effects[0] else {
            panic!("expected a report first: {effects:?}")
        };
        assert!(view.reachable && view.ready && view.running && view.leased);
        assert!(view.serving_as_primary());
        assert_eq!(view.at, at());
        assert_eq!(view.lsn, Lsn::parse("0/3000060"));
        assert_eq!(view.role, Some(RunningRole::Primary));
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
            at: at(),
            next_poll: true,
        };
        let (_, effects) = step(tracked(), polled);
        assert_eq!(
            effects[0],
            ReplicaEffect::Report(Box::new(InstanceView::unreachable(
                "db-2",
                at(),
                "refused".into()
            )))
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
        let (state, effects) = step(state, ran(Ok(json!({"reloaded": true}))));
        assert_eq!(
            effects,
            vec![
                ReplicaEffect::Finished {
                    command: reload(),
                    outcome: Ok(json!({"reloaded": true})),
                    at: SystemTime::UNIX_EPOCH,
                },
                ReplicaEffect::Call("127.0.0.9:8000".into(), Command::Restart),
            ]
        );
        assert_eq!(state.running, Some(Command::Restart));
    }

    #[test]
    fn a_failed_command_is_reported_with_its_reason() {
        let (state, _) = step(tracked(), ReplicaEvent::Run(Command::Restart));
        let (state, effects) = step(state, ran(Err("timed out".into())));
        assert_eq!(
            effects,
            vec![ReplicaEffect::Finished {
                command: Command::Restart,
                outcome: Err("timed out".into()),
                at: SystemTime::UNIX_EPOCH,
            }]
        );
        assert_eq!(state.running, None);
    }

    #[test]
    fn a_late_outcome_without_a_running_command_changes_nothing() {
        let (state, effects) = step(tracked(), ran(Ok(Value::Null)));
        assert!(effects.is_empty());
        assert_eq!(state, tracked());
    }

    #[test]
    fn a_grant_goes_to_the_instance_at_once_even_behind_a_command() {
        let grant = LeaseGrant {
            valid_until_ms: 5000,
            duration_ms: 4000,
        };
        let (state, _) = step(tracked(), ReplicaEvent::Run(Command::Restart));
        let (state, effects) = step(state, ReplicaEvent::Grant(grant));
        assert_eq!(
            effects,
            vec![ReplicaEffect::Lease("127.0.0.9:8000".into(), grant)]
        );
        assert_eq!(state.running, Some(Command::Restart));
        // Without an address there is nowhere to send it.
        let (_, effects) = step(ReplicaState::new("db-2"), ReplicaEvent::Grant(grant));
        assert!(effects.is_empty());
    }

    #[test]
    fn a_report_without_a_running_server_is_a_stopped_instance() {
        let report = StatusReport {
            instance: "db-1".into(),
            role: Some(RunningRole::Primary),
            problem: Some("the volume is empty".into()),
            error: Some("postgres is not running".into()),
            ..StatusReport::default()
        };
        let view = InstanceView::from_report("db-1", at(), report);
        assert!(view.reachable && !view.running && !view.ready && !view.leased);
        assert!(!view.serving_as_primary());
        assert_eq!(view.problem.as_deref(), Some("the volume is empty"));
    }

    #[test]
    fn a_poll_without_an_address_reports_the_instance_unreachable() {
        let (_, effects) = step(ReplicaState::new("db-2"), ReplicaEvent::Poll(at()));
        assert_eq!(
            effects,
            vec![
                ReplicaEffect::Report(Box::new(InstanceView::unreachable(
                    "db-2",
                    at(),
                    "its pod has no address".into()
                ))),
                ReplicaEffect::PollAfter(POLL_INTERVAL),
            ]
        );
    }
}
