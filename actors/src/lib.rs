//! Castellan's actor tree: the supervised actors (one per pool, cluster, replica,
//! backup, schedule) and the pure `(state, event) -> (state, effects)` state machines
//! they run. See `docs/architecture.md`.
//!
//! Nothing lives here yet: the first state machines arrive with the DatabaseCluster
//! controller. This crate exists now so that the workspace already has the shape the
//! architecture describes and later work does not have to move code between crates.
#![forbid(unsafe_code)]
