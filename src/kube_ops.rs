//! The Kubernetes names that several controllers share, operator and node agent alike:
//! the labels and finalizers one of them sets and another reads, and the field manager
//! of a node's entry in a pool's status.
//!
//! One copy, so that two writers of the same object cannot drift apart on a name. It
//! decides nothing: which fields to write, and when, stays with each caller.

/// Label every object of a DatabaseCluster carries (its pods, Services, claims, and the
/// Backups its schedules make): the cluster's name.
pub const CLUSTER_LABEL: &str = "castellan.io/cluster";
/// Label of a database pod and its volume: the instance's name.
pub const INSTANCE_LABEL: &str = "castellan.io/instance";
/// Label naming the node a `BlockDevice` or a pool's PersistentVolume is on, to list
/// one node's objects.
pub const NODE_LABEL: &str = "castellan.io/node";
/// Label naming the pool a PersistentVolume was carved from.
pub const POOL_LABEL: &str = "castellan.io/pool";

/// Keeps a StoragePool until every node's part of it is released: by that node's agent
/// (`agent::pool::deletion`), or by the operator for a node that never comes back
/// (`operator::pools`).
pub const POOL_FINALIZER: &str = "castellan.io/pool";
/// Keeps a PersistentVolume until the agent has dealt with its subvolume.
pub const VOLUME_FINALIZER: &str = "castellan.io/volume";

/// Field manager of one node's entry in a StoragePool's `status.nodes`. The node's agent
/// applies its entry under it; the operator applies an empty status under it to release
/// a node that never comes back, and server-side apply then deletes what only this
/// manager owned.
pub fn node_entry_manager(node: &str) -> String {
    format!("castellan-agent/{node}")
}
