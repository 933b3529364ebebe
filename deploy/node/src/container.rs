//! Starting and stopping one run of a container: its argv, environment, mounts and user
//! become a `castellan-devnode sandbox` process in its own process group (so signals
//! reach the container's whole tree), with stdout and stderr appended to the run's log.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Container, Pod};
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};

use crate::env::Environment;
use crate::process_registry::{MARKER_VARIABLE, ProcessRegistry, kill_group, kill_marked};
use crate::sandbox::BindMount;
use crate::volume::VolumePaths;

/// Everything needed to start a container's process (or an exec probe beside it).
#[derive(Clone, Debug)]
pub struct Launch {
    pub argv: Vec<String>,
    pub env: Environment,
    pub mounts: Vec<BindMount>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub groups: Vec<u32>,
    pub workdir: Option<PathBuf>,
    /// None for `hostNetwork` pods, which keep the host's name.
    pub hostname: Option<String>,
    /// The value of `CASTELLAN_DEVNODE_CONTAINER` for this container's processes.
    pub marker: String,
}

/// One running container process.
pub struct Process {
    child: Child,
    pub pid: u32,
    marker: String,
}

/// `runAsUser`/`runAsGroup`: the container's security context wins over the pod's.
pub fn run_as(pod: &Pod, container: &Container) -> (Option<u32>, Option<u32>) {
    let pod_context = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.security_context.as_ref());
    let container_context = container.security_context.as_ref();
    let id = |value: Option<i64>| value.and_then(|id| u32::try_from(id).ok());
    let uid = container_context
        .and_then(|c| c.run_as_user)
        .or(pod_context.and_then(|p| p.run_as_user));
    let gid = container_context
        .and_then(|c| c.run_as_group)
        .or(pod_context.and_then(|p| p.run_as_group));
    (id(uid), id(gid))
}

/// `fsGroup` and `supplementalGroups` of the pod.
pub fn supplementary_groups(pod: &Pod) -> Vec<u32> {
    let Some(context) = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.security_context.as_ref())
    else {
        return Vec::new();
    };
    context
        .fs_group
        .into_iter()
        .chain(context.supplemental_groups.iter().flatten().copied())
        .filter_map(|group| u32::try_from(group).ok())
        .collect()
}

/// The pod's hostname: `spec.hostname`, else its name cut to 63 characters, as the
/// kubelet sets it; None with `hostNetwork`.
pub fn hostname(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref();
    if spec.and_then(|spec| spec.host_network).unwrap_or(false) {
        return None;
    }
    let name = spec
        .and_then(|spec| spec.hostname.clone())
        .filter(|name| !name.is_empty())
        .or_else(|| pod.metadata.name.clone())?;
    Some(
        name.chars()
            .take(63)
            .collect::<String>()
            .trim_end_matches(['-', '.'])
            .to_string(),
    )
}

/// The container's `volumeMounts` as bind mounts of the prepared volume directories.
pub fn bind_mounts(container: &Container, volumes: &VolumePaths) -> anyhow::Result<Vec<BindMount>> {
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let Some(volume) = volumes.get(&mount.name) else {
            bail!("volumeMount {:?} names no volume of the pod", mount.name);
        };
        let mut source = volume.clone();
        if let Some(sub_path) = mount.sub_path.as_deref().filter(|path| !path.is_empty()) {
            if sub_path.split('/').any(|part| part == "..") {
                bail!("subPath {sub_path:?} leaves its volume");
            }
            source = source.join(sub_path);
            if !source.exists() {
                // As the kubelet does: a missing subPath becomes a directory.
                std::fs::create_dir_all(&source)
                    .with_context(|| format!("creating subPath {}", source.display()))?;
            }
        }
        let target = PathBuf::from(&mount.mount_path);
        if source.to_string_lossy().contains(':') || mount.mount_path.contains(':') {
            bail!(
                "mount {} → {} contains ':', which the sandbox cannot express",
                source.display(),
                mount.mount_path
            );
        }
        mounts.push(BindMount {
            source,
            target,
            read_only: mount.read_only.unwrap_or(false),
            bidirectional: mount.mount_propagation.as_deref() == Some("Bidirectional"),
        });
    }
    Ok(mounts)
}

/// The sandbox command for a launch. `/proc/self/exe` rather than the binary's path:
/// it still works after `cargo build` replaced the file under a running node.
pub fn sandbox_command(launch: &Launch) -> Command {
    let mut command = Command::new("/proc/self/exe");
    command.arg("sandbox");
    for mount in &launch.mounts {
        command.arg("--mount").arg(mount.to_arg());
    }
    if let Some(uid) = launch.uid {
        command.arg("--uid").arg(uid.to_string());
    }
    if let Some(gid) = launch.gid {
        command.arg("--gid").arg(gid.to_string());
    }
    for group in &launch.groups {
        command.arg("--group").arg(group.to_string());
    }
    if let Some(workdir) = &launch.workdir {
        command.arg("--workdir").arg(workdir);
    }
    if let Some(hostname) = &launch.hostname {
        command.arg("--hostname").arg(hostname);
    }
    command.arg("--").args(&launch.argv);
    command
        .env_clear()
        .envs(launch.env.iter().map(|(name, value)| (name, value)))
        .env(MARKER_VARIABLE, &launch.marker);
    // Its own process group, so that everything it starts can be killed with it.
    command
        .process_group(0)
        .stdin(Stdio::null())
        .kill_on_drop(false);
    command
}

/// Starts one run of a container, its output appended to `log_file`, and records it.
pub fn spawn(
    launch: &Launch,
    log_file: &Path,
    registry: &ProcessRegistry,
    owner: &str,
) -> anyhow::Result<Process> {
    if launch.argv.is_empty() {
        bail!(
            "no command: the container sets none and its image has no mapping (see docs/devnode.md)"
        );
    }
    if let Some(parent) = log_file.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
        .with_context(|| format!("opening log {}", log_file.display()))?;
    let log_for_stderr = log
        .try_clone()
        .with_context(|| format!("opening log {}", log_file.display()))?;
    let child = sandbox_command(launch)
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_for_stderr))
        .spawn()
        .with_context(|| format!("starting {:?}", launch.argv))?;
    let pid = child.id().context("the container process has no pid")?;
    registry.record(pid, owner)?;
    Ok(Process {
        child,
        pid,
        marker: launch.marker.clone(),
    })
}

/// How a run ended: an exit code as a container runtime reports it (128 + signal for
/// a process killed by a signal).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Exit {
    pub code: i32,
    pub signal: Option<i32>,
}

impl From<std::process::ExitStatus> for Exit {
    fn from(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Exit { code, signal: None },
            (None, Some(signal)) => Exit {
                code: 128 + signal,
                signal: Some(signal),
            },
            (None, None) => Exit {
                code: 128,
                signal: None,
            },
        }
    }
}

/// Waits for the container's main process; when it exits, whatever it started is
/// killed (its process group, and processes that left the group but carry the
/// container's marker), so a container's process tree never outlives it.
pub async fn wait(process: &mut Process, registry: &ProcessRegistry) -> Exit {
    let exit = match process.child.wait().await {
        Ok(status) => Exit::from(status),
        Err(error) => {
            tracing::warn!(pid = process.pid, "waiting for container process: {error}");
            Exit {
                code: 128,
                signal: None,
            }
        }
    };
    kill_everything(process, registry);
    exit
}

fn kill_everything(process: &Process, registry: &ProcessRegistry) {
    kill_group(process.pid, Signal::SIGKILL);
    kill_marked(|marker| marker == process.marker);
    registry.forget(process.pid);
}

/// Stops a container as a container runtime does: SIGTERM to its main process (which
/// owns shutting down what it started, as PID 1 in a container would), SIGKILL to all
/// of it once the main process exits or `grace` runs out.
pub async fn terminate(process: &mut Process, grace: Duration, registry: &ProcessRegistry) -> Exit {
    if let Ok(pid) = i32::try_from(process.pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGTERM);
    }
    match tokio::time::timeout(grace, process.child.wait()).await {
        Ok(status) => {
            kill_everything(process, registry);
            status.map(Exit::from).unwrap_or(Exit {
                code: 128,
                signal: None,
            })
        }
        Err(_elapsed) => {
            kill_group(process.pid, Signal::SIGKILL);
            wait(process, registry).await
        }
    }
}
