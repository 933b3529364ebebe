//! Safety: whether a disk may be claimed by a pool, and if not, why — in words a
//! person reads in `kubectl get` output.
//!
//! Pure: it judges facts gathered elsewhere (discovery, probe) and never looks at a
//! device itself. Two kinds of refusal exist. What is *on* a disk (a partition table,
//! a filesystem, a RAID, LVM or crypto header) is data the pool's `allowWipe` may
//! destroy. What is *using* a disk (a mount, a holder, swap, the root filesystem) or
//! makes it unwritable is never overridden: wiping a disk in use corrupts whatever
//! uses it.

use std::fmt;

use super::probe::{Signature, SignatureKind};

/// What safety needs to know about a disk.
#[derive(Clone, Debug, Default)]
pub struct DeviceFacts<'a> {
    pub signatures: &'a [Signature],
    /// Partition names the kernel knows (`sda1`).
    pub partitions: &'a [String],
    /// Devices stacked on the disk or its partitions (`dm-0`, `md0`).
    pub holders: &'a [String],
    /// Where the disk or its partitions are mounted in the host mount namespace.
    pub mount_points: &'a [String],
    pub swap: bool,
    pub holds_root: bool,
    pub read_only: bool,
    /// Why probing for signatures failed, if it did: then nothing is known of what is
    /// on the disk, and wiping the unknown is not a risk `allowWipe` was meant to take.
    pub probe_error: Option<&'a str>,
    /// Removable media (the kernel's `removable` flag: USB sticks, SD cards): a pool
    /// takes them only when they are listed by path.
    pub removable: bool,
    /// The udev links that name the disk (`/dev/disk/by-id/…`, `by-path`, `by-uuid`),
    /// by which a pool may list it.
    pub links: &'a [String],
}

/// One reason a disk is not claimable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    HoldsRoot,
    Mounted(String),
    Held(String),
    Swap,
    ReadOnly,
    Unprobed(String),
    PartitionTable(String),
    Partitions(Vec<String>),
    Filesystem(String),
    Raid(String),
    Crypto(String),
    Signature(String),
}

impl Refusal {
    /// Whether a pool's `allowWipe` lifts this refusal.
    pub fn wipe_lifts(&self) -> bool {
        match self {
            Refusal::HoldsRoot
            | Refusal::Mounted(_)
            | Refusal::Held(_)
            | Refusal::Swap
            | Refusal::ReadOnly
            | Refusal::Unprobed(_) => false,
            Refusal::PartitionTable(_)
            | Refusal::Partitions(_)
            | Refusal::Filesystem(_)
            | Refusal::Raid(_)
            | Refusal::Crypto(_)
            | Refusal::Signature(_) => true,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::HoldsRoot => write!(f, "holds the root filesystem"),
            Refusal::Mounted(point) => write!(f, "is mounted at {point}"),
            Refusal::Held(holder) => write!(f, "is held by {holder}"),
            Refusal::Swap => write!(f, "is used as swap"),
            Refusal::ReadOnly => write!(f, "is read-only"),
            Refusal::Unprobed(error) => write!(f, "could not be probed ({error})"),
            Refusal::PartitionTable(name) => write!(f, "has a partition table ({name})"),
            Refusal::Partitions(names) => write!(f, "has partitions ({})", names.join(", ")),
            Refusal::Filesystem(name) => write!(f, "{} {name} filesystem", article(name)),
            Refusal::Raid(name) => write!(f, "has a RAID or LVM signature ({name})"),
            Refusal::Crypto(name) => write!(f, "has an encrypted volume ({name})"),
            Refusal::Signature(name) => write!(f, "has a {name} signature"),
        }
    }
}

/// "has an ext4" but "has a btrfs".
fn article(word: &str) -> &'static str {
    match word.chars().next().map(|c| c.to_ascii_lowercase()) {
        Some('a' | 'e' | 'i' | 'o' | 'u') => "has an",
        _ => "has a",
    }
}

/// The judgement on one disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The pool may take the disk. `wipe` lists what taking it destroys (empty for a
    /// clean disk): the pool's `allowWipe` lifted these refusals.
    Claimable { wipe: Vec<Refusal> },
    /// The pool must leave the disk alone, for these reasons (never empty).
    Refused(Vec<Refusal>),
}

impl Verdict {
    /// The reasons in one line, such as `has an ext4 filesystem; is mounted at /x`;
    /// `None` for a claimable disk.
    pub fn reason(&self) -> Option<String> {
        match self {
            Verdict::Claimable { .. } => None,
            Verdict::Refused(reasons) => Some(join(reasons)),
        }
    }
}

pub fn join(reasons: &[Refusal]) -> String {
    reasons
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every reason the disk is not clean, whatever `allowWipe` says, most serious first.
pub fn refusals(facts: &DeviceFacts<'_>) -> Vec<Refusal> {
    let mut reasons = Vec::new();
    if facts.holds_root {
        reasons.push(Refusal::HoldsRoot);
    }
    for point in facts
        .mount_points
        .iter()
        .filter(|point| point.as_str() != "/")
    {
        reasons.push(Refusal::Mounted(point.clone()));
    }
    reasons.extend(facts.holders.iter().cloned().map(Refusal::Held));
    if facts.swap {
        reasons.push(Refusal::Swap);
    }
    if facts.read_only {
        reasons.push(Refusal::ReadOnly);
    }
    if let Some(error) = facts.probe_error {
        reasons.push(Refusal::Unprobed(error.to_string()));
    }
    for signature in facts.signatures {
        let name = signature.name.clone();
        reasons.push(match signature.kind {
            SignatureKind::PartitionTable => Refusal::PartitionTable(name),
            SignatureKind::Filesystem => Refusal::Filesystem(name),
            SignatureKind::Raid => Refusal::Raid(name),
            SignatureKind::Crypto => Refusal::Crypto(name),
            SignatureKind::Other => Refusal::Signature(name),
        });
    }
    // Partitions without a partition-table signature (a table probing cannot read, or
    // one just wiped while the kernel still lists its partitions) still mean the disk
    // is not empty.
    let has_table = facts
        .signatures
        .iter()
        .any(|s| s.kind == SignatureKind::PartitionTable);
    if !facts.partitions.is_empty() && !has_table {
        reasons.push(Refusal::Partitions(facts.partitions.to_vec()));
    }
    reasons
}

/// Judges a disk for a pool with the given `allowWipe`.
pub fn judge(facts: &DeviceFacts<'_>, allow_wipe: bool) -> Verdict {
    let reasons = refusals(facts);
    if reasons.is_empty() {
        return Verdict::Claimable { wipe: Vec::new() };
    }
    if allow_wipe && reasons.iter().all(Refusal::wipe_lifts) {
        return Verdict::Claimable { wipe: reasons };
    }
    Verdict::Refused(reasons)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    fn signature(name: &str, kind: SignatureKind) -> Signature {
        Signature {
            name: name.into(),
            kind,
            uuid: None,
            device_uuid: None,
            label: None,
        }
    }

    fn messages(verdict: &Verdict) -> String {
        verdict.reason().unwrap_or_default()
    }

    #[test]
    fn a_clean_disk_is_claimable_with_or_without_wipe() {
        let facts = DeviceFacts::default();
        for allow_wipe in [false, true] {
            let verdict = judge(&facts, allow_wipe);
            assert_eq!(verdict, Verdict::Claimable { wipe: vec![] });
            assert!(matches!(verdict, Verdict::Claimable { .. }));
            assert_eq!(verdict.reason(), None);
        }
    }

    #[test]
    fn signatures_refuse_without_wipe_and_are_listed_as_wiped_with_it() {
        let cases = [
            (
                signature("ext4", SignatureKind::Filesystem),
                "has an ext4 filesystem",
            ),
            (
                signature("btrfs", SignatureKind::Filesystem),
                "has a btrfs filesystem",
            ),
            (
                signature("gpt", SignatureKind::PartitionTable),
                "has a partition table (gpt)",
            ),
            (
                signature("LVM2_member", SignatureKind::Raid),
                "has a RAID or LVM signature (LVM2_member)",
            ),
            (
                signature("crypto_LUKS", SignatureKind::Crypto),
                "has an encrypted volume (crypto_LUKS)",
            ),
            (
                signature("swap", SignatureKind::Other),
                "has a swap signature",
            ),
        ];
        for (signature, message) in cases {
            let signatures = [signature];
            let facts = DeviceFacts {
                signatures: &signatures,
                ..Default::default()
            };
            let refused = judge(&facts, false);
            assert!(matches!(refused, Verdict::Refused(_)));
            assert_eq!(messages(&refused), message);
            match judge(&facts, true) {
                Verdict::Claimable { wipe } => assert_eq!(join(&wipe), message),
                other => panic!("{message}: allowWipe should lift it, got {other:?}"),
            }
        }
    }

    #[test]
    fn partitions_without_a_readable_table_refuse_but_with_one_are_not_repeated() {
        let partitions = ["sdb1".to_string(), "sdb2".to_string()];
        let facts = DeviceFacts {
            partitions: &partitions,
            ..Default::default()
        };
        assert_eq!(
            messages(&judge(&facts, false)),
            "has partitions (sdb1, sdb2)"
        );
        assert!(matches!(judge(&facts, true), Verdict::Claimable { .. }));

        let signatures = [signature("dos", SignatureKind::PartitionTable)];
        let facts = DeviceFacts {
            partitions: &partitions,
            signatures: &signatures,
            ..Default::default()
        };
        assert_eq!(
            messages(&judge(&facts, false)),
            "has a partition table (dos)"
        );
    }

    #[test]
    fn use_by_the_host_is_never_lifted_by_wipe() {
        let mounts = ["/x".to_string()];
        let holders = ["dm-0".to_string()];
        let root = ["/".to_string(), "/boot".to_string()];
        let cases: [(DeviceFacts<'_>, &str); 6] = [
            (
                DeviceFacts {
                    probe_error: Some("wipefs: permission denied"),
                    ..Default::default()
                },
                "could not be probed (wipefs: permission denied)",
            ),
            (
                DeviceFacts {
                    mount_points: &mounts,
                    ..Default::default()
                },
                "is mounted at /x",
            ),
            (
                DeviceFacts {
                    holders: &holders,
                    ..Default::default()
                },
                "is held by dm-0",
            ),
            (
                DeviceFacts {
                    swap: true,
                    ..Default::default()
                },
                "is used as swap",
            ),
            (
                DeviceFacts {
                    read_only: true,
                    ..Default::default()
                },
                "is read-only",
            ),
            (
                DeviceFacts {
                    holds_root: true,
                    mount_points: &root,
                    ..Default::default()
                },
                "holds the root filesystem; is mounted at /boot",
            ),
        ];
        for (facts, message) in cases {
            for allow_wipe in [false, true] {
                let verdict = judge(&facts, allow_wipe);
                assert_eq!(messages(&verdict), message, "allowWipe={allow_wipe}");
            }
        }
    }

    #[test]
    fn a_mix_is_refused_even_with_wipe_and_names_everything() {
        let signatures = [signature("ext4", SignatureKind::Filesystem)];
        let mounts = ["/data".to_string()];
        let facts = DeviceFacts {
            signatures: &signatures,
            mount_points: &mounts,
            ..Default::default()
        };
        let verdict = judge(&facts, true);
        assert_eq!(
            messages(&verdict),
            "is mounted at /data; has an ext4 filesystem"
        );
    }

    #[test]
    fn every_refusal_knows_whether_wipe_lifts_it() {
        let lifted = [
            Refusal::PartitionTable("gpt".into()),
            Refusal::Partitions(vec!["a1".into()]),
            Refusal::Filesystem("xfs".into()),
            Refusal::Raid("linux_raid_member".into()),
            Refusal::Crypto("crypto_LUKS".into()),
            Refusal::Signature("swap".into()),
        ];
        let kept = [
            Refusal::HoldsRoot,
            Refusal::Mounted("/".into()),
            Refusal::Held("md0".into()),
            Refusal::Swap,
            Refusal::ReadOnly,
            Refusal::Unprobed("x".into()),
        ];
        assert!(lifted.iter().all(Refusal::wipe_lifts));
        assert!(!kept.iter().any(Refusal::wipe_lifts));
    }
}
