//! The `ClusterActor`: one per `DatabaseCluster`, supervising one `ReplicaActor` per
//! instance. Its pure machine decides; its shell acts.
//!
//! - `machine.rs` — the machine: passes over the owned objects, members, parameter
//!   reloads and rolling restarts, fencing commands; its state, events and effects are
//!   `state.rs`;
//! - `primary.rs` — the primary's lease, failover, split brains, rejoining;
//! - `failover.rs` — whom to promote and when it is safe (the pure rules);
//! - `switchover.rs` — switchover by request or drain;
//! - `actions.rs` — restart and reload declared by annotation;
//! - `quorum.rs` — the synchronous quorum under `dataDurability`;
//! - `archiving.rs` — the `ContinuousArchiving` condition and its Events;
//! - `plan.rs` — what a pass should leave behind (role labels, instances to create and
//!   remove, status, members), decided from the order and what the pass read;
//!   `volumes.rs` decides its `VolumesBound` condition;
//! - `pass.rs` — one I/O pass: applies Secrets, Services, budgets and volumes, reads
//!   pods and nodes, and carries out the plan;
//! - `shell.rs` — performs the machine's effects.

mod actions;
mod archiving;
mod failover;
#[cfg(test)]
mod fixtures;
mod machine;
mod parameters;
pub mod pass;
pub mod plan;
mod primary;
mod quorum;
mod restoring;
pub mod shell;
mod state;
mod switchover;
pub mod upgrade;
mod volumes;

pub use actions::{
    RELOAD_ANNOTATION, RELOADED_ANNOTATION, RESTART_ANNOTATION, RESTARTED_ANNOTATION,
};
pub use failover::LEASE_DURATION;
pub use machine::ClusterMachine;
pub use state::*;
pub use switchover::SWITCHOVER_ANNOTATION;
