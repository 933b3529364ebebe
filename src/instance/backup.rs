//! Base backups: the data directory, streamed as a zstd-compressed tar straight into
//! the object store, with no copy on the local disk.
//!
//! A backup uses PostgreSQL's non-exclusive low-level API on one connection:
//! `pg_backup_start` (a fast checkpoint; on a standby a restartpoint, once it has
//! replayed a checkpoint the operator asked the primary for), the files read
//! while the server runs (torn pages are repaired by the full-page images in the WAL
//! replayed on restore), then `pg_backup_stop`, whose `backup_label` goes into the tar
//! last. It runs on a replica as well as on the primary, so the operator takes it from a
//! healthy replica and the primary's disks do not pay for it.
//!
//! The copy is only restorable with the WAL up to the point `pg_backup_stop` returned:
//! the backup waits until that segment is in the archive (on a replica the segment
//! completes when the primary switches to the next one, which the operator asks for),
//! and only then writes `backup.json`, its manifest. A backup without a manifest was
//! never finished and is never restored.
//!
//! Layout: `<prefix>/<system id>/base/<id>/data.tar.zst` (`data.tar` with
//! `compression: none`) and `.../backup.json`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use super::archive::{self, wal_key};
use super::bootstrap::Binaries;
use crate::instance_api::{BackupPhase, BackupReport, BackupRequest, Lsn, millis_since_epoch};
use castellan_crds::database_cluster::Compression;

/// zstd level for base backups: 1 keeps one core ahead of a disk's sequential read
/// (`docs/benchmarks.md`, `make bench-backup`).
const ZSTD_LEVEL: i32 = 1;

/// Size of the parts uploaded, and how many are in flight at once.
const PART_BYTES: usize = 16 * 1024 * 1024;
const PARTS_IN_FLIGHT: usize = 3;

/// How long a finished copy waits for the WAL that makes it consistent.
const WAL_WAIT: Duration = Duration::from_secs(600);
/// How long an earlier segment may still be on its way once the last one is archived.
const IN_FLIGHT: Duration = Duration::from_secs(30);
/// How long a replica may take to replay the primary's checkpoint before its backup.
const REPLAY_WAIT: Duration = Duration::from_secs(120);

/// Finished backups remembered for the operator's questions.
const REMEMBERED: usize = 16;

/// Directories whose contents PostgreSQL rebuilds or never needs from a backup (as
/// `pg_basebackup` leaves them out): kept empty in the tar.
const EMPTIED_DIRS: &[&str] = &[
    "pg_wal",
    "pg_dynshmem",
    "pg_notify",
    "pg_replslot",
    "pg_serial",
    "pg_snapshots",
    "pg_stat_tmp",
    "pg_subtrans",
];

/// Files at the top of the data directory that belong to the running server or to a
/// role, not to the data.
const SKIPPED_FILES: &[&str] = &[
    "postmaster.pid",
    "postmaster.opts",
    "backup_label",
    "backup_manifest",
    "tablespace_map",
    "current_logfiles",
    "standby.signal",
    "recovery.signal",
    "postgresql.auto.conf.tmp",
];

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{what} {path}: {source}")]
    File {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {key} in the object store: {source}")]
    Store {
        what: &'static str,
        key: String,
        source: object_store::Error,
    },
    #[error("{what}: {source}")]
    Database {
        what: &'static str,
        source: sqlx::Error,
    },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Archive(#[from] archive::ArchiveError),
}

fn store_error(what: &'static str, key: &str) -> impl FnOnce(object_store::Error) -> BackupError {
    let key = key.to_owned();
    move |source| BackupError::Store { what, key, source }
}

/// The key prefix of base backup `id`.
pub fn backup_key(prefix: &str, system_id: &str, id: &str) -> String {
    if prefix.is_empty() {
        format!("{system_id}/base/{id}")
    } else {
        format!("{prefix}/{system_id}/base/{id}")
    }
}

/// The key of the tar under backup key prefix `key`.
pub fn data_key(key: &str, compression: Compression) -> String {
    match compression {
        Compression::Zstd => format!("{key}/data.tar.zst"),
        Compression::None => format!("{key}/data.tar"),
    }
}

/// The key of backup `id`'s manifest.
pub fn manifest_key(prefix: &str, system_id: &str, id: &str) -> String {
    format!("{}/backup.json", backup_key(prefix, system_id, id))
}

/// Backup `id`'s manifest, `None` when it has none (it never completed); the error
/// says what could not be read.
pub async fn read_manifest(
    store: &dyn ObjectStore,
    prefix: &str,
    system_id: &str,
    id: &str,
) -> Result<Option<BackupReport>, String> {
    let key = manifest_key(prefix, system_id, id);
    match store.get(&ObjectPath::from(key.as_str())).await {
        Ok(found) => {
            let bytes = found
                .bytes()
                .await
                .map_err(|e| format!("reading {key}: {e}"))?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| format!("the manifest {key} is unreadable: {e}"))
        }
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(error) => Err(format!("reading {key}: {error}")),
    }
}

/// The manager's base backups: at most one running, the last few remembered.
pub struct Backups {
    instance: String,
    data_dir: PathBuf,
    binaries: Binaries,
    pool: PgPool,
    reports: Mutex<BTreeMap<String, BackupReport>>,
    running: Mutex<Option<String>>,
}

impl Backups {
    pub fn new(instance: String, data_dir: PathBuf, binaries: Binaries, pool: PgPool) -> Self {
        Self {
            instance,
            data_dir,
            binaries,
            pool,
            reports: Mutex::new(BTreeMap::new()),
            running: Mutex::new(None),
        }
    }

    pub fn report(&self, id: &str) -> Option<BackupReport> {
        self.reports.lock().ok()?.get(id).cloned()
    }

    fn update(&self, id: &str, change: impl FnOnce(&mut BackupReport)) {
        if let Ok(mut reports) = self.reports.lock()
            && let Some(report) = reports.get_mut(id)
        {
            change(report);
        }
    }

    /// Starts backup `request.id` in the background, or reports it if it is known
    /// already; refuses a second one while another runs.
    /// `standby`: the server runs as a replica.
    pub fn start(
        self: &Arc<Self>,
        request: BackupRequest,
        standby: bool,
    ) -> Result<BackupReport, String> {
        if request.id.is_empty()
            || !request
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "backup id {:?} must be letters, digits, '-' and '_' only",
                request.id
            ));
        }
        if let Some(known) = self.report(&request.id) {
            return Ok(known);
        }
        {
            let mut running = self.running.lock().map_err(|_| "poisoned".to_owned())?;
            if let Some(other) = running.as_ref() {
                return Err(format!(
                    "backup {other} is running on this instance; one at a time"
                ));
            }
            *running = Some(request.id.clone());
        }
        let report = BackupReport {
            id: request.id.clone(),
            phase: BackupPhase::Running,
            instance: self.instance.clone(),
            from_standby: standby,
            compression: request.compression,
            started_ms: Some(millis_since_epoch(SystemTime::now())),
            ..BackupReport::default()
        };
        if let Ok(mut reports) = self.reports.lock() {
            while reports.len() >= REMEMBERED {
                let oldest = reports
                    .iter()
                    .filter(|(_, r)| {
                        matches!(r.phase, BackupPhase::Completed | BackupPhase::Failed)
                    })
                    .min_by_key(|(_, r)| r.started_ms)
                    .map(|(id, _)| id.clone());
                match oldest {
                    Some(id) => reports.remove(&id),
                    None => break,
                };
            }
            reports.insert(request.id.clone(), report.clone());
        }
        let backups = self.clone();
        tokio::spawn(async move {
            let id = request.id.clone();
            tracing::info!(backup = %id, standby, "base backup starting");
            let outcome = take(&backups, &request, standby).await;
            let now = millis_since_epoch(SystemTime::now());
            match outcome {
                Ok(()) => tracing::info!(backup = %id, "base backup completed"),
                Err(error) => {
                    tracing::error!(backup = %id, error = %error, "base backup failed");
                    backups.update(&id, |report| {
                        report.phase = BackupPhase::Failed;
                        report.error = Some(archive::with_causes(&error));
                        report.stopped_ms = Some(now);
                    });
                }
            }
            if let Ok(mut running) = backups.running.lock() {
                *running = None;
            }
        });
        Ok(report)
    }
}

/// What `pg_backup_stop` returns.
struct Stopped {
    label: String,
    tablespace_map: String,
}

async fn take(
    backups: &Backups,
    request: &BackupRequest,
    standby: bool,
) -> Result<(), BackupError> {
    let id = &request.id;
    let target = &request.target;
    let store: Arc<dyn ObjectStore> = Arc::new(archive::s3_store(target)?);
    let system_id = super::bootstrap::system_identifier(&backups.binaries, &backups.data_dir)
        .await
        .map_err(|e| BackupError::Refused(format!("reading the system identifier: {e}")))?
        .ok_or_else(|| {
            BackupError::Refused("pg_controldata printed no system identifier".to_owned())
        })?;
    let prefix = target.prefix.trim_matches('/');
    let key = backup_key(prefix, &system_id, id);
    let manifest_key = manifest_key(prefix, &system_id, id);
    if store
        .head(&ObjectPath::from(manifest_key.as_str()))
        .await
        .is_ok()
    {
        return Err(BackupError::Refused(format!(
            "{manifest_key} exists already: backup {id} was taken before and is never overwritten"
        )));
    }
    backups.update(id, |report| {
        report.key = Some(key.clone());
        report.system_id = Some(system_id.clone());
    });

    // Detached from the pool: if the backup fails, closing the session aborts it,
    // where a pooled session would keep it open for the next user.
    let mut connection = backups
        .pool
        .acquire()
        .await
        .map_err(|source| BackupError::Database {
            what: "connecting to the server to start the backup",
            source,
        })?
        .detach();
    // On a replica the backup begins at its last restartpoint, which replays only the
    // primary's checkpoints: once it has replayed the one the operator asked for, the
    // backup begins there, after archiving was switched on.
    if let Some(checkpoint) = request.after_checkpoint.as_deref().filter(|_| standby) {
        replay_past(&backups.pool, checkpoint).await?;
    }
    let begin: String = sqlx::query_scalar("SELECT pg_backup_start($1, true)::text")
        .bind(format!("castellan {id}"))
        .fetch_one(&mut connection)
        .await
        .map_err(|source| BackupError::Database {
            what: "starting the backup (pg_backup_start)",
            source,
        })?;
    backups.update(id, |report| report.begin_lsn = Some(begin.clone()));

    let files = tokio::task::spawn_blocking({
        let data_dir = backups.data_dir.clone();
        move || list(&data_dir)
    })
    .await
    .map_err(|e| BackupError::Refused(format!("listing the data directory: {e}")))??;
    let total: u64 = files.iter().map(|f| f.size).sum();
    backups.update(id, |report| report.bytes_total = total);

    let compression = request.compression;
    let data_key = data_key(&key, compression);
    let read = Arc::new(AtomicU64::new(0));
    let (chunks_tx, chunks_rx) = mpsc::channel::<Bytes>(2);
    let (files_done_tx, files_done_rx) = oneshot::channel::<()>();
    let (label_tx, label_rx) = oneshot::channel::<Option<Stopped>>();
    let writer = tokio::task::spawn_blocking({
        let data_dir = backups.data_dir.clone();
        let read = read.clone();
        move || {
            write_tar(
                &data_dir,
                &files,
                compression,
                &read,
                chunks_tx,
                files_done_tx,
                label_rx,
            )
        }
    });
    let upload = upload(store.clone(), &data_key, chunks_rx);
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let bytes = read.load(Ordering::Relaxed);
            backups.update(id, |report| report.bytes_read = bytes);
        }
    };
    // Once the files are in the tar, stop the backup and hand its label to the tar.
    let stop = stop_backup(&mut connection, files_done_rx, label_tx);
    let (stored, stopped, written) = tokio::select! {
        outcome = async { tokio::join!(upload, stop, writer) } => outcome,
        () = progress => unreachable!("the progress loop never ends"),
    };
    let written =
        written.map_err(|e| BackupError::Refused(format!("the tar writer panicked: {e}")))?;
    // The first error in the pipeline is the cause; the others follow from it.
    let (stop_lsn, label) = stopped?;
    written?;
    let stored = stored?;
    let consistent_ms = millis_since_epoch(SystemTime::now());

    let label = parse_label(&label)?;
    let segment_size = segment_size(&backups.pool).await?;
    let end_wal = segment_name(label.timeline, stop_lsn, segment_size);
    backups.update(id, |report| {
        report.bytes_read = total;
        report.bytes_stored = stored;
        report.timeline = Some(label.timeline);
        report.begin_wal = Some(label.begin_wal.clone());
        report.end_lsn = Some(stop_lsn.to_string());
        report.end_wal = Some(end_wal.clone());
        report.consistent_ms = Some(consistent_ms);
        report.phase = BackupPhase::WaitingForWal;
    });

    // The segment holding the stop point must be archived for the copy to restore.
    if !standby {
        super::database::switch_wal(&backups.pool)
            .await
            .map_err(|e| BackupError::Refused(format!("after the backup: {e}")))?;
    }
    // Every segment from the start to the stop point must be archived for the copy to
    // restore. The last one arrives once the primary switches; the earlier ones are
    // there already, or at most seconds away (uploaded side by side with the last).
    // One still missing then was completed before archiving was switched on (a
    // standby's backup starts at the last checkpoint it replayed), and never comes.
    let begin_lsn = Lsn::parse(&begin).ok_or_else(|| {
        BackupError::Refused(format!(
            "pg_backup_start returned an unreadable LSN {begin}"
        ))
    })?;
    let mut segments = segments_between(label.timeline, begin_lsn, stop_lsn, segment_size);
    let last = segments.pop().unwrap_or_else(|| end_wal.clone());
    if !archived(
        store.as_ref(),
        &wal_key(prefix, &system_id, &last),
        WAL_WAIT,
    )
    .await
    {
        return Err(BackupError::Refused(format!(
            "WAL segment {last}, which the backup needs to be consistent, was not archived within {}s; see the cluster's ContinuousArchiving condition",
            WAL_WAIT.as_secs()
        )));
    }
    for segment in segments {
        if !archived(
            store.as_ref(),
            &wal_key(prefix, &system_id, &segment),
            IN_FLIGHT,
        )
        .await
        {
            return Err(BackupError::Refused(format!(
                "WAL segment {segment}, which the backup needs, is not in the archive: it was completed before archiving was on (or lost from the bucket), so this copy could never be restored; take the backup again once the cluster has archived a checkpoint"
            )));
        }
    }

    let mut manifest = backups
        .report(id)
        .ok_or_else(|| BackupError::Refused("the backup's report was lost".to_owned()))?;
    manifest.phase = BackupPhase::Completed;
    manifest.stopped_ms = Some(millis_since_epoch(SystemTime::now()));
    let body = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
    let options = PutOptions {
        mode: PutMode::Create,
        ..PutOptions::default()
    };
    store
        .put_opts(
            &ObjectPath::from(manifest_key.as_str()),
            PutPayload::from(body),
            options,
        )
        .await
        .map_err(store_error("writing the manifest", &manifest_key))?;
    backups.update(id, |report| *report = manifest);
    Ok(())
}

/// Waits until the tar holds every file, stops the backup, and hands its label to the
/// tar writer (`None` when the copy or the stop failed).
async fn stop_backup(
    connection: &mut sqlx::PgConnection,
    files_done: oneshot::Receiver<()>,
    label: oneshot::Sender<Option<Stopped>>,
) -> Result<(Lsn, String), BackupError> {
    if files_done.await.is_err() {
        let _ = label.send(None);
        return Err(BackupError::Refused(
            "the copy of the data directory failed".to_owned(),
        ));
    }
    let stopped: Result<(String, String, Option<String>), BackupError> =
        sqlx::query_as("SELECT lsn::text, labelfile, spcmapfile FROM pg_backup_stop(false)")
            .fetch_one(connection)
            .await
            .map_err(|source| BackupError::Database {
                what: "stopping the backup (pg_backup_stop)",
                source,
            });
    let parsed = stopped.and_then(|(lsn, text, map)| {
        let parsed = Lsn::parse(&lsn).ok_or_else(|| {
            BackupError::Refused(format!("pg_backup_stop returned an unreadable LSN {lsn}"))
        })?;
        Ok((parsed, text, map.unwrap_or_default()))
    });
    match parsed {
        Ok((lsn, text, tablespace_map)) => {
            let _ = label.send(Some(Stopped {
                label: text.clone(),
                tablespace_map,
            }));
            Ok((lsn, text))
        }
        Err(error) => {
            let _ = label.send(None);
            Err(error)
        }
    }
}

/// Streams `chunks` into a multipart upload at `key`; returns the bytes stored. A
/// failure aborts the upload, so no partial object is left behind.
async fn upload(
    store: Arc<dyn ObjectStore>,
    key: &str,
    mut chunks: mpsc::Receiver<Bytes>,
) -> Result<u64, BackupError> {
    let location = ObjectPath::from(key);
    let upload = store
        .put_multipart(&location)
        .await
        .map_err(store_error("starting the upload of", key))?;
    let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
    let mut stored = 0u64;
    let mut complete = false;
    while let Some(chunk) = chunks.recv().await {
        // The writer's last word: an empty part after a complete tar.
        if chunk.is_empty() {
            complete = true;
            break;
        }
        if let Err(error) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
            // Dropping the receiver makes the tar writer stop.
            drop(chunks);
            let _ = writer.abort().await;
            return Err(store_error("uploading", key)(error));
        }
        stored += chunk.len() as u64;
        writer.put(chunk);
    }
    if !complete {
        // The tar writer failed (and says why): no truncated object is left.
        let _ = writer.abort().await;
        return Err(BackupError::Refused(format!(
            "the upload of {key} was cut short"
        )));
    }
    writer
        .finish()
        .await
        .map_err(store_error("finishing the upload of", key))?;
    Ok(stored)
}

/// One entry of the data directory to copy.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    /// Relative to the data directory.
    path: PathBuf,
    kind: Kind,
    size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Dir,
    File,
}

/// The data directory's entries to copy, directories before what they hold.
fn list(data_dir: &Path) -> Result<Vec<Entry>, BackupError> {
    let mut entries = Vec::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(dir) = pending.pop() {
        let full = data_dir.join(&dir);
        let read = match std::fs::read_dir(&full) {
            Ok(read) => read,
            // A directory PostgreSQL removed while we walked (a dropped database).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(BackupError::File {
                    what: "listing",
                    path: full,
                    source,
                });
            }
        };
        let mut names: Vec<_> = read.filter_map(Result::ok).collect();
        names.sort_by_key(|e| e.file_name());
        for item in names {
            let name = item.file_name().to_string_lossy().into_owned();
            let relative = dir.join(&name);
            let Ok(meta) = std::fs::symlink_metadata(item.path()) else {
                continue;
            };
            if !included(&relative, &name) {
                continue;
            }
            if meta.file_type().is_symlink() {
                if dir == Path::new("pg_tblspc") {
                    return Err(BackupError::Refused(format!(
                        "the data directory has a tablespace ({}); Castellan's backups cover the data directory only",
                        relative.display()
                    )));
                }
                continue;
            }
            if meta.is_dir() {
                entries.push(Entry {
                    path: relative.clone(),
                    kind: Kind::Dir,
                    size: 0,
                });
                let emptied = dir.as_os_str().is_empty() && EMPTIED_DIRS.contains(&name.as_str());
                if emptied {
                    if name == "pg_wal" {
                        entries.push(Entry {
                            path: relative.join("archive_status"),
                            kind: Kind::Dir,
                            size: 0,
                        });
                    }
                } else {
                    pending.push(relative);
                }
            } else if meta.is_file() {
                entries.push(Entry {
                    path: relative,
                    kind: Kind::File,
                    size: meta.len(),
                });
            }
        }
    }
    Ok(entries)
}

/// Whether `relative` (named `name`) belongs in a backup.
fn included(relative: &Path, name: &str) -> bool {
    let top = relative.parent().is_none_or(|p| p.as_os_str().is_empty());
    if top && SKIPPED_FILES.contains(&name) {
        return false;
    }
    // Relation cache files are rebuilt; temporary files belong to running queries.
    name != "pg_internal.init" && !name.starts_with("pgsql_tmp")
}

/// A `Write` that cuts what is written into parts for the upload.
struct Chunks {
    buffer: Vec<u8>,
    sender: mpsc::Sender<Bytes>,
}

impl Chunks {
    fn send(&mut self) -> std::io::Result<()> {
        let part = std::mem::replace(&mut self.buffer, Vec::with_capacity(PART_BYTES));
        self.sender
            .blocking_send(Bytes::from(part))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload stopped"))
    }
}

impl Write for Chunks {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(buf);
        if self.buffer.len() >= PART_BYTES {
            self.send()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The compressor between the tar and the upload's parts, or none.
enum Packer {
    Zstd(zstd::Encoder<'static, Chunks>),
    Plain(Chunks),
}

impl Packer {
    fn new(sink: Chunks, compression: Compression) -> std::io::Result<Self> {
        Ok(match compression {
            Compression::Zstd => Packer::Zstd(zstd::Encoder::new(sink, ZSTD_LEVEL)?),
            Compression::None => Packer::Plain(sink),
        })
    }

    /// Ends the compressed stream; returns the parts' sink.
    fn finish(self) -> std::io::Result<Chunks> {
        match self {
            Packer::Zstd(encoder) => encoder.finish(),
            Packer::Plain(sink) => Ok(sink),
        }
    }
}

impl Write for Packer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Packer::Zstd(encoder) => encoder.write(buf),
            Packer::Plain(sink) => sink.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Packer::Zstd(encoder) => encoder.flush(),
            Packer::Plain(sink) => sink.flush(),
        }
    }
}

/// Writes the tar of `files`, then (once `pg_backup_stop` answered) the backup label,
/// into `chunks`, compressed as asked. Runs on a blocking thread.
fn write_tar(
    data_dir: &Path,
    files: &[Entry],
    compression: Compression,
    read: &AtomicU64,
    chunks: mpsc::Sender<Bytes>,
    files_done: oneshot::Sender<()>,
    label: oneshot::Receiver<Option<Stopped>>,
) -> Result<(), BackupError> {
    let sink = Chunks {
        buffer: Vec::with_capacity(PART_BYTES),
        sender: chunks,
    };
    let file_error = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| BackupError::File { what, path, source }
    };
    let packer = Packer::new(sink, compression).map_err(file_error("compressing", data_dir))?;
    let mut tar = tar::Builder::new(packer);
    tar.mode(tar::HeaderMode::Complete);
    for entry in files {
        let full = data_dir.join(&entry.path);
        match entry.kind {
            Kind::Dir => {
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o700);
                header.set_size(0);
                header.set_mtime(0);
                tar.append_data(&mut header, &entry.path, std::io::empty())
                    .map_err(file_error("adding to the backup", &full))?;
            }
            Kind::File => {
                let file = match std::fs::File::open(&full) {
                    Ok(file) => file,
                    // Removed since the listing (a dropped table): WAL replay agrees.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(source) => {
                        return Err(BackupError::File {
                            what: "opening",
                            path: full,
                            source,
                        });
                    }
                };
                let mut header = tar::Header::new_gnu();
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o600);
                header.set_size(entry.size);
                header.set_mtime(
                    std::fs::metadata(&full)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                        .map_or(0, |d| d.as_secs()),
                );
                // Exactly the listed size: a file that grew is cut (the WAL has the
                // rest), one that shrank is padded with zeros, as pg_basebackup does.
                let body = file
                    .take(entry.size)
                    .chain(std::io::repeat(0))
                    .take(entry.size);
                let counted = Counted { inner: body, read };
                tar.append_data(&mut header, &entry.path, counted)
                    .map_err(file_error("adding to the backup", &full))?;
            }
        }
    }
    let _ = files_done.send(());
    let Ok(Some(stopped)) = label.blocking_recv() else {
        return Err(BackupError::Refused(
            "the backup was not stopped".to_owned(),
        ));
    };
    for (name, contents) in [
        ("backup_label", &stopped.label),
        ("tablespace_map", &stopped.tablespace_map),
    ] {
        if contents.is_empty() {
            continue;
        }
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0o600);
        header.set_size(contents.len() as u64);
        header.set_mtime(0);
        tar.append_data(&mut header, name, contents.as_bytes())
            .map_err(file_error("adding to the backup", Path::new(name)))?;
    }
    let packer = tar
        .into_inner()
        .map_err(file_error("finishing the tar of", data_dir))?;
    let mut sink = packer
        .finish()
        .map_err(file_error("compressing", data_dir))?;
    if !sink.buffer.is_empty() {
        sink.send().map_err(file_error("uploading", data_dir))?;
    }
    // The end marker: what was sent is the whole tar.
    sink.send().map_err(file_error("uploading", data_dir))?;
    Ok(())
}

/// Counts the bytes read through it, for the progress report.
struct Counted<'a, R> {
    inner: R,
    read: &'a AtomicU64,
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// What the backup label says about where the backup starts.
#[derive(Debug, PartialEq)]
struct Label {
    begin_wal: String,
    timeline: u32,
}

/// Reads `START WAL LOCATION: 0/2000028 (file 000000010000000000000002)` and
/// `START TIMELINE: 1` from a backup label.
fn parse_label(label: &str) -> Result<Label, BackupError> {
    let begin_wal = label
        .lines()
        .find_map(|line| line.strip_prefix("START WAL LOCATION:"))
        .and_then(|rest| rest.split("(file ").nth(1))
        .map(|rest| rest.trim_end_matches(')').trim().to_owned());
    let timeline = label
        .lines()
        .find_map(|line| line.strip_prefix("START TIMELINE:"))
        .and_then(|rest| rest.trim().parse().ok());
    match (begin_wal, timeline) {
        (Some(begin_wal), Some(timeline)) => Ok(Label {
            begin_wal,
            timeline,
        }),
        _ => Err(BackupError::Refused(format!(
            "the backup label has no start WAL file or timeline: {label:?}"
        ))),
    }
}

async fn segment_size(pool: &PgPool) -> Result<u64, BackupError> {
    let size: i64 = sqlx::query_scalar(
        "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'",
    )
    .fetch_one(pool)
    .await
    .map_err(|source| BackupError::Database {
        what: "reading wal_segment_size",
        source,
    })?;
    u64::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .ok_or_else(|| {
            BackupError::Refused(format!("wal_segment_size {size} is not a power of two"))
        })
}

/// The name of the WAL segment holding `lsn` on `timeline` (what `pg_walfile_name`
/// computes, which a standby cannot run).
pub fn segment_name(timeline: u32, lsn: Lsn, segment_size: u64) -> String {
    let segments_per_id = 0x1_0000_0000 / segment_size;
    let segment = lsn.0 / segment_size;
    format!(
        "{timeline:08X}{:08X}{:08X}",
        segment / segments_per_id,
        segment % segments_per_id
    )
}

/// Whether `key` is in the store within `patience` (asked every second; an error
/// asking is logged and asked again).
async fn archived(store: &dyn ObjectStore, key: &str, patience: Duration) -> bool {
    let location = ObjectPath::from(key);
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        match store.head(&location).await {
            Ok(_) => return true,
            Err(object_store::Error::NotFound { .. }) => {}
            Err(error) => tracing::warn!(%key, %error, "checking the archive for a WAL segment"),
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits until this replica has replayed past `lsn`, for up to [`REPLAY_WAIT`].
async fn replay_past(pool: &PgPool, lsn: &str) -> Result<(), BackupError> {
    let deadline = tokio::time::Instant::now() + REPLAY_WAIT;
    loop {
        let replayed = super::database::replayed_past(pool, lsn)
            .await
            .map_err(|e| BackupError::Refused(format!("before the backup: {e}")))?;
        if replayed {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(BackupError::Refused(format!(
                "this replica did not replay the primary's checkpoint at {lsn} within {} s",
                REPLAY_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The WAL segments from the one holding `begin` to the one holding `end`, both
/// included, on `timeline`.
pub fn segments_between(timeline: u32, begin: Lsn, end: Lsn, segment_size: u64) -> Vec<String> {
    let first = begin.0 / segment_size;
    let last = end.0 / segment_size;
    (first..=last)
        .map(|segment| segment_name(timeline, Lsn(segment * segment_size), segment_size))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_needs_every_segment_from_its_start_to_its_end() {
        let mb16 = 16 * 1024 * 1024;
        let lsn = |text: &str| Lsn::parse(text).expect("test value");
        assert_eq!(
            segments_between(1, lsn("0/30000D8"), lsn("0/5000950"), mb16),
            vec![
                "000000010000000000000003",
                "000000010000000000000004",
                "000000010000000000000005"
            ]
        );
        // Across a log file boundary.
        assert_eq!(
            segments_between(2, lsn("0/FF000028"), lsn("1/00000100"), mb16),
            vec!["0000000200000000000000FF", "000000020000000100000000"]
        );
    }

    #[test]
    fn segment_names_match_pg_walfile_name() {
        let mb16 = 16 * 1024 * 1024;
        assert_eq!(
            segment_name(1, Lsn::parse("0/2000028").expect("test value"), mb16),
            "000000010000000000000002"
        );
        assert_eq!(
            segment_name(3, Lsn::parse("16/B374D848").expect("test value"), mb16),
            "0000000300000016000000B3"
        );
        // 1 GiB segments: four per log file.
        assert_eq!(
            segment_name(1, Lsn::parse("1/C0000000").expect("test value"), 1 << 30),
            "000000010000000100000003"
        );
    }

    #[test]
    fn labels_give_the_start_file_and_timeline() {
        let label = "START WAL LOCATION: 0/2000028 (file 000000010000000000000002)\n\
                     CHECKPOINT LOCATION: 0/2000060\nBACKUP METHOD: streamed\n\
                     BACKUP FROM: standby\nSTART TIME: 2026-12-02 03:00:00 UTC\n\
                     LABEL: castellan x\nSTART TIMELINE: 2\n";
        assert_eq!(
            parse_label(label).expect("test value"),
            Label {
                begin_wal: "000000010000000000000002".into(),
                timeline: 2
            }
        );
        assert!(parse_label("nonsense").is_err());
    }

    /// The tar a backup writes, in either compression, unpacks (as a restore does) to
    /// the listed files and the label, byte for byte.
    #[test]
    fn tars_round_trip_with_and_without_compression() {
        for compression in [Compression::Zstd, Compression::None] {
            let root = std::env::temp_dir().join(format!(
                "castellan-backup-tar-{compression:?}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&root);
            let (source, target) = (root.join("source"), root.join("target"));
            std::fs::create_dir_all(source.join("base/1")).expect("test value");
            std::fs::create_dir_all(&target).expect("test value");
            // Pages of noise and pages of zeros, more than one upload part.
            let table: Vec<u8> = (0..(PART_BYTES + 4096) as u32)
                .map(|i| match (i / 8192) % 2 {
                    0 => (i.wrapping_mul(2_654_435_761) >> 24) as u8,
                    _ => 0,
                })
                .collect();
            std::fs::write(source.join("base/1/16384"), &table).expect("test value");
            std::fs::write(source.join("PG_VERSION"), "15\n").expect("test value");
            let files = list(&source).expect("test value");

            let (chunks_tx, mut chunks_rx) = mpsc::channel::<Bytes>(64);
            let (files_done_tx, files_done_rx) = oneshot::channel();
            let (label_tx, label_rx) = oneshot::channel();
            let read = AtomicU64::new(0);
            let writer = std::thread::spawn({
                let source = source.clone();
                move || {
                    write_tar(
                        &source,
                        &files,
                        compression,
                        &read,
                        chunks_tx,
                        files_done_tx,
                        label_rx,
                    )
                    .map(|()| read.load(Ordering::Relaxed))
                }
            });
            files_done_rx
                .blocking_recv()
                .expect("the files are in the tar");
            let label = "START WAL LOCATION: 0/2000028 (file 000000010000000000000002)\n";
            let stopped = Stopped {
                label: label.to_owned(),
                tablespace_map: String::new(),
            };
            assert!(label_tx.send(Some(stopped)).is_ok());
            let mut stored = Vec::new();
            while let Some(chunk) = chunks_rx.blocking_recv() {
                stored.extend_from_slice(&chunk);
            }
            let read = writer
                .join()
                .expect("no panic")
                .expect("the tar is written");
            assert_eq!(read, table.len() as u64 + 3);
            let compressed = stored.len() < table.len();
            assert_eq!(
                compressed,
                compression == Compression::Zstd,
                "{compression:?}"
            );

            crate::instance::restore::unpack_tar(stored.as_slice(), compression, &target)
                .expect("unpacked");
            assert_eq!(
                std::fs::read(target.join("base/1/16384")).expect("test value"),
                table
            );
            assert_eq!(
                std::fs::read_to_string(target.join("backup_label")).expect("test value"),
                label
            );
            let _ = std::fs::remove_dir_all(&root);
        }
    }

    #[test]
    fn the_listing_leaves_out_what_the_server_rebuilds() {
        let dir =
            std::env::temp_dir().join(format!("castellan-backup-list-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in [
            "base/1",
            "global",
            "pg_wal/archive_status",
            "pg_stat_tmp",
            "pg_tblspc",
        ] {
            std::fs::create_dir_all(dir.join(sub)).expect("test value");
        }
        for (file, body) in [
            ("PG_VERSION", "15"),
            ("postmaster.pid", "1"),
            ("standby.signal", ""),
            ("base/1/1259", "data"),
            ("base/1/pg_internal.init", "cache"),
            ("base/1/pgsql_tmp123", "temp"),
            ("global/pg_control", "control"),
            ("pg_wal/000000010000000000000001", "wal"),
            ("pg_stat_tmp/db.stat", "stats"),
        ] {
            std::fs::write(dir.join(file), body).expect("test value");
        }
        let listed: Vec<String> = list(&dir)
            .expect("test value")
            .into_iter()
            .map(|e| e.path.display().to_string())
            .collect();
        let mut sorted = listed.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            vec![
                "PG_VERSION",
                "base",
                "base/1",
                "base/1/1259",
                "global",
                "global/pg_control",
                "pg_stat_tmp",
                "pg_tblspc",
                "pg_wal",
                "pg_wal/archive_status",
            ]
        );
        // A directory comes before what it holds.
        let position = |p: &str| listed.iter().position(|l| l == p).expect("test value");
        assert!(
            position("base") < position("base/1") && position("base/1") < position("base/1/1259")
        );

        std::os::unix::fs::symlink("/tmp", dir.join("pg_tblspc/16384")).expect("test value");
        assert!(matches!(list(&dir), Err(BackupError::Refused(m)) if m.contains("tablespace")));
        std::fs::remove_dir_all(&dir).expect("test value");
    }

    #[test]
    fn progress_is_never_100_before_completion() {
        let mut report = BackupReport {
            bytes_total: 10,
            bytes_read: 10,
            ..BackupReport::default()
        };
        assert_eq!(report.progress_percent(), 99);
        report.bytes_read = 5;
        assert_eq!(report.progress_percent(), 50);
        report.phase = BackupPhase::Completed;
        assert_eq!(report.progress_percent(), 100);
        assert_eq!(BackupReport::default().progress_percent(), 0);
    }
}
