//! `Backup`: one base backup of a `DatabaseCluster` to its object store.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A request for one backup. Its spec is fixed once created: a different backup is a
/// different object.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "castellan.io",
    version = "v1alpha1",
    kind = "Backup",
    plural = "backups",
    namespaced,
    status = "BackupStatus",
    shortname = "cbk",
    category = "castellan",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".spec.cluster"}"#,
    printcolumn = r#"{"name":"Method","type":"string","jsonPath":".spec.method"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Progress","type":"integer","jsonPath":".status.progressPercent"}"#,
    printcolumn = r#"{"name":"Started","type":"date","jsonPath":".status.startedAt"}"#,
    printcolumn = r#"{"name":"Size","type":"string","jsonPath":".status.size"}"#,
    printcolumn = r#"{"name":"Verified","type":"string","jsonPath":".status.conditions[?(@.type==\"RestoreVerified\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a Backup's spec cannot be changed after it is created; create a new Backup instead").reason(Reason::FieldValueForbidden))]
#[serde(rename_all = "camelCase")]
pub struct BackupSpec {
    /// Name of the `DatabaseCluster` (same namespace) to back up.
    #[schemars(length(min = 1, max = 63))]
    pub cluster: String,

    /// How the backup is taken.
    #[serde(default)]
    pub method: BackupMethod,

    /// Once completed, prove it restorable: restore it into a scratch instance (never
    /// selected by the cluster's Services), replay the archived WAL, check the data, and
    /// record the outcome as the `RestoreVerified` condition here and on the cluster.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verify: bool,
}

/// How a backup is taken.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum BackupMethod {
    /// A compressed base backup streamed to the cluster's S3-compatible object store,
    /// restorable to any point covered by the archived WAL.
    #[default]
    ObjectStore,
}

/// Progress and result of a backup.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// `Pending`, `Running`, `Completed` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// When the backup started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    /// When the copy ended (RFC 3339): the earliest moment it restores to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<String>,
    /// Names the backup in the object store: `<path>/<systemIdentifier>/base/<backupId>/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_id: Option<String>,
    /// PostgreSQL's system identifier of the cluster backed up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identifier: Option<String>,
    /// The WAL timeline the backup starts on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<i64>,
    /// Stored size, as a quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// Stored size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,
    /// First WAL segment needed to restore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_wal: Option<String>,
    /// Last WAL segment needed to make it consistent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_wal: Option<String>,
    /// LSN where the backup starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_lsn: Option<String>,
    /// LSN where the backup becomes consistent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_lsn: Option<String>,
    /// Where it is stored, as an `s3://bucket/path` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Bytes of the data directory copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_bytes: Option<i64>,
    /// Percent done while running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_percent: Option<i32>,
    /// Instance the backup was taken from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What a running backup waits for, while it waits: the WAL its copy needs to be
    /// consistent, archived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// When a verification of it finished (RFC 3339), with `spec.verify`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_at: Option<String>,
    /// How long that verification took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification_seconds: Option<i64>,
}
