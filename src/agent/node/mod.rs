//! The `NodeActor`: the root of the agent's tree. When to look at the disks
//! (`machine`, pure) and one look handed to the `DiskActor`s and `PoolMemberActor`s it
//! supervises (`shell`).

pub mod machine;
pub mod shell;
