//! Disks for the agent's end-to-end tests: sparse files that become loop devices, and
//! the content that makes a disk "not clearly empty" (a filesystem, a partition table),
//! and the guards that detach and unmount them whatever the outcome of a test.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub const MIB: u64 = 1024 * 1024;

/// Runs a program to success and returns its stdout; a failure fails the test.
pub fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A sparse file of `size` bytes in `dir`.
pub fn sparse_file(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    File::create(&path)
        .and_then(|file| file.set_len(size))
        .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    path
}

/// Puts an ext4 filesystem on `path`.
pub fn write_ext4(path: &Path) {
    run("mkfs.ext4", &["-q", "-F", &path.to_string_lossy()]);
}

/// Puts an empty GPT partition table on `path`.
pub fn write_gpt(path: &Path) {
    let mut sfdisk = Command::new("sfdisk")
        .args(["--quiet", &path.to_string_lossy()])
        .stdin(Stdio::piped())
        .spawn()
        .expect("running sfdisk");
    sfdisk
        .stdin
        .take()
        .expect("sfdisk stdin")
        .write_all(b"label: gpt\n")
        .expect("writing to sfdisk");
    assert!(
        sfdisk.wait().expect("waiting for sfdisk").success(),
        "sfdisk failed"
    );
}

/// Loop devices, detached on drop (after `btrfs device scan --forget`, so the kernel
/// keeps no stale btrfs member at a path the next user of the loop gets).
#[derive(Default)]
pub struct Loops {
    devices: Vec<(String, bool)>,
}

impl Loops {
    pub fn attach(&mut self, file: &Path) -> String {
        let path = run("losetup", &["--find", "--show", &file.to_string_lossy()])
            .trim()
            .to_string();
        self.devices.push((path.clone(), true));
        path
    }

    /// Forgets a device something else detached, so that the guard never detaches
    /// whoever attached that `/dev/loopN` next.
    pub fn disown(&mut self, path: &str) {
        for (device, attached) in &mut self.devices {
            if device == path {
                *attached = false;
            }
        }
    }

    pub fn detach(&mut self, path: &str) {
        for (device, attached) in &mut self.devices {
            if device == path && *attached {
                let _ = Command::new("btrfs")
                    .args(["device", "scan", "--forget", device])
                    .output();
                run("losetup", &["--detach", device]);
                *attached = false;
            }
        }
    }
}

impl Drop for Loops {
    fn drop(&mut self) {
        for (device, attached) in &self.devices {
            if *attached {
                let _ = Command::new("btrfs")
                    .args(["device", "scan", "--forget", device])
                    .output();
                let _ = Command::new("losetup").args(["--detach", device]).status();
            }
        }
    }
}

/// Mount points under `dir`, from this process's mount table.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4).map(str::to_string))
        .filter(|mount| mount.starts_with(&prefix))
        .collect()
}

/// Unmounts everything under the pool root on drop (declared after `Loops`, so it
/// runs before the loop devices are detached).
pub struct Unmount {
    pub root: PathBuf,
}

impl Unmount {
    pub fn all(&self) {
        for mount in mounts_under(&self.root).iter().rev() {
            let status = Command::new("umount").arg(mount).status();
            if !status.is_ok_and(|s| s.success()) {
                let _ = Command::new("umount").args(["--lazy", mount]).status();
            }
        }
    }
}

impl Drop for Unmount {
    fn drop(&mut self) {
        self.all();
    }
}

/// A btrfs filesystem on a loop device over a sparse file, mounted at `root`; unmounted,
/// detached and removed on drop.
pub struct Btrfs {
    // Fields drop in order: unmount before detaching.
    unmount: Unmount,
    _loops: Loops,
    file: PathBuf,
}

impl Btrfs {
    pub fn mount(root: &Path, size: u64) -> Self {
        fs::create_dir_all(root).unwrap_or_else(|e| panic!("creating {}: {e}", root.display()));
        let name = format!(
            "{}.img",
            root.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        );
        let file = sparse_file(&std::env::temp_dir(), &name, size);
        let mut loops = Loops::default();
        let device = loops.attach(&file);
        run("mkfs.btrfs", &["-q", "-f", &device]);
        run("mount", &[&device, &root.to_string_lossy()]);
        Self {
            unmount: Unmount {
                root: root.to_path_buf(),
            },
            _loops: loops,
            file,
        }
    }
}

impl Drop for Btrfs {
    fn drop(&mut self) {
        self.unmount.all();
        let _ = fs::remove_file(&self.file);
    }
}
