//! Pool: what one node must do to make its part of a `StoragePool` real, and what to
//! report about it.
//!
//! Pure. From the claim decision (`claim`) and what the node's btrfs looks like now
//! (`Filesystem`), `plan` lists the steps — wipe, mkfs, mount, enable quotas, add
//! devices, rebalance — and `node_status` turns the result into the node's entry of
//! `status.nodes`. The shell (`pools`) runs the steps and writes the objects; nothing
//! here runs a command or talks to the API server.
//!
//! The filesystem is the truth about membership: a disk carrying the pool's btrfs label
//! is a member even if its `BlockDevice` lost `status.pool`, so a crash between mkfs
//! and the status write never turns the pool's own disks into "dirty" ones.

use std::time::Duration;

use castellan_crds::block_device::BlockDeviceState;
use castellan_crds::storage_pool::{
    Layout, PoolDisk, PoolNodeStatus, PoolReplacement, RejectedDisk,
};

use super::claim::{Claim, Decision, LayoutShortfall};
use crate::agent::btrfs::{self, DeviceErrors, Show, Usage};

/// The node's btrfs for the pool, as found before planning.
#[derive(Clone, Debug, PartialEq)]
pub enum Filesystem {
    /// No disk carries it and nothing is mounted: build it.
    Absent,
    /// Members exist (claims with `member`) but the mount point is not mounted.
    Unmounted,
    /// Mounted; what `btrfs filesystem show` says.
    Mounted(Show),
}

/// One thing to do on the node, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `wipefs --all <path>`: only for a disk claimed with `allowWipe` that had
    /// signatures (never mounted, held or holding `/`: `safety` refuses those always),
    /// and only if the disk at `path` is still `block_device` when it runs.
    Wipe { path: String, block_device: String },
    /// `mkfs.btrfs <args>` (without `--force`).
    Mkfs(Vec<String>),
    /// `btrfs device scan <devices>`, then mount the first at the pool's mount point,
    /// with `-o degraded` when a member is missing.
    Mount {
        devices: Vec<String>,
        degraded: bool,
    },
    /// `btrfs quota enable <mount point>` (idempotent).
    EnableQuota,
    /// `btrfs device add <paths> <mount point>`.
    AddDevices(Vec<String>),
    /// `btrfs balance start --bg -dconvert=<data>,soft -mconvert=<metadata>,soft`: the
    /// profiles for the new disk count, converting only what is not already in them.
    Balance {
        data: &'static str,
        metadata: &'static str,
    },
    /// `btrfs filesystem resize <devid>:max <mount point>`: a replacement larger than
    /// the disk it replaced is used whole.
    Resize { devid: u64 },
    /// `btrfs replace start -B -r <devid> <path> <mount point>`, left running in the
    /// background: the failed member is copied onto the disk at `path` (from
    /// the layout's other copies, reading the failed one only where no other exists),
    /// which then takes its place. Only if the disk at `path` is still `block_device`.
    Replace {
        failed: FailedMember,
        path: String,
        block_device: String,
    },
}

/// A member to replace: btrfs counts errors on it, or it has been missing for longer
/// than the grace period.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedMember {
    /// btrfs's device id, by which `btrfs replace` names it (a failed disk's superblock
    /// may be gone, and a missing one has no path).
    pub devid: u64,
    /// A replacement must be at least this large.
    pub size_bytes: u64,
    /// How status and Events name it: its path or `BlockDevice`.
    pub name: String,
}

/// What the pool must repair on this node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Repair {
    pub failed: Vec<FailedMember>,
    /// A replacement failed a moment ago: wait before trying again.
    pub hold: bool,
}

/// The failed members of the mounted filesystem `show`: those btrfs counts errors on
/// (`failing`, by path) and the devices it lists as missing, once every missing member
/// is past the grace period (`missing_failed`, BlockDevice names and sizes) — which
/// missing device id is which disk is not known, so none is replaced before all count
/// as failed.
pub fn failed_members(
    show: &Show,
    failing: &[(String, DeviceErrors)],
    missing_failed: &[(String, u64)],
) -> Vec<FailedMember> {
    let mut failed: Vec<FailedMember> = failing
        .iter()
        .filter_map(|(path, _)| {
            let device = show
                .devices
                .iter()
                .find(|device| device.path.as_deref() == Some(path.as_str()))?;
            Some(FailedMember {
                devid: device.devid,
                size_bytes: device.size_bytes,
                name: path.clone(),
            })
        })
        .collect();
    let missing: Vec<u64> = show
        .devices
        .iter()
        .filter(|device| device.path.is_none())
        .map(|device| device.devid)
        .collect();
    if !missing.is_empty() && missing_failed.len() >= missing.len() {
        let size_bytes = missing_failed
            .iter()
            .map(|(_, size)| *size)
            .max()
            .unwrap_or(0);
        let names: Vec<&str> = missing_failed
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        for devid in missing {
            failed.push(FailedMember {
                devid,
                size_bytes,
                name: if missing_failed.len() == 1 {
                    names.join(", ")
                } else {
                    format!("missing devid {devid}")
                },
            });
        }
    }
    failed
}

/// Why nothing is built on this node (yet).
#[derive(Clone, Debug, PartialEq)]
pub enum Blocked {
    /// The claimable disks cannot carry the layout.
    Shortfall(LayoutShortfall),
    /// Every member of the node's pool is missing (these BlockDevices): the pool's data
    /// is on them, so no new filesystem is built on other disks. Re-attaching them
    /// brings the pool back; deleting their BlockDevices gives that data up.
    MembersMissing(Vec<String>),
}

/// The steps that bring the node's pool to what `decision` says.
pub fn plan(
    pool: &str,
    layout: Layout,
    decision: &Decision,
    filesystem: &Filesystem,
    repair: &Repair,
) -> Result<Vec<Step>, Blocked> {
    let members: Vec<&Claim> = decision.claims.iter().filter(|c| c.member).collect();
    let wipes = |claims: &[&Claim]| -> Vec<Step> {
        claims
            .iter()
            .filter(|claim| !claim.wipe.is_empty())
            .map(|claim| Step::Wipe {
                path: claim.path.clone(),
                block_device: claim.block_device.clone(),
            })
            .collect()
    };
    match filesystem {
        Filesystem::Absent if members.is_empty() => {
            // A node that had the pool and lost every disk of it (a reboot without
            // them, a cable): building anew on other disks would bring the pool back
            // empty under volumes that had data. Wait for them, or for the user to
            // give them up.
            if !decision.missing_members.is_empty() {
                return Err(Blocked::MembersMissing(decision.missing_members.clone()));
            }
            decision.layout.clone().map_err(Blocked::Shortfall)?;
            let claims: Vec<&Claim> = decision.claims.iter().collect();
            let paths: Vec<&str> = claims.iter().map(|claim| claim.path.as_str()).collect();
            let args = btrfs::mkfs_args(pool, layout, &paths).map_err(Blocked::Shortfall)?;
            let mut steps = wipes(&claims);
            steps.push(Step::Mkfs(args));
            steps.push(Step::Mount {
                devices: paths.iter().map(|path| path.to_string()).collect(),
                degraded: false,
            });
            steps.push(Step::EnableQuota);
            Ok(steps)
        }
        // Members carry the filesystem but the plan was told it is absent: treat as
        // unmounted, never mkfs over them.
        Filesystem::Absent | Filesystem::Unmounted => {
            if members.is_empty() {
                return Ok(Vec::new());
            }
            // New disks join on the next pass, once the mount shows what is in it.
            Ok(vec![
                Step::Mount {
                    devices: members.iter().map(|claim| claim.path.clone()).collect(),
                    degraded: !decision.missing_members.is_empty(),
                },
                Step::EnableQuota,
            ])
        }
        Filesystem::Mounted(show) => {
            // A replacement under way (its new disk is listed as devid 0): btrfs runs
            // one such operation at a time, and it ends on its own.
            if show.devices.iter().any(|device| device.devid == 0) {
                return Ok(Vec::new());
            }
            // A member claim the filesystem does not list carries the label of an old
            // copy of it (a replaced disk whose superblock survived): never added back.
            let joining: Vec<&Claim> = decision
                .claims
                .iter()
                .filter(|claim| {
                    !claim.member
                        && !show
                            .devices
                            .iter()
                            .any(|device| device.path.as_deref() == Some(claim.path.as_str()))
                })
                .collect();
            // While a member has failed, a new disk replaces it rather than growing
            // the pool; one too small waits, unused.
            if let Some(failed) = repair.failed.first() {
                let target = joining
                    .iter()
                    .find(|claim| claim.size_bytes >= failed.size_bytes);
                let (Some(target), false) = (target, repair.hold) else {
                    return Ok(Vec::new());
                };
                let mut steps = wipes(&[*target]);
                steps.push(Step::Replace {
                    failed: failed.clone(),
                    path: target.path.clone(),
                    block_device: target.block_device.clone(),
                });
                return Ok(steps);
            }
            if joining.is_empty() {
                return Ok(Vec::new());
            }
            let mut steps = wipes(&joining);
            steps.push(Step::AddDevices(
                joining.iter().map(|claim| claim.path.clone()).collect(),
            ));
            let present = show.devices.iter().filter(|d| d.path.is_some()).count();
            let (data, metadata) = btrfs::profiles(layout, present + joining.len());
            steps.push(Step::Balance { data, metadata });
            Ok(steps)
        }
    }
}

/// A claimed disk's `BlockDevice` as the pool pass finds it: name, state, pool.
pub type DeviceState<'a> = (&'a str, Option<BlockDeviceState>, Option<&'a str>);

/// The BlockDevices to mark `Claimed` before `steps` run: the disks about to join
/// (not yet members) that do not say so already. Nothing when nothing will run, so a
/// pool that cannot be built leaves its candidates `Unclaimed`.
pub fn to_mark_claimed(
    pool: &str,
    decision: &Decision,
    steps: &[Step],
    current: &[DeviceState<'_>],
) -> Vec<String> {
    if steps.is_empty() {
        return Vec::new();
    }
    decision
        .claims
        .iter()
        .filter(|claim| !claim.member)
        .filter(|claim| {
            !current.iter().any(|(name, state, owner)| {
                *name == claim.block_device
                    && matches!(
                        state,
                        Some(BlockDeviceState::Claimed | BlockDeviceState::InUse)
                    )
                    && *owner == Some(pool)
            })
        })
        .map(|claim| claim.block_device.clone())
        .collect()
}

/// The BlockDevices to mark `InUse` after the steps: every claim the mounted
/// filesystem lists that does not say `InUse` by this pool already (idempotent). A
/// claim the filesystem does not list (a failed `device add`) stays `Claimed`.
pub fn to_mark_in_use(
    pool: &str,
    decision: &Decision,
    show: Option<&Show>,
    failing: &[(String, DeviceErrors)],
    current: &[DeviceState<'_>],
) -> Vec<String> {
    let Some(show) = show else {
        return Vec::new();
    };
    decision
        .claims
        .iter()
        .filter(|claim| {
            show.devices
                .iter()
                .any(|device| device.path.as_deref() == Some(claim.path.as_str()))
        })
        // A failing member is reported `Failed`, not put back `InUse`.
        .filter(|claim| !failing.iter().any(|(path, _)| path == &claim.path))
        .filter(|claim| {
            !current.iter().any(|(name, state, owner)| {
                *name == claim.block_device
                    && *state == Some(BlockDeviceState::InUse)
                    && *owner == Some(pool)
            })
        })
        .map(|claim| claim.block_device.clone())
        .collect()
}

pub use castellan_crds::storage_pool::{DEGRADED, FAILED, HEALTHY, PENDING};

/// What the node's pool looks like after the steps ran (or failed).
#[derive(Clone, Debug, Default)]
pub struct Outcome<'a> {
    /// `btrfs filesystem show` of the mounted pool, if mounted.
    pub show: Option<&'a Show>,
    pub usage: Option<&'a Usage>,
    /// Why nothing was built.
    pub blocked: Option<&'a Blocked>,
    /// The first step that failed, with its error.
    pub error: Option<&'a str>,
    /// Bytes promised to volumes (no volumes yet: 0).
    pub allocated_bytes: u64,
    /// Members whose btrfs error counters are above zero, by path.
    pub failing: &'a [(String, DeviceErrors)],
    /// Missing members (BlockDevice names) missing for longer than the grace period:
    /// they count as failed.
    pub missing_failed: &'a [String],
    /// The members to replace (failing or missing past the grace period).
    pub failed: &'a [FailedMember],
    /// A replacement that is running.
    pub replacement: Option<&'a PoolReplacement>,
    /// Why the last replacement failed.
    pub replace_error: Option<&'a str>,
}

/// Whether a member missing for `missing` counts as failed after `grace`: `Ok`, or how
/// long is left.
pub fn missing_verdict(missing: Duration, grace: Duration) -> Result<(), Duration> {
    if missing >= grace {
        Ok(())
    } else {
        Err(grace - missing)
    }
}

/// The node's entry of `status.nodes`.
pub fn node_status(
    node: &str,
    decision: &Decision,
    missing_paths: &[(String, String)],
    outcome: &Outcome<'_>,
) -> PoolNodeStatus {
    let mut disks: Vec<PoolDisk> = Vec::new();
    if let Some(show) = outcome.show {
        for device in &show.devices {
            let Some(path) = &device.path else { continue };
            let claim = decision.claims.iter().find(|claim| &claim.path == path);
            let failing = outcome.failing.iter().any(|(failing, _)| failing == path);
            let state = if device.devid == 0 {
                "Replacing"
            } else if failing {
                "Failing"
            } else {
                "Online"
            };
            disks.push(PoolDisk {
                block_device: claim
                    .map(|claim| claim.block_device.clone())
                    .unwrap_or_default(),
                path: path.clone(),
                size_bytes: i64::try_from(device.size_bytes).unwrap_or(i64::MAX),
                state: Some(state.into()),
            });
        }
    }
    // A missing member keeps its entry, at its last path unless another disk has
    // taken that path since (list-map keys must be unique).
    for (block_device, path) in missing_paths {
        if disks.iter().any(|disk| &disk.path == path) {
            continue;
        }
        let failed = outcome.missing_failed.contains(block_device);
        disks.push(PoolDisk {
            block_device: block_device.clone(),
            path: path.clone(),
            size_bytes: 0,
            state: Some(if failed { "Failed" } else { "Missing" }.into()),
        });
    }
    let mut rejected: Vec<RejectedDisk> = Vec::new();
    for disk in &decision.rejected {
        if !rejected.iter().any(|r| r.path == disk.path)
            && !disks.iter().any(|d| d.path == disk.path)
        {
            rejected.push(disk.clone());
        }
    }

    let missing = outcome
        .show
        .map(Show::missing)
        .unwrap_or_default()
        .max(missing_paths.len());
    let (health, message) = if let Some(error) = outcome.error {
        (FAILED, Some(error.to_string()))
    } else if let Some(Blocked::Shortfall(shortfall)) = outcome.blocked {
        (PENDING, Some(format!("no filesystem built: {shortfall}")))
    } else if let Some(Blocked::MembersMissing(members)) = outcome.blocked {
        let (count, noun) = match members.len() {
            1 => ("its only member".to_string(), "it"),
            n => (format!("all {n} of its members"), "them"),
        };
        (
            FAILED,
            Some(format!(
                "{count} on this node {} missing ({}) and the pool's data is on {noun}: \
                 no new filesystem is built on other disks; re-attach {noun}, or delete \
                 {} BlockDevice{} to give that data up and build the pool anew",
                if members.len() == 1 { "is" } else { "are" },
                members.join(", "),
                if members.len() == 1 { "its" } else { "their" },
                if members.len() == 1 { "" } else { "s" },
            )),
        )
    } else if outcome.show.is_none() {
        (PENDING, Some("no disk claimed yet".to_string()))
    } else if let Some(replacement) = outcome.replacement {
        (
            DEGRADED,
            Some(format!(
                "replacing {} by {} ({}): {} copied",
                replacement.failed,
                replacement.path,
                replacement.block_device,
                replacement.progress.as_deref().unwrap_or("nothing yet")
            )),
        )
    } else if missing > 0 {
        let names: Vec<&str> = missing_paths
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        let noun = if missing == 1 { "disk is" } else { "disks are" };
        let which = if names.is_empty() {
            String::new()
        } else {
            format!(" ({})", names.join(", "))
        };
        let failed = if outcome.missing_failed.is_empty() {
            String::new()
        } else {
            format!(
                "; missing for longer than the grace period, so counted as failed: {} (replace it)",
                outcome.missing_failed.join(", ")
            )
        };
        (
            DEGRADED,
            Some(format!(
                "{missing} {noun} missing{which}; mounted degraded, data stays readable while the layout keeps a copy{failed}"
            )),
        )
    } else if !outcome.failing.is_empty() {
        let which: Vec<String> = outcome
            .failing
            .iter()
            .map(|(path, errors)| format!("{path} ({errors})"))
            .collect();
        let noun = if which.len() == 1 {
            "disk reports"
        } else {
            "disks report"
        };
        (
            DEGRADED,
            Some(format!(
                "{} {noun} I/O or checksum errors: {}; reads are served from the layout's other copy where it keeps one; replace the disk",
                which.len(),
                which.join(", ")
            )),
        )
    } else {
        (HEALTHY, None)
    };
    let message = message.map(|message| match (outcome.failed.first(), health) {
        (Some(failed), DEGRADED) if outcome.replacement.is_none() => {
            let attempt = outcome
                .replace_error
                .map(|error| format!("; the last replacement failed: {error}"))
                .unwrap_or_default();
            format!(
                "{message}; a clean disk of at least {} bytes that the pool's device filter selects on this node replaces {}{attempt}",
                failed.size_bytes, failed.name
            )
        }
        _ => message,
    });
    let capacity = outcome.usage.map(Usage::usable_bytes);
    let to_i64 = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
    PoolNodeStatus {
        node: node.to_string(),
        health: Some(health.to_string()),
        message,
        capacity_bytes: capacity.map(to_i64),
        allocated_bytes: capacity.map(|_| to_i64(outcome.allocated_bytes)),
        free_bytes: capacity
            .map(|capacity| to_i64(capacity.saturating_sub(outcome.allocated_bytes))),
        disks,
        rejected,
        replacement: outcome.replacement.cloned(),
        // The shell's: it carries the scrub schedule from pass to pass.
        scrub: None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use crate::agent::btrfs::ShowDevice;
    use crate::agent::disk::safety::Refusal;

    fn claim(name: &str, path: &str, member: bool, wipe: bool) -> Claim {
        Claim {
            block_device: name.into(),
            path: path.into(),
            size_bytes: 1 << 30,
            member,
            wipe: if wipe {
                vec![Refusal::Filesystem("ext4".into())]
            } else {
                vec![]
            },
        }
    }

    fn decision(
        claims: Vec<Claim>,
        missing: &[&str],
        layout: Result<(), LayoutShortfall>,
    ) -> Decision {
        Decision {
            claims,
            rejected: vec![],
            missing_members: missing.iter().map(|m| m.to_string()).collect(),
            layout,
        }
    }

    /// The plan for pool `p` with nothing of its filesystem found and nothing to repair.
    fn plan_absent(layout: Layout, decision: &Decision) -> Result<Vec<Step>, Blocked> {
        plan(
            "p",
            layout,
            decision,
            &Filesystem::Absent,
            &Repair::default(),
        )
    }

    /// The node's entry when nothing was built, for `blocked`.
    fn blocked_status(
        decision: &Decision,
        missing_paths: &[(String, String)],
        blocked: &Blocked,
    ) -> PoolNodeStatus {
        node_status(
            "n1",
            decision,
            missing_paths,
            &Outcome {
                blocked: Some(blocked),
                ..Default::default()
            },
        )
    }

    fn show(paths: &[Option<&str>]) -> Show {
        Show {
            label: Some("castellan-p".into()),
            uuid: "u".into(),
            total_devices: paths.len(),
            devices: paths
                .iter()
                .enumerate()
                .map(|(i, path)| ShowDevice {
                    devid: i as u64 + 1,
                    size_bytes: if path.is_some() { 1 << 30 } else { 0 },
                    used_bytes: 0,
                    path: path.map(Into::into),
                })
                .collect(),
        }
    }

    fn usage() -> Usage {
        Usage {
            device_size_bytes: 2 << 30,
            device_missing_bytes: 0,
            used_bytes: 0,
            free_estimated_bytes: 1 << 30,
            data_ratio: 2.0,
        }
    }

    #[test]
    fn absent_builds_wiping_only_dirty_claims_then_mounts_and_enables_quotas() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", false, false),
                claim("b", "/dev/l1", false, true),
            ],
            &[],
            Ok(()),
        );
        let steps = plan(
            "p",
            Layout::Raid1,
            &d,
            &Filesystem::Absent,
            &Repair::default(),
        )
        .unwrap();
        assert_eq!(
            steps,
            [
                Step::Wipe {
                    path: "/dev/l1".into(),
                    block_device: "b".into()
                },
                Step::Mkfs(btrfs::mkfs_args("p", Layout::Raid1, &["/dev/l0", "/dev/l1"]).unwrap()),
                Step::Mount {
                    devices: vec!["/dev/l0".into(), "/dev/l1".into()],
                    degraded: false
                },
                Step::EnableQuota,
            ]
        );
    }

    #[test]
    fn absent_with_a_shortfall_builds_nothing() {
        let shortfall = LayoutShortfall {
            layout: Layout::Raid1,
            needed: 2,
            available: 1,
            rejected: 0,
        };
        let d = decision(
            vec![claim("a", "/dev/l0", false, false)],
            &[],
            Err(shortfall.clone()),
        );
        assert_eq!(
            plan_absent(Layout::Raid1, &d),
            Err(Blocked::Shortfall(shortfall))
        );
    }

    #[test]
    fn absent_with_every_member_missing_builds_nothing_on_other_disks() {
        // Both members gone, two clean disks that could carry a raid1 anew.
        let d = decision(
            vec![
                claim("c", "/dev/l2", false, false),
                claim("d", "/dev/l3", false, true),
            ],
            &["a", "b"],
            Ok(()),
        );
        assert_eq!(
            plan_absent(Layout::Raid1, &d),
            Err(Blocked::MembersMissing(vec!["a".into(), "b".into()]))
        );
        // Nothing runs, so nothing is marked Claimed either.
        assert!(to_mark_claimed("p", &d, &[], &[]).is_empty());
        // With no disk at all it waits for them the same way, not as a shortfall.
        let none = decision(
            vec![],
            &["a"],
            Err(LayoutShortfall {
                layout: Layout::Single,
                needed: 1,
                available: 0,
                rejected: 0,
            }),
        );
        assert_eq!(
            plan_absent(Layout::Single, &none),
            Err(Blocked::MembersMissing(vec!["a".into()]))
        );
    }

    #[test]
    fn every_member_missing_is_failed_saying_how_to_go_on() {
        let d = decision(vec![], &["a", "b"], Ok(()));
        let blocked = Blocked::MembersMissing(vec!["a".into(), "b".into()]);
        let status = blocked_status(
            &d,
            &[
                ("a".into(), "/dev/l0".into()),
                ("b".into(), "/dev/l1".into()),
            ],
            &blocked,
        );
        assert_eq!(status.health.as_deref(), Some(FAILED));
        assert_eq!(
            status.message.as_deref(),
            Some(
                "all 2 of its members on this node are missing (a, b) and the pool's data is on \
                 them: no new filesystem is built on other disks; re-attach them, or delete \
                 their BlockDevices to give that data up and build the pool anew"
            )
        );
        let states: Vec<_> = status.disks.iter().map(|d| d.state.as_deref()).collect();
        assert_eq!(states, [Some("Missing"), Some("Missing")]);
        let one = Blocked::MembersMissing(vec!["a".into()]);
        let status = blocked_status(&decision(vec![], &["a"], Ok(())), &[], &one);
        assert_eq!(
            status.message.as_deref(),
            Some(
                "its only member on this node is missing (a) and the pool's data is on it: \
                 no new filesystem is built on other disks; re-attach it, or delete its \
                 BlockDevice to give that data up and build the pool anew"
            )
        );
    }

    #[test]
    fn unmounted_members_are_mounted_degraded_only_when_one_is_missing() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", true, false),
            ],
            &[],
            Ok(()),
        );
        let steps = plan(
            "p",
            Layout::Raid1,
            &d,
            &Filesystem::Unmounted,
            &Repair::default(),
        )
        .unwrap();
        assert_eq!(
            steps[0],
            Step::Mount {
                devices: vec!["/dev/l0".into(), "/dev/l1".into()],
                degraded: false
            }
        );
        assert_eq!(steps[1], Step::EnableQuota);

        // One member missing: the layout shortfall does not stop a mount of a built pool.
        let shortfall = LayoutShortfall {
            layout: Layout::Raid1,
            needed: 2,
            available: 1,
            rejected: 0,
        };
        let d = decision(
            vec![claim("a", "/dev/l0", true, false)],
            &["b"],
            Err(shortfall),
        );
        let steps = plan(
            "p",
            Layout::Raid1,
            &d,
            &Filesystem::Absent,
            &Repair::default(),
        )
        .unwrap();
        assert_eq!(
            steps[0],
            Step::Mount {
                devices: vec!["/dev/l0".into()],
                degraded: true
            }
        );
        // Nothing claimed and nothing built: nothing to do.
        let d = decision(vec![], &[], Ok(()));
        assert_eq!(
            plan(
                "p",
                Layout::Single,
                &d,
                &Filesystem::Unmounted,
                &Repair::default()
            ),
            Ok(vec![])
        );
    }

    #[test]
    fn mounted_with_every_claim_in_it_is_left_alone() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", true, false),
            ],
            &[],
            Ok(()),
        );
        let mounted = Filesystem::Mounted(show(&[Some("/dev/l0"), Some("/dev/l1")]));
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &Repair::default()),
            Ok(vec![])
        );
    }

    #[test]
    fn a_new_disk_joins_a_mounted_pool_and_the_profile_follows_the_count() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("c", "/dev/l2", false, true),
            ],
            &[],
            Ok(()),
        );
        let mounted = Filesystem::Mounted(show(&[Some("/dev/l0")]));
        let steps = plan("p", Layout::Single, &d, &mounted, &Repair::default()).unwrap();
        assert_eq!(
            steps,
            [
                Step::Wipe {
                    path: "/dev/l2".into(),
                    block_device: "c".into()
                },
                Step::AddDevices(vec!["/dev/l2".into()]),
                Step::Balance {
                    data: "single",
                    metadata: "raid1"
                },
            ]
        );
    }

    #[test]
    fn joining_disks_are_marked_claimed_only_when_something_will_run() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", false, false),
                claim("c", "/dev/l2", false, false),
            ],
            &[],
            Ok(()),
        );
        let steps = [Step::AddDevices(vec!["/dev/l1".into(), "/dev/l2".into()])];
        let current = [
            ("a", Some(BlockDeviceState::InUse), Some("p")),
            ("b", Some(BlockDeviceState::Unclaimed), None),
            // Already Claimed by this pool (an earlier pass failed): not written again.
            ("c", Some(BlockDeviceState::Claimed), Some("p")),
        ];
        // Unclaimed -> Claimed; a member is never marked Claimed.
        assert_eq!(to_mark_claimed("p", &d, &steps, &current), ["b"]);
        // Nothing runs (a layout shortfall, or nothing to do): nothing is marked.
        assert!(to_mark_claimed("p", &d, &[], &current).is_empty());
    }

    #[test]
    fn disks_in_the_filesystem_are_marked_in_use_once() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", false, false),
                claim("c", "/dev/l2", false, false),
                claim("d", "/dev/l3", true, false),
            ],
            &[],
            Ok(()),
        );
        let s = show(&[Some("/dev/l0"), Some("/dev/l1"), Some("/dev/l3")]);
        let current = [
            ("a", Some(BlockDeviceState::InUse), Some("p")),
            ("b", Some(BlockDeviceState::Claimed), Some("p")),
            ("c", Some(BlockDeviceState::Claimed), Some("p")),
            // A member by its label whose status was lost: Unclaimed -> InUse.
            ("d", Some(BlockDeviceState::Unclaimed), None),
        ];
        // Claimed -> InUse (b), Unclaimed -> InUse (d); InUse stays (a); not in the
        // filesystem stays Claimed (c).
        assert_eq!(to_mark_in_use("p", &d, Some(&s), &[], &current), ["b", "d"]);
        // A member with errors stays Failed.
        let failing = [(d.claims[1].path.clone(), DeviceErrors::default())];
        assert_eq!(to_mark_in_use("p", &d, Some(&s), &failing, &current), ["d"]);
        // Not mounted: nothing can be shown in use.
        assert!(to_mark_in_use("p", &d, None, &[], &current).is_empty());
        // InUse by another pool's name is rewritten (the label is the truth).
        let other = [("a", Some(BlockDeviceState::InUse), Some("q"))];
        assert!(to_mark_in_use("p", &d, Some(&s), &[], &other).contains(&"a".to_string()));
    }

    #[test]
    fn status_is_healthy_with_capacity_when_mounted_and_complete() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", true, false),
            ],
            &[],
            Ok(()),
        );
        let s = show(&[Some("/dev/l0"), Some("/dev/l1")]);
        let u = usage();
        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(HEALTHY));
        assert_eq!(status.message, None);
        assert_eq!(status.capacity_bytes, Some(1 << 30));
        assert_eq!(status.allocated_bytes, Some(0));
        assert_eq!(status.free_bytes, Some(1 << 30));
        assert_eq!(status.disks.len(), 2);
        assert_eq!(status.disks[1].block_device, "b");
        assert_eq!(status.disks[1].state.as_deref(), Some("Online"));
    }

    #[test]
    fn status_is_degraded_naming_the_missing_disk() {
        let d = decision(vec![claim("a", "/dev/l0", true, false)], &["b"], Ok(()));
        let s = show(&[Some("/dev/l0"), None]);
        let u = usage();
        let status = node_status(
            "n1",
            &d,
            &[("b".into(), "/dev/l1".into())],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(DEGRADED));
        assert!(
            status
                .message
                .as_deref()
                .unwrap()
                .starts_with("1 disk is missing (b)")
        );
        assert_eq!(status.disks[1].state.as_deref(), Some("Missing"));

        // btrfs alone knows of the missing device: still degraded.
        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(DEGRADED));
    }

    #[test]
    fn status_is_pending_with_the_shortfall_or_failed_with_the_error() {
        let shortfall = LayoutShortfall {
            layout: Layout::Raid1,
            needed: 2,
            available: 1,
            rejected: 2,
        };
        let mut d = decision(
            vec![claim("a", "/dev/l0", false, false)],
            &[],
            Err(shortfall.clone()),
        );
        d.rejected.push(RejectedDisk {
            block_device: Some("x".into()),
            path: "/dev/l9".into(),
            reason: "has an ext4 filesystem (allowWipe is off)".into(),
        });
        let blocked = Blocked::Shortfall(shortfall);
        let status = blocked_status(&d, &[], &blocked);
        assert_eq!(status.health.as_deref(), Some(PENDING));
        assert_eq!(
            status.message.as_deref(),
            Some(
                "no filesystem built: layout raid1 needs at least 2 disks, and 1 disk can be claimed (2 refused, see rejected)"
            )
        );
        assert_eq!(status.capacity_bytes, None);
        assert_eq!(status.rejected.len(), 1);

        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                error: Some("running mkfs.btrfs: exit status 1"),
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(FAILED));

        let status = node_status(
            "n1",
            &decision(vec![], &[], Ok(())),
            &[],
            &Outcome::default(),
        );
        assert_eq!(status.health.as_deref(), Some(PENDING));
    }

    #[test]
    fn a_member_with_errors_degrades_the_node_and_is_shown_failing() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", true, false),
            ],
            &[],
            Ok(()),
        );
        let s = show(&[Some("/dev/l0"), Some("/dev/l1")]);
        let u = usage();
        let failing = [(
            "/dev/l1".to_string(),
            DeviceErrors {
                corruption: 17,
                ..Default::default()
            },
        )];
        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                failing: &failing,
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(DEGRADED));
        assert_eq!(
            status.message.as_deref(),
            Some(
                "1 disk reports I/O or checksum errors: /dev/l1 (17 corruption errors); reads are served from the layout's other copy where it keeps one; replace the disk"
            )
        );
        let states: Vec<_> = status.disks.iter().map(|d| d.state.as_deref()).collect();
        assert_eq!(states, [Some("Online"), Some("Failing")]);
    }

    #[test]
    fn a_member_missing_past_the_grace_period_counts_as_failed() {
        let grace = Duration::from_secs(300);
        assert_eq!(
            missing_verdict(Duration::from_secs(60), grace),
            Err(Duration::from_secs(240))
        );
        assert_eq!(missing_verdict(grace, grace), Ok(()));
        assert_eq!(missing_verdict(Duration::from_secs(301), grace), Ok(()));

        let d = decision(vec![claim("a", "/dev/l0", true, false)], &["b"], Ok(()));
        let s = show(&[Some("/dev/l0"), None]);
        let u = usage();
        let missing = [("b".to_string(), "/dev/l1".to_string())];
        let failed = ["b".to_string()];
        let status = node_status(
            "n1",
            &d,
            &missing,
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                missing_failed: &failed,
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(DEGRADED));
        assert_eq!(
            status.message.as_deref(),
            Some(
                "1 disk is missing (b); mounted degraded, data stays readable while the layout keeps a copy; missing for longer than the grace period, so counted as failed: b (replace it)"
            )
        );
        assert_eq!(status.disks[1].state.as_deref(), Some("Failed"));
    }

    fn errors() -> DeviceErrors {
        DeviceErrors {
            corruption: 3,
            ..Default::default()
        }
    }

    #[test]
    fn failed_members_are_the_failing_ones_and_the_missing_ones_past_the_grace_period() {
        let s = show(&[Some("/dev/l0"), Some("/dev/l1"), None]);
        let failing = [("/dev/l1".to_string(), errors())];
        assert_eq!(
            failed_members(&s, &failing, &[]),
            [FailedMember {
                devid: 2,
                size_bytes: 1 << 30,
                name: "/dev/l1".into()
            }],
            "a missing device not yet past its grace period is not replaced"
        );
        assert_eq!(
            failed_members(&s, &[], &[("b".to_string(), 2 << 30)]),
            [FailedMember {
                devid: 3,
                size_bytes: 2 << 30,
                name: "b".into()
            }],
            "the missing device, as large as its BlockDevice said"
        );
        let two_missing = show(&[Some("/dev/l0"), None, None]);
        assert_eq!(
            failed_members(&two_missing, &[], &[("b".to_string(), 1 << 30)]),
            [],
            "which of two missing devices is the expired one is not known: wait for both"
        );
    }

    fn failed(devid: u64, size_bytes: u64) -> Repair {
        Repair {
            failed: vec![FailedMember {
                devid,
                size_bytes,
                name: "/dev/l1".into(),
            }],
            hold: false,
        }
    }

    #[test]
    fn a_new_disk_replaces_a_failed_member_instead_of_joining() {
        let mut small = claim("c", "/dev/l2", false, false);
        small.size_bytes = 1 << 29;
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                small,
                claim("d", "/dev/l3", false, true),
            ],
            &[],
            Ok(()),
        );
        let mounted = Filesystem::Mounted(show(&[Some("/dev/l0"), Some("/dev/l1")]));
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &failed(2, 1 << 30)),
            Ok(vec![
                Step::Wipe {
                    path: "/dev/l3".into(),
                    block_device: "d".into()
                },
                Step::Replace {
                    failed: failed(2, 1 << 30).failed[0].clone(),
                    path: "/dev/l3".into(),
                    block_device: "d".into()
                }
            ]),
            "the disk large enough takes the failed one's place; the small one waits"
        );
        let mut held = failed(2, 1 << 30);
        held.hold = true;
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &held),
            Ok(vec![]),
            "a replacement that just failed is not retried at once"
        );
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &failed(2, 4 << 30)),
            Ok(vec![]),
            "no disk large enough: nothing joins while a member has failed"
        );
    }

    #[test]
    fn nothing_runs_while_a_replacement_is_under_way() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("d", "/dev/l3", false, false),
                claim("e", "/dev/l4", false, false),
            ],
            &[],
            Ok(()),
        );
        let mut s = show(&[Some("/dev/l0"), Some("/dev/l1"), Some("/dev/l3")]);
        s.devices[2].devid = 0;
        let mounted = Filesystem::Mounted(s);
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &failed(2, 1 << 30)),
            Ok(vec![])
        );
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &Repair::default()),
            Ok(vec![])
        );
    }

    #[test]
    fn an_old_copy_of_a_member_is_never_added_back() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("b", "/dev/l1", true, false),
                claim("old", "/dev/l9", true, false),
            ],
            &[],
            Ok(()),
        );
        let mounted = Filesystem::Mounted(show(&[Some("/dev/l0"), Some("/dev/l1")]));
        assert_eq!(
            plan("p", Layout::Raid1, &d, &mounted, &Repair::default()),
            Ok(vec![])
        );
    }

    #[test]
    fn status_shows_the_replacement_and_what_a_failed_member_needs() {
        let d = decision(
            vec![
                claim("a", "/dev/l0", true, false),
                claim("d", "/dev/l3", false, false),
            ],
            &[],
            Ok(()),
        );
        let mut s = show(&[Some("/dev/l0"), Some("/dev/l1"), Some("/dev/l3")]);
        s.devices[2].devid = 0;
        let u = usage();
        let failing = [("/dev/l1".to_string(), errors())];
        let repair = failed(2, 1 << 30);
        let replacement = PoolReplacement {
            failed: "/dev/l1 (devid 2)".into(),
            block_device: "d".into(),
            path: "/dev/l3".into(),
            progress: Some("42.5%".into()),
        };
        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                failing: &failing,
                failed: &repair.failed,
                replacement: Some(&replacement),
                ..Default::default()
            },
        );
        assert_eq!(status.health.as_deref(), Some(DEGRADED));
        assert_eq!(
            status.message.as_deref(),
            Some("replacing /dev/l1 (devid 2) by /dev/l3 (d): 42.5% copied")
        );
        let states: Vec<_> = status.disks.iter().map(|d| d.state.as_deref()).collect();
        assert_eq!(states, [Some("Online"), Some("Failing"), Some("Replacing")]);
        assert_eq!(status.replacement, Some(replacement));

        let s = show(&[Some("/dev/l0"), Some("/dev/l1")]);
        let status = node_status(
            "n1",
            &d,
            &[],
            &Outcome {
                show: Some(&s),
                usage: Some(&u),
                failing: &failing,
                failed: &repair.failed,
                replace_error: Some("target too small"),
                ..Default::default()
            },
        );
        assert_eq!(
            status.message.as_deref(),
            Some(
                "1 disk reports I/O or checksum errors: /dev/l1 (3 corruption errors); reads are served from the layout's other copy where it keeps one; replace the disk; a clean disk of at least 1073741824 bytes that the pool's device filter selects on this node replaces /dev/l1; the last replacement failed: target too small"
            )
        );
        assert_eq!(status.replacement, None);
    }
}
