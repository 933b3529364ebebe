//! Benchmark: how long writes through a DatabaseCluster's `-rw` Service stop after a
//! fault, and how many acknowledged rows a failover loses.
//!
//! Against the local cluster in `CASTELLAN_KUBECONFIG` (`make bench-failover` brings up
//! its own, port base 56000, and tears it down), with the operator as a host process
//! managing a namespace of its own. A writer inserts rows through `-rw` without pause
//! the whole time and records every acknowledged commit (`support::faults::Writer`).
//!
//! First a 3-instance `sync` cluster (`ANY 1`, `dataDurability: required`), and
//! `BENCH_FAULTS` (default 10) times each: the primary's postmaster killed (the instance
//! manager restarts it in place; no failover expected), the primary's node stopped (a
//! failover; the node is started again afterwards), and a switchover to a replica. Then
//! a 3-instance `async` cluster with `BENCH_FAULTS` node stops. After every fault the
//! cluster is back to Ready/3 with one primary before the next, and a kill waits until
//! the server has run for 32 s: one killed sooner is restarted after a crash-loop
//! back-off (0.5 s, 1 s, 2 s … 30 s), which is not what a single kill costs.
//!
//! What it measures, per fault: seconds from the fault being applied to the first
//! commit acknowledged after the first write that failed — a commit that was already in
//! flight when the fault hit does not count as writes working again. The clock starts
//! when the command that applies the fault starts (`kill`, `nodes.sh stop`, `kubectl
//! annotate`), not when it returns: `nodes.sh stop` kills the node's processes at once
//! but takes 5 s and more to return (the node process does not exit on SIGTERM and is
//! killed after 5 s), so from its return a lost node would look like a 0.1 s outage.
//! For a kill or an annotation the two differ by well under 0.3 s. And the acknowledged rows
//! missing on the new primary (the old one, when no failover happened) once writes
//! work again: those are lost, since a returning old primary is rewound onto the new
//! one's timeline. `sync` must lose none; the `async` figure is what `async` costs.
//!
//! Also per fault: the outage a client saw (first failed write to writes working
//! again), and any outage after writes had recovered
//! and before the cluster settled — all instances on the primary's timeline and
//! streaming, no parameter waiting for a restart — which is when the next fault comes.
//!
//! Prints every sample and a table of min/median/max with the goals (postgres killed
//! ≤ 3 s, node lost ≤ 10 s); exits non-zero if `sync` lost an acknowledged row. Results
//! are recorded in docs/benchmarks.md.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

use support::cluster::{
    LocalVolumes, Operator, apply_cluster, delete_cluster, describe, instance_addresses, jsonpath,
    phase_and_ready, secret_value, wait_for,
};
use support::faults::{
    Outage, Writer, missing_on, node, node_of, postmaster_pid, postmaster_started, signal,
};
use support::{TestNamespace, client, kubectl_ok};

/// The operator's metrics address: beside `make test`'s (127.0.64.x) and bench/clusters.sh's.
const OPERATOR: &str = "127.0.63.2:8080";
/// Longest a fault may keep writes from working before the benchmark gives up.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(120);
/// The instance manager restarts a killed server at once only if it had run this long
/// (`STABLE_RUN`, 30 s, in src/instance/mod.rs, and a second for the whole seconds of
/// `postmaster.pid`); a server killed sooner is restarted after a back-off that doubles
/// up to 30 s, as for a crash loop. Each kill waits for this much uptime, so that it is
/// timed as a single kill, not as the next crash of a loop.
const STABLE_UPTIME: Duration = Duration::from_secs(32);
/// Longest the cluster may take to be Ready/3 again after a fault (the old primary's
/// node restarted, its instance rewound and following the new primary).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(240);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    KillPostgres,
    StopNode,
    Switchover,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Fault::KillPostgres => "postgres killed (restart in place)",
            Fault::StopNode => "node stopped (failover)",
            Fault::Switchover => "switchover",
        }
    }

    /// The target for seconds until writes work again, where there is one.
    fn goal(self) -> Option<Duration> {
        match self {
            Fault::KillPostgres => Some(Duration::from_secs(3)),
            Fault::StopNode => Some(Duration::from_secs(10)),
            Fault::Switchover => None,
        }
    }
}

/// One fault, as the writer saw it.
struct Sample {
    /// From the fault applied (its command started) to the first acknowledged commit
    /// after the first failed write.
    write_again: Duration,
    /// From the first failed write to that commit: the outage a client saw.
    outage: Duration,
    /// Acknowledged rows missing on the primary once writes worked again.
    lost: usize,
    /// Outages after writes had recovered and before the cluster settled.
    later_outages: Vec<Duration>,
}

/// Figures of one kind of fault on one cluster.
struct Series {
    mode: &'static str,
    fault: Fault,
    samples: Vec<Sample>,
    /// Kills after which another instance was primary (none expected).
    failovers: usize,
}

impl Series {
    /// Seconds until a write worked again (min, median, max), and the median outage.
    fn figures(&self) -> ((f64, f64, f64), f64) {
        let write_again = spread(
            self.samples
                .iter()
                .map(|s| seconds(s.write_again))
                .collect(),
        );
        let (_, outage, _) = spread(self.samples.iter().map(|s| seconds(s.outage)).collect());
        (write_again, outage)
    }
}

/// An instance as status reports it.
struct Reported {
    name: String,
    role: String,
    timeline: String,
    /// Present for a standby the primary sees streaming.
    lag_bytes: String,
}

/// One DatabaseCluster under a writer.
struct Subject {
    ns: String,
    name: String,
    sync: bool,
    password: String,
    logs: Vec<PathBuf>,
    writer: Writer,
    /// Acknowledged ids up to this one were found on the primary after an earlier fault;
    /// each fault checks the ones after it.
    checked_through: i64,
}

impl Subject {
    fn diagnostics(&self) -> String {
        format!(
            "{}\ninstances: {}",
            describe(&self.ns, &self.logs),
            jsonpath("dbc", &self.name, &self.ns, "{.status.instances}")
        )
    }

    fn primary(&self) -> String {
        jsonpath("dbc", &self.name, &self.ns, "{.status.currentPrimary}")
    }

    fn replica(&self) -> String {
        let primary = self.primary();
        instance_addresses(&self.ns, &self.name)
            .into_iter()
            .map(|(pod, _)| pod)
            .find(|pod| *pod != primary)
            .expect("a replica")
    }

    fn reported(&self) -> Vec<Reported> {
        jsonpath(
            "dbc",
            &self.name,
            &self.ns,
            "{range .status.instances[*]}{.name}={.role}={.timeline}={.lagBytes} {end}",
        )
        .split_whitespace()
        .filter_map(|entry| {
            let mut fields = entry.split('=').map(str::to_owned);
            Some(Reported {
                name: fields.next()?,
                role: fields.next()?,
                timeline: fields.next()?,
                lag_bytes: fields.next()?,
            })
        })
        .collect()
    }

    /// What status says once a fault is over: Ready/3; exactly one instance reporting
    /// itself primary, the current one; every instance on its timeline and every other
    /// one streaming from it; in `sync` mode the quorum streaming. Ready/3 alone is not
    /// enough: readiness is the pods', and a stopped node's pods stay Ready in the API
    /// until the node controller's grace period (40 s) has passed.
    fn status_settled(&self) -> bool {
        let primary = self.primary();
        let reported = self.reported();
        let Some(timeline) = reported
            .iter()
            .find(|i| i.name == primary)
            .map(|i| i.timeline.clone())
        else {
            return false;
        };
        phase_and_ready(&self.ns, &self.name) == "Ready/3"
            && reported.len() == 3
            && reported.iter().all(|i| {
                !i.timeline.is_empty()
                    && i.timeline == timeline
                    && (i.role == "primary") == (i.name == primary)
                    && (i.name == primary || !i.lag_bytes.is_empty())
            })
            && (!self.sync || self.quorum_streaming())
    }

    fn quorum_streaming(&self) -> bool {
        jsonpath(
            "dbc",
            &self.name,
            &self.ns,
            "{.status.conditions[?(@.type==\"SynchronousReplication\")].status}",
        ) == "True"
    }

    /// Whether some instance has a parameter change waiting for a restart, which the
    /// operator's rolling restart would apply — with an outage if it is the primary's.
    /// None when an instance cannot be asked.
    async fn pending_restart(&self) -> Option<bool> {
        for (_, host) in instance_addresses(&self.ns, &self.name) {
            let options = PgConnectOptions::new()
                .host(&host)
                .port(5432)
                .username("clerk")
                .password(&self.password)
                .database("shop");
            let mut connection = tokio::time::timeout(Duration::from_secs(2), options.connect())
                .await
                .ok()?
                .ok()?;
            let pending: i64 =
                sqlx::query_scalar("select count(*) from pg_settings where pending_restart")
                    .fetch_one(&mut connection)
                    .await
                    .ok()?;
            if pending > 0 {
                return Some(true);
            }
        }
        Some(false)
    }

    /// Waits until the cluster has recovered from a fault and stays so: status settled
    /// (`status_settled`) and nothing waiting for a restart, twice 2 s apart with no
    /// failed write between, then a write going through.
    async fn settle(&self, after: &str) {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        let mut since: Option<Instant> = None;
        loop {
            let settled = self.status_settled() && self.pending_restart().await == Some(false);
            match (settled, since) {
                (true, Some(at)) if !self.writer.failed_after(at) => break,
                (true, None) => since = Some(Instant::now()),
                _ => since = None,
            }
            assert!(
                Instant::now() < deadline,
                "{}: settled after {after} within {SETTLE_TIMEOUT:?}\n{}",
                self.name,
                self.diagnostics()
            );
            tokio::time::sleep(Duration::from_secs(if since.is_some() { 2 } else { 1 })).await;
        }
        self.writer
            .wait_for_write_after(Instant::now(), Duration::from_secs(60))
            .await;
    }

    /// Acknowledged rows since the last check that the current primary lacks.
    async fn lost_on_primary(&mut self) -> usize {
        let primary = self.primary();
        let address = instance_addresses(&self.ns, &self.name)
            .into_iter()
            .find(|(pod, _)| *pod == primary)
            .map(|(_, ip)| ip)
            .expect("the primary's address");
        let window: BTreeSet<i64> = self
            .writer
            .acknowledged()
            .range(self.checked_through + 1..)
            .copied()
            .collect();
        // Nothing is on its way any more to rows the new primary lacks (their old
        // primary is gone): a short patience only rides out a refused connection.
        let missing = missing_on(
            &self.ns,
            &self.name,
            &address,
            &window,
            Duration::from_secs(3),
        )
        .await;
        self.checked_through = window.last().copied().unwrap_or(self.checked_through);
        missing.len()
    }

    /// Applies `fault`, measures until writes work again, counts what was lost, and
    /// waits until the cluster has recovered.
    async fn inject(&mut self, fault: Fault, tag: &str) -> (Sample, bool) {
        let primary = self.primary();
        // Found before the clock starts: kubectl takes a while.
        if fault == Fault::KillPostgres {
            let started = postmaster_started(&self.ns, &primary).expect("the primary's postmaster");
            let uptime = SystemTime::now()
                .duration_since(started)
                .unwrap_or_default();
            tokio::time::sleep(STABLE_UPTIME.saturating_sub(uptime)).await;
        }
        let postmaster = (fault == Fault::KillPostgres)
            .then(|| postmaster_pid(&self.ns, &primary).expect("the primary's postmaster"));
        let node_name = (fault == Fault::StopNode).then(|| node_of(&self.ns, &primary));
        let target = (fault == Fault::Switchover).then(|| self.replica());
        let annotation = target
            .as_ref()
            .map(|target| format!("castellan.io/switchover-to={target}"));
        self.writer.take_longest_gap();

        let before = Instant::now();
        let wall = SystemTime::now();
        if let Some(pid) = postmaster {
            signal(pid, "KILL");
        }
        if let Some(name) = &node_name {
            node("stop", name);
        }
        if let Some(annotation) = &annotation {
            kubectl_ok(&["annotate", "dbc", &self.name, "-n", &self.ns, annotation]);
        }
        let applied = Instant::now();
        let Outage {
            first_failure,
            write_again,
        } = self
            .writer
            .wait_for_recovery_after(before, RECOVERY_TIMEOUT)
            .await;

        if fault != Fault::KillPostgres {
            wait_for(
                &format!("{}: another primary than {primary}", self.name),
                RECOVERY_TIMEOUT,
                || {
                    let now = self.primary();
                    !now.is_empty() && now != primary
                },
                || self.diagnostics(),
            );
        }
        let lost = self.lost_on_primary().await;
        if let Some(name) = &node_name {
            node("start", name);
        }
        self.settle(fault.label()).await;
        let new_primary = self.primary();
        if let Some(target) = &target
            && *target != new_primary
        {
            println!("  note: switchover to {target} made {new_primary} primary");
        }
        let sample = Sample {
            write_again: write_again - before,
            outage: write_again - first_failure,
            lost,
            later_outages: self
                .writer
                .outages_after(write_again)
                .iter()
                .map(|later| later.write_again - later.first_failure)
                .collect(),
        };
        println!(
            "  {tag} {} {}: {primary} → {new_primary}: fault command took {:.2} s, first failed \
             write {:.2} s, write again {:.2} s (outage {:.2} s), lost {lost}, \
             longest write pause {:.2} s, later outages {:?}",
            utc_time(wall),
            self.name,
            seconds(applied - before),
            seconds(first_failure - before),
            seconds(sample.write_again),
            seconds(sample.outage),
            seconds(self.writer.take_longest_gap()),
            sample
                .later_outages
                .iter()
                .map(|pause| format!("{:.2} s", seconds(*pause)))
                .collect::<Vec<_>>(),
        );
        (sample, new_primary != primary)
    }

    async fn series(&mut self, fault: Fault, count: usize) -> Series {
        let mode = if self.sync { "sync" } else { "async" };
        println!("{mode}: {} × {count}", fault.label());
        let mut series = Series {
            mode,
            fault,
            samples: Vec::new(),
            failovers: 0,
        };
        for n in 1..=count {
            let (sample, failed_over) = self.inject(fault, &format!("{n}/{count}")).await;
            series.samples.push(sample);
            series.failovers += usize::from(failed_over && fault == Fault::KillPostgres);
        }
        series
    }
}

/// Applies a 3-instance cluster (`sync`: `ANY 1` with the default `dataDurability:
/// required`; otherwise the default, async), waits until it is Ready, and starts a writer
/// on it.
async fn subject(ns: &str, name: &str, class: &str, sync: bool, logs: &[PathBuf]) -> Subject {
    let replication = if sync {
        "  replication: {mode: sync, syncReplicas: 1}\n"
    } else {
        ""
    };
    apply_cluster(ns, name, 3, class, replication);
    wait_for(
        &format!("{name}: 3 instances Ready"),
        SETTLE_TIMEOUT,
        || phase_and_ready(ns, name) == "Ready/3",
        || describe(ns, logs),
    );
    let writer = Writer::start(ns, name).await;
    let subject = Subject {
        ns: ns.to_owned(),
        name: name.to_owned(),
        sync,
        password: secret_value(ns, &format!("{name}-app"), "password"),
        logs: logs.to_vec(),
        writer,
        checked_through: 0,
    };
    subject.settle("start").await;
    subject
}

/// Keeps a cluster's Events (they explain outages: `RollingRestart`, `FailingOver`…) in
/// a file beside the operator's log, since the namespace does not outlive the run.
fn save_events(ns: &str, name: &str) {
    let events = kubectl_ok(&[
        "get",
        "events",
        "-n",
        ns,
        "--field-selector",
        &format!("involvedObject.name={name}"),
        "--sort-by=.eventTime",
        // A repeated Event is one object with a count: its note is the first occurrence's,
        // its times the first and the last.
        "-o",
        "custom-columns=FIRST:.eventTime,LAST:.series.lastObservedTime,COUNT:.series.count,\
         TYPE:.type,REASON:.reason,NOTE:.message",
    ]);
    let file = std::env::temp_dir().join(format!("{ns}-{name}-events.txt"));
    match std::fs::write(&file, events) {
        Ok(()) => println!("{name}'s Events: {}", file.display()),
        Err(error) => println!("{name}'s Events not kept: {}: {error}", file.display()),
    }
}

/// `HH:MM:SS.mmm` UTC, to find a sample among the Events and logs.
fn utc_time(time: SystemTime) -> String {
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let of_day = since_epoch.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60,
        since_epoch.subsec_millis()
    )
}

fn seconds(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

/// min, median, max.
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    (values[0], median, values[n - 1])
}

fn report(all: &[Series], faults: usize) -> bool {
    println!();
    println!(
        "Failover benchmark ({}, {faults} faults of each kind)",
        support::machine()
    );
    println!(
        "write again: seconds from the fault applied (its command started) until a write \
         through -rw is acknowledged again; outage: from the first failed write"
    );
    println!(
        "| mode  | fault                              | write again min | median | max     \
         | outage median | goal | median/goal | rows lost | later outages |"
    );
    println!(
        "| ----- | ---------------------------------- | --------------: | -----: | ------: \
         | ------------: | ---: | ----------: | --------: | ------------- |"
    );
    for series in all {
        let ((min, median, max), outage) = series.figures();
        let lost: usize = series.samples.iter().map(|s| s.lost).sum();
        let (goal, ratio) = match series.fault.goal() {
            Some(goal) => (
                format!("{:.0} s", seconds(goal)),
                format!("{:.2}", median / seconds(goal)),
            ),
            None => ("-".into(), "-".into()),
        };
        let later: Vec<f64> = series
            .samples
            .iter()
            .flat_map(|s| &s.later_outages)
            .map(|pause| seconds(*pause))
            .collect();
        let later = if later.is_empty() {
            "none".to_owned()
        } else {
            let (_, median, max) = spread(later.clone());
            format!(
                "{} in {} samples, median {median:.2} s, max {max:.2} s",
                later.len(),
                series
                    .samples
                    .iter()
                    .filter(|s| !s.later_outages.is_empty())
                    .count()
            )
        };
        println!(
            "| {:<5} | {:<34} | {:>13.2} s | {:>4.2} s | {:>5.2} s | {:>11.2} s | {:>4} | {:>11} | {:>9} | {} |",
            series.mode,
            series.fault.label(),
            min,
            median,
            max,
            outage,
            goal,
            ratio,
            lost,
            later
        );
    }
    println!();
    for series in all {
        let ((_, median, _), outage) = series.figures();
        if let Some(goal) = series.fault.goal() {
            println!(
                "{} {}: median {median:.2} s (goal {:.0} s: {:.2}); \
                 from the first failed write {outage:.2} s ({:.2})",
                series.mode,
                series.fault.label(),
                seconds(goal),
                median / seconds(goal),
                outage / seconds(goal),
            );
        }
        if series.failovers > 0 {
            println!(
                "{} {}: {} of {} kills ended with another primary (none expected)",
                series.mode,
                series.fault.label(),
                series.failovers,
                series.samples.len()
            );
        }
    }
    let lost_in = |mode: &str| -> Vec<f64> {
        all.iter()
            .filter(|s| s.mode == mode)
            .flat_map(|s| &s.samples)
            .map(|s| s.lost as f64)
            .collect()
    };
    let sync_lost = lost_in("sync");
    let sync_total: f64 = sync_lost.iter().sum();
    println!(
        "acknowledged rows lost, sync: {sync_total:.0} over {} faults (must be 0){}",
        sync_lost.len(),
        if sync_total == 0.0 { "" } else { "  FAILED" }
    );
    let async_lost = lost_in("async");
    if !async_lost.is_empty() {
        let total: f64 = async_lost.iter().sum();
        let count = async_lost.len();
        let (min, median, max) = spread(async_lost);
        println!(
            "acknowledged rows lost, async: {total:.0} over {count} failovers \
             (per failover min {min:.0}, median {median:.1}, max {max:.0})"
        );
    }
    sync_total == 0.0
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> std::process::ExitCode {
    let faults: usize = std::env::var("BENCH_FAULTS")
        .ok()
        .and_then(|value| value.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(10);
    let client = client().await;
    let namespace = TestNamespace::create(&client, "bench-failover").await;
    let ns = namespace.name.clone();
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    println!("operator log: {}", operator.log.display());
    let mut all = Vec::new();

    {
        let volumes = LocalVolumes::create("bench-sync", 1);
        let mut sync = subject(&ns, "shop-sync", &volumes.class, true, &logs).await;
        all.push(sync.series(Fault::KillPostgres, faults).await);
        all.push(sync.series(Fault::StopNode, faults).await);
        all.push(sync.series(Fault::Switchover, faults).await);
        drop(sync);
        save_events(&ns, "shop-sync");
        delete_cluster(&ns, "shop-sync");
    }
    {
        let volumes = LocalVolumes::create("bench-async", 1);
        let mut asynchronous = subject(&ns, "shop-async", &volumes.class, false, &logs).await;
        all.push(asynchronous.series(Fault::StopNode, faults).await);
        drop(asynchronous);
        save_events(&ns, "shop-async");
        delete_cluster(&ns, "shop-async");
    }

    let durable = report(&all, faults);
    drop(operator);
    if durable {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
