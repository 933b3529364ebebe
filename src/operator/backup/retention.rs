//! The cluster's `spec.backup.retention`: which base backups stay in the object store,
//! and the WAL only the removed ones needed. A schedule's retention is about the
//! `Backup` objects it made, not the data (`docs/backups.md`).
//!
//! A completed backup is removed when it falls outside every limit given (not among the
//! newest `keepLast`, older than `maxAge`); the newest completed backup never is. WAL
//! is removed only below the start of the oldest backup kept, so every kept backup can
//! still be restored to any point after it. An upload with no manifest (a backup that
//! failed) is removed once it is a day old and older than the oldest kept backup.

use std::time::Duration;

use castellan_crds::retention::Retention;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use crate::instance::archive::is_segment;
use crate::instance_api::{ArchiveTarget, BackupPhase, BackupReport};

/// How old an upload without a manifest must be before it counts as abandoned.
const ABANDONED_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The ids of the completed backups to remove, of `manifests` (one cluster's), at
/// `now_ms`.
pub fn expired(manifests: &[BackupReport], retention: &Retention, now_ms: u64) -> Vec<String> {
    let keep_last = retention.keep_last.and_then(|k| usize::try_from(k).ok());
    let max_age = match retention.max_age() {
        None => None,
        Some(Ok(age)) => Some(age),
        // Unreadable (admission refuses it): remove nothing rather than guess.
        Some(Err(_)) => return Vec::new(),
    };
    if keep_last.is_none() && max_age.is_none() {
        return Vec::new();
    }
    let mut completed: Vec<&BackupReport> = manifests
        .iter()
        .filter(|m| m.phase == BackupPhase::Completed)
        .collect();
    // Newest first.
    completed.sort_by_key(|m| std::cmp::Reverse(m.consistent_ms));
    completed
        .iter()
        .enumerate()
        .skip(1) // The newest is never removed.
        .filter(|(index, _)| keep_last.is_none_or(|k| *index >= k))
        .filter(|(_, m)| {
            max_age.is_none_or(|age| {
                let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                m.consistent_ms.unwrap_or(0).saturating_add(age_ms) < now_ms
            })
        })
        .map(|(_, m)| m.id.clone())
        .collect()
}

/// The position (log and segment, without the timeline) a WAL file name starts at.
fn position(file: &str) -> Option<&str> {
    let segment = file.split('.').next()?;
    is_segment(segment).then(|| &segment[8..])
}

/// The WAL objects below `oldest_begin` (the first segment of the oldest kept backup),
/// on every timeline; history files are kept.
pub fn wal_below<'a>(objects: &'a [ObjectMeta], oldest_begin: &str) -> Vec<&'a ObjectMeta> {
    let Some(limit) = position(oldest_begin) else {
        return Vec::new();
    };
    objects
        .iter()
        .filter(|o| {
            o.location
                .filename()
                .map(|name| name.trim_end_matches(".zst"))
                .and_then(position)
                .is_some_and(|p| p < limit)
        })
        .collect()
}

/// What a sweep removed, for the Event and status.
#[derive(Debug, Default, PartialEq)]
pub struct Swept {
    pub backups: Vec<String>,
    pub wal_files: usize,
    pub abandoned: usize,
    /// The consistent point of the oldest backup kept.
    pub first_recoverability_ms: Option<u64>,
}

/// Applies `retention` to the backups and WAL of every system identifier under the
/// target's prefix.
pub async fn sweep(
    target: &ArchiveTarget,
    retention: &Retention,
    now_ms: u64,
) -> Result<Swept, String> {
    use futures::TryStreamExt;
    let store = crate::instance::archive::s3_store(target).map_err(|e| e.to_string())?;
    let root = ObjectPath::from(target.prefix.as_str());
    let systems = store
        .list_with_delimiter(Some(&root))
        .await
        .map_err(|e| format!("listing {root}: {e}"))?;
    let mut swept = Swept::default();
    for system in systems.common_prefixes {
        let base = ObjectPath::from(format!("{system}/base"));
        let objects: Vec<ObjectMeta> = store
            .list(Some(&base))
            .try_collect()
            .await
            .map_err(|e| format!("listing {base}: {e}"))?;
        let mut manifests = Vec::new();
        for manifest in objects
            .iter()
            .filter(|o| o.location.filename() == Some("backup.json"))
        {
            let bytes = async { store.get(&manifest.location).await?.bytes().await }
                .await
                .map_err(|e| format!("reading {}: {e}", manifest.location))?;
            if let Ok(report) = serde_json::from_slice::<BackupReport>(&bytes) {
                manifests.push(report);
            }
        }
        let removed = expired(&manifests, retention, now_ms);
        let kept: Vec<&BackupReport> = manifests
            .iter()
            .filter(|m| m.phase == BackupPhase::Completed && !removed.contains(&m.id))
            .collect();
        let oldest = kept.iter().min_by_key(|m| m.consistent_ms);
        if let Some(oldest) = oldest {
            let at = oldest.consistent_ms;
            swept.first_recoverability_ms = match (swept.first_recoverability_ms, at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        let folder_of = |o: &ObjectMeta| {
            o.location
                .parts()
                .nth_back(1)
                .map(|p| p.as_ref().to_owned())
        };
        let has_manifest = |id: &str| manifests.iter().any(|m| m.id == id);
        let oldest_ms = oldest.and_then(|m| m.consistent_ms).unwrap_or(0);
        let mut doomed: Vec<ObjectPath> = Vec::new();
        for object in &objects {
            let Some(id) = folder_of(object) else {
                continue;
            };
            let modified = u64::try_from(object.last_modified.timestamp_millis()).unwrap_or(0);
            let abandoned = !has_manifest(&id)
                && modified + u64::try_from(ABANDONED_AFTER.as_millis()).unwrap_or(0) < now_ms
                && modified < oldest_ms;
            if removed.contains(&id) || abandoned {
                doomed.push(object.location.clone());
                if abandoned {
                    swept.abandoned += 1;
                }
            }
        }
        // The data first, the manifest last: a half-removed backup is never restored.
        doomed.sort_by_key(|p| p.filename() == Some("backup.json"));
        for location in doomed {
            store
                .delete(&location)
                .await
                .map_err(|e| format!("removing {location}: {e}"))?;
        }
        swept.backups.extend(removed);
        if let Some(oldest) = oldest.and_then(|m| m.begin_wal.clone()) {
            let wals = ObjectPath::from(format!("{system}/wals"));
            let objects: Vec<ObjectMeta> = store
                .list(Some(&wals))
                .try_collect()
                .await
                .map_err(|e| format!("listing {wals}: {e}"))?;
            for object in wal_below(&objects, &oldest) {
                store
                    .delete(&object.location)
                    .await
                    .map_err(|e| format!("removing {}: {e}", object.location))?;
                swept.wal_files += 1;
            }
        }
    }
    Ok(swept)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3_600_000;

    fn completed(id: &str, at_hours: u64) -> BackupReport {
        BackupReport {
            id: id.into(),
            phase: BackupPhase::Completed,
            consistent_ms: Some(at_hours * HOUR),
            ..BackupReport::default()
        }
    }

    fn retention(keep_last: Option<i32>, max_age: Option<&str>) -> Retention {
        Retention {
            keep_last,
            max_age: max_age.map(str::to_owned),
        }
    }

    #[test]
    fn an_unreadable_age_removes_nothing() {
        let all = vec![completed("a", 1), completed("b", 2), completed("c", 3)];
        assert!(expired(&all, &retention(Some(1), Some("5m")), 1000 * HOUR).is_empty());
    }

    #[test]
    fn keep_last_removes_all_but_the_newest_n() {
        let all = vec![completed("a", 1), completed("c", 3), completed("b", 2)];
        assert_eq!(
            expired(&all, &retention(Some(2), None), 10 * HOUR),
            vec!["a"]
        );
        assert_eq!(
            expired(&all, &retention(Some(1), None), 10 * HOUR),
            vec!["b", "a"]
        );
    }

    #[test]
    fn a_backup_goes_only_outside_every_limit_given() {
        let all = vec![completed("a", 1), completed("b", 2), completed("c", 30)];
        // Older than a day and not among the newest two: only a.
        assert_eq!(
            expired(&all, &retention(Some(2), Some("1d")), 31 * HOUR),
            vec!["a"]
        );
        // Age alone: a and b are older than 24h at hour 31.
        assert_eq!(
            expired(&all, &retention(None, Some("24h")), 31 * HOUR),
            vec!["b", "a"]
        );
    }

    #[test]
    fn the_newest_backup_and_unfinished_ones_are_never_removed() {
        let mut failed = completed("f", 0);
        failed.phase = BackupPhase::Failed;
        let all = vec![completed("only", 1), failed];
        assert!(expired(&all, &retention(None, Some("1h")), 1000 * HOUR).is_empty());
        assert!(expired(&all, &retention(None, None), 1000 * HOUR).is_empty());
    }

    #[test]
    fn wal_below_the_oldest_kept_backup_goes_on_every_timeline_history_stays() {
        let meta = |key: &str| ObjectMeta {
            location: ObjectPath::from(key),
            last_modified: chrono::DateTime::from_timestamp(0, 0).expect("a time"),
            size: 1,
            e_tag: None,
            version: None,
        };
        let objects = vec![
            meta("p/7/wals/0000000100000000/000000010000000000000002.zst"),
            meta("p/7/wals/0000000100000000/000000010000000000000005.zst"),
            meta("p/7/wals/0000000200000000/000000020000000000000004.partial.zst"),
            meta("p/7/wals/0000000200000000/000000020000000000000006.zst"),
            meta("p/7/wals/00000002.history.zst"),
        ];
        let gone: Vec<String> = wal_below(&objects, "000000020000000000000005")
            .iter()
            .map(|o| o.location.to_string())
            .collect();
        assert_eq!(
            gone,
            vec![
                "p/7/wals/0000000100000000/000000010000000000000002.zst",
                "p/7/wals/0000000200000000/000000020000000000000004.partial.zst",
            ]
        );
    }
}
