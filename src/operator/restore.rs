//! What a cluster with `bootstrap.recovery` restores: the backup (a completed `Backup`
//! of its namespace, or the newest suitable one in an object-store location), where its
//! WAL is, and whether the target lies in what the archive covers. A target outside it
//! is refused with the covered range, before any instance touches anything.

use castellan_crds::database_cluster::Recovery;
use castellan_crds::{Backup, DatabaseCluster};
use futures::TryStreamExt;
use kube::{Api, Client, ResourceExt};
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;

use super::backup::machine::{COMPLETED, rfc3339};
use super::object_store::target;
use crate::instance::archive::s3_store;
use crate::instance::backup::read_manifest;
use crate::instance_api::{ArchiveTarget, BackupPhase, BackupReport, Lsn, RestoreRequest};

/// The restore for `cluster`'s first instance, or why it cannot go ahead yet; `None`
/// without `bootstrap.recovery`.
pub async fn request(
    client: &Client,
    cluster: &DatabaseCluster,
) -> Option<Result<RestoreRequest, String>> {
    let recovery = cluster.spec.bootstrap.as_ref()?.recovery.as_ref()?;
    Some(resolve(client, cluster, recovery).await)
}

async fn resolve(
    client: &Client,
    cluster: &DatabaseCluster,
    recovery: &Recovery,
) -> Result<RestoreRequest, String> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let (source, manifests) = match (&recovery.backup, &recovery.source) {
        (Some(name), _) => from_backup(client, cluster, &namespace, name).await?,
        (None, Some(location)) => {
            let prefix = location.path.clone().unwrap_or_default();
            let source = target(
                client,
                &namespace,
                location,
                prefix.trim_matches('/').to_owned(),
            )
            .await?;
            let manifests = manifests_in(&source).await?;
            (source, manifests)
        }
        (None, None) => return Err("bootstrap.recovery names no backup and no source".to_owned()),
    };
    let target_time = match &recovery.target_time {
        Some(time) => Some(
            time.parse::<k8s_openapi::jiff::Timestamp>()
                .map_err(|e| format!("bootstrap.recovery.targetTime {time} is not a time: {e}"))?,
        ),
        None => None,
    };
    let target_ms = target_time.map(|t| t.as_millisecond());
    let target_lsn = match &recovery.target_lsn {
        Some(lsn) => Some(
            Lsn::parse(lsn)
                .ok_or_else(|| format!("bootstrap.recovery.targetLsn {lsn} is not an LSN"))?,
        ),
        None => None,
    };
    let Some(chosen) = choose(&manifests, target_ms, target_lsn) else {
        return Err(
            match manifests.iter().filter_map(|m| m.consistent_ms).min() {
                None => format!(
                    "no completed base backup under s3://{}/{}",
                    source.bucket, source.prefix
                ),
                Some(first) => format!(
                    "the target is before the earliest backup: the archive under s3://{}/{} covers from {}",
                    source.bucket,
                    source.prefix,
                    rfc3339(first)
                ),
            },
        );
    };
    let system_id = chosen
        .system_id
        .clone()
        .ok_or("the backup's manifest has no system identifier")?;
    if let Some(target_ms) = target_ms {
        let end = archive_end_ms(&source, &system_id).await?;
        let begin = chosen.consistent_ms.unwrap_or_default();
        within(target_ms, begin, end)?;
    }
    Ok(RestoreRequest {
        source,
        system_id,
        backup_id: chosen.id.clone(),
        // In UTC, as PostgreSQL reads it (it takes no `T` or `Z`).
        target_time: target_time.map(|t| t.strftime("%Y-%m-%d %H:%M:%S%.f+00").to_string()),
        target_lsn: recovery.target_lsn.clone(),
        verify: false,
    })
}

/// A `Backup` of this namespace: its object store (the source cluster's, or this
/// cluster's when that one is gone) and its manifest.
async fn from_backup(
    client: &Client,
    cluster: &DatabaseCluster,
    namespace: &str,
    name: &str,
) -> Result<(ArchiveTarget, Vec<BackupReport>), String> {
    let backups: Api<Backup> = Api::namespaced(client.clone(), namespace);
    let backup = backups
        .get_opt(name)
        .await
        .map_err(|e| format!("reading Backup {name}: {e}"))?
        .ok_or_else(|| format!("Backup {name} does not exist in {namespace}"))?;
    let status = backup.status.clone().unwrap_or_default();
    if status.phase.as_deref() != Some(COMPLETED) {
        return Err(format!(
            "Backup {name} is {}, not Completed: only a completed backup is restored",
            status.phase.as_deref().unwrap_or("not started")
        ));
    }
    let location = status
        .location
        .as_deref()
        .ok_or_else(|| format!("Backup {name} has no location"))?;
    let (bucket, prefix) = parse_location(location)
        .ok_or_else(|| format!("Backup {name}'s location {location} is not s3://<bucket>/<prefix>/<system id>/base/<id>/"))?;
    let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), namespace);
    let source_cluster = clusters
        .get_opt(&backup.spec.cluster)
        .await
        .map_err(|e| format!("reading DatabaseCluster {}: {e}", backup.spec.cluster))?;
    let store = source_cluster
        .as_ref()
        .filter(|c| c.name_any() != cluster.name_any())
        .and_then(|c| c.spec.backup.clone())
        .or_else(|| cluster.spec.backup.clone())
        .ok_or_else(|| {
            format!(
                "Backup {name}'s cluster {} is gone and this cluster has no spec.backup: \
                 nothing says how to reach s3://{bucket}",
                backup.spec.cluster
            )
        })?;
    let mut source = target(client, namespace, &store, prefix).await?;
    source.bucket = bucket;
    let id = status.backup_id.unwrap_or_default();
    let system_id = status.system_identifier.unwrap_or_default();
    let manifest = read_manifest(&s3(&source)?, &source.prefix, &system_id, &id)
        .await?
        .ok_or_else(|| {
            format!("Backup {name} has no manifest under {location}: it is not restorable")
        })?;
    Ok((source, vec![manifest]))
}

fn s3(source: &ArchiveTarget) -> Result<object_store::aws::AmazonS3, String> {
    s3_store(source).map_err(|e| e.to_string())
}

/// `s3://bucket/<prefix>/<system id>/base/<id>/` → (bucket, prefix).
fn parse_location(location: &str) -> Option<(String, String)> {
    let rest = location.strip_prefix("s3://")?.trim_end_matches('/');
    let (bucket, key) = rest.split_once('/')?;
    let (before, _id) = key.rsplit_once("/base/")?;
    let (prefix, _system_id) = before.rsplit_once('/').unwrap_or(("", before));
    Some((bucket.to_owned(), prefix.to_owned()))
}

/// Every completed backup's manifest under the location, whatever cluster (system
/// identifier) archived there.
async fn manifests_in(source: &ArchiveTarget) -> Result<Vec<BackupReport>, String> {
    let store = s3(source)?;
    let root = ObjectPath::from(source.prefix.as_str());
    let systems = store
        .list_with_delimiter(Some(&root))
        .await
        .map_err(|e| format!("listing s3://{}/{}: {e}", source.bucket, source.prefix))?;
    let mut manifests = Vec::new();
    for system in systems.common_prefixes {
        let Some(system_id) = system.filename().map(str::to_owned) else {
            continue;
        };
        let base = ObjectPath::from(format!("{system}/base"));
        let backups = store
            .list_with_delimiter(Some(&base))
            .await
            .map_err(|e| format!("listing {base}: {e}"))?;
        for backup in backups.common_prefixes {
            let Some(id) = backup.filename() else {
                continue;
            };
            if let Some(manifest) = read_manifest(&store, &source.prefix, &system_id, id).await? {
                manifests.push(manifest);
            }
        }
    }
    Ok(manifests)
}

/// The newest completed backup that is consistent before the target.
fn choose(
    manifests: &[BackupReport],
    target_ms: Option<i64>,
    target_lsn: Option<Lsn>,
) -> Option<&BackupReport> {
    manifests
        .iter()
        .filter(|m| m.phase == BackupPhase::Completed)
        .filter(|m| match target_ms {
            Some(target) => m
                .consistent_ms
                .is_some_and(|c| i64::try_from(c).unwrap_or(i64::MAX) <= target),
            None => true,
        })
        .filter(|m| match target_lsn {
            Some(target) => m
                .end_lsn
                .as_deref()
                .and_then(Lsn::parse)
                .is_some_and(|end| end <= target),
            None => true,
        })
        .max_by_key(|m| m.consistent_ms)
}

/// When the newest archived WAL file of `system_id` was stored: the latest moment a
/// restore can reach.
async fn archive_end_ms(source: &ArchiveTarget, system_id: &str) -> Result<i64, String> {
    let store = s3(source)?;
    let wals = ObjectPath::from(format!("{}/{system_id}/wals", source.prefix));
    let listed: Vec<object_store::ObjectMeta> = store
        .list(Some(&wals))
        .try_collect()
        .await
        .map_err(|e| format!("listing {wals}: {e}"))?;
    listed
        .iter()
        .map(|o| o.last_modified.timestamp_millis())
        .max()
        .ok_or_else(|| format!("no archived WAL under {wals}"))
}

/// A target time must lie between the backup's consistent point and the last WAL
/// archived; the message names the range.
fn within(target_ms: i64, begin_ms: u64, end_ms: i64) -> Result<(), String> {
    let begin = i64::try_from(begin_ms).unwrap_or(i64::MAX);
    if target_ms < begin || target_ms > end_ms {
        return Err(format!(
            "bootstrap.recovery.targetTime {} is outside what the archive covers: from {} to {}",
            rfc3339(u64::try_from(target_ms).unwrap_or(0)),
            rfc3339(begin_ms),
            rfc3339(u64::try_from(end_ms).unwrap_or(0)),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(id: &str, consistent_ms: u64, end_lsn: &str) -> BackupReport {
        BackupReport {
            id: id.into(),
            phase: BackupPhase::Completed,
            consistent_ms: Some(consistent_ms),
            end_lsn: Some(end_lsn.into()),
            ..BackupReport::default()
        }
    }

    #[test]
    fn target_times_are_written_as_postgresql_reads_them() {
        let t: k8s_openapi::jiff::Timestamp =
            "2026-12-02T04:47:16.147678+02:00".parse().expect("a time");
        assert_eq!(
            t.strftime("%Y-%m-%d %H:%M:%S%.f+00").to_string(),
            "2026-12-02 02:47:16.147678+00"
        );
    }

    #[test]
    fn locations_give_bucket_and_prefix() {
        assert_eq!(
            parse_location("s3://castellan/sales/shop/7714/base/first-0a1b/"),
            Some(("castellan".into(), "sales/shop".into()))
        );
        assert_eq!(
            parse_location("s3://b/7714/base/x/"),
            Some(("b".into(), String::new()))
        );
        assert_eq!(parse_location("https://b/x"), None);
    }

    #[test]
    fn the_newest_backup_before_the_target_is_chosen() {
        let mut failed = manifest("failed", 5000, "0/9000000");
        failed.phase = BackupPhase::Failed;
        let all = vec![
            manifest("old", 1000, "0/3000000"),
            manifest("new", 3000, "0/7000000"),
            failed,
        ];
        assert_eq!(choose(&all, None, None).map(|m| m.id.as_str()), Some("new"));
        assert_eq!(
            choose(&all, Some(2000), None).map(|m| m.id.as_str()),
            Some("old")
        );
        assert_eq!(
            choose(&all, None, Lsn::parse("0/5000000")).map(|m| m.id.as_str()),
            Some("old")
        );
        assert_eq!(choose(&all, Some(500), None), None);
    }

    #[test]
    fn a_target_outside_the_archive_is_refused_with_the_range() {
        assert!(within(1500, 1000, 2000).is_ok());
        let early = within(500, 1_796_180_400_000, 1_796_184_000_000).expect_err("too early");
        assert!(
            early.contains("from 2026-12-02T03:00:00Z to 2026-12-02T04:00:00Z"),
            "{early}"
        );
        assert!(within(2001, 1000, 2000).is_err());
    }
}
