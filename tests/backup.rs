//! Base backups to the local S3 server, end to end, through `kubectl`: a `Backup` of a
//! 2-instance cluster under write load is taken from the replica, streamed to
//! `<namespace>/<cluster>/<system id>/base/<id>/` with its manifest, reports progress,
//! sizes and WAL/LSN bounds, and sets the cluster's `lastBackup`; a backup survives an
//! operator restart in the middle; a backup whose instance restarts in the middle is
//! `Failed`, never `Completed`; a Backup of a missing cluster waits and says why.
//! Archiving is switched on after the data is written, as a user adding backups to a
//! running cluster does: the first backup must still be complete and restorable (a
//! replica's last restartpoint predates archiving, so it begins at a fresh checkpoint).

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster, apply_manifest, condition_message,
    describe, events, events_with, http_get, instance_addresses, jsonpath, phase_and_ready,
    try_superuser, wait_for,
};
use support::{TestNamespace, client, kubectl_ok, s3};

const CLUSTER: &str = "shop";
const OPERATOR: &str = "127.0.66.1:8080";

fn backup_status(namespace: &str, name: &str, path: &str) -> String {
    jsonpath("backup", name, namespace, &format!("{{.status.{path}}}"))
}

fn apply_backup(namespace: &str, name: &str, cluster: &str) {
    apply_manifest(
        namespace,
        name,
        &format!(
            "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata: {{name: {name}}}\nspec: {{cluster: {cluster}}}\n"
        ),
    );
}

/// The 16 MiB segments from `first` to `last`, both included, on one timeline.
fn segments(first: &str, last: &str) -> Vec<String> {
    let number = |name: &str| {
        let log = u64::from_str_radix(&name[8..16], 16).expect("a WAL file name");
        let segment = u64::from_str_radix(&name[16..24], 16).expect("a WAL file name");
        log * 0x100 + segment
    };
    (number(first)..=number(last))
        .map(|n| format!("{}{:08X}{:08X}", &first[..8], n / 0x100, n % 0x100))
        .collect()
}

#[tokio::test]
async fn base_backups_stream_from_a_replica_and_survive_restarts_honestly() {
    let _client = client().await;
    let namespace = TestNamespace::create(&_client, "backup").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 1);
    let mut operator = Some(Operator::start(&ns, OPERATOR));
    let logs: Vec<PathBuf> = operator.iter().map(|o| o.log.clone()).collect();
    let diagnostics = || describe(&ns, &logs);

    // A Backup of a cluster that does not exist waits and says why.
    apply_backup(&ns, "early", "nosuch");
    wait_for(
        "a Backup of a missing cluster Pending with the reason",
        Duration::from_secs(30),
        || {
            backup_status(&ns, "early", "phase") == "Pending"
                && backup_status(&ns, "early", "error").contains("does not exist")
        },
        diagnostics,
    );

    apply_cluster(&ns, CLUSTER, 2, &volumes.class, SUPERUSER_ACCESS);
    wait_for(
        "the cluster Ready/2",
        Duration::from_secs(120),
        || phase_and_ready(&ns, CLUSTER) == "Ready/2",
        diagnostics,
    );
    let primary = jsonpath("dbc", CLUSTER, &ns, "{.status.currentPrimary}");
    let mut connection = try_superuser(&ns, CLUSTER, &primary)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Enough data that a backup takes a few seconds: about 150 MiB.
    sqlx::query(
        "create table filler as select g as id, repeat(md5(g::text), 16) as pad \
         from generate_series(1, 250000) g",
    )
    .execute(&mut connection)
    .await
    .expect("writing filler");
    sqlx::query("create table orders (id bigserial primary key, item text)")
        .execute(&mut connection)
        .await
        .expect("creating orders");
    let system_id: i64 = sqlx::query_scalar("select system_identifier from pg_control_system()")
        .fetch_one(&mut connection)
        .await
        .expect("the system identifier");
    // Archiving begins here: the replica's last restartpoint, at the checkpoint the
    // cluster was made with, is older than the ~10 segments of filler, never archived.
    s3::switch_archiving_on(&ns, CLUSTER, 2, "retention: {keepLast: 1}", diagnostics);
    // With nothing written since: the primary closed its segment when the object store
    // was put in force, so archiving is tried at once, not after the next 16 MiB of WAL
    // or archive_timeout.
    wait_for(
        "a segment archived without a write, once archiving is switched on",
        Duration::from_secs(60),
        || condition_message(&ns, CLUSTER, "ContinuousArchiving").contains("archives WAL: last "),
        diagnostics,
    );

    // Writes go on during the backups.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicI64::new(0));
    let writer = tokio::spawn({
        let (stop, written) = (stop.clone(), written.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                if sqlx::query("insert into orders (item) values ('widget')")
                    .execute(&mut connection)
                    .await
                    .is_ok()
                {
                    written.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    // A backup under write load comes from the replica, with everything in status.
    apply_backup(&ns, "first", CLUSTER);
    let mut progress_seen = Vec::new();
    wait_for(
        "the first backup Completed",
        Duration::from_secs(180),
        || {
            progress_seen.push(backup_status(&ns, "first", "progressPercent"));
            let phase = backup_status(&ns, "first", "phase");
            assert_ne!(phase, "Failed", "{}", backup_status(&ns, "first", "error"));
            phase == "Completed"
        },
        diagnostics,
    );
    let replica = if primary == format!("{CLUSTER}-1") {
        format!("{CLUSTER}-2")
    } else {
        format!("{CLUSTER}-1")
    };
    assert_eq!(
        backup_status(&ns, "first", "instance"),
        replica,
        "taken from the replica"
    );
    assert_eq!(backup_status(&ns, "first", "progressPercent"), "100");
    let size: i64 = backup_status(&ns, "first", "sizeBytes")
        .parse()
        .expect("sizeBytes");
    let data: i64 = backup_status(&ns, "first", "dataBytes")
        .parse()
        .expect("dataBytes");
    assert!(
        data > 100 << 20,
        "the data directory was copied: {data} bytes"
    );
    assert!(
        size > 0 && size < data,
        "stored compressed: {size} of {data} bytes"
    );
    for field in [
        "beginWal",
        "endWal",
        "beginLsn",
        "endLsn",
        "startedAt",
        "stoppedAt",
    ] {
        assert!(
            !backup_status(&ns, "first", field).is_empty(),
            "status.{field} set"
        );
    }
    let id = backup_status(&ns, "first", "backupId");
    let key = format!("{ns}/{CLUSTER}/{system_id}/base/{id}");
    assert_eq!(
        backup_status(&ns, "first", "location"),
        format!("s3://{}/{key}/", s3::env()["S3_BUCKET"])
    );
    let stored = s3::keys(&key).await;
    assert!(
        stored.contains(&format!("{key}/data.tar.zst"))
            && stored.contains(&format!("{key}/backup.json")),
        "the data and its manifest are stored: {stored:?}"
    );
    // Every segment from the beginning to the end is archived, the first one included,
    // though archiving was switched on only just before.
    let (begin_wal, end_wal) = (
        backup_status(&ns, "first", "beginWal"),
        backup_status(&ns, "first", "endWal"),
    );
    let archived = s3::keys(&format!("{ns}/{CLUSTER}/{system_id}/wals")).await;
    for wal in segments(&begin_wal, &end_wal) {
        let key = format!("{ns}/{CLUSTER}/{system_id}/wals/{}/{wal}.zst", &wal[..16]);
        assert!(
            archived.contains(&key),
            "{wal}, which the backup needs ({begin_wal}..{end_wal}), is archived: {archived:?}"
        );
    }
    assert!(!events_with(&ns, "BackupCompleted", "").is_empty());
    wait_for(
        "the cluster's lastBackup",
        Duration::from_secs(30),
        || jsonpath("dbc", CLUSTER, &ns, "{.status.lastBackup}") == "first",
        diagnostics,
    );
    assert!(!jsonpath("dbc", CLUSTER, &ns, "{.status.firstRecoverabilityPoint}").is_empty());
    // Metrics (docs/metrics.md): the operator's newest completed backup of the cluster,
    // and the primary's archiver, which stored the backup's WAL.
    let operator_metrics = http_get(OPERATOR, "/metrics").1;
    let completed = operator_metrics
        .lines()
        .find_map(|line| {
            line.strip_prefix(&format!(
                "castellan_backup_last_completed_timestamp_seconds{{namespace=\"{ns}\",cluster=\"{CLUSTER}\"}} "
            ))?
            .parse::<f64>()
            .ok()
        })
        .unwrap_or_else(|| panic!("no last completed backup in:\n{operator_metrics}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    assert!(
        (now - 600.0..=now + 5.0).contains(&completed),
        "the backup ended at {completed}, now is {now}"
    );
    let primary_address = instance_addresses(&ns, CLUSTER)
        .into_iter()
        .find(|(pod, _)| *pod == primary)
        .expect("the primary's address")
        .1;
    let instance_metrics = http_get(&format!("{primary_address}:9187"), "/metrics").1;
    let archived = instance_metrics
        .lines()
        .find_map(|line| {
            line.strip_prefix("castellan_pg_stat_archiver_archived_total{")?
                .rsplit(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no archiver counter in:\n{instance_metrics}"));
    assert!(archived > 0, "{instance_metrics}");
    assert!(
        instance_metrics.contains("castellan_pg_stat_archiver_last_archived_timestamp_seconds{"),
        "{instance_metrics}"
    );
    if progress_seen
        .iter()
        .any(|p| p.parse::<i32>().is_ok_and(|p| p > 0 && p < 100))
    {
        eprintln!("progress seen while running: {progress_seen:?}");
    }

    // The operator restarted while a backup runs: it follows it to the end.
    apply_backup(&ns, "second", CLUSTER);
    wait_for(
        "the second backup Running",
        Duration::from_secs(60),
        || backup_status(&ns, "second", "phase") == "Running",
        diagnostics,
    );
    if let Some(old) = operator.take() {
        old.terminate();
    }
    operator = Some(Operator::start(&ns, OPERATOR));
    wait_for(
        "the second backup Completed after the operator restart",
        Duration::from_secs(180),
        || backup_status(&ns, "second", "phase") == "Completed",
        diagnostics,
    );

    // Retention (keepLast: 1): the first backup and the WAL only it needed go; the
    // second and everything from its start stay, and the cluster says from when it
    // can be restored.
    wait_for(
        "retention removing the first backup",
        Duration::from_secs(60),
        || !events(&ns, "BackupsRemoved").is_empty(),
        diagnostics,
    );
    let remaining = s3::keys(&key).await;
    assert!(
        remaining.is_empty(),
        "the first backup is gone: {remaining:?}"
    );
    let second = format!(
        "{ns}/{CLUSTER}/{system_id}/base/{}",
        backup_status(&ns, "second", "backupId")
    );
    assert!(
        s3::keys(&second)
            .await
            .iter()
            .any(|k| k.ends_with("backup.json")),
        "the newest backup stays"
    );
    let begin = backup_status(&ns, "second", "beginWal");
    let wals = s3::keys(&format!("{ns}/{CLUSTER}/{system_id}/wals")).await;
    let segment = |k: &String| {
        k.rsplit('/')
            .next()
            .and_then(|name| name.split('.').next())
            .filter(|name| name.len() == 24)
            .map(|name| name[8..].to_owned())
    };
    assert!(
        wals.iter()
            .filter_map(segment)
            .all(|position| position.as_str() >= &begin[8..]),
        "no WAL below {begin} is left: {wals:?}"
    );
    assert!(
        wals.iter()
            .filter_map(segment)
            .any(|position| position == begin[8..]),
        "the second backup's first segment {begin} stays: {wals:?}"
    );
    let second_stopped = backup_status(&ns, "second", "stoppedAt");
    wait_for(
        "the first recoverability point at the second backup",
        Duration::from_secs(30),
        || {
            jsonpath("dbc", CLUSTER, &ns, "{.status.firstRecoverabilityPoint}") == second_stopped
                && jsonpath("dbc", CLUSTER, &ns, "{.status.lastBackup}") == "second"
        },
        diagnostics,
    );

    // The instance taking a backup restarted in the middle: Failed, with the reason.
    apply_backup(&ns, "third", CLUSTER);
    wait_for(
        "the third backup Running",
        Duration::from_secs(60),
        || backup_status(&ns, "third", "phase") == "Running",
        diagnostics,
    );
    let taker = backup_status(&ns, "third", "instance");
    kubectl_ok(&["delete", "pod", &taker, "-n", &ns, "--wait=false"]);
    wait_for(
        "the third backup Failed",
        Duration::from_secs(180),
        || backup_status(&ns, "third", "phase") == "Failed",
        diagnostics,
    );
    let error = backup_status(&ns, "third", "error");
    assert!(error.contains("never restored"), "{error}");
    assert!(!events_with(&ns, "BackupFailed", "").is_empty());
    let third = format!(
        "{ns}/{CLUSTER}/{system_id}/base/{}",
        backup_status(&ns, "third", "backupId")
    );
    assert!(
        !s3::keys(&third)
            .await
            .iter()
            .any(|k| k.ends_with("backup.json")),
        "no manifest for the failed backup"
    );

    stop.store(true, Ordering::Relaxed);
    writer.await.expect("the writer");
    assert!(written.load(Ordering::Relaxed) > 0, "writes went on");
    drop(operator);
}
