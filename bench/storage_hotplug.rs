//! Benchmark: how fast the node agent notices a new disk and grows a pool with it, and
//! how fast it notices a failing member and replaces it.
//!
//! Against the local cluster in `CASTELLAN_KUBECONFIG` with its nodes and the agent
//! DaemonSet (`deploy/local/agent.sh up`), as root: a `single` pool on node-1, then
//! `CASTELLAN_BENCH_SAMPLES` (default 7) times a new 256 MiB loop device in node-1's disk
//! directory, timing from `losetup` returning to (a) its BlockDevice existing and (b) the
//! pool's capacity on node-1 growing. Prints every sample and min/median/max.
//!
//! Then a `raid1` pool of two 1 GiB disks on node-1 with 256 MiB of data: one member's
//! backing file is zeroed and the data read (page cache dropped) until btrfs counts the
//! errors, timing until the node's entry is `Degraded`; then a new 1 GiB disk is
//! attached, timing until the replacement starts and until the entry is `Healthy`
//! again, and the data is checked against what was written.
//! `make bench-storage` runs it; results are recorded in docs/benchmarks.md.
//!
//! Everything it makes (pool, loop devices, files, BlockDevices, the node label) is
//! removed at the end, also after a failure: deleting the pool makes the agent unmount
//! it and wipe its disks, and whatever is left is unmounted and detached here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use castellan_crds::block_device::BlockDevice;
use castellan_crds::storage_pool::{PoolNodeStatus, StoragePool};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

const NODE: &str = "node-1";
const DISK_BYTES: u64 = 256 * 1024 * 1024;
const MIB: u64 = 1024 * 1024;
/// The raid1 pool's disks: a 1 GiB pool.
const RAID1_DISK_BYTES: u64 = 1024 * MIB;
/// Data written to it before a member fails.
const DATA_BYTES: u64 = 256 * MIB;
const TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(20);

fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|error| format!("running {program}: {error}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(format!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<String, String> {
    let dev = kubeconfig.parent().unwrap_or(Path::new("."));
    let mut all = vec!["--kubeconfig", kubeconfig.to_str().unwrap_or_default()];
    all.extend_from_slice(args);
    run(&dev.join("bin/kubectl").to_string_lossy(), &all)
}

/// Milliseconds statistics of `samples` (seconds).
fn summary(samples: &[f64]) -> String {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    format!(
        "min {:.3} s  median {:.3} s  max {:.3} s  (n={})",
        sorted.first().copied().unwrap_or_default(),
        median,
        sorted.last().copied().unwrap_or_default(),
        sorted.len()
    )
}

struct Bench {
    kubeconfig: PathBuf,
    dev: PathBuf,
    pool: String,
    files: Vec<PathBuf>,
    loops: Vec<String>,
}

impl Bench {
    fn attach(&mut self, index: usize) -> Result<(String, PathBuf), String> {
        self.attach_sized(&index.to_string(), DISK_BYTES)
    }

    fn attach_sized(&mut self, name: &str, bytes: u64) -> Result<(String, PathBuf), String> {
        let dir = self.dev.join("disks").join(NODE);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let file = dir.join(format!("{}-{name}.img", self.pool));
        std::fs::File::create(&file)
            .and_then(|handle| handle.set_len(bytes))
            .map_err(|e| format!("creating {}: {e}", file.display()))?;
        self.files.push(file.clone());
        let device = run("losetup", &["--find", "--show", &file.to_string_lossy()])?;
        self.loops.push(device.clone());
        Ok((device, file))
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        for pool in [self.pool.clone(), self.raid1_pool()] {
            let _ = kubectl(
                &self.kubeconfig,
                &["delete", "storagepool", &pool, "--timeout=60s"],
            );
            // The agent unmounts a deleted pool; anything left (a failed run) goes here.
            let mount = self.dev.join("pools").join(NODE).join(&pool);
            let _ = Command::new("umount").arg(&mount).output();
        }
        for device in &self.loops {
            let _ = Command::new("btrfs")
                .args(["device", "scan", "--forget", device])
                .output();
            let _ = Command::new("losetup").args(["--detach", device]).output();
        }
        if let Ok(list) = kubectl(
            &self.kubeconfig,
            &[
                "get",
                "blockdevices",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name} {.spec.identity}{\"\\n\"}{end}",
            ],
        ) {
            for line in list.lines() {
                if let Some((name, identity)) = line.split_once(' ')
                    && identity.contains(&format!("/{}-", self.pool))
                {
                    let _ = kubectl(
                        &self.kubeconfig,
                        &["delete", "blockdevice", name, "--wait=false"],
                    );
                }
            }
        }
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
        let _ = kubectl(
            &self.kubeconfig,
            &["label", "node", NODE, "castellan.io/bench-"],
        );
    }
}

impl Bench {
    fn raid1_pool(&self) -> String {
        format!("{}-raid1", self.pool)
    }
}

/// node-1's entry of `pool`'s status.
async fn entry(pools: &Api<StoragePool>, pool: &str) -> Option<PoolNodeStatus> {
    pools
        .get(pool)
        .await
        .ok()?
        .status?
        .nodes
        .into_iter()
        .find(|entry| entry.node == NODE)
}

/// Data that is not all zeros, `DATA_BYTES` of it, written to `path`; its bytes.
fn write_data(path: &Path) -> Result<Vec<u8>, String> {
    let data: Vec<u8> = (0..DATA_BYTES as usize).map(|i| (i % 251) as u8).collect();
    std::fs::write(path, &data).map_err(|e| format!("writing {}: {e}", path.display()))?;
    run("sync", &[])?;
    Ok(data)
}

/// Reads `path` in a new process (btrfs picks a raid1 copy by the reader's pid) with
/// the page cache dropped, and checks it against `data`.
fn read_back(path: &Path, data: &[u8]) -> Result<(), String> {
    std::fs::write("/proc/sys/vm/drop_caches", "3").map_err(|e| e.to_string())?;
    let read = Command::new("cat")
        .arg(path)
        .output()
        .map_err(|e| e.to_string())?;
    if read.status.success() && read.stdout == data {
        Ok(())
    } else {
        Err(format!("{} did not read back as written", path.display()))
    }
}

/// A raid1 member fails under data and a new disk replaces it.
async fn failure_and_replacement(
    bench: &mut Bench,
    pools: &Api<StoragePool>,
) -> Result<(), String> {
    let pool = bench.raid1_pool();
    let (good, _) = bench.attach_sized("r1-a", RAID1_DISK_BYTES)?;
    let (bad, bad_file) = bench.attach_sized("r1-b", RAID1_DISK_BYTES)?;
    let object: StoragePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "StoragePool",
        "metadata": { "name": pool },
        "spec": {
            "nodeSelector": { "matchLabels": { "castellan.io/bench": bench.pool } },
            // Not the 256 MiB disks the first part released.
            "devices": { "pathPattern": "^/dev/loop[0-9]+$", "minSize": "1Gi" },
            "layout": "raid1",
            "storageClass": { "name": pool, "reclaimPolicy": "Delete" },
        }
    }))
    .map_err(|e| e.to_string())?;
    pools
        .create(&PostParams::default(), &object)
        .await
        .map_err(|e| format!("creating the raid1 pool: {e}"))?;
    wait("the raid1 pool Healthy on two disks", || async {
        entry(pools, &pool)
            .await
            .filter(|e| e.health.as_deref() == Some("Healthy") && e.disks.len() == 2)
    })
    .await?;
    let mount = bench.dev.join("pools").join(NODE).join(&pool);
    let file = mount.join("data.bin");
    let data = write_data(&file)?;
    println!(
        "raid1 pool {pool} on {good} and {bad} (1 GiB each), {} MiB written",
        DATA_BYTES / MIB
    );

    // The member turns to zeros; reads find checksum errors that btrfs counts.
    run(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={}", bad_file.display()),
            "bs=1M",
            &format!("count={}", RAID1_DISK_BYTES / MIB),
            "conv=notrunc",
            "status=none",
        ],
    )?;
    let failed = Instant::now();
    let counted = loop {
        for _ in 0..4 {
            read_back(&file, &data)?;
        }
        let stats = run("btrfs", &["device", "stats", &mount.to_string_lossy()])?;
        if stats
            .lines()
            .any(|line| line.starts_with(&format!("[{bad}].")) && !line.trim().ends_with(" 0"))
        {
            break failed.elapsed();
        }
        if failed.elapsed() > TIMEOUT {
            return Err(format!("btrfs counted no error on {bad}"));
        }
    };
    wait("the pool Degraded", || async {
        entry(pools, &pool)
            .await
            .filter(|e| e.health.as_deref() == Some("Degraded"))
    })
    .await?;
    let degraded = failed.elapsed();
    println!(
        "member zeroed → btrfs counted errors (reads with the page cache dropped): {:.3} s",
        counted.as_secs_f64()
    );
    println!(
        "member zeroed → node Degraded: {:.3} s; after the bench saw btrfs count the errors: {:.3} s (the agent reads the counters every --pool-poll-seconds, 5 s in the DaemonSet)",
        degraded.as_secs_f64(),
        (degraded - counted).as_secs_f64()
    );

    let attached = Instant::now();
    let (new, _) = bench.attach_sized("r1-c", RAID1_DISK_BYTES)?;
    let mut started = None;
    let healthy = loop {
        let now = entry(pools, &pool).await;
        if started.is_none() && now.as_ref().is_some_and(|e| e.replacement.is_some()) {
            started = Some(attached.elapsed());
        }
        if let Some(e) = &now
            && e.health.as_deref() == Some("Healthy")
            && e.disks.iter().any(|d| d.path == new)
        {
            break attached.elapsed();
        }
        if attached.elapsed() > Duration::from_secs(300) {
            return Err(format!(
                "the pool is not Healthy after the replacement: {now:#?}"
            ));
        }
        tokio::time::sleep(POLL).await;
    };
    read_back(&file, &data)?;
    let scrub_started = Instant::now();
    let scrub = run("btrfs", &["scrub", "start", "-B", &mount.to_string_lossy()])?;
    if !scrub.contains("no errors found") {
        return Err(format!(
            "the scrub after the replacement found errors: {scrub}"
        ));
    }
    println!(
        "replacement disk {new} attached → replacement running in status: {}",
        started.map_or(
            "not seen (over between two looks)".to_string(),
            |at| format!("{:.3} s", at.as_secs_f64())
        )
    );
    println!(
        "replacement disk attached → node Healthy again ({} MiB rebuilt onto it): {:.3} s",
        DATA_BYTES / MIB,
        healthy.as_secs_f64()
    );
    println!(
        "data read back identical; a scrub of both copies found no errors ({:.3} s)",
        scrub_started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn capacity(pools: &Api<StoragePool>, pool: &str) -> Option<i64> {
    let status = pools.get(pool).await.ok()?.status?;
    status
        .nodes
        .iter()
        .find(|entry| entry.node == NODE)?
        .capacity_bytes
}

async fn wait<T, F, Fut>(what: &str, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if Instant::now() > deadline {
            return Err(format!("{what}: not within {TIMEOUT:?}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let kubeconfig = PathBuf::from(std::env::var_os("CASTELLAN_KUBECONFIG").ok_or(
        "CASTELLAN_KUBECONFIG is not set: point it at a local cluster with the agent DaemonSet",
    )?);
    let samples: usize = std::env::var("CASTELLAN_BENCH_SAMPLES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(7);
    let config = Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&kubeconfig)
            .map_err(|e| format!("reading {}: {e}", kubeconfig.display()))?,
        &KubeConfigOptions::default(),
    )
    .await
    .map_err(|e| format!("loading {}: {e}", kubeconfig.display()))?;
    let client = Client::try_from(config).map_err(|e| e.to_string())?;
    let dev = kubeconfig
        .parent()
        .ok_or("the kubeconfig has no directory")?
        .to_path_buf();
    let mut bench = Bench {
        kubeconfig: kubeconfig.clone(),
        dev,
        pool: format!("bench-{}", std::process::id()),
        files: Vec::new(),
        loops: Vec::new(),
    };
    let pools = Api::<StoragePool>::all(client.clone());
    let devices = Api::<BlockDevice>::all(client.clone());

    kubectl(
        &kubeconfig,
        &[
            "label",
            "--overwrite",
            "node",
            NODE,
            &format!("castellan.io/bench={}", bench.pool),
        ],
    )?;
    let (first, _) = bench.attach(0)?;
    let pool: StoragePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "StoragePool",
        "metadata": { "name": bench.pool },
        "spec": {
            "nodeSelector": { "matchLabels": { "castellan.io/bench": bench.pool } },
            "devices": { "pathPattern": "^/dev/loop[0-9]+$" },
            "layout": "single",
            "storageClass": { "name": bench.pool, "reclaimPolicy": "Delete" },
        }
    }))
    .map_err(|e| e.to_string())?;
    pools
        .create(&PostParams::default(), &pool)
        .await
        .map_err(|e| format!("creating the pool: {e}"))?;
    let mut current = wait("the pool built on its first disk", || async {
        capacity(&pools, &bench.pool)
            .await
            .filter(|bytes| *bytes > 0)
    })
    .await?;
    println!(
        "pool {} built on {first} ({current} bytes usable)",
        bench.pool
    );

    let (mut appeared, mut grown) = (Vec::new(), Vec::new());
    for index in 1..=samples {
        let dir = bench.dev.join("disks").join(NODE);
        let name = format!("{}-{index}.img", bench.pool);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let started = Instant::now();
        let (device, file) = bench.attach(index)?;
        debug_assert_eq!(file, dir.join(&name));
        let seen = wait("the BlockDevice", || async {
            let list = devices
                .list(&ListParams::default().labels(&format!("castellan.io/node={NODE}")))
                .await
                .ok()?;
            list.items
                .iter()
                .any(|object| object.spec.path == device && object.spec.identity.contains(&name))
                .then(|| started.elapsed())
        })
        .await?;
        let before = current;
        let after = wait("the pool's growth", || async {
            capacity(&pools, &bench.pool)
                .await
                .filter(|bytes| *bytes > before)
        })
        .await?;
        let growth = started.elapsed();
        current = after;
        println!(
            "sample {index}: {device}: BlockDevice after {:.3} s, pool grown {before} → {after} bytes after {:.3} s",
            seen.as_secs_f64(),
            growth.as_secs_f64()
        );
        appeared.push(seen.as_secs_f64());
        grown.push(growth.as_secs_f64());
    }
    println!("attach → BlockDevice: {}", summary(&appeared));
    println!("attach → pool grown:  {}", summary(&grown));
    let started = Instant::now();
    pools
        .delete(&bench.pool, &DeleteParams::default())
        .await
        .map_err(|e| format!("deleting the pool: {e}"))?;
    wait("the pool released", || async {
        pools
            .get_opt(&bench.pool)
            .await
            .ok()
            .and_then(|pool| pool.is_none().then_some(()))
    })
    .await?;
    println!(
        "pool deleted → released on its node: {:.3} s",
        started.elapsed().as_secs_f64()
    );
    failure_and_replacement(&mut bench, &pools).await
}
