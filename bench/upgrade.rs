//! Benchmark: how long writers wait through a version change, and what keeping the old
//! data for a rollback costs on btrfs.
//!
//! Against the local cluster in `CASTELLAN_KUBECONFIG` (`make bench-upgrade` brings up
//! its own with `bench/local_cluster.sh` and tears it down), with the operator as a host
//! process managing a namespace of its own. Three runs, one after the other, each on
//! volumes of its own that are removed afterwards:
//!
//! 1. and 2. A major upgrade 15 → 18 of an async cluster whose database was filled by
//!    Debian's `pgbench -i`, through the primary's pod address with `sslmode=require`
//!    as tests/major_upgrade.rs does, once per entry of `BENCH_UPGRADE_RUNS`
//!    (`scale:instances,…`, default `7:3,135:3`: about 100 MB and about 2 GB, 3
//!    instances each). A run that would not fit in the free space of the temporary
//!    directory (about twice the database and 1 GiB of WAL per instance) is refused
//!    before it starts; downtimes are compared between runs of the same instance count. The volumes are directories on a
//!    btrfs filesystem of their own (a loop device over a sparse file, as
//!    `LocalVolumes::create_on_btrfs` makes), so the upgrade pod runs
//!    `pg_upgrade --clone`; the bench's cluster has no agent, so no StoragePool — a
//!    pool's volumes are btrfs subvolumes on the same kind of filesystem. Before the
//!    upgrade the replicas have caught up and a `CHECKPOINT` has written the bulk
//!    load's dirty pages: the upgrade is measured, not the tail of the load.
//! 3. A minor update 18.3 → 18.4 of a 3-instance cluster (the image catalog's "18" moved
//!    from `:0.1.0-pg18.3` to `:0.1.0-pg18`, as tests/cluster_lifecycle.rs does).
//!
//! Downtime, each time: a writer inserts rows through the `-rw` Service without pause
//! (`support::faults::Writer`, the one bench/failover.rs uses) and the figure is the
//! longest time between two acknowledged commits from the change until the cluster is
//! done: from the last write that succeeded before the stop to the first that
//! succeeded after. Also, as bench/failover.rs counts, the time from the change (the
//! `kubectl patch`) to that first write, and any further outage.
//!
//! The phases of a major upgrade are timed by polling `status.upgrade.phase` every
//! 100 ms (and `readyInstances`, which shows the upgraded primary ready before the
//! replicas), beside the Events' own timestamps; the upgrade pod's log gives
//! pg_upgrade's own duration. The space the kept old data takes is read with
//! `btrfs filesystem du` of the primary's `pgdata-previous` (exclusive: what removing
//! it frees; shared: reflinked with the live `pgdata`) and `btrfs filesystem usage`
//! of the whole filesystem before and after.
//!
//! Prints every figure and the checks against the goal (≤ 30 s of write downtime for
//! either size, and nearly the same for both: the larger within 1.5 × the smaller).
//! Results are recorded in docs/benchmarks.md.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use castellan_crds::DatabaseCluster;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};

use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster_of, apply_manifest, delete_cluster,
    describe, instance_addresses, jsonpath, phase_and_ready, secret_value, server_versions,
    set_catalog_image, try_superuser, wait_for, wait_for_catalog,
};
use support::disks::{MIB, run};
use support::faults::{Writer, reported_roles, volume_path};
use support::{TestNamespace, client, kubectl_ok};

/// The operator's metrics address: beside bench/failover.rs's (127.0.63.2) and
/// bench/backup.rs's (127.0.63.3).
const OPERATOR: &str = "127.0.62.2:8080";
/// The write downtime a major upgrade may cost, whatever the size.
const GOAL: Duration = Duration::from_secs(30);
/// "Nearly the same for both sizes": the larger database's downtime at most this many
/// times the smaller's.
const SIZE_RATIO_GOAL: f64 = 1.5;
/// Longest the cluster may take to be Ready, filled or upgraded.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(600);

fn seconds(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

/// `btrfs filesystem du -s` of one directory, in bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Du {
    total: u64,
    exclusive: u64,
    shared: u64,
}

fn btrfs_du(dir: &Path) -> Du {
    let out = run(
        "btrfs",
        &["filesystem", "du", "-s", "--raw", &dir.to_string_lossy()],
    );
    let numbers: Vec<u64> = out
        .lines()
        .last()
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .filter_map(|field| field.parse().ok())
        .collect();
    match numbers[..] {
        [total, exclusive, shared] => Du {
            total,
            exclusive,
            shared,
        },
        _ => panic!(
            "cannot read btrfs filesystem du of {}:\n{out}",
            dir.display()
        ),
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// A change of `status.upgrade.phase` or of `readyInstances`, as polled.
#[derive(Clone, Debug)]
struct Mark {
    at: Instant,
    phase: String,
    ready: i32,
}

/// Polls a cluster's status every 100 ms and records every change of the upgrade's
/// phase and of the ready instances, and keeps the upgrade pod's log while it exists
/// (the operator deletes the pod once the upgraded primary starts).
struct Timeline {
    marks: Arc<Mutex<Vec<Mark>>>,
    upgrade_log: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Timeline {
    fn start(client: &kube::Client, ns: &str, cluster: &str) -> Self {
        let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), ns);
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let marks = Arc::new(Mutex::new(Vec::<Mark>::new()));
        let upgrade_log = Arc::new(Mutex::new(String::new()));
        let (name, pod) = (cluster.to_owned(), format!("{cluster}-upgrade"));
        let (seen, log) = (marks.clone(), upgrade_log.clone());
        let task = tokio::spawn(async move {
            loop {
                if let Ok(object) = clusters.get(&name).await {
                    let status = object.status.unwrap_or_default();
                    let phase = status.upgrade.map(|u| u.phase).unwrap_or_default();
                    let ready = status.ready_instances.unwrap_or(0);
                    {
                        let mut marks = seen.lock().expect("marks");
                        if marks
                            .last()
                            .is_none_or(|last| last.phase != phase || last.ready != ready)
                        {
                            marks.push(Mark {
                                at: Instant::now(),
                                phase: phase.clone(),
                                ready,
                            });
                        }
                    }
                    let complete = log.lock().expect("log").contains("\"outcome\"");
                    if !complete
                        && matches!(phase.as_str(), "Upgrading" | "Starting")
                        && let Ok(text) = pods.logs(&pod, &LogParams::default()).await
                        && !text.is_empty()
                    {
                        *log.lock().expect("log") = text;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self {
            marks,
            upgrade_log,
            task,
        }
    }

    fn marks(&self) -> Vec<Mark> {
        self.marks.lock().expect("marks").clone()
    }

    /// When the phase first was `phase`.
    fn entered(&self, phase: &str) -> Option<Instant> {
        self.marks()
            .iter()
            .find(|mark| mark.phase == phase)
            .map(|mark| mark.at)
    }

    /// When, in phase `phase`, at least `ready` instances were first ready.
    fn ready_in(&self, phase: &str, ready: i32) -> Option<Instant> {
        self.marks()
            .iter()
            .find(|mark| mark.phase == phase && mark.ready >= ready)
            .map(|mark| mark.at)
    }

    fn upgrade_log(&self) -> String {
        self.upgrade_log.lock().expect("log").clone()
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One cluster's Events as `(seconds after since, reason, message)`, oldest first.
fn events_since(ns: &str, cluster: &str, since: SystemTime) -> Vec<(f64, String, String)> {
    let out = kubectl_ok(&[
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        &format!("involvedObject.name={cluster}"),
        "-o",
        "jsonpath={range .items[*]}{.eventTime}|{.firstTimestamp}|{.reason}|{.message}{\"\\n\"}{end}",
    ]);
    let since = jiff::Timestamp::try_from(since).expect("a time after 1970");
    let mut events: Vec<(f64, String, String)> = out
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(4, '|');
            let (event_time, first, reason, message) = (
                fields.next()?,
                fields.next()?,
                fields.next()?,
                fields.next()?,
            );
            let time: jiff::Timestamp = [event_time, first]
                .into_iter()
                .find_map(|t| t.parse().ok())?;
            let after = time.duration_since(since).as_secs_f64();
            (after >= 0.0).then(|| (after, reason.to_owned(), message.to_owned()))
        })
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    events
}

fn print_events(events: &[(f64, String, String)], reasons: &[&str]) {
    for (after, reason, message) in events {
        if reasons.contains(&reason.as_str()) {
            let short: String = message.chars().take(150).collect();
            println!("    event +{after:7.2} s {reason}: {short}");
        }
    }
}

/// The upgrade pod's log lines (flat JSON, as `castellan upgrade run` writes them) as
/// `(seconds after since, message)`: when each step began.
fn upgrade_steps(log: &str, since: SystemTime) -> Vec<(f64, String)> {
    let since = jiff::Timestamp::try_from(since).expect("a time after 1970");
    log.lines()
        .filter_map(|line| {
            let line: serde_json::Value = serde_json::from_str(line).ok()?;
            let time: jiff::Timestamp = line["timestamp"].as_str()?.parse().ok()?;
            let mut message = line["message"].as_str()?.to_owned();
            for detail in ["check", "method", "checksums"] {
                if let Some(value) = line.get(detail) {
                    message.push_str(&format!(" {detail}={value}"));
                }
            }
            Some((time.duration_since(since).as_secs_f64(), message))
        })
        .collect()
}

/// The primary's pod and its address, from the roles the cluster reports.
fn primary(ns: &str, cluster: &str) -> (String, String) {
    let pod = reported_roles(ns, cluster)
        .into_iter()
        .find(|(_, role)| role == "primary")
        .map(|(name, _)| name)
        .unwrap_or_default();
    let address = instance_addresses(ns, cluster)
        .into_iter()
        .find(|(name, _)| *name == pod)
        .map(|(_, ip)| ip)
        .unwrap_or_default();
    (pod, address)
}

/// Waits until every replica reports a replay position within 1 MiB of the primary's
/// WAL: the load is over everywhere, not still replaying when the upgrade stops them.
fn wait_caught_up(ns: &str, cluster: &str, instances: u32, diagnostics: impl Fn() -> String) {
    wait_for(
        &format!("{cluster}: every replica caught up"),
        CLUSTER_TIMEOUT,
        || {
            let lags = jsonpath(
                "dbc",
                cluster,
                ns,
                "{range .status.instances[?(@.role==\"replica\")]}{.lagBytes} {end}",
            );
            let lags: Vec<&str> = lags.split_whitespace().collect();
            lags.len() + 1 == instances as usize
                && lags
                    .iter()
                    .all(|lag| lag.parse::<u64>().is_ok_and(|bytes| bytes < MIB))
        },
        diagnostics,
    );
}

/// What a major upgrade cost.
struct Major {
    scale: u32,
    instances: u32,
    database_bytes: i64,
    load: Duration,
    method: String,
    pg_upgrade_message: String,
    /// Longest time between two acknowledged commits: the write downtime.
    downtime: Duration,
    /// From the `kubectl patch` to the first write after the outage.
    patch_to_write: Duration,
    /// Further outages after writes had resumed, until every instance was ready.
    later_outages: Vec<Duration>,
    /// Phases, as `(name, seconds)`.
    phases: Vec<(String, f64)>,
    /// From the patch to every instance ready on 18.
    total: Duration,
    data: Du,
    previous: Du,
    used_before: u64,
    used_after: u64,
}

async fn major_upgrade(
    client: &kube::Client,
    ns: &str,
    logs: &[PathBuf],
    cluster: &str,
    scale: u32,
    instances: u32,
) -> Major {
    let diagnostics = || describe(ns, logs);
    // The database (15 MB a scale step) on each instance, its WAL, and the upgraded copy's
    // own files, with room to spare; the file is sparse.
    let database = u64::from(scale) * 16 * MIB;
    let filesystem = (3 * 2 * database + 3 * 1024 * MIB).max(4096 * MIB);
    let capacity = format!("{}Gi", (2 * database).div_ceil(1024 * MIB).max(1) * 2);
    let volumes =
        LocalVolumes::create_on_btrfs_sized(&format!("bench-{cluster}"), 1, filesystem, &capacity);
    // The volume's size sets how much WAL a slot may hold back (a quarter of it): too
    // small a claim would invalidate a replica's slot during the load.
    apply_manifest(
        ns,
        cluster,
        &format!(
            "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: {cluster}}}\nspec:\n  \
             engine: postgresql\n  version: \"15\"\n  replicas: {instances}\n  \
             storage: {{size: {capacity}, storageClassName: {}}}\n  \
             bootstrap: {{initdb: {{database: shop, owner: clerk}}}}\n{SUPERUSER_ACCESS}",
            volumes.class
        ),
    );
    wait_for(
        &format!("{cluster}: {instances} instances of 15 Ready"),
        CLUSTER_TIMEOUT,
        || phase_and_ready(ns, cluster) == format!("Ready/{instances}"),
        diagnostics,
    );

    let (primary_pod, address) = primary(ns, cluster);
    println!("  {cluster}: pgbench -i -s {scale} on {primary_pod} ({address}) …");
    let password = secret_value(ns, &format!("{cluster}-app"), "password");
    let started = Instant::now();
    support::postgres::pgbench_init(&address, &password, scale);
    let load = started.elapsed();
    wait_caught_up(ns, cluster, instances, diagnostics);
    let mut superuser = try_superuser(ns, cluster, &primary_pod)
        .await
        .expect("the superuser");
    sqlx::query("checkpoint")
        .execute(&mut superuser)
        .await
        .expect("checkpoint");
    let database_bytes: i64 = sqlx::query_scalar("select pg_database_size('shop')")
        .fetch_one(&mut superuser)
        .await
        .expect("pg_database_size");
    drop(superuser);
    println!(
        "  {cluster}: {:.0} MB in shop after {:.1} s of pgbench -i",
        database_bytes as f64 / 1e6,
        seconds(load)
    );
    let used_before = volumes.used_bytes();

    let writer = Writer::start(ns, cluster).await;
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;
    let timeline = Timeline::start(client, ns, cluster);
    tokio::time::sleep(Duration::from_secs(2)).await;
    writer.take_longest_gap();

    let patched = Instant::now();
    let patched_wall = SystemTime::now();
    kubectl_ok(&[
        "patch",
        "dbc",
        cluster,
        "-n",
        ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"version":"18"}}"#,
    ]);
    let outage = writer
        .wait_for_recovery_after(patched, CLUSTER_TIMEOUT)
        .await;
    wait_for(
        &format!("{cluster}: the upgrade succeeds with {instances} instances of 18 ready"),
        CLUSTER_TIMEOUT,
        || {
            jsonpath("dbc", cluster, ns, "{.status.upgrade.phase}") == "Succeeded"
                && phase_and_ready(ns, cluster) == format!("Ready/{instances}")
        },
        diagnostics,
    );
    let total = patched.elapsed();
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;
    let downtime = writer.take_longest_gap();
    let later_outages: Vec<Duration> = writer
        .outages_after(outage.write_again)
        .iter()
        .map(|later| later.write_again - later.first_failure)
        .collect();
    drop(writer);

    for (pod, version) in server_versions(ns, cluster).await {
        assert!(version.starts_with("18."), "{pod} runs {version}");
    }
    let method = jsonpath("dbc", cluster, ns, "{.status.upgrade.method}");
    let upgraded = jsonpath("dbc", cluster, ns, "{.status.upgrade.instance}");
    let volume = volume_path(ns, &upgraded);
    run("btrfs", &["filesystem", "sync", &volume.to_string_lossy()]);
    let data = btrfs_du(&volume.join("pgdata"));
    let previous = btrfs_du(&volume.join("pgdata-previous"));
    let used_after = volumes.used_bytes();

    // The phases as polled; a phase the poll missed (shorter than 100 ms) counts as 0.
    let at = |phase: &str| timeline.entered(phase);
    let stopping = at("Stopping");
    let upgrading = at("Upgrading");
    let starting = at("Starting");
    let primary_ready = timeline.ready_in("Starting", 1).or(at("Succeeded"));
    let succeeded = at("Succeeded");
    // Signed: the poll sees a phase up to 100 ms late, so the last write may come after
    // the moment Stopping was seen.
    let span = |from: Option<Instant>, to: Option<Instant>| match (from, to) {
        (Some(from), Some(to)) if to >= from => seconds(to - from),
        (Some(from), Some(to)) => -seconds(from - to),
        _ => f64::NAN,
    };
    let last_write_before = outage.write_again - downtime;
    let phases = vec![
        (
            "patch → Stopping (operator sees the change)".to_owned(),
            span(Some(patched), stopping),
        ),
        (
            "Stopping (instances shut down cleanly)".to_owned(),
            span(stopping, upgrading),
        ),
        (
            "Upgrading (upgrade pod: export, initdb, check, pg_upgrade, swap)".to_owned(),
            span(upgrading, starting),
        ),
        (
            "Starting → primary ready on 18".to_owned(),
            span(starting, primary_ready),
        ),
        (
            "primary ready → replicas copied and ready (Succeeded)".to_owned(),
            span(primary_ready, succeeded),
        ),
        (
            "last write before → Stopping seen".to_owned(),
            span(Some(last_write_before), stopping),
        ),
        (
            "primary ready → first write through -rw".to_owned(),
            span(primary_ready, Some(outage.write_again)),
        ),
    ];
    println!("  {cluster}: phases as polled (seconds):");
    for (phase, took) in &phases {
        println!("    {took:7.2}  {phase}");
    }
    println!("  {cluster}: the upgrade pod's steps (seconds after the patch):");
    let steps = upgrade_steps(&timeline.upgrade_log(), patched_wall);
    for (after, message) in &steps {
        println!("    +{after:7.2} s {message}");
    }
    let events = events_since(ns, cluster, patched_wall);
    print_events(
        &events,
        &[
            "UpgradeStarted",
            "UpgradeRunning",
            "UpgradeStarting",
            "UpgradeSucceeded",
            "UpgradeFailed",
        ],
    );
    let pg_upgrade_message = jsonpath("dbc", cluster, ns, "{.status.upgrade.message}");
    let starting_message = events
        .iter()
        .find(|(_, reason, _)| reason == "UpgradeStarting")
        .map(|(_, _, message)| message.clone())
        .unwrap_or(pg_upgrade_message);
    println!(
        "  {cluster}: write downtime {:.2} s (patch → write again {:.2} s), total {:.1} s, \
         method {method}; later outages {:?}",
        seconds(downtime),
        seconds(outage.write_again - patched),
        seconds(total),
        later_outages
    );
    drop(timeline);
    delete_cluster(ns, cluster);
    drop(volumes);
    Major {
        scale,
        instances,
        database_bytes,
        load,
        method,
        pg_upgrade_message: starting_message,
        downtime,
        patch_to_write: outage.write_again - patched,
        later_outages,
        phases,
        total,
        data,
        previous,
        used_before,
        used_after,
    }
}

/// What a minor update cost.
struct Minor {
    took: Duration,
    downtime: Duration,
    outages: Vec<Duration>,
}

async fn minor_update(ns: &str, logs: &[PathBuf], cluster: &str) -> Minor {
    let diagnostics = || describe(ns, logs);
    let volumes = LocalVolumes::create("bench-minor", 1);
    set_catalog_image(ns, "18", "ghcr.io/castellan-io/castellan:0.1.0-pg18.3");
    apply_cluster_of(ns, cluster, "18", 3, &volumes.class, "");
    wait_for(
        &format!("{cluster}: 3 instances of 18.3 Ready"),
        CLUSTER_TIMEOUT,
        || phase_and_ready(ns, cluster) == "Ready/3",
        diagnostics,
    );
    for (pod, version) in server_versions(ns, cluster).await {
        assert_eq!(version, "18.3", "{pod}");
    }
    let writer = Writer::start(ns, cluster).await;
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    writer.take_longest_gap();

    let since = Instant::now();
    let since_wall = SystemTime::now();
    set_catalog_image(ns, "18", "ghcr.io/castellan-io/castellan:0.1.0-pg18");
    let images = || {
        kubectl_ok(&[
            "get",
            "pods",
            "-n",
            ns,
            "-l",
            &format!("castellan.io/cluster={cluster}"),
            "-o",
            "jsonpath={range .items[*]}{.spec.containers[0].image}{\"\\n\"}{end}",
        ])
    };
    wait_for(
        &format!("{cluster}: every instance on the new image and Ready"),
        CLUSTER_TIMEOUT,
        || {
            let images = images();
            images.lines().count() == 3
                && images
                    .lines()
                    .all(|image| image == "ghcr.io/castellan-io/castellan:0.1.0-pg18")
                && phase_and_ready(ns, cluster) == "Ready/3"
        },
        diagnostics,
    );
    let took = since.elapsed();
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;
    let downtime = writer.take_longest_gap();
    let outages = writer
        .outages_after(since)
        .iter()
        .map(|o| o.write_again - o.first_failure)
        .collect();
    drop(writer);
    for (pod, version) in server_versions(ns, cluster).await {
        assert_eq!(version, "18.4", "{pod}");
    }
    print_events(
        &events_since(ns, cluster, since_wall),
        &["MinorUpdate", "Switchover", "SwitchedOver"],
    );
    println!(
        "  {cluster}: 18.3 → 18.4 took {:.1} s; longest write gap {:.2} s; outages {:?}",
        seconds(took),
        seconds(downtime),
        outages
    );
    delete_cluster(ns, cluster);
    drop(volumes);
    Minor {
        took,
        downtime,
        outages,
    }
}

fn report(majors: &[Major], minor: &Minor) -> bool {
    println!();
    println!("Upgrade benchmark ({})", support::machine());
    println!(
        "write downtime: the longest time between two commits acknowledged through -rw, \
         from the change until every instance is ready"
    );
    println!(
        "| change | instances | database | pgbench -i | method | write downtime | patch → write \
         | all ready | later outages |"
    );
    println!("| --- | --: | --: | --: | --- | --: | --: | --: | --- |");
    for major in majors {
        println!(
            "| 15 → 18, scale {} | {} | {:.0} MB | {:.0} s | {} | {:.2} s | {:.2} s | {:.1} s | {:?} |",
            major.scale,
            major.instances,
            major.database_bytes as f64 / 1e6,
            seconds(major.load),
            major.method,
            seconds(major.downtime),
            seconds(major.patch_to_write),
            seconds(major.total),
            major.later_outages
        );
    }
    println!(
        "| 18.3 → 18.4 (catalog) | 3 | - | - | rolling | {:.2} s | - | {:.1} s | outages {:?} |",
        seconds(minor.downtime),
        seconds(minor.took),
        minor.outages
    );
    println!();
    let mut names: BTreeMap<usize, String> = BTreeMap::new();
    for major in majors {
        for (n, (phase, _)) in major.phases.iter().enumerate() {
            names.insert(n, phase.clone());
        }
    }
    print!("| phase (s) |");
    for major in majors {
        print!(" scale {} |", major.scale);
    }
    println!();
    println!("| --- |{}", " --: |".repeat(majors.len()));
    for (n, phase) in &names {
        print!("| {phase} |");
        for major in majors {
            print!(" {:.2} |", major.phases.get(*n).map_or(f64::NAN, |p| p.1));
        }
        println!();
    }
    println!();
    for major in majors {
        println!("scale {}: {}", major.scale, major.pg_upgrade_message);
        println!(
            "scale {}: kept pgdata-previous total {:.1} MiB, exclusive {:.1} MiB, shared \
             {:.1} MiB; live pgdata total {:.1} MiB, exclusive {:.1} MiB; filesystem used \
             {:.1} MiB before the upgrade, {:.1} MiB after ({:+.1} MiB)",
            major.scale,
            mib(major.previous.total),
            mib(major.previous.exclusive),
            mib(major.previous.shared),
            mib(major.data.total),
            mib(major.data.exclusive),
            mib(major.used_before),
            mib(major.used_after),
            mib(major.used_after) - mib(major.used_before)
        );
    }
    let mut met = true;
    for major in majors {
        let ok = major.downtime <= GOAL;
        met &= ok;
        println!(
            "goal: scale {} downtime {:.2} s ≤ {:.0} s: {}",
            major.scale,
            seconds(major.downtime),
            seconds(GOAL),
            if ok { "met" } else { "NOT MET" }
        );
    }
    let mut pairs = Vec::new();
    for (n, small) in majors.iter().enumerate() {
        for large in &majors[n + 1..] {
            if large.instances == small.instances && large.scale != small.scale {
                pairs.push(if large.scale > small.scale {
                    (small, large)
                } else {
                    (large, small)
                });
            }
        }
    }
    for (small, large) in pairs {
        let ratio = seconds(large.downtime) / seconds(small.downtime);
        let size_ratio = large.database_bytes as f64 / small.database_bytes as f64;
        let ok = ratio <= SIZE_RATIO_GOAL;
        met &= ok;
        println!(
            "goal: downtime scale {} / scale {} ({} instances) = {ratio:.2} for {size_ratio:.1} × \
             the data (≤ {SIZE_RATIO_GOAL}): {}",
            large.scale,
            small.scale,
            large.instances,
            if ok { "met" } else { "NOT MET" }
        );
        println!(
            "ratios scale {} / scale {}: Upgrading phase {:.2}, all ready {:.2}",
            large.scale,
            small.scale,
            large.phases[2].1 / small.phases[2].1,
            seconds(large.total) / seconds(small.total)
        );
    }
    met
}

/// The major upgrades to run, `scale:instances` separated by commas
/// (`BENCH_UPGRADE_RUNS`, default `7:3,135:3`).
fn runs() -> Vec<(u32, u32)> {
    let spec = std::env::var("BENCH_UPGRADE_RUNS").unwrap_or_else(|_| "7:3,135:3".into());
    spec.split(',')
        .map(|run| {
            run.trim()
                .split_once(':')
                .and_then(|(scale, instances)| Some((scale.parse().ok()?, instances.parse().ok()?)))
                .filter(|(scale, instances)| *scale > 0 && (1..=3).contains(instances))
                .unwrap_or_else(|| {
                    panic!("BENCH_UPGRADE_RUNS: {run:?} is not scale:instances (1 to 3)")
                })
        })
        .collect()
}

/// Bytes free on the filesystem of the temporary directory, where the btrfs images'
/// sparse files are.
fn free_bytes() -> u64 {
    let out = run(
        "df",
        &[
            "--output=avail",
            "-B1",
            &std::env::temp_dir().to_string_lossy(),
        ],
    );
    out.lines()
        .last()
        .and_then(|line| line.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> std::process::ExitCode {
    let runs = runs();
    let client = client().await;
    let namespace = TestNamespace::create(&client, "bench-upgrade").await;
    let ns = namespace.name.clone();
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    println!("operator log: {}", operator.log.display());
    wait_for_catalog(&ns, || describe(&ns, &logs));

    let mut majors = Vec::new();
    for (scale, instances) in runs {
        // Each instance holds the database and up to about 1 GiB of WAL (max_wal_size),
        // and a replica copied afresh after the upgrade may hold its old data a while
        // beside the new: refused up front rather than filling the machine's disk.
        let needed = u64::from(instances) * (u64::from(scale) * 2 * 16 * MIB + 1024 * MIB);
        let free = free_bytes();
        assert!(
            free > needed,
            "scale {scale} with {instances} instances needs about {:.1} GiB free in {} and \
             {:.1} GiB are: set BENCH_UPGRADE_RUNS with fewer instances or a smaller scale",
            mib(needed) / 1024.0,
            std::env::temp_dir().display(),
            mib(free) / 1024.0
        );
        let cluster = format!("major-{scale}-{instances}");
        println!("15 → 18, {instances} instances, pgbench scale {scale}:");
        majors.push(major_upgrade(&client, &ns, &logs, &cluster, scale, instances).await);
    }
    println!("18.3 → 18.4, 3 instances:");
    let minor = minor_update(&ns, &logs, "minor").await;

    let met = report(&majors, &minor);
    drop(operator);
    if met {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
