//! Benchmark: base backup throughput and restore time for a database of more than 1 GiB,
//! against the local S3 server (`make bench-backup` brings up its own local cluster,
//! port base 56000, with the S3 server, and tears it down).
//!
//! A one-instance cluster with `spec.backup` is filled with `BENCH_BACKUP_ROWS` rows
//! (default 3 000 000, about 1.2 GiB of half-random text). Then, each after dropping the
//! page cache (`/proc/sys/vm/drop_caches`), in the same run on the same volume:
//! 1. a raw sequential read of every file of the data directory (the ceiling);
//! 2. `pg_basebackup` of the server to `/dev/null` (tar, no WAL): what PostgreSQL's own
//!    tool reaches;
//! 3. a Castellan `Backup` into a multipart upload, from its creation to `Completed`:
//!    uncompressed (`compression: none`), then with zstd level 1 (the default);
//! 4. restores of both backups into new clusters, from their creation to `Restored`
//!    and Ready.
//!
//! And, in process over the same files (cached), how fast and how small zstd levels 1
//! and 3 and lz4 compress them on one core: the measurement behind the choice of zstd.
//! Prints every figure and the ratios to the raw read; recorded in docs/benchmarks.md.

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::cluster::{
    LocalVolumes, Operator, SUPERUSER_ACCESS, apply_cluster, apply_manifest, condition, describe,
    jsonpath, phase_and_ready, secret_value, try_superuser, wait_for,
};
use support::faults::volume_path;
use support::{TestNamespace, client, s3};

const OPERATOR: &str = "127.0.63.3:8080";
const MIB: f64 = 1024.0 * 1024.0;

fn drop_caches() {
    // Dirty pages first, or they stay cached.
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n")
        .expect("dropping the page cache (run as root)");
}

/// Every regular file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() {
                found.push(entry.path());
            }
        }
    }
    found
}

/// Reads every file once; returns the bytes read.
fn read_all(files: &[PathBuf], mut each: impl FnMut(&[u8])) -> u64 {
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    for path in files {
        let Ok(mut file) = std::fs::File::open(path) else {
            continue;
        };
        while let Ok(n) = file.read(&mut buffer) {
            if n == 0 {
                break;
            }
            each(&buffer[..n]);
            total += n as u64;
        }
    }
    total
}

fn rate(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / MIB / elapsed.as_secs_f64()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let rows: i64 = std::env::var("BENCH_BACKUP_ROWS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3_000_000);
    let _client = client().await;
    let namespace = TestNamespace::create(&_client, "bench-backup").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 1);
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    s3::archiving_cluster(&ns, "shop", 1, &volumes.class, "", diagnostics);
    let mut connection = try_superuser(&ns, "shop", "shop-1")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    sqlx::query(
        "create table filler as select g as id, \
         md5(random()::text) || md5(random()::text) || repeat(md5(g::text), 6) as pad \
         from generate_series(1, $1) g",
    )
    .bind(rows)
    .execute(&mut connection)
    .await
    .expect("filling the database");
    sqlx::query("checkpoint")
        .execute(&mut connection)
        .await
        .expect("checkpoint");
    println!(
        "filled {rows} rows in {:.0}s",
        started.elapsed().as_secs_f64()
    );

    let data_dir = volume_path(&ns, "shop-1").join("pgdata");
    let mut listed = files(&data_dir);
    listed.retain(|p| !p.starts_with(data_dir.join("pg_wal")));

    drop_caches();
    let started = Instant::now();
    let raw_bytes = read_all(&listed, |_| {});
    let raw = rate(raw_bytes, started.elapsed());
    println!(
        "raw sequential read: {:.0} MiB in {:.1}s: {raw:.0} MiB/s",
        raw_bytes as f64 / MIB,
        started.elapsed().as_secs_f64()
    );

    // zstd and lz4 on one core, over the same (now cached) files.
    let mut sample = Vec::new();
    read_all(&listed, |chunk| {
        if sample.len() < 256 << 20 {
            sample.extend_from_slice(chunk);
        }
    });
    for (name, compress) in [
        (
            "zstd -1",
            Box::new(|d: &[u8]| zstd::bulk::compress(d, 1).map(|c| c.len()).unwrap_or(0))
                as Box<dyn Fn(&[u8]) -> usize>,
        ),
        (
            "zstd -3",
            Box::new(|d: &[u8]| zstd::bulk::compress(d, 3).map(|c| c.len()).unwrap_or(0)),
        ),
        (
            "lz4",
            Box::new(|d: &[u8]| lz4_flex::block::compress(d).len()),
        ),
    ] {
        let started = Instant::now();
        let stored: usize = sample.chunks(1 << 20).map(&compress).sum();
        let elapsed = started.elapsed();
        println!(
            "{name}: {:.0} MiB/s on one core, stored {:.1}% of {:.0} MiB ({:.2} of the raw read's speed)",
            rate(sample.len() as u64, elapsed),
            stored as f64 * 100.0 / sample.len() as f64,
            sample.len() as f64 / MIB,
            rate(sample.len() as u64, elapsed) / raw
        );
    }

    // The store's own ceiling: as many bytes uploaded from memory the way a backup
    // uploads them (16 MiB parts, three in flight), with nothing read or compressed.
    {
        use object_store::{ObjectStoreExt, WriteMultipart};
        let store = s3::store();
        let location = object_store::path::Path::from(format!("{ns}/ceiling"));
        let part = bytes::Bytes::from(vec![0x5a_u8; 16 << 20]);
        let started = Instant::now();
        let upload = store
            .put_multipart(&location)
            .await
            .expect("starting the ceiling upload");
        let mut writer = WriteMultipart::new_with_chunk_size(upload, 16 << 20);
        let mut sent = 0u64;
        while sent < raw_bytes {
            writer
                .wait_for_capacity(3)
                .await
                .expect("uploading the ceiling");
            writer.put(part.clone());
            sent += part.len() as u64;
        }
        writer.finish().await.expect("finishing the ceiling upload");
        let ceiling = rate(sent, started.elapsed());
        println!(
            "S3 store ceiling (multipart upload from memory): {:.0} MiB in {:.1}s, {ceiling:.0} MiB/s ({:.2} of raw)",
            sent as f64 / MIB,
            started.elapsed().as_secs_f64(),
            ceiling / raw
        );
        let _ = store.delete(&location).await;
    }

    let address = support::cluster::instance_addresses(&ns, "shop")
        .into_iter()
        .next()
        .map(|(_, ip)| ip)
        .expect("an address");
    let password = secret_value(&ns, "shop-replication", "password");
    drop_caches();
    let started = Instant::now();
    let output = Command::new("pg_basebackup")
        .args([
            "-h",
            &address,
            "-U",
            "streaming_replica",
            "-D",
            "-",
            "-Ft",
            "-X",
            "none",
            "--checkpoint",
            "fast",
        ])
        .env("PGPASSWORD", &password)
        .stdout(std::process::Stdio::null())
        .output()
        .expect("running pg_basebackup");
    let elapsed = started.elapsed();
    if output.status.success() {
        let base = rate(raw_bytes, elapsed);
        println!(
            "pg_basebackup to /dev/null: {:.1}s, {base:.0} MiB/s ({:.2} of raw)",
            elapsed.as_secs_f64(),
            base / raw
        );
    } else {
        println!(
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }

    // Castellan's backup uncompressed, then with zstd (the default), each after
    // dropping the page cache; restores of both.
    for (name, compression) in [("plain", "none"), ("zstd", "zstd")] {
        apply_cluster(
            &ns,
            "shop",
            1,
            &volumes.class,
            &format!(
                "  backup: {}\n{SUPERUSER_ACCESS}",
                s3::backup_target(None, &format!("compression: {compression}"))
            ),
        );
        drop_caches();
        let started = Instant::now();
        apply_manifest(
            &ns,
            name,
            &format!(
                "apiVersion: castellan.io/v1alpha1\nkind: Backup\nmetadata: {{name: {name}}}\nspec: {{cluster: shop}}\n"
            ),
        );
        wait_for(
            &format!("backup {name} Completed"),
            Duration::from_secs(1800),
            || {
                let phase = jsonpath("backup", name, &ns, "{.status.phase}");
                assert_ne!(
                    phase,
                    "Failed",
                    "{}",
                    jsonpath("backup", name, &ns, "{.status.error}")
                );
                phase == "Completed"
            },
            diagnostics,
        );
        let elapsed = started.elapsed();
        let data: u64 = jsonpath("backup", name, &ns, "{.status.dataBytes}")
            .parse()
            .unwrap_or(0);
        let stored: u64 = jsonpath("backup", name, &ns, "{.status.sizeBytes}")
            .parse()
            .unwrap_or(0);
        let backup = rate(data, elapsed);
        println!(
            "Castellan Backup (compression: {compression}, multipart): {:.1}s for {:.0} MiB, {backup:.0} MiB/s ({:.2} of raw), stored {:.0} MiB ({:.1}%)",
            elapsed.as_secs_f64(),
            data as f64 / MIB,
            backup / raw,
            stored as f64 / MIB,
            stored as f64 * 100.0 / data.max(1) as f64
        );
    }

    for backup in ["plain", "zstd"] {
        let restored = format!("restored-{backup}");
        let started = Instant::now();
        apply_manifest(
            &ns,
            &restored,
            &format!(
                "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {{name: {restored}}}\nspec:\n  \
                 engine: postgresql\n  version: \"15\"\n  replicas: 1\n  \
                 storage: {{size: 1Gi, storageClassName: {}}}\n  bootstrap: {{recovery: {{backup: {backup}}}}}\n",
                volumes.class
            ),
        );
        wait_for(
            &format!("{restored} Ready"),
            Duration::from_secs(1800),
            || {
                phase_and_ready(&ns, &restored) == "Ready/1"
                    && condition(&ns, &restored, "Restored") == "True/Restored"
            },
            diagnostics,
        );
        println!(
            "restore of backup {backup} into a new cluster, to Ready: {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
    drop(operator);
}
