//! End-to-end: the real `castellan agent` building `StoragePool`s on two simulated
//! nodes, with real loop devices over sparse files and real btrfs, against the cluster
//! in `CASTELLAN_KUBECONFIG`. Needs root (losetup, mount), util-linux, `sfdisk`,
//! e2fsprogs and btrfs-progs.
//!
//! Each node is one agent process with its own node name, an allow-list matching only
//! its own scratch files, and a pool root in the test's scratch directory. Every loop
//! device, mount, process and object is removed by a guard, also when a test fails;
//! each test ends by asserting that nothing of its own is still mounted.

mod support;

use support::cluster::{Operator, events_about, events_regarding, http_get};
use support::disks::{Loops, MIB, Unmount, mounts_under, run, sparse_file, write_ext4, write_gpt};
use support::otel::{Receiver, spans};

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use castellan_crds::block_device::{BlockDevice, BlockDeviceState};
use castellan_crds::storage_pool::{
    PoolNodeStatus, PoolReplacement, StoragePool, StoragePoolStatus,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, watcher};

/// btrfs raid1 wants a little over 100 MiB per device; 256 MiB leaves room.
const DISK: u64 = 256 * MIB;

/// The test's scratch directory, removed on drop (declared first, dropped last).
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("castellan-pools-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self { dir }
    }

    fn node_dir(&self, node: &str) -> PathBuf {
        let dir = self.dir.join("disks").join(node);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        dir
    }

    fn pool_root(&self) -> PathBuf {
        self.dir.join("pools")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Never remove a directory with something still mounted under it.
        if mounts_under(&self.dir).is_empty() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

fn disk_file(dir: &Path, name: &str) -> PathBuf {
    sparse_file(dir, name, DISK)
}

fn ext4_file(dir: &Path, name: &str) -> PathBuf {
    let path = disk_file(dir, name);
    write_ext4(&path);
    path
}

fn gpt_file(dir: &Path, name: &str) -> PathBuf {
    let path = disk_file(dir, name);
    write_gpt(&path);
    path
}

/// A running agent, killed on drop; its log is printed if the test failed.
struct Agent {
    child: Option<Child>,
    log: PathBuf,
    node: String,
}

impl Agent {
    fn start(node: &str, disks: &Path, pool_root: &Path, log_dir: &Path) -> Self {
        Self::start_with_env(node, disks, pool_root, log_dir, &[])
    }

    fn start_with_env(
        node: &str,
        disks: &Path,
        pool_root: &Path,
        log_dir: &Path,
        env: &[(&str, &str)],
    ) -> Self {
        let log = log_dir.join(format!("agent-{node}.log"));
        let log_file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .expect("opening the agent log");
        let allow = format!("^{}/", regex::escape(&disks.to_string_lossy()));
        let child = Command::new(env!("CARGO_BIN_EXE_castellan"))
            .args(["agent", "--node-name", node, "--device-allow", &allow])
            .arg("--pool-root")
            .arg(pool_root)
            // Only uevents and pool changes trigger looks: the timer is out of the way.
            .args(["--rescan-seconds", "600", "--pool-poll-seconds", "1"])
            // Several agents run on this host: each gets a free port for /metrics
            // (logged), never the DaemonSet's 9188.
            .args(["--metrics-address", "127.0.0.1:0"])
            .env("KUBECONFIG", support::kubeconfig_path())
            .env("RUST_LOG", "info,castellan::agent=debug")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("starting castellan agent");
        Self {
            child: Some(child),
            log,
            node: node.to_string(),
        }
    }

    /// Where the agent serves `/metrics`, from its log.
    fn metrics_address(&self) -> String {
        let log = fs::read_to_string(&self.log).expect("reading the agent log");
        // One JSON object per line (the agent's default log format).
        log.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["message"] == "serving /metrics")
            .find_map(|line| line["address"].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("the agent logged no /metrics address:\n{log}"))
    }

    /// The phases the agent's actor for `pool` went through, as it logged them
    /// (`from`, `to`), in order (across restarts: the log is appended to).
    fn phases(&self, pool: &str) -> Vec<(String, String)> {
        let log = fs::read_to_string(&self.log).expect("reading the agent log");
        log.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["message"] == "pool member phase" && line["pool"] == pool)
            .map(|line| {
                let text = |key: &str| line[key].as_str().unwrap_or_default().to_string();
                (text("from"), text("to"))
            })
            .collect()
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        // The log of a failed test, or of every agent with CASTELLAN_AGENT_LOGS set.
        if std::thread::panicking() || std::env::var_os("CASTELLAN_AGENT_LOGS").is_some() {
            eprintln!(
                "--- agent log of {} ---\n{}",
                self.node,
                fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Deletes the test's Nodes, pools, StorageClasses and BlockDevices on drop.
#[derive(Default)]
struct Objects {
    nodes: Vec<String>,
    pools: Vec<String>,
    classes: Vec<String>,
    volumes: Vec<String>,
}

impl Drop for Objects {
    fn drop(&mut self) {
        for pool in &self.pools {
            // The agents that would release the pool (its finalizer) are stopped by now,
            // and the guards unmount and detach what they built.
            let _ = support::kubectl(&[
                "patch",
                "storagepool",
                pool,
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ]);
            let _ = support::kubectl(&["delete", "storagepool", pool, "--wait=false"]);
        }
        for class in &self.classes {
            let _ = support::kubectl(&["delete", "storageclass", class, "--wait=false"]);
        }
        for volume in &self.volumes {
            let _ = support::kubectl(&["delete", "pv", volume, "--wait=false"]);
        }
        for node in &self.nodes {
            let selector = format!("castellan.io/node={node}");
            let _ = support::kubectl(&["delete", "blockdevices", "-l", &selector, "--wait=false"]);
            let _ = support::kubectl(&["delete", "node", node, "--wait=false"]);
        }
    }
}

async fn create_node(nodes: &Api<Node>, name: &str, group: &str) {
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "labels": { "castellan.io/test-pools": group } }
    }))
    .expect("a Node object");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|e| panic!("creating Node {name}: {e}"));
}

async fn create_pool(pools: &Api<StoragePool>, name: &str, group: &str, layout: &str) {
    let pool: StoragePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "StoragePool",
        "metadata": { "name": name },
        "spec": {
            "nodeSelector": { "matchLabels": { "castellan.io/test-pools": group } },
            // allowWipe (set later) needs a path filter or a node list.
            "devices": { "pathPattern": "^/dev/loop[0-9]+$" },
            "layout": layout,
            "storageClass": { "name": name, "reclaimPolicy": "Delete" },
        }
    }))
    .expect("a StoragePool object");
    pools
        .create(&PostParams::default(), &pool)
        .await
        .unwrap_or_else(|e| panic!("creating StoragePool {name}: {e}"));
}

/// Polls pool `name` until the entry of `node` satisfies `ready`; returns it.
async fn wait_node(
    pools: &Api<StoragePool>,
    name: &str,
    node: &str,
    what: &str,
    ready: impl Fn(&PoolNodeStatus) -> bool,
) -> PoolNodeStatus {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    while Instant::now() < deadline {
        let pool = pools.get(name).await.expect("reading the StoragePool");
        let entry = pool
            .status
            .unwrap_or_default()
            .nodes
            .into_iter()
            .find(|entry| entry.node == node);
        if let Some(entry) = &entry
            && ready(entry)
        {
            return entry.clone();
        }
        last = entry;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("pool {name} on {node} never became {what}; last: {last:#?}");
}

/// Polls pool `name` until its status satisfies `ready`; returns it.
async fn wait_pool(
    pools: &Api<StoragePool>,
    name: &str,
    what: &str,
    ready: impl Fn(&StoragePoolStatus) -> bool,
) -> StoragePoolStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = None;
    while Instant::now() < deadline {
        let status = pools
            .get(name)
            .await
            .expect("reading the StoragePool")
            .status
            .unwrap_or_default();
        if ready(&status) {
            return status;
        }
        last = Some(status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("pool {name} never became {what}; last: {last:#?}");
}

/// Bytes as the agent writes quantities (the largest exact binary unit).
fn quantity(bytes: i64) -> String {
    for (suffix, unit) in [
        ("Ti", 1i64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

fn paths(entry: &PoolNodeStatus) -> Vec<String> {
    let mut paths: Vec<String> = entry.disks.iter().map(|d| d.path.clone()).collect();
    paths.sort();
    paths
}

fn sorted(mut paths: Vec<String>) -> Vec<String> {
    paths.sort();
    paths
}

fn btrfs_devices(mount: &Path) -> usize {
    run(
        "btrfs",
        &["filesystem", "show", "--raw", &mount.to_string_lossy()],
    )
    .lines()
    .filter(|line| line.trim_start().starts_with("devid"))
    .count()
}

/// A test's own simulated node with one pool: its disks' directory, the names, and the
/// guards that undo it all. Fields drop in order: the agent stops, the pool unmounts,
/// the loops detach, the objects go, the scratch directory goes.
struct OneNode {
    agent: Option<Agent>,
    unmount: Unmount,
    loops: Loops,
    objects: Objects,
    scratch: Scratch,
    node: String,
    pool: String,
    group: String,
    dir: PathBuf,
    node_api: Api<Node>,
    pool_api: Api<StoragePool>,
}

impl OneNode {
    /// Node `pools-n<number>-<pid>` in a group of its own, for pool `<tag>-<pid>`.
    async fn new(tag: &str, number: u32) -> Self {
        let client = support::client().await;
        let pid = std::process::id();
        let scratch = Scratch::new(tag);
        let mut this = Self {
            agent: None,
            unmount: Unmount {
                root: scratch.pool_root(),
            },
            loops: Loops::default(),
            objects: Objects::default(),
            node: format!("pools-n{number}-{pid}"),
            pool: format!("{tag}-{pid}"),
            group: format!("{tag}-{pid}"),
            dir: PathBuf::new(),
            node_api: Api::all(client.clone()),
            pool_api: Api::all(client),
            scratch,
        };
        this.objects.nodes.push(this.node.clone());
        create_node(&this.node_api, &this.node, &this.group).await;
        this.dir = this.scratch.node_dir(&this.node);
        this
    }

    /// A new 256 MiB disk of the node (its loop device path).
    fn disk(&mut self, name: &str) -> String {
        self.loops.attach(&disk_file(&self.dir, name))
    }

    fn start_agent(&mut self, env: &[(&str, &str)]) {
        self.agent = Some(Agent::start_with_env(
            &self.node,
            &self.dir,
            &self.scratch.pool_root(),
            &self.scratch.dir,
            env,
        ));
    }

    async fn create_pool(&mut self, layout: &str) {
        self.objects.pools.push(self.pool.clone());
        self.objects.classes.push(self.pool.clone());
        create_pool(&self.pool_api, &self.pool, &self.group, layout).await;
    }

    async fn wait(&self, what: &str, ready: impl Fn(&PoolNodeStatus) -> bool) -> PoolNodeStatus {
        wait_node(&self.pool_api, &self.pool, &self.node, what, ready).await
    }

    /// The pool actor's phases as its agent logged them, once the last is `from` →
    /// `to` (the phase follows the end of the pass that wrote the status a test waits
    /// for); fails after 5 s.
    async fn phases_ending(&self, from: &str, to: &str) -> Vec<(String, String)> {
        let last = (from.to_string(), to.to_string());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let phases = self
                .agent
                .as_ref()
                .map(|agent| agent.phases(&self.pool))
                .unwrap_or_default();
            if phases.last() == Some(&last) {
                return phases;
            }
            assert!(
                Instant::now() < deadline,
                "the pool's actor never went {from} -> {to}: {phases:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the agent, unmounts the pool and proves nothing of the test's is mounted.
    fn finish(mut self) {
        if let Some(mut agent) = self.agent.take() {
            agent.stop();
        }
        self.unmount.all();
        assert_eq!(mounts_under(&self.scratch.dir), Vec::<String>::new());
    }
}

#[tokio::test]
async fn raid1_on_two_nodes_claims_clean_disks_takes_dirty_ones_with_wipe_grows_and_degrades() {
    let client = support::client().await;
    let node_api: Api<Node> = Api::all(client.clone());
    let pool_api: Api<StoragePool> = Api::all(client.clone());
    let device_api: Api<BlockDevice> = Api::all(client.clone());
    let class_api: Api<StorageClass> = Api::all(client.clone());
    let pid = std::process::id();
    let group = format!("raid1-{pid}");
    let names = [format!("pools-n1-{pid}"), format!("pools-n2-{pid}")];
    let pool = format!("raid1-{pid}");

    // Declaration order is drop order reversed: agents stop, pools unmount, loops
    // detach, objects go, scratch goes.
    let scratch = Scratch::new("raid1");
    let mut objects = Objects::default();
    let mut loops = Loops::default();
    let unmount = Unmount {
        root: scratch.pool_root(),
    };
    let mut agents: Vec<Agent> = Vec::new();

    let mut clean = Vec::new();
    let mut dirty = Vec::new();
    for node in &names {
        objects.nodes.push(node.clone());
        create_node(&node_api, node, &group).await;
        let dir = scratch.node_dir(node);
        let a = loops.attach(&disk_file(&dir, "clean-a.img"));
        let b = loops.attach(&disk_file(&dir, "clean-b.img"));
        let ext4 = loops.attach(&ext4_file(&dir, "ext4.img"));
        let gpt = loops.attach(&gpt_file(&dir, "gpt.img"));
        clean.push(vec![a, b]);
        dirty.push((ext4, gpt));
        agents.push(Agent::start(node, &dir, &scratch.pool_root(), &scratch.dir));
    }

    objects.pools.push(pool.clone());
    objects.classes.push(pool.clone());
    let created = Instant::now();
    create_pool(&pool_api, &pool, &group, "raid1").await;

    // Exactly the clean disks, and a reason for each dirty one.
    for (i, node) in names.iter().enumerate() {
        let entry = wait_node(&pool_api, &pool, node, "Healthy with two disks", |e| {
            e.health.as_deref() == Some("Healthy") && e.disks.len() == 2
        })
        .await;
        println!(
            "{node}: raid1 pool built {:.2} s after the StoragePool was created",
            created.elapsed().as_secs_f64()
        );
        assert_eq!(paths(&entry), sorted(clean[i].clone()));
        let (ext4, gpt) = &dirty[i];
        let reason = |path: &str| {
            entry
                .rejected
                .iter()
                .find(|r| r.path == path)
                .map(|r| r.reason.clone())
                .unwrap_or_else(|| panic!("no rejection for {path}: {entry:#?}"))
        };
        assert_eq!(reason(ext4), "has an ext4 filesystem (allowWipe is off)");
        assert!(
            reason(gpt).starts_with("has a partition table (gpt)")
                && reason(gpt).ends_with("(allowWipe is off)"),
            "{}",
            reason(gpt)
        );
        let capacity = entry.capacity_bytes.expect("capacityBytes");
        assert!(
            capacity > 200 * MIB as i64 && capacity <= DISK as i64,
            "raid1 of two 256 MiB disks has about 256 MiB usable, not {capacity}"
        );
        assert_eq!(entry.allocated_bytes, Some(0));
        assert_eq!(entry.free_bytes, Some(capacity));

        let mount = scratch.pool_root().join(node).join(&pool);
        assert!(mounts_under(&mount).contains(&mount.to_string_lossy().into_owned()));
        assert_eq!(btrfs_devices(&mount), 2);
        let profiles = run("btrfs", &["filesystem", "df", &mount.to_string_lossy()]);
        assert!(profiles.contains("Data, RAID1"), "{profiles}");
        // Quotas are on: qgroups can be listed.
        run("btrfs", &["qgroup", "show", &mount.to_string_lossy()]);

        let members = device_api
            .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
            .await
            .expect("listing BlockDevices");
        for device in &members.items {
            let status = device.status.clone().unwrap_or_default();
            if clean[i].contains(&device.spec.path) {
                assert_eq!(status.state, Some(BlockDeviceState::InUse), "{device:#?}");
                assert_eq!(status.pool.as_deref(), Some(pool.as_str()));
            } else {
                assert_eq!(
                    status.state,
                    Some(BlockDeviceState::Unclaimed),
                    "{device:#?}"
                );
            }
        }
    }
    // Totals over both nodes: two raid1 pools of two 256 MiB disks each.
    let totals = wait_pool(&pool_api, &pool, "Ready with totals", |status| {
        status.phase.as_deref() == Some("Ready") && status.ready_nodes == Some(2)
    })
    .await;
    let per_node: i64 = totals.nodes.iter().filter_map(|n| n.capacity_bytes).sum();
    assert_eq!(
        totals.capacity.as_deref(),
        Some(quantity(per_node).as_str())
    );
    assert_eq!(totals.allocated.as_deref(), Some("0"));
    let ready = totals
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("a Ready condition");
    assert_eq!(ready.status, "True", "{ready:#?}");

    let class = class_api.get(&pool).await.expect("the StorageClass");
    assert_eq!(class.provisioner, "castellan.io/local");
    assert_eq!(
        class.volume_binding_mode.as_deref(),
        Some("WaitForFirstConsumer")
    );
    assert_eq!(class.allow_volume_expansion, Some(true));

    // Data written now must survive a lost disk later.
    let n2_mount = scratch.pool_root().join(&names[1]).join(&pool);
    fs::write(n2_mount.join("kept.txt"), b"still here").expect("writing to the pool");
    run("sync", &[]);

    // allowWipe: the dirty disks join, wiped.
    let wiped = Instant::now();
    pool_api
        .patch(
            &pool,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "devices": { "allowWipe": true } } })),
        )
        .await
        .expect("setting allowWipe");
    for (i, node) in names.iter().enumerate() {
        let entry = wait_node(&pool_api, &pool, node, "four disks with allowWipe", |e| {
            e.disks.len() == 4 && e.rejected.is_empty()
        })
        .await;
        println!(
            "{node}: dirty disks wiped and joined {:.2} s after allowWipe was set",
            wiped.elapsed().as_secs_f64()
        );
        let mut expected = clean[i].clone();
        expected.extend([dirty[i].0.clone(), dirty[i].1.clone()]);
        assert_eq!(paths(&entry), sorted(expected));
        assert_eq!(entry.health.as_deref(), Some("Healthy"));
    }

    // Hotplug: a new clean disk on node 1 joins its pool.
    let before = wait_node(&pool_api, &pool, &names[0], "settled", |e| {
        e.disks.len() == 4
    })
    .await
    .capacity_bytes
    .unwrap_or_default();
    let dir = scratch.node_dir(&names[0]);
    let file = disk_file(&dir, "hotplug.img");
    let attached = Instant::now();
    let new = loops.attach(&file);
    let grown = wait_node(&pool_api, &pool, &names[0], "grown by the new disk", |e| {
        e.disks.iter().any(|d| d.path == new) && e.capacity_bytes.unwrap_or_default() > before
    })
    .await;
    println!(
        "{}: {:.2} s from attaching {new} to pool growth ({} -> {} bytes usable)",
        names[0],
        attached.elapsed().as_secs_f64(),
        before,
        grown.capacity_bytes.unwrap_or_default()
    );
    assert_eq!(grown.disks.len(), 5);

    // A lost member: node 2's agent stops (a node restart), the pool is unmounted and
    // one member is detached; the restarted agent mounts it degraded and says why.
    agents[1].stop();
    run("umount", &[&n2_mount.to_string_lossy()]);
    let lost = clean[1][0].clone();
    loops.detach(&lost);
    let restarted = Instant::now();
    agents[1] = Agent::start_with_env(
        &names[1],
        &scratch.node_dir(&names[1]),
        &scratch.pool_root(),
        &scratch.dir,
        // Missing for 5 s counts as failed (300 s by default).
        &[("CASTELLAN_MISSING_GRACE_SECONDS", "5")],
    );
    let degraded = wait_node(&pool_api, &pool, &names[1], "Degraded", |e| {
        e.health.as_deref() == Some("Degraded")
    })
    .await;
    println!(
        "{}: Degraded {:.2} s after the agent restarted with a member missing: {}",
        names[1],
        restarted.elapsed().as_secs_f64(),
        degraded.message.clone().unwrap_or_default()
    );
    let message = degraded.message.clone().unwrap_or_default();
    assert!(message.contains("1 disk is missing"), "{message}");
    assert!(
        degraded
            .disks
            .iter()
            .any(|d| d.path == lost && d.state.as_deref() == Some("Missing"))
            || degraded
                .disks
                .iter()
                .any(|d| d.state.as_deref() == Some("Missing")),
        "{degraded:#?}"
    );
    let totals = wait_pool(&pool_api, &pool, "Degraded as a whole", |status| {
        status.phase.as_deref() == Some("Degraded")
    })
    .await;
    let condition = totals
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .expect("a Degraded condition");
    assert_eq!(
        (condition.status.as_str(), condition.message.as_str()),
        ("True", format!("degraded on {}", names[1]).as_str())
    );
    // Past the grace period the missing member counts as failed, with no event from
    // outside to prompt a look.
    let failed = wait_node(
        &pool_api,
        &pool,
        &names[1],
        "the missing member failed",
        |e| e.disks.iter().any(|d| d.state.as_deref() == Some("Failed")),
    )
    .await;
    println!(
        "{}: the missing member counted as failed {:.2} s after the agent restarted (grace 5 s)",
        names[1],
        restarted.elapsed().as_secs_f64()
    );
    let message = failed.message.clone().unwrap_or_default();
    assert!(
        message.contains("missing for longer than the grace period, so counted as failed"),
        "{message}"
    );
    assert!(
        restarted.elapsed() >= Duration::from_secs(5),
        "failed before its grace"
    );
    assert_eq!(
        fs::read_to_string(n2_mount.join("kept.txt")).expect("reading from the degraded pool"),
        "still here"
    );

    // A new clean disk on node 2 replaces the member that never came back (by its
    // btrfs device id: it has no path): Healthy again, the lost disk no longer the
    // pool's.
    let replacement = loops.attach(&disk_file(&scratch.node_dir(&names[1]), "spare.img"));
    let attached = Instant::now();
    let healthy = wait_node(
        &pool_api,
        &pool,
        &names[1],
        "Healthy after the replacement",
        |e| e.health.as_deref() == Some("Healthy"),
    )
    .await;
    println!(
        "{}: Healthy {:.2} s after a replacement for the missing member was attached",
        names[1],
        attached.elapsed().as_secs_f64()
    );
    assert!(
        healthy.disks.iter().any(|d| d.path == replacement)
            && healthy
                .disks
                .iter()
                .all(|d| d.state.as_deref() == Some("Online")),
        "{healthy:#?}"
    );
    // By name: the replacement may well have taken the lost disk's loop device path.
    let lost_name = failed
        .disks
        .iter()
        .find(|d| d.state.as_deref() == Some("Failed"))
        .map(|d| d.block_device.clone())
        .expect("the failed member's entry");
    let lost_status = Api::<BlockDevice>::all(support::client().await)
        .get(&lost_name)
        .await
        .expect("reading the lost disk's BlockDevice")
        .status
        .unwrap_or_default();
    assert_eq!(
        (lost_status.pool, lost_status.state),
        (None, Some(BlockDeviceState::Missing))
    );
    assert_eq!(
        fs::read_to_string(n2_mount.join("kept.txt")).expect("reading after the replacement"),
        "still here"
    );

    // Clean up explicitly, then prove nothing of ours is mounted.
    for agent in &mut agents {
        agent.stop();
    }
    unmount.all();
    assert_eq!(mounts_under(&scratch.dir), Vec::<String>::new());
}

#[tokio::test]
async fn raid1_with_one_disk_is_refused_with_a_reason() {
    let mut setup = OneNode::new("lonely", 3).await;
    let disk = setup.disk("only.img");
    setup.start_agent(&[]);
    setup.create_pool("raid1").await;
    let entry = setup
        .wait("Pending", |e| {
            e.health.as_deref() == Some("Pending") && e.message.is_some()
        })
        .await;
    assert_eq!(
        entry.message.as_deref(),
        Some("no filesystem built: layout raid1 needs at least 2 disks, and 1 disk can be claimed")
    );
    assert!(entry.disks.is_empty(), "{entry:#?}");
    assert_eq!(entry.capacity_bytes, None);
    let signatures = run("wipefs", &["--no-act", &disk]);
    assert!(
        signatures.trim().is_empty(),
        "the disk was touched: {signatures}"
    );

    // The node leaves the pool's selector: its entry goes (on the next look, which a
    // new disk's uevent triggers), and the totals follow.
    setup
        .node_api
        .patch(
            &setup.node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": { "labels": { "castellan.io/test-pools": null } }
            })),
        )
        .await
        .expect("removing the Node's label");
    setup.disk("trigger.img");
    let left = wait_pool(
        &setup.pool_api,
        &setup.pool,
        "without the node's entry",
        |status| status.nodes.is_empty() && status.ready_nodes == Some(0),
    )
    .await;
    assert_eq!(left.phase.as_deref(), Some("Pending"), "{left:#?}");
    setup.finish();
}

/// A btrfs filesystem of someone else's over two disks, mounted through the first: the
/// mount table names only that one, but the second is just as much in use. A pool that
/// may wipe (`allowWipe`) and whose filter matches both takes neither, and says why.
#[tokio::test]
async fn a_foreign_two_device_btrfs_with_one_member_mounted_is_never_touched() {
    let mut setup = OneNode::new("foreign", 4).await;
    let foreign_mount = setup.scratch.dir.join("foreign");
    fs::create_dir_all(&foreign_mount).expect("creating the foreign mount point");
    let unmount_foreign = Unmount {
        root: foreign_mount.clone(),
    };
    let first = setup.disk("foreign-a.img");
    let second = setup.disk("foreign-b.img");
    run(
        "mkfs.btrfs",
        &[
            "-q", "-f", "-d", "raid1", "-m", "raid1", "-L", "theirs", &first, &second,
        ],
    );
    run("mount", &[&first, &foreign_mount.to_string_lossy()]);
    fs::write(foreign_mount.join("theirs.txt"), b"not yours").expect("writing their file");
    run("sync", &[]);
    setup.start_agent(&[]);

    setup.create_pool("single").await;
    setup
        .pool_api
        .patch(
            &setup.pool,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "devices": { "allowWipe": true } } })),
        )
        .await
        .expect("setting allowWipe");
    let mounted_at = format!("is mounted at {}", foreign_mount.display());
    let entry = setup
        .wait("both members refused", |e| {
            [&first, &second]
                .iter()
                .all(|path| e.rejected.iter().any(|r| &&r.path == path))
        })
        .await;
    for path in [&first, &second] {
        let reason = entry
            .rejected
            .iter()
            .find(|r| &r.path == path)
            .map(|r| r.reason.as_str())
            .unwrap_or_default();
        assert!(
            reason.starts_with(&mounted_at) && !reason.contains("allowWipe"),
            "{path}: {reason} ({entry:#?})"
        );
    }
    assert!(entry.disks.is_empty(), "{entry:#?}");
    // A few more looks, then: both members still theirs, the file still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let show = run(
        "btrfs",
        &["filesystem", "show", &foreign_mount.to_string_lossy()],
    );
    assert!(
        show.contains(&first) && show.contains(&second) && show.contains("theirs"),
        "{show}"
    );
    assert_eq!(
        fs::read_to_string(foreign_mount.join("theirs.txt")).expect("reading their file"),
        "not yours"
    );
    assert!(
        run("wipefs", &["--no-act", &second]).contains("btrfs"),
        "the unmounted member was wiped"
    );

    unmount_foreign.all();
    setup.finish();
}

/// A mkfs that fails halfway does not wedge the pool. The disk's backing file lives on
/// a 1 MiB tmpfs, so `mkfs.btrfs` writes its first megabyte and then fails (the loop
/// device's writes hit ENOSPC). The node's entry says `Failed` with mkfs's error, the
/// disk half-written but never mounted as a member; the pool's actor retries with
/// back-off. Once the tmpfs has room, a retry builds the pool: `Healthy` on that disk,
/// with no other trigger than the actor's own retry (no uevent, no pool change, the
/// periodic look 600 s away).
#[tokio::test]
async fn a_mkfs_that_fails_halfway_does_not_wedge_the_pool() {
    let mut setup = OneNode::new("halfway", 9).await;
    let small = setup.dir.join("small");
    fs::create_dir_all(&small).expect("creating the tmpfs mount point");
    run(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=1m",
            "castellan-e2e-halfway",
            &small.to_string_lossy(),
        ],
    );
    // Dropped before `setup`: the loop device still holds the file, so it is a lazy
    // unmount, completed when the loop device is detached.
    let tmpfs = Unmount {
        root: small.clone(),
    };
    let file = sparse_file(&small, "half.img", DISK);
    let disk = setup.loops.attach(&file);
    setup.start_agent(&[]);
    setup.create_pool("single").await;

    let failed = setup
        .wait("Failed by mkfs", |e| {
            e.health.as_deref() == Some("Failed")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains("mkfs.btrfs"))
        })
        .await;
    let written = fs::metadata(&file).map(|m| m.blocks() * 512).unwrap_or(0);
    println!(
        "mkfs failed after writing {} KiB: {}",
        written / 1024,
        failed.message.as_deref().unwrap_or_default()
    );
    assert!(written > 0, "mkfs wrote nothing before failing");
    let mount = setup
        .scratch
        .pool_root()
        .join(&setup.node)
        .join(&setup.pool);
    assert!(
        !mounts_under(&setup.scratch.pool_root())
            .iter()
            .any(|m| Path::new(m) == mount),
        "a half-built pool was mounted"
    );

    run(
        "mount",
        &["-o", "remount,size=512m", &small.to_string_lossy()],
    );
    let grown = Instant::now();
    let healthy = setup
        .wait("Healthy after the retry", |e| {
            e.health.as_deref() == Some("Healthy") && e.disks.len() == 1
        })
        .await;
    println!(
        "room made -> Healthy after {:.1} s (the pool actor's back-off)",
        grown.elapsed().as_secs_f64()
    );
    assert_eq!(paths(&healthy), vec![disk.clone()]);
    assert_eq!(btrfs_devices(&mount), 1);
    // The pool's actor went through its phases: formatting failed it, and a later
    // incarnation formatted, mounted and reached Healthy.
    let phases = setup.phases_ending("Mounting", "Healthy").await;
    let pair = |from: &str, to: &str| (from.to_string(), to.to_string());
    assert_eq!(
        phases.first(),
        Some(&pair("Planning", "Formatting")),
        "{phases:?}"
    );
    assert!(phases.contains(&pair("Formatting", "Failed")), "{phases:?}");
    assert_eq!(
        phases[phases.len() - 3..],
        [
            pair("Planning", "Formatting"),
            pair("Formatting", "Mounting"),
            pair("Mounting", "Healthy")
        ],
        "{phases:?}"
    );
    // Lazily: the loop device holds its file until `finish` detaches it.
    tmpfs.all();
    setup.finish();
}

/// A pool's creation is a trace: the agent exports over OTLP as the operator does, the
/// pool actor's `pool pass` span with the commands it ran (`pool step`: mkfs, mount,
/// quota) under it.
#[tokio::test]
async fn a_pools_creation_is_a_trace() {
    let receiver = Receiver::start(25410);
    let mut setup = OneNode::new("traced", 5).await;
    setup.disk("traced.img");
    setup.start_agent(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:25410"),
        // Exported within half a second: the agent is killed, not stopped.
        ("OTEL_BSP_SCHEDULE_DELAY", "500"),
    ]);
    setup.create_pool("single").await;
    setup
        .wait("Healthy", |e| e.health.as_deref() == Some("Healthy"))
        .await;

    let deadline = Instant::now() + Duration::from_secs(30);
    let (root, steps) = loop {
        let found = spans(&receiver.traces());
        let agent_spans: Vec<_> = found
            .iter()
            .filter(|span| span.service == "castellan-agent")
            .collect();
        let built = agent_spans.iter().find_map(|root| {
            let steps: Vec<_> = agent_spans
                .iter()
                .filter(|span| span.name == "pool step" && span.parent == root.id)
                .collect();
            (root.name == "pool pass" && steps.len() >= 3).then(|| ((*root).clone(), steps.len()))
        });
        if let Some(built) = built {
            break built;
        }
        assert!(
            Instant::now() < deadline,
            "no pool pass span with its steps from castellan-agent in {}: {:?}",
            receiver.traces().display(),
            agent_spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "pool {}: trace {} with {steps} steps (mkfs, mount, quota)",
        setup.pool, root.trace
    );

    setup.finish();
}

/// A raid1 member that returns garbage (its backing file zeroed under the mounted pool)
/// is noticed from btrfs's own error counters within seconds of the reads that hit it:
/// its BlockDevice `Failed`, the node's pool `Degraded` with the errors named, a
/// `DiskFailing` Event, and the data still read intact from the other copy. A clean
/// disk attached then replaces it (`btrfs replace`): the pool is Healthy on the good
/// disk and the new one, the data read intact throughout, the old disk left `Failed`
/// and no longer the pool's: detaching it leaves the pool Healthy.
#[tokio::test]
async fn a_raid1_member_with_checksum_errors_is_reported_failing_and_replaced() {
    let mut setup = OneNode::new("failing", 6).await;
    let device_api: Api<BlockDevice> = Api::all(support::client().await);
    let good = setup.disk("good.img");
    let bad = setup.disk("bad.img");
    let bad_file = setup.dir.join("bad.img");
    setup.start_agent(&[]);
    setup.create_pool("raid1").await;
    setup
        .wait("Healthy with two disks", |e| {
            e.health.as_deref() == Some("Healthy") && e.disks.len() == 2
        })
        .await;
    let (node, pool) = (setup.node.clone(), setup.pool.clone());
    let mount = setup.scratch.pool_root().join(&node).join(&pool);
    // A volume of the pool on the node, bound to a claim: it is told its pool's health.
    let namespace = support::TestNamespace::create(&support::client().await, "pools-health").await;
    let claims: Api<PersistentVolumeClaim> =
        Api::namespaced(support::client().await, &namespace.name);
    let volume = bound_volume(&mut setup, &namespace.name, &mount).await;
    // 32 MiB of data that is not all zeros, on both copies.
    let data: Vec<u8> = (0..32 * MIB as usize).map(|i| (i % 251) as u8).collect();
    fs::write(mount.join("kept.bin"), &data).expect("writing to the pool");
    run("sync", &[]);

    // The member's blocks turn to zeros behind btrfs's back (the loop device reads the
    // file); reads with the page cache dropped then hit checksum errors on it, which
    // btrfs repairs from the other copy and counts.
    run(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={}", bad_file.display()),
            "bs=1M",
            "count=256",
            "conv=notrunc",
            "status=none",
        ],
    );
    let corrupted = Instant::now();
    let deadline = corrupted + Duration::from_secs(60);
    loop {
        fs::write("/proc/sys/vm/drop_caches", "3").expect("dropping the page cache");
        // Separate processes: btrfs picks a raid1 copy by the reader's pid.
        for _ in 0..4 {
            let read = Command::new("cat")
                .arg(mount.join("kept.bin"))
                .output()
                .expect("reading the file");
            assert!(read.status.success(), "reading from the pool failed");
            assert!(read.stdout == data, "the pool returned other data");
        }
        let stats = run("btrfs", &["device", "stats", &mount.to_string_lossy()]);
        if stats
            .lines()
            .any(|line| line.starts_with(&format!("[{bad}].")) && !line.trim().ends_with(" 0"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "btrfs counted no error on {bad}: {stats}"
        );
    }
    let counted = Instant::now();
    let entry = setup
        .wait("Degraded by the failing disk", |e| {
            e.health.as_deref() == Some("Degraded")
        })
        .await;
    println!(
        "{node}: Degraded {:.2} s after btrfs counted the errors ({:.2} s after the corruption)",
        counted.elapsed().as_secs_f64(),
        corrupted.elapsed().as_secs_f64()
    );
    let message = entry.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("1 disk reports I/O or checksum errors: ") && message.contains(&bad),
        "{message}"
    );
    let states: Vec<(String, Option<String>)> = entry
        .disks
        .iter()
        .map(|d| (d.path.clone(), d.state.clone()))
        .collect();
    assert!(
        states.contains(&(bad.clone(), Some("Failing".into()))),
        "{states:?}"
    );
    assert!(
        entry.disks.iter().all(|d| !d.block_device.is_empty()),
        "every disk named by its BlockDevice, the zeroed one too: {:?}",
        entry.disks
    );
    assert!(
        states.contains(&(good.clone(), Some("Online".into()))),
        "{states:?}"
    );
    let devices = device_api
        .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
        .await
        .expect("listing BlockDevices");
    let failed = devices
        .items
        .iter()
        .find(|device| device.spec.path == bad)
        .and_then(|device| device.status.clone())
        .unwrap_or_default();
    assert_eq!(failed.state, Some(BlockDeviceState::Failed), "{failed:?}");
    let events = events_about("", &pool, "DiskFailing");
    assert!(events.contains(&bad), "no DiskFailing Event: {events:?}");
    // The agent's metrics say the same, as an alert reads them.
    let address = setup.agent.as_ref().expect("the agent").metrics_address();
    let (code, metrics) = http_get(&address, "/metrics");
    assert_eq!(code, 200, "{metrics}");
    let series =
        |name: &str, labels: &str| format!("{name}{{node=\"{node}\",pool=\"{pool}\"{labels}}}");
    for line in [
        format!(
            "{} 1.0\n",
            series("castellan_pool_health", ",health=\"Degraded\"")
        ),
        format!(
            "{} 1.0\n",
            series("castellan_pool_members", ",state=\"Failing\"")
        ),
        format!(
            "{} 1.0\n",
            series("castellan_pool_members", ",state=\"Online\"")
        ),
    ] {
        assert!(metrics.contains(&line), "{line:?} missing from:\n{metrics}");
    }
    let corruption = metrics
        .lines()
        .find(|line| {
            line.starts_with(&series(
                "castellan_device_errors_total",
                &format!(",device=\"{bad}\",kind=\"corruption\""),
            ))
        })
        .and_then(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no corruption counter of {bad}:\n{metrics}"));
    assert!(corruption > 0, "{metrics}");
    assert!(
        metrics.contains(&format!(
            "castellan_pool_capacity_bytes{{node=\"{node}\",pool=\"{pool}\"}}"
        )),
        "{metrics}"
    );
    assert_eq!(
        fs::read(mount.join("kept.bin")).expect("reading after the failure"),
        data
    );
    assert!(
        message.contains("a clean disk of at least")
            && message.contains(&format!("replaces {bad}")),
        "the status says what replaces the failed disk: {message}"
    );
    // The volume and its claim are told: annotations, a condition, an Event.
    let claim = wait_claim_health(&claims, &volume, "Degraded").await;
    let condition = claim
        .status
        .and_then(|status| status.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|condition| condition.type_ == "PoolHealthy")
        .expect("a PoolHealthy condition on the claim");
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_deref()),
        ("False", Some("Degraded"))
    );
    assert!(
        condition.message.unwrap_or_default().contains(&bad),
        "the claim's condition names the failing disk"
    );
    let degraded_events = events_about(&namespace.name, &volume, "VolumeDegraded");
    assert!(
        degraded_events.contains(&pool),
        "no VolumeDegraded Event on the claim: {degraded_events:?}"
    );
    // The PersistentVolume itself is told too (it has no conditions, so an Event and
    // the annotations): cluster-scoped, so its Event is in `default`.
    let persistent_volume = claim
        .spec
        .as_ref()
        .and_then(|spec| spec.volume_name.clone())
        .expect("the claim names its volume");
    let volume_events = events_regarding(
        "default",
        "PersistentVolume",
        &persistent_volume,
        "VolumeDegraded",
    );
    assert!(
        volume_events.contains(&format!("pool {pool} is Degraded on node {node}")),
        "no VolumeDegraded Event on PersistentVolume {persistent_volume}: {volume_events:?}"
    );

    // A new clean disk on the node replaces the failed one; the data is read (page
    // cache dropped) all along.
    // Every version of the pool's status from here on: the replacement is in status
    // while it runs, however short that is (a 1 GiB copy can end between two polls).
    let replacements = watch_replacements(&setup).await;
    let new = setup.disk("new.img");
    let attached = Instant::now();
    let mut reads = 0;
    let healthy = loop {
        fs::write("/proc/sys/vm/drop_caches", "3").expect("dropping the page cache");
        let read = Command::new("cat")
            .arg(mount.join("kept.bin"))
            .output()
            .expect("reading the file");
        assert!(
            read.status.success() && read.stdout == data,
            "the data read during the replacement"
        );
        reads += 1;
        if let Some(entry) = setup_entry(&setup).await
            && entry.health.as_deref() == Some("Healthy")
        {
            break entry;
        }
        assert!(
            attached.elapsed() < Duration::from_secs(90),
            "the pool is not Healthy 90 s after the replacement disk came: {:#?}",
            setup_entry(&setup).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let seen = replacements.stop();
    println!(
        "{node}: Healthy {:.2} s after the replacement disk was attached ({reads} reads of the data meanwhile); replacement in status: {seen:?}",
        attached.elapsed().as_secs_f64()
    );
    assert!(
        seen.iter()
            .any(|r| r.path == new && r.failed.contains(&bad) && !r.block_device.is_empty()),
        "status.nodes[].replacement named the failed disk and its replacement while it ran: {seen:?}"
    );
    let states: Vec<(String, Option<String>)> = healthy
        .disks
        .iter()
        .map(|d| (d.path.clone(), d.state.clone()))
        .collect();
    assert_eq!(
        sorted(states.iter().map(|(path, _)| path.clone()).collect()),
        sorted(vec![good.clone(), new.clone()]),
        "{states:?}"
    );
    assert!(
        states
            .iter()
            .all(|(_, state)| state.as_deref() == Some("Online")),
        "{states:?}"
    );
    let listed = run(
        "btrfs",
        &["filesystem", "show", "--raw", &mount.to_string_lossy()],
    );
    assert!(
        listed.contains(&new) && !listed.contains(&bad),
        "the filesystem has the new disk, not the failed one:\n{listed}"
    );
    let devices = device_api
        .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
        .await
        .expect("listing BlockDevices");
    let status_of = |path: &str| {
        devices
            .items
            .iter()
            .find(|device| device.spec.path == path)
            .and_then(|device| device.status.clone())
            .unwrap_or_default()
    };
    let old = status_of(&bad);
    assert_eq!(old.state, Some(BlockDeviceState::Failed), "{old:?}");
    assert!(
        old.message
            .as_deref()
            .unwrap_or_default()
            .contains("replaced by"),
        "{old:?}"
    );
    assert_eq!(
        old.pool, None,
        "the replaced disk is no longer the pool's: {old:?}"
    );
    assert_eq!(status_of(&new).state, Some(BlockDeviceState::InUse));
    let events = events_about("", &pool, "DiskReplaced");
    assert!(events.contains(&new), "no DiskReplaced Event: {events:?}");
    wait_claim_health(&claims, &volume, "Healthy").await;
    let healthy_events = events_about(&namespace.name, &volume, "VolumeHealthy");
    assert!(
        healthy_events.contains("healthy again"),
        "no VolumeHealthy Event on the claim: {healthy_events:?}"
    );
    let healthy_events = events_regarding(
        "default",
        "PersistentVolume",
        &persistent_volume,
        "VolumeHealthy",
    );
    assert!(
        healthy_events.contains("healthy again"),
        "no VolumeHealthy Event on PersistentVolume {persistent_volume}: {healthy_events:?}"
    );
    let started = events_about("", &pool, "DiskReplacing");
    assert!(
        started.contains(&format!("replacing {bad}")) && started.contains(&new),
        "no DiskReplacing Event: {started:?}"
    );
    // Every block of the data checks out on both copies (scrub reads them all).
    let scrub = run("btrfs", &["scrub", "start", "-B", &mount.to_string_lossy()]);
    assert!(scrub.contains("no errors found"), "{scrub}");
    assert_eq!(
        fs::read(mount.join("kept.bin")).expect("reading after the replacement"),
        data
    );

    // The old disk is detached, as its message invites: it is Missing, and the pool,
    // which no longer counts it, stays Healthy.
    let old_name = devices
        .items
        .iter()
        .find(|device| device.spec.path == bad)
        .map(|device| device.name_any())
        .expect("the replaced disk's BlockDevice");
    setup.loops.detach(&bad);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = device_api
            .get(&old_name)
            .await
            .expect("reading the replaced disk's BlockDevice")
            .status
            .and_then(|status| status.state);
        if state == Some(BlockDeviceState::Missing) {
            break;
        }
        assert!(Instant::now() < deadline, "never Missing: {state:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Passes after the detach have run (the look that marked it Missing ran them).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = setup_entry(&setup).await.expect("the node's entry");
    assert_eq!(after.health.as_deref(), Some("Healthy"), "{after:#?}");
    assert_eq!(
        sorted(after.disks.iter().map(|d| d.path.clone()).collect()),
        sorted(vec![good.clone(), new.clone()]),
        "{after:#?}"
    );

    setup.finish();
}

/// A pool scrubbed on its schedule (`* * * * *` here): a member whose blocks were
/// zeroed behind btrfs's back, never read since, is found by the scrub, which rewrites
/// the bad copies from the good one: the scrub `Repaired` with the counts in the node's
/// status and a `ScrubRepaired` Event, the member failing, the data intact; the next
/// slot in the status; `suspend` stops the schedule.
#[tokio::test]
async fn a_scheduled_scrub_finds_and_repairs_silent_corruption() {
    let mut setup = OneNode::new("scrub", 7).await;
    setup.disk("one.img");
    let bad = setup.disk("two.img");
    let bad_file = setup.dir.join("two.img");
    setup.start_agent(&[]);
    setup.create_pool("raid1").await;
    setup
        .wait("Healthy with two disks", |e| {
            e.health.as_deref() == Some("Healthy") && e.disks.len() == 2
        })
        .await;
    let entry = setup
        .wait("the monthly schedule in status", |e| e.scrub.is_some())
        .await;
    let next = entry.scrub.and_then(|scrub| scrub.next).unwrap_or_default();
    assert!(
        next.ends_with("-01T03:00:00Z"),
        "by default the first of the month at 03:00 UTC: {next}"
    );
    let mount = setup
        .scratch
        .pool_root()
        .join(&setup.node)
        .join(&setup.pool);
    let data: Vec<u8> = (0..32 * MIB as usize).map(|i| (i % 251) as u8).collect();
    fs::write(mount.join("kept.bin"), &data).expect("writing to the pool");
    run("sync", &[]);
    // Silent corruption: every block after the first MiB of one member turns to zeros,
    // and nothing reads it before the scrub does.
    run(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={}", bad_file.display()),
            "bs=1M",
            "seek=1",
            "count=255",
            "conv=notrunc",
            "status=none",
        ],
    );
    fs::write("/proc/sys/vm/drop_caches", "3").expect("dropping the page cache");
    let scheduled = Instant::now();
    setup
        .pool_api
        .patch(
            &setup.pool,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "scrub": { "schedule": "* * * * *" } } })),
        )
        .await
        .expect("scheduling scrubs every minute");
    let deadline = scheduled + Duration::from_secs(120);
    let scrub = loop {
        let scrub = setup_entry(&setup).await.and_then(|entry| entry.scrub);
        if let Some(scrub) = &scrub
            && scrub.last_finished.is_some()
        {
            break scrub.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no scrub ended within 120 s of the every-minute schedule: {scrub:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "{}: scrub ended {:.1} s after the every-minute schedule was set: {:?} {:?}",
        setup.node,
        scheduled.elapsed().as_secs_f64(),
        scrub.phase,
        scrub.result
    );
    assert_eq!(scrub.phase.as_deref(), Some("Repaired"), "{scrub:#?}");
    let result = scrub.result.clone().unwrap_or_default();
    assert!(
        result.contains("checksum") && result.contains("all corrected from the good copy"),
        "{result}"
    );
    let started = scrub.last_started.clone().unwrap_or_default();
    let next = scrub.next.clone().unwrap_or_default();
    assert!(
        next.ends_with(":00Z") && next > started,
        "the next slot, a minute boundary after {started}: {next}"
    );
    let events = events_about("", &setup.pool, "ScrubRepaired");
    assert!(
        events.contains("all corrected"),
        "no ScrubRepaired Event: {events:?}"
    );
    // btrfs counted the errors on the member: it is reported failing.
    let entry = setup
        .wait("Degraded by the member the scrub found bad", |e| {
            e.health.as_deref() == Some("Degraded")
        })
        .await;
    assert!(
        entry.message.as_deref().unwrap_or_default().contains(&bad),
        "{entry:#?}"
    );
    fs::write("/proc/sys/vm/drop_caches", "3").expect("dropping the page cache");
    assert_eq!(
        fs::read(mount.join("kept.bin")).expect("reading after the scrub"),
        data
    );

    setup
        .pool_api
        .patch(
            &setup.pool,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "scrub": { "suspend": true } } })),
        )
        .await
        .expect("suspending scrubs");
    setup
        .wait("scrubs suspended", |e| {
            e.scrub.as_ref().and_then(|s| s.next.as_deref()) == Some("none: scrub.suspend is true")
        })
        .await;

    setup.finish();
}

/// A node that never comes back (its agent stopped for good) keeps its part of a deleted
/// pool; the declared way out is `castellan.io/release-nodes` on the pool, which the
/// operator (`--release-pools`) carries out: the node's entry goes, its volume without a
/// claim is let go, one whose claim still exists is kept and named; once that claim is
/// deleted and the request made again, the pool goes.
#[tokio::test]
async fn a_pool_on_a_node_that_never_returns_is_released_on_request() {
    let mut setup = OneNode::new("release", 8).await;
    setup.disk("only.img");
    setup.start_agent(&[]);
    setup.create_pool("single").await;
    setup
        .wait("Healthy", |e| e.health.as_deref() == Some("Healthy"))
        .await;
    let mount = setup
        .scratch
        .pool_root()
        .join(&setup.node)
        .join(&setup.pool);
    let namespace = support::TestNamespace::create(&support::client().await, "pools-release").await;
    let claimed = bound_volume(&mut setup, &namespace.name, &mount).await;
    // A volume of the node whose claim is gone, with the agent's finalizer: only its
    // agent would let it go.
    let orphan = format!("{}-orphan", setup.pool);
    setup.objects.volumes.push(orphan.clone());
    let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": orphan,
            "labels": { "castellan.io/node": setup.node, "castellan.io/pool": setup.pool },
            "finalizers": ["castellan.io/volume"],
        },
        "spec": {
            "capacity": { "storage": "1Mi" },
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": setup.pool,
            "local": { "path": setup.scratch.dir.to_string_lossy() },
            "nodeAffinity": { "required": { "nodeSelectorTerms": [{ "matchExpressions": [
                { "key": "kubernetes.io/hostname", "operator": "In", "values": [setup.node] }
            ]}]}},
            "claimRef": { "namespace": namespace.name, "name": "gone" },
        }
    }))
    .expect("a PersistentVolume");
    let volumes = Api::<PersistentVolume>::all(support::client().await);
    volumes
        .create(&PostParams::default(), &pv)
        .await
        .expect("creating the orphan volume");

    // The node is lost: its agent never runs again. The pool is deleted and stays.
    if let Some(mut agent) = setup.agent.take() {
        agent.stop();
    }
    setup.unmount.all();
    support::kubectl_ok(&["delete", "storagepool", &setup.pool, "--wait=false"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stuck = setup
        .pool_api
        .get(&setup.pool)
        .await
        .expect("the pool stays");
    assert!(stuck.metadata.deletion_timestamp.is_some());

    let _operator = Operator::start_with(&namespace.name, "127.0.77.1:8080", &["--release-pools"]);
    let requested = Instant::now();
    support::kubectl_ok(&[
        "annotate",
        "storagepool",
        &setup.pool,
        &format!("castellan.io/release-nodes={}", setup.node),
    ]);
    let released = wait_pool(
        &setup.pool_api,
        &setup.pool,
        "the node's entry released",
        |status| !status.nodes.iter().any(|entry| entry.node == setup.node),
    )
    .await;
    println!(
        "{}: released {:.2} s after the request",
        setup.node,
        requested.elapsed().as_secs_f64()
    );
    assert!(released.nodes.is_empty(), "{released:#?}");
    // The request is removed once carried out (after the entry: wait for it).
    let mut served = false;
    for _ in 0..50 {
        let pool = setup
            .pool_api
            .get(&setup.pool)
            .await
            .expect("the pool stays: a claim remains");
        if !pool
            .annotations()
            .contains_key("castellan.io/release-nodes")
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(served, "the request is removed once carried out");
    let mut gone = false;
    for _ in 0..50 {
        if volumes
            .get_opt(&orphan)
            .await
            .expect("reading the orphan")
            .is_none()
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "the volume without a claim was let go");
    assert!(
        volumes.get_opt(&claimed).await.expect("reading").is_some(),
        "the volume under a claim is kept"
    );
    let kept = events_about("", &setup.pool, "VolumesKept");
    assert!(
        kept.contains(&claimed),
        "no VolumesKept Event naming it: {kept:?}"
    );

    // The claim goes; asked again, the pool is released entirely.
    support::kubectl_ok(&[
        "delete",
        "pvc",
        &claimed,
        "-n",
        &namespace.name,
        "--wait=false",
    ]);
    support::kubectl_ok(&[
        "annotate",
        "storagepool",
        &setup.pool,
        &format!("castellan.io/release-nodes={}", setup.node),
    ]);
    let mut deleted = false;
    for _ in 0..150 {
        if setup
            .pool_api
            .get_opt(&setup.pool)
            .await
            .expect("reading the pool")
            .is_none()
        {
            deleted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(deleted, "the deleted pool goes once nothing of it is left");
    let events = events_about("", &setup.pool, "NodeReleased");
    assert!(events.contains("so it goes"), "{events:?}");

    setup.finish();
}

/// A claim in `namespace` bound to a volume of the test's pool on its node, as the
/// agent would have provisioned (labels, node affinity, a path in the pool); the
/// claim's and the volume's name.
/// A node that comes back without any disk of its pool (rebooted without them) does
/// not build the pool anew on another clean disk: that would bring the pool back empty
/// under volumes that had data. It says why and waits; the disk's return brings the
/// pool back with its data; deleting the missing disk's BlockDevice (the user giving
/// that data up) builds the pool anew on the clean disk.
#[tokio::test]
async fn a_pool_whose_disks_are_all_missing_is_not_rebuilt_on_other_disks() {
    let mut setup = OneNode::new("lost", 10).await;
    let first = setup.disk("first.img");
    setup.start_agent(&[]);
    setup.create_pool("single").await;
    let healthy = setup
        .wait("Healthy", |e| {
            e.health.as_deref() == Some("Healthy") && e.disks.len() == 1
        })
        .await;
    let member = healthy.disks[0].block_device.clone();
    let mount = setup
        .scratch
        .pool_root()
        .join(&setup.node)
        .join(&setup.pool);
    fs::write(mount.join("kept"), "acknowledged").expect("writing into the pool");
    run("sync", &[]);

    // The node restarts without its disk, and a clean one is attached instead.
    let reboot_without = |setup: &mut OneNode, disk: &str| {
        if let Some(mut agent) = setup.agent.take() {
            agent.stop();
        }
        setup.unmount.all();
        setup.loops.detach(disk);
    };
    reboot_without(&mut setup, &first);
    let spare_file = setup.dir.join("spare.img");
    let spare = setup.disk("spare.img");
    setup.start_agent(&[]);
    let waiting = setup
        .wait("Failed with its member missing", |e| {
            e.health.as_deref() == Some("Failed")
                && e.message.as_deref().is_some_and(|m| m.contains("missing"))
        })
        .await;
    let message = waiting.message.clone().unwrap_or_default();
    println!("all members missing: {message}");
    assert!(
        message.contains(&member),
        "names the missing disk: {message}"
    );
    assert!(
        message.contains("delete its BlockDevice"),
        "says how to give the data up: {message}"
    );
    setup.phases_ending("Planning", "Blocked").await;
    // Give a wrong pass time to happen, then prove none did: the clean disk carries
    // nothing and is nobody's, and nothing is mounted.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        run("wipefs", &["--noheadings", &spare]).trim(),
        "",
        "the spare was written"
    );
    assert!(
        !mounts_under(&setup.scratch.pool_root())
            .iter()
            .any(|m| Path::new(m) == mount),
        "a new pool was mounted"
    );
    let devices = Api::<BlockDevice>::all(support::client().await);
    let spare_object = devices
        .list(&ListParams::default().labels(&format!("castellan.io/node={}", setup.node)))
        .await
        .expect("listing the node's BlockDevices")
        .items
        .into_iter()
        // The spare may have the path the lost disk had: not that disk's object.
        .find(|device| device.spec.path == spare && device.name_any() != member)
        .expect("the spare's BlockDevice");
    let status = spare_object.status.clone().unwrap_or_default();
    assert_eq!(
        (status.state, status.pool.as_deref()),
        (Some(BlockDeviceState::Unclaimed), None),
        "the spare was claimed"
    );

    // The disk comes back (the spare taken out first, so it does not join): the pool
    // is mounted again with what was written on it.
    setup.loops.detach(&spare);
    let back = setup.loops.attach(&setup.dir.join("first.img"));
    setup
        .wait("Healthy on its own disk again", |e| {
            e.health.as_deref() == Some("Healthy") && paths(e) == vec![back.clone()]
        })
        .await;
    assert_eq!(
        fs::read_to_string(mount.join("kept")).expect("reading the pool's data"),
        "acknowledged"
    );

    // The disk is lost for good, and the user says so by deleting its BlockDevice: the
    // pool is built anew, empty, on the clean disk.
    reboot_without(&mut setup, &back);
    let spare = setup.loops.attach(&spare_file);
    setup.start_agent(&[]);
    setup
        .wait("Failed with its member missing again", |e| {
            e.health.as_deref() == Some("Failed")
                && e.message.as_deref().is_some_and(|m| m.contains(&member))
        })
        .await;
    let given_up = Instant::now();
    support::kubectl_ok(&["delete", "blockdevice", &member]);
    setup
        .wait("Healthy on the spare", |e| {
            e.health.as_deref() == Some("Healthy") && paths(e) == vec![spare.clone()]
        })
        .await;
    println!(
        "BlockDevice deleted -> pool built anew on the spare in {:.1} s",
        given_up.elapsed().as_secs_f64()
    );
    assert!(!mount.join("kept").exists(), "a new pool starts empty");
    setup.finish();
}

async fn bound_volume(setup: &mut OneNode, namespace: &str, mount: &Path) -> String {
    let name = format!("{}-vol", setup.pool);
    setup.objects.volumes.push(name.clone());
    let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": { "castellan.io/node": setup.node, "castellan.io/pool": setup.pool },
        },
        "spec": {
            "capacity": { "storage": "1Mi" },
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": setup.pool,
            "local": { "path": mount.to_string_lossy() },
            "nodeAffinity": { "required": { "nodeSelectorTerms": [{ "matchExpressions": [
                { "key": "kubernetes.io/hostname", "operator": "In", "values": [setup.node] }
            ]}]}},
            "claimRef": { "namespace": namespace, "name": name },
        }
    }))
    .expect("a PersistentVolume");
    Api::<PersistentVolume>::all(support::client().await)
        .create(&PostParams::default(), &pv)
        .await
        .expect("creating the volume");
    let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": setup.pool,
            "volumeName": name,
            "resources": { "requests": { "storage": "1Mi" } },
        }
    }))
    .expect("a PersistentVolumeClaim");
    Api::<PersistentVolumeClaim>::namespaced(support::client().await, namespace)
        .create(&PostParams::default(), &claim)
        .await
        .expect("creating the claim");
    name
}

/// Waits until claim `name` says its pool is `health`; returns it.
async fn wait_claim_health(
    claims: &Api<PersistentVolumeClaim>,
    name: &str,
    health: &str,
) -> PersistentVolumeClaim {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let claim = claims.get(name).await.expect("reading the claim");
        if claim
            .annotations()
            .get("castellan.io/pool-health")
            .map(String::as_str)
            == Some(health)
        {
            return claim;
        }
        assert!(
            Instant::now() < deadline,
            "claim {name} not told its pool is {health}: {:?}",
            claim.metadata.annotations
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The test node's entry in its pool's status, if any.
/// The `replacement` entries of a node's pool status, every version the API server
/// served while the watch ran.
struct Replacements {
    seen: Arc<Mutex<Vec<PoolReplacement>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Replacements {
    fn stop(self) -> Vec<PoolReplacement> {
        self.task.abort();
        self.seen.lock().expect("the watch's record").clone()
    }
}

async fn watch_replacements(setup: &OneNode) -> Replacements {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (api, pool, node) = (
        setup.pool_api.clone(),
        setup.pool.clone(),
        setup.node.clone(),
    );
    let (started, watching) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let seen = seen.clone();
        async move {
            let config = watcher::Config::default().fields(&format!("metadata.name={pool}"));
            let mut events = std::pin::pin!(watcher(api, config));
            let mut started = Some(started);
            while let Some(event) = events.next().await {
                let object = match event {
                    Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => object,
                    Ok(watcher::Event::InitDone) => {
                        if let Some(started) = started.take() {
                            let _ = started.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let replacement = object
                    .status
                    .unwrap_or_default()
                    .nodes
                    .into_iter()
                    .find(|entry| entry.node == node)
                    .and_then(|entry| entry.replacement);
                if let Some(replacement) = replacement {
                    let mut seen = seen.lock().expect("the watch's record");
                    if seen.last() != Some(&replacement) {
                        seen.push(replacement);
                    }
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), watching)
        .await
        .expect("the StoragePool watch started within 10 s")
        .expect("the StoragePool watch ran");
    Replacements { seen, task }
}

async fn setup_entry(setup: &OneNode) -> Option<PoolNodeStatus> {
    setup
        .pool_api
        .get(&setup.pool)
        .await
        .expect("reading the StoragePool")
        .status
        .unwrap_or_default()
        .nodes
        .into_iter()
        .find(|entry| entry.node == setup.node)
}
