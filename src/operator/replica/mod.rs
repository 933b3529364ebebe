//! The `ReplicaActor`: one per database instance, child of its cluster's actor. It
//! reads its instance every second, reports each view, and runs the cluster's commands
//! and lease grants to that instance. `machine.rs` decides; `shell.rs` acts.

mod machine;
pub mod shell;

pub use machine::*;
