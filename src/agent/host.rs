//! Commands that must act on the host's mounts, not the agent's own view of them.
//!
//! The agent mounts pools and creates subvolumes that *other* pods (and the kubelet)
//! use at host paths. Run as a DaemonSet, the agent lives in its container's mount
//! namespace: a `mount` made there would be invisible to the host, and a mount made on
//! the host after the container started would be invisible to the agent. So every
//! command that mounts, unmounts or looks inside a pool runs in PID 1's mount namespace
//! (`nsenter --mount=/proc/1/ns/mnt`, the way node agents of CSI drivers do it; the pod
//! needs `hostPID` and privileges for that). As a plain host process the agent already
//! is in that namespace and runs commands directly.
//!
//! This module runs commands and reports failures with what was run; it decides
//! nothing.

use std::path::Path;
use std::process::Command;

/// PID 1's mount namespace: the host's, when the agent shares the host PID namespace.
const HOST_MOUNT_NAMESPACE: &str = "/proc/1/ns/mnt";

/// Whether this process is in another mount namespace than PID 1 (a container).
/// Namespaces are compared by their links (`mnt:[4026531841]`); if either cannot be
/// read (no `hostPID`), the agent runs commands in its own namespace, which is right
/// for a host process and the only thing possible otherwise.
fn in_container() -> bool {
    let own = std::fs::read_link("/proc/self/ns/mnt");
    let host = std::fs::read_link(HOST_MOUNT_NAMESPACE);
    matches!((own, host), (Ok(own), Ok(host)) if own != host)
}

/// The command for `program`, entering the host's mount namespace when needed.
pub fn command(program: &str) -> Command {
    if in_container() {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--mount={HOST_MOUNT_NAMESPACE}"))
            .arg("--")
            .arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs a command on the host; its stdout, or what was run and how it failed.
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let output = command(program)
        .args(args)
        .output()
        .map_err(|error| format!("running {program} {}: {error}", args.join(" ")))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Whether `path` is a mount point on the host.
pub fn is_mount_point(path: &Path) -> bool {
    command("mountpoint")
        .arg("-q")
        .arg(path)
        .status()
        .is_ok_and(|status| status.success())
}

/// Creates a directory (and its parents) on the host.
pub fn create_dir_all(path: &Path) -> Result<(), String> {
    let path = path.to_string_lossy();
    run("mkdir", &["-p", &path]).map(drop)
}

/// Whether `path` exists on the host.
pub fn exists(path: &Path) -> bool {
    command("test")
        .arg("-e")
        .arg(path)
        .status()
        .is_ok_and(|status| status.success())
}

/// A command on the host left running while the agent goes on (a `btrfs replace` or
/// `scrub` in the foreground of a process of its own, so that its exit status and
/// output come back to the agent).
pub struct Background {
    child: std::process::Child,
    /// What was run, for errors.
    pub command: String,
    pub started: std::time::Instant,
}

impl Background {
    /// Starts `program args` with stdout and stderr kept for [`Background::finished`].
    pub fn start(program: &str, args: &[&str]) -> Result<Self, String> {
        let command_line = format!("{program} {}", args.join(" "));
        let child = command(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|error| format!("running {command_line}: {error}"))?;
        Ok(Self {
            child,
            command: command_line,
            started: std::time::Instant::now(),
        })
    }

    /// Whether it still runs (an error asking counts as ended).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for it to end: its stdout, or what was run and how it failed (with its
    /// stderr) and its stdout. Call once [`Background::running`] is false.
    pub fn finished(self) -> Result<String, (String, String)> {
        let command = self.command;
        match self.child.wait_with_output() {
            Ok(output) => {
                let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
                if output.status.success() {
                    Ok(stdout)
                } else {
                    Err((
                        format!(
                            "{command} failed ({}): {}",
                            output.status,
                            String::from_utf8_lossy(&output.stderr).trim()
                        ),
                        stdout,
                    ))
                }
            }
            Err(error) => Err((format!("waiting for {command}: {error}"), String::new())),
        }
    }
}
