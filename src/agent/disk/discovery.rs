//! Discovery: what block devices this node has, read straight from sysfs.
//!
//! It owns reading `/sys/block` (size, model, serial, WWN, rotational, removable,
//! read-only, partitions, holders, a loop device's backing file) and the host's mount
//! table and swap list, and it must not write anything. It does not use `/dev/disk/by-*`
//! (the `lsblk` crate's source): those links are made by udevd, which nodes in
//! development — and some minimal hosts — do not run.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// A device's `major:minor` number, as sysfs `dev` files and `mountinfo` print it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevNumber {
    pub major: u32,
    pub minor: u32,
}

impl DevNumber {
    /// Parses `"254:0"`.
    pub fn parse(text: &str) -> Option<Self> {
        let (major, minor) = text.trim().split_once(':')?;
        Some(Self {
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
        })
    }
}

/// A partition of a disk, as sysfs lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Kernel name, such as `sda1`.
    pub name: String,
    pub dev: Option<DevNumber>,
    /// Devices stacked on this partition (`dm-0`, `md0`).
    pub holders: Vec<String>,
}

/// A whole disk as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    /// Kernel name, such as `sdb` or `loop3`.
    pub name: String,
    /// Device node, such as `/dev/sdb`.
    pub path: String,
    pub dev: Option<DevNumber>,
    pub size_bytes: u64,
    pub model: Option<String>,
    pub serial: Option<String>,
    pub wwn: Option<String>,
    pub rotational: bool,
    pub removable: bool,
    pub read_only: bool,
    pub partitions: Vec<Partition>,
    /// Devices stacked on the whole disk (`dm-0`, `md0`).
    pub holders: Vec<String>,
    /// For a loop device, the file it is attached to.
    pub loop_backing_file: Option<PathBuf>,
}

/// Why reading sysfs failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("listing block devices in {path}: {source}")]
    List { path: PathBuf, source: io::Error },
}

/// Kernel name prefixes that are never disks a pool could use: RAM disks, compressed
/// swap in RAM, optical drives, and devices the kernel builds on top of disks (device
/// mapper, MD RAID) — those show up as holders of the real disks instead.
const NOT_DISKS: [&str; 5] = ["ram", "zram", "sr", "dm-", "md"];

/// Every whole disk under `<sys_root>/block` with a non-zero size. Unattached loop
/// devices (size 0) are left out: they are slots, not disks.
pub fn scan(sys_root: &Path) -> Result<Vec<Disk>, DiscoveryError> {
    let block = sys_root.join("block");
    let entries = fs::read_dir(&block).map_err(|source| DiscoveryError::List {
        path: block.clone(),
        source,
    })?;
    let mut disks = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if NOT_DISKS.iter().any(|prefix| name.starts_with(prefix)) {
            continue;
        }
        if let Some(disk) = read_disk(&block.join(&name), &name) {
            disks.push(disk);
        }
    }
    disks.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(disks)
}

/// Reads one disk's directory; `None` when it has no size (an empty loop slot, a
/// card reader without a card) or vanished while being read.
fn read_disk(dir: &Path, name: &str) -> Option<Disk> {
    // `size` is in 512-byte sectors whatever the disk's logical block size.
    let sectors: u64 = read_trimmed(&dir.join("size"))?.parse().ok()?;
    if sectors == 0 {
        return None;
    }
    let device = dir.join("device");
    Some(Disk {
        name: name.to_string(),
        path: format!("/dev/{name}"),
        dev: read_trimmed(&dir.join("dev")).and_then(|text| DevNumber::parse(&text)),
        size_bytes: sectors.saturating_mul(512),
        model: read_trimmed(&device.join("model")),
        serial: read_trimmed(&device.join("serial"))
            .or_else(|| read_trimmed(&dir.join("serial")))
            .or_else(|| {
                fs::read(device.join("vpd_pg80"))
                    .ok()
                    .and_then(|page| serial_from_vpd_page(&page))
            }),
        wwn: read_trimmed(&dir.join("wwid")).or_else(|| read_trimmed(&device.join("wwid"))),
        rotational: read_flag(&dir.join("queue/rotational")),
        removable: read_flag(&dir.join("removable")),
        read_only: read_flag(&dir.join("ro")),
        partitions: read_partitions(dir, name),
        holders: list_names(&dir.join("holders")),
        loop_backing_file: read_trimmed(&dir.join("loop/backing_file"))
            .map(|path| PathBuf::from(path.trim_end_matches(" (deleted)"))),
    })
}

/// Partitions are the subdirectories named after the disk that have a `partition` file.
fn read_partitions(dir: &Path, disk: &str) -> Vec<Partition> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut partitions: Vec<Partition> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            (name.starts_with(disk) && path.join("partition").exists()).then(|| Partition {
                dev: read_trimmed(&path.join("dev")).and_then(|text| DevNumber::parse(&text)),
                holders: list_names(&path.join("holders")),
                name,
            })
        })
        .collect();
    partitions.sort_by(|a, b| a.name.cmp(&b.name));
    partitions
}

/// The serial number in a SCSI "Unit Serial Number" VPD page (0x80): a 4-byte header,
/// then the page length, then ASCII. SCSI disks expose their serial only this way.
pub fn serial_from_vpd_page(page: &[u8]) -> Option<String> {
    if page.len() < 4 || page[1] != 0x80 {
        return None;
    }
    let length = usize::from(page[3]);
    let body = page.get(4..4 + length).unwrap_or(&page[4..]);
    non_empty(String::from_utf8_lossy(body).trim_matches(|c: char| c == '\0' || c.is_whitespace()))
}

fn list_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn read_trimmed(path: &Path) -> Option<String> {
    non_empty(&fs::read_to_string(path).ok()?)
}

fn read_flag(path: &Path) -> bool {
    read_trimmed(path).is_some_and(|text| text == "1")
}

fn non_empty(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// One line of `/proc/<pid>/mountinfo` that matters here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub dev: Option<DevNumber>,
    pub mount_point: String,
    /// The mount source, such as `/dev/vda1` (btrfs mounts show an anonymous `0:N`
    /// device number, so the source is what names their disk).
    pub source: String,
}

/// The udev links under `dev_disk` (`by-id`, `by-path`, `by-uuid`), grouped by the
/// device path each resolves to (`/dev/sdb` → `/dev/disk/by-id/wwn-…`, …), each group
/// sorted. Links that do not resolve (a disk just unplugged) are left out; where udevd
/// does not run the directory is missing and the map empty.
pub fn links(dev_disk: &Path) -> BTreeMap<String, Vec<String>> {
    let mut links: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for kind in ["by-id", "by-path", "by-uuid"] {
        let dir = dev_disk.join(kind);
        for name in list_names(&dir) {
            let link = dir.join(&name);
            let is_link = fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink());
            if let (true, Ok(target)) = (is_link, fs::canonicalize(&link)) {
                links
                    .entry(target.to_string_lossy().into_owned())
                    .or_default()
                    .push(link.to_string_lossy().into_owned());
            }
        }
    }
    for group in links.values_mut() {
        group.sort();
    }
    links
}

/// Parses mountinfo (`proc(5)`): `id parent major:minor root mountpoint options
/// [optional fields] - fstype source superoptions`.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let separator = fields.iter().position(|field| *field == "-")?;
            Some(Mount {
                dev: DevNumber::parse(fields.get(2)?),
                mount_point: unescape_octal(fields.get(4)?),
                source: unescape_octal(fields.get(separator + 2)?),
            })
        })
        .collect()
}

/// Paths listed in `/proc/swaps` (first column, after the header).
pub fn parse_swaps(text: &str) -> Vec<String> {
    text.lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .map(unescape_octal)
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as `\040`-style octal escapes.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = bytes
            .get(index + 1..index + 4)
            .filter(|digits| {
                bytes[index] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d))
            })
            .and_then(|digits| u8::from_str_radix(&String::from_utf8_lossy(digits), 8).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                index += 4;
            }
            None => {
                out.push(bytes[index]);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where a disk or its partitions are in use by the host, from the mount table and
/// the swap list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub mount_points: Vec<String>,
    pub swap: bool,
    pub holds_root: bool,
}

/// The member devices of every mounted btrfs filesystem, one list of kernel names
/// (`sdb`, `loop3`, `nvme0n1p2`) per filesystem, from `/sys/fs/btrfs/<fsid>/devices`,
/// which the kernel keeps for each mounted btrfs whatever the mount namespace. A
/// filesystem over several devices is mounted by naming one of them and the mount
/// table names only that one; the others are just as much in use.
pub fn mounted_btrfs_members(sys_root: &Path) -> Vec<Vec<String>> {
    let root = sys_root.join("fs").join("btrfs");
    list_names(&root)
        .into_iter()
        .map(|fsid| list_names(&root.join(fsid).join("devices")))
        .filter(|members| !members.is_empty())
        .collect()
}

/// How the host uses `disk`: mounted (the disk or one of its partitions, matched by
/// device number or by source path, or through another member of a mounted btrfs
/// filesystem it belongs to, `btrfs_members`), swapped on, or holding `/`.
pub fn usage_of(
    disk: &Disk,
    mounts: &[Mount],
    swaps: &[String],
    btrfs_members: &[Vec<String>],
) -> Usage {
    let mut names = vec![disk.name.clone()];
    let mut devs: Vec<DevNumber> = disk.dev.into_iter().collect();
    for partition in &disk.partitions {
        names.push(partition.name.clone());
        devs.extend(partition.dev);
    }
    let own: Vec<String> = names.iter().map(|name| format!("/dev/{name}")).collect();
    let filesystems: Vec<&Vec<String>> = btrfs_members
        .iter()
        .filter(|members| members.iter().any(|member| names.contains(member)))
        .collect();
    let mut paths = own.clone();
    paths.push(disk.path.clone());
    for members in &filesystems {
        paths.extend(members.iter().map(|member| format!("/dev/{member}")));
    }
    let ours = |mount: &Mount| {
        mount.dev.is_some_and(|dev| devs.contains(&dev)) || paths.contains(&mount.source)
    };
    let mut mount_points: Vec<String> = mounts
        .iter()
        .filter(|mount| ours(mount))
        .map(|mount| mount.mount_point.clone())
        .collect();
    // Mounted, but not where this mount table shows (another mount namespace).
    for members in filesystems {
        let shown = mounts.iter().any(|mount| {
            members
                .iter()
                .any(|member| mount.source == format!("/dev/{member}"))
        });
        if !shown {
            mount_points.push(format!(
                "an unknown place (a btrfs filesystem over {}, mounted in another mount namespace)",
                members.join(", ")
            ));
        }
    }
    mount_points.sort();
    mount_points.dedup();
    Usage {
        holds_root: mount_points.iter().any(|point| point == "/"),
        swap: swaps.iter().any(|swap| paths.contains(swap)),
        mount_points,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    /// A fake sysfs under a fresh directory, removed on drop.
    struct FakeSys(PathBuf);

    impl FakeSys {
        fn new(tag: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("castellan-sysfs-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("block")).unwrap();
            Self(dir)
        }
        fn write(&self, relative: &str, content: &str) {
            let path = self.0.join("block").join(relative);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn every_member_of_a_mounted_multi_device_btrfs_is_in_use() {
        let sys = FakeSys::new("btrfs-members");
        let fsid = sys
            .0
            .join("fs/btrfs/5b1e2a3c-0000-4000-8000-000000000001/devices");
        fs::create_dir_all(&fsid).unwrap();
        for member in ["loop4", "loop5"] {
            fs::write(fsid.join(member), "").unwrap();
        }
        // Another mounted btrfs, in a mount namespace this table does not show.
        let hidden = sys
            .0
            .join("fs/btrfs/5b1e2a3c-0000-4000-8000-000000000002/devices");
        fs::create_dir_all(&hidden).unwrap();
        fs::write(hidden.join("sdd"), "").unwrap();
        // btrfs's own sysfs entries that are no filesystem.
        fs::create_dir_all(sys.0.join("fs/btrfs/features")).unwrap();
        let members = mounted_btrfs_members(&sys.0);
        assert_eq!(members, [vec!["loop4", "loop5"], vec!["sdd"]]);

        let mounts = parse_mountinfo(MOUNTINFO);
        // The mount table names loop4 only (mounted at /pool); loop5 is as much in use.
        let second = usage_of(&disk("loop5", (7, 5), &[]), &mounts, &[], &members);
        assert_eq!(second.mount_points, ["/pool"]);
        assert_eq!(
            usage_of(&disk("loop5", (7, 5), &[]), &mounts, &[], &[]).mount_points,
            Vec::<String>::new(),
            "without the kernel's list the mount table alone misses it"
        );
        let elsewhere = usage_of(&disk("sdd", (8, 48), &[]), &mounts, &[], &members);
        assert_eq!(
            elsewhere.mount_points,
            ["an unknown place (a btrfs filesystem over sdd, mounted in another mount namespace)"]
        );
        let unrelated = usage_of(&disk("sde", (8, 64), &[]), &mounts, &[], &members);
        assert!(unrelated.mount_points.is_empty());
        assert!(mounted_btrfs_members(&sys.0.join("none")).is_empty());
    }

    #[test]
    fn udev_links_are_grouped_by_the_device_they_resolve_to() {
        // /dev/disk as udev lays it out: relative links, one directory per kind.
        let root = FakeSys::new("links");
        let dev = root.0.join("dev");
        for kind in ["by-id", "by-path", "by-uuid"] {
            fs::create_dir_all(dev.join("disk").join(kind)).unwrap();
        }
        fs::write(dev.join("sdb"), "").unwrap();
        fs::write(dev.join("sdb1"), "").unwrap();
        let link = |kind: &str, name: &str, target: &str| {
            std::os::unix::fs::symlink(target, dev.join("disk").join(kind).join(name)).unwrap();
        };
        link("by-id", "wwn-0x5000c500a0b1c2d3", "../../sdb");
        link("by-id", "ata-DISK_123", "../../sdb");
        link("by-path", "pci-0000:00:1f.2-ata-1", "../../sdb");
        link("by-uuid", "0b7c1f4e", "../../sdb1");
        link("by-id", "usb-gone", "../../sdz");
        fs::write(dev.join("disk").join("by-id").join("not-a-link"), "").unwrap();

        let links = links(&dev.join("disk"));
        let sdb = fs::canonicalize(dev.join("sdb")).unwrap();
        let sdb1 = fs::canonicalize(dev.join("sdb1")).unwrap();
        let named = |kind: &str, name: &str| {
            dev.join("disk")
                .join(kind)
                .join(name)
                .to_string_lossy()
                .into_owned()
        };
        assert_eq!(
            links.get(sdb.to_str().unwrap()).unwrap(),
            &vec![
                named("by-id", "ata-DISK_123"),
                named("by-id", "wwn-0x5000c500a0b1c2d3"),
                named("by-path", "pci-0000:00:1f.2-ata-1"),
            ]
        );
        assert_eq!(
            links.get(sdb1.to_str().unwrap()).unwrap(),
            &vec![named("by-uuid", "0b7c1f4e")]
        );
        // The dangling link and the plain file name nothing.
        assert_eq!(links.len(), 2, "{links:?}");
        assert!(super::links(&root.0.join("no-udev")).is_empty());
    }

    #[test]
    fn scan_reads_disks_partitions_holders_and_skips_empty_and_virtual_devices() {
        let sys = FakeSys::new("scan");
        sys.write("sda/size", "2048\n");
        sys.write("sda/dev", "8:0\n");
        sys.write("sda/device/model", "Samsung SSD   \n");
        sys.write("sda/device/wwid", "naa.5002538e40a1b2c3\n");
        sys.write("sda/queue/rotational", "0\n");
        sys.write("sda/removable", "0\n");
        sys.write("sda/ro", "0\n");
        sys.write("sda/sda1/partition", "1\n");
        sys.write("sda/sda1/dev", "8:1\n");
        sys.write("sda/sda1/holders/dm-0", "");
        sys.write("sda/holders/md0", "");
        sys.write("vdb/size", "100\n");
        sys.write("vdb/serial", "disk-42\n");
        sys.write("vdb/queue/rotational", "1\n");
        sys.write("vdb/removable", "1\n");
        sys.write("vdb/ro", "1\n");
        sys.write("loop0/size", "0\n");
        sys.write("loop1/size", "8\n");
        sys.write("loop1/loop/backing_file", "/tmp/x.img (deleted)\n");
        sys.write("dm-0/size", "100\n");
        sys.write("zram0/size", "100\n");

        let disks = scan(&sys.0).unwrap();
        let names: Vec<&str> = disks.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["loop1", "sda", "vdb"]);

        let loop1 = &disks[0];
        assert_eq!(loop1.size_bytes, 4096);
        assert_eq!(loop1.loop_backing_file, Some(PathBuf::from("/tmp/x.img")));
        assert_eq!(loop1.dev, None);

        let sda = &disks[1];
        assert_eq!(sda.path, "/dev/sda");
        assert_eq!(sda.size_bytes, 2048 * 512);
        assert_eq!(sda.dev, Some(DevNumber { major: 8, minor: 0 }));
        assert_eq!(sda.model.as_deref(), Some("Samsung SSD"));
        assert_eq!(sda.wwn.as_deref(), Some("naa.5002538e40a1b2c3"));
        assert_eq!(sda.serial, None);
        assert!(!sda.rotational && !sda.removable && !sda.read_only);
        assert_eq!(sda.holders, ["md0"]);
        assert_eq!(
            sda.partitions,
            [Partition {
                name: "sda1".into(),
                dev: Some(DevNumber { major: 8, minor: 1 }),
                holders: vec!["dm-0".into()],
            }]
        );

        let vdb = &disks[2];
        assert_eq!(vdb.serial.as_deref(), Some("disk-42"));
        assert!(vdb.rotational && vdb.removable && vdb.read_only);
        assert!(vdb.partitions.is_empty() && vdb.holders.is_empty());
    }

    #[test]
    fn scan_reports_a_missing_sysfs() {
        let error = scan(Path::new("/nonexistent-castellan")).unwrap_err();
        assert!(error.to_string().contains("/nonexistent-castellan/block"));
    }

    #[test]
    fn dev_numbers_parse_or_not() {
        assert_eq!(
            DevNumber::parse("7:3\n"),
            Some(DevNumber { major: 7, minor: 3 })
        );
        assert_eq!(DevNumber::parse("7"), None);
        assert_eq!(DevNumber::parse("a:1"), None);
    }

    #[test]
    fn vpd_page_serial() {
        let mut page = vec![0, 0x80, 0, 6];
        page.extend_from_slice(b" S3Z1 ");
        assert_eq!(serial_from_vpd_page(&page).as_deref(), Some("S3Z1"));
        assert_eq!(serial_from_vpd_page(&[0, 0x83, 0, 0]), None);
        assert_eq!(serial_from_vpd_page(&[0, 0x80]), None);
        assert_eq!(
            serial_from_vpd_page(&[0, 0x80, 0, 4, b' ', 0, 0, b' ']),
            None
        );
        // A length past the end reads what is there.
        assert_eq!(
            serial_from_vpd_page(&[0, 0x80, 0, 9, b'A']).as_deref(),
            Some("A")
        );
    }

    const MOUNTINFO: &str = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
28 27 8:1 / /mnt/my\\040data rw shared:1 - xfs /dev/sda1 rw
29 27 0:45 / /pool rw - btrfs /dev/loop4 rw
30 27 0:5 / /dev rw - devtmpfs udev rw
garbage line
";

    #[test]
    fn mountinfo_parses_with_optional_fields_and_escapes() {
        let mounts = parse_mountinfo(MOUNTINFO);
        assert_eq!(mounts.len(), 4);
        assert_eq!(mounts[1].mount_point, "/mnt/my data");
        assert_eq!(mounts[1].source, "/dev/sda1");
        assert_eq!(mounts[1].dev, Some(DevNumber { major: 8, minor: 1 }));
        assert_eq!(unescape_octal("a\\134b\\9"), "a\\b\\9");
    }

    fn disk(name: &str, dev: (u32, u32), partitions: &[(&str, (u32, u32))]) -> Disk {
        Disk {
            name: name.into(),
            path: format!("/dev/{name}"),
            dev: Some(DevNumber {
                major: dev.0,
                minor: dev.1,
            }),
            size_bytes: 1,
            model: None,
            serial: None,
            wwn: None,
            rotational: false,
            removable: false,
            read_only: false,
            partitions: partitions
                .iter()
                .map(|(name, dev)| Partition {
                    name: (*name).into(),
                    dev: Some(DevNumber {
                        major: dev.0,
                        minor: dev.1,
                    }),
                    holders: vec![],
                })
                .collect(),
            holders: vec![],
            loop_backing_file: None,
        }
    }

    #[test]
    fn usage_matches_by_device_number_and_by_source_and_swap() {
        let mounts = parse_mountinfo(MOUNTINFO);
        let swaps = parse_swaps("Filename Type Size Used Priority\n/dev/sdc2 partition 1 0 -2\n");
        assert_eq!(swaps, ["/dev/sdc2"]);

        let root = usage_of(&disk("vda", (254, 0), &[]), &mounts, &swaps, &[]);
        assert_eq!(
            root,
            Usage {
                mount_points: vec!["/".into()],
                swap: false,
                holds_root: true
            }
        );

        let data = usage_of(
            &disk("sda", (8, 0), &[("sda1", (8, 1))]),
            &mounts,
            &swaps,
            &[],
        );
        assert_eq!(data.mount_points, ["/mnt/my data"]);
        assert!(!data.holds_root && !data.swap);

        let btrfs = usage_of(&disk("loop4", (7, 4), &[]), &mounts, &swaps, &[]);
        assert_eq!(btrfs.mount_points, ["/pool"]);

        let swap = usage_of(
            &disk("sdc", (8, 32), &[("sdc2", (8, 34))]),
            &mounts,
            &swaps,
            &[],
        );
        assert_eq!(
            swap,
            Usage {
                mount_points: vec![],
                swap: true,
                holds_root: false
            }
        );
    }
}
