//! `kubectl castellan status CLUSTER`: what the DatabaseCluster's status and its
//! Backups say, gathered into one summary (printed as JSON/YAML for scripts) and laid
//! out as tables for a person.

use anyhow::Context;
use castellan_crds::database_cluster::InstanceStatus;
use castellan_crds::storage_pool::HEALTHY;
use castellan_crds::{Backup, DatabaseCluster};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::Serialize;

use super::table::{self, good, heading, notice};
use super::{Output, Target, print_structured};
use crate::operator::backup::machine::human_size;

/// How many of the cluster's latest Backups the summary lists.
const RECENT_BACKUPS: usize = 5;

/// A cluster's state, as `status` prints it.
#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSummary {
    pub name: String,
    pub namespace: String,
    pub engine: String,
    /// The version the data is in (status), else the one asked for.
    pub version: String,
    pub phase: Option<String>,
    pub primary: Option<String>,
    pub replicas: i32,
    pub ready_instances: i32,
    /// `async`, or `sync ANY n (required|preferred)`.
    pub replication: String,
    /// The `ContinuousArchiving` condition, when the cluster archives.
    pub archiving: Option<Condition>,
    pub last_backup: Option<String>,
    pub first_recoverability_point: Option<String>,
    pub instances: Vec<InstanceStatus>,
    pub conditions: Vec<Condition>,
    /// The latest Backups of the cluster, newest first.
    pub backups: Vec<BackupSummary>,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupSummary {
    pub name: String,
    pub phase: Option<String>,
    pub progress_percent: Option<i32>,
    pub size: Option<String>,
    pub started_at: Option<String>,
    pub stopped_at: Option<String>,
    pub error: Option<String>,
}

/// The summary of `cluster` with its `backups` (any order; those of other clusters
/// are left out).
pub fn summarise(cluster: &DatabaseCluster, backups: &[Backup]) -> ClusterSummary {
    let status = cluster.status.clone().unwrap_or_default();
    let replication = match &cluster.spec.replication {
        Some(r) if crate::operator::build::synchronous(cluster) => format!(
            "sync ANY {} ({})",
            r.sync_replicas.unwrap_or(1),
            match r.data_durability.unwrap_or_default() {
                castellan_crds::database_cluster::DataDurability::Required => "required",
                castellan_crds::database_cluster::DataDurability::Preferred => "preferred",
            }
        ),
        _ => "async".to_owned(),
    };
    let name = cluster.name_any();
    let mut ours: Vec<&Backup> = backups.iter().filter(|b| b.spec.cluster == name).collect();
    // Newest first; the creation time is RFC 3339 in UTC, so it sorts as text.
    ours.sort_by_key(|b| std::cmp::Reverse(b.creation_timestamp().map(|t| t.0)));
    ClusterSummary {
        namespace: cluster.namespace().unwrap_or_default(),
        engine: serde_json::to_value(cluster.spec.engine)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        version: status
            .version
            .clone()
            .unwrap_or_else(|| cluster.spec.version.clone()),
        phase: status.phase.clone(),
        primary: status.current_primary.clone(),
        replicas: cluster.spec.replicas,
        ready_instances: status.ready_instances.unwrap_or(0),
        replication,
        archiving: status
            .conditions
            .iter()
            .find(|c| c.type_ == "ContinuousArchiving")
            .cloned(),
        last_backup: status.last_backup.clone(),
        first_recoverability_point: status.first_recoverability_point.clone(),
        instances: status.instances.clone(),
        conditions: status.conditions.clone(),
        backups: ours
            .into_iter()
            .take(RECENT_BACKUPS)
            .map(|b| {
                let s = b.status.clone().unwrap_or_default();
                BackupSummary {
                    name: b.name_any(),
                    phase: s.phase,
                    progress_percent: s.progress_percent,
                    size: s.size,
                    started_at: s.started_at,
                    stopped_at: s.stopped_at,
                    error: s.error,
                }
            })
            .collect(),
        name,
    }
}

fn or_dash(value: Option<&str>) -> String {
    value.unwrap_or("-").to_owned()
}

/// The lag of a replica: bytes and seconds behind, as far as known (a primary lags
/// nobody).
fn lag(instance: &InstanceStatus) -> String {
    if instance.role.as_deref() == Some("primary") {
        return "-".to_owned();
    }
    match (instance.lag_bytes, instance.lag_seconds) {
        (None, None) => "-".to_owned(),
        (bytes, seconds) => {
            let bytes = bytes.map(|b| format!("{}B", human_size(b)));
            let seconds = seconds.map(|s| format!("{s:.1}s"));
            [bytes, seconds]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(" / ")
        }
    }
}

/// The health of the pool under an instance's volume, as its agent reports it: green
/// when healthy, red otherwise, `-` when nobody reports it.
fn volume(instance: &InstanceStatus) -> String {
    match instance.volume_health.as_deref() {
        None => "-".to_owned(),
        Some(health) => good(health, health == HEALTHY),
    }
}

/// The summary as a person reads it, within `width` columns.
pub fn render(summary: &ClusterSummary, width: usize) -> String {
    let phase = summary.phase.as_deref().unwrap_or("Unknown");
    let mut out = format!(
        "{} {}/{}  {} {}  {}  {}/{} ready\n",
        heading("Cluster"),
        summary.namespace,
        summary.name,
        summary.engine,
        summary.version,
        good(phase, phase == "Ready"),
        summary.ready_instances,
        summary.replicas,
    );
    out.push_str(&format!(
        "{} {}  {} {}\n",
        heading("Primary"),
        or_dash(summary.primary.as_deref()),
        heading("Replication"),
        summary.replication
    ));
    let archiving = match &summary.archiving {
        None => "off (no spec.backup)".to_owned(),
        Some(c) => format!("{} ({})", good(&c.status, c.status == "True"), c.reason),
    };
    out.push_str(&format!(
        "{} {}  {} {}\n",
        heading("Archiving"),
        archiving,
        heading("Last backup"),
        or_dash(summary.last_backup.as_deref())
    ));
    if let Some(point) = &summary.first_recoverability_point {
        out.push_str(&format!("{} {point}\n", heading("Recoverable from")));
    }

    out.push('\n');
    // The VOLUME column only when an agent reports on some instance's volume: a
    // cluster on other storage keeps the narrower table, and the column would be all
    // dashes there.
    let volumes = summary.instances.iter().any(|i| i.volume_health.is_some());
    let rows: Vec<Vec<String>> = summary
        .instances
        .iter()
        .map(|i| {
            let role = i.role.as_deref().unwrap_or("-");
            let role = if i.fenced {
                notice(&format!("{role},fenced"))
            } else {
                role.to_owned()
            };
            let mut row = vec![
                i.name.clone(),
                role,
                good(if i.ready { "yes" } else { "no" }, i.ready),
            ];
            if volumes {
                row.push(volume(i));
            }
            row.extend([
                or_dash(i.node.as_deref()),
                i.timeline.map_or("-".to_owned(), |t| t.to_string()),
                or_dash(i.lsn.as_deref()),
                lag(i),
            ]);
            row
        })
        .collect();
    let headers: &[&str] = if volumes {
        &[
            "INSTANCE", "ROLE", "READY", "VOLUME", "NODE", "TL", "LSN", "LAG",
        ]
    } else {
        &["INSTANCE", "ROLE", "READY", "NODE", "TL", "LSN", "LAG"]
    };
    out.push_str(&table::render(headers, &rows, width));

    if !summary.backups.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = summary
            .backups
            .iter()
            .map(|b| {
                let phase = b.phase.as_deref().unwrap_or("Pending");
                let phase = match phase {
                    "Completed" => good(phase, true),
                    "Failed" => good(phase, false),
                    other => notice(other),
                };
                vec![
                    b.name.clone(),
                    phase,
                    b.progress_percent
                        .map_or("-".to_owned(), |p| format!("{p}%")),
                    or_dash(b.size.as_deref()),
                    or_dash(b.started_at.as_deref()),
                    b.error.clone().unwrap_or_default(),
                ]
            })
            .collect();
        out.push_str(&table::render(
            &["BACKUP", "PHASE", "DONE", "SIZE", "STARTED", "ERROR"],
            &rows,
            width,
        ));
    }

    out.push('\n');
    let rows: Vec<Vec<String>> = summary
        .conditions
        .iter()
        .map(|c| {
            // Degraded is the one condition whose True is bad news.
            let fine = (c.status == "True") != (c.type_ == "Degraded");
            vec![
                c.type_.clone(),
                good(&c.status, fine),
                c.reason.clone(),
                c.message.clone(),
            ]
        })
        .collect();
    out.push_str(&table::render(
        &["CONDITION", "STATUS", "REASON", "MESSAGE"],
        &rows,
        width,
    ));
    out
}

pub async fn run(target: &Target, name: &str, output: Output) -> anyhow::Result<()> {
    let clusters: Api<DatabaseCluster> = Api::namespaced(target.client.clone(), &target.namespace);
    let cluster = clusters
        .get(name)
        .await
        .with_context(|| format!("reading DatabaseCluster {}/{name}", target.namespace))?;
    let backups: Api<Backup> = Api::namespaced(target.client.clone(), &target.namespace);
    let backups = backups
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing the Backups of {}", target.namespace))?;
    let summary = summarise(&cluster, &backups.items);
    if !print_structured(output, &summary)? {
        super::write_out(&render(&summary, table::width()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> (DatabaseCluster, Vec<Backup>) {
        let cluster: DatabaseCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "castellan.io/v1alpha1", "kind": "DatabaseCluster",
            "metadata": {"name": "shop", "namespace": "prod"},
            "spec": {"engine": "postgresql", "version": "15", "replicas": 2,
                     "storage": {"size": "1Gi"},
                     "replication": {"mode": "sync", "syncReplicas": 1}},
            "status": {
                "phase": "Ready", "currentPrimary": "shop-1", "readyInstances": 2,
                "lastBackup": "2026-12-01T10:00:00Z",
                "instances": [
                    {"name": "shop-1", "node": "node-1", "role": "primary", "timeline": 1, "lsn": "0/3000060", "ready": true},
                    {"name": "shop-2", "node": "node-2", "role": "replica", "timeline": 1, "lsn": "0/3000000", "lagBytes": 96, "lagSeconds": 0.5, "ready": false, "fenced": true, "volumeHealth": "Degraded"}
                ],
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "AllInstancesReady", "message": "every instance is ready", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                    {"type": "ContinuousArchiving", "status": "False", "reason": "ArchiveFailing", "message": "WAL file 000000010000000000000003 could not be stored: the object store answered 403 Forbidden for every one of the last 12 attempts", "lastTransitionTime": "2026-12-01T10:00:00Z"}
                ]
            }
        }))
        .expect("a cluster");
        let backup = |name: &str, cluster: &str, created: &str, phase: &str| -> Backup {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "castellan.io/v1alpha1", "kind": "Backup",
                "metadata": {"name": name, "namespace": "prod", "creationTimestamp": created},
                "spec": {"cluster": cluster},
                "status": {"phase": phase, "progressPercent": 40}
            }))
            .expect("a backup")
        };
        let backups = vec![
            backup("old", "shop", "2026-11-01T00:00:00Z", "Completed"),
            backup("new", "shop", "2026-12-01T00:00:00Z", "Running"),
            backup("other", "orders", "2026-12-02T00:00:00Z", "Completed"),
        ];
        (cluster, backups)
    }

    #[test]
    fn the_summary_has_the_clusters_backups_newest_first_and_its_archiving() {
        let (cluster, backups) = example();
        let summary = summarise(&cluster, &backups);
        assert_eq!(summary.replication, "sync ANY 1 (required)");
        assert_eq!(
            summary
                .backups
                .iter()
                .map(|b| b.name.as_str())
                .collect::<Vec<_>>(),
            vec!["new", "old"]
        );
        assert_eq!(
            summary.archiving.as_ref().map(|c| c.reason.as_str()),
            Some("ArchiveFailing")
        );
        assert_eq!(summary.primary.as_deref(), Some("shop-1"));
    }

    #[test]
    fn the_table_fits_80_columns_and_shows_what_matters() {
        let (cluster, backups) = example();
        let out = render(&summarise(&cluster, &backups), 80);
        for line in out.lines() {
            assert!(
                console::measure_text_width(line) <= 80,
                "{} columns: {line}",
                console::measure_text_width(line)
            );
        }
        for needle in [
            "prod/shop",
            "shop-2",
            "replica,fenced",
            "96B / 0.5s",
            "ArchiveFailing",
            "new",
            "40%",
            "VOLUME",
            "Degraded",
        ] {
            assert!(out.contains(needle), "{needle} in\n{out}");
        }
    }

    /// The instance table's cells of `name`'s row, colours left out.
    fn row_of(out: &str, name: &str) -> Vec<String> {
        out.lines()
            .map(|line| console::strip_ansi_codes(line).to_string())
            .find(|line| line.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row of {name} in\n{out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_volume_column_shows_each_instances_pool_health_when_an_agent_reports_one() {
        let (cluster, backups) = example();
        let out = render(&summarise(&cluster, &backups), 80);
        let header = out
            .lines()
            .map(|line| console::strip_ansi_codes(line).to_string())
            .find(|line| line.starts_with("INSTANCE"))
            .unwrap_or_default();
        assert_eq!(
            header.split_whitespace().collect::<Vec<_>>(),
            [
                "INSTANCE", "ROLE", "READY", "VOLUME", "NODE", "TL", "LSN", "LAG"
            ]
        );
        assert_eq!(row_of(&out, "shop-2")[3], "Degraded");
        assert_eq!(row_of(&out, "shop-1")[3], "-", "not reported");

        let mut elsewhere = cluster.clone();
        if let Some(status) = elsewhere.status.as_mut() {
            for instance in &mut status.instances {
                instance.volume_health = None;
            }
        }
        let out = render(&summarise(&elsewhere, &backups), 80);
        assert!(!out.contains("VOLUME"), "no column of dashes:\n{out}");
        assert_eq!(row_of(&out, "shop-2")[3], "node-2");
    }
}
