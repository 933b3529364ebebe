//! Deleting a StoragePool: the pure decision of what one node does with its part.
//!
//! The pool carries the finalizer `castellan.io/pool` (added by the first agent that
//! builds on it). Once the pool is being deleted, every node's agent asks `decide`:
//!
//! - while PersistentVolumes of the pool exist (on any node), nothing is touched: the
//!   pool stays mounted and serving, the node's entry says why, and the pool gets a
//!   `Deleting` condition and a Warning Event. Deleting the claims (or, for `Retain`,
//!   the PVs) lets the deletion go on;
//! - then each node unmounts its filesystem, wipes the btrfs signature from the member
//!   disks that still carry the pool's label (so they are clean and `Unclaimed` again,
//!   claimable by the next pool without `allowWipe`), releases their BlockDevices, and
//!   removes its status entry;
//! - the agent that sees no entry left removes the finalizer.
//!
//! Subvolumes retained after their PV was deleted go with the filesystem: deleting the
//! pool is the user's statement that its data is no longer wanted. A node whose agent
//! never comes back keeps its entry, and with it the finalizer; the annotation
//! `castellan.io/release-nodes` on the pool lets the operator release that node's part
//! (`operator::pools`).

use std::path::PathBuf;

/// One member disk of the pool on this node.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub block_device: String,
    pub path: String,
    /// Attached now (a missing disk cannot be wiped; its object is released anyway).
    pub attached: bool,
    /// Carries the pool's btrfs label: only such a disk is wiped.
    pub carries_label: bool,
}

/// A step of releasing this node's part, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Unmount(PathBuf),
    /// `btrfs device scan --forget`, then `wipefs --all`, if the disk at `path` is
    /// still `block_device`.
    Wipe {
        path: String,
        block_device: String,
    },
    /// Hand the BlockDevice back to the inventory (`Unclaimed` on its next look).
    Release(String),
    /// Remove this node's entry from the pool's status.
    Leave,
}

/// What this node does for a pool being deleted.
#[derive(Clone, Debug, PartialEq)]
pub enum Deletion {
    /// Volumes remain: keep everything, with this message.
    Blocked(String),
    Release(Vec<Step>),
}

/// Decides for one node. `volumes` are the names of the pool's PVs on every node.
pub fn decide(
    pool: &str,
    class: &str,
    volumes: &[String],
    mount: Option<PathBuf>,
    members: &[Member],
    listed: bool,
) -> Deletion {
    if !volumes.is_empty() {
        let shown: Vec<&str> = volumes.iter().take(5).map(String::as_str).collect();
        let more = volumes.len().saturating_sub(shown.len());
        return Deletion::Blocked(format!(
            "pool {pool} is not deleted while {} PersistentVolume(s) of StorageClass {class} exist: {}{}; delete their claims (or, with Retain, the volumes) first",
            volumes.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            },
        ));
    }
    let mut steps = Vec::new();
    if let Some(mount) = mount {
        steps.push(Step::Unmount(mount));
    }
    for member in members {
        if member.attached && member.carries_label {
            steps.push(Step::Wipe {
                path: member.path.clone(),
                block_device: member.block_device.clone(),
            });
        }
    }
    for member in members {
        steps.push(Step::Release(member.block_device.clone()));
    }
    if listed {
        steps.push(Step::Leave);
    }
    Deletion::Release(steps)
}

/// Whether the finalizer can go: no node has an entry left and no volume exists.
pub fn finalizer_removable(entries: usize, volumes: usize) -> bool {
    entries == 0 && volumes == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, attached: bool, carries_label: bool) -> Member {
        Member {
            block_device: name.into(),
            path: format!("/dev/{name}"),
            attached,
            carries_label,
        }
    }

    #[test]
    fn volumes_block_the_deletion_and_are_named() {
        let volumes: Vec<String> = (1..=7).map(|i| format!("pvc-{i}")).collect();
        let decision = decide(
            "fast",
            "castellan-fast",
            &volumes,
            Some("/p".into()),
            &[member("a", true, true)],
            true,
        );
        assert_eq!(
            decision,
            Deletion::Blocked(
                "pool fast is not deleted while 7 PersistentVolume(s) of StorageClass castellan-fast exist: pvc-1, pvc-2, pvc-3, pvc-4, pvc-5 and 2 more; delete their claims (or, with Retain, the volumes) first".into()
            )
        );
    }

    #[test]
    fn without_volumes_the_node_unmounts_wipes_its_labelled_disks_releases_and_leaves() {
        let members = [
            member("a", true, true),
            member("b", false, true),
            member("c", true, false),
        ];
        let decision = decide(
            "fast",
            "castellan-fast",
            &[],
            Some("/p/n1/fast".into()),
            &members,
            true,
        );
        assert_eq!(
            decision,
            Deletion::Release(vec![
                Step::Unmount("/p/n1/fast".into()),
                Step::Wipe {
                    path: "/dev/a".into(),
                    block_device: "a".into()
                },
                Step::Release("a".into()),
                Step::Release("b".into()),
                Step::Release("c".into()),
                Step::Leave,
            ])
        );
    }

    #[test]
    fn a_node_with_nothing_mounted_and_no_entry_has_nothing_to_do() {
        assert_eq!(
            decide("fast", "c", &[], None, &[], false),
            Deletion::Release(vec![])
        );
        assert_eq!(
            decide("fast", "c", &[], None, &[], true),
            Deletion::Release(vec![Step::Leave])
        );
    }

    #[test]
    fn the_finalizer_goes_when_no_entry_and_no_volume_is_left() {
        assert!(finalizer_removable(0, 0));
        assert!(!finalizer_removable(1, 0));
        assert!(!finalizer_removable(0, 1));
    }
}
