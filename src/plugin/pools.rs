//! `kubectl castellan pools`: every StoragePool with its capacity and health per node,
//! and the disks (BlockDevices) it claimed or that nobody claimed.

use anyhow::Context;
use castellan_crds::storage_pool::HEALTHY;
use castellan_crds::{BlockDevice, StoragePool};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::Serialize;

use super::table::{self, good, heading, notice};
use super::{Output, Target, print_structured};
use crate::operator::backup::machine::human_size;

#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct PoolsSummary {
    pub pools: Vec<PoolSummary>,
    /// Disks no pool claimed, with why (state, message).
    pub unclaimed: Vec<DiskSummary>,
}

#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct PoolSummary {
    pub name: String,
    pub phase: Option<String>,
    pub capacity: Option<String>,
    pub allocated: Option<String>,
    pub free: Option<String>,
    pub nodes: Vec<castellan_crds::storage_pool::PoolNodeStatus>,
    pub disks: Vec<DiskSummary>,
}

#[derive(Serialize, Debug, Clone)]
#[serde(rename_all = "camelCase")]
pub struct DiskSummary {
    pub name: String,
    pub node: String,
    pub path: String,
    pub size_bytes: i64,
    pub state: Option<String>,
    pub pool: Option<String>,
    pub message: Option<String>,
}

pub fn summarise(pools: &[StoragePool], devices: &[BlockDevice]) -> PoolsSummary {
    let disks: Vec<DiskSummary> = devices
        .iter()
        .map(|d| {
            let status = d.status.clone().unwrap_or_default();
            DiskSummary {
                name: d.name_any(),
                node: d.spec.node_name.clone(),
                path: d.spec.path.clone(),
                size_bytes: d.spec.size_bytes,
                state: status
                    .state
                    .and_then(|s| serde_json::to_value(s).ok())
                    .and_then(|v| v.as_str().map(str::to_owned)),
                pool: status.pool,
                message: status.message,
            }
        })
        .collect();
    PoolsSummary {
        pools: pools
            .iter()
            .map(|p| {
                let status = p.status.clone().unwrap_or_default();
                let name = p.name_any();
                PoolSummary {
                    disks: disks
                        .iter()
                        .filter(|d| d.pool.as_deref() == Some(name.as_str()))
                        .cloned()
                        .collect(),
                    name,
                    phase: status.phase,
                    capacity: status.capacity,
                    allocated: status.allocated,
                    free: status.free,
                    nodes: status.nodes,
                }
            })
            .collect(),
        unclaimed: disks.iter().filter(|d| d.pool.is_none()).cloned().collect(),
    }
}

fn bytes(value: Option<i64>) -> String {
    value.map_or("-".to_owned(), |b| format!("{}B", human_size(b)))
}

fn disk_rows(disks: &[DiskSummary]) -> Vec<Vec<String>> {
    disks
        .iter()
        .map(|d| {
            let state = d.state.as_deref().unwrap_or("-");
            let state = match state {
                "Missing" | "Failed" => good(state, false),
                _ => state.to_owned(),
            };
            vec![
                d.node.clone(),
                d.path.clone(),
                bytes(Some(d.size_bytes)),
                state,
                d.name.clone(),
            ]
        })
        .collect()
}

pub fn render(summary: &PoolsSummary, width: usize) -> String {
    let mut out = String::new();
    for pool in &summary.pools {
        let phase = pool.phase.as_deref().unwrap_or("Unknown");
        out.push_str(&format!(
            "{} {}  {}  capacity {}  allocated {}  free {}\n",
            heading("Pool"),
            pool.name,
            good(phase, phase == "Ready"),
            pool.capacity.as_deref().unwrap_or("-"),
            pool.allocated.as_deref().unwrap_or("-"),
            pool.free.as_deref().unwrap_or("-"),
        ));
        let rows: Vec<Vec<String>> = pool
            .nodes
            .iter()
            .map(|n| {
                let health = n.health.as_deref().unwrap_or("-");
                vec![
                    n.node.clone(),
                    good(health, health == HEALTHY),
                    bytes(n.capacity_bytes),
                    bytes(n.allocated_bytes),
                    bytes(n.free_bytes),
                    n.message.clone().unwrap_or_default(),
                ]
            })
            .collect();
        out.push_str(&table::render(
            &["NODE", "HEALTH", "CAPACITY", "ALLOCATED", "FREE", "MESSAGE"],
            &rows,
            width,
        ));
        if !pool.disks.is_empty() {
            out.push_str(&table::render(
                &["  NODE", "DISK", "SIZE", "STATE", "BLOCKDEVICE"],
                &disk_rows(&pool.disks)
                    .into_iter()
                    .map(|mut row| {
                        row[0] = format!("  {}", row[0]);
                        row
                    })
                    .collect::<Vec<_>>(),
                width,
            ));
        }
        for node in &pool.nodes {
            for rejected in &node.rejected {
                out.push_str(&format!(
                    "  {} {} on {}: {}\n",
                    notice("rejected"),
                    rejected.path,
                    node.node,
                    rejected.reason
                ));
            }
        }
        out.push('\n');
    }
    if summary.pools.is_empty() {
        out.push_str("No StoragePools.\n\n");
    }
    if !summary.unclaimed.is_empty() {
        out.push_str(&format!("{}\n", heading("Disks in no pool")));
        out.push_str(&table::render(
            &["NODE", "DISK", "SIZE", "STATE", "BLOCKDEVICE"],
            &disk_rows(&summary.unclaimed),
            width,
        ));
    }
    out
}

pub async fn run(target: &Target, output: Output) -> anyhow::Result<()> {
    let pools: Api<StoragePool> = Api::all(target.client.clone());
    let pools = pools
        .list(&ListParams::default())
        .await
        .context("listing StoragePools")?;
    let devices: Api<BlockDevice> = Api::all(target.client.clone());
    let devices = devices
        .list(&ListParams::default())
        .await
        .context("listing BlockDevices")?;
    let summary = summarise(&pools.items, &devices.items);
    if !print_structured(output, &summary)? {
        super::write_out(&render(&summary, table::width()))?;
    }
    Ok(())
}
