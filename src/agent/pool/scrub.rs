//! Scrubbing a node's part of a pool on the pool's schedule (`spec.scrub`).
//!
//! A scrub reads every copy of every block and checks it against its checksum; on a
//! raid1 pool a bad copy is rewritten from a good one. It is how silent corruption is
//! found before the other copy is needed, so it runs on a schedule (the first day of
//! each month at 03:00 UTC by default, as btrfsmaintenance does).
//!
//! The decisions are pure ([`plan`], [`verdict`]); [`Scrubs`] runs
//! `btrfs scrub start -B -R` in a process of its own per pool (its raw counters come
//! back on its stdout when it ends). The schedule's state lives in the pool's status
//! (`status.nodes[].scrub.lastStarted`), so an agent restart neither repeats a scrub
//! nor forgets one: the scrubs owed since the last one (however many slots passed)
//! are one scrub, started as soon as the pool may run it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use jiff::Timestamp;

use crate::agent::host::Background;
use crate::cadence::Cadence;

pub const RUNNING: &str = "Running";
pub const SUCCEEDED: &str = "Succeeded";
pub const REPAIRED: &str = "Repaired";
pub const FAILED: &str = "Failed";

/// What to do about scrubbing now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Start a scrub now.
    pub start: bool,
    /// The next slot after this pass (after now if one starts, else the one owed).
    pub next: Option<Timestamp>,
}

/// Whether a scrub is due: the first slot after the last scrub started (or, for a
/// pool never scrubbed here, after `since`, when the node's part was first seen) has
/// come. `may_run` is false while the pool cannot be scrubbed usefully (not mounted, a
/// member failed or being replaced, a scrub running): a due scrub then waits.
pub fn plan(
    cadence: &Cadence,
    last_started: Option<Timestamp>,
    since: Timestamp,
    now: Timestamp,
    may_run: bool,
) -> Plan {
    let owed = cadence.next_after(last_started.unwrap_or(since)).ok();
    match owed {
        Some(slot) if slot <= now && may_run => Plan {
            start: true,
            next: cadence.next_after(now).ok(),
        },
        next => Plan { start: false, next },
    }
}

/// The counters of `btrfs scrub start -B -R` (or `status -R`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub bytes: u64,
    pub read_errors: u64,
    pub csum_errors: u64,
    pub verify_errors: u64,
    pub super_errors: u64,
    pub corrected: u64,
    pub uncorrectable: u64,
}

/// Reads the raw counters (`\tcsum_errors: 3` lines); `None` when there are none.
pub fn parse_counts(text: &str) -> Option<Counts> {
    let mut counts = Counts::default();
    let mut seen = false;
    for line in text.lines() {
        let Some((name, value)) = line.trim().split_once(':') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<u64>() else {
            continue;
        };
        let field = match name {
            "data_bytes_scrubbed" | "tree_bytes_scrubbed" => {
                counts.bytes += value;
                seen = true;
                continue;
            }
            "read_errors" => &mut counts.read_errors,
            "csum_errors" => &mut counts.csum_errors,
            "verify_errors" => &mut counts.verify_errors,
            "super_errors" => &mut counts.super_errors,
            "corrected_errors" => &mut counts.corrected,
            "uncorrectable_errors" => &mut counts.uncorrectable,
            _ => continue,
        };
        *field = value;
        seen = true;
    }
    seen.then_some(counts)
}

/// The phase and result of a scrub that ended with `counts`.
pub fn verdict(counts: &Counts) -> (&'static str, String) {
    let size = format!("{:.1} MiB", counts.bytes as f64 / (1024.0 * 1024.0));
    let errors =
        counts.read_errors + counts.csum_errors + counts.verify_errors + counts.super_errors;
    let found = format!(
        "{} read, {} checksum, {} verify, {} superblock errors in {size}",
        counts.read_errors, counts.csum_errors, counts.verify_errors, counts.super_errors
    );
    if counts.uncorrectable > 0 {
        (
            FAILED,
            format!(
                "{found}: {} uncorrectable (a block with no good copy: the files that hold it are damaged), {} corrected",
                counts.uncorrectable, counts.corrected
            ),
        )
    } else if errors > 0 {
        (
            REPAIRED,
            format!("{found}: all corrected from the good copy"),
        )
    } else {
        (SUCCEEDED, format!("no errors found in {size}"))
    }
}

/// How a scrub that ended went: its phase and result.
pub fn ended(outcome: Result<String, (String, String)>) -> (&'static str, String) {
    match outcome {
        Ok(stdout) => parse_counts(&stdout).map_or(
            (
                FAILED,
                "the scrub ended without its counters (btrfs scrub start -B -R printed none)"
                    .to_string(),
            ),
            |counts| verdict(&counts),
        ),
        // btrfs exits non-zero when it found uncorrectable errors: the counters say
        // what; without them, the error does.
        Err((error, stdout)) => match parse_counts(&stdout) {
            Some(counts) if counts.uncorrectable > 0 => verdict(&counts),
            _ => (FAILED, error),
        },
    }
}

/// The node's running scrubs, one per pool.
#[derive(Default)]
pub struct Scrubs {
    jobs: Mutex<BTreeMap<String, Background>>,
}

/// A pool's scrub now.
pub enum Progress {
    None,
    Running,
    /// It ended since the last look: its phase and result.
    Ended(&'static str, String),
}

impl Scrubs {
    pub fn start(&self, pool: &str, mount: &Path) -> Result<(), String> {
        let process = Background::start(
            "btrfs",
            &["scrub", "start", "-B", "-R", &mount.to_string_lossy()],
        )?;
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.insert(pool.to_string(), process);
        }
        Ok(())
    }

    /// The pool's scrub: running, ended since the last look (once), or none.
    pub fn progress(&self, pool: &str) -> Progress {
        let Ok(mut jobs) = self.jobs.lock() else {
            return Progress::None;
        };
        let Some(job) = jobs.get_mut(pool) else {
            return Progress::None;
        };
        if job.running() {
            return Progress::Running;
        }
        match jobs.remove(pool) {
            Some(job) => {
                let (phase, result) = ended(job.finished());
                Progress::Ended(phase, result)
            }
            None => Progress::None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    fn at(time: &str) -> Timestamp {
        time.parse().unwrap()
    }

    fn monthly() -> Cadence {
        Cadence::parse(
            castellan_crds::storage_pool::DEFAULT_SCRUB_SCHEDULE,
            None,
            at("2026-01-01T00:00:00Z"),
        )
        .unwrap()
    }

    #[test]
    fn a_scrub_is_due_at_the_first_slot_after_the_last_one_and_owed_ones_are_one() {
        let cadence = monthly();
        let since = at("2026-03-15T10:00:00Z");
        // Never scrubbed here: the first slot after the pool was first seen.
        assert_eq!(
            plan(&cadence, None, since, at("2026-03-20T00:00:00Z"), true),
            Plan {
                start: false,
                next: Some(at("2026-04-01T03:00:00Z"))
            }
        );
        assert_eq!(
            plan(&cadence, None, since, at("2026-04-01T03:00:00Z"), true),
            Plan {
                start: true,
                next: Some(at("2026-05-01T03:00:00Z"))
            }
        );
        // Three slots missed (the node was off): one scrub now, then the next slot.
        let last = Some(at("2026-01-01T03:00:00Z"));
        assert_eq!(
            plan(&cadence, last, since, at("2026-04-10T12:00:00Z"), true),
            Plan {
                start: true,
                next: Some(at("2026-05-01T03:00:00Z"))
            }
        );
        // Due, but the pool cannot be scrubbed now: it waits, owed.
        assert_eq!(
            plan(&cadence, last, since, at("2026-04-10T12:00:00Z"), false),
            Plan {
                start: false,
                next: Some(at("2026-02-01T03:00:00Z"))
            }
        );
        // Just scrubbed: nothing until the next slot.
        let last = Some(at("2026-04-01T03:00:01Z"));
        assert!(!plan(&cadence, last, since, at("2026-04-20T00:00:00Z"), true).start);
    }

    const CLEAN: &str = "scrub done for 76743be6-5f28-41ca-9ae8-e3801412ddb3
Scrub started:    Thu Dec  3 20:58:59 2026
Status:           finished
Duration:         0:00:00
\tdata_extents_scrubbed: 1526
\ttree_extents_scrubbed: 26
\tdata_bytes_scrubbed: 100007936
\ttree_bytes_scrubbed: 425984
\tread_errors: 0
\tcsum_errors: 0
\tverify_errors: 0
\tno_csum: 0
\tcsum_discards: 0
\tsuper_errors: 0
\tmalloc_errors: 0
\tuncorrectable_errors: 0
\tunverified_errors: 0
\tcorrected_errors: 0
\tlast_physical: 166789120
";

    #[test]
    fn the_counters_say_succeeded_repaired_or_failed() {
        assert_eq!(
            ended(Ok(CLEAN.to_string())),
            (SUCCEEDED, "no errors found in 95.8 MiB".to_string())
        );
        let repaired = CLEAN
            .replace("csum_errors: 0", "csum_errors: 12208")
            .replace("corrected_errors: 0", "corrected_errors: 12208");
        assert_eq!(
            ended(Ok(repaired)),
            (
                REPAIRED,
                "0 read, 12208 checksum, 0 verify, 0 superblock errors in 95.8 MiB: all corrected from the good copy".to_string()
            )
        );
        let lost = CLEAN
            .replace("csum_errors: 0", "csum_errors: 4")
            .replace("uncorrectable_errors: 0", "uncorrectable_errors: 4");
        let (phase, result) = ended(Err(("btrfs scrub failed (exit status: 3)".into(), lost)));
        assert_eq!(phase, FAILED);
        assert!(result.contains("4 uncorrectable"), "{result}");
        assert_eq!(
            ended(Err((
                "btrfs scrub start failed: busy".into(),
                String::new()
            ))),
            (FAILED, "btrfs scrub start failed: busy".to_string())
        );
        assert_eq!(ended(Ok("nothing".into())).0, FAILED);
    }
}
