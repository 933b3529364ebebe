//! Claim: which of one node's disks a `StoragePool` takes, which it refuses and why,
//! and whether the pool's layout can be built from what it may take.
//!
//! Pure: it judges a pool's spec against facts about the node's disks gathered
//! elsewhere; building the pool is someone else's job, and nothing here touches a
//! device. What the user sees in `status.nodes[].rejected` is the `reason` text
//! produced here.

use std::collections::BTreeMap;
use std::fmt;

use castellan_crds::block_device::BlockDeviceState;
use castellan_crds::quantity::parse_bytes;
use castellan_crds::storage_pool::{Layout, RejectedDisk, StoragePoolSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};
use regex::Regex;

use crate::agent::disk::safety::{self, DeviceFacts, Refusal, Verdict};

/// One of the node's disks, as a pool sees it.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// The `BlockDevice` object's name.
    pub block_device: &'a str,
    pub path: &'a str,
    pub size_bytes: u64,
    pub state: Option<BlockDeviceState>,
    /// The pool that already claimed it, if any.
    pub pool: Option<&'a str>,
    pub facts: DeviceFacts<'a>,
}

impl Candidate<'_> {
    /// Whether a path a pool lists names this disk: its own path or one of udev's
    /// links to it (`/dev/disk/by-id/…`).
    fn is(&self, listed: &str) -> bool {
        self.path == listed || self.facts.links.iter().any(|link| link == listed)
    }
}

/// A disk the pool takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub block_device: String,
    pub path: String,
    pub size_bytes: u64,
    /// Already a member of this pool (so not judged again: its btrfs signature and
    /// mount are the pool's own).
    pub member: bool,
    /// What taking it destroys (non-empty only with `allowWipe`).
    pub wipe: Vec<Refusal>,
}

/// The decision for one pool on one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub claims: Vec<Claim>,
    pub rejected: Vec<RejectedDisk>,
    /// Members of this pool that are not attached now: the pool is degraded here.
    pub missing_members: Vec<String>,
    /// `Err` when the claimable disks cannot carry the layout.
    pub layout: Result<(), LayoutShortfall>,
}

/// A layout the node's disks cannot satisfy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutShortfall {
    pub layout: Layout,
    pub needed: usize,
    pub available: usize,
    pub rejected: usize,
}

impl fmt::Display for LayoutShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let noun = if self.available == 1 { "disk" } else { "disks" };
        write!(
            f,
            "layout {} needs at least {} disks, and {} {noun} can be claimed",
            layout_name(self.layout),
            self.needed,
            self.available
        )?;
        if self.rejected > 0 {
            write!(f, " ({} refused, see rejected)", self.rejected)?;
        }
        Ok(())
    }
}

fn layout_name(layout: Layout) -> &'static str {
    match layout {
        Layout::Single => "single",
        Layout::Raid1 => "raid1",
        Layout::Raid10 => "raid10",
    }
}

/// The fewest disks a layout can be built on: btrfs raid1 keeps two copies on two
/// devices; raid10 stripes mirrors and needs four.
pub fn min_disks(layout: Layout) -> usize {
    match layout {
        Layout::Single => 1,
        Layout::Raid1 => 2,
        Layout::Raid10 => 4,
    }
}

/// A spec the agent cannot apply; becomes a condition on the pool, not a retry.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpecError {
    #[error("devices.pathPattern {pattern:?} is not a valid regular expression: {message}")]
    PathPattern { pattern: String, message: String },
    #[error("devices.minSize {0:?} is not a quantity of bytes")]
    MinSize(String),
    #[error("nodeSelector: {0} (operators are In, NotIn, Exists and DoesNotExist)")]
    Selector(String),
}

/// Whether a node with `labels` is one of the pool's nodes (kube's `Selector`, with
/// Kubernetes' own semantics: `NotIn` and `DoesNotExist` match a missing label).
pub fn selects_node(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SpecError> {
    let Some(selector) = selector else {
        return Ok(true);
    };
    let parsed = Selector::try_from(selector.clone()).map_err(|error| {
        // kube's error does not say which expression it refused: name the operators.
        let operators: Vec<&str> = selector
            .match_expressions
            .iter()
            .flatten()
            .map(|expression| expression.operator.as_str())
            .collect();
        SpecError::Selector(format!("{error} (operators given: {operators:?})"))
    })?;
    Ok(parsed.matches(labels))
}

/// The pool a disk belongs to, as pool `pool` judges it. The filesystem is the truth
/// for an attached disk: carrying `pool`'s btrfs label makes it a member whatever its
/// status says, and a disk whose status names `pool` but that carries no label was
/// claimed and never built into it (a wipe or mkfs that failed halfway, a crash), so
/// it is judged afresh like any disk, never mounted as a member. A disk that is not
/// attached keeps what its status says: a missing member is still a member.
pub fn membership<'a>(
    pool: &'a str,
    attached: bool,
    carries_label: bool,
    status_pool: Option<&'a str>,
) -> Option<&'a str> {
    match (attached, carries_label) {
        (true, true) => Some(pool),
        (true, false) => status_pool.filter(|other| *other != pool),
        (false, _) => status_pool,
    }
}

/// Decides which of `candidates` (the node's disks) pool `pool` takes on `node`.
pub fn decide(
    pool: &str,
    spec: &StoragePoolSpec,
    node: &str,
    candidates: &[Candidate<'_>],
) -> Result<Decision, SpecError> {
    let filter = &spec.devices;
    let pattern = filter
        .path_pattern
        .as_deref()
        .map(|pattern| {
            Regex::new(pattern).map_err(|error| SpecError::PathPattern {
                pattern: pattern.to_string(),
                message: error.to_string(),
            })
        })
        .transpose()?;
    let min_size = filter
        .min_size
        .as_deref()
        .map(|size| parse_bytes(size).ok_or_else(|| SpecError::MinSize(size.to_string())))
        .transpose()?;
    let listed: Option<&[String]> = filter
        .nodes
        .iter()
        .find(|entry| entry.name == node)
        .map(|entry| entry.paths.as_slice());

    let mut decision = Decision {
        claims: Vec::new(),
        rejected: Vec::new(),
        missing_members: Vec::new(),
        layout: Ok(()),
    };
    let mut reject = |candidate: &Candidate<'_>, reason: String| {
        decision.rejected.push(RejectedDisk {
            block_device: Some(candidate.block_device.to_string()),
            path: candidate.path.to_string(),
            reason,
        });
    };
    let mut claims = Vec::new();
    let mut missing_members = Vec::new();

    for candidate in candidates {
        let named = listed.is_some_and(|paths| paths.iter().any(|path| candidate.is(path)));
        if listed.is_some() && !named {
            continue;
        }
        // A filter a disk fails leaves it alone silently, unless the user named the
        // disk explicitly: then they expect to hear why it was not taken.
        let filtered = if pattern
            .as_ref()
            .is_some_and(|pattern| !pattern.is_match(candidate.path))
        {
            Some("does not match devices.pathPattern".to_string())
        } else if min_size.is_some_and(|min| candidate.size_bytes < min) {
            Some(format!(
                "is smaller than devices.minSize ({} bytes < {})",
                candidate.size_bytes,
                filter.min_size.as_deref().unwrap_or_default()
            ))
        } else {
            None
        };
        if let Some(reason) = filtered {
            if named {
                reject(candidate, reason);
            }
            continue;
        }

        if candidate.pool == Some(pool) {
            if candidate.state == Some(BlockDeviceState::Missing) {
                missing_members.push(candidate.block_device.to_string());
            } else {
                claims.push(Claim {
                    block_device: candidate.block_device.to_string(),
                    path: candidate.path.to_string(),
                    size_bytes: candidate.size_bytes,
                    member: true,
                    wipe: Vec::new(),
                });
            }
            continue;
        }
        if let Some(other) = candidate.pool {
            reject(candidate, format!("is claimed by pool {other}"));
            continue;
        }
        match candidate.state {
            Some(BlockDeviceState::Missing) => {
                reject(candidate, "is not attached (Missing)".to_string());
                continue;
            }
            Some(BlockDeviceState::Failed) => {
                reject(candidate, "has failed".to_string());
                continue;
            }
            _ => {}
        }
        if candidate.facts.removable && !named {
            reject(
                candidate,
                "is removable media: a pool takes it only when devices.nodes[].paths lists it"
                    .to_string(),
            );
            continue;
        }
        match safety::judge(&candidate.facts, filter.allow_wipe) {
            Verdict::Claimable { wipe } => claims.push(Claim {
                block_device: candidate.block_device.to_string(),
                path: candidate.path.to_string(),
                size_bytes: candidate.size_bytes,
                member: false,
                wipe,
            }),
            Verdict::Refused(reasons) => {
                let mut reason = safety::join(&reasons);
                if reasons.iter().all(Refusal::wipe_lifts) {
                    reason.push_str(" (allowWipe is off)");
                }
                reject(candidate, reason);
            }
        }
    }

    for path in listed.unwrap_or_default() {
        if !candidates.iter().any(|candidate| candidate.is(path)) {
            decision.rejected.push(RejectedDisk {
                block_device: None,
                path: path.clone(),
                reason: format!("no such disk on node {node}"),
            });
        }
    }

    let needed = min_disks(spec.layout);
    if claims.len() < needed {
        decision.layout = Err(LayoutShortfall {
            layout: spec.layout,
            needed,
            available: claims.len(),
            rejected: decision.rejected.len(),
        });
    }
    decision.claims = claims;
    decision.missing_members = missing_members;
    Ok(decision)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use crate::agent::disk::probe::{Signature, SignatureKind};
    use castellan_crds::storage_pool::{
        DeviceFilter, NodeDevices, PoolStorageClass, ReclaimPolicy,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    const GIB: u64 = 1 << 30;

    fn spec(layout: Layout, devices: DeviceFilter) -> StoragePoolSpec {
        StoragePoolSpec {
            node_selector: None,
            devices,
            layout,
            storage_class: PoolStorageClass {
                name: "fast".into(),
                reclaim_policy: ReclaimPolicy::Delete,
                default: false,
            },
            scrub: None,
        }
    }

    fn clean<'a>(name: &'a str, path: &'a str) -> Candidate<'a> {
        Candidate {
            block_device: name,
            path,
            size_bytes: 10 * GIB,
            state: Some(BlockDeviceState::Unclaimed),
            pool: None,
            facts: DeviceFacts::default(),
        }
    }

    fn ext4_signature() -> Vec<Signature> {
        vec![Signature {
            name: "ext4".into(),
            kind: SignatureKind::Filesystem,
            uuid: None,
            device_uuid: None,
            label: None,
        }]
    }

    fn gpt_signature() -> Vec<Signature> {
        vec![Signature {
            name: "gpt".into(),
            kind: SignatureKind::PartitionTable,
            uuid: None,
            device_uuid: None,
            label: None,
        }]
    }

    fn names(decision: &Decision) -> Vec<&str> {
        decision
            .claims
            .iter()
            .map(|claim| claim.block_device.as_str())
            .collect()
    }

    fn reasons(decision: &Decision) -> Vec<(String, String)> {
        decision
            .rejected
            .iter()
            .map(|r| (r.path.clone(), r.reason.clone()))
            .collect()
    }

    #[test]
    fn raid1_claims_exactly_the_clean_disks_and_names_the_others() {
        let ext4 = ext4_signature();
        let gpt = gpt_signature();
        let disks = [
            clean("a", "/dev/loop0"),
            clean("b", "/dev/loop1"),
            Candidate {
                facts: DeviceFacts {
                    signatures: &ext4,
                    ..Default::default()
                },
                ..clean("c", "/dev/loop2")
            },
            Candidate {
                facts: DeviceFacts {
                    signatures: &gpt,
                    ..Default::default()
                },
                ..clean("d", "/dev/loop3")
            },
        ];
        let decision = decide(
            "p",
            &spec(Layout::Raid1, DeviceFilter::default()),
            "n1",
            &disks,
        )
        .unwrap();
        assert_eq!(names(&decision), ["a", "b"]);
        assert_eq!(
            reasons(&decision),
            [
                (
                    "/dev/loop2".into(),
                    "has an ext4 filesystem (allowWipe is off)".into()
                ),
                (
                    "/dev/loop3".into(),
                    "has a partition table (gpt) (allowWipe is off)".into()
                ),
            ]
        );
        assert_eq!(decision.rejected[0].block_device.as_deref(), Some("c"));
        assert_eq!(decision.layout, Ok(()));

        let wipe = DeviceFilter {
            allow_wipe: true,
            ..Default::default()
        };
        let decision = decide("p", &spec(Layout::Raid1, wipe), "n1", &disks).unwrap();
        assert_eq!(names(&decision), ["a", "b", "c", "d"]);
        assert_eq!(
            decision.claims[2].wipe,
            [Refusal::Filesystem("ext4".into())]
        );
        assert!(decision.rejected.is_empty());
    }

    #[test]
    fn use_by_the_host_is_refused_even_with_wipe_and_without_the_wipe_hint() {
        let ext4 = ext4_signature();
        let mounts = ["/data".to_string()];
        let disks = [Candidate {
            facts: DeviceFacts {
                signatures: &ext4,
                mount_points: &mounts,
                ..Default::default()
            },
            ..clean("a", "/dev/sda")
        }];
        let wipe = DeviceFilter {
            allow_wipe: true,
            ..Default::default()
        };
        let decision = decide("p", &spec(Layout::Single, wipe), "n1", &disks).unwrap();
        assert_eq!(
            reasons(&decision),
            [(
                "/dev/sda".into(),
                "is mounted at /data; has an ext4 filesystem".into()
            )]
        );
        assert_eq!(
            decision.layout.unwrap_err().to_string(),
            "layout single needs at least 1 disks, and 0 disks can be claimed (1 refused, see rejected)"
        );
    }

    #[test]
    fn layouts_need_their_disk_counts() {
        assert_eq!(
            (
                min_disks(Layout::Single),
                min_disks(Layout::Raid1),
                min_disks(Layout::Raid10)
            ),
            (1, 2, 4)
        );
        let one = [clean("a", "/dev/sda")];
        let decision = decide(
            "p",
            &spec(Layout::Raid1, DeviceFilter::default()),
            "n1",
            &one,
        )
        .unwrap();
        let shortfall = decision.layout.unwrap_err();
        assert_eq!(
            shortfall,
            LayoutShortfall {
                layout: Layout::Raid1,
                needed: 2,
                available: 1,
                rejected: 0
            }
        );
        assert_eq!(
            shortfall.to_string(),
            "layout raid1 needs at least 2 disks, and 1 disk can be claimed"
        );

        let three = [
            clean("a", "/dev/sda"),
            clean("b", "/dev/sdb"),
            clean("c", "/dev/sdc"),
        ];
        let decision = decide(
            "p",
            &spec(Layout::Raid10, DeviceFilter::default()),
            "n1",
            &three,
        )
        .unwrap();
        assert_eq!(decision.layout.unwrap_err().needed, 4);
        let four = [
            clean("a", "/dev/sda"),
            clean("b", "/dev/sdb"),
            clean("c", "/dev/sdc"),
            clean("d", "/dev/sdd"),
        ];
        let decision = decide(
            "p",
            &spec(Layout::Raid10, DeviceFilter::default()),
            "n1",
            &four,
        )
        .unwrap();
        assert_eq!(decision.layout, Ok(()));
        assert!(
            decide(
                "p",
                &spec(Layout::Single, DeviceFilter::default()),
                "n1",
                &one
            )
            .unwrap()
            .layout
            .is_ok()
        );
    }

    #[test]
    fn filters_leave_disks_alone_silently() {
        let disks = [
            clean("a", "/dev/sda"),
            clean("b", "/dev/sdb"),
            Candidate {
                size_bytes: GIB,
                ..clean("c", "/dev/sdc")
            },
        ];
        let filter = DeviceFilter {
            path_pattern: Some("^/dev/sd[b-z]$".into()),
            min_size: Some("2Gi".into()),
            ..Default::default()
        };
        let decision = decide("p", &spec(Layout::Single, filter), "n1", &disks).unwrap();
        assert_eq!(names(&decision), ["b"]);
        assert!(decision.rejected.is_empty());
    }

    #[test]
    fn an_explicit_list_limits_the_node_and_explains_every_named_disk() {
        let disks = [
            clean("a", "/dev/sda"),
            clean("b", "/dev/sdb"),
            Candidate {
                size_bytes: GIB,
                ..clean("c", "/dev/sdc")
            },
            clean("d", "/dev/vdd"),
        ];
        let filter = DeviceFilter {
            path_pattern: Some("^/dev/sd".into()),
            min_size: Some("2Gi".into()),
            nodes: vec![
                NodeDevices {
                    name: "n1".into(),
                    paths: vec![
                        "/dev/sdb".into(),
                        "/dev/sdc".into(),
                        "/dev/vdd".into(),
                        "/dev/sdz".into(),
                    ],
                },
                NodeDevices {
                    name: "n2".into(),
                    paths: vec!["/dev/sda".into()],
                },
            ],
            allow_wipe: false,
        };
        let decision = decide("p", &spec(Layout::Single, filter.clone()), "n1", &disks).unwrap();
        assert_eq!(names(&decision), ["b"]);
        assert_eq!(
            reasons(&decision),
            [
                (
                    "/dev/sdc".into(),
                    format!("is smaller than devices.minSize ({GIB} bytes < 2Gi)")
                ),
                (
                    "/dev/vdd".into(),
                    "does not match devices.pathPattern".into()
                ),
                ("/dev/sdz".into(), "no such disk on node n1".into()),
            ]
        );
        assert_eq!(decision.rejected[2].block_device, None);

        // A node the list does not name is judged by the other filters alone.
        let decision = decide("p", &spec(Layout::Single, filter), "n3", &disks).unwrap();
        assert_eq!(names(&decision), ["a", "b"]);
    }

    #[test]
    fn a_claimed_disk_is_a_member_only_once_it_carries_the_pools_filesystem() {
        // Attached with the label: a member, whatever the status says (a crash between
        // mkfs and the status write).
        assert_eq!(membership("p", true, true, None), Some("p"));
        assert_eq!(membership("p", true, true, Some("q")), Some("p"));
        // Claimed by p but its mkfs failed: judged afresh, not mounted.
        assert_eq!(membership("p", true, false, Some("p")), None);
        // Another pool's claim stands until that pool says otherwise.
        assert_eq!(membership("p", true, false, Some("q")), Some("q"));
        assert_eq!(membership("p", true, false, None), None);
        // Not attached: its status is all there is (a missing member).
        assert_eq!(membership("p", false, false, Some("p")), Some("p"));
        assert_eq!(membership("p", false, false, None), None);
    }

    #[test]
    fn a_disk_is_listed_by_a_udev_link_as_well_as_by_its_path() {
        let links = ["/dev/disk/by-id/wwn-0x5000c500a0b1c2d3".to_string()];
        let disks = [
            Candidate {
                facts: DeviceFacts {
                    links: &links,
                    ..Default::default()
                },
                ..clean("a", "/dev/sdb")
            },
            clean("b", "/dev/sdc"),
        ];
        let filter = DeviceFilter {
            nodes: vec![NodeDevices {
                name: "n1".into(),
                paths: vec![
                    "/dev/disk/by-id/wwn-0x5000c500a0b1c2d3".into(),
                    "/dev/disk/by-id/gone".into(),
                ],
            }],
            ..Default::default()
        };
        let decision = decide("p", &spec(Layout::Single, filter), "n1", &disks).unwrap();
        assert_eq!(names(&decision), ["a"]);
        // The claim names the disk by its path; the link that names nothing is reported
        // as the user wrote it.
        assert_eq!(decision.claims[0].path, "/dev/sdb");
        assert_eq!(
            reasons(&decision),
            [(
                "/dev/disk/by-id/gone".into(),
                "no such disk on node n1".into()
            )]
        );
    }

    #[test]
    fn removable_media_are_taken_only_when_listed() {
        let disks = [
            Candidate {
                facts: DeviceFacts {
                    removable: true,
                    ..Default::default()
                },
                ..clean("stick", "/dev/sdx")
            },
            clean("disk", "/dev/sdb"),
        ];
        let unlisted = decide(
            "p",
            &spec(Layout::Single, DeviceFilter::default()),
            "n1",
            &disks,
        )
        .unwrap();
        assert_eq!(names(&unlisted), ["disk"]);
        assert_eq!(
            reasons(&unlisted),
            [(
                "/dev/sdx".into(),
                "is removable media: a pool takes it only when devices.nodes[].paths lists it"
                    .into()
            )]
        );
        // A pattern that matches it is not enough: it must be named.
        let pattern = DeviceFilter {
            path_pattern: Some("^/dev/sd".into()),
            ..Default::default()
        };
        let by_pattern = decide("p", &spec(Layout::Single, pattern), "n1", &disks).unwrap();
        assert_eq!(names(&by_pattern), ["disk"]);
        let listed = DeviceFilter {
            nodes: vec![NodeDevices {
                name: "n1".into(),
                paths: vec!["/dev/sdx".into()],
            }],
            ..Default::default()
        };
        let listed = decide("p", &spec(Layout::Single, listed), "n1", &disks).unwrap();
        assert_eq!(names(&listed), ["stick"]);
    }

    #[test]
    fn members_other_pools_missing_and_failed_disks() {
        let ext4 = ext4_signature();
        let disks = [
            // A member carries the pool's own filesystem: not judged again.
            Candidate {
                pool: Some("p"),
                state: Some(BlockDeviceState::InUse),
                facts: DeviceFacts {
                    signatures: &ext4,
                    ..Default::default()
                },
                ..clean("a", "/dev/sda")
            },
            Candidate {
                pool: Some("p"),
                state: Some(BlockDeviceState::Missing),
                ..clean("b", "/dev/sdb")
            },
            Candidate {
                pool: Some("other"),
                state: Some(BlockDeviceState::InUse),
                ..clean("c", "/dev/sdc")
            },
            Candidate {
                state: Some(BlockDeviceState::Missing),
                ..clean("d", "/dev/sdd")
            },
            Candidate {
                state: Some(BlockDeviceState::Failed),
                ..clean("e", "/dev/sde")
            },
        ];
        let decision = decide(
            "p",
            &spec(Layout::Raid1, DeviceFilter::default()),
            "n1",
            &disks,
        )
        .unwrap();
        assert_eq!(names(&decision), ["a"]);
        assert!(decision.claims[0].member);
        assert_eq!(decision.missing_members, ["b"]);
        assert_eq!(
            reasons(&decision),
            [
                ("/dev/sdc".into(), "is claimed by pool other".into()),
                ("/dev/sdd".into(), "is not attached (Missing)".into()),
                ("/dev/sde".into(), "has failed".into()),
            ]
        );
        assert_eq!(decision.layout.unwrap_err().available, 1);
    }

    #[test]
    fn bad_filters_are_spec_errors() {
        let filter = DeviceFilter {
            path_pattern: Some("(".into()),
            ..Default::default()
        };
        assert!(matches!(
            decide("p", &spec(Layout::Single, filter), "n", &[]),
            Err(SpecError::PathPattern { .. })
        ));
        let filter = DeviceFilter {
            min_size: Some("lots".into()),
            ..Default::default()
        };
        assert_eq!(
            decide("p", &spec(Layout::Single, filter), "n", &[]).unwrap_err(),
            SpecError::MinSize("lots".into())
        );
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn requirement(key: &str, operator: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: operator.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn node_selectors_match_labels_and_expressions() {
        let node = labels(&[("disk", "ssd"), ("zone", "a")]);
        assert_eq!(selects_node(None, &node), Ok(true));
        let by_labels = LabelSelector {
            match_labels: Some(labels(&[("disk", "ssd")])),
            match_expressions: None,
        };
        assert_eq!(selects_node(Some(&by_labels), &node), Ok(true));
        assert_eq!(
            selects_node(Some(&by_labels), &labels(&[("disk", "hdd")])),
            Ok(false)
        );

        let cases = [
            (requirement("zone", "In", &["a", "b"]), true),
            (requirement("zone", "In", &["c"]), false),
            (requirement("zone", "NotIn", &["c"]), true),
            (requirement("zone", "NotIn", &["a"]), false),
            (requirement("rack", "NotIn", &["a"]), true),
            (requirement("zone", "Exists", &[]), true),
            (requirement("rack", "Exists", &[]), false),
            (requirement("rack", "DoesNotExist", &[]), true),
            (requirement("zone", "DoesNotExist", &[]), false),
        ];
        for (expression, expected) in cases {
            let selector = LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![expression.clone()]),
            };
            assert_eq!(
                selects_node(Some(&selector), &node),
                Ok(expected),
                "{expression:?}"
            );
        }
        let bad = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![requirement("zone", "Gt", &["1"])]),
        };
        let refused = selects_node(Some(&bad), &node).unwrap_err();
        assert!(
            matches!(&refused, SpecError::Selector(message) if message.contains("Gt")),
            "{refused}"
        );
    }
}
