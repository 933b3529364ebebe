//! Restores from the local S3 server, end to end, through `kubectl`: a cluster made
//! with `bootstrap.recovery` from a `Backup` holds exactly the rows committed before
//! its `targetTime`, or every archived row without one, and archives under its own
//! path; a target after the end of the archive is refused with the covered range; and
//! once the source cluster and its Backups are deleted, a cluster is restored straight
//! from the object-store location.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use sqlx::PgConnection;
use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_manifest, condition, condition_message,
    describe, events_with, jsonpath, phase_and_ready, try_superuser, wait_for,
};
use support::{TestNamespace, client, kubectl_ok, s3};

const OPERATOR: &str = "127.0.67.1:8080";

async fn superuser(namespace: &str, cluster: &str) -> PgConnection {
    let primary = jsonpath("dbc", cluster, namespace, "{.status.currentPrimary}");
    try_superuser(namespace, cluster, &primary)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn insert(connection: &mut PgConnection, batch: &str, rows: i32) {
    sqlx::query("insert into orders (batch) select $1 from generate_series(1, $2)")
        .bind(batch)
        .bind(rows)
        .execute(&mut *connection)
        .await
        .expect("writing orders");
}

/// Rows per batch, as `a=100 b=50`.
async fn batches(connection: &mut PgConnection) -> String {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("select batch, count(*) from orders group by batch order by batch")
            .fetch_all(&mut *connection)
            .await
            .expect("counting orders");
    rows.iter()
        .map(|(batch, n)| format!("{batch}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A one-instance cluster restored as `recovery` says (flow-style YAML), archiving to
/// its own path.
fn apply_restored(namespace: &str, name: &str, class: &str, recovery: &str) {
    apply_manifest(
        namespace,
        name,
        &format!(
            "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: {name}}}\nspec:\n  \
             engine: postgresql\n  version: \"15\"\n  replicas: 1\n  \
             storage: {{size: 1Gi, storageClassName: {class}}}\n  \
             bootstrap: {{recovery: {recovery}}}\n  backup: {}\n{SUPERUSER_ACCESS}",
            s3::backup_target(None, "")
        ),
    );
}

#[tokio::test]
async fn clusters_are_restored_to_a_point_in_time_and_from_a_bare_location() {
    let _client = client().await;
    let namespace = TestNamespace::create(&_client, "restore").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 3);
    let operator = Operator::start(&ns, OPERATOR);
    let logs: Vec<PathBuf> = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);

    s3::archiving_cluster(&ns, "shop", 1, &volumes.class, "", diagnostics);
    let mut source = superuser(&ns, "shop").await;
    sqlx::query("create table orders (id bigserial primary key, batch text, at timestamptz default clock_timestamp())")
        .execute(&mut source)
        .await
        .expect("creating orders");
    insert(&mut source, "a", 100).await;

    apply_manifest(
        &ns,
        "base",
        "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata: {name: base}\nspec: {cluster: shop}\n",
    );
    wait_for(
        "the base backup Completed",
        Duration::from_secs(120),
        || jsonpath("backup", "base", &ns, "{.status.phase}") == "Completed",
        diagnostics,
    );

    // Batch b before the target, c after it; all of it archived.
    insert(&mut source, "b", 50).await;
    let target: String = sqlx::query_scalar(
        "select to_char(clock_timestamp() at time zone 'utc', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
    )
    .fetch_one(&mut source)
    .await
    .expect("the target time");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    insert(&mut source, "c", 25).await;
    let last: String = sqlx::query_scalar("select pg_walfile_name(pg_current_wal_lsn())")
        .fetch_one(&mut source)
        .await
        .expect("the current WAL file");
    sqlx::query("select pg_switch_wal()")
        .execute(&mut source)
        .await
        .expect("switching WAL");
    let system_id: i64 = sqlx::query_scalar("select system_identifier from pg_control_system()")
        .fetch_one(&mut source)
        .await
        .expect("the system identifier");
    let folder = format!("{ns}/shop/{system_id}/wals/{}", &last[..16]);
    let key = format!("{folder}/{last}.zst");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !s3::keys(&folder).await.contains(&key) {
        assert!(
            std::time::Instant::now() < deadline,
            "{key} archived\n{}",
            diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // To the target time: exactly a and b.
    apply_restored(
        &ns,
        "pitr",
        &volumes.class,
        &format!("{{backup: base, targetTime: \"{target}\"}}"),
    );
    // To the end of the archive: a, b and c.
    apply_restored(&ns, "latest", &volumes.class, "{backup: base}");
    // After the end of the archive: refused, with the range.
    apply_restored(
        &ns,
        "future",
        &volumes.class,
        "{backup: base, targetTime: \"2099-01-01T00:00:00Z\"}",
    );
    for name in ["pitr", "latest"] {
        wait_for(
            &format!("{name} restored and Ready"),
            Duration::from_secs(240),
            || {
                phase_and_ready(&ns, name) == "Ready/1"
                    && condition(&ns, name, "Restored") == "True/Restored"
            },
            diagnostics,
        );
    }
    let mut pitr = superuser(&ns, "pitr").await;
    assert_eq!(
        batches(&mut pitr).await,
        "a=100 b=50",
        "restored to {target}"
    );
    let mut latest = superuser(&ns, "latest").await;
    assert_eq!(batches(&mut latest).await, "a=100 b=50 c=25");
    // The restored cluster takes writes and archives under its own path, on a new
    // timeline, never into its source's.
    insert(&mut pitr, "d", 1).await;
    let history = format!("{ns}/pitr/{system_id}/wals");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !s3::keys(&history)
        .await
        .iter()
        .any(|k| k.ends_with(".history.zst"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "a history file under {history}: {:?}\n{}",
            s3::keys(&history).await,
            diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        !s3::keys(&format!("{ns}/shop/{system_id}/wals"))
            .await
            .iter()
            .any(|k| k.ends_with(".history.zst")),
        "nothing of the restored clusters' timelines in the source's archive"
    );

    wait_for(
        "the out-of-range restore refused with the range",
        Duration::from_secs(60),
        || {
            condition(&ns, "future", "Restored") == "False/RestoreWaiting"
                && condition_message(&ns, "future", "Restored")
                    .contains("outside what the archive covers: from ")
        },
        diagnostics,
    );
    assert!(
        events_with(&ns, "RestoreRefused", "2099-01-01T00:00:00Z").contains("2099-01-01T00:00:00Z")
    );
    kubectl_ok(&["delete", "dbc", "future", "-n", &ns, "--wait=false"]);

    // Verification: a Backup with verify: true is restored into a scratch instance that
    // no Service of the cluster ever selects, checked, and the verdict recorded.
    apply_manifest(
        &ns,
        "checked",
        "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata: {name: checked}\nspec: {cluster: shop, verify: true}\n",
    );
    let verified = |backup: &str| {
        jsonpath(
            "backup",
            backup,
            &ns,
            "{.status.conditions[?(@.type==\"RestoreVerified\")].status}",
        )
    };
    let mut scratch_seen = false;
    wait_for(
        "the checked backup verified",
        Duration::from_secs(300),
        || {
            let ips = kubectl_ok(&[
                "get",
                "pods",
                "-n",
                &ns,
                "-l",
                "castellan.io/verifies=shop",
                "-o",
                "jsonpath={.items[*].status.podIP}",
            ]);
            for ip in ips.split_whitespace() {
                scratch_seen = true;
                for service in ["shop-rw", "shop-ro", "shop-r"] {
                    let endpoints = kubectl_ok(&[
                        "get",
                        "endpointslices",
                        "-n",
                        &ns,
                        "-l",
                        &format!("kubernetes.io/service-name={service}"),
                        "-o",
                        "jsonpath={.items[*].endpoints[*].addresses[*]}",
                    ]);
                    assert!(
                        !endpoints.split_whitespace().any(|a| a == ip),
                        "{service} never selects the scratch instance"
                    );
                }
            }
            let status = verified("checked");
            assert_ne!(status, "False", "{}", diagnostics());
            status == "True"
        },
        diagnostics,
    );
    assert!(scratch_seen, "the scratch instance ran");
    assert_eq!(condition(&ns, "shop", "RestoreVerified"), "True/Verified");
    assert!(
        events_with(&ns, "RestoreVerified", "catalog indexes intact")
            .contains("catalog indexes intact")
    );
    assert!(!jsonpath("backup", "checked", &ns, "{.status.verifiedAt}").is_empty());
    wait_for(
        "the scratch instance removed",
        Duration::from_secs(60),
        || {
            kubectl_ok(&[
                "get",
                "pods",
                "-n",
                &ns,
                "-l",
                "castellan.io/verifies=shop",
                "-o",
                "name",
            ])
            .is_empty()
        },
        diagnostics,
    );

    // A damaged backup fails its verification, with a Warning.
    let base = format!(
        "{ns}/shop/{system_id}/base/{}/data.tar.zst",
        jsonpath("backup", "base", &ns, "{.status.backupId}")
    );
    s3::put(&base, b"not a backup".to_vec()).await;
    kubectl_ok(&[
        "annotate",
        "backup",
        "base",
        "-n",
        &ns,
        "castellan.io/verify=now",
    ]);
    wait_for(
        "the damaged backup failing its verification",
        Duration::from_secs(300),
        || verified("base") == "False",
        diagnostics,
    );
    assert!(!events_with(&ns, "RestoreVerificationFailed", "").is_empty());
    assert_eq!(
        condition(&ns, "shop", "RestoreVerified"),
        "False/VerificationFailed"
    );

    // The source and its Backups gone: restore straight from the location.
    kubectl_ok(&["delete", "dbc", "shop", "-n", &ns]);
    kubectl_ok(&["delete", "backup", "--all", "-n", &ns]);
    apply_restored(
        &ns,
        "rebuilt",
        &volumes.class,
        &format!(
            "{{source: {}}}",
            s3::backup_target(Some(&format!("{ns}/shop")), "")
        ),
    );
    wait_for(
        "rebuilt restored from the location and Ready",
        Duration::from_secs(240),
        || {
            phase_and_ready(&ns, "rebuilt") == "Ready/1"
                && condition(&ns, "rebuilt", "Restored") == "True/Restored"
        },
        diagnostics,
    );
    let mut rebuilt = superuser(&ns, "rebuilt").await;
    assert_eq!(batches(&mut rebuilt).await, "a=100 b=50 c=25");
    drop(operator);
}
