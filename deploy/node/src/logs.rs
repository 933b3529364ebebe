//! Container logs: one file per run of a container, `<pod>/logs/<container>/<n>.log`,
//! where `n` is the container's restart count at that run. The newest file is the
//! current log, the one before it is what `kubectl logs --previous` shows; older ones
//! are pruned. Because the files outlive a node restart, so does the restart count.

use std::path::{Path, PathBuf};

const RUNS_KEPT: usize = 3;

pub fn container_dir(pod_dir: &Path, container: &str) -> PathBuf {
    pod_dir.join("logs").join(container)
}

/// Run numbers with a log file, in ascending order.
pub fn runs(pod_dir: &Path, container: &str) -> Vec<u32> {
    let mut runs: Vec<u32> = std::fs::read_dir(container_dir(pod_dir, container))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            entry
                .file_name()
                .to_str()?
                .strip_suffix(".log")?
                .parse()
                .ok()
        })
        .collect();
    runs.sort_unstable();
    runs
}

pub fn run_file(pod_dir: &Path, container: &str, run: u32) -> PathBuf {
    container_dir(pod_dir, container).join(format!("{run}.log"))
}

/// The log file of the current run, or of the one before it.
pub fn log_file(pod_dir: &Path, container: &str, previous: bool) -> Option<PathBuf> {
    let runs = runs(pod_dir, container);
    let index = runs.len().checked_sub(if previous { 2 } else { 1 })?;
    Some(run_file(pod_dir, container, runs[index]))
}

/// Deletes all but the newest runs' logs.
pub fn prune(pod_dir: &Path, container: &str) {
    let runs = runs(pod_dir, container);
    for run in runs.iter().take(runs.len().saturating_sub(RUNS_KEPT)) {
        let _ = std::fs::remove_file(run_file(pod_dir, container, *run));
    }
}

/// The last `lines` lines of `text` (all of it when `None`).
pub fn tail(text: &[u8], lines: Option<usize>) -> &[u8] {
    let Some(lines) = lines else { return text };
    if lines == 0 {
        return &[];
    }
    // A trailing newline ends the last line rather than starting an empty one.
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0;
    for (index, byte) in body.iter().enumerate().rev() {
        if *byte == b'\n' {
            seen += 1;
            if seen == lines {
                return &text[index + 1..];
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_counts_lines_from_the_end() {
        assert_eq!(tail(b"a\nb\nc\n", Some(2)), b"b\nc\n");
        assert_eq!(tail(b"a\nb\nc", Some(1)), b"c");
        assert_eq!(tail(b"a\nb\n", Some(5)), b"a\nb\n");
        assert_eq!(tail(b"a\n", Some(0)), b"");
        assert_eq!(tail(b"a\n", None), b"a\n");
    }

    #[test]
    fn previous_is_the_run_before_the_newest() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("devnode-logs-{}", std::process::id()));
        std::fs::create_dir_all(container_dir(&dir, "c"))?;
        for run in [0, 1, 2, 10] {
            std::fs::write(run_file(&dir, "c", run), b"")?;
        }
        assert_eq!(log_file(&dir, "c", false), Some(run_file(&dir, "c", 10)));
        assert_eq!(log_file(&dir, "c", true), Some(run_file(&dir, "c", 2)));
        prune(&dir, "c");
        assert_eq!(runs(&dir, "c"), vec![1, 2, 10]);
        std::fs::remove_dir_all(&dir)
    }
}
