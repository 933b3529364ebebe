//! The `BackupSchedule` controller: makes `Backup` objects on the schedule's cron
//! slots and removes the ones its retention lets go. Taking the backups is the
//! `Backup` controller's work, not this one's.
//!
//! `machine.rs` decides (pure: slots, catch-up, skips, retention, status); this file is
//! the shell: it reads the schedule and the Backups labelled with its name, creates
//! and deletes Backups, writes the status (server-side apply of the status
//! subresource, its own field manager) and records Events, then sleeps until the next
//! slot. A reconcile is a handful of API calls, so unlike a cluster the schedule has no
//! actor of its own: the controller already runs one reconcile per schedule at a time,
//! and everything that must survive a restart is in the status (`nextScheduleTime` is
//! the first slot not handled yet).
//!
//! The Backups are watched too (by label, not ownership: they have no owner reference,
//! see [`machine::backup`]), so a Backup that completes or fails updates
//! `lastSuccessfulBackup`, `activeBackups` and retention at once, not at the next slot.

pub mod machine;

use std::sync::Arc;
use std::time::Duration;

use castellan_crds::{Backup, BackupSchedule};
use futures::StreamExt;
use jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tracing::Instrument;

use super::context::{Shared, object_reference};
use crate::kube_ops::{apply_status_onto, with_current_status};
use machine::{BackupRecord, Observed, SCHEDULE_LABEL};

/// Field manager of the schedule's status and of the Backups it creates.
const MANAGER: &str = "castellan-backup-schedule";

/// How long after a failed reconcile (the API server refused a write) to try again.
const RETRY: Duration = Duration::from_secs(10);

struct Context {
    shared: Arc<Shared>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} for BackupSchedule {schedule}: {source}")]
    Kube {
        what: String,
        schedule: String,
        source: kube::Error,
    },
}

fn kube_error(what: impl Into<String>, schedule: &str) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    let schedule = schedule.to_owned();
    move |source| Error::Kube {
        what,
        schedule,
        source,
    }
}

/// Runs the controller until the process is asked to stop. `schedules` and `backups`
/// are the APIs of the watched namespace (or of all of them).
pub async fn run(schedules: Api<BackupSchedule>, backups: Api<Backup>, shared: Arc<Shared>) {
    tracing::info!("BackupSchedule controller starting");
    let context = Arc::new(Context { shared });
    Controller::new(schedules, watcher::Config::default())
        .watches(
            backups,
            watcher::Config::default().labels(SCHEDULE_LABEL),
            |backup: Backup| {
                let schedule = backup.labels().get(SCHEDULE_LABEL)?.clone();
                let namespace = backup.namespace()?;
                Some(ObjectRef::<BackupSchedule>::new(&schedule).within(&namespace))
            },
        )
        .shutdown_on_signal()
        .run(reconcile, error_policy, context)
        .for_each(|outcome| async move {
            match outcome {
                Ok(_) => {}
                // Logged with its cause by `error_policy`.
                Err(controller::Error::ReconcilerFailed(..)) => {}
                Err(error) => {
                    tracing::warn!(%error, "the BackupSchedule controller's watch failed")
                }
            }
        })
        .await;
    tracing::info!("BackupSchedule controller stopped");
}

/// Every reconcile is a span, with the schedule's `namespace/name`.
async fn reconcile(schedule: Arc<BackupSchedule>, context: Arc<Context>) -> Result<Action, Error> {
    let key = format!(
        "{}/{}",
        schedule.namespace().unwrap_or_default(),
        schedule.name_any()
    );
    let span = tracing::info_span!("reconcile", schedule = %key);
    context
        .shared
        .metrics
        .reconcile("backupschedule", apply(&schedule, &context.shared, &key))
        .instrument(span)
        .await
}

/// Reads, decides, acts: creates before it records (a status never names a Backup
/// that was not made), deletes, writes the status, then records the Events.
async fn apply(schedule: &BackupSchedule, shared: &Shared, key: &str) -> Result<Action, Error> {
    if schedule.metadata.deletion_timestamp.is_some() {
        // Its Backups stay (no owner reference): they are what a restore names.
        return Ok(Action::await_change());
    }
    let namespace = schedule.namespace().unwrap_or_default();
    let name = schedule.name_any();
    // Decided on the status as it is now: the cache may not hold the last one written
    // yet, and a status decided on an older one would move the schedule's record back.
    let schedules: Api<BackupSchedule> = Api::namespaced(shared.client.clone(), &namespace);
    let schedule = &with_current_status(&schedules, schedule)
        .await
        .map_err(kube_error("reading the status", key))?;
    let backups: Api<Backup> = Api::namespaced(shared.client.clone(), &namespace);
    let listed = backups
        .list(&ListParams::default().labels(&format!("{SCHEDULE_LABEL}={name}")))
        .await
        .map_err(kube_error("listing its Backups", key))?;
    // A Backup already being deleted is as good as gone.
    let present: Vec<&Backup> = listed
        .items
        .iter()
        .filter(|b| b.metadata.deletion_timestamp.is_none())
        .collect();
    let records: Vec<BackupRecord> = present
        .iter()
        .copied()
        .filter_map(BackupRecord::of)
        .collect();
    let now = Timestamp::now();
    let decision = machine::decide(&Observed {
        name: &name,
        uid: schedule.metadata.uid.as_deref(),
        spec: &schedule.spec,
        status: schedule.status.as_ref(),
        generation: schedule.metadata.generation,
        created: schedule
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(now, |t| t.0),
        backups: &records,
        now,
    });
    tracing::debug!(?decision, "decided");

    if let Some(planned) = &decision.create {
        let backup = machine::backup(
            &namespace,
            &name,
            schedule.metadata.uid.as_deref(),
            &schedule.spec.cluster,
            schedule.spec.verify,
            planned,
        );
        let params = PostParams {
            field_manager: Some(MANAGER.to_owned()),
            ..PostParams::default()
        };
        match backups.create(&params, &backup).await {
            Ok(_) => {
                tracing::info!(backup = %planned.name, slot = %planned.slot, cluster = %schedule.spec.cluster, "created Backup");
            }
            // Made by an earlier look whose status write was lost (or the watch had
            // not shown it yet): the slot is taken either way.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                tracing::info!(backup = %planned.name, slot = %planned.slot, "Backup for this slot already exists");
            }
            Err(error) => {
                return Err(kube_error(format!("creating Backup {}", planned.name), key)(error));
            }
        }
    }

    for pruned in &decision.delete {
        // Only the object that was judged: not one re-created under the same name
        // since the list.
        let uid = present
            .iter()
            .find(|b| b.metadata.name.as_deref() == Some(pruned.name.as_str()))
            .and_then(|b| b.metadata.uid.clone());
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match backups.delete(&pruned.name, &params).await {
            Ok(_) => {
                tracing::info!(backup = %pruned.name, why = %pruned.why, "deleted Backup by retention")
            }
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                tracing::info!(backup = %pruned.name, "Backup already gone or replaced; not deleted");
            }
            Err(error) => {
                return Err(kube_error(format!("deleting Backup {}", pruned.name), key)(
                    error,
                ));
            }
        }
    }

    if schedule.status.as_ref() != Some(&decision.status) {
        // Onto the version decided on: anything written since makes it a 409 and
        // another pass.
        apply_status_onto(&schedules, schedule, MANAGER, &decision.status)
            .await
            .map_err(kube_error("writing the status", key))?;
    }

    let reference = object_reference(schedule);
    for note in decision.notes {
        if note.reason == machine::BACKUP_SKIPPED || note.reason == machine::INVALID_SCHEDULE {
            tracing::warn!(reason = note.reason, note = %note.message, "schedule Event");
        }
        shared.record_at(&reference, note).await;
    }
    Ok(decision
        .requeue
        .map_or_else(Action::await_change, Action::requeue))
}

fn error_policy(schedule: Arc<BackupSchedule>, error: &Error, _context: Arc<Context>) -> Action {
    tracing::warn!(schedule = %schedule.name_any(), %error, "BackupSchedule reconcile will be retried");
    Action::requeue(RETRY)
}
