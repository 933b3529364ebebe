//! Btrfs: what a pool's filesystem on one node is made of — its label, where it is
//! mounted, the `mkfs.btrfs` arguments for a layout — and what `btrfs filesystem show`
//! and `btrfs filesystem usage` print about it, parsed.
//!
//! Pure: it builds argument lists and reads command output, and runs nothing. The
//! pool-member actor runs the commands (as root, on the node) and feeds the output
//! back here. The parsers are tested against output captured from btrfs-progs 6.2 on
//! loop devices.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use castellan_crds::storage_pool::Layout;

use super::disk::identity::CASTELLAN_LABEL_PREFIX;
use super::pool::claim::{LayoutShortfall, min_disks};

/// Where pools are mounted on a node, one directory per node and pool.
pub const POOL_ROOT: &str = "/var/lib/castellan/pools";

/// The filesystem label of pool `pool`: how Castellan recognises its own filesystems
/// (and identifies disks without WWN or serial, see `identity`).
pub fn label(pool: &str) -> String {
    format!("{CASTELLAN_LABEL_PREFIX}{pool}")
}

/// The pool's mount point. The node is part of it because development runs several
/// nodes on one host; in a cluster it costs one directory level.
pub fn mount_path(root: &Path, node: &str, pool: &str) -> PathBuf {
    root.join(node).join(pool)
}

/// `(data, metadata)` btrfs profiles for a layout over `devices` disks. Metadata is
/// never less redundant than data: on one disk `single` data keeps two metadata copies
/// (`dup`) and on several, mirrored ones (`raid1`).
pub fn profiles(layout: Layout, devices: usize) -> (&'static str, &'static str) {
    match layout {
        Layout::Single if devices > 1 => ("single", "raid1"),
        Layout::Single => ("single", "dup"),
        Layout::Raid1 => ("raid1", "raid1"),
        Layout::Raid10 => ("raid10", "raid10"),
    }
}

/// Arguments to `mkfs.btrfs` building pool `pool` over `devices`, or the shortfall if
/// the layout needs more disks. `--force` is deliberately absent: mkfs then refuses a
/// device that carries any signature, a last guard behind `safety` for disks claimed
/// without `allowWipe` (with it, the actor wipes them first, explicitly).
pub fn mkfs_args(
    pool: &str,
    layout: Layout,
    devices: &[&str],
) -> Result<Vec<String>, LayoutShortfall> {
    let needed = min_disks(layout);
    if devices.len() < needed {
        return Err(LayoutShortfall {
            layout,
            needed,
            available: devices.len(),
            rejected: 0,
        });
    }
    let (data, metadata) = profiles(layout, devices.len());
    let mut args: Vec<String> = [
        "--label",
        &label(pool),
        "--data",
        data,
        "--metadata",
        metadata,
    ]
    .iter()
    .map(|arg| arg.to_string())
    .collect();
    args.extend(devices.iter().map(|device| device.to_string()));
    Ok(args)
}

/// One device line of `btrfs filesystem show --raw`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShowDevice {
    pub devid: u64,
    pub size_bytes: u64,
    pub used_bytes: u64,
    /// `None` for a device btrfs knows but cannot find (`MISSING`).
    pub path: Option<String>,
}

/// What `btrfs filesystem show --raw <mount point>` says about one filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Show {
    pub label: Option<String>,
    pub uuid: String,
    pub total_devices: usize,
    pub devices: Vec<ShowDevice>,
}

impl Show {
    /// Devices the filesystem has but cannot reach: listed as `MISSING`, or not
    /// listed at all although counted in "Total devices".
    pub fn missing(&self) -> usize {
        let present = self
            .devices
            .iter()
            .filter(|device| device.path.is_some())
            .count();
        self.total_devices.saturating_sub(present)
    }
}

/// Parses the first filesystem in `btrfs filesystem show --raw` output.
pub fn parse_show(text: &str) -> Option<Show> {
    let mut lines = text.lines().map(str::trim).filter(|line| !line.is_empty());
    let header = lines.next()?.strip_prefix("Label:")?.trim();
    let (label, uuid) = header.split_once("uuid:")?;
    let label = label.trim();
    let label = (label != "none").then(|| label.trim_matches('\'').to_string());
    let mut show = Show {
        label,
        uuid: uuid.trim().to_string(),
        total_devices: 0,
        devices: Vec::new(),
    };
    for line in lines {
        if line.starts_with("Label:") {
            break;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Total", "devices", count, ..] => show.total_devices = count.parse().ok()?,
            [
                "devid",
                devid,
                "size",
                size,
                "used",
                used,
                "path",
                rest @ ..,
            ] => {
                show.devices.push(ShowDevice {
                    devid: devid.parse().ok()?,
                    size_bytes: size.parse().ok()?,
                    used_bytes: used.parse().ok()?,
                    path: match rest {
                        [path] if *path != "MISSING" => Some((*path).to_string()),
                        _ => None,
                    },
                });
            }
            _ => {}
        }
    }
    Some(show)
}

/// The figures of `btrfs filesystem usage -b` a pool's status needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Usage {
    /// Raw bytes of all devices.
    pub device_size_bytes: u64,
    /// Raw bytes the missing devices had.
    pub device_missing_bytes: u64,
    /// Bytes stored (after redundancy: what files take).
    pub used_bytes: u64,
    /// btrfs's estimate of the bytes files can still take.
    pub free_estimated_bytes: u64,
    /// Raw bytes written per byte of data (2.0 for raid1).
    pub data_ratio: f64,
}

impl Usage {
    /// Usable capacity after redundancy: raw size over the data ratio.
    pub fn usable_bytes(&self) -> u64 {
        if self.data_ratio <= 0.0 {
            return 0;
        }
        (self.device_size_bytes as f64 / self.data_ratio) as u64
    }
}

/// The error counters btrfs keeps per device of a filesystem (`btrfs device stats`),
/// cumulative over the filesystem's life: any of them above zero means the disk has
/// failed reads, writes or checksums, and the layout's other copy is what is served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceErrors {
    pub write: u64,
    pub read: u64,
    pub flush: u64,
    pub corruption: u64,
    pub generation: u64,
}

impl DeviceErrors {
    pub fn any(&self) -> bool {
        self.write + self.read + self.flush + self.corruption + self.generation > 0
    }
}

impl std::fmt::Display for DeviceErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let counts = [
            (self.read, "read"),
            (self.write, "write"),
            (self.flush, "flush"),
            (self.corruption, "corruption"),
            (self.generation, "generation"),
        ];
        let shown: Vec<String> = counts
            .iter()
            .filter(|(count, _)| *count > 0)
            .map(|(count, kind)| format!("{count} {kind}"))
            .collect();
        if shown.is_empty() {
            write!(f, "no errors")
        } else {
            write!(f, "{} errors", shown.join(", "))
        }
    }
}

/// Parses `btrfs device stats <mount point>`: `[/dev/sdb].corruption_errs  3` lines,
/// by device path. Devices btrfs cannot find show as `[devid:N]` and are left out.
pub fn parse_device_stats(text: &str) -> std::collections::BTreeMap<String, DeviceErrors> {
    let mut stats: std::collections::BTreeMap<String, DeviceErrors> = Default::default();
    for line in text.lines() {
        let Some((device, rest)) = line
            .trim()
            .strip_prefix('[')
            .and_then(|l| l.split_once("]."))
        else {
            continue;
        };
        if !device.starts_with('/') {
            continue;
        }
        let mut words = rest.split_whitespace();
        let (Some(counter), Some(Ok(count))) = (words.next(), words.next().map(str::parse::<u64>))
        else {
            continue;
        };
        let entry = stats.entry(device.to_string()).or_default();
        match counter {
            "write_io_errs" => entry.write = count,
            "read_io_errs" => entry.read = count,
            "flush_io_errs" => entry.flush = count,
            "corruption_errs" => entry.corruption = count,
            "generation_errs" => entry.generation = count,
            _ => {}
        }
    }
    stats
}

/// The progress of a running `btrfs replace`, from `btrfs replace status -1 <mount
/// point>`: `"42.5%"` while it runs (`42.5% done, 0 write errs, 0 uncorr. read errs`),
/// `None` when none runs (`Never started`, or `Started on …, finished on …`).
pub fn parse_replace_progress(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let percent = line.trim().split_once("% done")?.0;
        percent.parse::<f64>().ok().map(|_| format!("{percent}%"))
    })
}

/// Parses the "Overall" block of `btrfs filesystem usage -b`.
pub fn parse_usage(text: &str) -> Option<Usage> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let value = line.trim().strip_prefix(name)?.strip_prefix(':')?;
            value.split_whitespace().next().map(str::to_string)
        })
    };
    let bytes = |name: &str| field(name)?.parse::<u64>().ok();
    Some(Usage {
        device_size_bytes: bytes("Device size")?,
        device_missing_bytes: bytes("Device missing")?,
        used_bytes: bytes("Used")?,
        free_estimated_bytes: bytes("Free (estimated)")?,
        data_ratio: field("Data ratio")?.parse().ok()?,
    })
}

/// The volumes of a pool from `btrfs qgroup show -re --raw <mount>`: each subvolume
/// directly under `volumes/`, by name, with its referenced-bytes limit (`None` for
/// `none`). Qgroups of deleted subvolumes (`<stale>`) and anything outside `volumes/`
/// are not volumes. `None` if the output is not a qgroup table (quotas off).
pub fn parse_volume_quotas(text: &str) -> Option<BTreeMap<String, Option<u64>>> {
    let mut lines = text.lines();
    let header = lines.next()?;
    if !header.starts_with("Qgroupid") || !header.contains("Path") {
        return None;
    }
    let mut volumes = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [id, _referenced, _exclusive, limit, _exclusive_limit, path] = fields.as_slice() else {
            continue;
        };
        if !id.starts_with("0/") {
            continue;
        }
        let Some(name) = path
            .strip_prefix("volumes/")
            .filter(|name| !name.contains('/'))
        else {
            continue;
        };
        volumes.insert(name.to_string(), limit.parse::<u64>().ok());
    }
    Some(volumes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    #[test]
    fn replace_progress_only_while_a_replace_runs() {
        assert_eq!(
            super::parse_replace_progress("22.8% done, 0 write errs, 0 uncorr. read errs\n"),
            Some("22.8%".to_string())
        );
        assert_eq!(super::parse_replace_progress("Never started\n"), None);
        assert_eq!(
            super::parse_replace_progress(
                "Started on  3.Dec 20:14:53, finished on  3.Dec 20:14:53, 0 write errs, 0 uncorr. read errs\n"
            ),
            None
        );
    }

    use super::*;

    #[test]
    fn device_stats_are_read_by_device() {
        let text = "[/dev/loop0].write_io_errs    0\n[/dev/loop0].read_io_errs     0\n\
                    [/dev/loop0].flush_io_errs    0\n[/dev/loop0].corruption_errs  0\n\
                    [/dev/loop0].generation_errs  0\n[/dev/loop1].write_io_errs    0\n\
                    [/dev/loop1].read_io_errs     2\n[/dev/loop1].flush_io_errs    0\n\
                    [/dev/loop1].corruption_errs  17\n[/dev/loop1].generation_errs  0\n\
                    [devid:3].write_io_errs    0\n";
        let stats = parse_device_stats(text);
        assert_eq!(stats.len(), 2);
        assert!(!stats["/dev/loop0"].any());
        assert_eq!(
            stats["/dev/loop1"],
            DeviceErrors {
                read: 2,
                corruption: 17,
                ..Default::default()
            }
        );
        assert_eq!(
            stats["/dev/loop1"].to_string(),
            "2 read, 17 corruption errors"
        );
        assert_eq!(stats["/dev/loop0"].to_string(), "no errors");
    }

    // Captured on the development machine: a raid1 over two 300 MiB loop devices…
    const SHOW: &str = "Label: 'castellan-p1'  uuid: d8eb3e79-2675-438a-bd73-f8aec7307bd9
\tTotal devices 2 FS bytes used 147456
\tdevid    1 size 314572800 used 109051904 path /dev/loop0
\tdevid    2 size 314572800 used 109051904 path /dev/loop1

";
    // …and the same filesystem mounted `-o degraded` with the second device detached.
    const SHOW_DEGRADED: &str = "Label: 'castellan-p1'  uuid: d8eb3e79-2675-438a-bd73-f8aec7307bd9
\tTotal devices 2 FS bytes used 147456
\tdevid    1 size 314572800 used 109051904 path /dev/loop0
\tdevid    2 size 0 used 0 path  MISSING
";
    const USAGE: &str = "Overall:
    Device size:\t\t         629145600
    Device allocated:\t\t         218103808
    Device unallocated:\t\t         411041792
    Device missing:\t\t                 0
    Device slack:\t\t                 0
    Used:\t\t\t            294912
    Free (estimated):\t\t         272629760\t(min: 272629760)
    Free (statfs, df):\t\t         271581184
    Data ratio:\t\t\t              2.00
    Metadata ratio:\t\t              2.00
    Global reserve:\t\t           5767168\t(used: 0)
    Multiple profiles:\t\t                no

Data,RAID1: Size:67108864, Used:0 (0.00%)
   /dev/loop0\t  67108864
";

    // `btrfs qgroup show -re --raw` on the development machine: two volumes (one with a
    // quota), one deleted volume not yet cleaned, the top level.
    const QGROUPS: &str =
        "Qgroupid    Referenced    Exclusive  Max referenced  Max exclusive   Path 
--------    ----------    ---------  --------------  -------------   ---- 
0/5              16384        16384            none           none   <toplevel>
0/256         10469376     10469376        31457280           none   volumes/pvc-a
0/257            16384        16384            none           none   volumes/pvc-b
0/258            16384        16384            none           none   <stale>
0/259            16384        16384        1048576            none   other/nested
";

    #[test]
    fn volume_quotas_are_the_subvolumes_under_volumes() {
        let quotas = parse_volume_quotas(QGROUPS).unwrap();
        assert_eq!(
            quotas.into_iter().collect::<Vec<_>>(),
            vec![
                ("pvc-a".to_string(), Some(31457280)),
                ("pvc-b".to_string(), None)
            ]
        );
        assert_eq!(
            parse_volume_quotas("ERROR: can't list qgroups: quotas not enabled"),
            None
        );
    }

    #[test]
    fn labels_and_mount_paths_name_pool_and_node() {
        assert_eq!(label("fast"), "castellan-fast");
        assert_eq!(
            mount_path(Path::new(POOL_ROOT), "node-1", "fast"),
            PathBuf::from("/var/lib/castellan/pools/node-1/fast")
        );
    }

    #[test]
    fn profiles_per_layout_and_disk_count() {
        assert_eq!(profiles(Layout::Single, 1), ("single", "dup"));
        assert_eq!(profiles(Layout::Single, 3), ("single", "raid1"));
        assert_eq!(profiles(Layout::Raid1, 2), ("raid1", "raid1"));
        assert_eq!(profiles(Layout::Raid10, 4), ("raid10", "raid10"));
    }

    #[test]
    fn mkfs_arguments_or_the_shortfall() {
        assert_eq!(
            mkfs_args("fast", Layout::Raid1, &["/dev/loop0", "/dev/loop1"]).unwrap(),
            [
                "--label",
                "castellan-fast",
                "--data",
                "raid1",
                "--metadata",
                "raid1",
                "/dev/loop0",
                "/dev/loop1"
            ]
        );
        let shortfall =
            mkfs_args("fast", Layout::Raid10, &["/dev/a", "/dev/b", "/dev/c"]).unwrap_err();
        assert_eq!((shortfall.needed, shortfall.available), (4, 3));
        assert!(mkfs_args("fast", Layout::Single, &[]).is_err());
        assert!(
            !mkfs_args("fast", Layout::Single, &["/dev/a"])
                .unwrap()
                .contains(&"--force".to_string())
        );
    }

    #[test]
    fn show_lists_devices_and_counts_missing_ones() {
        let show = parse_show(SHOW).unwrap();
        assert_eq!(show.label.as_deref(), Some("castellan-p1"));
        assert_eq!(show.uuid, "d8eb3e79-2675-438a-bd73-f8aec7307bd9");
        assert_eq!(show.total_devices, 2);
        assert_eq!(
            show.devices[1],
            ShowDevice {
                devid: 2,
                size_bytes: 314_572_800,
                used_bytes: 109_051_904,
                path: Some("/dev/loop1".into())
            }
        );
        assert_eq!(show.missing(), 0);

        let degraded = parse_show(SHOW_DEGRADED).unwrap();
        assert_eq!(degraded.devices[1].path, None);
        assert_eq!(degraded.missing(), 1);

        // A device counted but not listed at all is missing too.
        let unlisted =
            parse_show(&SHOW_DEGRADED.replace("\tdevid    2 size 0 used 0 path  MISSING\n", ""))
                .unwrap();
        assert_eq!(unlisted.missing(), 1);
    }

    #[test]
    fn show_without_a_label_stops_at_the_next_filesystem_and_rejects_garbage() {
        let two = "Label: none  uuid: u1\n\tTotal devices 1 FS bytes used 1\n\tdevid 1 size 10 used 1 path /dev/sda\n\nLabel: 'x'  uuid: u2\n\tTotal devices 1 FS bytes used 1\n\tdevid 1 size 10 used 1 path /dev/sdb\n";
        let show = parse_show(two).unwrap();
        assert_eq!(
            (show.label, show.uuid.as_str(), show.devices.len()),
            (None, "u1", 1)
        );
        assert_eq!(parse_show(""), None);
        assert_eq!(parse_show("ERROR: not a btrfs filesystem"), None);
        assert_eq!(
            parse_show("Label: 'x'  uuid: u\n\tdevid one size 1 used 1 path /dev/a\n"),
            None
        );
    }

    #[test]
    fn usage_gives_raw_used_free_and_usable_capacity() {
        let usage = parse_usage(USAGE).unwrap();
        assert_eq!(
            usage,
            Usage {
                device_size_bytes: 629_145_600,
                device_missing_bytes: 0,
                used_bytes: 294_912,
                free_estimated_bytes: 272_629_760,
                data_ratio: 2.0,
            }
        );
        assert_eq!(usage.usable_bytes(), 314_572_800);
        assert_eq!(
            Usage {
                data_ratio: 0.0,
                ..usage
            }
            .usable_bytes(),
            0
        );
        assert_eq!(parse_usage("Overall:\n    Device size: 1\n"), None);
    }
}
