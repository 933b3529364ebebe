//! Disks for the agent's end-to-end tests: sparse files that become loop devices, and
//! the content that makes a disk "not clearly empty" (a filesystem, a partition table).

use std::fs::File;
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
