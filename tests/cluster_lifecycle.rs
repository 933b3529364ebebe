//! Day two of a DatabaseCluster, end to end on the dev nodes through kubectl-level
//! actions: a 3-instance synchronous cluster scaled to 5 while the leading operator is
//! killed, then to 2 (a commit is on the remaining sync standby when it returns); a
//! reloadable and a restart-only parameter changed; a value PostgreSQL refuses never
//! written (a condition names it, a replica made meanwhile starts without it); a
//! replica's volume lost and rebuilt from the primary; an actor panic survived and reported; the Lease released
//! on a clean shutdown; a version the image does not carry runs nothing and says why.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::cluster::{
    LocalVolumes, Operator, apply_cluster, apply_cluster_of, catalog_image, condition_message,
    connect_app, describe, events, events_with, http_get, instance_addresses, jsonpath,
    phase_and_ready, server_versions, set_catalog_image, wait_for, wait_for_catalog, wait_orders,
};
use support::faults::{Writer, volume_path};
use support::{TestNamespace, client, kubectl, kubectl_ok};

const SCALE_OPERATORS: [&str; 2] = ["127.0.61.1:8080", "127.0.61.2:8080"];
const FAULT_OPERATOR: &str = "127.0.62.1:8080";
const VERSION_OPERATOR: &str = "127.0.75.1:8080";
const MINOR_OPERATOR: &str = "127.0.75.2:8080";

fn roles(namespace: &str, name: &str) -> Vec<String> {
    kubectl_ok(&[
        "get",
        "pods",
        "-n",
        namespace,
        "-l",
        &format!("castellan.io/cluster={name}"),
        "-o",
        "jsonpath={.items[*].metadata.labels.castellan\\.io/role}",
    ])
    .split_whitespace()
    .map(str::to_owned)
    .collect()
}

fn pods(namespace: &str, name: &str) -> Vec<String> {
    instance_addresses(namespace, name)
        .into_iter()
        .map(|(pod, _)| pod)
        .collect()
}

async fn setting(connection: &mut sqlx::PgConnection, name: &str) -> String {
    sqlx::query_scalar::<_, String>("select current_setting($1)")
        .bind(name)
        .fetch_one(connection)
        .await
        .unwrap_or_else(|e| panic!("show {name}: {e}"))
}

/// `kubectl patch`es `shop`'s `spec.parameters` to `parameters` (a JSON object).
fn patch_parameters(namespace: &str, parameters: &str) {
    kubectl_ok(&[
        "patch",
        "dbc",
        "shop",
        "-n",
        namespace,
        "--type",
        "merge",
        "-p",
        &format!(r#"{{"spec":{{"parameters":{parameters}}}}}"#),
    ]);
}

/// `work_mem` on each instance of `shop`, in the order of their pods' names.
async fn work_mem_everywhere(namespace: &str) -> Vec<String> {
    let mut values = Vec::new();
    for (_, ip) in instance_addresses(namespace, "shop") {
        let mut connection = connect_app(namespace, "shop", &ip).await;
        values.push(setting(&mut connection, "work_mem").await);
    }
    values
}

/// Every instance has every row of `orders`.
async fn every_instance_has(namespace: &str, name: &str, rows: i64) {
    for (pod, ip) in instance_addresses(namespace, name) {
        let mut connection = connect_app(namespace, name, &ip).await;
        wait_orders(&mut connection, rows, &format!("rows on {pod}")).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_up_through_an_operator_failover_then_down_change_parameters_and_rebuild() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "life").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("life-local", 2);
    let mut operators = vec![
        Operator::start(&ns, SCALE_OPERATORS[0]),
        Operator::start(&ns, SCALE_OPERATORS[1]),
    ];
    let logs: Vec<PathBuf> = operators.iter().map(|o| o.log.clone()).collect();
    let diagnostics = || describe(&ns, &logs);

    let sync = "  replication: {mode: sync, syncReplicas: 1}\n";
    apply_cluster(&ns, "shop", 3, &volumes.class, sync);
    wait_for(
        "3 instances Ready",
        Duration::from_secs(240),
        || phase_and_ready(&ns, "shop") == "Ready/3",
        diagnostics,
    );
    let rw = jsonpath("svc", "shop-rw", &ns, "{.spec.clusterIP}");
    let mut primary = connect_app(&ns, "shop", &rw).await;
    sqlx::query("create table orders (id int primary key)")
        .execute(&mut primary)
        .await
        .expect("create");
    sqlx::query("insert into orders values (1)")
        .execute(&mut primary)
        .await
        .expect("insert");
    drop(primary);
    every_instance_has(&ns, "shop", 1).await;

    // Scale to 5, and kill the leading operator as soon as the first new instance
    // exists: the other takes over and finishes, with one primary and no lost instance.
    kubectl_ok(&[
        "patch",
        "dbc",
        "shop",
        "-n",
        &ns,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"replicas":5}}"#,
    ]);
    wait_for(
        "scale-up started",
        Duration::from_secs(60),
        || pods(&ns, "shop").len() > 3,
        diagnostics,
    );
    let leader = operators
        .iter()
        .position(Operator::is_leader)
        .expect("one operator leads");
    drop(operators.remove(leader));
    let survivor = operators.pop().expect("the other operator");
    let resumed = Instant::now();
    wait_for(
        "5 instances Ready after the operator failover",
        Duration::from_secs(300),
        || phase_and_ready(&ns, "shop") == "Ready/5",
        diagnostics,
    );
    println!(
        "scale-up finished {:.1} s after the leader was killed",
        resumed.elapsed().as_secs_f64()
    );
    assert!(survivor.is_leader());
    let mut found = roles(&ns, "shop");
    found.sort();
    assert_eq!(
        found,
        vec!["primary", "replica", "replica", "replica", "replica"],
        "one primary, no duplicates:\n{}",
        diagnostics()
    );
    every_instance_has(&ns, "shop", 1).await;

    // Scale to 2: the surplus standbys leave the quorum first, then go with their volumes.
    kubectl_ok(&[
        "patch",
        "dbc",
        "shop",
        "-n",
        &ns,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"replicas":2}}"#,
    ]);
    wait_for(
        "2 instances Ready, the others and their volumes gone",
        Duration::from_secs(180),
        || {
            phase_and_ready(&ns, "shop") == "Ready/2"
                && pods(&ns, "shop") == vec!["shop-1", "shop-2"]
                && kubectl_ok(&[
                    "get",
                    "pvc",
                    "-n",
                    &ns,
                    "-o",
                    "jsonpath={.items[*].metadata.name}",
                ]) == "shop-1 shop-2"
        },
        diagnostics,
    );
    let mut primary = connect_app(&ns, "shop", &rw).await;
    wait_for_setting(&mut primary, "synchronous_standby_names", "ANY 1 (shop-2)").await;
    // In sync mode a committed row is on the synchronous standby when the commit
    // returns (remote_apply: applied there, so visible, not only flushed).
    let standby_ip = instance_addresses(&ns, "shop")
        .into_iter()
        .find(|(pod, _)| pod == "shop-2")
        .map(|(_, ip)| ip)
        .expect("shop-2 has an address");
    let mut standby = connect_app(&ns, "shop", &standby_ip).await;
    sqlx::query("set synchronous_commit = remote_apply")
        .execute(&mut primary)
        .await
        .expect("set synchronous_commit");
    sqlx::query("insert into orders values (2)")
        .execute(&mut primary)
        .await
        .expect("a commit with the quorum on the remaining standby");
    let on_standby: i64 = sqlx::query_scalar("select count(*) from orders where id = 2")
        .fetch_one(&mut standby)
        .await
        .expect("reading the standby");
    assert_eq!(
        on_standby, 1,
        "the committed row is on the sync standby at commit time"
    );
    drop((primary, standby));
    every_instance_has(&ns, "shop", 2).await;
    assert!(
        events(&ns, "RemovedInstance").lines().count() >= 3,
        "{}",
        diagnostics()
    );

    // A reloadable and a restart-only parameter: the first by reload everywhere, the
    // second by a rolling restart, replicas first and the primary last.
    patch_parameters(&ns, r#"{"work_mem":"8MB","max_connections":"150"}"#);
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut started = Vec::new();
    'settled: loop {
        started.clear();
        let mut all = true;
        for (pod, ip) in instance_addresses(&ns, "shop") {
            let Ok(Ok(mut connection)) = tokio::time::timeout(Duration::from_secs(5), async {
                use sqlx::ConnectOptions;
                sqlx::postgres::PgConnectOptions::new()
                    .host(&ip)
                    .username("clerk")
                    .password(&support::cluster::secret_value(&ns, "shop-app", "password"))
                    .database("shop")
                    .connect()
                    .await
            })
            .await
            else {
                all = false;
                continue;
            };
            // The rolling restart may end this session between two reads: not yet.
            let read = sqlx::query_as::<_, (String, String, String)>(
                "select current_setting('work_mem'), current_setting('max_connections'), \
                 pg_postmaster_start_time()::text",
            )
            .fetch_one(&mut connection)
            .await;
            let Ok((work_mem, max_connections, start)) = read else {
                all = false;
                continue;
            };
            all &= work_mem == "8MB" && max_connections == "150";
            started.push((start, pod));
        }
        if all && started.len() == 2 && phase_and_ready(&ns, "shop") == "Ready/2" {
            break 'settled;
        }
        assert!(
            Instant::now() < deadline,
            "parameters applied everywhere within 180 s\n{}",
            diagnostics()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    started.sort();
    assert_eq!(
        started
            .iter()
            .map(|(_, pod)| pod.as_str())
            .collect::<Vec<_>>(),
        vec!["shop-2", "shop-1"],
        "the replica restarted before the primary: {started:?}"
    );
    assert!(events_with(&ns, "RollingRestart", "max_connections").contains("max_connections"));
    assert!(events(&ns, "Reloaded").lines().count() >= 2);

    // A value PostgreSQL refuses is never written: the condition names it with
    // PostgreSQL's reason, and every instance keeps its last good configuration. (The
    // replica rebuilt below is made while the spec still holds it: it starts without
    // it rather than crash-looping.)
    patch_parameters(&ns, r#"{"work_mem":"banana","max_connections":"150"}"#);
    let parameters_condition = |field: &str| {
        jsonpath(
            "dbc",
            "shop",
            &ns,
            &format!("{{.status.conditions[?(@.type==\"ParametersValid\")].{field}}}"),
        )
    };
    wait_for(
        "the refused work_mem in ParametersValid",
        Duration::from_secs(60),
        || {
            parameters_condition("reason") == "InvalidParameters"
                && parameters_condition("message")
                    .contains("invalid value for parameter \"work_mem\": \"banana\"")
        },
        diagnostics,
    );
    assert!(events_with(&ns, "InvalidParameters", "work_mem").contains("work_mem"));
    assert_eq!(work_mem_everywhere(&ns).await, vec!["8MB", "8MB"]);

    // A replica whose volume is lost is rebuilt from the primary.
    let lost = jsonpath("pvc", "shop-2", &ns, "{.metadata.uid}");
    kubectl_ok(&["delete", "pvc", "shop-2", "-n", &ns, "--wait=false"]);
    kubectl_ok(&[
        "delete",
        "pod",
        "shop-2",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ]);
    wait_for(
        "the replica rebuilt on a new volume and the cluster Ready",
        Duration::from_secs(180),
        || {
            // A new claim (the old one may linger while its finalizer goes), and the
            // status read with every pod running again: a Ready/2 written before the
            // operator saw the deletion would otherwise pass.
            let claim = jsonpath("pvc", "shop-2", &ns, "{.metadata.uid}");
            phase_and_ready(&ns, "shop") == "Ready/2"
                && !claim.is_empty()
                && claim != lost
                && instance_addresses(&ns, "shop")
                    .iter()
                    .all(|(_, ip)| !ip.is_empty())
        },
        diagnostics,
    );
    every_instance_has(&ns, "shop", 2).await;
    assert_eq!(
        work_mem_everywhere(&ns).await,
        vec!["8MB", "4MB"],
        "the primary keeps its last good value; the rebuilt replica runs without the refused one (PostgreSQL's default)"
    );
    assert_eq!(parameters_condition("status"), "False");

    // Corrected: taken everywhere, and the condition says so.
    patch_parameters(&ns, r#"{"work_mem":"16MB","max_connections":"150"}"#);
    let deadline = Instant::now() + Duration::from_secs(60);
    while work_mem_everywhere(&ns).await != vec!["16MB", "16MB"] {
        assert!(
            Instant::now() < deadline,
            "work_mem 16MB everywhere\n{}",
            diagnostics()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    wait_for(
        "ParametersValid again",
        Duration::from_secs(30),
        || parameters_condition("status") == "True",
        diagnostics,
    );
    assert!(!events_with(&ns, "ParametersValid", "").is_empty());

    kubectl_ok(&[
        "delete",
        "dbc",
        "shop",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ]);
    drop(survivor);
    drop(volumes);
}

async fn wait_for_setting(connection: &mut sqlx::PgConnection, name: &str, wanted: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let value = setting(connection, name).await;
        // PostgreSQL shows the names as written; compare without quotes and spaces.
        let normalise = |s: &str| s.replace(['"', ' '], "");
        if normalise(&value) == normalise(wanted) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} is {value:?}, not {wanted:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_actor_panic_is_survived_and_reported_as_degraded() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "fault").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("fault-local", 1);
    let mut operator = Operator::start_with(&ns, FAULT_OPERATOR, &["--fault-injection"]);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    apply_cluster(&ns, "calm", 1, &volumes.class, "");
    apply_cluster(&ns, "faulty", 1, &volumes.class, "");
    wait_for(
        "both clusters Ready",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "calm") == "Ready/1" && phase_and_ready(&ns, "faulty") == "Ready/1",
        diagnostics,
    );

    // Every message to the faulty cluster's actor now panics it.
    kubectl_ok(&[
        "annotate",
        "dbc",
        "faulty",
        "-n",
        &ns,
        "castellan.io/inject-fault=test panic",
    ]);
    let degraded = |name: &str| {
        jsonpath(
            "dbc",
            name,
            &ns,
            "{.status.conditions[?(@.type==\"Degraded\")].status}",
        )
    };
    wait_for(
        "the faulty cluster is Degraded",
        Duration::from_secs(120),
        || degraded("faulty") == "True",
        diagnostics,
    );
    let reason = condition_message(&ns, "faulty", "Degraded");
    assert!(reason.contains("injected fault: test panic"), "{reason}");
    assert_eq!(phase_and_ready(&ns, "faulty"), "Degraded/1");
    assert!(
        events(&ns, "Degraded").contains("injected fault"),
        "{}",
        diagnostics()
    );
    // The operator survived, and the other cluster did not notice.
    assert!(operator.running(), "the operator process is still running");
    // Its metrics count the restarts and the actor found failing (docs/metrics.md).
    let metrics = http_get(FAULT_OPERATOR, "/metrics").1;
    let count = |series: &str| {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{metrics}"))
    };
    assert!(
        count("castellan_actor_restarts_total{supervisor=\"clusters\"}") >= 1.0,
        "{metrics}"
    );
    assert!(
        count("castellan_actor_failing_total{supervisor=\"clusters\"}") >= 1.0,
        "{metrics}"
    );
    assert_eq!(phase_and_ready(&ns, "calm"), "Ready/1");
    assert_eq!(degraded("calm"), "False");

    // Fixing the cluster restarts its actor at once, and it recovers.
    kubectl_ok(&[
        "annotate",
        "dbc",
        "faulty",
        "-n",
        &ns,
        "castellan.io/inject-fault-",
    ]);
    wait_for(
        "the faulty cluster recovers",
        Duration::from_secs(60),
        || degraded("faulty") == "False" && phase_and_ready(&ns, "faulty") == "Ready/1",
        diagnostics,
    );

    // A clean shutdown gives the Lease up at once.
    let status = operator.terminate();
    assert!(
        status.success(),
        "the operator exits cleanly on SIGTERM: {status}"
    );
    let holder = kubectl(&[
        "get",
        "lease",
        "castellan-operator",
        "-n",
        &ns,
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&holder.stdout),
        "",
        "lease released"
    );
    drop(volumes);
}

/// A pod never runs another PostgreSQL major than the spec asks for (issue #11): the
/// dev nodes' image carries 15, so a cluster asking for 17 initialises nothing, starts
/// nothing, and says why; `status.version` is what the instances run (15 for a cluster
/// of 15), not a copy of the spec.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_the_image_does_not_carry_runs_nothing_and_says_why() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "versions").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("versions-local", 2);
    let operator = Operator::start(&ns, VERSION_OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    // The image catalog: made with the built images when there is none.
    wait_for_catalog(&ns, diagnostics);
    assert_eq!(
        catalog_image(&ns, "15"),
        "ghcr.io/castellan-io/castellan:0.1.0-pg15"
    );
    assert_eq!(
        catalog_image(&ns, "18"),
        "ghcr.io/castellan-io/castellan:0.1.0-pg18"
    );
    // A user's mistake: 17 mapped to an image that carries 15.
    set_catalog_image(&ns, "17", "ghcr.io/castellan-io/castellan:0.1.0-pg15");
    apply_cluster(&ns, "current", 1, &volumes.class, "");
    apply_cluster_of(&ns, "newer", "17", 1, &volumes.class, "");
    apply_cluster_of(&ns, "unlisted", "16", 1, &volumes.class, "");
    let condition_of = |cluster: &str, type_: &str, field: &str| {
        jsonpath(
            "dbc",
            cluster,
            &ns,
            &format!("{{.status.conditions[?(@.type==\"{type_}\")].{field}}}"),
        )
    };
    wait_for(
        "the cluster of 15 is Ready, the one of 17 says why it runs nothing, and the one of 16 \
         that the catalog has no image for it",
        Duration::from_secs(180),
        || {
            phase_and_ready(&ns, "current") == "Ready/1"
                && condition_of("newer", "PrimaryAvailable", "message")
                    .contains("carries PostgreSQL 15")
                && condition_of("unlisted", "VersionAvailable", "reason") == "NotInCatalog"
        },
        diagnostics,
    );
    let refusal = condition_of("newer", "PrimaryAvailable", "message");
    assert!(refusal.contains("asks for version 17"), "{refusal}");
    assert_eq!(jsonpath("dbc", "current", &ns, "{.status.version}"), "15");
    assert_eq!(
        jsonpath("dbc", "newer", &ns, "{.status.version}"),
        "",
        "nothing runs 17, so no version is reported"
    );
    assert!(
        !volume_path(&ns, "newer-1")
            .join("pgdata/PG_VERSION")
            .exists(),
        "nothing was initialised with the wrong binaries"
    );
    // The one without an image: no pod, a condition and a Warning that name the
    // catalog and what it has.
    let unlisted = condition_of("unlisted", "VersionAvailable", "message");
    assert!(
        unlisted.contains("no image for PostgreSQL 16"),
        "{unlisted}"
    );
    assert!(unlisted.contains("it has 15, 17, 18"), "{unlisted}");
    assert!(
        events_with(&ns, "VersionUnavailable", "PostgreSQL 16").contains("PostgreSQL 16"),
        "a Warning says so\n{}",
        diagnostics()
    );
    assert!(
        jsonpath("pod", "unlisted-1", &ns, "{.metadata.name}").is_empty(),
        "no pod runs another version than the one asked for"
    );
    assert_eq!(
        condition_of("current", "VersionAvailable", "status"),
        "True"
    );
    assert_eq!(
        jsonpath("pod", "current-1", &ns, "{.spec.containers[0].image}"),
        "ghcr.io/castellan-io/castellan:0.1.0-pg15"
    );

    // A version the catalog and the nodes have: 18 runs 18, its replica too (streaming
    // over TLS, with the 18 tools).
    apply_cluster_of(&ns, "eighteen", "18", 2, &volumes.class, "");
    wait_for(
        "the cluster of 18 is Ready with 2 instances",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "eighteen") == "Ready/2",
        diagnostics,
    );
    assert_eq!(jsonpath("dbc", "eighteen", &ns, "{.status.version}"), "18");
    assert_eq!(
        condition_of("eighteen", "VersionAvailable", "status"),
        "True"
    );
    let addresses = instance_addresses(&ns, "eighteen");
    assert_eq!(addresses.len(), 2, "{addresses:?}");
    for (pod, ip) in addresses {
        assert_eq!(
            jsonpath("pod", &pod, &ns, "{.spec.containers[0].image}"),
            "ghcr.io/castellan-io/castellan:0.1.0-pg18"
        );
        let mut connection = connect_app(&ns, "eighteen", &ip).await;
        let version: String = sqlx::query_scalar("show server_version_num")
            .fetch_one(&mut connection)
            .await
            .expect("server_version_num");
        assert!(version.starts_with("18"), "{pod} runs {version}");
    }

    drop(operator);
    drop(volumes);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_minor_update_rolls_through_the_instances_with_one_short_pause() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "minor").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("minor-local", 1);
    let operator = Operator::start(&ns, MINOR_OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    wait_for_catalog(&ns, diagnostics);
    set_catalog_image(&ns, "18", "ghcr.io/castellan-io/castellan:0.1.0-pg18.3");
    apply_cluster_of(&ns, "roll", "18", 3, &volumes.class, "");
    wait_for(
        "the cluster is Ready with 3 instances of 18.3",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "roll") == "Ready/3",
        diagnostics,
    );
    for (pod, version) in server_versions(&ns, "roll").await {
        assert_eq!(version, "18.3", "{pod}");
    }
    let writer = Writer::start(&ns, "roll").await;
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;

    // The catalog's 18 moves to the next minor: replicas are replaced one at a time,
    // then the primary after a switchover to an updated replica.
    let since = Instant::now();
    set_catalog_image(&ns, "18", "ghcr.io/castellan-io/castellan:0.1.0-pg18");
    let images = || {
        kubectl_ok(&[
            "get",
            "pods",
            "-n",
            &ns,
            "-l",
            "castellan.io/cluster=roll",
            "-o",
            "jsonpath={range .items[*]}{.spec.containers[0].image}{\"\\n\"}{end}",
        ])
    };
    wait_for(
        "every instance runs the new image and the cluster is Ready",
        Duration::from_secs(300),
        || {
            let images = images();
            images.lines().count() == 3
                && images
                    .lines()
                    .all(|image| image == "ghcr.io/castellan-io/castellan:0.1.0-pg18")
                && phase_and_ready(&ns, "roll") == "Ready/3"
        },
        diagnostics,
    );
    let took = since.elapsed();
    for (pod, version) in server_versions(&ns, "roll").await {
        assert_eq!(version, "18.4", "{pod}");
    }
    let replaced = events_with(&ns, "MinorUpdate", "roll-1");
    for pod in ["roll-1", "roll-2", "roll-3"] {
        assert!(
            replaced.contains(pod),
            "{pod} replaced: {replaced}\n{}",
            diagnostics()
        );
    }
    assert!(
        events_with(&ns, "Switchover", "minor update").contains("minor update"),
        "the primary was switched over, not restarted\n{}",
        diagnostics()
    );
    writer
        .wait_for_write_after(Instant::now(), Duration::from_secs(30))
        .await;
    let outages = writer.outages_after(since);
    let pauses: Vec<Duration> = outages
        .iter()
        .map(|o| o.write_again - o.first_failure)
        .collect();
    println!("minor update 18.3 -> 18.4 of 3 instances took {took:?}; writers paused {pauses:?}");
    assert!(
        outages.len() <= 1 && pauses.iter().all(|p| *p < Duration::from_secs(15)),
        "at most one short interruption for writers: {pauses:?}\n{}",
        diagnostics()
    );
    // Every acknowledged row is there.
    let acknowledged = writer.acknowledged();
    drop(writer);
    let primary = jsonpath("svc", "roll-rw", &ns, "{.spec.clusterIP}");
    let mut connection = connect_app(&ns, "roll", &primary).await;
    let ids: Vec<i64> = sqlx::query_scalar("select id from ledger")
        .fetch_all(&mut connection)
        .await
        .expect("the ledger");
    let stored: std::collections::BTreeSet<i64> = ids.into_iter().collect();
    let lost: Vec<&i64> = acknowledged.difference(&stored).collect();
    assert!(lost.is_empty(), "acknowledged rows lost: {lost:?}");
    drop(operator);
    drop(volumes);
}
