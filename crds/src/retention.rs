//! How long backups are kept: shared by `DatabaseCluster.spec.backup` and
//! `BackupSchedule.spec`, so both say it the same way.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Backups are removed once they fall outside both limits that are given; with neither
/// given, nothing is removed. The newest successful backup is never removed, because it
/// is the only way back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Keep at least this many of the newest successful backups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("retention.keepLast must be at least 1"))]
    pub keep_last: Option<i32>,

    /// Remove backups older than this: a whole number of hours, days or weeks (`36h`,
    /// `30d`, `8w`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.matches('^[1-9][0-9]*[hdw]$')").message("retention.maxAge must be a whole number of hours, days or weeks, such as 36h, 30d or 8w"))]
    pub max_age: Option<String>,
}
