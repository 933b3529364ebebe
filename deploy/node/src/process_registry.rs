//! The record of every container process this node started, kept on disk so that a node
//! that was killed (and could not clean up) kills its leftovers when it starts again.
//!
//! A process group does not hold everything a container starts: a daemon calls `setsid`
//! and leaves it. So every container process also carries `CASTELLAN_DEVNODE_CONTAINER`
//! in its environment, inherited by all it starts, and the node kills whatever still
//! carries a container's marker when that container ends (`kill_marked`).
//!
//! Each running container's process group is one file `processes/<pid>` holding the
//! process's start time (field 22 of `/proc/<pid>/stat`), which tells a leftover from an
//! unrelated process that reused the pid.

use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

/// The environment variable that marks a container's processes: its value is
/// `<pod state directory>/<container name>`.
pub const MARKER_VARIABLE: &str = "CASTELLAN_DEVNODE_CONTAINER";

#[derive(Clone)]
pub struct ProcessRegistry {
    dir: PathBuf,
    /// Markers of this node's containers all start with this.
    marker_prefix: String,
}

impl ProcessRegistry {
    pub fn open(state_dir: &Path) -> anyhow::Result<Self> {
        let dir = state_dir.join("processes");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating process registry {}", dir.display()))?;
        let marker_prefix = format!("{}/", state_dir.join("pods").display());
        Ok(Self { dir, marker_prefix })
    }

    pub fn record(&self, pid: u32, owner: &str) -> anyhow::Result<()> {
        let start_time = start_time(pid).unwrap_or_default();
        let file = self.dir.join(pid.to_string());
        std::fs::write(&file, format!("{start_time} {owner}\n"))
            .with_context(|| format!("recording process {pid} in {}", file.display()))
    }

    pub fn forget(&self, pid: u32) {
        // Already gone is fine: forgetting is idempotent.
        let _ = std::fs::remove_file(self.dir.join(pid.to_string()));
    }

    /// Kills (SIGKILL) the process group of every recorded process that still runs and
    /// forgets them all. Returns how many were killed.
    pub fn kill_leftovers(&self) -> anyhow::Result<usize> {
        let mut killed = 0;
        let entries = std::fs::read_dir(&self.dir)
            .with_context(|| format!("listing {}", self.dir.display()))?;
        for entry in entries {
            let entry = entry.with_context(|| format!("listing {}", self.dir.display()))?;
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<u32>().ok())
            else {
                continue;
            };
            let recorded = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let recorded_start = recorded.split_whitespace().next().unwrap_or_default();
            if start_time(pid).is_some_and(|now| now == recorded_start) {
                tracing::info!(
                    pid,
                    owner = recorded.trim(),
                    "killing leftover container process group"
                );
                kill_group(pid, Signal::SIGKILL);
                killed += 1;
            }
            self.forget(pid);
        }
        killed += kill_marked(|marker| marker.starts_with(&self.marker_prefix));
        Ok(killed)
    }
}

/// Sends `signal` to the process group led by `pid` (every container process leads its
/// own group). A group that no longer exists is not an error.
pub fn kill_group(pid: u32, signal: Signal) {
    // killpg(0) is our own group and killpg(1) is kill(-1), every process on the
    // machine: neither can be a container's group, so refuse them outright.
    if pid <= 1 {
        tracing::error!(pid, "refusing to signal process group {pid}");
        return;
    }
    if let Ok(pid) = i32::try_from(pid) {
        let _ = killpg(Pid::from_raw(pid), signal);
    }
}

/// SIGKILLs every process whose container marker satisfies `matches`; returns how many.
/// Scans a few times, since a process may fork while the scan runs.
pub fn kill_marked(matches: impl Fn(&str) -> bool) -> usize {
    let own = std::process::id();
    let prefix = format!("{MARKER_VARIABLE}=");
    let mut killed = 0;
    for _ in 0..3 {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return killed;
        };
        let marked: Vec<u32> = entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| *pid != own)
            .filter(|pid| {
                let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                environ.split(|byte| *byte == 0).any(|entry| {
                    std::str::from_utf8(entry)
                        .ok()
                        .and_then(|entry| entry.strip_prefix(&prefix))
                        .is_some_and(&matches)
                })
            })
            .collect();
        if marked.is_empty() {
            break;
        }
        for pid in marked.into_iter().filter(|pid| *pid > 1) {
            if let Ok(raw) = i32::try_from(pid)
                && kill(Pid::from_raw(raw), Signal::SIGKILL).is_ok()
            {
                killed += 1;
            }
        }
    }
    killed
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks since boot).
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_this_process_is_stable() {
        let pid = std::process::id();
        let first = start_time(pid);
        assert!(first.is_some());
        assert_eq!(first, start_time(pid));
    }
}
