//! Identity: how a disk is recognised again after a rename, a reattach or a reboot,
//! and the `BlockDevice` object name that follows from it.
//!
//! Pure. The order of trust is the disk's World Wide Name, then its serial number,
//! then — for loop devices, which have neither and are how development and the tests
//! simulate disks — the backing file's path and inode, then a filesystem Castellan
//! wrote (its UUID and the device's sub-UUID, for real disks that report neither WWN
//! nor serial). Path+inode survives detach and reattach of the same file (whatever
//! `/dev/loopN` it lands on) and changes if the file is replaced, which is exactly
//! "same disk" for a file. A disk with no identity
//! at all is not reported: naming it by its path would let two disks swap objects
//! when the kernel enumerates them in another order.

use std::fmt;

use super::probe::Signature;

/// Label prefix of the filesystems Castellan writes on pool disks, so their UUID can
/// serve as identity for disks without WWN or serial.
pub const CASTELLAN_LABEL_PREFIX: &str = "castellan-";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Identity {
    Wwn(String),
    Serial(String),
    /// A filesystem Castellan wrote: its UUID and, for a multi-device filesystem
    /// (a pool's btrfs spans several disks, all with the same filesystem UUID), this
    /// device's UUID within it.
    FilesystemUuid {
        filesystem: String,
        device: Option<String>,
    },
    /// Development only: a loop device's backing file.
    LoopFile {
        path: String,
        inode: u64,
    },
}

/// What identity can be built from.
#[derive(Clone, Debug, Default)]
pub struct IdentitySource<'a> {
    pub wwn: Option<&'a str>,
    pub serial: Option<&'a str>,
    /// The signatures found on the disk.
    pub signatures: &'a [Signature],
    /// A loop device's backing file and its inode.
    pub loop_file: Option<(&'a str, u64)>,
}

/// The most stable identity available, or `None`.
pub fn identify(source: &IdentitySource<'_>) -> Option<Identity> {
    if let Some(wwn) = source.wwn.map(normalize).filter(|wwn| !wwn.is_empty()) {
        return Some(Identity::Wwn(wwn));
    }
    if let Some(serial) = source
        .serial
        .map(str::trim)
        .filter(|serial| !serial.is_empty())
    {
        return Some(Identity::Serial(serial.to_string()));
    }
    // Before a filesystem UUID: a loop device's file is known from the start and
    // does not change when a pool is built on it, so its object keeps its name.
    if let Some((path, inode)) = source.loop_file {
        return Some(Identity::LoopFile {
            path: path.to_string(),
            inode,
        });
    }
    let castellan = source.signatures.iter().find(|signature| {
        signature
            .label
            .as_deref()
            .is_some_and(|label| label.starts_with(CASTELLAN_LABEL_PREFIX))
            && signature.uuid.is_some()
    });
    castellan.map(|signature| Identity::FilesystemUuid {
        filesystem: signature.uuid.clone().unwrap_or_default(),
        device: signature.device_uuid.clone(),
    })
}

/// sysfs prints WWNs with their scheme (`naa.…`, `eui.…`, `t10.…`), in varying case
/// and sometimes padded; identity keeps the scheme and compares them lowercased and
/// trimmed.
fn normalize(wwn: &str) -> String {
    wwn.trim().to_ascii_lowercase()
}

impl fmt::Display for Identity {
    /// The `spec.identity` text: `wwn:…`, `serial:…`, `fsuuid:<filesystem>[/<device>]`,
    /// `loopfile:<path>@<inode>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Wwn(wwn) => write!(f, "wwn:{wwn}"),
            Identity::Serial(serial) => write!(f, "serial:{serial}"),
            Identity::FilesystemUuid {
                filesystem,
                device: None,
            } => write!(f, "fsuuid:{filesystem}"),
            Identity::FilesystemUuid {
                filesystem,
                device: Some(device),
            } => write!(f, "fsuuid:{filesystem}/{device}"),
            Identity::LoopFile { path, inode } => write!(f, "loopfile:{path}@{inode}"),
        }
    }
}

impl Identity {
    fn kind(&self) -> &'static str {
        match self {
            Identity::Wwn(_) => "wwn",
            Identity::Serial(_) => "serial",
            Identity::FilesystemUuid { .. } => "fs",
            Identity::LoopFile { .. } => "loop",
        }
    }

    /// The `BlockDevice` name: `<node>-<kind>-<16 hex digits>`, a valid DNS subdomain.
    /// The node is part of it because a disk moved to another node is another object
    /// there (`spec.nodeName` is immutable). The hash is FNV-1a, written out here
    /// because names must not change with a Rust release (std's hasher may).
    pub fn object_name(&self, node: &str) -> String {
        let hash = fnv1a64(format!("{node}\n{self}").as_bytes());
        let kind = self.kind();
        // 253 is the limit; keep room for `-kind-` and the hash.
        let node = dns_safe(node, 253 - kind.len() - 2 - 16);
        format!("{node}-{kind}-{hash:016x}")
    }
}

/// Lowercases and replaces anything outside `[a-z0-9.-]` with `-`, then cuts to `max`
/// characters and trims separators at the start and end.
fn dns_safe(text: &str, max: usize) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(max)
        .collect();
    let trimmed = cleaned.trim_matches(['-', '.']);
    if trimmed.is_empty() {
        "node".to_string()
    } else {
        trimmed.to_string()
    }
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use crate::agent::disk::probe::SignatureKind;

    #[test]
    fn wwn_wins_over_everything() {
        let source = IdentitySource {
            wwn: Some(" NAA.5000C500A0B1C2D3 \n"),
            serial: Some("S1"),
            loop_file: Some(("/f", 1)),
            ..Default::default()
        };
        assert_eq!(
            identify(&source),
            Some(Identity::Wwn("naa.5000c500a0b1c2d3".into()))
        );
    }

    #[test]
    fn serial_when_there_is_no_wwn() {
        let source = IdentitySource {
            wwn: Some("  "),
            serial: Some(" S1 "),
            ..Default::default()
        };
        assert_eq!(identify(&source), Some(Identity::Serial("S1".into())));
    }

    fn filesystem(uuid: Option<&str>, device: Option<&str>, label: Option<&str>) -> Signature {
        Signature {
            name: "btrfs".into(),
            kind: SignatureKind::Filesystem,
            uuid: uuid.map(Into::into),
            device_uuid: device.map(Into::into),
            label: label.map(Into::into),
        }
    }

    #[test]
    fn castellan_filesystem_uuid_when_there_is_no_serial() {
        let signatures = [
            filesystem(Some("not-ours"), Some("d0"), Some("data")),
            filesystem(Some("ours"), Some("d1"), Some("castellan-pool-a")),
        ];
        let source = IdentitySource {
            serial: Some(""),
            signatures: &signatures,
            ..Default::default()
        };
        let identity = identify(&source).unwrap();
        assert_eq!(
            identity,
            Identity::FilesystemUuid {
                filesystem: "ours".into(),
                device: Some("d1".into())
            }
        );
        assert_eq!(identity.to_string(), "fsuuid:ours/d1");

        let single = [filesystem(Some("ours"), None, Some("castellan-x"))];
        let source = IdentitySource {
            signatures: &single,
            ..Default::default()
        };
        assert_eq!(identify(&source).unwrap().to_string(), "fsuuid:ours");

        // A filesystem without our label, or a labelled one without a UUID, is no identity.
        let unlabelled = [filesystem(Some("u"), Some("d"), None)];
        let source = IdentitySource {
            signatures: &unlabelled,
            ..Default::default()
        };
        assert_eq!(identify(&source), None);
        let no_uuid = [filesystem(None, Some("d"), Some("castellan-x"))];
        let source = IdentitySource {
            signatures: &no_uuid,
            ..Default::default()
        };
        assert_eq!(identify(&source), None);
    }

    #[test]
    fn loop_file_before_a_castellan_filesystem_and_nothing_means_none() {
        let ours = [filesystem(
            Some("ours"),
            Some("d1"),
            Some("castellan-pool-a"),
        )];
        let source = IdentitySource {
            signatures: &ours,
            loop_file: Some(("/tmp/d.img", 42)),
            ..Default::default()
        };
        let identity = identify(&source).unwrap();
        assert_eq!(identity.to_string(), "loopfile:/tmp/d.img@42");
        assert_eq!(identify(&IdentitySource::default()), None);
    }

    #[test]
    fn identity_text_per_kind() {
        assert_eq!(Identity::Wwn("w".into()).to_string(), "wwn:w");
        assert_eq!(Identity::Serial("s".into()).to_string(), "serial:s");
        let fs = Identity::FilesystemUuid {
            filesystem: "u".into(),
            device: None,
        };
        assert_eq!(fs.to_string(), "fsuuid:u");
    }

    #[test]
    fn names_are_stable_distinct_and_valid() {
        let disk = Identity::LoopFile {
            path: "/tmp/d.img".into(),
            inode: 42,
        };
        let name = disk.object_name("node-1");
        // Pinned: a change here renames every BlockDevice in every cluster.
        assert_eq!(
            name,
            format!(
                "node-1-loop-{:016x}",
                fnv1a64(b"node-1\nloopfile:/tmp/d.img@42")
            )
        );
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(name, disk.object_name("node-2"));
        assert_ne!(
            name,
            Identity::LoopFile {
                path: "/tmp/d.img".into(),
                inode: 43
            }
            .object_name("node-1")
        );
        assert!(
            Identity::Wwn("x".into())
                .object_name("n")
                .starts_with("n-wwn-")
        );
        assert!(
            Identity::Serial("x".into())
                .object_name("n")
                .starts_with("n-serial-")
        );
        assert!(
            Identity::FilesystemUuid {
                filesystem: "x".into(),
                device: None
            }
            .object_name("n")
            .starts_with("n-fs-")
        );

        let long = "A_".repeat(200);
        let name = Identity::Serial("x".into()).object_name(&long);
        assert!(name.len() <= 253, "{}", name.len());
        assert!(name.starts_with("a-a-"), "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        );
        assert!(
            Identity::Serial("x".into())
                .object_name("__")
                .starts_with("node-serial-")
        );
    }
}
