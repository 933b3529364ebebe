//! Major upgrades end to end on the dev nodes, through kubectl-level actions: a
//! 3-instance cluster of 15 with pgbench's tables raised to 18 on btrfs volumes
//! (`pg_upgrade --clone`) while the leading operator is killed, every row there and
//! every instance on 18 and streaming; then rolled back inside the window to the kept
//! 15 data, losing the writes made on 18. And an upgrade whose pre-flight fails (an
//! extension 18 no longer has) that leaves the cluster on 15 with its data and says
//! why, then goes through with `--copy` once the user fixed it, its old data removed at
//! once (`keepPreviousFor: 0s`) and no way back.

mod support;

use std::time::Duration;

use sqlx::PgConnection;
use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster, condition, connect_app, describe,
    events, events_with, instance_addresses, jsonpath, phase_and_ready, secret_value,
    server_versions, try_superuser, wait_for, wait_for_catalog,
};
use support::faults::{reported_roles, volume_path};
use support::postgres::connect;
use support::{TestNamespace, client, kubectl, kubectl_ok};

const UPGRADE_OPERATORS: [&str; 2] = ["127.0.76.1:8080", "127.0.76.2:8080"];
const PREFLIGHT_OPERATOR: &str = "127.0.76.3:8080";

/// A field of the cluster's `status.upgrade`.
fn upgrade_field(namespace: &str, cluster: &str, field: &str) -> String {
    jsonpath(
        "dbc",
        cluster,
        namespace,
        &format!("{{.status.upgrade.{field}}}"),
    )
}

fn set_version(namespace: &str, cluster: &str, version: &str) {
    kubectl_ok(&[
        "patch",
        "dbc",
        cluster,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        &format!(r#"{{"spec":{{"version":"{version}"}}}}"#),
    ]);
}

/// The primary's pod address, from the roles the cluster reports.
fn primary_address(namespace: &str, cluster: &str) -> String {
    let primary = reported_roles(namespace, cluster)
        .into_iter()
        .find(|(_, role)| role == "primary")
        .map(|(name, _)| name)
        .unwrap_or_default();
    instance_addresses(namespace, cluster)
        .into_iter()
        .find(|(pod, _)| *pod == primary)
        .map(|(_, ip)| ip)
        .unwrap_or_default()
}

async fn count(connection: &mut PgConnection, table: &str) -> i64 {
    // Table names of this test only.
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("select count(*) from {table}")))
        .fetch_one(connection)
        .await
        .unwrap_or_else(|e| panic!("counting {table}: {e}"))
}

/// Every instance of `cluster` has `rows` in `table` (replicas after replaying).
async fn every_instance_counts(namespace: &str, cluster: &str, table: &str, rows: i64) {
    for (pod, ip) in instance_addresses(namespace, cluster) {
        let mut connection = connect_app(namespace, cluster, &ip).await;
        let mut found = -1;
        for _ in 0..40 {
            found = count(&mut connection, table).await;
            if found == rows {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert_eq!(found, rows, "{table} on {pod}");
    }
}

/// pgbench's tables at scale 1 (100 000 accounts), made through the primary as the
/// application's owner, with Debian's pgbench.
fn pgbench_init(namespace: &str, cluster: &str) {
    let host = primary_address(namespace, cluster);
    let password = secret_value(namespace, &format!("{cluster}-app"), "password");
    support::postgres::pgbench_init(&host, &password, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn fifteen_to_eighteen_through_an_operator_kill_then_rolled_back() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "upgrade").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create_on_btrfs("upgrade-btrfs", 1);
    let first = Operator::start(&ns, UPGRADE_OPERATORS[0]);
    let logs = vec![
        first.log.clone(),
        std::env::temp_dir().join(format!(
            "operator-{}-{}.log",
            std::process::id(),
            UPGRADE_OPERATORS[1]
        )),
    ];
    let diagnostics = || describe(&ns, &logs);
    wait_for_catalog(&ns, diagnostics);
    apply_cluster(&ns, "up", 3, &volumes.class, SUPERUSER_ACCESS);
    wait_for(
        "the cluster of 15 is Ready with 3 instances",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "up") == "Ready/3",
        diagnostics,
    );
    pgbench_init(&ns, "up");
    let mut primary = connect_app(&ns, "up", &primary_address(&ns, "up")).await;
    sqlx::query("create table notes (id serial primary key, said text not null)")
        .execute(&mut primary)
        .await
        .expect("creating notes");
    sqlx::query("insert into notes (said) select 'before ' || n from generate_series(1, 10) n")
        .execute(&mut primary)
        .await
        .expect("writing notes");
    let accounts = count(&mut primary, "pgbench_accounts").await;
    assert_eq!(accounts, 100_000);
    drop(primary);

    // The upgrade, with the leading operator killed once it is under way.
    set_version(&ns, "up", "18");
    wait_for(
        "the upgrade starts",
        Duration::from_secs(60),
        || {
            matches!(
                upgrade_field(&ns, "up", "phase").as_str(),
                "Stopping" | "Upgrading" | "Starting"
            )
        },
        diagnostics,
    );
    let killed_in = upgrade_field(&ns, "up", "phase");
    drop(first);
    let second = Operator::start(&ns, UPGRADE_OPERATORS[1]);
    wait_for(
        "the new leader finishes the upgrade: 3 instances of 18 ready",
        Duration::from_secs(360),
        || {
            upgrade_field(&ns, "up", "phase") == "Succeeded"
                && phase_and_ready(&ns, "up") == "Ready/3"
        },
        diagnostics,
    );
    println!("the operator was killed in step {killed_in}");
    assert_eq!(jsonpath("dbc", "up", &ns, "{.status.version}"), "18");
    assert_eq!(
        upgrade_field(&ns, "up", "method"),
        "clone",
        "btrfs: reflinks"
    );
    assert_eq!(upgrade_field(&ns, "up", "previous"), "Kept");
    assert_eq!(condition(&ns, "up", "MajorUpgrade"), "True/Succeeded");
    for reason in ["UpgradeStarted", "UpgradeStarting", "UpgradeSucceeded"] {
        assert!(!events(&ns, reason).is_empty(), "an Event {reason}");
    }
    let versions = server_versions(&ns, "up").await;
    assert_eq!(versions.len(), 3, "{versions:?}");
    for (pod, version) in &versions {
        assert!(version.starts_with("18."), "{pod} runs {version}");
    }
    for (pod, _) in instance_addresses(&ns, "up") {
        assert_eq!(
            jsonpath("pod", &pod, &ns, "{.spec.containers[0].image}"),
            "ghcr.io/castellan-io/castellan:0.1.0-pg18"
        );
    }
    every_instance_counts(&ns, "up", "pgbench_accounts", accounts).await;
    every_instance_counts(&ns, "up", "notes", 10).await;
    let mut primary = connect_app(&ns, "up", &primary_address(&ns, "up")).await;
    // The application's role sees the senders, not their state.
    let streaming: i64 = sqlx::query_scalar("select count(*) from pg_stat_replication")
        .fetch_one(&mut primary)
        .await
        .unwrap_or(-1);
    assert_eq!(
        streaming, 2,
        "both replicas stream from the upgraded primary"
    );
    let checksums: String = sqlx::query_scalar("show data_checksums")
        .fetch_one(&mut primary)
        .await
        .expect("data_checksums");
    assert_eq!(checksums, "on", "the 15 cluster's setting, carried over");
    // Castellan's own schema (in the postgres database) came along and is in use: its
    // migrations are recorded, their grants kept, the heartbeat moves.
    let password = secret_value(&ns, "up-superuser", "password");
    let mut own = connect(
        &primary_address(&ns, "up"),
        "postgres",
        &password,
        "postgres",
    )
    .await;
    let heartbeat_age: f64 = sqlx::query_scalar(
        "select extract(epoch from now() - written_at)::float8 from castellan.heartbeat",
    )
    .fetch_one(&mut own)
    .await
    .expect("Castellan's heartbeat on 18");
    assert!(heartbeat_age < 10.0, "heartbeat {heartbeat_age}s old");
    let migrations: i64 = sqlx::query_scalar("select count(*) from _sqlx_migrations where success")
        .fetch_one(&mut own)
        .await
        .expect("the migrations' record");
    let files = std::fs::read_dir(support::repo().join("migrations"))
        .expect("migrations/")
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    assert_eq!(migrations, files as i64, "every migration, recorded once");
    let rewind_grant: bool = sqlx::query_scalar(
        "select has_function_privilege('streaming_replica', \
         'pg_catalog.pg_read_binary_file(text)', 'execute')",
    )
    .fetch_one(&mut own)
    .await
    .expect("a migration's grant");
    assert!(
        rewind_grant,
        "migrations/0002_rewind.sql's grants survive pg_upgrade"
    );
    drop(own);

    // Writes on 18, which a rollback loses.
    sqlx::query("insert into notes (said) select 'after ' || n from generate_series(1, 5) n")
        .execute(&mut primary)
        .await
        .expect("writing on 18");
    drop(primary);

    // The rollback: back to the kept 15 data, inside the window.
    set_version(&ns, "up", "15");
    wait_for(
        "the rollback brings back 3 instances of 15",
        Duration::from_secs(360),
        || {
            upgrade_field(&ns, "up", "phase") == "RolledBack"
                && phase_and_ready(&ns, "up") == "Ready/3"
        },
        diagnostics,
    );
    assert_eq!(jsonpath("dbc", "up", &ns, "{.status.version}"), "15");
    assert!(!events(&ns, "RolledBack").is_empty());
    for (pod, version) in server_versions(&ns, "up").await {
        assert!(version.starts_with("15."), "{pod} runs {version}");
    }
    every_instance_counts(&ns, "up", "pgbench_accounts", accounts).await;
    every_instance_counts(&ns, "up", "notes", 10).await;
    drop(second);
    drop(volumes);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_pre_flight_keeps_fifteen_and_its_data_then_the_fixed_cluster_upgrades() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "preflight").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create("preflight-local", 1);
    let operator = Operator::start(&ns, PREFLIGHT_OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    wait_for_catalog(&ns, diagnostics);
    // No rollback window: the old data goes as soon as the upgrade succeeded.
    apply_cluster(
        &ns,
        "old",
        1,
        &volumes.class,
        &format!("{SUPERUSER_ACCESS}  upgrade: {{keepPreviousFor: 0s}}\n"),
    );
    wait_for(
        "the cluster of 15 is Ready",
        Duration::from_secs(180),
        || phase_and_ready(&ns, "old") == "Ready/1",
        diagnostics,
    );
    let mut superuser = try_superuser(&ns, "old", "old-1")
        .await
        .expect("the superuser");
    // adminpack went away in PostgreSQL 17: pg_upgrade --check refuses a cluster that
    // uses it.
    sqlx::query("create extension adminpack")
        .execute(&mut superuser)
        .await
        .expect("adminpack on 15");
    sqlx::query("create table kept as select n from generate_series(1, 1000) n")
        .execute(&mut superuser)
        .await
        .expect("writing rows");
    drop(superuser);

    set_version(&ns, "old", "18");
    wait_for(
        "the upgrade fails and the cluster is back on 15",
        Duration::from_secs(240),
        || {
            upgrade_field(&ns, "old", "phase") == "Failed"
                && phase_and_ready(&ns, "old") == "Ready/1"
        },
        diagnostics,
    );
    assert_eq!(condition(&ns, "old", "MajorUpgrade"), "False/UpgradeFailed");
    let why = upgrade_field(&ns, "old", "message");
    assert!(
        why.contains("adminpack"),
        "the message names the cause: {why}"
    );
    assert!(
        !events_with(&ns, "UpgradeFailed", "adminpack").is_empty(),
        "a Warning says why"
    );
    assert_eq!(jsonpath("dbc", "old", &ns, "{.status.version}"), "15");
    let mut superuser = try_superuser(&ns, "old", "old-1")
        .await
        .expect("the superuser after the failed upgrade");
    let version: String = sqlx::query_scalar("show server_version")
        .fetch_one(&mut superuser)
        .await
        .expect("server_version");
    assert!(version.starts_with("15."), "{version}");
    assert_eq!(count(&mut superuser, "kept").await, 1000);
    // Not tried again on its own.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(upgrade_field(&ns, "old", "phase"), "Failed");

    // The user's fix: drop the extension, call the upgrade off and ask again.
    sqlx::query("drop extension adminpack")
        .execute(&mut superuser)
        .await
        .expect("dropping adminpack");
    drop(superuser);
    set_version(&ns, "old", "15");
    set_version(&ns, "old", "18");
    wait_for(
        "the fixed cluster upgrades",
        Duration::from_secs(240),
        || {
            upgrade_field(&ns, "old", "phase") == "Succeeded"
                && phase_and_ready(&ns, "old") == "Ready/1"
        },
        diagnostics,
    );
    assert_eq!(
        upgrade_field(&ns, "old", "method"),
        "copy",
        "not btrfs: a copy"
    );
    let mut superuser = try_superuser(&ns, "old", "old-1")
        .await
        .expect("the superuser on 18");
    let version: String = sqlx::query_scalar("show server_version")
        .fetch_one(&mut superuser)
        .await
        .expect("server_version");
    assert!(version.starts_with("18."), "{version}");
    assert_eq!(count(&mut superuser, "kept").await, 1000);
    drop(superuser);

    // keepPreviousFor 0s: the old data is removed at once, and there is no way back.
    wait_for(
        "the old data is removed",
        Duration::from_secs(60),
        || upgrade_field(&ns, "old", "previous") == "Removed",
        diagnostics,
    );
    assert!(!events(&ns, "PreviousDataRemoved").is_empty());
    let volume = volume_path(&ns, "old-1");
    assert!(volume.join("pgdata").join("PG_VERSION").exists());
    assert!(
        !volume.join("pgdata-previous").exists(),
        "the space is reclaimed: {}",
        volume.display()
    );
    let refused = kubectl(&[
        "patch",
        "dbc",
        "old",
        "-n",
        &ns,
        "--type=merge",
        "-p",
        r#"{"spec":{"version":"15"}}"#,
    ]);
    assert!(
        !refused.status.success(),
        "no rollback without the old data"
    );
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("version cannot be lowered from 18 to 15"),
        "{said}"
    );
    drop(operator);
    drop(volumes);
}
