//! `make down` (deploy/local/nodes.sh down) leaves no storage behind: every pool
//! mounted under the cluster's state directory is unmounted and every loop device over
//! a file in it is detached, and nothing outside it is touched. Needs root (losetup,
//! mount) and btrfs-progs; no cluster: it builds in a scratch state directory exactly
//! what the agent leaves there (a raid1 pool mounted under `pools/<node>/<pool>` over
//! loop devices of `disks/<node>/`, plus a loose loop device) and runs `nodes.sh down`.

mod support;

use support::disks::{Loops, MIB, Unmount, mounts_under, run, sparse_file};

use std::path::Path;
use std::process::Command;

/// Loop devices whose backing file is under `dir`, from `losetup`.
fn loops_under(dir: &Path) -> Vec<String> {
    let prefix = format!("{}/", dir.display());
    run("losetup", &["-n", "-l", "-O", "NAME,BACK-FILE"])
        .lines()
        .filter(|line| {
            line.split_once(' ')
                .is_some_and(|(_, file)| file.trim().starts_with(&prefix))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn down_unmounts_the_pools_and_detaches_the_loop_devices_of_its_state_directory() {
    let scratch = std::env::temp_dir().join(format!("castellan-down-{}", std::process::id()));
    let dev = scratch.join("dev");
    let outside = scratch.join("outside");
    for dir in [
        dev.join("disks/node-1"),
        dev.join("pools/node-1/fast"),
        outside.clone(),
    ] {
        std::fs::create_dir_all(&dir).expect("creating the scratch directories");
    }
    // Guards in case `down` fails: the test must not leak what it made.
    let mut loops = Loops::default();
    let _unmount = Unmount {
        root: scratch.clone(),
    };

    let disks = dev.join("disks/node-1");
    let first = loops.attach(&sparse_file(&disks, "a.img", 256 * MIB));
    let second = loops.attach(&sparse_file(&disks, "b.img", 256 * MIB));
    let loose = loops.attach(&sparse_file(&disks, "loose.img", 16 * MIB));
    run(
        "mkfs.btrfs",
        &[
            "-q",
            "--label",
            "castellan-fast",
            "--data",
            "raid1",
            "--metadata",
            "raid1",
            &first,
            &second,
        ],
    );
    // The pool root is a shared self-bind (the agent's Bidirectional volume) with the
    // pool mounted under it.
    let root = dev.join("pools").to_string_lossy().into_owned();
    run("mount", &["--bind", &root, &root]);
    run("mount", &["--make-shared", &root]);
    let mount = dev.join("pools/node-1/fast");
    run("mount", &["-t", "btrfs", &first, &mount.to_string_lossy()]);
    // Another cluster's disk (outside the state directory) that `down` must leave alone.
    let foreign = loops.attach(&sparse_file(&outside, "other.img", 16 * MIB));
    assert_eq!(mounts_under(&dev).len(), 2);
    assert_eq!(loops_under(&dev).len(), 3);

    let output = Command::new(support::repo().join("deploy/local/nodes.sh"))
        .arg("down")
        .env("CASTELLAN_DEV_DIR", &dev)
        .output()
        .expect("running nodes.sh down");
    assert!(
        output.status.success(),
        "nodes.sh down failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let left = loops_under(&dev);
    for device in [&first, &second, &loose] {
        if !left
            .iter()
            .any(|line| line.starts_with(&format!("{device} ")))
        {
            loops.disown(device);
        }
    }

    assert_eq!(
        mounts_under(&dev),
        Vec::<String>::new(),
        "pools left mounted"
    );
    assert_eq!(
        loops_under(&dev),
        Vec::<String>::new(),
        "loop devices left attached"
    );
    assert_eq!(
        loops_under(&outside).len(),
        1,
        "a loop device of another directory was detached"
    );
    loops.detach(&foreign);
    let _ = std::fs::remove_dir_all(&scratch);
}
