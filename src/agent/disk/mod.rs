//! The node's disks: discovery (sysfs), probing (`wipefs`, `blkid`), identity, safety,
//! one full look (`observe`), the `BlockDevice` objects (`inventory`) and the kernel's
//! uevents that prompt a look.

pub mod discovery;
pub mod identity;
pub mod inventory;
pub mod observe;
pub mod probe;
pub mod safety;
pub mod uevent;
