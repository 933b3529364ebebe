//! The DatabaseCluster controller end to end on the local cluster's process-backed
//! nodes: `kubectl apply` a two-instance PostgreSQL cluster and it becomes Ready, with
//! its credentials Secret, its Services following the roles, and a row written through
//! `-rw` readable through `-ro`; passwords rotated in the Secrets apply (the app
//! Secret's `uri` follows) and never reach a log; PostgreSQL's log lines come as JSON
//! records like the manager's; the leader's successor keeps the CA and reaches the
//! instances with it; deleting it removes what it owned.

mod support;

use support::postgres::{connect, try_connect};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster, describe, http_get, jsonpath,
    secret_value, try_superuser, wait_for,
};
use support::{TestNamespace, client, eventually, kubectl, kubectl_ok, process};

/// Where the test's two operators serve /healthz, /readyz and /metrics (also their
/// identities in the leader Lease).
const METRICS_ADDRESSES: [&str; 2] = ["127.0.60.1:8080", "127.0.60.2:8080"];
/// The environment variable that overrides jemalloc's built-in options (src/heap.rs).
const ALLOCATOR_OPTIONS: &str = "_RJEM_MALLOC_CONF";

#[tokio::test(flavor = "multi_thread")]
async fn a_two_instance_cluster_becomes_ready_and_replicates() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "dbc").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("dbc-local", 1);
    // Two replicas of the operator: only the one holding the Lease acts.
    let mut operators = vec![
        Operator::start(&ns, METRICS_ADDRESSES[0]),
        // A user's own allocator options (docs/operations.md), which reach the
        // operator's binary.
        Operator::start_with_env(
            &ns,
            METRICS_ADDRESSES[1],
            &[],
            &[(ALLOCATOR_OPTIONS, "narenas:2")],
        ),
    ];
    let logs: Vec<PathBuf> = operators.iter().map(|o| o.log.clone()).collect();
    let operator_log = || Operator::logs(&logs);
    // Both were started as `castellan operator` and run the operator's own binary,
    // castellan-operator beside it (a process maps only its role's code), keeping their
    // pid, arguments and environment.
    for operator in &operators {
        wait_for(
            "the operator serves /healthz",
            Duration::from_secs(30),
            || http_get(operator.address, "/healthz").0 == 200,
            || Operator::logs(&logs),
        );
        let pid = operator.pid();
        let exe = process::executable(pid);
        assert_eq!(
            exe, "castellan-operator",
            "operator {} runs {exe}",
            operator.address
        );
        assert!(
            process::has_arg(pid, operator.address),
            "operator {} lost its arguments",
            operator.address
        );
    }
    let options = format!("{ALLOCATOR_OPTIONS}=narenas:2");
    assert!(
        process::has_env(operators[1].pid(), &options),
        "the second operator runs without {options}"
    );
    let started = Instant::now();
    // Every statement logged: the passwords Castellan sets must not be among them.
    apply_cluster(
        &ns,
        "shop",
        2,
        &volumes.class,
        &format!("  parameters: {{log_statement: all}}\n{SUPERUSER_ACCESS}"),
    );

    let diagnostics = || describe(&ns, &logs);
    wait_for(
        "the cluster is Ready with 2 ready instances",
        Duration::from_secs(180),
        || {
            jsonpath(
                "dbc",
                "shop",
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
        },
        diagnostics,
    );
    println!(
        "kubectl apply to Ready (2 instances): {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The leader reaches the API server over one HTTP/2 connection, however many
    // watches and requests it has open (src/api_client.rs); kube's own client holds a
    // connection per watch and keeps every connection of a burst.
    let leader = operators
        .iter()
        .find(|o| o.is_leader())
        .expect("one operator leads");
    let port = support::config()
        .await
        .cluster_url
        .port_u16()
        .expect("the API server's URL names its port");
    assert_eq!(
        tcp_connections_to(leader.pid(), port),
        1,
        "the leading operator's TCP connections to the API server (port {port})"
    );
    assert_eq!(
        jsonpath("dbc", "shop", &ns, "{.status.currentPrimary}"),
        "shop-1"
    );
    assert_eq!(
        jsonpath(
            "dbc",
            "shop",
            &ns,
            "{.status.conditions[?(@.type==\"Ready\")].status}"
        ),
        "True"
    );
    let nodes = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        &ns,
        "-o",
        "jsonpath={.items[*].spec.nodeName}",
    ]);
    let nodes: Vec<&str> = nodes.split_whitespace().collect();
    assert_eq!(nodes.len(), 2);
    assert_ne!(nodes[0], nodes[1], "instances spread across nodes");

    // Passwords reach PostgreSQL only as SCRAM verifiers, set with statement logging
    // off: neither appears in a log that logs every statement.
    let primary_log = kubectl_ok(&["logs", "shop-1", "-n", &ns]);
    assert!(
        primary_log.contains("statement: "),
        "log_statement: all is in force, so the scan below means something"
    );
    for pod in ["shop-1", "shop-2"] {
        let log = kubectl_ok(&["logs", pod, "-n", &ns]);
        for (secret, key) in [
            ("shop-superuser", "password"),
            ("shop-replication", "password"),
            ("shop-app", "password"),
        ] {
            let password = secret_value(&ns, secret, key);
            assert!(!password.is_empty());
            assert!(
                !log.contains(&password),
                "{secret}'s password in {pod}'s log"
            );
        }
        assert!(!log.contains("SCRAM-SHA-256$"), "a verifier in {pod}'s log");
    }

    // The application's credentials, ready to use.
    let secret = |key: &str| secret_value(&ns, "shop-app", key);
    let password = secret("password");
    assert!(
        secret("uri").starts_with("postgresql://clerk:"),
        "the app secret carries a URI"
    );

    // Through the Services' cluster addresses, as an application would connect.
    let rw = jsonpath("svc", "shop-rw", &ns, "{.spec.clusterIP}");
    let ro = jsonpath("svc", "shop-ro", &ns, "{.spec.clusterIP}");
    let mut primary = connect(&rw, "clerk", &password, "shop").await;
    sqlx::query("create table orders (id int primary key)")
        .execute(&mut primary)
        .await
        .expect("create");
    sqlx::query("insert into orders values (1)")
        .execute(&mut primary)
        .await
        .expect("insert");
    let in_recovery: bool = sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(&mut primary)
        .await
        .expect("query");
    assert!(!in_recovery, "-rw reaches the primary");
    let mut replica = connect(&ro, "clerk", &password, "shop").await;
    let in_recovery: bool = sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(&mut replica)
        .await
        .expect("query");
    assert!(in_recovery, "-ro reaches a replica");
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>("select count(*) from orders")
        .fetch_one(&mut replica)
        .await
        .unwrap_or(0)
        != 1
    {
        assert!(
            Instant::now() < deadline,
            "the row replicates to the replica"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // PostgreSQL's own log comes through the instance manager as JSON lines like the
    // manager's, each with the cluster and instance: a failing statement is an ERROR
    // record with its SQLSTATE, user, database and statement.
    sqlx::query("select * from no_such_table")
        .execute(&mut primary)
        .await
        .expect_err("the table does not exist");
    let records = || -> Vec<serde_json::Value> {
        kubectl_ok(&["logs", "shop-1", "-n", &ns])
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("a line of shop-1's log is no JSON ({e}): {line}"))
            })
            .collect()
    };
    wait_for(
        "the failed statement in the primary's log as a JSON record",
        Duration::from_secs(10),
        || {
            records().iter().any(|line| {
                line["target"] == "postgres"
                    && line["level"] == "ERROR"
                    && line["severity"] == "ERROR"
                    && line["sql_state"] == "42P01"
                    && line["db_user"] == "clerk"
                    && line["database"] == "shop"
                    && line["cluster"] == "shop"
                    && line["instance"] == "shop-1"
                    && line["statement"]
                        .as_str()
                        .is_some_and(|s| s.contains("no_such_table"))
            })
        },
        diagnostics,
    );
    assert!(
        records().iter().any(|line| line["target"] == "postgres"
            && line["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("statement: "))),
        "log_statement's lines come as records of target postgres"
    );
    drop((primary, replica));

    // Rotated passwords: written into the Secrets, the primary sets them (as verifiers,
    // logging off), the app Secret's uri follows, and the old password stops working.
    let rotated = "n3w:p@ss/word";
    for secret in ["shop-app", "shop-superuser", "shop-replication"] {
        kubectl_ok(&[
            "patch",
            "secret",
            secret,
            "-n",
            &ns,
            "--type=merge",
            "-p",
            &format!("{{\"stringData\":{{\"password\":\"{rotated}\"}}}}"),
        ]);
    }
    let (rw_address, namespace_name) = (rw.as_str(), ns.as_str());
    eventually(
        "the rotated passwords work within 60 s",
        Duration::from_secs(60),
        || async move {
            try_connect(rw_address, "clerk", rotated, "shop")
                .await
                .map_err(|e| format!("app: {e}"))?;
            try_superuser(namespace_name, "shop", "shop-1")
                .await
                .map(drop)
                .map_err(|e| format!("superuser: {e}"))
        },
    )
    .await;
    assert!(
        try_connect(&rw, "clerk", &password, "shop").await.is_err(),
        "the old password no longer works"
    );
    wait_for(
        "the app Secret's uri to follow its password",
        Duration::from_secs(30),
        || secret("uri").contains(":n3w%3Ap%40ss%2Fword@"),
        operator_log,
    );
    let log = kubectl_ok(&["logs", "shop-1", "-n", &ns]);
    assert!(
        !log.contains(rotated) && !log.contains("SCRAM-SHA-256$"),
        "no rotated password nor verifier in the primary's log"
    );
    // Cut off after the rotation, the replica reconnects and streams what it missed:
    // with its client certificate (over TLS the replication role has no password
    // login; its password file still follows the Secret, for a build without TLS).
    let mut superuser = try_superuser(&ns, "shop", "shop-1")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("select pg_terminate_backend(pid) from pg_stat_replication")
        .execute(&mut superuser)
        .await
        .expect("cutting the replica off");
    sqlx::query("insert into orders values (2)")
        .execute(&mut superuser)
        .await
        .expect("insert");
    eventually(
        "the replica streams again after the rotation within 60 s",
        Duration::from_secs(60),
        || async move {
            let mut replica = try_superuser(namespace_name, "shop", "shop-2").await?;
            let seen = sqlx::query_scalar::<_, i64>(
                "select count(*) from orders where (select status = 'streaming' \
                 from pg_stat_wal_receiver)",
            )
            .fetch_one(&mut replica)
            .await
            .map_err(|e| e.to_string())?;
            if seen == 2 {
                Ok(())
            } else {
                Err(format!("{seen} of 2 rows while streaming"))
            }
        },
    )
    .await;

    // The operators' own endpoints; exactly one of them leads.
    let leaders: Vec<usize> = (0..2).filter(|i| operators[*i].is_leader()).collect();
    assert_eq!(
        leaders.len(),
        1,
        "exactly one operator leads:\n{}",
        operator_log()
    );
    let leader = leaders[0];
    for operator in &operators {
        assert_eq!(http_get(operator.address, "/healthz").0, 200);
        assert_eq!(
            http_get(operator.address, "/readyz").0,
            200,
            "the operator reaches the API server"
        );
    }
    let (code, metrics) = http_get(operators[leader].address, "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("castellan_instances_created_total 2\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("castellan_reconciles_total{controller=\"cluster\"}"),
        "{metrics}"
    );
    let (_, standby_metrics) = http_get(operators[1 - leader].address, "/metrics");
    // Counters by controller appear with the first reconcile: none on the standby.
    assert!(
        standby_metrics.contains("castellan_leader 0\n")
            && !standby_metrics.contains("castellan_reconciles_total{"),
        "the operator without the lease does nothing: {standby_metrics}"
    );

    // The leader is lost: the other takes the lease over and acts. A deleted replica
    // pod is recreated on its volume and the cluster is Ready again.
    let survivor = operators.remove(1 - leader);
    drop(operators);
    wait_for(
        "the surviving operator takes the lease over",
        Duration::from_secs(40),
        || survivor.is_leader(),
        diagnostics,
    );
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
        "the replica pod is back and the cluster Ready",
        Duration::from_secs(120),
        || {
            jsonpath(
                "dbc",
                "shop",
                &ns,
                "{.status.phase}/{.status.readyInstances}",
            ) == "Ready/2"
                && !jsonpath("pod", "shop-2", &ns, "{.metadata.uid}").is_empty()
        },
        diagnostics,
    );
    assert!(
        http_get(survivor.address, "/metrics")
            .1
            .contains("castellan_instances_created_total 1\n"),
        "the new leader recreated the pod"
    );

    // Voluntary disruptions may not take the primary, nor more than one replica.
    assert_eq!(
        jsonpath("pdb", "shop-primary", &ns, "{.spec.minAvailable}"),
        "1"
    );
    assert_eq!(jsonpath("pdb", "shop", &ns, "{.spec.minAvailable}"), "0");

    // Status shows every instance with its role and position.
    wait_for(
        "status lists both instances with LSNs",
        Duration::from_secs(30),
        || {
            jsonpath("dbc", "shop", &ns, "{.status.instances[*].lsn}")
                .split_whitespace()
                .count()
                == 2
        },
        diagnostics,
    );
    assert_eq!(
        jsonpath("dbc", "shop", &ns, "{.status.instances[*].role}"),
        "primary replica"
    );

    // The instances' API certificate is the CA's that the first leader made: the
    // survivor read that CA rather than making its own, and reached the instances with
    // it (the LSNs above come from their /status, over mutual TLS).
    assert_eq!(
        jsonpath("secret", "shop-instance-tls", &ns, "{.type}"),
        "kubernetes.io/tls"
    );
    let ca = jsonpath("secret", "castellan-ca", &ns, "{.data.tls\\.crt}");
    assert!(
        !ca.is_empty(),
        "the CA Secret is in the operators' namespace"
    );
    assert_eq!(
        jsonpath("secret", "shop-instance-tls", &ns, "{.data.ca\\.crt}"),
        ca
    );

    // Deleting the cluster removes what it owned.
    kubectl_ok(&[
        "delete",
        "dbc",
        "shop",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ]);
    wait_for(
        "owned objects are gone",
        Duration::from_secs(120),
        || {
            let left = kubectl(&[
                "get",
                "pods,pvc,svc,secrets,pdb",
                "-n",
                &ns,
                "-l",
                "castellan.io/cluster=shop",
                "-o",
                "name",
            ]);
            String::from_utf8_lossy(&left.stdout).trim().is_empty()
        },
        diagnostics,
    );
    drop(survivor);
    drop(volumes);
}

/// How many established TCP connections process `pid` has to `port`: its sockets'
/// inodes looked up in the TCP tables of its network namespace.
fn tcp_connections_to(pid: u32, port: u16) -> usize {
    let inodes = support::socket_inodes(pid);
    let remote_port = format!(":{port:04X}");
    ["tcp", "tcp6"]
        .iter()
        .flat_map(|table| {
            std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(|line| {
                    line.split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        // local address, remote address, state (01: established), …, inode (10th).
        .filter(|fields| {
            fields.len() > 9
                && fields[2].ends_with(&remote_port)
                && fields[3] == "01"
                && inodes.contains(&fields[9])
        })
        .count()
}
