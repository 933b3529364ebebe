//! Benchmark: the operator's and the node agent's footprint with many clusters, the
//! latency from a spec change to the operator's first action, and the same figures for
//! CloudNativePG's operator side by side.
//!
//! Against the local cluster in `CASTELLAN_KUBECONFIG` (`make bench-scale` brings up
//! its own, port base 56000, and tears it down). The measured operator and agent are
//! the release build, as deployed (deploy/release/build.sh; the directory is in
//! `CASTELLAN_RELEASE`), run as host processes so that /proc gives their memory and
//! CPU time; the nodes run the same release build's instance managers (`make
//! bench-scale` gives them an image map that says so). Three parts:
//!
//! 1. **Castellan, real clusters.** `BENCH_CLUSTERS` (default 100) single-instance
//!    PostgreSQL 15 clusters (`shared_buffers` 16MB, `max_connections` 20: small pods)
//!    applied in steps (0, 10, 50, 100): at each step, once every cluster is Ready and
//!    30 s have passed, the operator's resident set (VmRSS, its anonymous and file-backed
//!    parts, the peak VmHWM) and threads. At the last step, the CPU seconds per minute
//!    at idle of the operator and of a node agent (node-1's, with a raid1 pool on two
//!    loop disks: an edge box's agent), over 60 s.
//!    Then the operator is restarted onto the clusters (killed; its successor waits for
//!    the Lease): every cluster actor starts at once, a burst the steps never see. Its
//!    resident set and open sockets 90 s after it leads.
//! 2. **Spec change → first action.** The operator restarted the same way, with traces
//!    exported to a real OTLP receiver (deploy/otel/receiver.sh), then every cluster's
//!    `spec.parameters.work_mem` changed, one after another (0.3 s apart). From the
//!    operator's own trace of each change: the `reconcile` span that started with it to
//!    the first `instance api call` of the reload it sent (operator-internal), and from
//!    the moment the bench sent the PATCH to that call (same clock: everything runs on
//!    this machine), p50 and p99.
//! 3. **Side by side with CloudNativePG** (`bench/cnpg.sh`; skipped with
//!    `BENCH_PEER=0`). Its instance pods cannot run on the process-backed nodes (its
//!    image layout differs), so both operators are compared in the same state: the
//!    same number of their cluster objects in a namespace whose StorageClass has no
//!    volumes, so every claim and pod stays Pending. Per operator, alone: the resident
//!    set 30 s after it has acted on all of them, and, for 20 more clusters created
//!    one at a time, the time from the cluster's creation to the first object it owns
//!    (a watch of the namespace's Services, Secrets, ConfigMaps, claims, pods and Jobs
//!    sees both; the creation's watch event starts the clock). Printed as ratios.
//!
//! Figures are recorded in docs/benchmarks.md.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use castellan_crds::DatabaseCluster;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::runtime::watcher;

use support::cluster::{LocalVolumes, Operator, apply_cluster, wait_for};
use support::disks::{Loops, sparse_file};
use support::{TestNamespace, client, kubeconfig_path, kubectl, kubectl_ok};

/// The operators' metrics addresses: beside `make test`'s (127.0.64.x) and the other
/// benchmarks' (127.0.63.1–2).
const OPERATOR: &str = "127.0.63.3:8080";
const TRACED_OPERATOR: &str = "127.0.63.4:8080";
const PEER_OPERATOR: &str = "127.0.63.5:8080";
/// The OTLP receiver's ports (HTTP, and gRPC one above): below the ephemeral range,
/// apart from the tests' 25400–25411.
const OTLP_PORT: u16 = 25420;
/// Clusters created one at a time for the creation → first owned object latency.
const LATENCY_SAMPLES: usize = 20;

fn release_binary() -> PathBuf {
    let binary = std::env::var_os("CASTELLAN_RELEASE")
        .map(|dir| PathBuf::from(dir).join("castellan"))
        .expect(
            "CASTELLAN_RELEASE names no directory: `make bench-scale` builds the release \
             binaries (deploy/release/build.sh) and sets it",
        );
    assert!(
        binary.exists(),
        "{} is missing: `make bench-scale` builds it (deploy/release/build.sh)",
        binary.display()
    );
    binary
}

/// What /proc says of a process' memory.
#[derive(Clone, Debug)]
struct Memory {
    rss: u64,
    peak: u64,
    anon: u64,
    file: u64,
    threads: u64,
    /// Open sockets: the API server connections, mostly.
    sockets: usize,
}

fn memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    Memory {
        rss: field("VmRSS"),
        peak: field("VmHWM"),
        anon: field("RssAnon"),
        file: field("RssFile"),
        threads: field("Threads"),
        sockets: support::socket_inodes(pid).len(),
    }
}

/// The process' user + system CPU time so far, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/stat: {e}"));
    // Fields after the command name (which may hold spaces) in parentheses: utime and
    // stime are the 14th and 15th of the line, the 12th and 13th after it.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    ticks as f64 / clock_ticks()
}

/// The kernel's clock ticks per second, asked once.
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        let output = Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("getconf");
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .expect("CLK_TCK")
    })
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

/// How many of the namespace's DatabaseClusters are Ready with their one instance.
fn ready(ns: &str) -> usize {
    kubectl_ok(&[
        "get",
        "dbc",
        "-n",
        ns,
        "-o",
        "jsonpath={range .items[*]}{.status.phase}/{.status.readyInstances}{\"\\n\"}{end}",
    ])
    .lines()
    .filter(|line| *line == "Ready/1")
    .count()
}

fn wait_ready(ns: &str, count: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let now = ready(ns);
        if now >= count {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {now} of {count} clusters Ready after {timeout:?}:\n{}",
            kubectl(&["get", "dbc,pods", "-n", ns])
                .stdout
                .escape_ascii()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The node agent of node-1 as a host process, seeing only the bench's two loop disks,
/// with a raid1 pool built on them.
struct Agent {
    child: Child,
    _loops: Loops,
    dir: PathBuf,
}

impl Agent {
    fn start(program: &Path) -> Self {
        let dir = std::env::temp_dir().join(format!("bench-scale-agent-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("pools")).expect("the agent's directory");
        let mut loops = Loops::default();
        for name in ["a", "b"] {
            loops.attach(&sparse_file(&dir, name, 1024 * support::disks::MIB));
        }
        let log = std::fs::File::create(dir.join("agent.log")).expect("the agent's log");
        let allow = format!("^{}/[ab]$", regex::escape(&dir.to_string_lossy()));
        let child = Command::new(program)
            .args(["agent", "--node-name", "node-1", "--device-allow", &allow])
            .arg("--pool-root")
            .arg(dir.join("pools"))
            .args(["--metrics-address", "127.0.0.1:0"])
            .env("KUBECONFIG", kubeconfig_path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting the agent");
        let pool = "apiVersion: castellan.io/v1alpha1\nkind: StoragePool\n\
             metadata: {name: bench-edge}\nspec:\n  \
             nodeSelector: {matchLabels: {kubernetes.io/hostname: node-1}}\n  \
             devices: {pathPattern: \"^/dev/loop[0-9]+$\", minSize: 512Mi}\n  \
             layout: raid1\n  storageClass: {name: bench-edge, reclaimPolicy: Delete}\n";
        let manifest = dir.join("pool.yaml");
        std::fs::write(&manifest, pool).expect("writing the pool");
        kubectl_ok(&["apply", "-f", &manifest.to_string_lossy()]);
        let deadline = Instant::now() + Duration::from_secs(180);
        let ready_nodes = || {
            kubectl_ok(&[
                "get",
                "storagepool",
                "bench-edge",
                "-o",
                "jsonpath={.status.readyNodes}",
            ])
        };
        while ready_nodes() != "1" {
            assert!(
                Instant::now() < deadline,
                "the agent did not build its raid1 pool within 180 s: {}\n{}",
                kubectl(&["get", "storagepool", "bench-edge", "-o", "yaml"])
                    .stdout
                    .escape_ascii(),
                std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        Self {
            child,
            _loops: loops,
            dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Deleting the pool makes the agent unmount it; then the disks can go.
        let _ = kubectl(&[
            "delete",
            "storagepool",
            "bench-edge",
            "--wait=true",
            "--timeout=60s",
        ]);
        let _ = self.child.kill();
        let _ = self.child.wait();
        for mount in support::disks::mounts_under(&self.dir) {
            let _ = Command::new("umount").arg(&mount).status();
        }
    }
}

fn apply_small(ns: &str, name: &str, class: &str, work_mem: Option<&str>) {
    let work_mem = work_mem
        .map(|w| format!(", work_mem: {w}"))
        .unwrap_or_default();
    apply_cluster(
        ns,
        name,
        1,
        class,
        &format!("  parameters: {{shared_buffers: 16MB, max_connections: \"20\"{work_mem}}}\n"),
    );
}

/// Part 1: the footprint at each step.
fn footprint(ns: &str, class: &str, operator: &Operator, steps: &[usize]) -> Vec<(usize, Memory)> {
    let mut samples = Vec::new();
    let mut applied = 0;
    for &step in steps {
        let started = Instant::now();
        while applied < step {
            applied += 1;
            apply_small(ns, &format!("s{applied:03}"), class, None);
        }
        wait_ready(ns, step, Duration::from_secs(1800));
        if step > 0 {
            println!(
                "{step} clusters Ready, {:.0} s after the step's first apply",
                started.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_secs(30));
        let sample = memory(operator.pid());
        println!(
            "operator with {step:>3} clusters: RSS {:.1} MiB (anon {:.1}, file {:.1}), peak {:.1} MiB, {} threads",
            mib(sample.rss),
            mib(sample.anon),
            mib(sample.file),
            mib(sample.peak),
            sample.threads
        );
        samples.push((step, sample));
    }
    samples
}

/// How long after an operator restarted onto the clusters takes the Lease its memory is
/// read: its first passes done, and the API client's idle connections of that burst
/// closed (src/api_client.rs keeps them 30 s).
const RESTART_SETTLE: Duration = Duration::from_secs(90);

/// An operator started onto the clusters that exist (its predecessor killed, so it waits
/// for the Lease to expire), and its memory `RESTART_SETTLE` after it leads.
fn restarted(
    program: &Path,
    ns: &str,
    address: &'static str,
    env: &[(&str, &str)],
) -> (Operator, Memory) {
    let operator = Operator::start_program(program, ns, address, &[], env);
    wait_for(
        "the restarted operator leads",
        Duration::from_secs(120),
        || operator.is_leader(),
        || Operator::logs(std::slice::from_ref(&operator.log)),
    );
    std::thread::sleep(RESTART_SETTLE);
    let sample = memory(operator.pid());
    (operator, sample)
}

/// CPU seconds per minute of each process over the next 60 s.
fn idle_cpu(pids: &[u32]) -> Vec<f64> {
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(*p)).collect();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(60));
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    pids.iter()
        .zip(before)
        .map(|(pid, before)| (cpu_seconds(*pid) - before) / minutes)
        .collect()
}

fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as u64
}

/// One spec change's times, in milliseconds.
struct SpecChange {
    /// The operator's `reconcile` span's start → the reload's first call.
    internal: f64,
    /// The PATCH sent → the reload's first call.
    end_to_end: f64,
    /// The PATCH sent → the `reconcile` span's start: the API server's and the watch's
    /// part, and the operator's until it calls `reconcile`.
    to_reconcile: f64,
    /// The PATCH sent → its answer: the API server's part alone.
    patch: f64,
}

/// Part 2: every cluster's `work_mem` changed; per change, from the operator's trace and
/// the bench's clock.
async fn spec_change_latency(
    ns: &str,
    clusters: usize,
    receiver: &support::otel::Receiver,
) -> Vec<SpecChange> {
    let api: Api<DatabaseCluster> = Api::namespaced(client().await, ns);
    let mut sent = BTreeMap::new();
    for i in 1..=clusters {
        let name = format!("s{i:03}");
        let patch = serde_json::json!({"spec": {"parameters": {"work_mem": "5MB"}}});
        let at = SystemTime::now();
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_or_else(|e| panic!("patching {name}: {e}"));
        let answered = SystemTime::now();
        sent.insert(
            format!("{ns}/{name}"),
            (unix_nanos(at), unix_nanos(answered)),
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The batch exporter sends within its schedule delay (OTEL_BSP_SCHEDULE_DELAY).
    tokio::time::sleep(Duration::from_secs(10)).await;
    let spans = support::otel::spans(&receiver.traces());
    let mut by_trace: BTreeMap<&str, Vec<&support::otel::Span>> = BTreeMap::new();
    for span in spans.iter().filter(|s| s.service == "castellan-operator") {
        by_trace.entry(&span.trace).or_default().push(span);
    }
    let mut found = Vec::new();
    for (cluster, (patched, answered)) in &sent {
        // The first trace after the PATCH whose reconcile of this cluster led to a
        // reload: its root and the reload's first call.
        let mut best: Option<(u64, u64)> = None;
        for spans in by_trace.values() {
            let Some(root) = spans.iter().find(|s| {
                s.name == "reconcile"
                    && s.attributes.get("cluster") == Some(cluster)
                    && s.start >= *patched
            }) else {
                continue;
            };
            let reloads: Vec<&str> = spans
                .iter()
                .filter(|s| {
                    s.name == "instance command"
                        && s.attributes.get("command").map(String::as_str) == Some("reload")
                })
                .map(|s| s.id.as_str())
                .collect();
            let call = spans
                .iter()
                .filter(|s| s.name == "instance api call" && reloads.contains(&s.parent.as_str()))
                .map(|s| s.start)
                .min();
            if let Some(call) = call
                && best.is_none_or(|(r, _)| root.start < r)
            {
                best = Some((root.start, call));
            }
        }
        match best {
            Some((root, call)) => found.push(SpecChange {
                internal: (call - root) as f64 / 1e6,
                end_to_end: call.saturating_sub(*patched) as f64 / 1e6,
                to_reconcile: root.saturating_sub(*patched) as f64 / 1e6,
                patch: answered.saturating_sub(*patched) as f64 / 1e6,
            }),
            None => println!("no traced reload for {cluster}"),
        }
    }
    found
}

/// The kinds whose creation counts as an operator's first action on a cluster.
fn owned_kinds() -> Vec<ApiResource> {
    use k8s_openapi::api::batch::v1::Job;
    use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
    vec![
        ApiResource::erase::<Service>(&()),
        ApiResource::erase::<Secret>(&()),
        ApiResource::erase::<ConfigMap>(&()),
        ApiResource::erase::<PersistentVolumeClaim>(&()),
        ApiResource::erase::<Pod>(&()),
        ApiResource::erase::<Job>(&()),
    ]
}

/// Per cluster: when its creation arrived, and when its first owned object did.
type Seen = std::sync::Arc<std::sync::Mutex<BTreeMap<String, (Option<Instant>, Option<Instant>)>>>;

/// Watches `ns` for new cluster objects of `cluster_kind` and new owned objects;
/// records when each cluster's creation and its first owned object arrived.
struct FirstActions {
    seen: Seen,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FirstActions {
    async fn watch(ns: &str, cluster_kind: ApiResource) -> Self {
        let client = client().await;
        let seen: Seen = Default::default();
        let mut tasks = Vec::new();
        let mut kinds = vec![(cluster_kind.clone(), true)];
        kinds.extend(owned_kinds().into_iter().map(|k| (k, false)));
        for (kind, is_cluster) in kinds {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &kind);
            let seen = seen.clone();
            let cluster_kind = cluster_kind.kind.clone();
            tasks.push(tokio::spawn(async move {
                let mut events = watcher(api, watcher::Config::default()).boxed();
                while let Some(event) = events.next().await {
                    let Ok(watcher::Event::Apply(object)) = event else {
                        continue;
                    };
                    let now = Instant::now();
                    let owner = if is_cluster {
                        object.metadata.name.clone()
                    } else {
                        object
                            .metadata
                            .owner_references
                            .iter()
                            .flatten()
                            .find(|o| o.kind == cluster_kind)
                            .map(|o| o.name.clone())
                    };
                    let Some(owner) = owner else { continue };
                    let mut seen = seen.lock().expect("lock");
                    let entry = seen.entry(owner).or_insert((None, None));
                    if is_cluster {
                        entry.0.get_or_insert(now);
                    } else {
                        entry.1.get_or_insert(now);
                    }
                }
            }));
        }
        // Let the watches list what exists first.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Self { seen, tasks }
    }

    /// Clusters with a first owned object.
    fn acted_on(&self) -> usize {
        self.seen
            .lock()
            .expect("lock")
            .values()
            .filter(|(_, first)| first.is_some())
            .count()
    }

    /// Milliseconds from `name`'s creation to its first owned object, once both came.
    fn latency(&self, name: &str) -> Option<f64> {
        let seen = self.seen.lock().expect("lock");
        let (Some(created), Some(first)) = seen.get(name)? else {
            return None;
        };
        Some(first.saturating_duration_since(*created).as_secs_f64() * 1000.0)
    }
}

impl Drop for FirstActions {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// One operator's figures in the shared state.
struct PeerFigures {
    memory: Memory,
    latencies: Vec<f64>,
}

/// Part 3 for one operator: `count` clusters made by `create`, the memory once it has
/// acted on all of them, then `LATENCY_SAMPLES` more one at a time.
async fn pending_state(
    ns: &str,
    pid: u32,
    count: usize,
    kind: ApiResource,
    prefix: &str,
    create: impl Fn(&str),
) -> PeerFigures {
    let watch = FirstActions::watch(ns, kind).await;
    for i in 1..=count {
        create(&format!("{prefix}{i:03}"));
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    while watch.acted_on() < count {
        assert!(
            Instant::now() < deadline,
            "the operator acted on {} of {count} clusters within 600 s",
            watch.acted_on()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    let memory = memory(pid);
    let mut latencies = Vec::new();
    for i in 1..=LATENCY_SAMPLES {
        let name = format!("{prefix}x{i:02}");
        create(&name);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(ms) = watch.latency(&name) {
                latencies.push(ms);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no owned object of {name} within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    PeerFigures { memory, latencies }
}

fn cnpg(args: &[&str]) -> String {
    let output = Command::new(support::repo().join("bench/cnpg.sh"))
        .args(args)
        .output()
        .expect("running bench/cnpg.sh");
    assert!(
        output.status.success(),
        "bench/cnpg.sh {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

async fn side_by_side(program: &Path, clusters: usize) -> (PeerFigures, PeerFigures) {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "bench-peer").await;
    let ns = namespace.name.clone();
    // A class without volumes: every claim, and so every instance pod, stays Pending.
    let class = format!("bench-none-{}", std::process::id());
    let manifest = std::env::temp_dir().join(format!("{class}.yaml"));
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: {class}}}\n\
             provisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: WaitForFirstConsumer\n"
        ),
    )
    .expect("writing the class");
    kubectl_ok(&["apply", "-f", &manifest.to_string_lossy()]);

    let castellan = {
        let operator = Operator::start_program(program, &ns, PEER_OPERATOR, &[], &[]);
        let kind = ApiResource::erase::<DatabaseCluster>(&());
        let figures = pending_state(&ns, operator.pid(), clusters, kind, "c", |name| {
            apply_small(&ns, name, &class, None)
        })
        .await;
        drop(operator);
        kubectl_ok(&["delete", "dbc", "--all", "-n", &ns, "--wait=false"]);
        figures
    };

    cnpg(&["build"]);
    let pid: u32 = cnpg(&["start", &ns])
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .expect("bench/cnpg.sh start prints the manager's pid");
    let kind = ApiResource {
        group: "postgresql.cnpg.io".into(),
        version: "v1".into(),
        api_version: "postgresql.cnpg.io/v1".into(),
        kind: "Cluster".into(),
        plural: "clusters".into(),
    };
    let peer = pending_state(&ns, pid, clusters, kind, "p", |name| {
        cnpg(&["apply", name, &ns, &class]);
    })
    .await;
    cnpg(&["stop"]);
    let _ = kubectl(&["delete", "storageclass", &class, "--wait=false"]);
    (castellan, peer)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let clusters: usize = std::env::var("BENCH_CLUSTERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(100);
    let steps: Vec<usize> = [0, 10, 50, 100]
        .into_iter()
        .map(|s| s.min(clusters))
        .chain([clusters])
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let program = release_binary();
    let client = client().await;
    let namespace = TestNamespace::create(&client, "bench-scale").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("bench-scale", clusters.div_ceil(3) as u32);

    // Part 1.
    let operator = Operator::start_program(&program, &ns, OPERATOR, &[], &[]);
    println!("operator log: {}", operator.log.display());
    let profile = footprint(&ns, &volumes.class, &operator, &steps);
    let agent = Agent::start(&program);
    std::thread::sleep(Duration::from_secs(30));
    let agent_memory = memory(agent.pid());
    let cpu = idle_cpu(&[operator.pid(), agent.pid()]);
    let operator_memory = memory(operator.pid());
    drop(agent);
    // Restarted onto every cluster at once: all cluster actors make their first
    // requests together, a burst the creation steps above never see.
    drop(operator);
    let (operator, untraced_restart) = restarted(&program, &ns, OPERATOR, &[]);
    drop(operator);

    // Part 2.
    let receiver = support::otel::Receiver::start(OTLP_PORT);
    let endpoint = format!("http://127.0.0.1:{OTLP_PORT}");
    let (traced, traced_restart) = restarted(
        &program,
        &ns,
        TRACED_OPERATOR,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "500"),
        ],
    );
    wait_ready(&ns, clusters, Duration::from_secs(300));
    let latencies = spec_change_latency(&ns, clusters, &receiver).await;
    drop(traced);
    drop(receiver);
    kubectl_ok(&["delete", "dbc", "--all", "-n", &ns, "--wait=false"]);

    // Part 3.
    let peer = if std::env::var("BENCH_PEER").as_deref() == Ok("0") {
        None
    } else {
        Some(side_by_side(&program, clusters).await)
    };

    // The report.
    println!();
    println!(
        "Scale benchmark ({} cores, {}; release build; {clusters} single-instance clusters)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        jiff::Timestamp::now().strftime("%Y-%m-%d")
    );
    println!("operator resident set, 30 s after every cluster is Ready:");
    for (step, m) in &profile {
        println!(
            "  {step:>3} clusters  RSS {:>5.1} MiB  (anon {:>5.1}, file {:>4.1})  peak {:>5.1} MiB  {:>2} threads",
            mib(m.rss),
            mib(m.anon),
            mib(m.file),
            mib(m.peak),
            m.threads
        );
    }
    println!(
        "operator at idle with {clusters} clusters: RSS {:.1} MiB, peak {:.1} MiB, {:.2} CPU s/min",
        mib(operator_memory.rss),
        mib(operator_memory.peak),
        cpu[0]
    );
    for (how, m) in [
        ("", &untraced_restart),
        (" (traces exported)", &traced_restart),
    ] {
        println!(
            "operator restarted onto {clusters} clusters{how}, {} s after it leads: RSS {:.1} MiB (anon {:.1}), peak {:.1} MiB, {} sockets",
            RESTART_SETTLE.as_secs(),
            mib(m.rss),
            mib(m.anon),
            mib(m.peak),
            m.sockets
        );
    }
    println!(
        "node agent (raid1 pool, 2 disks) at idle: RSS {:.1} MiB, peak {:.1} MiB, {} threads, {:.2} CPU s/min",
        mib(agent_memory.rss),
        mib(agent_memory.peak),
        agent_memory.threads,
        cpu[1]
    );
    println!(
        "spec.parameters change → reload call ({} of {clusters} traced):",
        latencies.len()
    );
    let report = |what: &str, figure: fn(&SpecChange) -> f64| {
        let times = sorted(latencies.iter().map(figure).collect());
        println!(
            "  {what:<23} p50 {:>6.1} ms  p99 {:>6.1} ms  max {:>6.1} ms",
            percentile(&times, 50.0),
            percentile(&times, 99.0),
            times.last().copied().unwrap_or(f64::NAN)
        );
    };
    report("reconcile start → call", |l| l.internal);
    report("PATCH sent → call", |l| l.end_to_end);
    report("PATCH sent → reconcile", |l| l.to_reconcile);
    report("PATCH sent → answered", |l| l.patch);
    if let Some((castellan, cnpg)) = peer {
        println!(
            "side by side, {clusters} cluster objects whose pods stay Pending (CloudNativePG 1.27.0):"
        );
        for (name, f) in [("castellan", &castellan), ("cloudnative-pg", &cnpg)] {
            let l = sorted(f.latencies.clone());
            println!(
                "  {name:<15} RSS {:>6.1} MiB  peak {:>6.1} MiB  create → first owned object p50 {:>6.1} ms  p99 {:>6.1} ms",
                mib(f.memory.rss),
                mib(f.memory.peak),
                percentile(&l, 50.0),
                percentile(&l, 99.0)
            );
        }
        let (lc, lp) = (sorted(castellan.latencies), sorted(cnpg.latencies));
        println!(
            "  ratio cloudnative-pg / castellan: RSS {:.1}×  peak {:.1}×  p50 {:.1}×  p99 {:.1}×",
            cnpg.memory.rss as f64 / castellan.memory.rss as f64,
            cnpg.memory.peak as f64 / castellan.memory.peak as f64,
            percentile(&lp, 50.0) / percentile(&lc, 50.0),
            percentile(&lp, 99.0) / percentile(&lc, 99.0)
        );
    }
}
