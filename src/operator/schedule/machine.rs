//! What a `BackupSchedule` should do now, decided without I/O: whether to create a
//! `Backup` (and which), which of the schedule's `Backup`s retention removes, the
//! schedule's new status, the Events to record and when to look again. The shell
//! (`mod.rs`) reads the schedule and its Backups, calls [`decide`] and carries the
//! [`Decision`] out.
//!
//! The rules, which `docs/backups.md` explains to users:
//! - **Slots** are the times the cron expression names in `timeZone` (croner with jiff's
//!   time zones: a time skipped by a spring-forward change runs at the first instant
//!   after it, a time repeated by a fall-back change runs once, at the first of the
//!   two, as Vixie cron does).
//! - **Due:** `status.nextScheduleTime` is the first slot not handled yet, so a slot is
//!   due once `now` reaches it. It is persisted, so a restarted operator knows what it
//!   missed. A new schedule's first slot is the first one after its creation; an
//!   edited spec (a new cron, a new time zone, `suspend` turned off) starts from now:
//!   slots before the edit are not owed.
//! - **Catch-up:** however many slots passed while the operator was down, one Backup is
//!   made, for the latest of them.
//! - **Skip:** while one of the schedule's Backups is `Pending` or `Running` (or has no
//!   phase yet), a due slot is skipped (a `BackupSkipped` Warning) rather than
//!   queued: two base backups of one cluster at once only slow each other down.
//! - **Immediate:** `immediate: true` makes one Backup when the schedule is first seen,
//!   at that second, instead of waiting for the first slot.
//! - **Retention** is [`prune`].

use std::time::Duration;

use castellan_crds::backup::BackupMethod;
use castellan_crds::retention::Retention;
use castellan_crds::{Backup, BackupScheduleSpec, BackupScheduleStatus, BackupSpec};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::ResourceExt;

use super::super::cluster::Note;
use crate::cadence::Cadence;
use crate::kube_ops::CLUSTER_LABEL;

/// Label on every Backup a schedule creates: the schedule's name. The schedule finds
/// its Backups by it (they carry no owner reference, see [`backup`]).
pub const SCHEDULE_LABEL: &str = "castellan.io/schedule";
/// Annotation on every Backup a schedule creates: the schedule's uid. A schedule
/// deleted and created again under the same name finds its predecessor's Backups by
/// the label (and applies its retention to them), but only its own by this, which is
/// how `immediate` knows whether it has acted: timestamps have whole seconds, and a
/// predecessor's Backup can share the new schedule's second.
pub const SCHEDULE_UID_ANNOTATION: &str = "castellan.io/schedule-uid";

/// The condition this machine keeps.
pub const READY: &str = "Ready";

/// The verdict of a restore verification (`operator::backup::verify`).
pub const RESTORE_VERIFIED: &str = "RestoreVerified";
/// `Ready` False: the cron expression or the time zone cannot be used.
pub const INVALID_SCHEDULE: &str = "InvalidSchedule";
/// `Ready` True: backups are made on schedule.
pub const SCHEDULED: &str = "Scheduled";
/// `Ready` True: no new backups while `suspend` is set.
pub const SUSPENDED: &str = "Suspended";

/// Event reasons. Each Event about one Backup names it as its related object: the
/// Events of one reason on one schedule are otherwise one series, whose message is
/// the first one's.
pub const BACKUP_CREATED: &str = "BackupCreated";
pub const BACKUP_SKIPPED: &str = "BackupSkipped";
pub const BACKUP_PRUNED: &str = "BackupPruned";
pub const INVALID_RETENTION: &str = "InvalidRetention";

const BACKUP_API_VERSION: &str = "castellan.io/v1alpha1";

/// Look again at least this often, even when nothing is due sooner: a wake-up lost
/// to a clock step or a controller restart costs at most this much.
const LONGEST_SLEEP: Duration = Duration::from_secs(3600);

/// The phase of one Backup as this machine reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// No phase yet (just created, or the Backup controller has not seen it), or
    /// `Pending`, or a phase this operator does not know: still in play.
    Pending,
    Running,
    Completed,
    Failed,
}

impl Phase {
    pub fn of(phase: Option<&str>) -> Self {
        match phase {
            Some("Running") => Phase::Running,
            Some("Completed") => Phase::Completed,
            Some("Failed") => Phase::Failed,
            _ => Phase::Pending,
        }
    }

    fn active(self) -> bool {
        matches!(self, Phase::Pending | Phase::Running)
    }
}

/// What the machine needs to know of one of the schedule's Backups.
#[derive(Clone, Debug, PartialEq)]
pub struct BackupRecord {
    pub name: String,
    pub created: Timestamp,
    pub phase: Phase,
    /// `status.stoppedAt` of a finished backup: the point its data reaches.
    pub completed: Option<Timestamp>,
    /// The uid of the schedule that made it.
    pub schedule_uid: Option<String>,
    /// Its `RestoreVerified` verdict, once verified.
    pub verified: Option<Condition>,
}

impl BackupRecord {
    pub fn of(backup: &Backup) -> Option<Self> {
        let status = backup.status.as_ref();
        Some(Self {
            name: backup.metadata.name.clone()?,
            created: backup.metadata.creation_timestamp.as_ref()?.0,
            phase: Phase::of(status.and_then(|s| s.phase.as_deref())),
            completed: status
                .and_then(|s| s.stopped_at.as_deref())
                .and_then(|t| t.parse().ok()),
            schedule_uid: backup.annotations().get(SCHEDULE_UID_ANNOTATION).cloned(),
            verified: status
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == RESTORE_VERIFIED))
                .filter(|c| c.status != "Unknown")
                .cloned(),
        })
    }

    /// What retention measures age from: the end of the backup, or its creation.
    fn taken(&self) -> Timestamp {
        self.completed.unwrap_or(self.created)
    }
}

/// Everything [`decide`] reads.
#[derive(Clone, Debug)]
pub struct Observed<'a> {
    pub name: &'a str,
    pub uid: Option<&'a str>,
    pub spec: &'a BackupScheduleSpec,
    pub status: Option<&'a BackupScheduleStatus>,
    pub generation: Option<i64>,
    /// The schedule's `creationTimestamp`: its first slot is the first one after it.
    pub created: Timestamp,
    /// The Backups labelled with this schedule's name.
    pub backups: &'a [BackupRecord],
    pub now: Timestamp,
}

/// A Backup to create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub name: String,
    /// The slot it is for (the current second for an `immediate` one).
    pub slot: Timestamp,
}

/// A Backup retention removes, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pruned {
    pub name: String,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub create: Option<Planned>,
    pub delete: Vec<Pruned>,
    pub status: BackupScheduleStatus,
    pub notes: Vec<Note>,
    /// When to look again without a change to the schedule or its Backups: `None`
    /// when nothing is due by the clock (an invalid or suspended schedule without
    /// an age limit).
    pub requeue: Option<Duration>,
}

/// `<schedule>-<yyyymmddhhmmss>` of the slot in UTC: sortable, unique per slot, and
/// the same name when a reconcile whose status write was lost decides again.
pub fn backup_name(schedule: &str, slot: Timestamp) -> String {
    format!("{schedule}-{}", slot.strftime("%Y%m%d%H%M%S"))
}

/// The Backup a schedule creates. No owner reference, on purpose: a Backup is what a
/// restore names, so it must outlive the schedule that made it (deleting a schedule
/// leaves its Backups; retention removes them only while the schedule exists).
pub fn backup(
    namespace: &str,
    schedule: &str,
    schedule_uid: Option<&str>,
    cluster: &str,
    verify: bool,
    planned: &Planned,
) -> Backup {
    Backup {
        metadata: ObjectMeta {
            name: Some(planned.name.clone()),
            namespace: Some(namespace.to_owned()),
            annotations: schedule_uid
                .map(|uid| [(SCHEDULE_UID_ANNOTATION.to_owned(), uid.to_owned())].into()),
            labels: Some(
                [
                    (SCHEDULE_LABEL.to_owned(), schedule.to_owned()),
                    (CLUSTER_LABEL.to_owned(), cluster.to_owned()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        spec: BackupSpec {
            cluster: cluster.to_owned(),
            method: BackupMethod::default(),
            verify,
        },
        status: None,
    }
}

/// Decides what the schedule does at `observed.now`.
pub fn decide(observed: &Observed) -> Decision {
    // Slots are whole minutes and names whole seconds: work in whole seconds, so a
    // status time reads `…:00Z` and an immediate Backup's name matches its slot.
    let now = whole_second(observed.now);
    let previous = observed.status.cloned().unwrap_or_default();
    let mut notes = Vec::new();

    let retention = prune(observed.spec.retention.as_ref(), observed.backups, now);
    let cadence = Cadence::parse(
        &observed.spec.schedule,
        observed.spec.time_zone.as_deref(),
        now,
    );
    let mut create = None;
    let mut last_schedule_time = previous.last_schedule_time.clone();
    let (next, mut ready) = match &cadence {
        Err(message) => {
            // One Warning when the schedule becomes invalid (or invalid differently),
            // not one per look.
            let before = previous.conditions.iter().find(|c| c.type_ == READY);
            if before.is_none_or(|c| {
                c.reason != INVALID_SCHEDULE || !c.message.starts_with(message.as_str())
            }) {
                notes.push(Note::warning(INVALID_SCHEDULE, message.clone()));
            }
            (None, ("False", INVALID_SCHEDULE, message.clone()))
        }
        Ok(_) if observed.spec.suspend => (
            None,
            (
                "True",
                SUSPENDED,
                "suspended: no new backups; retention still applies".to_owned(),
            ),
        ),
        Ok(cadence) => {
            if let Some(slot) = due(observed, &previous, cadence, now) {
                let planned = Planned {
                    name: backup_name(observed.name, slot.at),
                    slot: slot.at,
                };
                let active = observed.backups.iter().find(|b| b.phase.active());
                if observed.backups.iter().any(|b| b.name == planned.name) {
                    // Created by a look whose status write was lost: record it only.
                    last_schedule_time = Some(planned.slot.to_string());
                } else if let Some(active) = active {
                    // Every slot skipped for one running Backup is one series of
                    // Events (its count says how many), so the message names the
                    // first slot and the Backup in the way.
                    notes.push(
                        Note::warning(
                            BACKUP_SKIPPED,
                            format!(
                                "skipped the backup due at {}: Backup {} is still {}; due slots are skipped until it ends",
                                planned.slot,
                                active.name,
                                phase_word(active.phase)
                            ),
                        )
                        .about_object(BACKUP_API_VERSION, "Backup", &active.name),
                    );
                } else {
                    notes.push(
                        Note::normal(
                            BACKUP_CREATED,
                            format!("created Backup {}{}", planned.name, slot.why),
                        )
                        .about_object(
                            BACKUP_API_VERSION,
                            "Backup",
                            &planned.name,
                        ),
                    );
                    last_schedule_time = Some(planned.slot.to_string());
                    create = Some(planned);
                }
            }
            match cadence.next_after(now) {
                Ok(next) => {
                    let zone = observed.spec.time_zone.as_deref().unwrap_or("UTC");
                    let local = cadence.local(next);
                    (
                        Some(next),
                        (
                            "True",
                            SCHEDULED,
                            format!("next backup at {next} ({local}, {zone})"),
                        ),
                    )
                }
                // Parse checked that it fires after `now`; an error here is a
                // schedule whose last slot has just passed.
                Err(error) => (
                    None,
                    (
                        "False",
                        INVALID_SCHEDULE,
                        format!(
                            "schedule {:?} never fires again: {error}",
                            observed.spec.schedule
                        ),
                    ),
                ),
            }
        }
    };

    // A retention that cannot be read (admission refuses it, so only an object that
    // bypassed validation) deletes nothing and says so in `Ready`'s message, with one
    // Warning when it first appears there.
    if let Some(problem) = &retention.problem {
        let said = previous
            .conditions
            .iter()
            .any(|c| c.type_ == READY && c.message.contains(problem.as_str()));
        if !said {
            notes.push(Note::warning(INVALID_RETENTION, problem.clone()));
        }
        ready.2 = format!("{}; {problem}", ready.2);
    }
    for pruned in &retention.delete {
        notes.push(
            Note::normal(
                BACKUP_PRUNED,
                format!(
                    "deleted Backup {} by retention: {}",
                    pruned.name, pruned.why
                ),
            )
            .about_object(BACKUP_API_VERSION, "Backup", &pruned.name),
        );
    }
    let (status_word, reason, message) = ready;
    let ready = ready_condition(&previous, status_word, reason, &message, observed, now);

    let status = status(
        observed,
        &previous,
        &create,
        &retention.delete,
        ready,
        last_schedule_time,
        next,
    );
    let wake = [next, retention.next_expiry].into_iter().flatten().min();
    let requeue = wake.map(|at| {
        // Negative only if `at` already passed: look again soon.
        let wait = Duration::try_from(now.duration_until(at)).unwrap_or(Duration::ZERO);
        wait.clamp(Duration::from_secs(1), LONGEST_SLEEP)
    });
    Decision {
        create,
        delete: retention.delete,
        status,
        notes,
        requeue,
    }
}

/// A slot that is due now, and what to say about it.
struct Due {
    at: Timestamp,
    why: String,
}

fn due(
    observed: &Observed,
    previous: &BackupScheduleStatus,
    cadence: &Cadence,
    now: Timestamp,
) -> Option<Due> {
    let first_sight = previous.observed_generation.is_none();
    if first_sight
        && observed.spec.immediate
        && !observed
            .backups
            .iter()
            .any(|b| b.schedule_uid.is_some() && b.schedule_uid.as_deref() == observed.uid)
    {
        return Some(Due {
            at: now,
            why: " at once (immediate)".to_owned(),
        });
    }
    // The first slot not handled yet.
    let owed_from = if first_sight {
        // Slots after the creation are owed, including one that passed before this
        // operator first saw the schedule.
        observed.created
    } else if previous.observed_generation != observed.generation {
        // The spec changed: slots of the old spec, or missed while suspended, are not
        // owed. `nextScheduleTime` starts over from now.
        return None;
    } else {
        match previous
            .next_schedule_time
            .as_deref()
            .map(str::parse::<Timestamp>)
        {
            Some(Ok(next)) => next,
            // Never computed (suspended or invalid until now) or unreadable: start
            // over from now rather than guess.
            _ => return None,
        }
    };
    let latest = cadence.latest_at(now).ok()?;
    if latest < owed_from {
        return None;
    }
    let missed_more = cadence
        .latest_before(latest)
        .is_ok_and(|earlier| earlier >= owed_from);
    let why = if missed_more {
        format!(
            " for the slot at {latest}: a catch-up for the slots missed since {owed_from}, one backup for all of them"
        )
    } else {
        format!(" for the slot at {latest}")
    };
    Some(Due { at: latest, why })
}

/// What retention decided.
#[derive(Debug, Default, PartialEq)]
pub struct Retained {
    pub delete: Vec<Pruned>,
    /// When the next kept backup falls out of `maxAge`: time to look again.
    pub next_expiry: Option<Timestamp>,
    /// A retention that cannot be read: nothing is removed.
    pub problem: Option<String>,
}

/// Which of the schedule's Backups retention removes.
///
/// - Only `Completed` Backups count. A Completed Backup is removed once it is outside
///   every limit given: not among the `keepLast` newest, and older than `maxAge`
///   (measured from `status.stoppedAt`, else its creation). With no limit given,
///   nothing is removed.
/// - The newest Completed Backup is never removed: it is the only way back.
/// - `Pending` and `Running` Backups are never removed: deleting one would abandon a
///   backup half-way.
/// - A `Failed` Backup is kept while it is the latest news (for its error and
///   Events), and removed, when retention is given, once a Backup created after it
///   has completed. It never counts toward `keepLast`.
pub fn prune(retention: Option<&Retention>, backups: &[BackupRecord], now: Timestamp) -> Retained {
    let Some(retention) = retention.filter(|r| r.limits_anything()) else {
        return Retained::default();
    };
    let max_age = match retention.max_age().transpose() {
        Ok(max_age) => max_age,
        Err(problem) => {
            return Retained {
                problem: Some(format!("{problem}; no Backup is deleted until it is fixed")),
                ..Retained::default()
            };
        }
    };
    let keep_last = retention
        .keep_last
        .map(|n| usize::try_from(n.max(1)).unwrap_or(1));
    let mut completed: Vec<&BackupRecord> = backups
        .iter()
        .filter(|b| b.phase == Phase::Completed)
        .collect();
    completed.sort_by(|a, b| (b.created, &b.name).cmp(&(a.created, &a.name)));

    let mut retained = Retained::default();
    // Index 0, the newest, is skipped: never removed.
    for (index, backup) in completed.iter().enumerate().skip(1) {
        let beyond_count = keep_last.is_none_or(|keep| index >= keep);
        if !beyond_count {
            continue;
        }
        // `None`: no age limit; `Some(None)`: an age so long it never ends.
        let expires = max_age.map(|age| {
            jiff::SignedDuration::try_from(age)
                .ok()
                .and_then(|age| backup.taken().checked_add(age).ok())
        });
        match expires {
            Some(None) => {}
            Some(Some(expires)) if expires > now => {
                retained.next_expiry = Some(match retained.next_expiry {
                    Some(earlier) => earlier.min(expires),
                    None => expires,
                });
            }
            _ => {
                let why = match (keep_last, max_age) {
                    (Some(keep), Some(_)) => format!(
                        "not among the {keep} newest completed and older than maxAge {}",
                        retention.max_age.as_deref().unwrap_or_default()
                    ),
                    (Some(keep), None) => format!("not among the {keep} newest completed"),
                    (None, _) => format!(
                        "older than maxAge {}",
                        retention.max_age.as_deref().unwrap_or_default()
                    ),
                };
                retained.delete.push(Pruned {
                    name: backup.name.clone(),
                    why,
                });
            }
        }
    }
    if let Some(newest) = completed.first() {
        for failed in backups
            .iter()
            .filter(|b| b.phase == Phase::Failed && b.created < newest.created)
        {
            retained.delete.push(Pruned {
                name: failed.name.clone(),
                why: format!("failed, and the later Backup {} completed", newest.name),
            });
        }
    }
    retained.delete.sort_by(|a, b| a.name.cmp(&b.name));
    retained
}

fn status(
    observed: &Observed,
    previous: &BackupScheduleStatus,
    create: &Option<Planned>,
    delete: &[Pruned],
    ready: Condition,
    last_schedule_time: Option<String>,
    next: Option<Timestamp>,
) -> BackupScheduleStatus {
    let deleted = |name: &str| delete.iter().any(|p| p.name == name);
    let mut kept: Vec<&BackupRecord> = observed
        .backups
        .iter()
        .filter(|b| !deleted(&b.name))
        .collect();
    kept.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    let last_successful_backup = kept
        .iter()
        .rev()
        .find(|b| b.phase == Phase::Completed)
        .map(|b| b.name.clone());
    let active_backups = kept
        .iter()
        .filter(|b| b.phase.active())
        .map(|b| b.name.clone())
        .chain(create.iter().map(|p| p.name.clone()))
        .collect();
    // The newest verdict on one of its backups, as the schedule's own.
    let verified = kept
        .iter()
        .filter_map(|b| b.verified.as_ref())
        .max_by_key(|c| c.last_transition_time.0);
    let mut conditions: Vec<Condition> = previous
        .conditions
        .iter()
        .filter(|c| c.type_ != READY && (verified.is_none() || c.type_ != RESTORE_VERIFIED))
        .cloned()
        .collect();
    conditions.push(ready);
    conditions.extend(verified.cloned());
    let last_verified = verified
        .map(|c| c.last_transition_time.0.to_string())
        .or_else(|| previous.last_verified.clone());
    BackupScheduleStatus {
        observed_generation: observed.generation,
        conditions,
        last_schedule_time,
        next_schedule_time: next.map(|t| t.to_string()),
        last_successful_backup,
        active_backups,
        last_verified,
    }
}

/// The `Ready` condition, keeping its transition time while its status holds.
fn ready_condition(
    previous: &BackupScheduleStatus,
    status: &str,
    reason: &str,
    message: &str,
    observed: &Observed,
    now: Timestamp,
) -> Condition {
    let last_transition_time = previous
        .conditions
        .iter()
        .find(|c| c.type_ == READY && c.status == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    Condition {
        type_: READY.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: observed.generation,
        last_transition_time,
    }
}

fn phase_word(phase: Phase) -> &'static str {
    match phase {
        Phase::Pending => "pending",
        Phase::Running => "running",
        Phase::Completed => "completed",
        Phase::Failed => "failed",
    }
}

fn whole_second(time: Timestamp) -> Timestamp {
    // A Timestamp's seconds are always in range, so this cannot fail; `time` is the
    // fallback only to avoid an unwrap.
    Timestamp::from_second(time.as_second()).unwrap_or(time)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "nightly";
    const UID: &str = "4ee3cd2f-bd90-4fcd-b568-a192c989e6b9";

    fn at(text: &str) -> Timestamp {
        text.parse().expect("a timestamp")
    }

    fn spec(schedule: &str) -> BackupScheduleSpec {
        BackupScheduleSpec {
            cluster: "orders".to_owned(),
            schedule: schedule.to_owned(),
            time_zone: None,
            retention: None,
            suspend: false,
            immediate: false,
            verify: false,
        }
    }

    fn in_zone(mut spec: BackupScheduleSpec, zone: &str) -> BackupScheduleSpec {
        spec.time_zone = Some(zone.to_owned());
        spec
    }

    fn record(name: &str, created: &str, phase: Phase) -> BackupRecord {
        BackupRecord {
            name: name.to_owned(),
            created: at(created),
            phase,
            completed: matches!(phase, Phase::Completed | Phase::Failed).then(|| at(created)),
            schedule_uid: Some(UID.to_owned()),
            verified: None,
        }
    }

    /// A Backup made by an earlier schedule of the same name.
    fn predecessors(mut record: BackupRecord) -> BackupRecord {
        record.schedule_uid = Some("uid-of-the-deleted-one".to_owned());
        record
    }

    /// A look at `now` at a schedule created at 10:00:30 and seen before (generation 1).
    fn look<'a>(
        spec: &'a BackupScheduleSpec,
        status: Option<&'a BackupScheduleStatus>,
        backups: &'a [BackupRecord],
        now: &str,
    ) -> Decision {
        decide(&Observed {
            name: NAME,
            uid: Some(UID),
            spec,
            status,
            generation: Some(1),
            created: at("2026-03-01T10:00:30Z"),
            backups,
            now: at(now),
        })
    }

    /// The status a schedule has after earlier looks: generation 1 seen, next slot due
    /// at `next`.
    fn seen(next: &str) -> BackupScheduleStatus {
        BackupScheduleStatus {
            observed_generation: Some(1),
            next_schedule_time: Some(next.to_owned()),
            ..BackupScheduleStatus::default()
        }
    }

    fn ready(decision: &Decision) -> &Condition {
        decision
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == READY)
            .expect("a Ready condition")
    }

    fn reasons(decision: &Decision) -> Vec<&'static str> {
        decision.notes.iter().map(|n| n.reason).collect()
    }

    fn names(pruned: &[Pruned]) -> Vec<&str> {
        pruned.iter().map(|p| p.name.as_str()).collect()
    }

    fn next_of(schedule: &str, zone: Option<&str>, after: &str) -> Timestamp {
        let mut spec = spec(schedule);
        spec.time_zone = zone.map(str::to_owned);
        Cadence::parse(&spec.schedule, spec.time_zone.as_deref(), at(after))
            .expect("a valid schedule")
            .next_after(at(after))
            .expect("a next slot")
    }

    // --- parsing ---

    #[test]
    fn five_field_expressions_and_macros_parse() {
        for schedule in [
            "* * * * *",
            "0 3 * * *",
            "*/15 9-17 * * MON-FRI",
            "0 0 29 2 *",
            "@daily",
            "@hourly",
            "@weekly",
            "@monthly",
            "@yearly",
        ] {
            assert!(
                Cadence::parse(
                    schedule,
                    spec(schedule).time_zone.as_deref(),
                    at("2026-03-01T10:00:00Z")
                )
                .is_ok(),
                "{schedule} should parse"
            );
        }
        assert_eq!(
            next_of("@daily", None, "2026-03-01T10:00:00Z"),
            at("2026-03-02T00:00:00Z")
        );
        assert_eq!(
            next_of("@hourly", None, "2026-03-01T10:00:00Z"),
            at("2026-03-01T11:00:00Z")
        );
    }

    #[test]
    fn an_invalid_cron_is_a_false_ready_condition_with_the_parsers_message_and_one_warning() {
        let decision = look(&spec("61 * * * *"), None, &[], "2026-03-01T10:00:31Z");
        let condition = ready(&decision);
        assert_eq!(condition.status, "False");
        assert_eq!(condition.reason, INVALID_SCHEDULE);
        assert!(
            condition.message.contains("\"61 * * * *\""),
            "{}",
            condition.message
        );
        assert!(
            condition.message.contains("five-field"),
            "{}",
            condition.message
        );
        assert!(
            condition.message.len() > 70,
            "the parser's message is kept: {}",
            condition.message
        );
        assert_eq!(reasons(&decision), [INVALID_SCHEDULE]);
        assert_eq!(decision.create, None);
        assert_eq!(decision.status.next_schedule_time, None);
        assert_eq!(decision.requeue, None, "waits for the user to change it");

        // Looking again says nothing new and keeps the transition time.
        let later = look(
            &spec("61 * * * *"),
            Some(&decision.status),
            &[],
            "2026-03-01T10:05:00Z",
        );
        assert!(later.notes.is_empty());
        assert_eq!(
            ready(&later).last_transition_time,
            Time(at("2026-03-01T10:00:31Z"))
        );
    }

    #[test]
    fn six_fields_and_schedules_that_never_fire_are_invalid() {
        let seconds = look(&spec("0 0 3 * * *"), None, &[], "2026-03-01T10:00:31Z");
        assert_eq!(ready(&seconds).reason, INVALID_SCHEDULE);
        assert!(
            ready(&seconds).message.contains("5 fields"),
            "{}",
            ready(&seconds).message
        );
        let never = look(&spec("0 0 31 2 *"), None, &[], "2026-03-01T10:00:31Z");
        assert_eq!(ready(&never).reason, INVALID_SCHEDULE);
        assert!(
            ready(&never).message.contains("never fires"),
            "{}",
            ready(&never).message
        );
        let garbage = look(&spec("every night"), None, &[], "2026-03-01T10:00:31Z");
        assert_eq!(ready(&garbage).reason, INVALID_SCHEDULE);
    }

    #[test]
    fn an_unknown_time_zone_is_invalid() {
        let decision = look(
            &in_zone(spec("0 3 * * *"), "Mars/Olympus_Mons"),
            None,
            &[],
            "2026-03-01T10:00:31Z",
        );
        let condition = ready(&decision);
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("False", INVALID_SCHEDULE)
        );
        assert!(
            condition.message.contains("timeZone \"Mars/Olympus_Mons\""),
            "{}",
            condition.message
        );
        assert_eq!(reasons(&decision), [INVALID_SCHEDULE]);
    }

    #[test]
    fn a_fixed_schedule_turns_ready_and_says_so_once() {
        let invalid = look(&spec("61 * * * *"), None, &[], "2026-03-01T10:00:31Z");
        let mut status = invalid.status.clone();
        status.next_schedule_time = None;
        let fixed = decide(&Observed {
            name: NAME,
            uid: Some(UID),
            spec: &spec("0 * * * *"),
            status: Some(&status),
            generation: Some(2),
            created: at("2026-03-01T10:00:30Z"),
            backups: &[],
            now: at("2026-03-01T10:02:00Z"),
        });
        assert_eq!(ready(&fixed).status, "True");
        assert_eq!(ready(&fixed).reason, SCHEDULED);
        assert_eq!(
            ready(&fixed).last_transition_time,
            Time(at("2026-03-01T10:02:00Z"))
        );
        assert_eq!(fixed.create, None, "an edit owes no slot before it");
        assert_eq!(
            fixed.status.next_schedule_time.as_deref(),
            Some("2026-03-01T11:00:00Z")
        );
        assert_eq!(fixed.status.observed_generation, Some(2));
    }

    // --- first sight and immediate ---

    #[test]
    fn a_new_schedule_waits_for_its_first_slot() {
        let decision = look(&spec("* * * * *"), None, &[], "2026-03-01T10:00:31.250Z");
        assert_eq!(decision.create, None);
        assert!(decision.notes.is_empty());
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-01T10:01:00Z")
        );
        assert_eq!(decision.status.last_schedule_time, None);
        assert_eq!(decision.status.observed_generation, Some(1));
        assert_eq!(ready(&decision).reason, SCHEDULED);
        assert!(
            ready(&decision).message.contains("2026-03-01T10:01:00Z"),
            "{}",
            ready(&decision).message
        );
        assert_eq!(decision.requeue, Some(Duration::from_secs(29)));
    }

    #[test]
    fn immediate_makes_one_backup_when_first_seen() {
        let mut spec = spec("0 3 * * *");
        spec.immediate = true;
        let decision = look(&spec, None, &[], "2026-03-01T10:00:31.900Z");
        assert_eq!(
            decision.create,
            Some(Planned {
                name: "nightly-20260301100031".to_owned(),
                slot: at("2026-03-01T10:00:31Z"),
            })
        );
        assert_eq!(reasons(&decision), [BACKUP_CREATED]);
        assert!(decision.notes[0].message.contains("immediate"));
        assert_eq!(
            decision.status.last_schedule_time.as_deref(),
            Some("2026-03-01T10:00:31Z")
        );
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-02T03:00:00Z")
        );
        assert_eq!(decision.status.active_backups, ["nightly-20260301100031"]);

        // Seen once, never again.
        let again = look(&spec, Some(&decision.status), &[], "2026-03-01T10:00:40Z");
        assert_eq!(again.create, None);
        // Nor when the status write was lost but the Backup was made.
        let made = [record(
            "nightly-20260301100031",
            "2026-03-01T10:00:31Z",
            Phase::Pending,
        )];
        let lost = look(&spec, None, &made, "2026-03-01T10:00:40Z");
        assert_eq!(lost.create, None);
        assert!(lost.notes.is_empty());
    }

    #[test]
    fn immediate_is_not_made_while_an_older_backup_of_the_same_name_runs() {
        // A schedule deleted and re-created under the same name finds its
        // predecessor's Backups by label; one of them still runs.
        let mut spec = spec("0 3 * * *");
        spec.immediate = true;
        let old = [predecessors(record(
            "nightly-20260301030000",
            "2026-03-01T03:00:00Z",
            Phase::Running,
        ))];
        let decision = look(&spec, None, &old, "2026-03-01T10:00:31Z");
        assert_eq!(decision.create, None);
        assert_eq!(reasons(&decision), [BACKUP_SKIPPED]);
    }

    #[test]
    fn immediate_is_made_beside_a_predecessors_backups_even_of_the_same_second() {
        // Creation times have whole seconds: the predecessor's Backup made in the
        // schedule's own second is still not this schedule's.
        let mut spec = spec("0 3 * * *");
        spec.immediate = true;
        let old = [predecessors(record(
            "nightly-20260301100030",
            "2026-03-01T10:00:30Z",
            Phase::Completed,
        ))];
        let decision = look(&spec, None, &old, "2026-03-01T10:00:31Z");
        assert_eq!(
            decision.create.map(|p| p.name),
            Some("nightly-20260301100031".to_owned())
        );
    }

    // --- slots, catch-up, skips ---

    #[test]
    fn a_due_slot_makes_its_backup_named_for_the_slot() {
        let status = seen("2026-03-01T10:01:00Z");
        let decision = look(
            &spec("* * * * *"),
            Some(&status),
            &[],
            "2026-03-01T10:01:00.300Z",
        );
        let planned = decision.create.clone().expect("a Backup");
        assert_eq!(planned.name, "nightly-20260301100100");
        let related = decision.notes[0].related.clone().expect("about the Backup");
        assert_eq!(
            (related.kind, related.name.as_str()),
            ("Backup", "nightly-20260301100100")
        );
        assert_eq!(
            decision.status.last_schedule_time.as_deref(),
            Some("2026-03-01T10:01:00Z")
        );
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-01T10:02:00Z")
        );
        assert_eq!(decision.requeue, Some(Duration::from_secs(60)));

        let backup = backup("shop", NAME, Some(UID), "orders", false, &planned);
        let labels = backup.metadata.labels.clone().expect("labels");
        assert_eq!(labels.get(SCHEDULE_LABEL).map(String::as_str), Some(NAME));
        assert_eq!(
            labels.get(CLUSTER_LABEL).map(String::as_str),
            Some("orders")
        );
        assert_eq!(
            backup.metadata.owner_references, None,
            "Backups outlive their schedule"
        );
        assert_eq!(backup.spec.cluster, "orders");
        assert_eq!(backup.metadata.namespace.as_deref(), Some("shop"));
    }

    #[test]
    fn before_its_slot_nothing_is_made() {
        let status = seen("2026-03-01T10:01:00Z");
        let decision = look(
            &spec("* * * * *"),
            Some(&status),
            &[],
            "2026-03-01T10:00:59.900Z",
        );
        assert_eq!(decision.create, None);
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-01T10:01:00Z")
        );
        assert_eq!(decision.requeue, Some(Duration::from_secs(1)));
    }

    #[test]
    fn slots_missed_while_the_operator_was_down_make_exactly_one_backup() {
        let status = seen("2026-03-01T10:01:00Z");
        let decision = look(
            &spec("* * * * *"),
            Some(&status),
            &[],
            "2026-03-01T10:07:30Z",
        );
        let planned = decision.create.clone().expect("one catch-up");
        assert_eq!(
            planned.name, "nightly-20260301100700",
            "for the latest missed slot"
        );
        assert!(
            decision.notes[0].message.contains("catch-up"),
            "{}",
            decision.notes[0].message
        );
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-01T10:08:00Z")
        );

        // The next look, with the Backup made (and even finished), makes no more.
        let made = [record(
            "nightly-20260301100700",
            "2026-03-01T10:07:30Z",
            Phase::Completed,
        )];
        let next = look(
            &spec("* * * * *"),
            Some(&decision.status),
            &made,
            "2026-03-01T10:07:45Z",
        );
        assert_eq!(next.create, None);
        assert!(next.notes.is_empty());
    }

    #[test]
    fn a_slot_that_passed_before_the_schedule_was_first_seen_is_caught_up() {
        // Created at 10:00:30 while the operator was down, first seen at 13:20.
        let decision = look(&spec("0 * * * *"), None, &[], "2026-03-01T13:20:00Z");
        assert_eq!(
            decision.create.clone().map(|p| p.name),
            Some("nightly-20260301130000".to_owned())
        );
        // Slots before the schedule existed are never owed.
        let early = look(&spec("0 10 * * *"), None, &[], "2026-03-01T10:00:40Z");
        assert_eq!(early.create, None);
    }

    #[test]
    fn an_edited_spec_owes_nothing_from_before_the_edit() {
        let status = seen("2026-03-01T10:01:00Z");
        let decision = decide(&Observed {
            name: NAME,
            uid: Some(UID),
            spec: &spec("*/5 * * * *"),
            status: Some(&status),
            generation: Some(2),
            created: at("2026-03-01T10:00:30Z"),
            backups: &[],
            now: at("2026-03-01T10:12:00Z"),
        });
        assert_eq!(decision.create, None);
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-01T10:15:00Z")
        );
    }

    #[test]
    fn a_due_slot_is_skipped_while_a_backup_is_pending_or_running() {
        for phase in [Phase::Pending, Phase::Running] {
            let status = seen("2026-03-01T10:02:00Z");
            let running = [record(
                "nightly-20260301100100",
                "2026-03-01T10:01:00Z",
                phase,
            )];
            let decision = look(
                &spec("* * * * *"),
                Some(&status),
                &running,
                "2026-03-01T10:02:00Z",
            );
            assert_eq!(decision.create, None);
            assert_eq!(reasons(&decision), [BACKUP_SKIPPED]);
            assert!(decision.notes[0].warning);
            assert_eq!(
                decision.notes[0].related.as_ref().map(|r| r.name.as_str()),
                Some("nightly-20260301100100"),
                "one series per Backup in the way"
            );
            assert!(
                decision.notes[0].message.contains("nightly-20260301100100"),
                "{}",
                decision.notes[0].message
            );
            assert_eq!(decision.status.active_backups, ["nightly-20260301100100"]);
            // The slot is spent: it is not made once the running one ends.
            assert_eq!(
                decision.status.next_schedule_time.as_deref(),
                Some("2026-03-01T10:03:00Z")
            );
            let finished = [record(
                "nightly-20260301100100",
                "2026-03-01T10:01:00Z",
                Phase::Completed,
            )];
            let after = look(
                &spec("* * * * *"),
                Some(&decision.status),
                &finished,
                "2026-03-01T10:02:30Z",
            );
            assert_eq!(after.create, None);
            assert!(after.notes.is_empty());
        }
    }

    #[test]
    fn a_backup_made_by_a_look_whose_status_was_lost_is_recorded_not_made_again() {
        let status = seen("2026-03-01T10:01:00Z");
        let made = [record(
            "nightly-20260301100100",
            "2026-03-01T10:01:00Z",
            Phase::Pending,
        )];
        let decision = look(
            &spec("* * * * *"),
            Some(&status),
            &made,
            "2026-03-01T10:01:02Z",
        );
        assert_eq!(decision.create, None);
        assert!(
            decision.notes.is_empty(),
            "not a skip: {:?}",
            decision.notes
        );
        assert_eq!(
            decision.status.last_schedule_time.as_deref(),
            Some("2026-03-01T10:01:00Z")
        );
    }

    #[test]
    fn a_failed_backup_does_not_hold_up_the_next_slot() {
        let status = seen("2026-03-01T10:02:00Z");
        let failed = [record(
            "nightly-20260301100100",
            "2026-03-01T10:01:00Z",
            Phase::Failed,
        )];
        let decision = look(
            &spec("* * * * *"),
            Some(&status),
            &failed,
            "2026-03-01T10:02:00Z",
        );
        assert_eq!(
            decision.create.clone().map(|p| p.name),
            Some("nightly-20260301100200".to_owned())
        );
    }

    // --- suspend ---

    #[test]
    fn a_suspended_schedule_makes_nothing_but_retention_still_applies() {
        let mut spec = spec("* * * * *");
        spec.suspend = true;
        spec.retention = Some(Retention {
            keep_last: Some(1),
            max_age: None,
        });
        let status = seen("2026-03-01T10:01:00Z");
        let backups = [
            record(
                "nightly-20260301090000",
                "2026-03-01T09:00:00Z",
                Phase::Completed,
            ),
            record(
                "nightly-20260301090100",
                "2026-03-01T09:01:00Z",
                Phase::Completed,
            ),
        ];
        let decision = look(&spec, Some(&status), &backups, "2026-03-01T10:05:00Z");
        assert_eq!(decision.create, None);
        assert_eq!(names(&decision.delete), ["nightly-20260301090000"]);
        assert_eq!(reasons(&decision), [BACKUP_PRUNED]);
        assert_eq!(
            (
                ready(&decision).status.as_str(),
                ready(&decision).reason.as_str()
            ),
            ("True", SUSPENDED)
        );
        assert_eq!(decision.status.next_schedule_time, None);
        assert_eq!(decision.requeue, None);
        assert_eq!(
            decision.status.last_successful_backup.as_deref(),
            Some("nightly-20260301090100")
        );
    }

    #[test]
    fn slots_missed_while_suspended_are_not_owed_after_resuming() {
        let mut suspended = spec("* * * * *");
        suspended.suspend = true;
        let asleep = look(
            &suspended,
            Some(&seen("2026-03-01T10:01:00Z")),
            &[],
            "2026-03-01T10:00:45Z",
        );
        // Turning suspend off is an edit (generation 2), at 11:30.
        let resumed = decide(&Observed {
            name: NAME,
            uid: Some(UID),
            spec: &spec("* * * * *"),
            status: Some(&asleep.status),
            generation: Some(2),
            created: at("2026-03-01T10:00:30Z"),
            backups: &[],
            now: at("2026-03-01T11:30:10Z"),
        });
        assert_eq!(resumed.create, None);
        assert_eq!(
            resumed.status.next_schedule_time.as_deref(),
            Some("2026-03-01T11:31:00Z")
        );
        assert_eq!(ready(&resumed).reason, SCHEDULED);
    }

    // --- time zones and daylight saving ---

    #[test]
    fn slots_are_read_in_the_time_zone_and_named_in_utc() {
        let berlin = Some("Europe/Berlin");
        // 03:00 in Berlin is 02:00 UTC in winter (CET) and 01:00 UTC in summer (CEST).
        assert_eq!(
            next_of("0 3 * * *", berlin, "2026-01-15T12:00:00Z"),
            at("2026-01-16T02:00:00Z")
        );
        assert_eq!(
            next_of("0 3 * * *", berlin, "2026-07-01T12:00:00Z"),
            at("2026-07-02T01:00:00Z")
        );
        assert_eq!(
            next_of("0 3 * * *", None, "2026-07-01T12:00:00Z"),
            at("2026-07-02T03:00:00Z")
        );

        let spec = in_zone(spec("0 3 * * *"), "Europe/Berlin");
        let status = seen("2026-07-02T01:00:00Z");
        let decision = look(&spec, Some(&status), &[], "2026-07-02T01:00:00Z");
        assert_eq!(
            decision.create.clone().map(|p| p.name),
            Some("nightly-20260702010000".to_owned())
        );
        assert!(
            ready(&decision).message.contains("2026-07-03 03:00 CEST"),
            "local time in the message: {}",
            ready(&decision).message
        );
    }

    #[test]
    fn a_slot_in_the_hour_skipped_by_spring_forward_runs_right_after_it() {
        // 2026-03-29: Berlin's clocks go from 02:00 CET to 03:00 CEST; 02:30 does not
        // exist that day. The backup runs at 03:00 CEST (01:00 UTC), once.
        let berlin = Some("Europe/Berlin");
        assert_eq!(
            next_of("30 2 * * *", berlin, "2026-03-28T02:00:00Z"),
            at("2026-03-29T01:00:00Z")
        );
        assert_eq!(
            next_of("30 2 * * *", berlin, "2026-03-29T01:00:00Z"),
            at("2026-03-30T00:30:00Z")
        );

        let spec = in_zone(spec("30 2 * * *"), "Europe/Berlin");
        let decision = look(
            &spec,
            Some(&seen("2026-03-29T01:00:00Z")),
            &[],
            "2026-03-29T01:00:05Z",
        );
        assert_eq!(
            decision.create.clone().map(|p| p.name),
            Some("nightly-20260329010000".to_owned())
        );
        assert_eq!(
            decision.status.next_schedule_time.as_deref(),
            Some("2026-03-30T00:30:00Z")
        );
    }

    #[test]
    fn a_slot_in_the_hour_repeated_by_fall_back_runs_once() {
        // 2026-10-25: Berlin's clocks go from 03:00 CEST back to 02:00 CET; 02:30
        // happens at 00:30 UTC and again at 01:30 UTC. The backup runs at the first.
        let berlin = Some("Europe/Berlin");
        assert_eq!(
            next_of("30 2 * * *", berlin, "2026-10-24T12:00:00Z"),
            at("2026-10-25T00:30:00Z")
        );
        assert_eq!(
            next_of("30 2 * * *", berlin, "2026-10-25T00:30:00Z"),
            at("2026-10-26T01:30:00Z")
        );

        let spec = in_zone(spec("30 2 * * *"), "Europe/Berlin");
        let first = look(
            &spec,
            Some(&seen("2026-10-25T00:30:00Z")),
            &[],
            "2026-10-25T00:30:01Z",
        );
        assert_eq!(
            first.create.clone().map(|p| p.name),
            Some("nightly-20261025003000".to_owned())
        );
        let made = [record(
            "nightly-20261025003000",
            "2026-10-25T00:30:01Z",
            Phase::Completed,
        )];
        let repeated = look(&spec, Some(&first.status), &made, "2026-10-25T01:30:01Z");
        assert_eq!(
            repeated.create, None,
            "02:30 CET is the same slot, already taken"
        );
    }

    #[test]
    fn an_hourly_schedule_runs_in_both_repeated_hours() {
        // Hourly is an interval, not a time of day: it fires every real hour, so the
        // repeated 02:00 is two slots an hour apart, as Vixie cron does.
        let berlin = Some("Europe/Berlin");
        assert_eq!(
            next_of("0 * * * *", berlin, "2026-10-25T00:00:00Z"),
            at("2026-10-25T01:00:00Z")
        );
        assert_eq!(
            next_of("0 * * * *", berlin, "2026-10-25T01:00:00Z"),
            at("2026-10-25T02:00:00Z")
        );
    }

    // --- retention ---

    fn keep(keep_last: Option<i32>, max_age: Option<&str>) -> Retention {
        Retention {
            keep_last,
            max_age: max_age.map(str::to_owned),
        }
    }

    #[test]
    fn keep_last_counts_completed_backups_and_spares_running_ones() {
        let backups = [
            record("b1", "2026-03-01T01:00:00Z", Phase::Completed),
            record("b2", "2026-03-01T02:00:00Z", Phase::Completed),
            record("b3", "2026-03-01T03:00:00Z", Phase::Running),
            record("b4", "2026-03-01T04:00:00Z", Phase::Completed),
            record("b5", "2026-03-01T05:00:00Z", Phase::Completed),
            record("b6", "2026-03-01T06:00:00Z", Phase::Pending),
        ];
        let retained = prune(
            Some(&keep(Some(2), None)),
            &backups,
            at("2026-03-01T07:00:00Z"),
        );
        assert_eq!(names(&retained.delete), ["b1", "b2"]);
        assert!(
            retained.delete[0].why.contains("2 newest"),
            "{}",
            retained.delete[0].why
        );

        let all = prune(
            Some(&keep(Some(1), None)),
            &backups,
            at("2026-03-01T07:00:00Z"),
        );
        assert_eq!(
            names(&all.delete),
            ["b1", "b2", "b4"],
            "b3 and b6 run, b5 is the newest"
        );
    }

    #[test]
    fn max_age_never_removes_the_newest_completed_backup() {
        let backups = [
            record("old", "2026-01-01T00:00:00Z", Phase::Completed),
            record("older", "2025-12-01T00:00:00Z", Phase::Completed),
            record("ancient-running", "2025-11-01T00:00:00Z", Phase::Running),
        ];
        let retained = prune(
            Some(&keep(None, Some("30d"))),
            &backups,
            at("2026-03-01T00:00:00Z"),
        );
        assert_eq!(names(&retained.delete), ["older"]);
        assert!(retained.delete[0].why.contains("maxAge 30d"));
        let alone = prune(
            Some(&keep(None, Some("1h"))),
            &backups[..1],
            at("2026-03-01T00:00:00Z"),
        );
        assert!(alone.delete.is_empty(), "the only way back stays");
    }

    #[test]
    fn with_both_limits_a_backup_goes_only_outside_both_and_the_expiry_wakes_the_schedule() {
        let backups = [
            record("day1", "2026-03-01T00:00:00Z", Phase::Completed),
            record("day2", "2026-03-02T00:00:00Z", Phase::Completed),
            record("day3", "2026-03-03T00:00:00Z", Phase::Completed),
        ];
        // keepLast 1 alone would remove day1 and day2; maxAge 36h keeps day2 (24h old).
        let retained = prune(
            Some(&keep(Some(1), Some("36h"))),
            &backups,
            at("2026-03-03T00:00:00Z"),
        );
        assert_eq!(names(&retained.delete), ["day1"]);
        assert_eq!(retained.next_expiry, Some(at("2026-03-03T12:00:00Z")));

        let mut spec = spec("0 0 * * *");
        spec.retention = Some(keep(Some(1), Some("36h")));
        let decision = look(
            &spec,
            Some(&seen("2026-03-04T00:00:00Z")),
            &backups,
            "2026-03-03T00:00:00Z",
        );
        assert_eq!(
            decision.requeue,
            Some(Duration::from_secs(3600)),
            "capped at an hour"
        );
        let late = look(
            &spec,
            Some(&seen("2026-03-04T00:00:00Z")),
            &backups,
            "2026-03-03T11:30:00Z",
        );
        assert_eq!(
            late.requeue,
            Some(Duration::from_secs(1800)),
            "wakes when day2 expires"
        );
    }

    #[test]
    fn failed_backups_go_once_a_later_one_completed_and_never_count() {
        let backups = [
            record("f1", "2026-03-01T01:00:00Z", Phase::Failed),
            record("c2", "2026-03-01T02:00:00Z", Phase::Completed),
            record("c3", "2026-03-01T03:00:00Z", Phase::Completed),
            record("f4", "2026-03-01T04:00:00Z", Phase::Failed),
        ];
        let retained = prune(
            Some(&keep(Some(2), None)),
            &backups,
            at("2026-03-01T05:00:00Z"),
        );
        assert_eq!(
            names(&retained.delete),
            ["f1"],
            "f4 is the latest news; c2 and c3 are the 2 newest"
        );
        assert!(retained.delete[0].why.contains("c3 completed"));
    }

    #[test]
    fn without_a_limit_nothing_is_removed() {
        let backups = [
            record("f1", "2026-03-01T01:00:00Z", Phase::Failed),
            record("c2", "2026-01-01T02:00:00Z", Phase::Completed),
            record("c3", "2026-03-01T03:00:00Z", Phase::Completed),
        ];
        let now = at("2026-03-01T05:00:00Z");
        assert_eq!(prune(None, &backups, now), Retained::default());
        assert_eq!(
            prune(Some(&keep(None, None)), &backups, now),
            Retained::default()
        );
    }

    #[test]
    fn an_unreadable_max_age_removes_nothing_and_says_so() {
        let backups = [
            record("c1", "2026-01-01T00:00:00Z", Phase::Completed),
            record("c2", "2026-02-01T00:00:00Z", Phase::Completed),
        ];
        let mut spec = spec("0 0 * * *");
        spec.retention = Some(keep(Some(1), Some("30 days")));
        let decision = look(
            &spec,
            Some(&seen("2026-03-02T00:00:00Z")),
            &backups,
            "2026-03-01T10:00:00Z",
        );
        assert!(decision.delete.is_empty());
        assert_eq!(reasons(&decision), [INVALID_RETENTION]);
        assert!(
            ready(&decision).message.contains("maxAge"),
            "{}",
            ready(&decision).message
        );
        let again = look(
            &spec,
            Some(&decision.status),
            &backups,
            "2026-03-01T10:05:00Z",
        );
        assert!(again.notes.is_empty(), "one Warning, not one per look");
    }

    #[test]
    fn status_names_the_newest_completed_and_the_active_backups() {
        let mut spec = spec("0 0 * * *");
        spec.retention = Some(keep(Some(1), None));
        let backups = [
            record("c1", "2026-03-01T01:00:00Z", Phase::Completed),
            record("c2", "2026-03-01T02:00:00Z", Phase::Completed),
            record("r3", "2026-03-01T03:00:00Z", Phase::Running),
            record("f4", "2026-03-01T04:00:00Z", Phase::Failed),
        ];
        let decision = look(
            &spec,
            Some(&seen("2026-03-02T00:00:00Z")),
            &backups,
            "2026-03-01T05:00:00Z",
        );
        assert_eq!(names(&decision.delete), ["c1"]);
        assert_eq!(
            decision.status.last_successful_backup.as_deref(),
            Some("c2")
        );
        assert_eq!(decision.status.active_backups, ["r3"]);
        assert!(
            decision.notes[0]
                .message
                .contains("deleted Backup c1 by retention: not among the 1 newest completed")
        );
    }

    #[test]
    fn phases_are_read_conservatively() {
        assert_eq!(Phase::of(None), Phase::Pending);
        assert_eq!(Phase::of(Some("Pending")), Phase::Pending);
        assert_eq!(Phase::of(Some("Running")), Phase::Running);
        assert_eq!(Phase::of(Some("Completed")), Phase::Completed);
        assert_eq!(Phase::of(Some("Failed")), Phase::Failed);
        assert_eq!(
            Phase::of(Some("Verifying")),
            Phase::Pending,
            "unknown: never deleted"
        );
    }

    #[test]
    fn the_newest_verdict_on_its_backups_is_the_schedules() {
        let verdict = |status: &str, time: &str| Condition {
            type_: RESTORE_VERIFIED.to_owned(),
            status: status.to_owned(),
            reason: "r".to_owned(),
            message: format!("verified at {time}"),
            observed_generation: None,
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(time)),
        };
        let mut old = record("nightly-1", "2026-03-01T03:00:00Z", Phase::Completed);
        old.verified = Some(verdict("True", "2026-03-01T03:20:00Z"));
        let mut new = record("nightly-2", "2026-03-02T03:00:00Z", Phase::Completed);
        new.verified = Some(verdict("False", "2026-03-02T03:20:00Z"));
        let backups = [old, new];
        let spec = spec("0 3 * * *");
        let status = look(&spec, None, &backups, "2026-03-02T04:00:00Z").status;
        let condition = status
            .conditions
            .iter()
            .find(|c| c.type_ == RESTORE_VERIFIED)
            .expect("RestoreVerified");
        assert_eq!(condition.status, "False");
        assert_eq!(
            status.last_verified.as_deref(),
            Some("2026-03-02T03:20:00Z")
        );
    }

    #[test]
    fn a_backup_record_reads_the_objects_times() {
        let mut backup = backup(
            "shop",
            NAME,
            Some(UID),
            "orders",
            false,
            &Planned {
                name: "nightly-20260301030000".to_owned(),
                slot: at("2026-03-01T03:00:00Z"),
            },
        );
        assert_eq!(BackupRecord::of(&backup), None, "no creation time yet");
        backup.metadata.creation_timestamp = Some(Time(at("2026-03-01T03:00:01Z")));
        backup.status = Some(castellan_crds::BackupStatus {
            phase: Some("Completed".to_owned()),
            stopped_at: Some("2026-03-01T03:10:00Z".to_owned()),
            ..castellan_crds::BackupStatus::default()
        });
        assert_eq!(
            BackupRecord::of(&backup),
            Some(BackupRecord {
                name: "nightly-20260301030000".to_owned(),
                created: at("2026-03-01T03:00:01Z"),
                phase: Phase::Completed,
                completed: Some(at("2026-03-01T03:10:00Z")),
                schedule_uid: Some(UID.to_owned()),
                verified: None,
            })
        );
    }

    #[test]
    fn looking_twice_changes_nothing_the_second_time() {
        let status = seen("2026-03-01T10:01:00Z");
        let first = look(
            &spec("* * * * *"),
            Some(&status),
            &[],
            "2026-03-01T10:01:00Z",
        );
        let made = [record(
            "nightly-20260301100100",
            "2026-03-01T10:01:00Z",
            Phase::Pending,
        )];
        let second = look(
            &spec("* * * * *"),
            Some(&first.status),
            &made,
            "2026-03-01T10:01:01Z",
        );
        assert_eq!(second.create, None);
        assert!(second.notes.is_empty());
        assert_eq!(second.status, first.status);
    }
}
