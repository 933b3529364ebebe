//! The `ClusterActor`: one per `DatabaseCluster`, supervising one `ReplicaActor` per
//! instance. Its pure machine decides; its shell acts.
//!
//! - `machine.rs` — the machine: passes over the owned objects, members, parameter
//!   reloads and rolling restarts, fencing commands; its state, events and effects are
//!   `state.rs`;
//! - `primary.rs` — the primary's lease, failover, split brains, rejoining;
//! - `failover.rs` — whom to promote and when it is safe (the pure rules);
//! - `switchover.rs` — switchover by request or drain;
//! - `quorum.rs` — the synchronous quorum under `dataDurability`;
//! - `pass.rs` — one I/O pass over Secrets, Services, budgets, volumes, pods and status;
//!   `volumes.rs` decides its `VolumesBound` condition;
//! - `shell.rs` — performs the machine's effects.

mod failover;
#[cfg(test)]
mod fixtures;
mod machine;
pub mod pass;
mod primary;
mod quorum;
pub mod shell;
mod state;
mod switchover;
mod volumes;

pub use machine::ClusterMachine;
pub use state::*;
