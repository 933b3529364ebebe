//! `StoragePool`: the disks of some nodes, claimed and built into redundant storage
//! that is published as a StorageClass.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::quantity::optional_quantity_schema;

/// A pool of local disks on the nodes a selector picks.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "castellan.io",
    version = "v1alpha1",
    kind = "StoragePool",
    plural = "storagepools",
    status = "StoragePoolStatus",
    shortname = "sp",
    shortname = "pool",
    category = "castellan",
    printcolumn = r#"{"name":"Layout","type":"string","jsonPath":".spec.layout"}"#,
    printcolumn = r#"{"name":"StorageClass","type":"string","jsonPath":".spec.storageClass.name"}"#,
    printcolumn = r#"{"name":"Nodes","type":"integer","jsonPath":".status.readyNodes"}"#,
    printcolumn = r#"{"name":"Capacity","type":"string","jsonPath":".status.capacity"}"#,
    printcolumn = r#"{"name":"Free","type":"string","jsonPath":".status.free"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("size(self.metadata.name) <= 40").message("metadata.name must be at most 40 characters: it names the pool's mount paths and labels on every node"),
)]
#[serde(rename_all = "camelCase")]
pub struct StoragePoolSpec {
    /// Nodes the pool spans; every node when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// Which disks on those nodes the pool may claim.
    #[serde(default)]
    #[x_kube(validation = Rule::new("!has(self.allowWipe) || !self.allowWipe || has(self.pathPattern) || (has(self.nodes) && size(self.nodes) > 0)").message("devices.allowWipe needs devices.pathPattern or devices.nodes: it would otherwise let the pool wipe every disk that is not clearly empty on every node it spans"))]
    pub devices: DeviceFilter,

    /// Redundancy across a node's claimed disks. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("layout cannot be changed after the pool is created: converting a pool's redundancy in place is not supported yet").reason(Reason::FieldValueForbidden))]
    pub layout: Layout,

    /// The StorageClass the pool publishes.
    pub storage_class: PoolStorageClass,

    /// When each node's part of the pool is scrubbed: every copy of every block read
    /// and checked against its checksum, a bad copy rewritten from a good one. The
    /// first day of each month at 03:00 UTC when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrub: Option<ScrubSpec>,
}

/// A pool's scrub schedule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScrubSpec {
    /// A five-field cron expression in UTC, such as `0 3 * * 0` (Sundays at 03:00), or
    /// a macro such as `@weekly`. `0 3 1 * *` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub schedule: Option<String>,
    /// No scheduled scrubs while true (one running goes on).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
}

/// The health words of a pool on a node: `status.nodes[].health`, and the value of
/// [`POOL_HEALTH_ANNOTATION`]. The agent writes them; the operator and the plugin read
/// them.
pub const HEALTHY: &str = "Healthy";
pub const DEGRADED: &str = "Degraded";
pub const FAILED: &str = "Failed";
pub const PENDING: &str = "Pending";

/// Annotation the node agent keeps on each PersistentVolume of a pool, and on its
/// claim: the pool's health on the volume's node (`Healthy`, `Degraded`, `Failed`,
/// `Pending`). The operator reads it from its instances' claims (`VolumesHealthy`).
pub const POOL_HEALTH_ANNOTATION: &str = "castellan.io/pool-health";
/// Beside it: why, when not `Healthy`.
pub const POOL_HEALTH_MESSAGE_ANNOTATION: &str = "castellan.io/pool-health-message";

/// The schedule of a pool without `scrub.schedule`.
pub const DEFAULT_SCRUB_SCHEDULE: &str = "0 3 1 * *";

/// Filters that pick disks; a disk must pass all that are given.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeviceFilter {
    /// A regular expression (RE2) the device path must match, such as `^/dev/sd[b-z]$`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub path_pattern: Option<String>,

    /// Disks smaller than this are left alone, such as `100Gi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "optional_quantity_schema")]
    #[x_kube(
        validation = Rule::new("isQuantity(self)").message("devices.minSize must be a Kubernetes quantity such as 100Gi"),
        validation = Rule::new("!isQuantity(self) || quantity(self).isGreaterThan(quantity('0'))").message("devices.minSize must be greater than zero"),
    )]
    pub min_size: Option<String>,

    /// Explicit per-node lists of device paths; when given, only these disks are
    /// considered on the nodes named. Removable media (USB sticks, SD cards) are only
    /// ever taken when listed here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // A map-list: the API server itself refuses a node named twice.
    #[schemars(length(max = 1000), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub nodes: Vec<NodeDevices>,

    /// Claim disks that are not clearly empty (partition tables, filesystems, RAID or
    /// LVM signatures), destroying what is on them. Off by default, and refused unless
    /// `pathPattern` or `nodes` narrows the disks; disks that are mounted, in use, or
    /// hold the root filesystem are never touched.
    #[serde(default)]
    pub allow_wipe: bool,
}

/// The device paths a pool may use on one node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeDevices {
    /// Node name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Device paths, such as `/dev/sdb`, or links to them as udev makes them:
    /// `/dev/disk/by-id/wwn-0x5000c500a0b1c2d3`, `/dev/disk/by-path/…`,
    /// `/dev/disk/by-uuid/…` (resolved on the node each time the pool is looked at).
    #[schemars(length(min = 1, max = 64))]
    #[x_kube(validation = Rule::new("self.all(p, p.startsWith('/dev/'))").message("devices.nodes[].paths must be device paths under /dev/"))]
    pub paths: Vec<DevicePath>,
}

/// A device path (a string of at most 256 characters).
pub type DevicePath = String;

/// Redundancy of a pool on a node.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// No redundancy: one disk's loss loses data. One disk or more.
    Single,
    /// Every block on two disks. Two disks or more.
    Raid1,
    /// Striped mirrors. Four disks or more.
    Raid10,
}

/// The StorageClass a pool publishes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolStorageClass {
    /// Name of the StorageClass. Immutable.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(
        validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("storageClass.name must be a DNS subdomain: lowercase letters, digits, '-' and '.'"),
        validation = Rule::new("self == oldSelf").message("storageClass.name cannot be changed: volumes already provisioned refer to it").reason(Reason::FieldValueForbidden),
    )]
    pub name: String,

    /// What happens to a volume's data when its claim is deleted. Immutable, like a
    /// StorageClass's own.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("storageClass.reclaimPolicy cannot be changed: Kubernetes StorageClasses are immutable").reason(Reason::FieldValueForbidden))]
    pub reclaim_policy: ReclaimPolicy,

    /// Make it the cluster's default StorageClass (the annotation
    /// `storageclass.kubernetes.io/is-default-class: "true"`): claims that name no class,
    /// such as a DatabaseCluster's without `storage.storageClassName`, get this one. May
    /// be changed at any time; when several classes are default, Kubernetes gives new
    /// claims the most recently created one.
    #[serde(default)]
    pub default: bool,
}

/// Reclaim policy of provisioned volumes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Remove the volume's data with its claim.
    #[default]
    Delete,
    /// Keep the data; an administrator removes it.
    Retain,
}

/// What Castellan observed of a `StoragePool`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StoragePoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded` and others, per the Kubernetes conventions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// One word a person can read: `Pending`, `Ready`, `Degraded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Nodes where the pool is built and healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_nodes: Option<i32>,
    /// Usable capacity over all nodes, as a quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<String>,
    /// Space promised to volumes over all nodes, as a quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<String>,
    /// Capacity not yet promised, as a quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free: Option<String>,
    /// The pool on each node. A list-map keyed by node, so that each node's agent
    /// applies its own entry (server-side apply) without replacing the others'.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["node"]))]
    pub nodes: Vec<PoolNodeStatus>,
}

/// The pool on one node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolNodeStatus {
    /// Node name.
    pub node: String,
    /// `Healthy`, `Degraded` (a disk is missing or failed), `Failed` or `Pending`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<String>,
    /// Why the pool is not healthy here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Usable bytes after redundancy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<i64>,
    /// Bytes promised to volumes (the sum of their quotas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_bytes: Option<i64>,
    /// Bytes not yet promised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<i64>,
    /// Disks the pool claimed on this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["path"]))]
    pub disks: Vec<PoolDisk>,
    /// Disks that matched the filters but were refused, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["path"]))]
    pub rejected: Vec<RejectedDisk>,
    /// A failed member being replaced by a new disk (`btrfs replace`), while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacement: Option<PoolReplacement>,
    /// The node's scrubs: the last one and the next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrub: Option<PoolScrubStatus>,
}

/// Scrubbing one node's part of a pool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolScrubStatus {
    /// When the last scrub started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_started: Option<String>,
    /// When it ended, as the agent saw it end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_finished: Option<String>,
    /// `Running`, `Succeeded` (no errors), `Repaired` (errors found and corrected),
    /// `Failed` (uncorrectable errors, or the scrub did not complete).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// What it found: `no errors found in 256.0 MiB`, the error counts, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The next scheduled scrub (RFC 3339), or why there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// A failed member's replacement in progress on one node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolReplacement {
    /// The member being replaced: its `BlockDevice` or path, and its btrfs device id.
    pub failed: String,
    /// The `BlockDevice` taking its place.
    pub block_device: String,
    /// The new disk's path on the node.
    pub path: String,
    /// How much of the failed member's data is copied, as btrfs reports it (`42.5%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
}

/// A disk in a pool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolDisk {
    /// The `BlockDevice` object.
    pub block_device: String,
    /// Device path on the node.
    pub path: String,
    /// Size in bytes.
    pub size_bytes: i64,
    /// `Online`, `Missing` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

/// A disk the pool would have taken but did not, and why.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RejectedDisk {
    /// The `BlockDevice` object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_device: Option<String>,
    /// Device path on the node.
    pub path: String,
    /// Why it was refused, such as `has an ext4 filesystem (allowWipe is off)`.
    pub reason: String,
}
