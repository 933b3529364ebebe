//! Major upgrades, as a machine over `status.upgrade`: raising `spec.version` stops
//! the instances cleanly, runs `pg_upgrade` in a pod of its own on the primary's
//! volume, starts the upgraded primary and copies the replicas from it; lowering it
//! back while the previous data is kept rolls the upgrade back. Every step is written
//! to status before it is acted on, so a new operator resumes from status; the
//! upgrade pod's commands are idempotent (`castellan upgrade`, `src/instance/upgrade.rs`).
//!
//! Safety: while the upgrade pod runs no instance pod exists, so no server runs on
//! either data directory except pg_upgrade's own; `pg_upgrade` runs with `--clone` or
//! `--copy`, never `--link`, so the old data directory stays valid until it is
//! forgotten; a failure before the upgraded server started leaves the old data as it
//! was, and the instances run the old version again (`Failed`).
//!
//! Pure: the pass (`pass.rs`) observes the upgrade pod and enacts the step.

use std::time::Duration;

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::{UpgradePolicy, UpgradeStatus};

use super::state::{Assessment, Note};
use super::switchover::SWITCHOVER_ANNOTATION as SWITCHOVER;
use crate::upgrade::report::{Method, Outcome, Report};

/// The condition a major upgrade is reported in.
pub const CONDITION: &str = "MajorUpgrade";

pub const STOPPING: &str = "Stopping";
pub const UPGRADING: &str = "Upgrading";
pub const STARTING: &str = "Starting";
pub const SUCCEEDED: &str = "Succeeded";
pub const FAILED: &str = "Failed";
pub const ROLLING_BACK: &str = "RollingBack";
pub const ROLLED_BACK: &str = "RolledBack";

pub const KEPT: &str = "Kept";
pub const REMOVED: &str = "Removed";

/// What the upgrade pod is asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Job {
    /// `pg_upgrade` from `from` to `to` on the volume of instance `instance`.
    Upgrade {
        instance: String,
        from: String,
        to: String,
    },
    /// Back to `to`'s kept data directory from `from`'s.
    Rollback {
        instance: String,
        from: String,
        to: String,
    },
    /// Remove the previous data directory (the rollback window ended).
    Forget { instance: String, version: String },
}

impl Job {
    pub fn instance(&self) -> &str {
        match self {
            Job::Upgrade { instance, .. }
            | Job::Rollback { instance, .. }
            | Job::Forget { instance, .. } => instance,
        }
    }
}

/// The upgrade pod as the pass found it.
#[derive(Clone, Debug, PartialEq)]
pub enum JobSeen {
    Absent,
    /// Created, not finished.
    Running,
    /// Finished: its exit status and the outcome its last log line reports.
    Finished {
        succeeded: bool,
        outcome: Report,
    },
}

/// What the pass knows for the step.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    pub cluster: &'a DatabaseCluster,
    /// The major the data is in (`status.version`), once known.
    pub data_version: Option<&'a str>,
    /// The spec's major has an image in the catalog (else `VersionAvailable` says why).
    pub target_available: bool,
    /// The instance that is primary.
    pub primary: String,
    /// Instance pods that exist (terminating ones included).
    pub instance_pods: usize,
    /// Every instance exists and is ready.
    pub all_ready: bool,
    pub job: JobSeen,
    /// Now, RFC 3339, and as seconds since the epoch.
    pub now: String,
    pub now_seconds: i64,
}

/// What the pass does for the upgrade, and the status it writes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    /// `status.upgrade` to write.
    pub status: Option<UpgradeStatus>,
    /// The data's major version to report (and to run) while an upgrade is under way.
    pub data_version: Option<String>,
    /// Delete every instance pod (their volumes stay).
    pub stop_instances: bool,
    /// Create no instance pods.
    pub hold_instances: bool,
    /// The upgrade pod to have.
    pub job: Option<Job>,
    /// Delete the (finished) upgrade pod.
    pub remove_job: bool,
    /// A Backup to create (a base backup of the upgraded cluster), by name.
    pub backup: Option<String>,
    /// The `MajorUpgrade` condition, once there is anything to say.
    pub condition: Option<Assessment>,
    pub notes: Vec<Note>,
}

fn major(version: &str) -> Option<u32> {
    version.parse().ok()
}

/// Whether the upgrade in `status` keeps the primary from being failed over: from the
/// stop of the instances until the upgraded ones are ready.
pub fn suspends_failover(cluster: &DatabaseCluster) -> bool {
    cluster
        .status
        .as_ref()
        .and_then(|s| s.upgrade.as_ref())
        .is_some_and(|u| {
            matches!(
                u.phase.as_str(),
                STOPPING | UPGRADING | STARTING | ROLLING_BACK
            )
        })
}

/// The next step, from the persisted `status.upgrade` and what the pass found.
pub fn step(facts: &Facts) -> Step {
    let cluster = facts.cluster;
    let current = cluster.status.as_ref().and_then(|s| s.upgrade.clone());
    let mut step = Step {
        status: current.clone(),
        condition: current.as_ref().map(settled_condition),
        ..Step::default()
    };
    let Some(upgrade) = current else {
        start(facts, None, &mut step);
        return step;
    };
    match upgrade.phase.as_str() {
        STOPPING => {
            step.data_version = Some(upgrade.from.clone());
            step.stop_instances = true;
            step.hold_instances = true;
            if facts.instance_pods == 0 {
                let mut next = upgrade.clone();
                next.phase = UPGRADING.to_owned();
                step.notes.push(Note::normal(
                    "UpgradeRunning",
                    format!(
                        "every instance stopped cleanly; running pg_upgrade from {} to {} on {}'s volume",
                        upgrade.from, upgrade.to, upgrade.instance
                    ),
                ));
                step.status = Some(next);
            }
            step.condition = Some(in_progress(&upgrade, "stopping every instance cleanly"));
        }
        UPGRADING => {
            step.data_version = Some(upgrade.from.clone());
            step.hold_instances = true;
            step.condition = Some(in_progress(&upgrade, "pg_upgrade runs"));
            match &facts.job {
                JobSeen::Running => {}
                JobSeen::Absent => {
                    step.job = Some(Job::Upgrade {
                        instance: upgrade.instance.clone(),
                        from: upgrade.from.clone(),
                        to: upgrade.to.clone(),
                    });
                }
                JobSeen::Finished { succeeded, outcome } => {
                    let mut next = upgrade.clone();
                    next.method = outcome.method.map(method_name).or(next.method);
                    if *succeeded && outcome.outcome == Outcome::Upgraded {
                        next.phase = STARTING.to_owned();
                        let sync = if crate::operator::build::synchronous(cluster) {
                            "; it takes writes as soon as it serves, before the replicas are \
                             copied from it: until one streams, commits wait for no standby \
                             (SynchronousReplication says when the quorum is back)"
                        } else {
                            ""
                        };
                        next.message = Some(format!(
                            "pg_upgrade --{} took {:.1}s; starting PostgreSQL {} on {}{sync}",
                            next.method.as_deref().unwrap_or("copy"),
                            outcome.seconds,
                            upgrade.to,
                            upgrade.instance
                        ));
                        step.data_version = Some(upgrade.to.clone());
                        step.notes.push(Note::normal(
                            "UpgradeStarting",
                            next.message.clone().unwrap_or_default(),
                        ));
                        step.condition = Some(in_progress(&next, "the upgraded primary starts"));
                    } else {
                        let why = &outcome.message;
                        next.phase = FAILED.to_owned();
                        next.finished_at = Some(facts.now.clone());
                        next.message = Some(format!(
                            "the upgrade from {} to {} failed and was rolled back: the instances run {} again on their untouched data. {why}",
                            upgrade.from, upgrade.to, upgrade.from
                        ));
                        step.notes.push(Note::warning(
                            "UpgradeFailed",
                            next.message.clone().unwrap_or_default(),
                        ));
                        step.condition = Some(settled_condition(&next));
                    }
                    step.status = Some(next);
                }
            }
        }
        STARTING => {
            step.data_version = Some(upgrade.to.clone());
            step.remove_job = facts.job != JobSeen::Absent;
            step.condition = Some(in_progress(
                &upgrade,
                "the upgraded primary starts and the replicas are copied from it",
            ));
            if facts.all_ready {
                let keep = UpgradePolicy::keep_previous_for(cluster.spec.upgrade.as_ref());
                let mut next = upgrade.clone();
                next.phase = SUCCEEDED.to_owned();
                next.finished_at = Some(facts.now.clone());
                next.previous = Some(KEPT.to_owned());
                next.previous_kept_until = Some(after(facts.now_seconds, keep));
                next.message = Some(format!(
                    "upgraded from {} to {} with pg_upgrade --{}; the {} data is kept until {} \
                     (setting version back to \"{}\" until then rolls back, losing the writes made since)",
                    upgrade.from,
                    upgrade.to,
                    next.method.as_deref().unwrap_or("copy"),
                    upgrade.from,
                    next.previous_kept_until.as_deref().unwrap_or_default(),
                    upgrade.from
                ));
                step.notes.push(Note::normal(
                    "UpgradeSucceeded",
                    next.message.clone().unwrap_or_default(),
                ));
                step.condition = Some(settled_condition(&next));
                step.status = Some(next);
            }
        }
        ROLLING_BACK => {
            step.data_version = Some(upgrade.to.clone());
            step.hold_instances = true;
            step.condition = Some(Assessment::new(
                false,
                "RollingBack",
                format!(
                    "rolling back from {} to the kept {} data: stopping the instances, then \
                     swapping the data directories",
                    upgrade.to, upgrade.from
                ),
            ));
            if facts.instance_pods > 0 {
                step.stop_instances = true;
            } else {
                match &facts.job {
                    JobSeen::Running => {}
                    JobSeen::Absent => {
                        step.job = Some(Job::Rollback {
                            instance: upgrade.instance.clone(),
                            from: upgrade.to.clone(),
                            to: upgrade.from.clone(),
                        });
                    }
                    JobSeen::Finished { succeeded, outcome } => {
                        let mut next = upgrade.clone();
                        if *succeeded && outcome.outcome == Outcome::RolledBack {
                            next.phase = ROLLED_BACK.to_owned();
                            next.previous = Some(REMOVED.to_owned());
                            next.previous_kept_until = None;
                            next.finished_at = Some(facts.now.clone());
                            next.message = Some(format!(
                                "rolled back to {} on the data kept from before the upgrade; \
                                 the writes made on {} are gone",
                                upgrade.from, upgrade.to
                            ));
                            step.data_version = Some(upgrade.from.clone());
                            step.notes.push(Note::normal(
                                "RolledBack",
                                next.message.clone().unwrap_or_default(),
                            ));
                        } else {
                            // Nothing was swapped: the upgraded data runs again, and a
                            // rollback is tried again only when the spec changes.
                            next.phase = SUCCEEDED.to_owned();
                            next.generation = cluster.metadata.generation;
                            next.message = Some(format!(
                                "the rollback to {} failed, and the instances run {} again: {}",
                                upgrade.from, upgrade.to, outcome.message
                            ));
                            step.notes.push(Note::warning(
                                "RollbackFailed",
                                next.message.clone().unwrap_or_default(),
                            ));
                        }
                        step.remove_job = true;
                        step.condition = Some(settled_condition(&next));
                        step.status = Some(next);
                    }
                }
            }
        }
        SUCCEEDED => {
            step.remove_job =
                facts.job != JobSeen::Absent && !matches!(facts.job, JobSeen::Running);
            let kept = upgrade.previous.as_deref() == Some(KEPT);
            let rollback_asked = kept
                && cluster.spec.version == upgrade.from
                && upgrade.generation != cluster.metadata.generation;
            if rollback_asked && facts.primary != upgrade.instance {
                // The kept data is on the volume of the instance that was primary
                // when the upgrade ran; rolled back anywhere else, the primary would
                // come back on another instance's data.
                step.condition = Some(Assessment::new(
                    false,
                    "RollbackWaiting",
                    format!(
                        "the rollback to {} waits: the data kept from before the upgrade is \
                         on {}'s volume, but {} is the primary since a failover; switch over \
                         first (kubectl annotate dbc {} {SWITCHOVER}={})",
                        upgrade.from,
                        upgrade.instance,
                        facts.primary,
                        cluster.metadata.name.as_deref().unwrap_or_default(),
                        upgrade.instance
                    ),
                ));
                return step;
            }
            if rollback_asked {
                let mut next = upgrade.clone();
                next.phase = ROLLING_BACK.to_owned();
                next.generation = cluster.metadata.generation;
                next.started_at = Some(facts.now.clone());
                next.finished_at = None;
                next.message = Some(format!(
                    "rolling back from {} to {}: the writes made since the upgrade are lost",
                    upgrade.to, upgrade.from
                ));
                step.notes.push(Note::warning(
                    "RollingBack",
                    next.message.clone().unwrap_or_default(),
                ));
                step.status = Some(next);
                step.data_version = Some(upgrade.to.clone());
                step.hold_instances = true;
                return step;
            }
            let expired = upgrade
                .previous_kept_until
                .as_deref()
                .and_then(seconds_of)
                .is_some_and(|until| facts.now_seconds >= until);
            if kept && expired {
                match &facts.job {
                    JobSeen::Finished {
                        succeeded: true,
                        outcome,
                    } if outcome.outcome == Outcome::Forgotten => {
                        let mut next = upgrade.clone();
                        next.previous = Some(REMOVED.to_owned());
                        next.previous_kept_until = None;
                        step.notes.push(Note::normal(
                            "PreviousDataRemoved",
                            format!(
                                "removed the {} data kept since the upgrade to {}: a rollback is no longer possible",
                                upgrade.from, upgrade.to
                            ),
                        ));
                        step.condition = Some(settled_condition(&next));
                        step.status = Some(next);
                        step.remove_job = true;
                    }
                    JobSeen::Finished { outcome, .. } => {
                        // Tried again after the pod is gone; the Warning says why.
                        step.notes.push(Note::warning(
                            "PreviousDataNotRemoved",
                            format!(
                                "could not remove the {} data kept since the upgrade: {}",
                                upgrade.from, outcome.message
                            ),
                        ));
                        step.remove_job = true;
                    }
                    JobSeen::Running => step.remove_job = false,
                    JobSeen::Absent => {
                        step.remove_job = false;
                        step.job = Some(Job::Forget {
                            instance: upgrade.instance.clone(),
                            version: upgrade.from.clone(),
                        });
                    }
                }
                return step;
            }
            // The archive of the old major is not one the upgraded cluster can be
            // restored from (it has another system identifier): a base backup starts
            // its own, when the cluster has an object store.
            if cluster.spec.backup.is_some()
                && upgrade.backup.is_none()
                && facts.data_version == Some(upgrade.to.as_str())
            {
                let name = backup_name(cluster, &upgrade);
                let mut next = upgrade.clone();
                next.backup = Some(name.clone());
                step.notes.push(Note::normal(
                    "UpgradeBackup",
                    format!(
                        "taking a base backup of the upgraded cluster (Backup {name}): the \
                         backups and WAL archived before the upgrade restore {} only",
                        upgrade.from
                    ),
                ));
                step.backup = Some(name);
                step.status = Some(next);
            }
            start(facts, Some(&upgrade), &mut step);
        }
        _ => {
            // Failed or RolledBack: the pod goes; a new upgrade may start.
            step.remove_job =
                facts.job != JobSeen::Absent && !matches!(facts.job, JobSeen::Running);
            start(facts, Some(&upgrade), &mut step);
        }
    }
    step
}

/// Starts an upgrade when the spec asks for a higher major than the data's, the
/// cluster is ready and the new major has an image. A failed upgrade is tried again
/// only once the spec changed.
fn start(facts: &Facts, last: Option<&UpgradeStatus>, step: &mut Step) {
    let cluster = facts.cluster;
    let wanted = cluster.spec.version.as_str();
    let Some(data) = facts.data_version else {
        return;
    };
    let (Some(from), Some(to)) = (major(data), major(wanted)) else {
        return;
    };
    if to <= from {
        return;
    }
    if last.is_some_and(|l| {
        l.phase == FAILED && l.to == wanted && l.generation == cluster.metadata.generation
    }) {
        return;
    }
    if last.is_some_and(|l| l.previous.as_deref() == Some(KEPT)) {
        step.condition = Some(Assessment::new(
            false,
            "PreviousDataKept",
            "a new major upgrade waits until the data kept from the last one is removed \
             (its upgrade.keepPreviousFor ends, or set it to 0s)",
        ));
        return;
    }
    if !facts.target_available {
        // VersionAvailable says why.
        return;
    }
    if !facts.all_ready {
        step.condition = Some(Assessment::new(
            false,
            "WaitingForInstances",
            format!(
                "the upgrade from {from} to {to} starts once every instance is ready: \
                 pg_upgrade needs a cleanly stopped primary, and the replicas are copied from it after"
            ),
        ));
        return;
    }
    let next = UpgradeStatus {
        from: data.to_owned(),
        to: wanted.to_owned(),
        phase: STOPPING.to_owned(),
        instance: facts.primary.clone(),
        method: None,
        generation: cluster.metadata.generation,
        started_at: Some(facts.now.clone()),
        finished_at: None,
        message: Some(format!(
            "upgrading from {from} to {to}: writes stop until the upgraded primary serves"
        )),
        previous: None,
        previous_kept_until: None,
        backup: None,
    };
    step.notes.push(Note::normal(
        "UpgradeStarted",
        format!(
            "major upgrade from {from} to {to} on {}'s volume: stopping every instance cleanly first",
            facts.primary
        ),
    ));
    step.condition = Some(in_progress(&next, "stopping every instance cleanly"));
    step.data_version = Some(data.to_owned());
    // The instances stop in the next pass, once the step is written: a new operator
    // that finds no step finds them running.
    step.status = Some(next);
}

/// How `status.upgrade.method` names a method.
fn method_name(method: Method) -> String {
    match method {
        Method::Clone => "clone",
        Method::Copy => "copy",
    }
    .to_owned()
}

/// The name of the Backup taken after an upgrade: the same on every pass that decides
/// it, so a pass whose status write was lost finds it made.
pub fn backup_name(cluster: &DatabaseCluster, upgrade: &UpgradeStatus) -> String {
    format!(
        "{}-pg{}-{}",
        cluster.metadata.name.as_deref().unwrap_or_default(),
        upgrade.to,
        upgrade.generation.unwrap_or_default()
    )
}

fn in_progress(upgrade: &UpgradeStatus, doing: &str) -> Assessment {
    Assessment::new(
        false,
        "Upgrading",
        format!(
            "upgrading from {} to {}: {doing} (step {})",
            upgrade.from, upgrade.to, upgrade.phase
        ),
    )
}

/// The condition of an upgrade at rest.
fn settled_condition(upgrade: &UpgradeStatus) -> Assessment {
    let message = upgrade.message.clone().unwrap_or_default();
    match upgrade.phase.as_str() {
        SUCCEEDED => Assessment::new(true, "Succeeded", message),
        FAILED => Assessment::new(false, "UpgradeFailed", message),
        ROLLED_BACK => Assessment::new(true, "RolledBack", message),
        _ => in_progress(upgrade, "under way"),
    }
}

/// `now + keep`, RFC 3339.
fn after(now_seconds: i64, keep: Duration) -> String {
    let seconds = now_seconds.saturating_add(i64::try_from(keep.as_secs()).unwrap_or(i64::MAX));
    k8s_openapi::jiff::Timestamp::from_second(seconds)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn seconds_of(text: &str) -> Option<i64> {
    text.parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .map(|t| t.as_second())
}

#[cfg(test)]
mod tests {
    use super::*;
    use castellan_crds::DatabaseClusterStatus;

    const NOW: i64 = 1_800_000_000;

    fn cluster(version: &str, generation: i64, upgrade: Option<UpgradeStatus>) -> DatabaseCluster {
        let mut cluster: DatabaseCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "DatabaseCluster",
            "metadata": {"name": "db", "namespace": "shop", "generation": generation},
            "spec": {"engine": "postgresql", "version": version, "replicas": 3,
                     "storage": {"size": "1Gi"}},
        }))
        .expect("a cluster");
        cluster.status = Some(DatabaseClusterStatus {
            version: Some("15".to_owned()),
            upgrade,
            ..DatabaseClusterStatus::default()
        });
        cluster
    }

    fn upgrade(phase: &str) -> UpgradeStatus {
        UpgradeStatus {
            from: "15".into(),
            to: "18".into(),
            phase: phase.into(),
            instance: "db-2".into(),
            generation: Some(2),
            ..UpgradeStatus::default()
        }
    }

    fn facts(cluster: &DatabaseCluster) -> Facts<'_> {
        Facts {
            cluster,
            data_version: cluster.status.as_ref().and_then(|s| s.version.as_deref()),
            target_available: true,
            primary: "db-2".into(),
            instance_pods: 3,
            all_ready: true,
            job: JobSeen::Absent,
            now: "2027-01-15T08:00:00Z".into(),
            now_seconds: NOW,
        }
    }

    fn finished(succeeded: bool, outcome: Outcome, message: Option<&str>) -> JobSeen {
        JobSeen::Finished {
            succeeded,
            outcome: Report {
                outcome,
                method: Some(Method::Clone),
                seconds: 1.5,
                message: message.unwrap_or_default().to_owned(),
            },
        }
    }

    fn phase(step: &Step) -> Option<&str> {
        step.status.as_ref().map(|u| u.phase.as_str())
    }

    fn reasons(step: &Step) -> Vec<&'static str> {
        step.notes.iter().map(|n| n.reason).collect()
    }

    #[test]
    fn nothing_happens_while_the_spec_asks_for_the_data_s_version() {
        let cluster = cluster("15", 1, None);
        assert_eq!(step(&facts(&cluster)), Step::default());
    }

    #[test]
    fn a_raised_version_starts_with_the_step_written_before_anything_stops() {
        let cluster = cluster("18", 2, None);
        let step = step(&facts(&cluster));
        assert_eq!(phase(&step), Some(STOPPING));
        let written = step.status.as_ref().expect("a step");
        assert_eq!((written.from.as_str(), written.to.as_str()), ("15", "18"));
        assert_eq!(written.instance, "db-2");
        assert_eq!(written.generation, Some(2));
        assert!(!step.stop_instances && !step.hold_instances);
        assert_eq!(step.data_version.as_deref(), Some("15"));
        assert_eq!(reasons(&step), ["UpgradeStarted"]);
    }

    #[test]
    fn an_upgrade_waits_for_ready_instances_and_an_image() {
        let cluster = cluster("18", 2, None);
        let waiting = step(&Facts {
            all_ready: false,
            ..facts(&cluster)
        });
        assert_eq!(waiting.status, None);
        assert_eq!(
            waiting.condition.map(|c| c.reason),
            Some("WaitingForInstances")
        );
        let no_image = step(&Facts {
            target_available: false,
            ..facts(&cluster)
        });
        assert_eq!(no_image.status, None);
        let unknown = step(&Facts {
            data_version: None,
            ..facts(&cluster)
        });
        assert_eq!(unknown.status, None);
    }

    #[test]
    fn stopping_deletes_the_instances_and_moves_on_once_they_are_gone() {
        let cluster = cluster("18", 2, Some(upgrade(STOPPING)));
        let stopping = step(&facts(&cluster));
        assert!(stopping.stop_instances && stopping.hold_instances);
        assert_eq!(phase(&stopping), Some(STOPPING));
        let stopped = step(&Facts {
            instance_pods: 0,
            ..facts(&cluster)
        });
        assert_eq!(phase(&stopped), Some(UPGRADING));
        assert_eq!(reasons(&stopped), ["UpgradeRunning"]);
        assert_eq!(stopped.job, None, "the pod starts once the step is written");
    }

    #[test]
    fn upgrading_runs_one_pod_and_holds_the_instances() {
        let cluster = cluster("18", 2, Some(upgrade(UPGRADING)));
        let absent = step(&Facts {
            instance_pods: 0,
            ..facts(&cluster)
        });
        assert_eq!(
            absent.job,
            Some(Job::Upgrade {
                instance: "db-2".into(),
                from: "15".into(),
                to: "18".into()
            })
        );
        assert!(absent.hold_instances);
        let running = step(&Facts {
            instance_pods: 0,
            job: JobSeen::Running,
            ..facts(&cluster)
        });
        assert_eq!(
            (running.job, running.status),
            (None, Some(upgrade(UPGRADING)))
        );
    }

    #[test]
    fn a_successful_pg_upgrade_moves_the_data_version_and_starts_the_new_primary() {
        let cluster = cluster("18", 2, Some(upgrade(UPGRADING)));
        let done = step(&Facts {
            instance_pods: 0,
            job: finished(true, Outcome::Upgraded, None),
            ..facts(&cluster)
        });
        assert_eq!(phase(&done), Some(STARTING));
        assert_eq!(done.data_version.as_deref(), Some("18"));
        assert_eq!(
            done.status.as_ref().and_then(|u| u.method.as_deref()),
            Some("clone")
        );
        assert!(done.hold_instances, "pods start once Starting is written");
        assert_eq!(reasons(&done), ["UpgradeStarting"]);
    }

    #[test]
    fn a_failed_pg_upgrade_goes_back_to_the_old_version_and_is_not_retried_until_the_spec_changes()
    {
        let cluster = cluster("18", 2, Some(upgrade(UPGRADING)));
        let failed = step(&Facts {
            instance_pods: 0,
            job: finished(
                false,
                Outcome::Failed,
                Some("pg_upgrade --check: plpython3u is missing"),
            ),
            ..facts(&cluster)
        });
        assert_eq!(phase(&failed), Some(FAILED));
        assert_eq!(failed.data_version.as_deref(), Some("15"));
        let condition = failed.condition.clone().expect("a condition");
        assert_eq!(
            (condition.status, condition.reason),
            (false, "UpgradeFailed")
        );
        assert!(
            condition.message.contains("plpython3u"),
            "{}",
            condition.message
        );
        assert_eq!(reasons(&failed), ["UpgradeFailed"]);
        // A pod that failed is a failure whatever its log says.
        let silent = step(&Facts {
            instance_pods: 0,
            job: finished(false, Outcome::Upgraded, None),
            ..facts(&cluster)
        });
        assert_eq!(phase(&silent), Some(FAILED));

        // Written: the pod goes, the instances come back on 15, nothing starts again…
        let cluster = self::cluster("18", 2, failed.status.clone());
        let after = step(&Facts {
            job: finished(false, Outcome::Failed, None),
            ..facts(&cluster)
        });
        assert!(after.remove_job && !after.hold_instances);
        assert_eq!(phase(&after), Some(FAILED));
        // … until the spec changes (say, a fixed catalog entry and a touched spec).
        let cluster = self::cluster("18", 3, failed.status);
        assert_eq!(phase(&step(&facts(&cluster))), Some(STOPPING));
    }

    #[test]
    fn starting_removes_the_pod_and_succeeds_once_every_instance_is_ready() {
        let cluster = cluster("18", 2, Some(upgrade(STARTING)));
        let starting = step(&Facts {
            all_ready: false,
            job: finished(true, Outcome::Upgraded, None),
            ..facts(&cluster)
        });
        assert!(starting.remove_job && !starting.hold_instances);
        assert_eq!(starting.data_version.as_deref(), Some("18"));
        assert_eq!(phase(&starting), Some(STARTING));
        let ready = step(&facts(&cluster));
        assert_eq!(phase(&ready), Some(SUCCEEDED));
        let written = ready.status.expect("a step");
        assert_eq!(written.previous.as_deref(), Some(KEPT));
        // The default window: a day.
        assert_eq!(
            written.previous_kept_until.as_deref(),
            Some("2027-01-16T08:00:00Z")
        );
        assert_eq!(reasons(&step(&facts(&cluster))), ["UpgradeSucceeded"]);
    }

    #[test]
    fn an_upgraded_cluster_with_an_object_store_gets_a_fresh_base_backup_once() {
        let mut succeeded = upgrade(SUCCEEDED);
        succeeded.previous = Some(KEPT.into());
        succeeded.previous_kept_until = Some("2027-01-16T08:00:00Z".into());
        let mut cluster = cluster("18", 2, Some(succeeded.clone()));
        cluster.status.as_mut().expect("status").version = Some("18".into());
        assert_eq!(step(&facts(&cluster)).backup, None, "no object store");
        cluster.spec.backup = serde_json::from_value(serde_json::json!({
            "endpoint": "http://s3.example.com", "bucket": "backups",
            "credentials": {"secretName": "s3"},
        }))
        .expect("a backup target");
        let first = step(&facts(&cluster));
        assert_eq!(first.backup.as_deref(), Some("db-pg18-2"));
        assert_eq!(
            first.status.as_ref().and_then(|u| u.backup.as_deref()),
            Some("db-pg18-2")
        );
        assert_eq!(reasons(&first), ["UpgradeBackup"]);
        cluster.status.as_mut().expect("status").upgrade = first.status;
        assert_eq!(step(&facts(&cluster)).backup, None, "once");
    }

    #[test]
    fn the_window_ends_with_the_previous_data_removed() {
        let mut succeeded = upgrade(SUCCEEDED);
        succeeded.previous = Some(KEPT.into());
        succeeded.previous_kept_until = Some("2027-01-15T07:00:00Z".into());
        let cluster = cluster("18", 2, Some(succeeded.clone()));
        let forget = step(&facts(&cluster));
        assert_eq!(
            forget.job,
            Some(Job::Forget {
                instance: "db-2".into(),
                version: "15".into()
            })
        );
        assert!(
            !forget.hold_instances,
            "the instances keep running meanwhile"
        );
        let forgotten = step(&Facts {
            job: finished(true, Outcome::Forgotten, None),
            ..facts(&cluster)
        });
        assert_eq!(
            forgotten
                .status
                .as_ref()
                .and_then(|u| u.previous.as_deref()),
            Some(REMOVED)
        );
        assert!(forgotten.remove_job);
        assert_eq!(reasons(&forgotten), ["PreviousDataRemoved"]);
        let failed = step(&Facts {
            job: finished(false, Outcome::Failed, Some("permission denied")),
            ..facts(&cluster)
        });
        assert!(failed.remove_job, "tried again with a new pod");
        assert_eq!(reasons(&failed), ["PreviousDataNotRemoved"]);

        // Within the window nothing is removed.
        succeeded.previous_kept_until = Some("2027-01-15T09:00:00Z".into());
        let cluster = self::cluster("18", 2, Some(succeeded));
        assert_eq!(step(&facts(&cluster)).job, None);
    }

    #[test]
    fn lowering_the_version_inside_the_window_rolls_back() {
        let mut succeeded = upgrade(SUCCEEDED);
        succeeded.previous = Some(KEPT.into());
        succeeded.previous_kept_until = Some("2027-01-16T08:00:00Z".into());
        let mut cluster = cluster("15", 3, Some(succeeded.clone()));
        cluster.status.as_mut().expect("status").version = Some("18".into());
        let asked = step(&facts(&cluster));
        assert_eq!(phase(&asked), Some(ROLLING_BACK));
        assert!(asked.hold_instances && !asked.stop_instances);
        assert_eq!(reasons(&asked), ["RollingBack"]);

        let mut rolling = cluster.clone();
        rolling.status.as_mut().expect("status").upgrade = asked.status.clone();
        let stopping = step(&facts(&rolling));
        assert!(stopping.stop_instances && stopping.job.is_none());
        let stopped = step(&Facts {
            instance_pods: 0,
            ..facts(&rolling)
        });
        assert_eq!(
            stopped.job,
            Some(Job::Rollback {
                instance: "db-2".into(),
                from: "18".into(),
                to: "15".into()
            })
        );
        let rolled = step(&Facts {
            instance_pods: 0,
            job: finished(true, Outcome::RolledBack, None),
            ..facts(&rolling)
        });
        assert_eq!(phase(&rolled), Some(ROLLED_BACK));
        assert_eq!(rolled.data_version.as_deref(), Some("15"));
        assert_eq!(reasons(&rolled), ["RolledBack"]);
        let refused = step(&Facts {
            instance_pods: 0,
            job: finished(false, Outcome::Failed, Some("no previous data")),
            ..facts(&rolling)
        });
        assert_eq!(phase(&refused), Some(SUCCEEDED));
        assert_eq!(reasons(&refused), ["RollbackFailed"]);
        assert!(refused.remove_job);
        // Not tried again for the same spec.
        rolling.status.as_mut().expect("status").upgrade = refused.status;
        assert_eq!(phase(&step(&facts(&rolling))), Some(SUCCEEDED));
    }

    #[test]
    fn a_rollback_after_a_failover_waits_for_the_kept_data_s_instance_to_be_primary() {
        let mut succeeded = upgrade(SUCCEEDED);
        succeeded.previous = Some(KEPT.into());
        succeeded.previous_kept_until = Some("2027-01-16T08:00:00Z".into());
        let mut cluster = cluster("15", 3, Some(succeeded));
        cluster.status.as_mut().expect("status").version = Some("18".into());
        let waiting = step(&Facts {
            primary: "db-3".into(),
            ..facts(&cluster)
        });
        assert_eq!(phase(&waiting), Some(SUCCEEDED));
        assert!(!waiting.hold_instances && !waiting.stop_instances);
        let condition = waiting.condition.expect("a condition");
        assert_eq!(condition.reason, "RollbackWaiting");
        assert!(
            condition
                .message
                .contains("castellan.io/switchover-to=db-2"),
            "{}",
            condition.message
        );
        // Switched over: it goes.
        assert_eq!(phase(&step(&facts(&cluster))), Some(ROLLING_BACK));
    }

    #[test]
    fn a_new_upgrade_waits_for_the_kept_data_to_go() {
        let mut succeeded = upgrade(SUCCEEDED);
        succeeded.to = "16".into();
        succeeded.previous = Some(KEPT.into());
        succeeded.previous_kept_until = Some("2027-01-16T08:00:00Z".into());
        let mut cluster = cluster("18", 3, Some(succeeded));
        cluster.status.as_mut().expect("status").version = Some("16".into());
        let waiting = step(&facts(&cluster));
        assert_eq!(phase(&waiting), Some(SUCCEEDED));
        assert_eq!(
            waiting.condition.map(|c| c.reason),
            Some("PreviousDataKept")
        );
    }

    #[test]
    fn failover_waits_while_the_instances_are_down_for_the_upgrade() {
        for (phase, suspends) in [
            (STOPPING, true),
            (UPGRADING, true),
            (STARTING, true),
            (ROLLING_BACK, true),
            (SUCCEEDED, false),
            (FAILED, false),
            (ROLLED_BACK, false),
        ] {
            assert_eq!(
                suspends_failover(&cluster("18", 2, Some(upgrade(phase)))),
                suspends,
                "{phase}"
            );
        }
        assert!(!suspends_failover(&cluster("18", 2, None)));
    }
}
