//! Restore verification: a completed `Backup` with `spec.verify` is restored into a
//! scratch instance of its cluster (`build::scratch`: its own volume, none of the
//! cluster's labels, so no Service ever sends it a client), which replays the archived
//! WAL, checks the data (`instance::verify`) and reports. The outcome is the
//! `RestoreVerified` condition on the Backup and on the cluster, with an Event (a
//! Warning when it failed); the scratch instance is then deleted.
//!
//! The step is decided by [`step`], without I/O; the state lives in the Backup's
//! `RestoreVerified` condition (`Unknown` while verifying, since when), so an operator
//! restart resumes it.

use std::time::{Duration, SystemTime};

use castellan_crds::{Backup, DatabaseCluster};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{DeleteParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::{machine, write_status};
use crate::instance_api::{RestoreRequest, StatusReport, VerificationReport};
use crate::operator::build;
use crate::operator::catalog;
use crate::operator::cluster::Note;
use crate::operator::context::Shared;
use crate::operator::instance_client;
use crate::operator::object_store::archive_setting;

/// The condition's type, on the Backup and on the cluster.
pub const CONDITION: &str = "RestoreVerified";

/// Annotation that asks for a (new) verification of a completed Backup, whatever its
/// `spec.verify`; removed when the verification is done.
pub const ANNOTATION: &str = "castellan.io/verify";

/// Whether `backup` is to be verified (once completed).
pub fn wanted(backup: &Backup) -> bool {
    backup.spec.verify || backup.annotations().contains_key(ANNOTATION)
}

/// The field manager of the cluster's `RestoreVerified` condition (its own, so that the
/// other status this controller writes never drops it).
const CONDITION_MANAGER: &str = "castellan-verification";

/// A verification that has not reported by then has failed.
const LIMIT: Duration = Duration::from_secs(1800);

/// What the scratch instance looks like.
#[derive(Clone, Debug, PartialEq)]
pub enum Scratch {
    /// No scratch pod.
    Missing,
    /// A scratch pod verifying another Backup.
    Busy(String),
    /// Not answering yet (starting, or no address).
    Starting,
    Report(Box<StatusReport>),
}

#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Create the scratch volume and pod, and mark the verification started.
    Create,
    /// Send it the backup to restore.
    Restore,
    Wait,
    /// Record the verdict and delete the scratch instance.
    Finish(VerificationReport),
}

/// The next step, from since when it runs (`None`: not started) and the scratch
/// instance.
pub fn step(started: Option<SystemTime>, scratch: &Scratch, now: SystemTime) -> Step {
    let Some(started) = started else {
        return match scratch {
            Scratch::Busy(_) => Step::Wait,
            _ => Step::Create,
        };
    };
    let elapsed = now.duration_since(started).unwrap_or_default();
    if let Scratch::Report(report) = scratch
        && let Some(verdict) = &report.verification
    {
        return Step::Finish(verdict.clone());
    }
    if elapsed > LIMIT {
        return Step::Finish(VerificationReport {
            ok: false,
            message: format!(
                "the scratch instance did not finish within {} minutes",
                LIMIT.as_secs() / 60
            ),
            duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        });
    }
    match scratch {
        Scratch::Missing => Step::Create,
        Scratch::Report(report)
            if report.role.is_none() && report.restoring.is_none() && report.problem.is_none() =>
        {
            Step::Restore
        }
        _ => Step::Wait,
    }
}

/// When the verification started: the Backup's `RestoreVerified` condition while it is
/// `Unknown`; `Err(())` once it has a verdict.
fn started(backup: &Backup) -> Result<Option<SystemTime>, ()> {
    let condition = backup
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION));
    match condition {
        None => Ok(None),
        Some(c) if c.status == "Unknown" => Ok(Some(SystemTime::from(c.last_transition_time.0))),
        Some(_) => Err(()),
    }
}

fn condition(status: &str, reason: &str, message: String, generation: Option<i64>) -> Condition {
    Condition {
        type_: CONDITION.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}

/// One pass of the verification of `backup` (completed, `spec.verify`).
pub async fn verify(shared: &Shared, backup: &Backup, cluster: Option<&DatabaseCluster>) -> Action {
    let asked_again = backup.annotations().contains_key(ANNOTATION);
    let started = match started(backup) {
        Ok(started) => started,
        // A verdict exists: only the annotation asks for another.
        Err(()) if asked_again => None,
        Err(()) => return Action::await_change(),
    };
    let Some(cluster) = cluster else {
        return Action::requeue(machine::RETRY);
    };
    let client = &shared.client;
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
    let id = backup
        .status
        .as_ref()
        .and_then(|s| s.backup_id.clone())
        .unwrap_or_default();
    let name = build::scratch_name(cluster, &id);
    let scratch = observe(&pods, cluster, &name, &backup.name_any()).await;
    match step(started, &scratch, SystemTime::now()) {
        Step::Wait => {}
        Step::Create => {
            // The last verification's volume may still be going away.
            if let Ok(Some(old)) = claims.get_opt(&name).await
                && old.metadata.deletion_timestamp.is_some()
            {
                return Action::requeue(machine::POLL);
            }
            // The backup holds data of the version the cluster runs.
            let (version, image) = catalog::for_cluster(&shared.catalog(), cluster);
            let image = match image {
                Ok(image) => image,
                Err(why) => {
                    // The cluster's VersionAvailable says so too.
                    tracing::warn!(backup = %backup.name_any(), %why, "cannot verify the backup yet");
                    return Action::requeue(machine::POLL);
                }
            };
            let runs = build::Runs { image, version };
            let (claim, pod) =
                build::scratch(cluster, &backup.name_any(), &name, &runs, &shared.settings);
            for outcome in [
                claims
                    .create(&PostParams::default(), &claim)
                    .await
                    .map(|_| ()),
                pods.create(&PostParams::default(), &pod).await.map(|_| ()),
            ] {
                match outcome {
                    Ok(()) => {}
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(error) => {
                        tracing::warn!(%error, scratch = %name, "creating the scratch instance");
                        return Action::requeue(machine::RETRY);
                    }
                }
            }
            if started.is_none() {
                let mut status = backup.status.clone().unwrap_or_default();
                status.conditions.retain(|c| c.type_ != CONDITION);
                status.conditions.push(condition(
                    "Unknown",
                    "Verifying",
                    format!("restoring it into the scratch instance {name}"),
                    backup.metadata.generation,
                ));
                if let Err(error) = write_status(client, backup, &status).await {
                    tracing::warn!(%error, "marking the verification started");
                }
            }
        }
        Step::Restore => {
            if let Err(error) = send_restore(client, cluster, backup, &pods, &name).await {
                tracing::warn!(%error, scratch = %name, "sending the backup to the scratch instance");
            }
        }
        Step::Finish(verdict) => {
            finish(shared, backup, cluster, &verdict).await;
            let _ = pods.delete(&name, &DeleteParams::default()).await;
            let _ = claims.delete(&name, &DeleteParams::default()).await;
            if asked_again {
                let backups: Api<Backup> = Api::namespaced(client.clone(), &namespace);
                let patch = json!({"metadata": {"annotations": {ANNOTATION: null}}});
                if let Err(error) = backups
                    .patch(
                        &backup.name_any(),
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&patch),
                    )
                    .await
                {
                    tracing::warn!(%error, "removing the verification request");
                }
            }
            return Action::await_change();
        }
    }
    Action::requeue(machine::POLL)
}

/// The scratch instance `name` of `backup`; another live scratch instance of the
/// cluster (one verification at a time per cluster) makes it `Busy`.
async fn observe(pods: &Api<Pod>, cluster: &DatabaseCluster, name: &str, backup: &str) -> Scratch {
    let selector = format!("{}={}", build::VERIFY_LABEL, cluster.name_any());
    let scratches = match pods
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
    {
        Ok(list) => list.items,
        Err(_) => return Scratch::Starting,
    };
    let other = scratches.iter().find(|p| {
        p.name_any() != name
            && p.metadata.deletion_timestamp.is_none()
            && p.annotations()
                .get(build::VERIFYING_ANNOTATION)
                .map(String::as_str)
                != Some(backup)
    });
    if let Some(other) = other {
        return Scratch::Busy(other.name_any());
    }
    let Some(pod) = scratches.into_iter().find(|p| p.name_any() == name) else {
        return Scratch::Missing;
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Scratch::Busy(name.to_owned());
    }
    let Some(address) = instance_client::pod_address(cluster, &pod) else {
        return Scratch::Starting;
    };
    match instance_client::call("GET", &address, "/status", None).await {
        Ok(body) => serde_json::from_value::<StatusReport>(body)
            .map(|report| Scratch::Report(Box::new(report)))
            .unwrap_or(Scratch::Starting),
        Err(_) => Scratch::Starting,
    }
}

async fn send_restore(
    client: &kube::Client,
    cluster: &DatabaseCluster,
    backup: &Backup,
    pods: &Api<Pod>,
    name: &str,
) -> Result<(), String> {
    let source = archive_setting(client, cluster)
        .await?
        .target
        .ok_or("the cluster has no spec.backup any more")?;
    let status = backup.status.clone().unwrap_or_default();
    let request = RestoreRequest {
        source,
        system_id: status.system_identifier.unwrap_or_default(),
        backup_id: status.backup_id.unwrap_or_default(),
        target_time: None,
        target_lsn: None,
        verify: true,
    };
    let pod = pods
        .get(name)
        .await
        .map_err(|e| format!("reading pod {name}: {e}"))?;
    let address =
        instance_client::pod_address(cluster, &pod).ok_or("the scratch pod has no address")?;
    instance_client::call("POST", &address, "/restore", Some(&json!(request)))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The verdict on the Backup and the cluster, and an Event on both.
async fn finish(
    shared: &Shared,
    backup: &Backup,
    cluster: &DatabaseCluster,
    verdict: &VerificationReport,
) {
    let seconds = i64::try_from(verdict.duration_ms / 1000).unwrap_or(i64::MAX);
    let (status, reason, message) = if verdict.ok {
        (
            "True",
            "Verified",
            format!(
                "Backup {} restored into a scratch instance and replayed to the end of the archive in {seconds}s; {}",
                backup.name_any(),
                verdict.message
            ),
        )
    } else {
        (
            "False",
            "VerificationFailed",
            format!(
                "Backup {} could not be verified: {}",
                backup.name_any(),
                verdict.message
            ),
        )
    };
    let mut backup_status = backup.status.clone().unwrap_or_default();
    backup_status.conditions.retain(|c| c.type_ != CONDITION);
    backup_status.conditions.push(condition(
        status,
        reason,
        message.clone(),
        backup.metadata.generation,
    ));
    backup_status.verified_at = Some(machine::rfc3339(crate::instance_api::millis_since_epoch(
        SystemTime::now(),
    )));
    backup_status.verification_seconds = Some(seconds);
    if let Err(error) = write_status(&shared.client, backup, &backup_status).await {
        tracing::warn!(%error, "writing the verification's outcome");
    }
    let cluster_status = json!({"conditions": [condition(
        status,
        reason,
        message.clone(),
        cluster.metadata.generation,
    )]});
    if let Err(error) = crate::operator::cluster::pass::write_status_as(
        &shared.client,
        cluster,
        &cluster_status,
        CONDITION_MANAGER,
    )
    .await
    {
        tracing::warn!(%error, "writing RestoreVerified on the cluster");
    }
    let note = |message: String| {
        if verdict.ok {
            Note::normal("RestoreVerified", message)
        } else {
            Note::warning("RestoreVerificationFailed", message)
        }
    };
    shared.record(cluster, note(message.clone())).await;
    let mut reference = backup.object_ref(&());
    reference.namespace = backup.namespace();
    shared.record_at(&reference, note(message)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + seconds)
    }

    fn report(change: impl FnOnce(&mut StatusReport)) -> Scratch {
        let mut report = StatusReport::default();
        change(&mut report);
        Scratch::Report(Box::new(report))
    }

    #[test]
    fn a_verification_starts_by_creating_the_scratch_instance_unless_another_runs() {
        assert_eq!(step(None, &Scratch::Missing, at(0)), Step::Create);
        assert_eq!(
            step(None, &Scratch::Busy("other".into()), at(0)),
            Step::Wait
        );
    }

    #[test]
    fn the_backup_is_sent_once_the_scratch_instance_waits_for_it() {
        assert_eq!(step(Some(at(0)), &Scratch::Starting, at(5)), Step::Wait);
        assert_eq!(step(Some(at(0)), &report(|_| {}), at(5)), Step::Restore);
        let restoring = report(|r| r.restoring = Some("downloading".into()));
        assert_eq!(step(Some(at(0)), &restoring, at(5)), Step::Wait);
        // A scratch pod that vanished is made again.
        assert_eq!(step(Some(at(0)), &Scratch::Missing, at(5)), Step::Create);
    }

    #[test]
    fn the_verdict_finishes_it_and_silence_fails_it() {
        let verdict = VerificationReport {
            ok: true,
            message: "app: 120 catalog indexes intact".into(),
            duration_ms: 9000,
        };
        let done = report(|r| r.verification = Some(verdict.clone()));
        assert_eq!(step(Some(at(0)), &done, at(9)), Step::Finish(verdict));
        let Step::Finish(late) = step(Some(at(0)), &Scratch::Starting, at(1801)) else {
            panic!("a verification past its limit finishes");
        };
        assert!(!late.ok && late.message.contains("30 minutes"));
    }
}
