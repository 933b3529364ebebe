//! Castellan's actor tree: the generic machinery the operator's and agent's actors
//! stand on. [`supervisor`] is the tree (parents own named children and restart the
//! ones that fail or panic, with back-off, reporting the ones that keep failing),
//! [`state_machine`] is the shape of every actor (a pure
//! `(state, event) -> (state, effects)` machine plus an effect executor), and
//! [`system`] runs the actix system on its own thread so tokio/kube-rs code can talk
//! to it. See `docs/actors.md`.
#![forbid(unsafe_code)]

pub mod state_machine;
pub mod supervisor;
pub mod system;

pub use state_machine::{Effects, Event, GetState, MachineActor, MachineSpec, StateMachine};
pub use supervisor::{
    Child, ChildExit, ChildFailing, ChildKey, ChildLink, ChildStatus, ChildStopped, FailureSink,
    GetChild, GetChildStatus, RestartNow, RestartPolicy, RetainChildren, Shutdown, StartChild,
    StopChild, Supervisor, catch_panic,
};
pub use system::{ActorSystem, SystemError};
