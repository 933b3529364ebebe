//! Restoring a base backup into an empty data directory: its manifest is read first
//! (only a completed backup has one, and it says how the tar is compressed), then the
//! tar is streamed from the object store and unpacked as it arrives, with no copy of
//! the archive on disk. The WAL replay that follows is PostgreSQL's, with
//! `restore_command` reading the source cluster's archive (`archive::Archive::read_from`).

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::sync::mpsc;

use super::archive;
use super::backup::{backup_key, data_key, read_manifest};
use crate::instance_api::{BackupPhase, BackupReport, RestoreRequest};
use castellan_crds::database_cluster::Compression;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{what} {key} in the object store: {source}")]
    Store {
        what: &'static str,
        key: String,
        source: object_store::Error,
    },
    #[error("unpacking the backup into {path}: {source}")]
    Unpack {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Archive(#[from] archive::ArchiveError),
}

/// Fetches and unpacks the backup `request` names into `data_dir`; `read` counts the
/// compressed bytes received. Returns the backup's manifest.
pub async fn unpack(
    request: &RestoreRequest,
    data_dir: &Path,
    read: Arc<AtomicU64>,
) -> Result<BackupReport, RestoreError> {
    let store: Arc<dyn ObjectStore> = Arc::new(archive::s3_store(&request.source)?);
    let prefix = request.source.prefix.trim_matches('/');
    let key = backup_key(prefix, &request.system_id, &request.backup_id);
    let manifest = read_manifest(
        store.as_ref(),
        prefix,
        &request.system_id,
        &request.backup_id,
    )
    .await
    .map_err(RestoreError::Refused)?
    .ok_or_else(|| {
        RestoreError::Refused(format!(
            "backup {} has no manifest under {key}: it never completed and is not restored",
            request.backup_id
        ))
    })?;
    if manifest.phase != BackupPhase::Completed {
        return Err(RestoreError::Refused(format!(
            "the manifest under {key} does not say the backup completed"
        )));
    }

    let compression = manifest.compression;
    let data_key = data_key(&key, compression);
    let stream = store
        .get(&ObjectPath::from(data_key.as_str()))
        .await
        .map_err(|source| RestoreError::Store {
            what: "reading",
            key: data_key.clone(),
            source,
        })?
        .into_stream();
    let (sender, receiver) = mpsc::channel::<Result<Bytes, String>>(4);
    let unpacking = tokio::task::spawn_blocking({
        let data_dir = data_dir.to_path_buf();
        move || {
            let reader = Received {
                receiver,
                current: Bytes::new(),
            };
            unpack_tar(reader, compression, &data_dir)
        }
    });
    let feeding = async {
        let mut stream = stream;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string());
            if let Ok(bytes) = &chunk {
                read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            let failed = chunk.is_err();
            if sender.send(chunk).await.is_err() || failed {
                break;
            }
        }
        drop(sender);
    };
    let ((), unpacked) = tokio::join!(feeding, unpacking);
    let path = data_dir.display().to_string();
    unpacked
        .map_err(|e| RestoreError::Refused(format!("the unpacking thread failed: {e}")))?
        .map_err(|source| RestoreError::Unpack { path, source })?;
    if !data_dir.join("backup_label").exists() {
        return Err(RestoreError::Refused(format!(
            "{data_key} holds no backup_label: it is not a complete base backup"
        )));
    }
    Ok(manifest)
}

/// Unpacks the backup's tar, stored as `compression` says, from `reader` into
/// `data_dir`.
pub(super) fn unpack_tar(
    reader: impl Read,
    compression: Compression,
    data_dir: &Path,
) -> std::io::Result<()> {
    let unpacked: Box<dyn Read> = match compression {
        Compression::Zstd => Box::new(zstd::Decoder::new(reader)?),
        Compression::None => Box::new(reader),
    };
    let mut tar = tar::Archive::new(unpacked);
    tar.set_preserve_permissions(true);
    tar.set_overwrite(false);
    for entry in tar.entries()? {
        // unpack_in refuses paths that leave the directory.
        entry?.unpack_in(data_dir)?;
    }
    Ok(())
}

/// A `Read` over the chunks the download sends; an error in the download is an error
/// here, so a cut stream never passes for the end of the archive.
struct Received {
    receiver: mpsc::Receiver<Result<Bytes, String>>,
    current: Bytes,
}

impl Read for Received {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.receiver.blocking_recv() {
                Some(Ok(bytes)) => self.current = bytes,
                Some(Err(error)) => return Err(std::io::Error::other(error)),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current = self.current.slice(n..);
        Ok(n)
    }
}
