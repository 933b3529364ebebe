//! Continuous WAL archiving as the cluster machine sees it: the `ContinuousArchiving`
//! condition, decided from the primary's archive report, and its Events. The setting
//! itself (object store and credentials) is read by the pass and sent to every
//! instance with `Command::Reload` (`machine::plan_commands`).

use super::state::{Assessment, ClusterEffect, ClusterState, Note, primary};
use crate::instance_api::{ArchiveConfig, ArchiveReport};
use crate::operator::build;

/// The archive setting every instance should have, once the pass has read it.
pub fn wanted_archive(state: &ClusterState) -> Option<&ArchiveConfig> {
    state.archive.as_ref()?.as_ref().ok()
}

/// `ContinuousArchiving`, with `spec.backup` set; `None` without it (or before the
/// first pass read it). It follows the primary's report: the primary archives every
/// segment the cluster writes (the replicas only fill gaps).
pub fn archive_assessment(state: &ClusterState) -> Option<Assessment> {
    let wanted = match state.archive.as_ref()? {
        Err(reason) => return Some(Assessment::new(false, "CredentialsUnavailable", reason)),
        Ok(wanted) => wanted,
    };
    wanted.target.as_ref()?;
    let Some((name, report)) = primary_report(state) else {
        return Some(Assessment::new(
            false,
            "PrimaryUnknown",
            "waiting for the primary's report on archiving",
        ));
    };
    if report.fingerprint.as_deref() != Some(wanted.fingerprint.as_str()) {
        return Some(Assessment::new(
            false,
            "Configuring",
            format!("sending the object store setting to {name}"),
        ));
    }
    if report.failing() {
        return Some(Assessment::new(
            false,
            "ArchivingFailing",
            format!(
                "{name} cannot archive WAL ({}); {} completed WAL files wait on its volume and none is removed before it is archived",
                report.last_failure.as_deref().unwrap_or("no reason given"),
                report.waiting
            ),
        ));
    }
    Some(Assessment::new(
        true,
        "Archiving",
        match &report.last_archived {
            Some(file) => format!(
                "{name} archives WAL: last {file}, {} waiting",
                report.waiting
            ),
            None => format!(
                "{name} archives WAL: nothing completed yet, {} waiting",
                report.waiting
            ),
        },
    ))
}

/// Size of a WAL segment (PostgreSQL's default, which Castellan does not change).
const SEGMENT_BYTES: u64 = 16 << 20;

/// When the WAL waiting on the primary's volume for the archive reaches a quarter of
/// the volume (as `max_slot_wal_keep_size` allows a slot), a Warning says the volume
/// will fill if archiving does not resume: nothing is ever removed before it is
/// archived, so this is the time to act. Once per episode.
fn warn_when_wal_piles_up(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let Some(cluster) = state.cluster.as_ref() else {
        return;
    };
    let limit = build::slot_wal_limit_bytes(cluster);
    let Some((name, report)) = primary_report(state) else {
        return;
    };
    let waiting = u64::from(report.waiting) * SEGMENT_BYTES;
    let piling = report.failing() && waiting >= limit;
    if piling && !state.wal_piling {
        effects.push(ClusterEffect::Record(Note::warning(
            "WALPilingUp",
            format!(
                "{} completed WAL files ({} MiB) wait on {name}'s {} volume because archiving fails: it fills if archiving does not resume (WAL is never removed before it is archived)",
                report.waiting,
                waiting >> 20,
                cluster.spec.storage.size
            ),
        )));
    }
    // The episode ends when archiving works again, not when the pile shrinks below the
    // limit while it still fails.
    if !report.failing() || piling {
        state.wal_piling = piling;
    }
}

/// The primary's name and archive report, when its latest view is reachable.
fn primary_report(state: &ClusterState) -> Option<(String, ArchiveReport)> {
    let (name, _) = primary(state)?;
    let view = state.views.get(name).filter(|view| view.reachable)?;
    Some((name.clone(), view.archive.clone()))
}

/// Records an Event when archiving starts failing (Warning) or works again, and says
/// whether the condition's status flipped (status is then written again).
pub fn archiving_changed(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) -> bool {
    let Some(assessment) = archive_assessment(state) else {
        return state.archiving_ok.take().is_some();
    };
    warn_when_wal_piles_up(state, effects);
    // Waiting for a report or a setting is not a failure worth an Event.
    if matches!(assessment.reason, "PrimaryUnknown" | "Configuring") {
        return false;
    }
    assessment.record_flip(&mut state.archiving_ok, "ArchivingResumed", effects)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;
    use crate::instance_api::{ArchiveReport, ArchiveTarget};
    use crate::operator::cluster::ClusterEvent;
    use crate::operator::replica::Command;

    fn on() -> ArchiveConfig {
        ArchiveConfig::new(Some(ArchiveTarget {
            endpoint: "http://127.0.0.1:9000".into(),
            bucket: "castellan".into(),
            prefix: "ns/db".into(),
            region: None,
            access_key_id: "id".into(),
            secret_access_key: "secret".into(),
            ca_bundle: None,
        }))
    }

    fn archived(fingerprint: &str, ok_ms: u64, failed_ms: Option<u64>) -> ArchiveReport {
        ArchiveReport {
            fingerprint: Some(fingerprint.to_owned()),
            last_archived: Some("000000010000000000000003".into()),
            last_archived_ms: Some(ok_ms),
            last_failure: failed_ms.map(|_| "storing: connection refused".to_owned()),
            last_failed_ms: failed_ms,
            waiting: 2,
        }
    }

    #[test]
    fn without_a_backup_setting_there_is_no_condition() {
        let mut state = settled(cluster(2, false, &[]), 2);
        assert_eq!(archive_assessment(&state), None);
        state.archive = Some(Ok(ArchiveConfig::new(None)));
        assert_eq!(archive_assessment(&state), None);
    }

    #[test]
    fn missing_credentials_are_the_condition() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Err("Secret s3 has no key accessKeyId".into()));
        let assessment = archive_assessment(&state).expect("a condition");
        assert_eq!(
            (assessment.status, assessment.reason),
            (false, "CredentialsUnavailable")
        );
    }

    #[test]
    fn every_instance_gets_the_setting_by_reload() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Ok(on()));
        let (_, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert!(
            commands(&effects)
                .iter()
                .any(|(name, command)| name == "db-2"
                    && matches!(command, Command::Reload { archive: Some(a), .. } if **a == on())),
            "{effects:?}"
        );
    }

    #[test]
    fn an_instance_with_the_setting_gets_no_reload_for_it() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Ok(on()));
        let mut replica = view("db-2", &[]);
        replica.archive = archived(&on().fingerprint, 1, None);
        let (_, effects) = step(state, ClusterEvent::Observed(replica));
        assert!(
            !commands(&effects).iter().any(|(name, _)| name == "db-2"),
            "{effects:?}"
        );
    }

    #[test]
    fn failing_archiving_is_a_warning_once_and_its_recovery_an_event() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Ok(on()));
        let fingerprint = on().fingerprint;
        let mut primary = primary_view(&["db-2"], "");
        primary.archive = archived(&fingerprint, 1, None);
        let (state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert!(notes(&effects).is_empty(), "healthy: no Event");
        assert_eq!(
            archive_assessment(&state).map(|a| a.reason),
            Some("Archiving")
        );

        // The pass that wrote the healthy condition has finished.
        let mut state = state;
        state.converging = false;
        primary.archive = archived(&fingerprint, 1, Some(2));
        let (state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert_eq!(notes(&effects), vec!["ArchivingFailing"]);
        assert!(
            converge_order(&effects)
                .and_then(|o| o.archive_condition.clone())
                .is_some_and(|a| !a.status),
            "status is written with the failure"
        );
        let (state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert!(notes(&effects).is_empty(), "one Warning, not one per poll");

        primary.archive = archived(&fingerprint, 3, Some(2));
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert_eq!(notes(&effects), vec!["ArchivingResumed"]);
    }

    #[test]
    fn wal_piling_up_to_a_quarter_of_the_volume_is_a_warning_once() {
        // 1Gi volumes: a quarter is 16 segments.
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Ok(on()));
        let fingerprint = on().fingerprint;
        let mut primary = primary_view(&["db-2"], "");
        primary.archive = archived(&fingerprint, 1, Some(2));
        primary.archive.waiting = 15;
        let (mut state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert_eq!(notes(&effects), vec!["ArchivingFailing"]);
        state.converging = false;
        primary.archive.waiting = 16;
        let (state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert_eq!(notes(&effects), vec!["WALPilingUp"]);
        primary.archive.waiting = 20;
        let (state, effects) = step(state, ClusterEvent::Observed(primary.clone()));
        assert!(notes(&effects).is_empty(), "once per episode");
        // Archiving works again: the next pile-up is a new episode.
        primary.archive = archived(&fingerprint, 3, Some(2));
        let (state, _) = step(state, ClusterEvent::Observed(primary.clone()));
        assert!(!state.wal_piling);
    }

    #[test]
    fn a_primary_without_the_setting_yet_is_configuring_not_failing() {
        let mut state = settled(cluster(2, false, &[]), 2);
        state.archive = Some(Ok(on()));
        let mut primary = primary_view(&["db-2"], "");
        primary.archive = ArchiveReport::default();
        let (state, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(notes(&effects).is_empty());
        assert_eq!(
            archive_assessment(&state).map(|a| a.reason),
            Some("Configuring")
        );
    }
}
