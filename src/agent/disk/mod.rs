//! The node's disks: discovery (sysfs), probing (`wipefs`, `blkid`), identity, safety,
//! one full look (`observe`), the `BlockDevice` objects (`inventory`), the kernel's
//! uevents that prompt a look, and the `DiskActor` that keeps one disk's object
//! through its lifecycle (`machine`, pure, and `shell`).

pub mod discovery;
pub mod identity;
pub mod inventory;
pub mod machine;
pub mod observe;
pub mod probe;
pub mod safety;
pub mod shell;
pub mod uevent;
