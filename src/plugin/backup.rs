//! `kubectl castellan backup CLUSTER`: creates a Backup (as `kubectl apply` of one
//! would) and follows its status to the end: a progress bar from
//! `.status.progressPercent` on a terminal, a plain line per change otherwise (a log
//! or a CI job). Exits non-zero with the reason when the backup fails. Interrupting
//! the plugin does not stop the backup: the operator carries on with the object.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::{Context, bail};
use castellan_crds::{Backup, BackupStatus};
use clap::Args;
use futures::TryStreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;

use super::Target;

#[derive(Args)]
pub struct BackupArgs {
    cluster: String,
    /// The Backup's name (default: `<cluster>-` and a generated suffix).
    #[arg(long)]
    name: Option<String>,
    /// Once completed, restore it into a scratch instance to prove it restorable
    /// (`spec.verify`).
    #[arg(long)]
    verify: bool,
    /// Create the Backup and return, without following it.
    #[arg(long)]
    no_wait: bool,
}

/// Where a backup stands, as the plugin reports it.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// Still going: the phase, percent done (when known) and what status says about it.
    Going {
        phase: String,
        percent: Option<u64>,
        note: Option<String>,
    },
    Completed {
        size: Option<String>,
        location: Option<String>,
    },
    Failed(String),
}

pub fn progress(status: Option<&BackupStatus>) -> Progress {
    let Some(status) = status else {
        return Progress::Going {
            phase: "Pending".to_owned(),
            percent: None,
            note: None,
        };
    };
    match status.phase.as_deref() {
        Some("Completed") => Progress::Completed {
            size: status.size.clone(),
            location: status.location.clone(),
        },
        Some("Failed") => Progress::Failed(
            status
                .error
                .clone()
                .unwrap_or_else(|| "no reason given (see its Events)".to_owned()),
        ),
        phase => Progress::Going {
            phase: phase.unwrap_or("Pending").to_owned(),
            percent: status
                .progress_percent
                .and_then(|p| u64::try_from(p.clamp(0, 100)).ok()),
            // A Pending backup says why it waits (no cluster yet, no object store), a
            // Running one what it waits for (its WAL archived).
            note: status.error.clone().or_else(|| status.waiting_for.clone()),
        },
    }
}

/// How progress is shown: a bar on a terminal, lines otherwise.
enum Display {
    Bar(ProgressBar),
    Lines { last: Option<String> },
}

impl Display {
    fn new(name: &str) -> Self {
        if !std::io::stderr().is_terminal() {
            return Display::Lines { last: None };
        }
        let bar = ProgressBar::new(100);
        // `{bar}` widens to the terminal; the rest is short so it fits 80 columns.
        let style = ProgressStyle::with_template(
            "{spinner} {prefix} [{wide_bar}] {pos:>3}% {elapsed} {msg}",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(name.to_owned());
        bar.enable_steady_tick(Duration::from_millis(200));
        Display::Bar(bar)
    }

    fn show(&mut self, name: &str, progress: &Progress) {
        match (self, progress) {
            (
                Display::Bar(bar),
                Progress::Going {
                    phase,
                    percent,
                    note,
                },
            ) => {
                if let Some(percent) = percent {
                    bar.set_position(*percent);
                }
                bar.set_message(match note {
                    Some(note) => format!("{phase}: {note}"),
                    None => phase.clone(),
                });
            }
            (Display::Bar(bar), Progress::Completed { size, .. }) => {
                bar.set_position(100);
                bar.finish_with_message(format!(
                    "completed {}",
                    size.as_deref().unwrap_or_default()
                ));
            }
            (Display::Bar(bar), Progress::Failed(reason)) => {
                bar.abandon_with_message(format!("failed: {reason}"));
            }
            (Display::Lines { last }, progress) => {
                let line = match progress {
                    Progress::Going {
                        phase,
                        percent,
                        note,
                    } => format!(
                        "backup {name}: {phase}{}{}",
                        percent.map(|p| format!(" {p}%")).unwrap_or_default(),
                        note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()
                    ),
                    Progress::Completed { size, .. } => format!(
                        "backup {name}: Completed 100%{}",
                        size.as_ref().map(|s| format!(" {s}")).unwrap_or_default()
                    ),
                    Progress::Failed(reason) => format!("backup {name}: Failed: {reason}"),
                };
                if last.as_ref() != Some(&line) {
                    // Progress only: a closed stderr must not stop the wait (eprintln
                    // would panic on it).
                    let _ = writeln!(std::io::stderr(), "{line}");
                    *last = Some(line);
                }
            }
        }
    }
}

pub async fn run(target: &Target, args: BackupArgs) -> anyhow::Result<()> {
    let backups: Api<Backup> = Api::namespaced(target.client.clone(), &target.namespace);
    let mut backup: Backup = serde_json::from_value(serde_json::json!({
        "apiVersion": "castellan.io/v1alpha1",
        "kind": "Backup",
        "metadata": {},
        "spec": {"cluster": args.cluster, "verify": args.verify},
    }))
    .context("building the Backup")?;
    match &args.name {
        Some(name) => backup.metadata.name = Some(name.clone()),
        None => backup.metadata.generate_name = Some(format!("{}-", args.cluster)),
    }
    let created = backups
        .create(&PostParams::default(), &backup)
        .await
        .with_context(|| format!("creating a Backup of {}/{}", target.namespace, args.cluster))?;
    let name = created.name_any();
    super::out_line(format_args!("backup.castellan.io/{name} created"))?;
    if args.no_wait {
        return Ok(());
    }

    let mut display = Display::new(&name);
    let mut changes = std::pin::pin!(watcher::watch_object(backups, &name));
    while let Some(backup) = changes
        .try_next()
        .await
        .with_context(|| format!("watching Backup {name}"))?
    {
        let Some(backup) = backup else {
            bail!("Backup {name} was deleted before it completed");
        };
        let progress = progress(backup.status.as_ref());
        display.show(&name, &progress);
        match progress {
            Progress::Completed { size, location } => {
                super::out_line(format_args!(
                    "backup {name} of {} completed{}{}",
                    args.cluster,
                    size.map(|s| format!(": {s}")).unwrap_or_default(),
                    location.map(|l| format!(" at {l}")).unwrap_or_default()
                ))?;
                return Ok(());
            }
            Progress::Failed(reason) => bail!("backup {name} failed: {reason}"),
            Progress::Going { .. } => {}
        }
    }
    bail!("the watch of Backup {name} ended before it completed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_follows_the_phase_and_percent() {
        assert_eq!(
            progress(None),
            Progress::Going {
                phase: "Pending".into(),
                percent: None,
                note: None
            }
        );
        let running = BackupStatus {
            phase: Some("Running".into()),
            progress_percent: Some(40),
            ..BackupStatus::default()
        };
        assert_eq!(
            progress(Some(&running)),
            Progress::Going {
                phase: "Running".into(),
                percent: Some(40),
                note: None
            }
        );
        let failed = BackupStatus {
            phase: Some("Failed".into()),
            error: Some("the instance restarted".into()),
            ..BackupStatus::default()
        };
        assert_eq!(
            progress(Some(&failed)),
            Progress::Failed("the instance restarted".into())
        );
        let done = BackupStatus {
            phase: Some("Completed".into()),
            size: Some("12Mi".into()),
            ..BackupStatus::default()
        };
        assert!(
            matches!(progress(Some(&done)), Progress::Completed { size: Some(s), .. } if s == "12Mi")
        );
    }
}
