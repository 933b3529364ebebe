//! Faults for the failover suite and benchmark, injected the way a machine or a person
//! causes them: a killed process, a stopped node, a frozen primary, a lost volume — and
//! a writer that records every commit the cluster acknowledged, to check afterwards
//! that none was lost.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};

use super::cluster::{jsonpath, secret_value};
use super::{kubeconfig_path, kubectl_ok};

/// Sends `signal` (a name such as `KILL`) to `pid`.
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args(["-s", signal, "--", &pid.to_string()])
        .status();
}

/// The host directory of an instance's volume (its PV's local path).
pub fn volume_path(namespace: &str, pod: &str) -> PathBuf {
    let pv = jsonpath("pvc", pod, namespace, "{.spec.volumeName}");
    assert!(!pv.is_empty(), "the claim of {pod} is bound");
    PathBuf::from(kubectl_ok(&[
        "get",
        "pv",
        &pv,
        "-o",
        "jsonpath={.spec.local.path}",
    ]))
}

/// The postmaster's pid of an instance, from `postmaster.pid` on its volume.
pub fn postmaster_pid(namespace: &str, pod: &str) -> Option<u32> {
    let file = volume_path(namespace, pod).join("pgdata/postmaster.pid");
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// When an instance's postmaster started, from `postmaster.pid` on its volume (its
/// third line: seconds since the epoch).
pub fn postmaster_started(namespace: &str, pod: &str) -> Option<SystemTime> {
    let file = volume_path(namespace, pod).join("pgdata/postmaster.pid");
    let seconds: u64 = std::fs::read_to_string(file)
        .ok()?
        .lines()
        .nth(2)?
        .trim()
        .parse()
        .ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(seconds))
}

/// The parent of a process.
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 4, after the command name in parentheses (which may hold spaces).
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn children(pid: u32) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// The instance manager (the pod's main process) of an instance: the postmaster's
/// parent.
pub fn instance_manager_pid(namespace: &str, pod: &str) -> Option<u32> {
    parent(postmaster_pid(namespace, pod)?)
}

/// Every process of an instance: its manager, the postmaster and the backends.
pub fn instance_processes(namespace: &str, pod: &str) -> Vec<u32> {
    let Some(postmaster) = postmaster_pid(namespace, pod) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = parent(postmaster).into_iter().collect();
    pids.push(postmaster);
    pids.extend(children(postmaster));
    pids
}

/// `deploy/local/nodes.sh stop|start NAME` on the cluster under test.
pub fn node(action: &str, name: &str) {
    let dev = kubeconfig_path()
        .parent()
        .map(PathBuf::from)
        .expect("the kubeconfig's directory");
    let port_base = std::env::var("CASTELLAN_PORT_BASE").unwrap_or_else(|_| "26000".into());
    let run = || {
        Command::new(super::repo().join("deploy/local/nodes.sh"))
            .args([action, name])
            .env("CASTELLAN_DEV_DIR", &dev)
            .env("CASTELLAN_PORT_BASE", &port_base)
            .status()
            .expect("running nodes.sh")
            .success()
    };
    // `nodes.sh start` checks that the node process runs right after forking it, and on
    // a loaded machine may look before the fork has become castellan-devnode (its
    // /proc/PID/exe is still bash): it then reports "node-N exited" of a node that runs.
    // Asked again, it finds the node running and waits for it to be Ready; a node that
    // really exits fails every time.
    let attempts = if action == "start" { 3 } else { 1 };
    for attempt in 1..=attempts {
        if run() {
            return;
        }
        eprintln!("nodes.sh {action} {name} failed (attempt {attempt} of {attempts})");
    }
    panic!("nodes.sh {action} {name} failed");
}

/// The node an instance runs on.
pub fn node_of(namespace: &str, pod: &str) -> String {
    jsonpath("pod", pod, namespace, "{.spec.nodeName}")
}

/// What the writer saw.
#[derive(Default)]
struct Ledger {
    /// Ids whose commit the cluster acknowledged.
    acknowledged: BTreeSet<i64>,
    next: i64,
    last_success: Option<Instant>,
    /// The longest time between two acknowledged commits since the last reset.
    longest_gap: Duration,
    /// When a write failed (an error or no answer), oldest first. Few: after a failure
    /// the writer reconnects before it writes again, and a failed connect is no write.
    failures: Vec<Instant>,
    /// The first acknowledged commit after each run of failures, oldest first.
    resumptions: Vec<Instant>,
}

/// A run of failed writes as the writer saw it, and its end.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// When the first write of the run failed.
    pub first_failure: Instant,
    /// When the first commit after it was acknowledged: writes work again.
    pub write_again: Instant,
}

impl Ledger {
    /// Every run of failed writes that began after `since` and has ended, oldest first.
    fn outages_after(&self, since: Instant) -> Vec<Outage> {
        let mut outages = Vec::new();
        let mut from = since;
        while let Some(first_failure) = self.failures.iter().find(|at| **at > from).copied() {
            let Some(write_again) = self
                .resumptions
                .iter()
                .find(|at| **at > first_failure)
                .copied()
            else {
                break;
            };
            outages.push(Outage {
                first_failure,
                write_again,
            });
            from = write_again;
        }
        outages
    }
}

/// Writes rows `(id, value)` into `ledger` through `-rw` without pause, recording each
/// acknowledged commit; reconnects after any error. Stops when dropped.
pub struct Writer {
    ledger: Arc<Mutex<Ledger>>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    pub async fn start(namespace: &str, cluster: &str) -> Self {
        let host = jsonpath(
            "svc",
            &format!("{cluster}-rw"),
            namespace,
            "{.spec.clusterIP}",
        );
        let password = secret_value(namespace, &format!("{cluster}-app"), "password");
        let options = PgConnectOptions::new()
            .host(&host)
            .port(5432)
            .username("clerk")
            .password(&password)
            .database("shop");
        let mut setup = super::postgres::connect(&host, "clerk", &password, "shop").await;
        sqlx::query("create table if not exists ledger (id bigint primary key, value text)")
            .execute(&mut setup)
            .await
            .expect("creating the ledger");
        drop(setup);
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let shared = ledger.clone();
        let task = tokio::spawn(async move {
            let mut connection: Option<PgConnection> = None;
            loop {
                let Some(conn) = connection.as_mut() else {
                    match tokio::time::timeout(Duration::from_secs(2), options.connect()).await {
                        Ok(Ok(conn)) => connection = Some(conn),
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                    continue;
                };
                let id = {
                    let mut ledger = shared.lock().expect("ledger");
                    ledger.next += 1;
                    ledger.next
                };
                let insert = sqlx::query("insert into ledger (id, value) values ($1, $2)")
                    .bind(id)
                    .bind(format!("row {id}"))
                    .execute(&mut *conn);
                match tokio::time::timeout(Duration::from_secs(5), insert).await {
                    Ok(Ok(_)) => {
                        let mut ledger = shared.lock().expect("ledger");
                        let now = Instant::now();
                        if let Some(last) = ledger.last_success {
                            ledger.longest_gap = ledger.longest_gap.max(now - last);
                        }
                        let failed_last = ledger
                            .failures
                            .last()
                            .is_some_and(|failure| ledger.last_success < Some(*failure));
                        if failed_last {
                            ledger.resumptions.push(now);
                        }
                        ledger.last_success = Some(now);
                        ledger.acknowledged.insert(id);
                    }
                    _ => {
                        // Unknown outcome (an error or no answer): not acknowledged.
                        shared.lock().expect("ledger").failures.push(Instant::now());
                        connection = None;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Self { ledger, task }
    }

    /// The ids acknowledged so far.
    pub fn acknowledged(&self) -> BTreeSet<i64> {
        self.ledger.lock().expect("ledger").acknowledged.clone()
    }

    /// The longest pause between acknowledged commits since the last call, and resets it.
    pub fn take_longest_gap(&self) -> Duration {
        let mut ledger = self.ledger.lock().expect("ledger");
        std::mem::take(&mut ledger.longest_gap)
    }

    /// Waits until a commit is acknowledged after `since`; how long after `since`.
    pub async fn wait_for_write_after(&self, since: Instant, timeout: Duration) -> Duration {
        let deadline = since + timeout;
        loop {
            let last = self.ledger.lock().expect("ledger").last_success;
            if let Some(last) = last.filter(|last| *last > since) {
                return last - since;
            }
            assert!(
                Instant::now() < deadline,
                "a write through -rw succeeds again within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until a write fails after `since` and a commit is acknowledged after that
    /// failure: the first outage after `since`. `since` is taken before the fault is
    /// applied: a command that applies one (stopping a node) may break the writer's
    /// connection before it returns. Unlike `wait_for_write_after`, a commit acknowledged
    /// between the fault and the first failure does not count as writes working again:
    /// it was in flight, or sent before the server noticed the fault. Panics when no
    /// write fails, or none succeeds again, within `timeout`.
    pub async fn wait_for_recovery_after(&self, since: Instant, timeout: Duration) -> Outage {
        let deadline = since + timeout;
        loop {
            {
                let ledger = self.ledger.lock().expect("ledger");
                if let Some(outage) = ledger.outages_after(since).first() {
                    return *outage;
                }
                assert!(
                    Instant::now() < deadline,
                    "a write through -rw fails after the fault and succeeds again within \
                     {timeout:?} (first failure after it: {:?})",
                    ledger
                        .failures
                        .iter()
                        .find(|at| **at > since)
                        .map(|at| *at - since)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The outages that began after `since` and have ended: for instance a second one
    /// after writes had already recovered from a fault.
    pub fn outages_after(&self, since: Instant) -> Vec<Outage> {
        self.ledger.lock().expect("ledger").outages_after(since)
    }

    /// Whether a write failed after `since`.
    pub fn failed_after(&self, since: Instant) -> bool {
        self.ledger
            .lock()
            .expect("ledger")
            .failures
            .last()
            .is_some_and(|at| *at > since)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Acknowledged ids missing on the instance at `host` (after waiting up to `patience`
/// for replication to deliver them).
pub async fn missing_on(
    namespace: &str,
    cluster: &str,
    host: &str,
    acknowledged: &BTreeSet<i64>,
    patience: Duration,
) -> Vec<i64> {
    read_missing(namespace, cluster, host, acknowledged, patience)
        .await
        .unwrap_or_else(|_| acknowledged.iter().copied().collect())
}

/// The acknowledged ids the instance at `host` does not have once `patience` has
/// passed (or as soon as it has them all); an error when it could not be read at all
/// meanwhile.
pub async fn read_missing(
    namespace: &str,
    cluster: &str,
    host: &str,
    acknowledged: &BTreeSet<i64>,
    patience: Duration,
) -> Result<Vec<i64>, String> {
    let password = secret_value(namespace, &format!("{cluster}-app"), "password");
    let ids: Vec<i64> = acknowledged.iter().copied().collect();
    let deadline = Instant::now() + patience;
    loop {
        let found: Result<Vec<i64>, String> = async {
            let mut conn = PgConnectOptions::new()
                .host(host)
                .port(5432)
                .username("clerk")
                .password(&password)
                .database("shop")
                .connect()
                .await
                .map_err(|e| format!("connecting to {host}: {e}"))?;
            sqlx::query_scalar("select id from ledger where id = any($1)")
                .bind(&ids)
                .fetch_all(&mut conn)
                .await
                .map_err(|e| format!("reading the ledger on {host}: {e}"))
        }
        .await;
        let missing = found.map(|found| {
            let found: BTreeSet<i64> = found.into_iter().collect();
            ids.iter()
                .filter(|id| !found.contains(id))
                .copied()
                .collect::<Vec<i64>>()
        });
        if missing.as_ref().is_ok_and(Vec::is_empty) || Instant::now() > deadline {
            return missing;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// How often the kubelet has restarted the pod's container.
pub fn restarts(namespace: &str, pod: &str) -> u64 {
    super::cluster::jsonpath(
        "pod",
        pod,
        namespace,
        "{.status.containerStatuses[0].restartCount}",
    )
    .parse()
    .unwrap_or(0)
}

/// The instances and their reported roles, from status.
pub fn reported_roles(namespace: &str, cluster: &str) -> Vec<(String, String)> {
    jsonpath(
        "dbc",
        cluster,
        namespace,
        "{range .status.instances[*]}{.name}={.role} {end}",
    )
    .split_whitespace()
    .filter_map(|pair| {
        let (name, role) = pair.split_once('=')?;
        Some((name.to_owned(), role.to_owned()))
    })
    .collect()
}
