//! `BlockDevice`: one physical disk seen on one node, written by the node agent.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A disk on a node. Written by `castellan agent`, not by users: its name is derived
/// from the disk's identity so that the same disk is the same object after a rename,
/// a reattach or a reboot.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "castellan.io",
    version = "v1alpha1",
    kind = "BlockDevice",
    plural = "blockdevices",
    status = "BlockDeviceStatus",
    shortname = "bd",
    shortname = "bdev",
    category = "castellan",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.nodeName"}"#,
    printcolumn = r#"{"name":"Path","type":"string","jsonPath":".spec.path"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","format":"int64","jsonPath":".spec.sizeBytes"}"#,
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".status.pool"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BlockDeviceSpec {
    /// Node the disk is attached to. Immutable: a disk moved to another node is
    /// another object there.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("nodeName is immutable").reason(Reason::FieldValueForbidden))]
    pub node_name: String,

    /// Current device path, such as `/dev/sdb` (may change across reboots).
    #[schemars(length(min = 1, max = 256))]
    #[x_kube(validation = Rule::new("self.startsWith('/dev/')").message("path must be a device path under /dev/"))]
    pub path: String,

    /// Size in bytes.
    #[schemars(range(min = 0))]
    pub size_bytes: i64,

    /// Vendor model string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,

    /// Serial number as the disk reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,

    /// World Wide Name, the most stable identity a disk has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,

    /// How the agent recognises this disk again: `wwn:…`, `serial:…`, or, for disks
    /// without either (loop devices, some virtual disks), `fsuuid:…` of the filesystem
    /// Castellan wrote.
    #[schemars(length(min = 1, max = 256))]
    pub identity: String,

    /// Spinning disk (true) or solid state (false).
    #[serde(default)]
    pub rotational: bool,

    /// What is on the disk as found by probing, such as `gpt`, `ext4`,
    /// `linux_raid_member`, `btrfs`; empty for a clean disk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signatures: Vec<String>,
}

/// Lifecycle of a disk as Castellan sees it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockDeviceState {
    /// Seen, not part of any pool.
    Unclaimed,
    /// Chosen by a pool and being prepared.
    Claimed,
    /// A member of a pool's filesystem.
    InUse,
    /// Known but not attached now.
    Missing,
    /// Attached but failing (I/O errors, failed to join the pool).
    Failed,
}

/// What the agent observed of the disk.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BlockDeviceStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Where the disk is in its lifecycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<BlockDeviceState>,
    /// The `StoragePool` that claimed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Why the disk is in its state (for example why a pool refused it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the agent last saw the disk attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
}
