//! End-to-end: the real `castellan agent` against the cluster in `CASTELLAN_KUBECONFIG`,
//! with real loop devices over sparse files. Needs root (losetup), util-linux
//! (`wipefs`, `blkid`), `sfdisk` (Debian: fdisk), e2fsprogs (`mkfs.ext4`) and
//! btrfs-progs (`mkfs.btrfs`).
//!
//! Each test runs its own agent under its own node name, allowed to see only the loop
//! devices backed by files in its own scratch directory, so tests (and other loop
//! devices on the machine) do not see each other's disks.

mod support;

use support::disks::{MIB, run, sparse_file, write_ext4, write_gpt};
use support::process;

use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use castellan_crds::block_device::{BlockDevice, BlockDeviceState};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};

/// A scratch directory, removed on drop (declare it before the loop devices over its
/// files, so they are detached first: locals drop in reverse order).
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("castellan-e2e-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self { dir }
    }

    /// A sparse file of `size` bytes.
    fn disk_file(&self, name: &str, size: u64) -> PathBuf {
        sparse_file(&self.dir, name, size)
    }

    /// The allow-list pattern matching exactly this directory's files.
    fn allow_pattern(&self) -> String {
        format!("^{}/", regex::escape(&self.dir.to_string_lossy()))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A loop device attached to a file, detached on drop.
struct LoopDevice {
    path: String,
    attached: bool,
}

impl LoopDevice {
    fn attach(file: &Path) -> Self {
        let output = run("losetup", &["--find", "--show", &file.to_string_lossy()]);
        Self {
            path: output.trim().to_string(),
            attached: true,
        }
    }

    fn detach(&mut self) {
        if self.attached {
            run("losetup", &["--detach", &self.path]);
            self.attached = false;
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if self.attached {
            let _ = Command::new("losetup")
                .args(["--detach", &self.path])
                .status();
        }
    }
}

/// A running `castellan agent`, killed on drop; its log is printed if the test failed.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    /// An agent that sees only `scratch`'s disks.
    fn start(node: &str, scratch: &Scratch) -> Self {
        Self::start_with(node, scratch, &["--device-allow", &scratch.allow_pattern()])
    }

    fn start_with(node: &str, scratch: &Scratch, extra: &[&str]) -> Self {
        let log = scratch.dir.join("agent.log");
        let log_file = File::create(&log).expect("creating the agent log");
        let child = Command::new(env!("CARGO_BIN_EXE_castellan"))
            .args(["agent", "--node-name", node])
            // A free port for /metrics, never the DaemonSet agents' 9188.
            .args(["--metrics-address", "127.0.0.1:0"])
            .args(extra)
            // A long period unless a test asks otherwise: then only uevents can explain
            // a quick update.
            .args(if extra.contains(&"--rescan-seconds") {
                &[][..]
            } else {
                &["--rescan-seconds", "600"][..]
            })
            .env("KUBECONFIG", support::kubeconfig_path())
            .env("RUST_LOG", "info,castellan::agent=debug")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("starting castellan agent");
        Self { child, log }
    }

    /// Waits until the process started as `castellan agent` runs the agent's own
    /// binary, castellan-agent beside it (it executes that binary as it starts, keeping
    /// its pid), and panics if it does not within 10 s.
    fn runs_the_agents_own_binary(&self) {
        let pid = self.child.id();
        support::cluster::wait_for(
            "the agent runs castellan-agent",
            Duration::from_secs(10),
            || process::executable(pid) == "castellan-agent",
            || format!("it runs {}", process::executable(pid)),
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- agent log ---\n{}",
                fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// Deletes a node's BlockDevices on drop.
struct NodeObjects {
    node: String,
}

impl Drop for NodeObjects {
    fn drop(&mut self) {
        let selector = format!("castellan.io/node={}", self.node);
        let _ = support::kubectl(&["delete", "blockdevices", "-l", &selector, "--wait=false"]);
    }
}

/// The identity the agent must give a loop device over `file`.
fn loop_identity(file: &Path) -> String {
    let inode = fs::metadata(file).expect("stat of a disk file").ino();
    format!("loopfile:{}@{inode}", file.display())
}

/// Polls the node's BlockDevices until one with `identity` satisfies `ready`.
async fn wait_for(
    api: &Api<BlockDevice>,
    node: &str,
    identity: &str,
    what: &str,
    ready: impl Fn(&BlockDevice) -> bool,
) -> BlockDevice {
    let deadline = Instant::now() + Duration::from_secs(30);
    let params = ListParams::default().labels(&format!("castellan.io/node={node}"));
    let mut last = None;
    while Instant::now() < deadline {
        let list = api.list(&params).await.expect("listing BlockDevices");
        let found: Vec<BlockDevice> = list
            .items
            .into_iter()
            .filter(|d| d.spec.identity == identity)
            .collect();
        assert!(
            found.len() <= 1,
            "more than one BlockDevice for {identity}: {found:#?}"
        );
        if let Some(device) = found.into_iter().next() {
            if ready(&device) {
                return device;
            }
            last = Some(device);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no BlockDevice for {identity} {what} within 30 s; last seen: {last:#?}");
}

fn state(device: &BlockDevice) -> Option<BlockDeviceState> {
    device.status.as_ref().and_then(|status| status.state)
}

fn message(device: &BlockDevice) -> String {
    device
        .status
        .as_ref()
        .and_then(|status| status.message.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn clean_ext4_gpt_and_btrfs_disks_are_reported_with_size_and_signatures() {
    let client = support::client().await;
    let api: Api<BlockDevice> = Api::all(client);
    let node = format!("e2e-discovery-{}", std::process::id());
    let _objects = NodeObjects { node: node.clone() };
    let scratch = Scratch::new("discovery");

    let clean = scratch.disk_file("clean.img", 64 * MIB);
    let ext4 = scratch.disk_file("ext4.img", 48 * MIB);
    write_ext4(&ext4);
    let gpt = scratch.disk_file("gpt.img", 32 * MIB);
    write_gpt(&gpt);

    let clean_loop = LoopDevice::attach(&clean);
    let _ext4_loop = LoopDevice::attach(&ext4);
    let _gpt_loop = LoopDevice::attach(&gpt);
    // A two-disk btrfs raid1 labelled as Castellan labels its pools: both disks carry
    // the same filesystem UUID and must still be two objects.
    let btrfs_files = [
        scratch.disk_file("btrfs-0.img", 128 * MIB),
        scratch.disk_file("btrfs-1.img", 128 * MIB),
    ];
    let btrfs_loops = btrfs_files.each_ref().map(|file| LoopDevice::attach(file));
    run(
        "mkfs.btrfs",
        &[
            "-q",
            "-f",
            "-L",
            "castellan-e2e",
            "-d",
            "raid1",
            "-m",
            "raid1",
            &btrfs_loops[0].path,
            &btrfs_loops[1].path,
        ],
    );
    let agent = Agent::start(&node, &scratch);
    agent.runs_the_agents_own_binary();

    let clean_object = wait_for(&api, &node, &loop_identity(&clean), "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    assert_eq!(clean_object.spec.size_bytes, (64 * MIB) as i64);
    assert_eq!(clean_object.spec.path, clean_loop.path);
    assert_eq!(clean_object.spec.node_name, node);
    assert!(
        clean_object.spec.signatures.is_empty(),
        "{:?}",
        clean_object.spec.signatures
    );
    assert_eq!(
        message(&clean_object),
        "",
        "a clean disk has nothing to refuse"
    );
    assert!(
        clean_object
            .name_any()
            .starts_with(&format!("{node}-loop-")),
        "{}",
        clean_object.name_any()
    );

    let ext4_object = wait_for(&api, &node, &loop_identity(&ext4), "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    assert_eq!(ext4_object.spec.size_bytes, (48 * MIB) as i64);
    assert_eq!(ext4_object.spec.signatures, ["ext4"]);
    assert_eq!(message(&ext4_object), "has an ext4 filesystem");

    let gpt_object = wait_for(&api, &node, &loop_identity(&gpt), "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    assert_eq!(gpt_object.spec.signatures, ["gpt"]);
    assert_eq!(message(&gpt_object), "has a partition table (gpt)");

    let mut btrfs_names = Vec::new();
    for file in &btrfs_files {
        let device = wait_for(&api, &node, &loop_identity(file), "Unclaimed", |d| {
            state(d) == Some(BlockDeviceState::Unclaimed)
        })
        .await;
        assert_eq!(device.spec.signatures, ["btrfs"]);
        assert_eq!(message(&device), "has a btrfs filesystem");
        btrfs_names.push(device.name_any());
    }
    assert_ne!(btrfs_names[0], btrfs_names[1]);

    let all = api
        .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
        .await
        .expect("listing BlockDevices");
    assert_eq!(
        all.items.len(),
        5,
        "only this test's disks: {:#?}",
        all.items.iter().map(|d| &d.spec.path).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn hotplug_creates_marks_missing_and_restores_the_same_object() {
    let client = support::client().await;
    let api: Api<BlockDevice> = Api::all(client);
    let node = format!("e2e-hotplug-{}", std::process::id());
    let _objects = NodeObjects { node: node.clone() };
    let scratch = Scratch::new("hotplug");

    // A first disk, so the agent's first scan shows it is up (and listening: the
    // socket opens before that scan).
    let first = scratch.disk_file("first.img", 16 * MIB);
    let _first_loop = LoopDevice::attach(&first);
    let _agent = Agent::start(&node, &scratch);
    wait_for(&api, &node, &loop_identity(&first), "after start", |d| {
        state(d).is_some()
    })
    .await;

    let hot = scratch.disk_file("hot.img", 24 * MIB);
    let identity = loop_identity(&hot);
    let attached = Instant::now();
    let mut hot_loop = LoopDevice::attach(&hot);
    let created = wait_for(&api, &node, &identity, "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    let attach_seconds = attached.elapsed().as_secs_f64();
    println!("attach -> BlockDevice Unclaimed: {attach_seconds:.2} s");
    assert_eq!(created.spec.size_bytes, (24 * MIB) as i64);
    assert_eq!(created.spec.path, hot_loop.path);
    assert!(
        attach_seconds < 2.0,
        "attach took {attach_seconds:.2} s to show (target: under 2 s)"
    );

    let detached = Instant::now();
    hot_loop.detach();
    let missing = wait_for(&api, &node, &identity, "Missing", |d| {
        state(d) == Some(BlockDeviceState::Missing)
    })
    .await;
    let detach_seconds = detached.elapsed().as_secs_f64();
    println!("detach -> BlockDevice Missing: {detach_seconds:.2} s");
    assert_eq!(missing.name_any(), created.name_any());
    assert!(
        message(&missing).contains("not attached"),
        "{}",
        message(&missing)
    );
    assert!(
        detach_seconds < 2.0,
        "detach took {detach_seconds:.2} s to show"
    );

    // Take the freed /dev/loopN with a disk this agent does not see, so the disk
    // comes back under another path: identity, not path, must find the object.
    let elsewhere = Scratch::new("hotplug-elsewhere");
    let _placeholder = LoopDevice::attach(&elsewhere.disk_file("placeholder.img", 8 * MIB));
    let reattached = Instant::now();
    let back_loop = LoopDevice::attach(&hot);
    let back = wait_for(&api, &node, &identity, "Unclaimed again", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    let reattach_seconds = reattached.elapsed().as_secs_f64();
    println!(
        "reattach -> same BlockDevice Unclaimed: {reattach_seconds:.2} s ({} -> {})",
        created.spec.path, back_loop.path
    );
    assert_eq!(
        back.name_any(),
        created.name_any(),
        "the same disk is the same object"
    );
    assert_eq!(
        back.metadata.uid, created.metadata.uid,
        "not deleted and recreated"
    );
    assert_eq!(back.spec.path, back_loop.path);
    assert_ne!(
        back_loop.path, created.spec.path,
        "the test meant to reattach under another path"
    );

    let all = api
        .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
        .await
        .expect("listing BlockDevices");
    assert_eq!(all.items.len(), 2, "no duplicate after reattach");
}

/// Deletes a Node on drop.
struct NodeObject {
    name: String,
}

impl Drop for NodeObject {
    fn drop(&mut self) {
        let _ = support::kubectl(&["delete", "node", &self.name, "--wait=false"]);
    }
}

#[tokio::test]
async fn the_node_annotation_limits_the_agent_and_devices_go_with_their_node() {
    let client = support::client().await;
    let api: Api<BlockDevice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    let node = format!("e2e-annotated-{}", std::process::id());
    let _objects = NodeObjects { node: node.clone() };
    let scratch = Scratch::new("annotated");
    let elsewhere = Scratch::new("annotated-elsewhere");

    // A Node object only: nothing runs it, which is all the agent needs to read its
    // annotation and own its BlockDevices.
    let _node_object = NodeObject { name: node.clone() };
    let node_manifest: Node = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": node,
            "annotations": { "castellan.io/device-allow": scratch.allow_pattern() },
        }
    }))
    .expect("a Node object");
    let created_node = nodes
        .create(&PostParams::default(), &node_manifest)
        .await
        .unwrap_or_else(|e| panic!("creating Node {node}: {e}"));

    let mine = scratch.disk_file("mine.img", 16 * MIB);
    let other = elsewhere.disk_file("other.img", 16 * MIB);
    let _mine_loop = LoopDevice::attach(&mine);
    let _other_loop = LoopDevice::attach(&other);
    let agent = Agent::start_with(&node, &scratch, &[]);

    let device = wait_for(&api, &node, &loop_identity(&mine), "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    let owners = device.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].name.as_str()),
        ("Node", node.as_str())
    );
    assert_eq!(Some(&owners[0].uid), created_node.metadata.uid.as_ref());

    // A rescan has happened (the object exists); give a second one, triggered by an
    // attach, the chance to pick up the other disk if the annotation were ignored.
    let trigger = scratch.disk_file("trigger.img", 8 * MIB);
    let _trigger_loop = LoopDevice::attach(&trigger);
    wait_for(&api, &node, &loop_identity(&trigger), "Unclaimed", |d| {
        state(d).is_some()
    })
    .await;
    let all = api
        .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
        .await
        .expect("listing BlockDevices");
    let identities: Vec<&str> = all.items.iter().map(|d| d.spec.identity.as_str()).collect();
    let other_identity = loop_identity(&other);
    assert!(
        !identities.contains(&other_identity.as_str()),
        "the annotation was ignored: {identities:?}"
    );
    assert_eq!(identities.len(), 2, "{identities:?}");

    // The garbage collector deletes a node's BlockDevices with the node.
    drop(agent);
    nodes
        .delete(&node, &Default::default())
        .await
        .unwrap_or_else(|e| panic!("deleting Node {node}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = api
            .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
            .await
            .expect("listing BlockDevices")
            .items
            .len();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} BlockDevices outlived their Node by 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_periodic_rescan_sees_a_filesystem_written_without_a_uevent() {
    let client = support::client().await;
    let api: Api<BlockDevice> = Api::all(client);
    let node = format!("e2e-rescan-{}", std::process::id());
    let _objects = NodeObjects { node: node.clone() };
    let scratch = Scratch::new("rescan");

    let file = scratch.disk_file("later-ext4.img", 32 * MIB);
    let disk = LoopDevice::attach(&file);
    let pattern = scratch.allow_pattern();
    let _agent = Agent::start_with(
        &node,
        &scratch,
        &["--device-allow", &pattern, "--rescan-seconds", "2"],
    );
    let identity = loop_identity(&file);
    let clean = wait_for(&api, &node, &identity, "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    assert!(clean.spec.signatures.is_empty());

    // The kernel sends no uevent for writes to a device (udevd's inotify watch would
    // synthesise one; there is no udevd here): only the periodic rescan can see this
    // (or, when tests run in parallel, a rescan another test's loop device triggered).
    run("mkfs.ext4", &["-q", "-F", &disk.path]);
    let written = Instant::now();
    // Spec and status are two writes: wait for both, or the poll can fall between them.
    let dirty = wait_for(&api, &node, &identity, "with ext4", |d| {
        d.spec.signatures == ["ext4"] && !message(d).is_empty()
    })
    .await;
    let seconds = written.elapsed().as_secs_f64();
    println!("mkfs.ext4 -> signatures [ext4] by periodic rescan: {seconds:.2} s");
    assert_eq!(dirty.name_any(), clean.name_any());
    assert_eq!(message(&dirty), "has an ext4 filesystem");
    assert!(
        seconds < 5.0,
        "a 2 s rescan took {seconds:.2} s to see the change"
    );
}

/// Deletes the admission policy and binding of a test on drop.
struct Policy {
    name: String,
}

impl Policy {
    /// Refuses the agent's inventory writes (a `lastSeen` set or changed) to the
    /// status of the BlockDevice of node `node` whose identity is `identity`: a disk
    /// whose writes keep failing, as a real API-side fault would make them. The
    /// supervisor's `Degraded` condition (no `lastSeen` change) is let through.
    fn refuse_inventory_writes(name: &str, node: &str, identity: &str, dir: &Path) -> Self {
        let yaml = format!(
            r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: {name}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - apiGroups: [castellan.io]
        apiVersions: ["*"]
        operations: [UPDATE]
        resources: [blockdevices/status]
  matchConditions:
    - name: the-faulty-disk
      expression: "object.spec.nodeName == '{node}' && object.spec.identity == '{identity}'"
  validations:
    - expression: >-
        !has(object.status) || !has(object.status.lastSeen) ||
        (has(oldObject.status) && has(oldObject.status.lastSeen) &&
         object.status.lastSeen == oldObject.status.lastSeen)
      message: "e2e: this disk's inventory writes are refused"
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {name}
spec:
  policyName: {name}
  validationActions: [Deny]
"#
        );
        let file = dir.join("policy.yaml");
        fs::write(&file, yaml).expect("writing the policy");
        support::kubectl_ok(&["apply", "-f", &file.to_string_lossy()]);
        Self {
            name: name.to_string(),
        }
    }

    fn remove(&self) {
        for kind in [
            "validatingadmissionpolicybinding",
            "validatingadmissionpolicy",
        ] {
            let _ = support::kubectl(&["delete", kind, &self.name, "--ignore-not-found"]);
        }
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        self.remove();
    }
}

fn degraded(device: &BlockDevice) -> Option<String> {
    device
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|condition| condition.type_ == "Degraded" && condition.status == "True")
        .map(|condition| format!("{}: {}", condition.reason, condition.message))
}

/// A disk whose object cannot be written: its DiskActor fails, is restarted with
/// back-off and, once it keeps failing, reported `Degraded` on its BlockDevice with a
/// Warning Event — while another disk attached at the same time is written as usual.
/// Once the writes are admitted again, the actor's next incarnation writes the object
/// and clears the condition.
#[tokio::test]
async fn a_disk_whose_writes_fail_is_reported_degraded_while_the_others_go_on_and_recovers() {
    let client = support::client().await;
    let api: Api<BlockDevice> = Api::all(client);
    let node = format!("e2e-faulty-{}", std::process::id());
    let _objects = NodeObjects { node: node.clone() };
    let scratch = Scratch::new("faulty");
    let faulty = scratch.disk_file("faulty.img", 32 * MIB);
    let good = scratch.disk_file("good.img", 32 * MIB);
    let policy = Policy::refuse_inventory_writes(
        &format!("castellan-e2e-faulty-{}", std::process::id()),
        &node,
        &loop_identity(&faulty),
        &scratch.dir,
    );
    // The API server compiles a new policy within a moment; give it one.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _faulty_loop = LoopDevice::attach(&faulty);
    let pattern = scratch.allow_pattern();
    let started = Instant::now();
    // A look every second: the faulty disk fails at each look its actor is up for.
    let _agent = Agent::start_with(
        &node,
        &scratch,
        &["--device-allow", &pattern, "--rescan-seconds", "1"],
    );
    let _good_loop = LoopDevice::attach(&good);
    let good_object = wait_for(&api, &node, &loop_identity(&good), "Unclaimed", |d| {
        state(d) == Some(BlockDeviceState::Unclaimed)
    })
    .await;
    assert_eq!(degraded(&good_object), None);

    // Five failures with 1, 2, 4 and 8 s between the restarts: about 15 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    let faulty_object = loop {
        let list = api
            .list(&ListParams::default().labels(&format!("castellan.io/node={node}")))
            .await
            .expect("listing BlockDevices");
        let found = list
            .items
            .into_iter()
            .find(|d| d.spec.identity == loop_identity(&faulty));
        if let Some(device) = found.filter(|device| degraded(device).is_some()) {
            break device;
        }
        assert!(
            Instant::now() < deadline,
            "the faulty disk was not reported Degraded within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "writes refused -> Degraded after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let reason = degraded(&faulty_object).unwrap_or_default();
    assert!(
        reason.starts_with("ActorFailing: the disk's actor failed 5 times in a row")
            && reason.contains("this disk's inventory writes are refused")
            && reason.contains("retrying in 60s"),
        "{reason}"
    );
    // Never written by the agent: no state, no lastSeen.
    assert_eq!(state(&faulty_object), None);
    let warning = support::cluster::events_about("", &faulty_object.name_any(), "Degraded");
    assert!(warning.contains("failed 5 times in a row"), "{warning}");
    // The other disk's object was kept current meanwhile (attached after the agent
    // started, so written by a look while the faulty actor was failing).
    let good_now = api
        .get(&good_object.name_any())
        .await
        .expect("reading the good disk");
    assert_eq!(state(&good_now), Some(BlockDeviceState::Unclaimed));

    // Writes admitted again: after the supervisor's cool-down (60 s) the actor is
    // restarted, writes the object and clears the condition.
    policy.remove();
    let recovered = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(100);
    loop {
        let device = api
            .get(&faulty_object.name_any())
            .await
            .expect("reading the faulty disk");
        if state(&device) == Some(BlockDeviceState::Unclaimed) && degraded(&device).is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the disk did not recover within 100 s: {:#?}",
            device.status
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "writes admitted -> Unclaimed, Degraded cleared after {:.1} s",
        recovered.elapsed().as_secs_f64()
    );
}
