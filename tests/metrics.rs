//! Metrics end to end on the dev nodes: a 2-instance DatabaseCluster, the operator's,
//! both instance managers' and the node agents' `/metrics` scraped over plain HTTP at
//! the addresses and ports docs/metrics.md gives. The names are there with sane values
//! (one primary, one replica in recovery, both up), every family served is documented,
//! and a write burst moves the transaction counter, the primary's WAL position and the
//! replica's replayed position, with WAL seen in flight on the way. A frozen server
//! reads as `castellan_pg_up 0` within the scrape's bound.

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::cluster::{
    LocalVolumes, Operator, apply_cluster, connect_app, describe, http_get, instance_addresses,
    jsonpath, wait_for,
};
use support::faults::{instance_manager_pid, instance_processes, signal};
use support::{TestNamespace, client, kubectl_ok};

const OPERATOR: &str = "127.0.78.1:8080";
const CLUSTER: &str = "shop";
const INSTANCE_METRICS_PORT: u16 = 9187;
const AGENT_METRICS_PORT: u16 = 9188;

/// The value of the first sample of `name` whose labels include every `labels` pair.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            return None;
        }
        if !labels
            .iter()
            .all(|(key, value)| rest.contains(&format!("{key}=\"{value}\"")))
        {
            return None;
        }
        rest.rsplit(' ').next()?.parse().ok()
    })
}

/// `sample`, or a failed test that shows the scrape.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(text, name, labels)
        .unwrap_or_else(|| panic!("no {name} {labels:?} in the scrape:\n{text}"))
}

fn scrape(address: &str) -> String {
    let (code, body) = http_get(address, "/metrics");
    assert_eq!(code, 200, "GET http://{address}/metrics: {body}");
    assert!(
        body.ends_with("# EOF\n"),
        "an OpenMetrics exposition: {body}"
    );
    body
}

/// Names in docs/metrics.md's tables.
fn documented() -> BTreeSet<String> {
    let docs = std::fs::read_to_string(support::repo().join("docs/metrics.md")).expect("docs");
    docs.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split('`').next())
        .filter(|name| name.starts_with("castellan_"))
        .map(str::to_owned)
        .collect()
}

/// Every family a scrape declares is documented under the name a query uses
/// (OpenMetrics declares counters without their `_total`).
fn assert_documented(what: &str, text: &str, documented: &BTreeSet<String>) {
    let mut families = 0;
    for line in text.lines() {
        let Some(declared) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = declared.split_once(' ').expect("# TYPE name kind");
        let queried = match kind {
            "counter" => format!("{name}_total"),
            _ => name.to_owned(),
        };
        assert!(
            documented.contains(&queried),
            "{what} serves {queried}, which docs/metrics.md does not list"
        );
        families += 1;
    }
    assert!(families > 0, "{what} served no metric family:\n{text}");
}

#[tokio::test]
async fn operator_instances_and_agents_serve_metrics_that_move_with_writes() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "metrics").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("metrics-local", 1);
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    let documented = documented();

    apply_cluster(&ns, CLUSTER, 2, &volumes.class, "");
    wait_for(
        "the 2-instance cluster is Ready",
        Duration::from_secs(240),
        || {
            jsonpath(
                "dbc",
                CLUSTER,
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
        },
        diagnostics,
    );

    // The operator: the leader, its cluster passes counted and timed, both pods made.
    let text = scrape(OPERATOR);
    assert_documented("the operator", &text, &documented);
    assert_eq!(value(&text, "castellan_leader", &[]), 1.0);
    assert!(
        value(
            &text,
            "castellan_reconciles_total",
            &[("controller", "cluster")]
        ) >= 1.0
    );
    assert!(
        value(
            &text,
            "castellan_reconcile_duration_seconds_count",
            &[("controller", "cluster")]
        ) >= 1.0
    );
    assert_eq!(value(&text, "castellan_instances_created_total", &[]), 2.0);

    // The instances, at their pod address on the metrics port.
    let primary = jsonpath("dbc", CLUSTER, &ns, "{.status.currentPrimary}");
    let addresses = instance_addresses(&ns, CLUSTER);
    assert_eq!(addresses.len(), 2, "{addresses:?}");
    let endpoint = |pod: &str| {
        let ip = &addresses
            .iter()
            .find(|(name, _)| name == pod)
            .expect("pod")
            .1;
        format!("{ip}:{INSTANCE_METRICS_PORT}")
    };
    let replica = addresses
        .iter()
        .map(|(pod, _)| pod.clone())
        .find(|pod| *pod != primary)
        .expect("a replica");
    let (primary_metrics, replica_metrics) = (endpoint(&primary), endpoint(&replica));
    // A standby shows in pg_stat_replication once it streams; Ready needs no more.
    wait_for(
        "the primary reports its streaming standby",
        Duration::from_secs(60),
        || {
            sample(
                &scrape(&primary_metrics),
                "castellan_pg_replication_streaming_replicas",
                &[],
            ) == Some(1.0)
        },
        diagnostics,
    );
    let before_primary = scrape(&primary_metrics);
    let before_replica = scrape(&replica_metrics);
    assert_documented(&primary, &before_primary, &documented);
    assert_documented(&replica, &before_replica, &documented);
    let cluster = [("cluster", CLUSTER)];
    for text in [&before_primary, &before_replica] {
        assert_eq!(value(text, "castellan_pg_up", &cluster), 1.0);
        assert!(
            value(
                text,
                "castellan_pg_database_size_bytes",
                &[("datname", "shop")]
            ) > 1e6
        );
        assert!(value(text, "castellan_pg_settings_max_connections", &[]) >= 10.0);
    }
    assert_eq!(
        value(&before_primary, "castellan_pg_role", &[("role", "primary")]),
        1.0
    );
    assert_eq!(
        value(&before_primary, "castellan_pg_replication_in_recovery", &[]),
        0.0
    );
    assert_eq!(
        value(&before_replica, "castellan_pg_role", &[("role", "replica")]),
        1.0
    );
    assert_eq!(
        value(&before_replica, "castellan_pg_replication_in_recovery", &[]),
        1.0
    );
    assert_eq!(
        value(
            &before_replica,
            "castellan_pg_replication_is_wal_receiver_up",
            &[]
        ),
        1.0
    );
    let standby = [("standby", replica.as_str())];
    value(
        &before_primary,
        "castellan_pg_stat_replication_replay_diff_bytes",
        &standby,
    );
    value(
        &before_primary,
        "castellan_pg_stat_archiver_archived_total",
        &cluster,
    );
    value(
        &before_primary,
        "castellan_pg_replication_slots_retained_bytes",
        &[],
    );

    // A write burst through the primary while both are scraped: the primary's
    // commits and WAL position, and the replica's replayed position, move; WAL in
    // flight (not yet replayed) is seen on the way.
    let host = addresses
        .iter()
        .find(|(name, _)| *name == primary)
        .expect("primary")
        .1
        .clone();
    let mut connection = connect_app(&ns, CLUSTER, &host).await;
    sqlx::query("create table burst (id bigserial primary key, payload text)")
        .execute(&mut connection)
        .await
        .expect("creating the table");
    let writing = Arc::new(AtomicBool::new(true));
    let watcher = std::thread::spawn({
        let writing = writing.clone();
        let (primary_metrics, replica_metrics) = (primary_metrics.clone(), replica_metrics.clone());
        move || {
            let mut in_flight: f64 = 0.0;
            while writing.load(Ordering::SeqCst) {
                let on_primary = http_get(&primary_metrics, "/metrics").1;
                let on_replica = http_get(&replica_metrics, "/metrics").1;
                for figure in [
                    sample(
                        &on_primary,
                        "castellan_pg_stat_replication_sent_diff_bytes",
                        &[],
                    ),
                    sample(
                        &on_primary,
                        "castellan_pg_stat_replication_replay_diff_bytes",
                        &[],
                    ),
                    sample(
                        &on_replica,
                        "castellan_pg_replication_replay_lag_bytes",
                        &[],
                    ),
                ] {
                    in_flight = in_flight.max(figure.unwrap_or(0.0));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            in_flight
        }
    });
    let commits = 200;
    for round in 0..commits {
        // 200 commits of ~256 KiB of WAL each: enough for a standby to trail.
        sqlx::query("insert into burst (payload) select repeat(md5(random()::text), 8) from generate_series(1, 1000)")
            .execute(&mut connection)
            .await
            .unwrap_or_else(|e| panic!("insert {round}: {e}"));
    }
    writing.store(false, Ordering::SeqCst);
    let in_flight = watcher.join().expect("the scraping thread");

    // Backends publish their transaction counts to the cumulative statistics at most
    // once a second, and an idle one within seconds: wait for the last of them.
    let shop = [("datname", "shop")];
    let commits_before = value(
        &before_primary,
        "castellan_pg_stat_database_xact_commit_total",
        &shop,
    );
    let committed = std::cell::Cell::new(0.0);
    wait_for(
        "the primary counts the burst's commits",
        Duration::from_secs(30),
        || {
            let counted = sample(
                &scrape(&primary_metrics),
                "castellan_pg_stat_database_xact_commit_total",
                &shop,
            );
            committed.set(counted.unwrap_or(0.0) - commits_before);
            committed.get() >= f64::from(commits)
        },
        || {
            format!(
                "{} commits counted for {commits} made\n{}",
                committed.get(),
                diagnostics()
            )
        },
    );
    let committed = committed.get();
    let after_primary = scrape(&primary_metrics);
    let written = value(&after_primary, "castellan_pg_current_wal_lsn_bytes", &[])
        - value(&before_primary, "castellan_pg_current_wal_lsn_bytes", &[]);
    assert!(
        written > 20e6,
        "the primary's WAL position moved only {written} bytes"
    );
    let replayed_before = value(
        &before_replica,
        "castellan_pg_last_wal_replay_lsn_bytes",
        &[],
    );
    wait_for(
        "the replica replays the burst",
        Duration::from_secs(60),
        || {
            sample(
                &scrape(&replica_metrics),
                "castellan_pg_last_wal_replay_lsn_bytes",
                &[],
            )
            .is_some_and(|replayed| replayed - replayed_before >= written * 0.9)
        },
        diagnostics,
    );
    eprintln!(
        "burst: {committed} commits, {:.1} MB of WAL; up to {:.1} MB seen in flight to the standby",
        written / 1e6,
        in_flight / 1e6
    );
    assert!(
        in_flight > 0.0,
        "no scrape during the burst saw WAL not yet sent, or not yet replayed"
    );

    // A server that does not answer: the replica's PostgreSQL frozen (not its
    // manager). The scrape still answers, within its 5 s bound, with up 0; thawed, 1.
    let frozen: Vec<u32> = instance_processes(&ns, &replica)
        .into_iter()
        .filter(|pid| Some(*pid) != instance_manager_pid(&ns, &replica))
        .collect();
    assert!(!frozen.is_empty(), "no PostgreSQL processes of {replica}");
    for pid in &frozen {
        signal(*pid, "STOP");
    }
    let asked = Instant::now();
    // Not http_get: its 5 s limit is the scrape's own bound, with no room to answer.
    let output = std::process::Command::new("curl")
        .args(["-s", "--max-time", "15", "-w", "\n%{http_code}"])
        .arg(format!("http://{replica_metrics}/metrics"))
        .output()
        .expect("running curl");
    let took = asked.elapsed();
    let output = String::from_utf8_lossy(&output.stdout).into_owned();
    let (text, code) = output.rsplit_once('\n').unwrap_or(("", "0"));
    let code: u16 = code.trim().parse().unwrap_or(0);
    for pid in &frozen {
        signal(*pid, "CONT");
    }
    assert_eq!(code, 200, "a frozen server's scrape: {text}");
    assert_eq!(value(text, "castellan_pg_up", &cluster), 0.0, "{text}");
    assert!(
        sample(text, "castellan_pg_replication_in_recovery", &[]).is_none(),
        "nothing is reported of a server that did not answer:\n{text}"
    );
    assert!(took < Duration::from_secs(7), "the scrape took {took:?}");
    eprintln!("a frozen server's scrape answered castellan_pg_up 0 in {took:.1?}");
    wait_for(
        "the thawed replica is up again in its metrics",
        Duration::from_secs(30),
        || sample(&scrape(&replica_metrics), "castellan_pg_up", &cluster) == Some(1.0),
        diagnostics,
    );

    // The agents: each at its pod address, reporting its own node's disks.
    let agents = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "castellan-system",
        "-l",
        "app.kubernetes.io/name=castellan-agent",
        "-o",
        "jsonpath={range .items[*]}{.spec.nodeName} {.status.podIP}{\"\\n\"}{end}",
    ]);
    if agents.trim().is_empty() {
        eprintln!("no agent DaemonSet on this cluster: its /metrics are not checked");
    }
    for line in agents.lines() {
        let (node, ip) = line.split_once(' ').expect("node and address");
        let text = scrape(&format!("{ip}:{AGENT_METRICS_PORT}"));
        assert_documented(&format!("the agent of {node}"), &text, &documented);
        value(
            &text,
            "castellan_block_devices",
            &[("node", node), ("phase", "InUse")],
        );
    }
}
