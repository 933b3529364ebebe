//! Replacing a failed pool member: the shell side of `pool::Step::Replace`.
//!
//! `btrfs replace` copies a failed member's data onto a new disk (from the layout's
//! other copies where they exist) and then swaps the new disk in under the failed
//! one's device id. It takes as long as the data takes to copy, so it runs in a
//! process of its own (`-B`: in the foreground of that process, so its exit status
//! and its error reach the agent; without `-B`, btrfs-progs forks and an error such as
//! a refused source device is lost). The pool pass looks at it on every pass: while it
//! runs, its progress goes to `status.nodes[].replacement`; when it ends, the result is
//! handed back once.
//!
//! After an agent restart the process is gone but the kernel may still be copying (or
//! have stopped with it): the filesystem then lists the new disk as device id 0, and
//! that alone is reported and waited for.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use castellan_crds::storage_pool::PoolReplacement;

use super::machine::FailedMember;
use crate::agent::btrfs::{self, Show};
use crate::agent::host::{Background, run};

/// What an ENOSPC from `btrfs replace` means for the user.
const TOO_FULL: &str = " (the pool is too full to replace a member: btrfs sets each block group read-only while it copies it, which needs room for it elsewhere; free space in the pool and it is tried again)";

/// How long a failed replacement waits before the next try.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);

/// A `btrfs replace` this agent started.
struct Job {
    process: Background,
    failed: FailedMember,
    status: PoolReplacement,
}

/// How a replacement that ended went.
pub struct Ended {
    pub failed: FailedMember,
    pub block_device: String,
    pub path: String,
    pub took: Duration,
    pub result: Result<(), String>,
}

/// The pool's replacement now.
pub enum Progress {
    None,
    Running(PoolReplacement),
    Ended(Ended),
}

/// The node's replacements, one per pool at most (btrfs runs one at a time).
#[derive(Default)]
pub struct Replacements {
    jobs: Mutex<BTreeMap<String, Job>>,
    /// The last failure per pool, and when.
    failures: Mutex<BTreeMap<String, (String, Instant)>>,
}

impl Replacements {
    /// Starts replacing `failed` in the pool mounted at `mount` by the disk at `path`.
    pub fn start(
        &self,
        pool: &str,
        mount: &Path,
        failed: &FailedMember,
        (path, block_device): (&str, &str),
    ) -> Result<(), String> {
        let devid = failed.devid.to_string();
        let mount_text = mount.to_string_lossy();
        let process = Background::start(
            "btrfs",
            &["replace", "start", "-B", "-r", &devid, path, &mount_text],
        )?;
        let job = Job {
            process,
            failed: failed.clone(),
            status: PoolReplacement {
                failed: format!("{} (devid {})", failed.name, failed.devid),
                block_device: block_device.to_string(),
                path: path.to_string(),
                progress: None,
            },
        };
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.insert(pool.to_string(), job);
        }
        Ok(())
    }

    /// The pool's replacement: running (with btrfs's progress), ended since the last
    /// look (once), or none. Blocking: reads `btrfs replace status`.
    pub fn progress(&self, pool: &str, mount: &Path, show: Option<&Show>) -> Progress {
        let Ok(mut jobs) = self.jobs.lock() else {
            return Progress::None;
        };
        let mount_text = mount.to_string_lossy();
        let copied = || {
            run("btrfs", &["replace", "status", "-1", &mount_text])
                .ok()
                .and_then(|text| btrfs::parse_replace_progress(&text))
        };
        if let Some(job) = jobs.get_mut(pool)
            && job.process.running()
        {
            let mut status = job.status.clone();
            status.progress = copied();
            return Progress::Running(status);
        }
        if let Some(job) = jobs.remove(pool) {
            let took = job.process.started.elapsed();
            let result = job.process.finished().map(drop).map_err(|(error, _)| {
                if error.contains("No space left on device") {
                    format!("{error}{TOO_FULL}")
                } else {
                    error
                }
            });
            if let (Err(message), Ok(mut failures)) = (&result, self.failures.lock()) {
                failures.insert(pool.to_string(), (message.clone(), Instant::now()));
            }
            return Progress::Ended(Ended {
                failed: job.failed,
                block_device: job.status.block_device,
                path: job.status.path,
                took,
                result,
            });
        }
        // Started before this agent: the filesystem shows its new disk as devid 0.
        let Some(target) = show
            .and_then(|show| show.devices.iter().find(|device| device.devid == 0))
            .and_then(|device| device.path.clone())
        else {
            return Progress::None;
        };
        Progress::Running(PoolReplacement {
            failed: "a member (the replacement was started before this agent)".to_string(),
            block_device: String::new(),
            path: target,
            progress: copied(),
        })
    }

    /// Why the pool's last replacement failed, while it is recent enough that the next
    /// try should wait.
    pub fn recent_failure(&self, pool: &str) -> Option<String> {
        let failures = self.failures.lock().ok()?;
        let (message, when) = failures.get(pool)?;
        (when.elapsed() < RETRY_AFTER).then(|| message.clone())
    }

    /// Forgets the pool's last failure (a replacement succeeded).
    pub fn forget_failure(&self, pool: &str) {
        if let Ok(mut failures) = self.failures.lock() {
            failures.remove(pool);
        }
    }
}
