//! Observe: one full look at this node's disks — discovery, the allow-list, probing,
//! host usage, safety and identity — turned into the devices the inventory writes.
//!
//! It reads the machine (sysfs, `/proc/1/mountinfo`, `/proc/swaps`, `wipefs`) but never
//! the API server; it is blocking and runs off the async runtime.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use castellan_crds::block_device::BlockDeviceSpec;
use regex::Regex;

use super::discovery::{self, Disk};
use super::identity::{self, IdentitySource};
use super::probe;
use super::safety::{self, DeviceFacts};

/// A device discovery found attached now, ready to be written.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The object name, from the device's identity.
    pub name: String,
    pub spec: BlockDeviceSpec,
    /// Why no pool could take it without `allowWipe` or at all, if anything; shown in
    /// `status.message` while the disk is `Unclaimed`.
    pub refusal: Option<String>,
    /// What `safety` judged it by, for the pools to judge it again with their own
    /// `allowWipe`. Not written anywhere.
    pub facts: OwnedFacts,
}

/// Where to read the host from. The mount table is PID 1's, so the agent sees the
/// host mount namespace when it shares the host PID namespace, even from a container.
#[derive(Clone, Debug)]
pub struct Sources {
    pub sys_root: PathBuf,
    pub mountinfo: PathBuf,
    pub swaps: PathBuf,
    /// Where udev keeps its links to disks (`by-id`, `by-path`, `by-uuid`); missing
    /// where udevd does not run, and then disks are named by their paths only.
    pub dev_disk: PathBuf,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            sys_root: PathBuf::from("/sys"),
            mountinfo: PathBuf::from("/proc/1/mountinfo"),
            swaps: PathBuf::from("/proc/swaps"),
            dev_disk: PathBuf::from("/dev/disk"),
        }
    }
}

/// Which devices this agent reports: with a pattern, only those whose path or (for a
/// loop device) backing file matches, so that several development nodes on one host
/// each see only their own disks.
#[derive(Clone, Debug, Default)]
pub struct AllowList(pub Option<Regex>);

impl AllowList {
    pub fn allows(&self, disk: &Disk) -> bool {
        let Some(pattern) = &self.0 else {
            return true;
        };
        pattern.is_match(&disk.path)
            || disk
                .loop_backing_file
                .as_deref()
                .is_some_and(|file| pattern.is_match(&file.to_string_lossy()))
    }
}

/// The facts `safety` judges a disk by, owned, so that pools can judge the disks of
/// the same look that the inventory wrote (see `DeviceFacts` for each field).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OwnedFacts {
    pub signatures: Vec<probe::Signature>,
    pub partitions: Vec<String>,
    pub holders: Vec<String>,
    pub mount_points: Vec<String>,
    pub swap: bool,
    pub holds_root: bool,
    pub read_only: bool,
    pub probe_error: Option<String>,
    pub removable: bool,
    pub links: Vec<String>,
}

impl OwnedFacts {
    pub fn borrow(&self) -> DeviceFacts<'_> {
        DeviceFacts {
            signatures: &self.signatures,
            partitions: &self.partitions,
            holders: &self.holders,
            mount_points: &self.mount_points,
            swap: self.swap,
            holds_root: self.holds_root,
            read_only: self.read_only,
            probe_error: self.probe_error.as_deref(),
            removable: self.removable,
            links: &self.links,
        }
    }
}

/// What one look found.
#[derive(Debug, Default)]
pub struct Observation {
    pub devices: Vec<Observed>,
    /// Disks left out, each with why (no identity, unreadable mount table); logged,
    /// not fatal.
    pub skipped: Vec<String>,
}

/// Whether the disk at `path` is still the one named `block_device`, its identity read
/// again from the hardware right before something destroys what is on it: a disk
/// hot-swapped into the same `/dev/sdX` has another identity and is left alone.
pub fn still_the_disk(
    node: &str,
    path: &str,
    block_device: &str,
    sources: &Sources,
) -> Result<(), String> {
    // That disk only: probing every disk of the host for each wipe is work for nothing.
    let only = AllowList(Some(
        Regex::new(&format!("^{}$", regex::escape(path)))
            .map_err(|error| format!("re-identifying {path} before wiping it: {error}"))?,
    ));
    let observation = observe(node, &only, sources)
        .map_err(|error| format!("re-identifying {path} before wiping it: {error}"))?;
    let now = observation
        .devices
        .iter()
        .find(|device| device.spec.path == path)
        .map(|device| device.name.as_str());
    same_disk(path, block_device, now)
}

/// The verdict of [`still_the_disk`] from the name the disk at `path` has now.
fn same_disk(path: &str, expected: &str, now: Option<&str>) -> Result<(), String> {
    match now {
        Some(name) if name == expected => Ok(()),
        Some(name) => Err(format!(
            "not wiped: {path} is now {name}, not {expected} (another disk took its place)"
        )),
        None => Err(format!(
            "not wiped: {path} is no identifiable disk now, not {expected}"
        )),
    }
}

/// Looks at every allowed disk of the node.
pub fn observe(
    node: &str,
    allow: &AllowList,
    sources: &Sources,
) -> Result<Observation, discovery::DiscoveryError> {
    let disks = discovery::scan(&sources.sys_root)?;
    // Without a readable mount table no disk can be shown unmounted; report the
    // table as empty would be a lie that `safety` trusts, so say so per disk instead.
    let mounts =
        std::fs::read_to_string(&sources.mountinfo).map(|text| discovery::parse_mountinfo(&text));
    let swaps = std::fs::read_to_string(&sources.swaps)
        .map(|text| discovery::parse_swaps(&text))
        .unwrap_or_default();
    let links = discovery::links(&sources.dev_disk);
    let btrfs_members = discovery::mounted_btrfs_members(&sources.sys_root);
    let mut observation = Observation::default();
    for disk in disks.iter().filter(|disk| allow.allows(disk)) {
        let mounts = match &mounts {
            Ok(mounts) => mounts,
            Err(error) => {
                observation.skipped.push(format!(
                    "{}: reading {}: {error}",
                    disk.path,
                    sources.mountinfo.display()
                ));
                continue;
            }
        };
        let links = links.get(&disk.path).map_or(&[][..], Vec::as_slice);
        match observe_disk(node, disk, mounts, &swaps, &btrfs_members, links) {
            Ok(device) => observation.devices.push(device),
            Err(reason) => observation.skipped.push(format!("{}: {reason}", disk.path)),
        }
    }
    let (devices, duplicates) = without_shared_identities(std::mem::take(&mut observation.devices));
    observation.devices = devices;
    observation.skipped.extend(duplicates);
    Ok(observation)
}

/// Leaves out every device whose identity another device shares, with why. Two disks
/// with one identity (cloned virtual disks with the same serial, a multi-device
/// filesystem probed without its sub-UUIDs) would otherwise flap as one object
/// between two paths, and a pool could claim the wrong one.
pub fn without_shared_identities(devices: Vec<Observed>) -> (Vec<Observed>, Vec<String>) {
    let mut kept = Vec::new();
    let mut skipped = Vec::new();
    for device in &devices {
        let twins: Vec<&str> = devices
            .iter()
            .filter(|other| other.name == device.name && other.spec.path != device.spec.path)
            .map(|other| other.spec.path.as_str())
            .collect();
        if twins.is_empty() {
            kept.push(device.clone());
        } else {
            skipped.push(format!(
                "{}: has the same identity ({}) as {}; not reported until they can be told apart",
                device.spec.path,
                device.spec.identity,
                twins.join(", ")
            ));
        }
    }
    (kept, skipped)
}

fn observe_disk(
    node: &str,
    disk: &Disk,
    mounts: &[discovery::Mount],
    swaps: &[String],
    btrfs_members: &[Vec<String>],
    links: &[String],
) -> Result<Observed, String> {
    // A disk that cannot be probed is still reported, refused as unknown: hiding it
    // would hide why no pool takes it.
    let (signatures, probe_error) = match probe::probe(Path::new(&disk.path)) {
        Ok(signatures) => (signatures, None),
        Err(error) => (Vec::new(), Some(error.to_string())),
    };
    let usage = discovery::usage_of(disk, mounts, swaps, btrfs_members);
    let partitions: Vec<String> = disk.partitions.iter().map(|p| p.name.clone()).collect();
    let holders: Vec<String> = disk
        .holders
        .iter()
        .chain(disk.partitions.iter().flat_map(|p| p.holders.iter()))
        .cloned()
        .collect();
    let facts = DeviceFacts {
        signatures: &signatures,
        partitions: &partitions,
        holders: &holders,
        mount_points: &usage.mount_points,
        swap: usage.swap,
        holds_root: usage.holds_root,
        read_only: disk.read_only,
        probe_error: probe_error.as_deref(),
        removable: disk.removable,
        links,
    };
    let refusal = safety::judge(&facts, false).reason();
    let owned_facts = OwnedFacts {
        signatures: signatures.clone(),
        partitions: partitions.clone(),
        holders: holders.clone(),
        mount_points: usage.mount_points.clone(),
        swap: usage.swap,
        holds_root: usage.holds_root,
        read_only: disk.read_only,
        probe_error: probe_error.clone(),
        removable: disk.removable,
        links: links.to_vec(),
    };

    let loop_file = match &disk.loop_backing_file {
        Some(file) => {
            let inode = std::fs::metadata(file)
                .map_err(|error| {
                    format!(
                        "reading the inode of its backing file {}: {error}",
                        file.display()
                    )
                })?
                .ino();
            Some((file.to_string_lossy().into_owned(), inode))
        }
        None => None,
    };
    let identity = identity::identify(&IdentitySource {
        wwn: disk.wwn.as_deref(),
        serial: disk.serial.as_deref(),
        signatures: &signatures,
        loop_file: loop_file
            .as_ref()
            .map(|(path, inode)| (path.as_str(), *inode)),
    })
    .ok_or_else(|| {
        "has no WWN, serial number or Castellan filesystem to recognise it by; not reported"
            .to_string()
    })?;

    Ok(Observed {
        name: identity.object_name(node),
        spec: BlockDeviceSpec {
            node_name: node.to_string(),
            path: disk.path.clone(),
            size_bytes: i64::try_from(disk.size_bytes).unwrap_or(i64::MAX),
            model: disk.model.clone(),
            serial: disk.serial.clone(),
            wwn: disk.wwn.clone(),
            identity: identity.to_string(),
            rotational: disk.rotational,
            signatures: signatures.iter().map(|s| s.name.clone()).collect(),
        },
        refusal,
        facts: owned_facts,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    #[test]
    fn a_wipe_waits_for_the_same_disk() {
        assert_eq!(
            same_disk("/dev/sdb", "node-1-wwn-5000c5", Some("node-1-wwn-5000c5")),
            Ok(())
        );
        assert_eq!(
            same_disk("/dev/sdb", "node-1-wwn-5000c5", Some("node-1-wwn-5000c6")),
            Err("not wiped: /dev/sdb is now node-1-wwn-5000c6, not node-1-wwn-5000c5 (another disk took its place)".into())
        );
        assert_eq!(
            same_disk("/dev/sdb", "node-1-wwn-5000c5", None),
            Err("not wiped: /dev/sdb is no identifiable disk now, not node-1-wwn-5000c5".into())
        );
    }

    fn disk(path: &str, backing: Option<&str>) -> Disk {
        Disk {
            name: path.trim_start_matches("/dev/").into(),
            path: path.into(),
            dev: None,
            size_bytes: 1,
            model: None,
            serial: None,
            wwn: None,
            rotational: false,
            removable: false,
            read_only: false,
            partitions: vec![],
            holders: vec![],
            loop_backing_file: backing.map(PathBuf::from),
        }
    }

    fn observed(name: &str, path: &str) -> Observed {
        Observed {
            name: name.into(),
            spec: BlockDeviceSpec {
                node_name: "n".into(),
                path: path.into(),
                size_bytes: 1,
                model: None,
                serial: Some("same".into()),
                wwn: None,
                identity: "serial:same".into(),
                rotational: false,
                signatures: vec![],
            },
            refusal: None,
            facts: OwnedFacts::default(),
        }
    }

    #[test]
    fn devices_sharing_an_identity_are_all_left_out() {
        let devices = vec![
            observed("a", "/dev/vda"),
            observed("twin", "/dev/vdb"),
            observed("twin", "/dev/vdc"),
        ];
        let (kept, skipped) = without_shared_identities(devices);
        assert_eq!(kept, [observed("a", "/dev/vda")]);
        assert_eq!(
            skipped,
            [
                "/dev/vdb: has the same identity (serial:same) as /dev/vdc; not reported until they can be told apart",
                "/dev/vdc: has the same identity (serial:same) as /dev/vdb; not reported until they can be told apart",
            ]
        );
    }

    #[test]
    fn the_allow_list_matches_path_or_backing_file() {
        let everything = AllowList::default();
        assert!(everything.allows(&disk("/dev/sda", None)));

        let by_path = AllowList(Some(Regex::new("^/dev/sd[b-z]$").unwrap()));
        assert!(by_path.allows(&disk("/dev/sdb", None)));
        assert!(!by_path.allows(&disk("/dev/sda", None)));

        let by_file = AllowList(Some(Regex::new("^/var/lib/dev-node-1/").unwrap()));
        assert!(by_file.allows(&disk("/dev/loop3", Some("/var/lib/dev-node-1/d0.img"))));
        assert!(!by_file.allows(&disk("/dev/loop4", Some("/var/lib/dev-node-2/d0.img"))));
        assert!(!by_file.allows(&disk("/dev/loop4", None)));
    }
}
