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
    /// `SOURCE:TARGET[:ro]`, bind-mounted in order.
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
}

impl BindMount {
    /// The `--mount` argument for this mount. Paths with `:` cannot be expressed, which
    /// the node refuses before it gets here.
    pub fn to_arg(&self) -> String {
        let mut arg = format!("{}:{}", self.source.display(), self.target.display());
        if self.read_only {
            arg.push_str(":ro");
        }
        arg
    }

    fn parse(arg: &str) -> anyhow::Result<Self> {
        let parts: Vec<&str> = arg.split(':').collect();
        match parts.as_slice() {
            [source, target] => Ok(Self {
                source: source.into(),
                target: target.into(),
                read_only: false,
            }),
            [source, target, "ro"] => Ok(Self {
                source: source.into(),
                target: target.into(),
                read_only: true,
            }),
            _ => bail!("mount {arg:?} is not SOURCE:TARGET[:ro]"),
        }
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
        unshare(CloneFlags::CLONE_NEWNS).context("creating a private mount namespace")?;
        // Without this, mounts made here would propagate back to the host's namespace.
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .context("making / private in the container's mount namespace")?;
        for bind in &mounts {
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
        };
        assert_eq!(BindMount::parse(&bind.to_arg()).ok(), Some(bind));
        assert!(BindMount::parse("/only-one").is_err());
    }
}
