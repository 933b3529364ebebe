//! A `Backup`'s machine, pure: from what is observed (the Backup, its cluster, the
//! instance taking it and that instance's report) to the next status and the one
//! thing to do. `Pending` → `Running` → `Completed` | `Failed`; the last two are final.
//!
//! Safety first: a backup is `Completed` only from a report or a manifest that says so
//! (the manifest is written last, after the WAL the copy needs is archived), and a
//! `Running` backup whose instance manager no longer knows it (restarted) is `Failed`,
//! never left running nor guessed done.

use std::time::Duration;

use castellan_crds::{Backup, BackupStatus, DatabaseCluster};
use kube::ResourceExt;

use crate::instance_api::{BackupPhase, BackupReport};

pub const PENDING: &str = "Pending";
pub const RUNNING: &str = "Running";
pub const COMPLETED: &str = "Completed";
pub const FAILED: &str = "Failed";

/// How often a running backup is polled, and a pending one looked at again.
pub const POLL: Duration = Duration::from_secs(2);
pub const RETRY: Duration = Duration::from_secs(10);

/// The instance chosen to take a backup.
#[derive(Clone, Debug, PartialEq)]
pub struct Chosen {
    pub instance: String,
    pub from_standby: bool,
}

/// What the shell saw of the instance taking a running backup.
#[derive(Clone, Debug, PartialEq)]
pub enum Observed {
    Report(Box<BackupReport>),
    /// The instance manager answers but does not know the backup: it restarted.
    Unknown,
    /// The pod is gone.
    Gone,
    /// No answer (yet): the error.
    Unreachable(String),
}

/// The one thing to do after writing the status.
#[derive(Clone, Debug, PartialEq)]
pub enum Act {
    Nothing,
    /// Ask `instance` to start backup `id`; from a replica, after asking the primary
    /// for a checkpoint for it to begin at (the replica's last restartpoint may be
    /// older than archiving, whose WAL was never archived).
    Start {
        instance: String,
        id: String,
        checkpoint_first: bool,
    },
    /// Ask the primary to close its WAL segment, so the replica's backup completes.
    SwitchWal,
    /// Look for the manifest in the object store before calling the backup failed.
    CheckManifest,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub status: BackupStatus,
    pub act: Act,
    /// Check again after this; `None` once final.
    pub requeue: Option<Duration>,
    /// An Event to record: warning?, reason, message.
    pub event: Option<(bool, &'static str, String)>,
}

/// The backup's id in the object store: its name and the first part of its uid, so
/// that a re-created Backup of the same name never meets the old one's objects.
pub fn backup_id(backup: &Backup) -> String {
    let uid = backup.metadata.uid.as_deref().unwrap_or("");
    let short: String = uid
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(8)
        .collect();
    let name: String = backup
        .name_any()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("{name}-{short}")
}

/// The instance to back up from: the healthiest ready replica (least lag), else the
/// ready primary. Fenced instances are never chosen.
pub fn choose(cluster: &DatabaseCluster) -> Option<Chosen> {
    let status = cluster.status.as_ref()?;
    let ready = status.instances.iter().filter(|i| i.ready && !i.fenced);
    let replica = ready
        .clone()
        .filter(|i| i.role.as_deref() == Some("replica"))
        .min_by_key(|i| (i.lag_bytes.unwrap_or(i64::MAX), i.name.clone()));
    if let Some(replica) = replica {
        return Some(Chosen {
            instance: replica.name.clone(),
            from_standby: true,
        });
    }
    ready
        .filter(|i| i.role.as_deref() == Some("primary"))
        .find(|i| status.current_primary.as_deref() == Some(i.name.as_str()))
        .map(|i| Chosen {
            instance: i.name.clone(),
            from_standby: false,
        })
}

fn archiving(cluster: &DatabaseCluster) -> Result<(), String> {
    let condition = cluster.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == "ContinuousArchiving")
    });
    match condition {
        Some(c) if c.status == "True" => Ok(()),
        Some(c) => Err(format!(
            "waiting for WAL archiving to work (a base backup without its WAL cannot be restored): {}",
            c.message
        )),
        None => Err("waiting for WAL archiving to start".to_owned()),
    }
}

fn with(status: &BackupStatus, change: impl FnOnce(&mut BackupStatus)) -> BackupStatus {
    let mut status = status.clone();
    change(&mut status);
    status
}

fn fail(status: &BackupStatus, now: &str, error: String) -> Decision {
    Decision {
        status: with(status, |s| {
            s.phase = Some(FAILED.to_owned());
            s.stopped_at.get_or_insert_with(|| now.to_owned());
            s.error = Some(error.clone());
            s.progress_percent = None;
        }),
        act: Act::Nothing,
        requeue: None,
        event: Some((true, "BackupFailed", error)),
    }
}

fn pending(status: &BackupStatus, why: String) -> Decision {
    Decision {
        status: with(status, |s| {
            s.phase = Some(PENDING.to_owned());
            s.error = Some(why);
        }),
        act: Act::Nothing,
        requeue: Some(RETRY),
        event: None,
    }
}

/// A backup not yet running: start it on the chosen instance, or say why not.
pub fn start(backup: &Backup, cluster: Option<&DatabaseCluster>, now: &str) -> Decision {
    let status = backup.status.clone().unwrap_or_default();
    let Some(cluster) = cluster else {
        return pending(
            &status,
            format!("DatabaseCluster {} does not exist", backup.spec.cluster),
        );
    };
    if cluster.spec.backup.is_none() {
        return fail(
            &status,
            now,
            format!(
                "DatabaseCluster {} has no spec.backup: there is no object store to back it up to",
                backup.spec.cluster
            ),
        );
    }
    if let Err(why) = archiving(cluster) {
        return pending(&status, why);
    }
    let Some(chosen) = choose(cluster) else {
        return pending(
            &status,
            "no instance of the cluster is ready to back up from".to_owned(),
        );
    };
    let id = backup_id(backup);
    Decision {
        status: with(&status, |s| {
            s.phase = Some(RUNNING.to_owned());
            s.instance = Some(chosen.instance.clone());
            s.backup_id = Some(id.clone());
            s.started_at = Some(now.to_owned());
            s.progress_percent = Some(0);
            s.error = None;
        }),
        act: Act::Start {
            instance: chosen.instance.clone(),
            id,
            checkpoint_first: chosen.from_standby,
        },
        requeue: Some(POLL),
        event: Some((
            false,
            "BackupStarted",
            format!(
                "taking a base backup from {} ({})",
                chosen.instance,
                if chosen.from_standby {
                    "a replica"
                } else {
                    "the primary: no replica is ready"
                }
            ),
        )),
    }
}

/// Copies what a report says into the status.
pub fn from_report(
    status: &BackupStatus,
    report: &BackupReport,
    location: Option<String>,
) -> BackupStatus {
    with(status, |s| {
        s.progress_percent = Some(report.progress_percent());
        s.data_bytes = i64::try_from(report.bytes_read).ok();
        s.size_bytes = i64::try_from(report.bytes_stored).ok().filter(|b| *b > 0);
        s.size = s.size_bytes.map(human_size);
        s.begin_lsn = report.begin_lsn.clone().or(s.begin_lsn.take());
        s.end_lsn = report.end_lsn.clone();
        s.begin_wal = report.begin_wal.clone();
        s.end_wal = report.end_wal.clone();
        s.timeline = report.timeline.map(i64::from);
        s.system_identifier = report.system_id.clone();
        if report.key.is_some() {
            s.location = location;
        }
        if let Some(ms) = report.consistent_ms {
            s.stopped_at = Some(rfc3339(ms));
        }
        s.waiting_for = (report.phase == BackupPhase::WaitingForWal).then(|| {
            format!(
                "WAL up to {} to be archived (the DatabaseCluster's ContinuousArchiving condition says how archiving goes)",
                report.end_wal.as_deref().unwrap_or("the end of the copy")
            )
        });
    })
}

/// A running backup, from what its instance says.
pub fn poll(backup: &Backup, observed: &Observed, location: Option<String>, now: &str) -> Decision {
    let status = backup.status.clone().unwrap_or_default();
    let instance = status.instance.clone().unwrap_or_default();
    match observed {
        Observed::Report(report) => match report.phase {
            BackupPhase::Running => Decision {
                status: from_report(&status, report, location),
                act: Act::Nothing,
                requeue: Some(POLL),
                event: None,
            },
            BackupPhase::WaitingForWal => {
                // The first time: ask the primary to close the segment once.
                let first = status.end_wal.is_none();
                Decision {
                    status: from_report(&status, report, location),
                    act: if first && report.from_standby {
                        Act::SwitchWal
                    } else {
                        Act::Nothing
                    },
                    requeue: Some(POLL),
                    event: None,
                }
            }
            BackupPhase::Completed => {
                let status = with(&from_report(&status, report, location), |s| {
                    s.phase = Some(COMPLETED.to_owned());
                    s.progress_percent = Some(100);
                    s.error = None;
                });
                let message = format!(
                    "base backup from {instance} completed: {} stored, restorable from {}",
                    status.size.clone().unwrap_or_default(),
                    status.stopped_at.clone().unwrap_or_default()
                );
                Decision {
                    status,
                    act: Act::Nothing,
                    requeue: None,
                    event: Some((false, "BackupCompleted", message)),
                }
            }
            BackupPhase::Failed => fail(
                &from_report(&status, report, location),
                now,
                format!(
                    "the base backup on {instance} failed: {}",
                    report.error.as_deref().unwrap_or("no reason given")
                ),
            ),
        },
        Observed::Unknown | Observed::Gone => Decision {
            status,
            act: Act::CheckManifest,
            requeue: Some(POLL),
            event: None,
        },
        Observed::Unreachable(error) => Decision {
            status: with(&status, |s| {
                s.error = Some(format!(
                    "cannot reach {instance} to follow the backup: {error}"
                ));
            }),
            act: Act::Nothing,
            requeue: Some(RETRY),
            event: None,
        },
    }
}

/// The manifest was looked for after the instance lost the backup: it is the only
/// proof of a finished backup.
pub fn after_manifest(
    backup: &Backup,
    manifest: Option<&BackupReport>,
    location: Option<String>,
    now: &str,
) -> Decision {
    let status = backup.status.clone().unwrap_or_default();
    let instance = status.instance.clone().unwrap_or_default();
    match manifest {
        Some(report) => poll(
            backup,
            &Observed::Report(Box::new(report.clone())),
            location,
            now,
        ),
        None => fail(
            &status,
            now,
            format!(
                "{instance} stopped taking the backup before it finished (its instance manager restarted or the pod is gone); \
                 what it uploaded has no manifest and is never restored"
            ),
        ),
    }
}

/// `1.5Gi`-style size.
pub fn human_size(bytes: i64) -> String {
    let units = ["", "Ki", "Mi", "Gi", "Ti"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}")
    } else {
        format!("{value:.1}{}", units[unit])
    }
}

pub fn rfc3339(ms: u64) -> String {
    let ms = i64::try_from(ms).unwrap_or(i64::MAX);
    k8s_openapi::jiff::Timestamp::from_millisecond(ms)
        .map(|t| {
            t.round(k8s_openapi::jiff::Unit::Second)
                .unwrap_or(t)
                .to_string()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: &str = "2026-12-02T03:00:00Z";

    fn backup(status: serde_json::Value) -> Backup {
        serde_json::from_value(json!({
            "apiVersion": "castellan.io/v1alpha1", "kind": "Backup",
            "metadata": {"name": "nightly.1", "namespace": "shop", "uid": "0a1b2c3d-4e5f-6789"},
            "spec": {"cluster": "db"},
            "status": status,
        }))
        .expect("test value")
    }

    fn cluster(archiving: &str, instances: serde_json::Value) -> DatabaseCluster {
        serde_json::from_value(json!({
            "apiVersion": "castellan.io/v1alpha1", "kind": "DatabaseCluster",
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {"engine": "postgresql", "version": "15", "replicas": 3, "storage": {"size": "1Gi"},
                     "backup": {"endpoint": "http://10.0.0.1:9000", "bucket": "castellan",
                                "credentials": {"secretName": "s3"}}},
            "status": {"currentPrimary": "db-1", "instances": instances,
                       "conditions": [{"type": "ContinuousArchiving", "status": archiving, "reason": "r",
                                       "message": "S3 down", "lastTransitionTime": NOW}]},
        }))
        .expect("test value")
    }

    fn three() -> serde_json::Value {
        json!([
            {"name": "db-1", "role": "primary", "ready": true},
            {"name": "db-2", "role": "replica", "ready": true, "lagBytes": 900},
            {"name": "db-3", "role": "replica", "ready": true, "lagBytes": 10},
        ])
    }

    fn report(phase: BackupPhase) -> BackupReport {
        BackupReport {
            id: "nightly-1-0a1b2c3d".into(),
            phase,
            instance: "db-3".into(),
            from_standby: true,
            key: Some("shop/db/7/base/nightly-1-0a1b2c3d".into()),
            system_id: Some("7".into()),
            timeline: Some(1),
            begin_lsn: Some("0/2000028".into()),
            end_lsn: Some("0/3000100".into()),
            begin_wal: Some("000000010000000000000002".into()),
            end_wal: Some("000000010000000000000003".into()),
            bytes_total: 100,
            bytes_read: 40,
            bytes_stored: 2048,
            consistent_ms: Some(1_796_180_400_000),
            ..BackupReport::default()
        }
    }

    fn running() -> Backup {
        backup(json!({"phase": "Running", "instance": "db-3", "backupId": "nightly-1-0a1b2c3d"}))
    }

    #[test]
    fn ids_are_name_and_uid_safe_for_object_keys() {
        assert_eq!(backup_id(&backup(json!({}))), "nightly-1-0a1b2c3d");
    }

    #[test]
    fn a_new_backup_starts_on_the_replica_with_least_lag_after_a_primary_checkpoint() {
        let decision = start(&backup(json!({})), Some(&cluster("True", three())), NOW);
        assert_eq!(
            decision.act,
            Act::Start {
                instance: "db-3".into(),
                id: "nightly-1-0a1b2c3d".into(),
                checkpoint_first: true,
            }
        );
        assert_eq!(decision.status.phase.as_deref(), Some(RUNNING));
        assert_eq!(decision.status.started_at.as_deref(), Some(NOW));
        assert_eq!(decision.event.expect("test value").1, "BackupStarted");
    }

    #[test]
    fn without_a_ready_replica_the_primary_is_used_and_fenced_ones_never() {
        let instances = json!([
            {"name": "db-1", "role": "primary", "ready": true},
            {"name": "db-2", "role": "replica", "ready": false},
            {"name": "db-3", "role": "replica", "ready": true, "fenced": true},
        ]);
        let decision = start(&backup(json!({})), Some(&cluster("True", instances)), NOW);
        assert_eq!(
            decision.act,
            Act::Start {
                instance: "db-1".into(),
                id: "nightly-1-0a1b2c3d".into(),
                checkpoint_first: false,
            }
        );
        let none = json!([{"name": "db-1", "role": "primary", "ready": false}]);
        let decision = start(&backup(json!({})), Some(&cluster("True", none)), NOW);
        assert_eq!(decision.act, Act::Nothing);
        assert_eq!(decision.status.phase.as_deref(), Some(PENDING));
        assert!(
            decision
                .status
                .error
                .expect("test value")
                .contains("no instance")
        );
    }

    #[test]
    fn a_backup_waits_for_its_cluster_and_for_archiving() {
        let decision = start(&backup(json!({})), None, NOW);
        assert_eq!(
            (decision.status.phase.as_deref(), decision.requeue),
            (Some(PENDING), Some(RETRY))
        );
        assert!(
            decision
                .status
                .error
                .expect("test value")
                .contains("does not exist")
        );
        let decision = start(&backup(json!({})), Some(&cluster("False", three())), NOW);
        assert_eq!(decision.act, Act::Nothing);
        assert!(
            decision
                .status
                .error
                .expect("test value")
                .contains("S3 down")
        );
    }

    #[test]
    fn a_cluster_without_an_object_store_fails_the_backup() {
        let mut cluster = cluster("True", three());
        cluster.spec.backup = None;
        let decision = start(&backup(json!({})), Some(&cluster), NOW);
        assert_eq!(decision.status.phase.as_deref(), Some(FAILED));
        assert_eq!(decision.requeue, None);
        assert!(decision.event.expect("test value").0);
    }

    #[test]
    fn progress_and_sizes_follow_the_report() {
        let decision = poll(
            &running(),
            &Observed::Report(Box::new(report(BackupPhase::Running))),
            Some("s3://b/k".into()),
            NOW,
        );
        assert_eq!(decision.status.progress_percent, Some(40));
        assert_eq!(decision.status.size.as_deref(), Some("2.0Ki"));
        assert_eq!(decision.status.location.as_deref(), Some("s3://b/k"));
        assert_eq!(decision.status.phase.as_deref(), Some(RUNNING));
        assert_eq!(decision.requeue, Some(POLL));
    }

    #[test]
    fn a_replica_backup_waiting_for_wal_switches_the_primary_once() {
        let first = poll(
            &running(),
            &Observed::Report(Box::new(report(BackupPhase::WaitingForWal))),
            None,
            NOW,
        );
        assert_eq!(first.act, Act::SwitchWal);
        let mut again = running();
        again.status = Some(first.status);
        let second = poll(
            &again,
            &Observed::Report(Box::new(report(BackupPhase::WaitingForWal))),
            None,
            NOW,
        );
        assert_eq!(second.act, Act::Nothing);
        // It says what it waits for, until the report moves on.
        let waiting = second
            .status
            .waiting_for
            .clone()
            .expect("what it waits for");
        assert!(
            waiting.contains("000000010000000000000003 to be archived"),
            "{waiting}"
        );
        again.status = Some(second.status);
        let done = poll(
            &again,
            &Observed::Report(Box::new(report(BackupPhase::Completed))),
            None,
            NOW,
        );
        assert_eq!(done.status.waiting_for, None);
        let mut primary = report(BackupPhase::WaitingForWal);
        primary.from_standby = false;
        assert_eq!(
            poll(&running(), &Observed::Report(Box::new(primary)), None, NOW).act,
            Act::Nothing
        );
    }

    #[test]
    fn completion_and_failure_are_final_with_an_event() {
        let done = poll(
            &running(),
            &Observed::Report(Box::new(report(BackupPhase::Completed))),
            None,
            NOW,
        );
        assert_eq!(done.status.phase.as_deref(), Some(COMPLETED));
        assert_eq!(done.status.progress_percent, Some(100));
        assert_eq!(
            done.status.stopped_at.as_deref(),
            Some("2026-12-02T03:00:00Z")
        );
        assert_eq!(done.requeue, None);
        assert_eq!(done.event.expect("test value").1, "BackupCompleted");
        let mut broken = report(BackupPhase::Failed);
        broken.error = Some("disk on fire".into());
        let failed = poll(&running(), &Observed::Report(Box::new(broken)), None, NOW);
        assert_eq!(failed.status.phase.as_deref(), Some(FAILED));
        assert!(
            failed
                .status
                .error
                .expect("test value")
                .contains("disk on fire")
        );
        assert!(failed.event.expect("test value").0);
    }

    #[test]
    fn a_lost_backup_is_failed_unless_its_manifest_proves_it_done() {
        for lost in [Observed::Unknown, Observed::Gone] {
            assert_eq!(poll(&running(), &lost, None, NOW).act, Act::CheckManifest);
        }
        let failed = after_manifest(&running(), None, None, NOW);
        assert_eq!(failed.status.phase.as_deref(), Some(FAILED));
        assert!(
            failed
                .status
                .error
                .expect("test value")
                .contains("never restored")
        );
        let manifest = report(BackupPhase::Completed);
        let done = after_manifest(&running(), Some(&manifest), None, NOW);
        assert_eq!(done.status.phase.as_deref(), Some(COMPLETED));
    }

    #[test]
    fn an_unreachable_instance_keeps_the_backup_running_and_says_why() {
        let decision = poll(
            &running(),
            &Observed::Unreachable("connection refused".into()),
            None,
            NOW,
        );
        assert_eq!(decision.status.phase.as_deref(), Some(RUNNING));
        assert!(
            decision
                .status
                .error
                .expect("test value")
                .contains("connection refused")
        );
        assert_eq!(decision.requeue, Some(RETRY));
    }

    #[test]
    fn sizes_read_like_quantities() {
        assert_eq!(human_size(512), "512");
        assert_eq!(human_size(3 * 1024 * 1024 / 2), "1.5Mi");
    }
}
