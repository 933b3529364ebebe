//! The node's part of each `StoragePool`: which disks it takes (`claim`), what to do
//! about its filesystem and what to report (`machine`, pure), the shell that runs it
//! and writes the objects (`shell`), and beside them the repair and upkeep it runs:
//! replacing a failed member (`replace`), scrubs (`scrub`), telling the volumes their
//! pool's health (`health`), deleting (`deletion`), the pool-wide totals (`totals`)
//! and the StorageClass (`storage_class`). `actor` is the `PoolMemberActor` that runs
//! the shell's pass over one pool at a time, and `lifecycle` its machine: the phases of
//! the node's part of the pool.

pub mod actor;
pub mod claim;
pub mod deletion;
pub mod health;
pub mod lifecycle;
pub mod machine;
pub mod replace;
pub mod scrub;
pub mod shell;
pub mod storage_class;
pub mod totals;
