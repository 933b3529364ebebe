//! `BackupSchedule`: `Backup`s made on a cron schedule and pruned by retention.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::retention::Retention;

/// Backups of a cluster on a schedule. The cron expression and time zone are checked
/// by the operator (CEL cannot parse them) and reported in the `Ready` condition.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "castellan.io",
    version = "v1alpha1",
    kind = "BackupSchedule",
    plural = "backupschedules",
    namespaced,
    status = "BackupScheduleStatus",
    shortname = "cbs",
    category = "castellan",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".spec.cluster"}"#,
    printcolumn = r#"{"name":"Schedule","type":"string","jsonPath":".spec.schedule"}"#,
    printcolumn = r#"{"name":"Suspend","type":"boolean","jsonPath":".spec.suspend"}"#,
    printcolumn = r#"{"name":"Last","type":"date","jsonPath":".status.lastScheduleTime"}"#,
    printcolumn = r#"{"name":"Next","type":"string","jsonPath":".status.nextScheduleTime"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("size(self.metadata.name) <= 48").message("metadata.name must be at most 48 characters: Backups are named <schedule>-<yyyymmddhhmmss> and labelled with the schedule's name, which must fit in 63 characters"),
)]
#[serde(rename_all = "camelCase")]
pub struct BackupScheduleSpec {
    /// Name of the `DatabaseCluster` (same namespace) to back up.
    #[schemars(length(min = 1, max = 63))]
    pub cluster: String,

    /// Standard five-field cron expression (`minute hour day-of-month month
    /// day-of-week`), such as `0 3 * * *`, or a macro such as `@daily`.
    #[schemars(length(min = 1, max = 128))]
    pub schedule: String,

    /// IANA time zone the schedule is read in, such as `Europe/Berlin`; UTC when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: Option<String>,

    /// Which of the `Backup` objects this schedule created to keep; older ones are
    /// deleted. What stays in the object store is the cluster's
    /// `spec.backup.retention`'s business.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,

    /// Stop making new backups (retention still applies). Slots that pass while
    /// suspended are not made up for when it is turned off.
    #[serde(default)]
    pub suspend: bool,

    /// Take a backup as soon as the operator first sees the schedule, not only at the
    /// first slot (not while suspended).
    #[serde(default)]
    pub immediate: bool,

    /// Verify every backup this schedule makes: each is restored into a scratch instance
    /// and checked once completed (`spec.verify` on the Backups); the newest verdict is
    /// the schedule's `RestoreVerified` condition and `status.lastVerified`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify: bool,
}

/// What the schedule has done and will do.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupScheduleStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (with reason `InvalidSchedule` when the cron or time zone is wrong) and
    /// others, per the Kubernetes conventions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The slot of the newest `Backup` this schedule created (RFC 3339, UTC); for an
    /// `immediate` one, the second it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<String>,
    /// The first slot not handled yet: when the next backup is due (RFC 3339, UTC).
    /// Absent while suspended or invalid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_schedule_time: Option<String>,
    /// Name of the newest `Completed` `Backup` of this schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_backup: Option<String>,
    /// `Backup`s of this schedule still `Pending` or `Running`; while there is one, due
    /// slots are skipped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active_backups: Vec<String>,
    /// When the newest verification of one of its backups finished (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_verified: Option<String>,
}
