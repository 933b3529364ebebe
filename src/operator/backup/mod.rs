//! The `Backup` controller: starts each backup on the instance the machine chooses,
//! follows it to the end through the instance API, and keeps the cluster's
//! `status.lastBackup` and `status.firstRecoverabilityPoint` true. The decisions are
//! the pure `machine`; this shell only observes and carries them out.
//!
//! It keeps nothing in memory between passes: an operator restarted mid-backup reads
//! the Backup's status (instance and id) and asks the instance again.

pub mod machine;
mod retention;
mod verify;

use std::sync::Arc;
use std::time::Duration;

use castellan_crds::{Backup, BackupStatus, DatabaseCluster};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tracing::Instrument;

use super::cluster::Note;
use super::context::Shared;
use super::instance_client::{self, InstanceApiError};
use super::object_store::archive_setting;
use crate::instance_api::{ArchiveTarget, BackupReport, BackupRequest, LsnResponse};
use crate::kube_ops::{apply_status_onto, with_current_status};
use machine::{Act, Decision, Observed};

/// The field manager of what this controller writes.
const MANAGER: &str = "castellan-backups";

/// A pod of a running backup that has not been ready for this long is taken as gone.
const NOT_READY_LIMIT: Duration = Duration::from_secs(120);
/// How long the primary may take over the checkpoint a replica's backup begins at
/// (it writes every dirty buffer out at once).
const CHECKPOINT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} for Backup {backup}: {source}")]
    Kube {
        what: &'static str,
        backup: String,
        source: kube::Error,
    },
}

struct Context {
    shared: Arc<Shared>,
}

/// How often every cluster's retention is applied (besides after each backup).
const SWEEP_EVERY: Duration = Duration::from_secs(600);

/// Runs the controller until the process is told to stop, and applies each cluster's
/// retention every [`SWEEP_EVERY`].
pub async fn run(shared: Arc<Shared>, backups: Api<Backup>, clusters: Api<DatabaseCluster>) {
    tokio::spawn({
        let shared = shared.clone();
        async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                match clusters.list(&Default::default()).await {
                    Ok(list) => {
                        for cluster in &list.items {
                            let first = retain(&shared, cluster).await;
                            if first.is_some() {
                                recoverability(&shared.client, cluster, first).await;
                            }
                        }
                    }
                    Err(error) => tracing::warn!(%error, "listing clusters to apply retention"),
                }
            }
        }
    });
    let controller = Controller::new(backups, watcher::Config::default());
    // Its cache is where the newest backup of each cluster is read when scraped.
    shared.metrics.watch_backups(controller.store());
    let context = Arc::new(Context { shared });
    tracing::info!("Backup controller starting");
    controller
        .shutdown_on_signal()
        .run(reconcile, error_policy, context)
        .for_each(|outcome| async move {
            if let Err(error) = outcome {
                tracing::warn!(error = %error, "Backup reconcile failed");
            }
        })
        .await;
}

fn error_policy(_backup: Arc<Backup>, error: &Error, _context: Arc<Context>) -> Action {
    tracing::warn!(error = %error, "Backup reconcile will be retried");
    Action::requeue(Duration::from_secs(5))
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

async fn reconcile(backup: Arc<Backup>, context: Arc<Context>) -> Result<Action, Error> {
    let span = tracing::info_span!(
        "reconcile backup",
        backup = %backup.name_any(),
        namespace = backup.namespace().unwrap_or_default(),
    );
    context
        .shared
        .metrics
        .reconcile("backup", reconcile_traced(&backup, &context))
        .instrument(span)
        .await
}

/// Whether `backup` has nothing left to do: failed, or completed and not to be
/// verified. Both are final, so the cache's word is enough.
fn settled(backup: &Backup) -> bool {
    let phase = backup.status.as_ref().and_then(|s| s.phase.as_deref());
    phase == Some(machine::FAILED) || (phase == Some(machine::COMPLETED) && !verify::wanted(backup))
}

async fn reconcile_traced(cached: &Backup, context: &Context) -> Result<Action, Error> {
    if settled(cached) {
        return Ok(Action::await_change());
    }
    let client = &context.shared.client;
    let namespace = cached.namespace().unwrap_or_else(|| "default".to_owned());
    // Decided on the status as it is now, not as the cache may still have it: a pass
    // on a stale one would start again what is running, or write back a phase the
    // previous pass had left.
    let backups: Api<Backup> = Api::namespaced(client.clone(), &namespace);
    let backup = &with_current_status(&backups, cached)
        .await
        .map_err(kube_error("reading the status", cached))?;
    if settled(backup) {
        return Ok(Action::await_change());
    }
    let phase = backup.status.as_ref().and_then(|s| s.phase.as_deref());
    let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), &namespace);
    let cluster = clusters
        .get_opt(&backup.spec.cluster)
        .await
        .map_err(kube_error("reading the cluster", backup))?;
    if phase == Some(machine::COMPLETED) {
        return Ok(verify::verify(&context.shared, backup, cluster.as_ref()).await);
    }
    let now = now();
    // The object store's setting (its Secrets read) only where it is used: to start
    // the backup, and to look for a manifest; not on every poll of a running one.
    let decision = if phase == Some(machine::RUNNING) {
        follow(client, backup, cluster.as_ref(), &now).await
    } else {
        let target = target_of(client, cluster.as_ref()).await;
        begin(client, backup, cluster.as_ref(), target, &now).await
    };
    write_status(client, backup, &decision.status).await?;
    if let Some((warning, reason, message)) = decision.event.clone() {
        let note = if warning {
            Note::warning(reason, message)
        } else {
            Note::normal(reason, message)
        };
        let mut reference = backup.object_ref(&());
        reference.namespace = backup.namespace();
        context.shared.record_at(&reference, note).await;
    }
    if decision.status.phase.as_deref() == Some(machine::COMPLETED)
        && let Some(cluster) = &cluster
    {
        let first = retain(&context.shared, cluster).await;
        recoverability(client, cluster, first).await;
    }
    if decision.status.phase.as_deref() == Some(machine::COMPLETED) && verify::wanted(backup) {
        return Ok(Action::requeue(machine::POLL));
    }
    Ok(decision
        .requeue
        .map_or_else(Action::await_change, Action::requeue))
}

/// A pending backup: start it where the machine says.
async fn begin(
    client: &Client,
    backup: &Backup,
    cluster: Option<&DatabaseCluster>,
    target: Result<Option<ArchiveTarget>, String>,
    now: &str,
) -> Decision {
    let decision = machine::start(backup, cluster, now);
    let Act::Start {
        instance,
        id,
        checkpoint_first,
    } = &decision.act
    else {
        return decision;
    };
    let status = backup.status.clone().unwrap_or_default();
    let target = match target {
        Ok(Some(target)) => target,
        Ok(None) => return wait(&status, "the cluster has no object store".to_owned()),
        Err(error) => return wait(&status, error),
    };
    let Some(cluster) = cluster else {
        return decision;
    };
    let address = match address(client, cluster, instance).await {
        Ok(address) => address,
        Err(error) => return wait(&status, error),
    };
    let compression = cluster
        .spec
        .backup
        .as_ref()
        .and_then(|backup| backup.compression)
        .unwrap_or_default();
    let after_checkpoint = if *checkpoint_first {
        match checkpoint(client, cluster).await {
            Ok(lsn) => Some(lsn),
            Err(error) => return wait(&status, error),
        }
    } else {
        None
    };
    let request = BackupRequest {
        id: id.clone(),
        target,
        compression,
        after_checkpoint,
    };
    let body = serde_json::to_value(&request).unwrap_or_default();
    match instance_client::call("POST", &address, "/backup", Some(&body)).await {
        Ok(_) => decision,
        Err(error) => wait(
            &status,
            format!("starting the backup on {instance}: {error}"),
        ),
    }
}

fn wait(status: &BackupStatus, why: String) -> Decision {
    let mut status = status.clone();
    status.phase = Some(machine::PENDING.to_owned());
    status.error = Some(why);
    Decision {
        status,
        act: Act::Nothing,
        requeue: Some(machine::RETRY),
        event: None,
    }
}

/// The object store `cluster` backs up to, with its credentials; `None` without a
/// cluster or without `spec.backup`.
async fn target_of(
    client: &Client,
    cluster: Option<&DatabaseCluster>,
) -> Result<Option<ArchiveTarget>, String> {
    match cluster {
        Some(cluster) if cluster.spec.backup.is_some() => {
            archive_setting(client, cluster).await.map(|c| c.target)
        }
        _ => Ok(None),
    }
}

/// A running backup: ask its instance, and act on the answer.
async fn follow(
    client: &Client,
    backup: &Backup,
    cluster: Option<&DatabaseCluster>,
    now: &str,
) -> Decision {
    let status = backup.status.clone().unwrap_or_default();
    let instance = status.instance.clone().unwrap_or_default();
    let id = status.backup_id.clone().unwrap_or_default();
    let bucket = cluster
        .and_then(|c| c.spec.backup.as_ref())
        .map(|b| b.bucket.clone());
    let location = |report: &BackupReport| {
        let (bucket, key) = (bucket.as_ref()?, report.key.as_ref()?);
        Some(format!("s3://{bucket}/{key}/"))
    };
    let observed = observe(client, cluster, &instance, &id).await;
    let report = match &observed {
        Observed::Report(report) => Some((**report).clone()),
        _ => None,
    };
    let decision = machine::poll(backup, &observed, report.as_ref().and_then(location), now);
    match decision.act {
        Act::SwitchWal => {
            if let Some(cluster) = cluster {
                switch_wal(client, cluster).await;
            }
            decision
        }
        Act::CheckManifest => {
            let target = target_of(client, cluster).await.ok().flatten();
            let manifest = match (&target, &status.system_identifier) {
                (Some(target), Some(system_id)) => manifest(target, system_id, &id).await,
                _ => None,
            };
            let location = manifest.as_ref().and_then(location);
            machine::after_manifest(backup, manifest.as_ref(), location, now)
        }
        _ => decision,
    }
}

/// What the instance taking the backup says about it.
async fn observe(
    client: &Client,
    cluster: Option<&DatabaseCluster>,
    instance: &str,
    id: &str,
) -> Observed {
    let Some(cluster) = cluster else {
        return Observed::Gone;
    };
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = match pods.get_opt(instance).await {
        Ok(Some(pod)) => pod,
        Ok(None) => return Observed::Gone,
        Err(error) => return Observed::Unreachable(format!("reading pod {instance}: {error}")),
    };
    if not_ready_for(&pod) > NOT_READY_LIMIT {
        return Observed::Gone;
    }
    let Some(address) = instance_client::pod_address(cluster, &pod) else {
        return Observed::Unreachable(format!("pod {instance} has no IP address"));
    };
    match instance_client::call("GET", &address, &format!("/backup/{id}"), None).await {
        Ok(body) => match serde_json::from_value::<BackupReport>(body) {
            Ok(report) => Observed::Report(Box::new(report)),
            Err(error) => {
                Observed::Unreachable(format!("reading {instance}'s backup report: {error}"))
            }
        },
        Err(InstanceApiError::Status { status: 404, .. }) => Observed::Unknown,
        Err(error) => Observed::Unreachable(error.to_string()),
    }
}

/// How long the pod has not been ready (zero while it is).
fn not_ready_for(pod: &Pod) -> Duration {
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status != "True" => c
            .last_transition_time
            .as_ref()
            .map(|t| {
                let since = k8s_openapi::jiff::Timestamp::now().duration_since(t.0);
                Duration::try_from(since).unwrap_or_default()
            })
            .unwrap_or_default(),
        _ => Duration::ZERO,
    }
}

/// The instance API address of `instance`.
async fn address(
    client: &Client,
    cluster: &DatabaseCluster,
    instance: &str,
) -> Result<String, String> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let pod = pods
        .get_opt(instance)
        .await
        .map_err(|e| format!("reading pod {instance}: {e}"))?
        .ok_or_else(|| format!("pod {instance} does not exist"))?;
    instance_client::pod_address(cluster, &pod)
        .ok_or_else(|| format!("pod {instance} has no IP address"))
}

/// Asks the primary for a checkpoint for a replica's backup to begin at; answers where
/// its record is.
async fn checkpoint(client: &Client, cluster: &DatabaseCluster) -> Result<String, String> {
    let primary = cluster
        .status
        .as_ref()
        .and_then(|s| s.current_primary.clone())
        .ok_or("the cluster has no primary to ask for a checkpoint")?;
    let address = address(client, cluster, &primary).await?;
    let answer = instance_client::call_within("POST", &address, "/checkpoint", None, CHECKPOINT)
        .await
        .map_err(|e| format!("asking the primary {primary} for a checkpoint: {e}"))?;
    serde_json::from_value::<LsnResponse>(answer)
        .map(|answer| answer.lsn)
        .map_err(|e| format!("reading the primary {primary}'s checkpoint position: {e}"))
}

/// Asks the primary to close its WAL segment. A failure is only logged: the segment
/// completes by itself with the next writes, and the backup waits for it.
async fn switch_wal(client: &Client, cluster: &DatabaseCluster) {
    let Some(primary) = cluster
        .status
        .as_ref()
        .and_then(|s| s.current_primary.clone())
    else {
        return;
    };
    let outcome = match address(client, cluster, &primary).await {
        Ok(address) => instance_client::call("POST", &address, "/switch-wal", None)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Err(error) => Err(error),
    };
    match outcome {
        Ok(()) => {
            tracing::info!(%primary, "asked the primary to switch WAL segments for a replica's backup")
        }
        Err(error) => {
            tracing::warn!(%primary, %error, "could not ask the primary to switch WAL segments")
        }
    }
}

/// The manifest of backup `id`, if it was written: the proof that it completed. One
/// that cannot be read counts as absent (and is logged): the backup is not proven.
async fn manifest(target: &ArchiveTarget, system_id: &str, id: &str) -> Option<BackupReport> {
    let store = crate::instance::archive::s3_store(target).ok()?;
    let prefix = target.prefix.trim_matches('/');
    crate::instance::backup::read_manifest(&store, prefix, system_id, id)
        .await
        .unwrap_or_else(|error| {
            tracing::warn!(%error, "reading a backup's manifest");
            None
        })
}

/// Applies the Backup's status onto the resource version `backup` was read at: when
/// anything wrote it since, the API server refuses (409 Conflict) and the next pass
/// decides again on what is there.
pub(super) async fn write_status(
    client: &Client,
    backup: &Backup,
    status: &BackupStatus,
) -> Result<(), Error> {
    let namespace = backup.namespace().unwrap_or_else(|| "default".to_owned());
    let backups: Api<Backup> = Api::namespaced(client.clone(), &namespace);
    let mut status = status.clone();
    status.observed_generation = backup.metadata.generation;
    apply_status_onto(&backups, backup, MANAGER, &status)
        .await
        .map_err(kube_error("writing the status", backup))?;
    Ok(())
}

/// The cluster's newest completed backup, from its completed Backups, and the earliest
/// moment its backups restore to: `first_ms` when retention found it in the object
/// store, else the oldest completed Backup's.
async fn recoverability(client: &Client, cluster: &DatabaseCluster, first_ms: Option<u64>) {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let backups: Api<Backup> = Api::namespaced(client.clone(), &namespace);
    let listed = match backups.list(&Default::default()).await {
        Ok(listed) => listed,
        Err(error) => {
            tracing::warn!(%error, "listing Backups for the cluster's recoverability");
            return;
        }
    };
    let mut completed: Vec<(String, String)> = listed
        .items
        .iter()
        .filter(|b| b.spec.cluster == cluster.name_any())
        .filter_map(|b| {
            let status = b.status.as_ref()?;
            (status.phase.as_deref() == Some(machine::COMPLETED))
                .then(|| (status.stopped_at.clone().unwrap_or_default(), b.name_any()))
        })
        .collect();
    completed.sort();
    let (Some(first), Some(last)) = (completed.first(), completed.last()) else {
        return;
    };
    let status = json!({
        "firstRecoverabilityPoint": first_ms.map_or_else(|| first.0.clone(), machine::rfc3339),
        "lastBackup": last.1,
    });
    if let Err(error) =
        super::cluster::pass::write_status_as(client, cluster, &status, MANAGER).await
    {
        tracing::warn!(%error, "writing the cluster's last backup");
    }
}

/// Applies the cluster's `spec.backup.retention` to its object store and says what
/// went in an Event; returns the consistent point of the oldest backup kept.
async fn retain(shared: &Shared, cluster: &DatabaseCluster) -> Option<u64> {
    let retention = cluster.spec.backup.as_ref()?.retention.clone()?;
    let target = match archive_setting(&shared.client, cluster).await {
        Ok(config) => config.target?,
        Err(error) => {
            tracing::warn!(cluster = %cluster.name_any(), %error, "cannot apply retention");
            return None;
        }
    };
    let now = crate::instance_api::millis_since_epoch(std::time::SystemTime::now());
    let swept = match retention::sweep(&target, &retention, now).await {
        Ok(swept) => swept,
        Err(error) => {
            tracing::warn!(cluster = %cluster.name_any(), %error, "applying retention failed");
            let note = Note::warning(
                "RetentionFailed",
                format!("applying spec.backup.retention: {error}"),
            );
            shared.record(cluster, note).await;
            return None;
        }
    };
    if !swept.backups.is_empty() || swept.abandoned > 0 {
        let message = format!(
            "retention removed {} base backup(s) ({}), {} WAL file(s) only they needed, and {} object(s) of unfinished backups",
            swept.backups.len(),
            swept.backups.join(", "),
            swept.wal_files,
            swept.abandoned
        );
        tracing::info!(cluster = %cluster.name_any(), %message, "retention applied");
        shared
            .record(cluster, Note::normal("BackupsRemoved", message))
            .await;
    }
    swept.first_recoverability_ms
}

fn kube_error(what: &'static str, backup: &Backup) -> impl FnOnce(kube::Error) -> Error {
    let backup = format!(
        "{}/{}",
        backup.namespace().unwrap_or_default(),
        backup.name_any()
    );
    move |source| Error::Kube {
        what,
        backup,
        source,
    }
}
