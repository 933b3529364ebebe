//! Continuous WAL archiving to the local S3 server, end to end: a 2-instance cluster with
//! `spec.backup` archives its completed segments (zstd, under
//! `<namespace>/<cluster>/<system id>/wals/`); archiving goes on after a switchover (the
//! new timeline's history file and segments) and an operator restart; with the S3
//! server stopped the cluster says so (`ContinuousArchiving` False, a Warning, another
//! when the waiting WAL reaches a quarter of the volume) and keeps the waiting WAL, and
//! catches up once the server is back; a replica whose slot was lost while it was
//! fenced catches up from the archive (`restore_command`).

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use support::cluster::{
    LocalVolumes, Operator, describe, events, events_with, jsonpath, phase_and_ready, wait_for,
};
use support::faults::volume_path;
use support::{TestNamespace, client, kubectl_ok, s3};

const CLUSTER: &str = "shop";
const OPERATOR: &str = "127.0.65.1:8080";
const SEGMENT_SIZE: usize = 16 * 1024 * 1024;

fn condition(namespace: &str, type_: &str) -> String {
    support::cluster::condition(namespace, CLUSTER, type_)
}

/// `kubectl annotate dbc shop <annotation>`.
fn annotate(namespace: &str, annotation: &str) {
    kubectl_ok(&["annotate", "dbc", CLUSTER, "-n", namespace, annotation]);
}

fn primary(namespace: &str) -> String {
    jsonpath("dbc", CLUSTER, namespace, "{.status.currentPrimary}")
}

async fn superuser(namespace: &str, pod: &str) -> PgConnection {
    try_superuser(namespace, pod)
        .await
        .unwrap_or_else(|error| panic!("{error}"))
}

async fn try_superuser(namespace: &str, pod: &str) -> Result<PgConnection, String> {
    support::cluster::try_superuser(namespace, CLUSTER, pod).await
}

/// Writes a little, then ends the current segment; returns its file name.
async fn complete_a_segment(
    connection: &mut PgConnection,
    diagnostics: &dyn Fn() -> String,
) -> String {
    let failed = |what: &str, error: sqlx::Error| -> ! {
        panic!("{what} on the primary: {error}\n{}", diagnostics())
    };
    if let Err(error) =
        sqlx::query("insert into orders (item) select 'widget' from generate_series(1, 100)")
            .execute(&mut *connection)
            .await
    {
        failed("writing orders", error);
    }
    let name: String = match sqlx::query_scalar("select pg_walfile_name(pg_current_wal_lsn())")
        .fetch_one(&mut *connection)
        .await
    {
        Ok(name) => name,
        Err(error) => failed("reading the current WAL file", error),
    };
    if let Err(error) = sqlx::query("select pg_switch_wal()")
        .execute(&mut *connection)
        .await
    {
        failed("switching WAL", error);
    }
    name
}

async fn system_id(connection: &mut PgConnection) -> String {
    sqlx::query_scalar::<_, i64>("select system_identifier from pg_control_system()")
        .fetch_one(&mut *connection)
        .await
        .expect("the system identifier")
        .to_string()
}

async fn wait_for_key(key: &str, what: &str, diagnostics: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let folder = key.rsplit_once('/').map_or(key, |(folder, _)| folder);
    loop {
        if s3::keys(folder).await.iter().any(|k| k == key) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {key} not in the object store within 60 s; there: {:?}\n{}",
            s3::keys(folder).await,
            diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn segment_key(prefix: &str, file: &str) -> String {
    format!("{prefix}/wals/{}/{file}.zst", &file[..16])
}

#[tokio::test]
async fn completed_wal_reaches_the_object_store_through_a_switchover_and_an_outage() {
    let _client = client().await;
    let namespace = TestNamespace::create(&_client, "archive").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 1);
    let mut operator = Some(Operator::start(&ns, OPERATOR));
    let logs: Vec<PathBuf> = operator.iter().map(|o| o.log.clone()).collect();
    let diagnostics = || describe(&ns, &logs);

    s3::archiving_cluster(&ns, CLUSTER, 2, &volumes.class, "", diagnostics);

    // A completed segment appears under <namespace>/<cluster>/<system id>/wals/, whole.
    let first = primary(&ns);
    let mut connection = superuser(&ns, &first).await;
    sqlx::query("create table if not exists orders (id bigserial primary key, item text)")
        .execute(&mut connection)
        .await
        .expect("creating orders");
    let prefix = format!("{ns}/{CLUSTER}/{}", system_id(&mut connection).await);
    let file = complete_a_segment(&mut connection, &diagnostics).await;
    let key = segment_key(&prefix, &file);
    wait_for_key(&key, "a completed segment", diagnostics).await;
    assert_eq!(s3::wal_file(&key).await.len(), SEGMENT_SIZE, "{key} whole");

    // Switchover: the new primary archives its timeline's history file and segments.
    let target = format!("{CLUSTER}-2");
    let target = if first == target {
        format!("{CLUSTER}-1")
    } else {
        target
    };
    annotate(&ns, &format!("castellan.io/switchover-to={target}"));
    wait_for(
        "the switchover",
        Duration::from_secs(90),
        || primary(&ns) == target && phase_and_ready(&ns, CLUSTER) == "Ready/2",
        diagnostics,
    );
    let mut connection = superuser(&ns, &target).await;
    let file = complete_a_segment(&mut connection, &diagnostics).await;
    assert!(
        file.starts_with("00000002"),
        "{file} is on the new timeline"
    );
    wait_for_key(
        &format!("{prefix}/wals/00000002.history.zst"),
        "the new timeline's history",
        diagnostics,
    )
    .await;
    wait_for_key(
        &segment_key(&prefix, &file),
        "a segment after the switchover",
        diagnostics,
    )
    .await;

    // The operator restarted: the instances keep archiving with the setting they have.
    if let Some(old) = operator.take() {
        old.terminate();
    }
    operator = Some(Operator::start(&ns, OPERATOR));
    let file = complete_a_segment(&mut connection, &diagnostics).await;
    wait_for_key(
        &segment_key(&prefix, &file),
        "a segment after an operator restart",
        diagnostics,
    )
    .await;

    // The S3 server stopped: a condition and a Warning, and the WAL stays; once the
    // waiting WAL reaches a quarter of the 1Gi volume (16 segments), another Warning.
    s3::server("stop");
    let mut waiting = Vec::new();
    for _ in 0..17 {
        waiting.push(complete_a_segment(&mut connection, &diagnostics).await);
    }
    wait_for(
        "ContinuousArchiving False with the S3 server down",
        Duration::from_secs(60),
        || condition(&ns, "ContinuousArchiving") == "False/ArchivingFailing",
        diagnostics,
    );
    assert!(
        !events(&ns, "ArchivingFailing").is_empty(),
        "a Warning Event says so"
    );
    wait_for(
        "a Warning that WAL piles up on the volume",
        Duration::from_secs(30),
        || !events(&ns, "WALPilingUp").is_empty(),
        diagnostics,
    );
    let pg_wal = volume_path(&ns, &target).join("pgdata/pg_wal");
    for file in &waiting {
        assert!(
            pg_wal.join(file).exists(),
            "{file} stays on the volume until it is archived"
        );
    }

    // Back: it catches up and says so.
    s3::server("up");
    for file in &waiting {
        wait_for_key(
            &segment_key(&prefix, file),
            "a segment that waited for the S3 server",
            diagnostics,
        )
        .await;
    }
    wait_for(
        "ContinuousArchiving True again",
        Duration::from_secs(60),
        || condition(&ns, "ContinuousArchiving") == "True/Archiving",
        diagnostics,
    );
    assert!(!events_with(&ns, "ArchivingResumed", "").is_empty());

    // A replica that fell behind what its slot may hold catches up from the archive
    // (restore_command): fenced while the primary writes and checkpoints past
    // max_slot_wal_keep_size (a quarter of 1Gi), its slot is lost; unfenced, it reads
    // the segments it missed from the object store.
    let replica = first;
    annotate(
        &ns,
        &format!("castellan.io/fenced-instances=[\"{replica}\"]"),
    );
    wait_for(
        "the replica fenced",
        Duration::from_secs(60),
        || {
            jsonpath(
                "dbc",
                CLUSTER,
                &ns,
                &format!("{{.status.instances[?(@.name==\"{replica}\")].fenced}}"),
            ) == "true"
        },
        diagnostics,
    );
    for _ in 0..24 {
        complete_a_segment(&mut connection, &diagnostics).await;
    }
    let slot = format!("castellan_{}", replica.replace('-', "_"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        sqlx::query("checkpoint")
            .execute(&mut connection)
            .await
            .expect("a checkpoint");
        let status: Option<String> =
            sqlx::query_scalar("select wal_status from pg_replication_slots where slot_name = $1")
                .bind(&slot)
                .fetch_optional(&mut connection)
                .await
                .expect("reading the slot")
                .flatten();
        if status.as_deref() == Some("lost") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "slot {slot} not lost within 60 s: {status:?}\n{}",
            diagnostics()
        );
        complete_a_segment(&mut connection, &diagnostics).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let marker: i64 =
        sqlx::query_scalar("insert into orders (item) values ('marker') returning id")
            .fetch_one(&mut connection)
            .await
            .expect("writing the marker");
    sqlx::query("select pg_switch_wal()")
        .execute(&mut connection)
        .await
        .expect("switching WAL");
    annotate(&ns, "castellan.io/fenced-instances-");
    wait_for(
        "the lagging replica restoring from the archive",
        Duration::from_secs(120),
        || {
            kubectl_ok(&["logs", "-n", &ns, &replica])
                .contains("restored a WAL file from the archive")
        },
        diagnostics,
    );
    // It accepts connections once it has replayed far enough to be consistent (its
    // pod's readiness may still say true from before it was fenced: ask the server).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let found = match try_superuser(&ns, &replica).await {
            Ok(mut on_replica) => {
                sqlx::query_scalar::<_, i64>("select id from orders where id = $1")
                    .bind(marker)
                    .fetch_optional(&mut on_replica)
                    .await
                    .unwrap_or(None)
            }
            Err(_) => None,
        };
        if found == Some(marker) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the marker row is not on {replica} within 120 s\n{}",
            diagnostics()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    drop(operator);
}
