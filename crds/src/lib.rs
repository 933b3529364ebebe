//! Castellan's API, group `castellan.io`, version `v1alpha1`, as Rust types.
//!
//! The CustomResourceDefinitions in the repository's `crds/` directory are generated
//! from these types (`make crds`, or `castellan crds --out-dir crds`), and a test fails
//! when they are stale. Validation that a person can get wrong lives here too, as
//! OpenAPI constraints and CEL rules (`x-kubernetes-validations`), so that the API
//! server refuses bad input at admission with a message saying what to fix. What CEL
//! cannot judge (a cron expression, a regex, a missing Secret) is the operator's job and
//! surfaces as a condition.
//!
//! This crate holds types and their schemas only: no I/O, no client.
#![forbid(unsafe_code)]

pub mod backup;
pub mod backup_schedule;
pub mod block_device;
pub mod database_cluster;
pub mod pg_hba;
pub mod quantity;
pub mod render;
pub mod retention;
pub mod storage_pool;

pub use backup::{Backup, BackupSpec, BackupStatus};
pub use backup_schedule::{BackupSchedule, BackupScheduleSpec, BackupScheduleStatus};
pub use block_device::{BlockDevice, BlockDeviceSpec, BlockDeviceState, BlockDeviceStatus};
pub use database_cluster::{DatabaseCluster, DatabaseClusterSpec, DatabaseClusterStatus};
pub use storage_pool::{StoragePool, StoragePoolSpec, StoragePoolStatus};

/// The API group of every Castellan resource.
pub const GROUP: &str = "castellan.io";
/// The one served (and stored) version.
pub const VERSION: &str = "v1alpha1";
/// The category every kind shares, so `kubectl get castellan` lists them all.
pub const CATEGORY: &str = "castellan";
