//! The sandbox a container's process starts in: its own hostname (the pod's, in a private
//! UTS namespace), a private mount namespace in which each
//! volume is bind-mounted at its `mountPath`, then the container's user and group, then
//! `exec` of the container's command (so the process keeps the pid the node recorded).
//!
//! Why bind mounts in a mount namespace rather than symlinks on the host: two pods that
//! mount different volumes at the same path (every PostgreSQL pod mounts its data at the
//! same place) would collide on the host, and a symlink would leak into the host's view.
//! In a private namespace each container sees its own volumes and the host sees none of
//! them. The one trace left on the host is the empty directory (or file) created as the
//! mount point when `mountPath` did not exist: a bind mount needs something to cover.
//!
//! `mountPropagation: Bidirectional` (what node agents that mount for other pods use,
//! Castellan's storage agent among them) is honoured: such a volume's source is made a
//! shared mount on the host (a bind mount onto itself, once) before the namespace is
//! created, and that mount is left out when everything else is made a slave, so mounts
//! made under it in the container appear on the host and the other way round.
//!
//! This runs before any async runtime or thread exists: `unshare(CLONE_NEWNS)` and the
//! user change apply to the calling thread only.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use nix::unistd::{Gid, Uid, setgid, setgroups, sethostname, setuid};

#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    /// `SOURCE:TARGET[:ro][:rshared]`, bind-mounted in order.
    #[arg(long = "mount")]
    mounts: Vec<String>,
    #[arg(long)]
    uid: Option<u32>,
    #[arg(long)]
    gid: Option<u32>,
    /// Supplementary groups (`fsGroup`, `supplementalGroups`).
    #[arg(long = "group")]
    groups: Vec<u32>,
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// The pod's hostname, set in a private UTS namespace.
    #[arg(long)]
    hostname: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// One bind mount asked of the sandbox.
#[derive(Clone, Debug, PartialEq)]
pub struct BindMount {
    pub source: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
    /// `mountPropagation: Bidirectional`.
    pub bidirectional: bool,
}

impl BindMount {
    /// The `--mount` argument for this mount. Paths with `:` cannot be expressed, which
    /// the node refuses before it gets here.
    pub fn to_arg(&self) -> String {
        let mut arg = format!("{}:{}", self.source.display(), self.target.display());
        if self.read_only {
            arg.push_str(":ro");
        }
        if self.bidirectional {
            arg.push_str(":rshared");
        }
        arg
    }

    fn parse(arg: &str) -> anyhow::Result<Self> {
        let parts: Vec<&str> = arg.split(':').collect();
        let (source, target, options) = match parts.as_slice() {
            [source, target, options @ ..] => (source, target, options),
            _ => bail!("mount {arg:?} is not SOURCE:TARGET[:ro][:rshared]"),
        };
        let mut bind = Self {
            source: source.into(),
            target: target.into(),
            read_only: false,
            bidirectional: false,
        };
        for option in options {
            match *option {
                "ro" => bind.read_only = true,
                "rshared" => bind.bidirectional = true,
                _ => bail!("mount {arg:?} is not SOURCE:TARGET[:ro][:rshared]"),
            }
        }
        Ok(bind)
    }
}

pub fn run(args: SandboxArgs) -> anyhow::Result<()> {
    let mounts = args
        .mounts
        .iter()
        .map(|arg| BindMount::parse(arg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(hostname) = &args.hostname {
        unshare(CloneFlags::CLONE_NEWUTS).context("creating a private UTS namespace")?;
        sethostname(hostname).with_context(|| format!("setting hostname {hostname:?}"))?;
    }
    if !mounts.is_empty() {
        let shared: Vec<&Path> = mounts
            .iter()
            .filter(|bind| bind.bidirectional)
            .map(|bind| bind.source.as_path())
            .collect();
        for source in &shared {
            share_on_host(source)?;
        }
        unshare(CloneFlags::CLONE_NEWNS).context("creating a private mount namespace")?;
        // Without this, mounts made here would propagate back to the host's namespace.
        // Slave rather than private: an unmount on the host still reaches the copy made
        // here (for mounts under a shared one, such as the storage agent's pools), so a
        // container started while a pool was mounted does not keep that filesystem, and
        // its disks, busy after the host let go of it.
        if shared.is_empty() {
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_SLAVE,
                None::<&str>,
            )
            .context("making / a slave in the container's mount namespace")?;
        } else {
            make_slave_except(&shared)?;
        }
        for bind in &mounts {
            if bind.bidirectional && bind.source == bind.target {
                // Already there, shared with the host. Binding it again would stack a
                // mount on the shared one, and that mount would propagate to the host.
                continue;
            }
            bind_mount(bind)?;
        }
    }
    if let Some(gid) = args.gid {
        let mut groups: Vec<Gid> = vec![Gid::from_raw(gid)];
        groups.extend(args.groups.iter().map(|group| Gid::from_raw(*group)));
        setgroups(&groups).with_context(|| format!("setting supplementary groups {groups:?}"))?;
        setgid(Gid::from_raw(gid)).with_context(|| format!("setting group id {gid}"))?;
    } else if !args.groups.is_empty() {
        let groups: Vec<Gid> = args.groups.iter().map(|g| Gid::from_raw(*g)).collect();
        setgroups(&groups).with_context(|| format!("setting supplementary groups {groups:?}"))?;
    }
    if let Some(uid) = args.uid {
        if args.gid.is_none() {
            // runAsUser without runAsGroup: like a container runtime, use group 0 unless
            // told otherwise, but drop root's supplementary groups.
            setgroups(&[Gid::from_raw(0)]).context("clearing supplementary groups")?;
        }
        setuid(Uid::from_raw(uid)).with_context(|| format!("setting user id {uid}"))?;
    }
    let (program, arguments) = args
        .command
        .split_first()
        .context("the container has no command")?;
    let mut command = std::process::Command::new(program);
    command.args(arguments);
    if let Some(workdir) = &args.workdir {
        command.current_dir(workdir);
    }
    // exec only returns on failure.
    let error = command.exec();
    Err(error).with_context(|| format!("starting {program:?}"))
}

/// Makes `source` a shared mount on the host (still in the host's namespace): a bind
/// mount onto itself when it is not a mount point yet. Idempotent; the self-bind stays
/// (`nodes.sh down` removes the ones under the cluster's state directory).
fn share_on_host(source: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(source)
        .with_context(|| format!("creating the shared volume {}", source.display()))?;
    if !mount_points().iter().any(|point| point == source) {
        mount(
            Some(source),
            source,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("bind-mounting {} onto itself", source.display()))?;
    }
    mount(
        None::<&str>,
        source,
        None::<&str>,
        MsFlags::MS_SHARED,
        None::<&str>,
    )
    .with_context(|| format!("making {} a shared mount", source.display()))
}

/// Every mount of the container's namespace a slave, one by one, except the shared
/// volumes and what is mounted under them (a recursive `MS_SLAVE` on `/` would stop
/// their mounts from reaching the host).
fn make_slave_except(shared: &[&Path]) -> anyhow::Result<()> {
    for point in mount_points() {
        if shared.iter().any(|source| point.starts_with(source)) {
            continue;
        }
        // A mount that vanished meanwhile is no longer there to leak anything.
        if let Err(error) = mount(
            None::<&str>,
            &point,
            None::<&str>,
            MsFlags::MS_SLAVE,
            None::<&str>,
        ) && error != nix::errno::Errno::EINVAL
            && error != nix::errno::Errno::ENOENT
        {
            return Err(error).with_context(|| format!("making {} a slave", point.display()));
        }
    }
    Ok(())
}

/// Mount points of this process's namespace (octal escapes of `mountinfo` decoded for
/// spaces, the one that matters in paths we make).
fn mount_points() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(point.replace("\\040", " ")))
        .collect()
}

fn bind_mount(bind: &BindMount) -> anyhow::Result<()> {
    create_mount_point(&bind.source, &bind.target)?;
    mount(
        Some(&bind.source),
        &bind.target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .with_context(|| {
        format!(
            "bind-mounting {} at {}",
            bind.source.display(),
            bind.target.display()
        )
    })?;
    if bind.read_only {
        mount(
            None::<&str>,
            &bind.target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_REC,
            None::<&str>,
        )
        .with_context(|| format!("making {} read-only", bind.target.display()))?;
    }
    Ok(())
}

/// A bind mount covers an existing file or directory of the same kind.
fn create_mount_point(source: &Path, target: &Path) -> anyhow::Result<()> {
    if target.exists() {
        return Ok(());
    }
    if source.is_dir() {
        std::fs::create_dir_all(target)
            .with_context(|| format!("creating mount point {}", target.display()))?;
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating mount point {}", parent.display()))?;
        }
        std::fs::File::create(target)
            .with_context(|| format!("creating mount point {}", target.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_arguments_round_trip() {
        let bind = BindMount {
            source: "/state/pods/a/volumes/data".into(),
            target: "/var/lib/data".into(),
            read_only: true,
            bidirectional: false,
        };
        assert_eq!(BindMount::parse(&bind.to_arg()).ok(), Some(bind));
        let shared = BindMount {
            source: "/pools".into(),
            target: "/pools".into(),
            read_only: false,
            bidirectional: true,
        };
        assert_eq!(shared.to_arg(), "/pools:/pools:rshared");
        assert_eq!(BindMount::parse(&shared.to_arg()).ok(), Some(shared));
        assert!(BindMount::parse("/a:/b:rw").is_err());
        assert!(BindMount::parse("/only-one").is_err());
    }
}
