//! Continuous WAL archiving to the cluster's object store.
//!
//! PostgreSQL's `archive_command` runs `castellan wal-archive <file>`, which hands the
//! file to this instance's manager over a unix socket in the instance's private socket
//! directory ([`serve`]) and exits 0 only when the manager says the file is stored. The
//! manager holds the store's client and credentials in memory (the operator sends them
//! with `POST /reload`), stores each file compressed with zstd, and counts what it did
//! for the status report.
//!
//! Every instance archives (`archive_mode = always`): a replica that is promoted has
//! then already archived what it received, so nothing the old primary did not get to
//! is missing from the archive. A file already in the store is never overwritten:
//! - on a replica it is taken as stored (the primary, or another replica, put it there);
//! - on a primary its content is compared, and a different file under the same name is
//!   an error that stops archiving (PostgreSQL keeps the file and retries), never an
//!   overwrite.
//!
//! Objects live under `<prefix>/<system identifier>/wals/`, segments in a folder per
//! timeline and log (`wals/0000000100000000/000000010000000000000003.zst`), so that a
//! restored or re-created cluster, which has another prefix or another system
//! identifier, never collides with this one (`docs/backups.md`).
//!
//! When the archive falls behind, a request for one segment also stores the next few
//! waiting ones side by side, and their later requests are answered at once.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as ObjectPath;
use object_store::{
    Certificate, ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OnceCell, watch};

use super::Published;

use crate::instance_api::{
    ArchiveConfig, ArchiveReport, ArchiveTarget, RunningRole, millis_since_epoch,
};

/// Name of the manager's archive socket in the instance's socket directory.
pub const SOCKET: &str = "castellan-archive.sock";

/// zstd level: 3 (zstd's default) stores a 16 MiB segment of ordinary OLTP WAL in a
/// fraction of its size at several hundred MB/s on one core.
const ZSTD_LEVEL: i32 = 3;

/// How many waiting segments one request stores beside the one asked for.
const AHEAD: usize = 3;

/// How long a restore replaying another cluster's archive waits for a file.
const SOURCE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a restore may wait for the archive before the file counts as missing.
const RESTORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("archiving is not configured yet: the operator has not sent this instance its setting")]
    NotConfigured,
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
    #[error(
        "{key} is already archived with different content: a different {file} was archived under the same name, and it is never overwritten"
    )]
    Different { key: String, file: String },
    #[error("compressing {file}: {source}")]
    Compress {
        file: String,
        source: std::io::Error,
    },
    #[error("reading {0} from the object store took longer than {1:?}")]
    Timeout(String, std::time::Duration),
    #[error("reading the system identifier with pg_controldata: {0}")]
    SystemId(String),
    #[error("setting up the S3 client for {endpoint}: {source}")]
    Client {
        endpoint: String,
        source: object_store::Error,
    },
}

/// Whether `name` is a WAL segment file name (24 hexadecimal digits).
pub fn is_segment(name: &str) -> bool {
    name.len() == 24 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The object key of WAL file `file` (a segment, `.partial` segment, `.history` or
/// `.backup` file) under `prefix` for the cluster with `system_id`.
pub fn wal_key(prefix: &str, system_id: &str, file: &str) -> String {
    let base = if prefix.is_empty() {
        format!("{system_id}/wals")
    } else {
        format!("{prefix}/{system_id}/wals")
    };
    let segment_part = file.split('.').next().unwrap_or(file);
    if is_segment(segment_part) {
        format!("{base}/{}/{file}.zst", &segment_part[..16])
    } else {
        format!("{base}/{file}.zst")
    }
}

/// The archiving setting the manager runs with.
#[derive(Clone, Default)]
pub enum Setting {
    /// The operator has not said yet: nothing is let go.
    #[default]
    Unknown,
    /// No object store (`spec.backup` absent): completed segments are let go.
    Off,
    On(Arc<Archiver>),
}

impl Setting {
    pub fn fingerprint(&self) -> Option<String> {
        match self {
            Setting::Unknown => None,
            Setting::Off => Some(ArchiveConfig::new(None).fingerprint),
            Setting::On(archiver) => Some(archiver.fingerprint.clone()),
        }
    }
}

/// One object store setting: the client, and what it was made from.
pub struct Archiver {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    fingerprint: String,
    system_id: OnceCell<String>,
    /// Files stored ahead of PostgreSQL's request for them.
    ahead: Mutex<HashSet<String>>,
}

impl Archiver {
    pub fn new(config: &ArchiveConfig, target: &ArchiveTarget) -> Result<Self, ArchiveError> {
        let store = s3_store(target)?;
        Ok(Self {
            store: Arc::new(store),
            prefix: target.prefix.trim_matches('/').to_owned(),
            fingerprint: config.fingerprint.clone(),
            system_id: OnceCell::new(),
            ahead: Mutex::new(HashSet::new()),
        })
    }
}

/// The S3 client for `target`: path-style requests (S3-compatible servers on an IP
/// address have no virtual hosts), plain HTTP only when the endpoint says `http://`,
/// the target's CA bundle trusted beside the system's authorities.
pub fn s3_store(target: &ArchiveTarget) -> Result<object_store::aws::AmazonS3, ArchiveError> {
    let client_error = |source| ArchiveError::Client {
        endpoint: target.endpoint.clone(),
        source,
    };
    let mut options = ClientOptions::new();
    if let Some(pem) = &target.ca_bundle {
        for certificate in Certificate::from_pem_bundle(pem.as_bytes()).map_err(client_error)? {
            options = options.with_root_certificate(certificate);
        }
    }
    AmazonS3Builder::new()
        // First: the settings below that are client options amend these.
        .with_client_options(options)
        .with_endpoint(&target.endpoint)
        .with_bucket_name(&target.bucket)
        .with_region(target.region.as_deref().unwrap_or("us-east-1"))
        .with_access_key_id(&target.access_key_id)
        .with_secret_access_key(&target.secret_access_key)
        .with_allow_http(target.endpoint.starts_with("http://"))
        .with_virtual_hosted_style_request(false)
        // `If-None-Match: *` on the write (object_store refuses PutMode::Create
        // without it).
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .build()
        .map_err(client_error)
}

/// The manager's side of archiving: the setting the operator sent, what it did since,
/// and the work the archive socket asks for.
pub struct Archive {
    data_dir: PathBuf,
    /// `pg_controldata`, to read the system identifier.
    binaries: super::bootstrap::Binaries,
    /// The role the instance runs in now.
    published: watch::Receiver<Published>,
    setting: Mutex<Setting>,
    report: Mutex<ArchiveReport>,
    /// While a restore replays another cluster's WAL: where `restore` reads from.
    source: Mutex<Option<Arc<Archiver>>>,
}

impl Archive {
    pub fn new(
        data_dir: PathBuf,
        binaries: super::bootstrap::Binaries,
        published: watch::Receiver<Published>,
    ) -> Self {
        Self {
            data_dir,
            binaries,
            published,
            setting: Mutex::new(Setting::Unknown),
            report: Mutex::new(ArchiveReport::default()),
            source: Mutex::new(None),
        }
    }

    /// Whether WAL is read from another cluster's archive (a restore).
    pub fn replaying_source(&self) -> bool {
        self.source.lock().is_ok_and(|s| s.is_some())
    }

    /// Reads WAL from `source` instead of this cluster's archive (a restore replaying
    /// the cluster it came from), or from the archive again (`None`). Archiving is not
    /// affected: the restored cluster never writes into its source's archive.
    pub fn read_from(&self, source: Option<&ArchiveTarget>) -> Result<(), ArchiveError> {
        let archiver = match source {
            Some(target) => Some(Arc::new(Archiver::new(
                &ArchiveConfig::new(Some(target.clone())),
                target,
            )?)),
            None => None,
        };
        if let Ok(mut current) = self.source.lock() {
            *current = archiver;
        }
        Ok(())
    }

    fn setting(&self) -> Setting {
        self.setting
            .lock()
            .map(|setting| setting.clone())
            .unwrap_or_default()
    }

    /// Puts the operator's setting in force (no reload of the server: the next file
    /// reads it). A changed setting starts a fresh report. `true` when it names an
    /// object store that was not in force before.
    pub fn apply(&self, config: &ArchiveConfig) -> Result<bool, ArchiveError> {
        if self.setting().fingerprint().as_deref() == Some(config.fingerprint.as_str()) {
            return Ok(false);
        }
        let setting = match &config.target {
            None => Setting::Off,
            Some(target) => Setting::On(Arc::new(Archiver::new(config, target)?)),
        };
        tracing::info!(fingerprint = %config.fingerprint, "new WAL archive setting");
        if let Ok(mut current) = self.setting.lock() {
            *current = setting;
        }
        if let Ok(mut report) = self.report.lock() {
            *report = ArchiveReport::default();
        }
        Ok(config.target.is_some())
    }

    /// Whether the setting with `fingerprint` is still in force and has archived
    /// nothing yet.
    pub fn untried(&self, fingerprint: &str) -> bool {
        // The counts only: `report` would also list pg_wal for the waiting files.
        let nothing_yet = self
            .report
            .lock()
            .is_ok_and(|report| report.last_archived.is_none() && report.last_failure.is_none());
        nothing_yet && self.setting().fingerprint().as_deref() == Some(fingerprint)
    }

    /// What archiving did since the setting, with its fingerprint and the files
    /// waiting now.
    pub fn report(&self) -> ArchiveReport {
        let mut report = self
            .report
            .lock()
            .map(|report| report.clone())
            .unwrap_or_default();
        report.fingerprint = self.setting().fingerprint();
        report.waiting =
            u32::try_from(waiting(&self.data_dir.join("pg_wal")).len()).unwrap_or(u32::MAX);
        report
    }

    /// The cluster's system identifier, read once per setting.
    async fn system_id<'a>(&self, archiver: &'a Archiver) -> Result<&'a str, ArchiveError> {
        archiver
            .system_id
            .get_or_try_init(|| system_id(&self.binaries, &self.data_dir))
            .await
            .map(String::as_str)
    }

    /// Archives `file` (a path PostgreSQL gave, relative to the data directory) and,
    /// when others wait behind it, the next few of them.
    pub async fn archive(&self, file: &Path) -> Result<(), ArchiveError> {
        let archiver = match self.setting() {
            Setting::Unknown => return Err(ArchiveError::NotConfigured),
            Setting::Off => return Ok(()),
            Setting::On(archiver) => archiver,
        };
        let path = self.data_dir.join(file);
        let name = file_name(&path);
        let taken = archiver
            .ahead
            .lock()
            .map(|mut ahead| ahead.remove(&name))
            .unwrap_or(false);
        if taken {
            return Ok(());
        }
        let system_id = self.system_id(&archiver).await?.to_owned();
        let replica = self.published.borrow().role == Some(RunningRole::Replica);
        let wal_dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let ahead: Vec<String> = waiting(&wal_dir)
            .into_iter()
            .filter(|other| *other > name && is_segment(other))
            .take(AHEAD)
            .collect();
        let store_one = |name: String| {
            let archiver = archiver.clone();
            let (system_id, wal_dir) = (system_id.clone(), wal_dir.clone());
            async move {
                let result = store(&archiver, &system_id, &wal_dir.join(&name), replica).await;
                (name, result)
            }
        };
        let mut jobs = vec![store_one(name.clone())];
        jobs.extend(ahead.into_iter().map(store_one));
        let mut outcome = Ok(());
        for (stored, result) in futures::future::join_all(jobs).await {
            match result {
                Ok(()) => {
                    self.record_success(&stored);
                    if stored != name
                        && let Ok(mut ahead) = archiver.ahead.lock()
                    {
                        ahead.insert(stored);
                    }
                }
                Err(error) if stored == name => outcome = Err(error),
                // A file stored ahead that failed is simply asked for again.
                Err(_) => {}
            }
        }
        if let Err(error) = &outcome {
            self.record_failure(&name, error);
        }
        outcome
    }

    /// Fetches WAL file `file` from the archive into `dest` (relative to the data
    /// directory): `Ok(false)` when the archive does not have it, or archiving is off.
    /// A standby asks for every file it wants next, also while it streams or while its
    /// primary is gone, so an archive that does not answer within [`RESTORE_TIMEOUT`]
    /// counts as not having it: a slow object store must not keep a replica from
    /// following a new primary.
    pub async fn restore(&self, file: &str, dest: &Path) -> Result<bool, ArchiveError> {
        let source = self.source.lock().ok().and_then(|s| s.clone());
        let replaying = source.is_some();
        let archiver = match (source, self.setting()) {
            (Some(source), _) => source,
            (None, Setting::On(archiver)) => archiver,
            (None, _) => return Ok(false),
        };
        let key = wal_key(&archiver.prefix, self.system_id(&archiver).await?, file);
        let location = ObjectPath::from(key.as_str());
        // A restore waits longer, and a store that does not answer is an error there:
        // taken as "missing" it would end the recovery early, short of the target.
        let timeout = if replaying {
            SOURCE_TIMEOUT
        } else {
            RESTORE_TIMEOUT
        };
        let fetched = tokio::time::timeout(timeout, async {
            archiver.store.get(&location).await?.bytes().await
        })
        .await;
        let compressed = match fetched {
            Err(_) if replaying => return Err(ArchiveError::Timeout(key, timeout)),
            Err(_) => {
                tracing::warn!(%key, "the archive did not answer in time: the file counts as missing");
                return Ok(false);
            }
            Ok(Err(object_store::Error::NotFound { .. })) => return Ok(false),
            Ok(Err(source)) => {
                return Err(ArchiveError::Store {
                    what: "reading",
                    key,
                    source,
                });
            }
            Ok(Ok(bytes)) => bytes,
        };
        let raw = zstd::stream::decode_all(compressed.as_ref()).map_err(|source| {
            ArchiveError::Compress {
                file: file.to_owned(),
                source,
            }
        })?;
        let path = self.data_dir.join(dest);
        let partial = path.with_extension("castellan-partial");
        let write = async {
            tokio::fs::write(&partial, &raw).await?;
            tokio::fs::rename(&partial, &path).await
        };
        write.await.map_err(|source| ArchiveError::File {
            what: "writing",
            path,
            source,
        })?;
        tracing::info!(file, "restored a WAL file from the archive");
        Ok(true)
    }

    fn record_success(&self, name: &str) {
        if let Ok(mut report) = self.report.lock() {
            if report.last_archived.as_deref() < Some(name) || !is_segment(name) {
                report.last_archived = Some(name.to_owned());
            }
            report.last_archived_ms = Some(millis_since_epoch(SystemTime::now()));
        }
    }

    fn record_failure(&self, name: &str, error: &ArchiveError) {
        let error = with_causes(error);
        tracing::warn!(file = name, %error, "archiving a WAL file failed");
        if let Ok(mut report) = self.report.lock() {
            report.last_failure = Some(format!("archiving {name}: {error}"));
            report.last_failed_ms = Some(millis_since_epoch(SystemTime::now()));
        }
    }
}

/// `error` with the causes its message leaves out: the S3 client says "error sending
/// request" and keeps why (a refused certificate, a refused connection) in its sources.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let said = inner.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = inner.source();
    }
    text
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The WAL files PostgreSQL has finished and not yet had archived, oldest first.
pub fn waiting(wal_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(wal_dir.join("archive_status"))
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok())
                .filter_map(|entry| {
                    entry
                        .file_name()
                        .to_string_lossy()
                        .strip_suffix(".ready")
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

async fn system_id(
    binaries: &super::bootstrap::Binaries,
    data_dir: &Path,
) -> Result<String, ArchiveError> {
    super::bootstrap::system_identifier(binaries, data_dir)
        .await
        .map_err(|e| ArchiveError::SystemId(e.to_string()))?
        .ok_or_else(|| ArchiveError::SystemId("pg_controldata printed none".to_owned()))
}

/// Stores one file unless it is there already (see the module documentation).
async fn store(
    archiver: &Archiver,
    system_id: &str,
    path: &Path,
    replica: bool,
) -> Result<(), ArchiveError> {
    let name = file_name(path);
    let key = wal_key(&archiver.prefix, system_id, &name);
    let location = ObjectPath::from(key.as_str());
    let store_error = |what: &'static str| {
        let key = key.clone();
        move |source| ArchiveError::Store { what, key, source }
    };
    let exists = match archiver.store.head(&location).await {
        Ok(_) => true,
        Err(object_store::Error::NotFound { .. }) => false,
        Err(source) => return Err(store_error("checking")(source)),
    };
    if exists && replica {
        return Ok(());
    }
    let raw = tokio::fs::read(path)
        .await
        .map_err(|source| ArchiveError::File {
            what: "reading",
            path: path.to_path_buf(),
            source,
        })?;
    if exists {
        return same_content(archiver, &location, &key, &name, &raw).await;
    }
    // Off the async threads; the file comes back for a comparison after a lost race.
    let (raw, compressed) = tokio::task::spawn_blocking(move || {
        let compressed = zstd::bulk::compress(&raw, ZSTD_LEVEL);
        (raw, compressed)
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|(raw, compressed)| Ok((raw, compressed?)))
    .map_err(|source| ArchiveError::Compress {
        file: name.clone(),
        source,
    })?;
    let options = PutOptions {
        mode: PutMode::Create,
        ..PutOptions::default()
    };
    match archiver
        .store
        .put_opts(&location, PutPayload::from(compressed), options)
        .await
    {
        Ok(_) => Ok(()),
        // Someone stored it between our check and our write: compare as above.
        Err(object_store::Error::AlreadyExists { .. }) => {
            same_content(archiver, &location, &key, &name, &raw).await
        }
        Err(source) => Err(store_error("storing")(source)),
    }
}

async fn same_content(
    archiver: &Archiver,
    location: &ObjectPath,
    key: &str,
    name: &str,
    raw: &[u8],
) -> Result<(), ArchiveError> {
    let stored: Bytes = async { archiver.store.get(location).await?.bytes().await }
        .await
        .map_err(|source| ArchiveError::Store {
            what: "reading",
            key: key.to_owned(),
            source,
        })?;
    let decompressed =
        zstd::stream::decode_all(stored.as_ref()).map_err(|_| ArchiveError::Different {
            key: key.to_owned(),
            file: name.to_owned(),
        })?;
    if decompressed == raw {
        Ok(())
    } else {
        Err(ArchiveError::Different {
            key: key.to_owned(),
            file: name.to_owned(),
        })
    }
}

/// Serves the archive socket: one request per connection, `archive <path>\n` or
/// `restore <file> <dest>\n`, answered `ok\n`, `missing\n` (restore only) or
/// `error <message>\n`.
pub async fn serve(listener: UnixListener, archive: Arc<Archive>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection on the archive socket");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let archive = archive.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let request = line.trim_end();
            let answer = match request.split_once(' ') {
                Some(("archive", file)) => match archive.archive(Path::new(file)).await {
                    Ok(()) => "ok\n".to_owned(),
                    Err(error) => format!("error {error}\n"),
                },
                Some(("restore", rest)) => match rest.split_once(' ') {
                    Some((file, dest)) => match archive.restore(file, Path::new(dest)).await {
                        Ok(true) => "ok\n".to_owned(),
                        Ok(false) => "missing\n".to_owned(),
                        // Replaying a source, a file that cannot be read must stop the
                        // recovery rather than end it as if the archive ended there.
                        Err(error) if archive.replaying_source() => format!("fatal {error}\n"),
                        Err(error) => format!("error {error}\n"),
                    },
                    None => format!("error malformed request {request:?}\n"),
                },
                _ => format!("error unknown request {request:?}\n"),
            };
            let _ = write.write_all(answer.as_bytes()).await;
        });
    }
}

/// Sends one request line to the manager behind `socket` and returns its answer.
async fn ask(socket: &Path, request: &str) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let stream = UnixStream::connect(socket).await.with_context(|| {
        format!(
            "connecting to the instance manager's archive socket {}",
            socket.display()
        )
    })?;
    let (read, mut write) = stream.into_split();
    write
        .write_all(format!("{request}\n").as_bytes())
        .await
        .context("sending the request to the instance manager")?;
    let mut answer = String::new();
    BufReader::new(read)
        .read_line(&mut answer)
        .await
        .context("reading the instance manager's answer")?;
    Ok(answer.trim_end().to_owned())
}

/// `castellan wal-archive`: asks the manager behind `socket` to archive `file`, and
/// fails (so that PostgreSQL keeps the file and asks again) unless it says it did.
pub async fn request(socket: &Path, file: &Path) -> anyhow::Result<()> {
    match ask(socket, &format!("archive {}", file.display()))
        .await?
        .as_str()
    {
        "ok" => Ok(()),
        other => anyhow::bail!(
            "the instance manager did not archive {}: {}",
            file.display(),
            other.strip_prefix("error ").unwrap_or(other)
        ),
    }
}

/// `castellan wal-restore`: asks the manager behind `socket` to fetch WAL file `file`
/// from the archive into `dest`. Fails when it is not there (PostgreSQL then reads
/// `pg_wal` or streams), or could not be fetched.
pub async fn request_restore(socket: &Path, file: &str, dest: &Path) -> anyhow::Result<()> {
    match ask(socket, &format!("restore {file} {}", dest.display()))
        .await?
        .as_str()
    {
        "ok" => Ok(()),
        "missing" => anyhow::bail!("{file} is not in the archive"),
        // PostgreSQL aborts a recovery whose restore_command exits above 125.
        fatal if fatal.starts_with("fatal ") => {
            eprintln!(
                "castellan wal-restore: {file} could not be read from the archive: {}; stopping the recovery",
                &fatal[6..]
            );
            std::process::exit(255)
        }
        other => anyhow::bail!(
            "the instance manager did not restore {file}: {}",
            other.strip_prefix("error ").unwrap_or(other)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_filed_by_timeline_and_log() {
        for (prefix, file, key) in [
            (
                "ns/shop",
                "000000010000000000000003",
                "ns/shop/73/wals/0000000100000000/000000010000000000000003.zst",
            ),
            (
                "ns/shop",
                "000000020000000100000003.partial",
                "ns/shop/73/wals/0000000200000001/000000020000000100000003.partial.zst",
            ),
            (
                "ns/shop",
                "00000002.history",
                "ns/shop/73/wals/00000002.history.zst",
            ),
            ("", "00000002.history", "73/wals/00000002.history.zst"),
        ] {
            assert_eq!(wal_key(prefix, "73", file), key);
        }
    }

    #[test]
    fn only_24_hex_digits_make_a_segment() {
        assert!(is_segment("000000010000000000000003"));
        assert!(!is_segment("00000002.history"));
        assert!(!is_segment("00000001000000000000000G"));
    }

    #[test]
    fn waiting_files_come_oldest_first() {
        let dir = std::env::temp_dir().join(format!("castellan-archive-{}", std::process::id()));
        let status = dir.join("archive_status");
        std::fs::create_dir_all(&status).expect("temp dir");
        for name in [
            "000000010000000000000005.ready",
            "000000010000000000000004.ready",
            "000000010000000000000003.done",
        ] {
            std::fs::write(status.join(name), "").expect("status file");
        }
        assert_eq!(
            waiting(&dir),
            vec!["000000010000000000000004", "000000010000000000000005"]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failure_after_the_last_success_is_failing() {
        let mut report = ArchiveReport::default();
        assert!(!report.failing());
        report.last_failed_ms = Some(10);
        assert!(report.failing());
        report.last_archived_ms = Some(11);
        assert!(!report.failing());
    }

    #[test]
    fn failures_carry_the_causes_their_message_leaves_out() {
        #[derive(Debug, thiserror::Error)]
        #[error("error sending request")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other(
            "invalid peer certificate: UnknownIssuer",
        ));
        assert_eq!(
            with_causes(&error),
            "error sending request: invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    fn fingerprints_change_with_the_credentials_only_in_hash() {
        let target = |secret: &str| ArchiveTarget {
            endpoint: "http://127.0.0.1:9000".into(),
            bucket: "castellan".into(),
            prefix: "ns/shop".into(),
            region: None,
            access_key_id: "id".into(),
            secret_access_key: secret.into(),
            ca_bundle: None,
        };
        let a = ArchiveConfig::new(Some(target("s3cr3t-a")));
        let b = ArchiveConfig::new(Some(target("s3cr3t-b")));
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_eq!(a.fingerprint.len(), 16);
        assert!(!format!("{a:?}").contains("s3cr3t"), "no secret in logs");
        assert_eq!(ArchiveConfig::new(None).fingerprint, "off");
    }
}
