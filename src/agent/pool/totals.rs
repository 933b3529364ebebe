//! Totals: a `StoragePool`'s cluster-wide status — `capacity`, `allocated`, `free`,
//! `readyNodes`, `phase` and the `Ready`/`Degraded` conditions — computed from every
//! node's entry of `status.nodes`.
//!
//! Pure. Every agent computes them after writing its own entry and applies them with
//! the resource version it read as a precondition, so a total computed from a stale
//! set of entries is refused by the API server and computed again from a fresh read
//! (see `pools`). The operator's pool controller can take this over unchanged.

use castellan_crds::storage_pool::PoolNodeStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use super::machine::{DEGRADED, FAILED, HEALTHY};

/// The pool-wide part of the status.
#[derive(Clone, Debug, PartialEq)]
pub struct Totals {
    pub capacity: String,
    pub allocated: String,
    pub free: String,
    pub ready_nodes: i32,
    pub phase: &'static str,
    pub conditions: Vec<Condition>,
}

/// A byte count as a Kubernetes quantity, in the largest binary unit that divides it.
pub fn quantity(bytes: u64) -> String {
    for (suffix, unit) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

fn bytes(value: Option<i64>) -> u64 {
    value.and_then(|v| u64::try_from(v).ok()).unwrap_or(0)
}

/// The totals over `nodes`. `previous` are the conditions the pool has now: a
/// condition whose status did not change keeps its `lastTransitionTime`.
pub fn compute(
    nodes: &[PoolNodeStatus],
    generation: Option<i64>,
    previous: &[Condition],
    now: Timestamp,
) -> Totals {
    let capacity: u64 = nodes.iter().map(|n| bytes(n.capacity_bytes)).sum();
    let allocated: u64 = nodes.iter().map(|n| bytes(n.allocated_bytes)).sum();
    let health = |word: &str| {
        nodes
            .iter()
            .filter(|n| n.health.as_deref() == Some(word))
            .map(|n| n.node.as_str())
            .collect::<Vec<_>>()
    };
    let (healthy, degraded, failed) = (health(HEALTHY), health(DEGRADED), health(FAILED));
    let phase = if !degraded.is_empty() || !failed.is_empty() {
        "Degraded"
    } else if !healthy.is_empty() && healthy.len() == nodes.len() {
        "Ready"
    } else {
        "Pending"
    };

    let ready = if phase == "Ready" {
        (
            "True",
            "AllNodesHealthy",
            format!("the pool is healthy on {} node(s)", healthy.len()),
        )
    } else if nodes.is_empty() {
        (
            "False",
            "NoNodes",
            "no node has reported the pool yet".to_string(),
        )
    } else {
        let waiting: Vec<&str> = nodes
            .iter()
            .filter(|n| n.health.as_deref() != Some(HEALTHY))
            .map(|n| n.node.as_str())
            .collect();
        (
            "False",
            "NodesNotHealthy",
            format!("not healthy on: {}", waiting.join(", ")),
        )
    };
    let degraded_condition = if degraded.is_empty() && failed.is_empty() {
        (
            "False",
            "NoDegradedNodes",
            "no node is degraded or failed".to_string(),
        )
    } else {
        let mut parts = Vec::new();
        if !degraded.is_empty() {
            parts.push(format!("degraded on {}", degraded.join(", ")));
        }
        if !failed.is_empty() {
            parts.push(format!("failed on {}", failed.join(", ")));
        }
        ("True", "NodesDegraded", parts.join("; "))
    };
    let condition = |kind: &str, (status, reason, message): (&str, &str, String)| {
        let since = previous
            .iter()
            .find(|c| c.type_ == kind && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or(Time(now));
        Condition {
            type_: kind.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message,
            observed_generation: generation,
            last_transition_time: since,
        }
    };
    Totals {
        capacity: quantity(capacity),
        allocated: quantity(allocated),
        free: quantity(capacity.saturating_sub(allocated)),
        ready_nodes: i32::try_from(healthy.len()).unwrap_or(i32::MAX),
        phase,
        conditions: vec![
            condition("Ready", ready),
            condition("Degraded", degraded_condition),
        ],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    const MIB: i64 = 1 << 20;

    fn node(name: &str, health: &str, capacity: Option<i64>) -> PoolNodeStatus {
        PoolNodeStatus {
            node: name.into(),
            health: Some(health.into()),
            capacity_bytes: capacity,
            allocated_bytes: capacity.map(|_| 0),
            free_bytes: capacity,
            ..Default::default()
        }
    }

    fn now() -> Timestamp {
        "2026-11-30T12:00:00Z".parse().unwrap()
    }

    fn find<'a>(totals: &'a Totals, kind: &str) -> &'a Condition {
        totals.conditions.iter().find(|c| c.type_ == kind).unwrap()
    }

    #[test]
    fn quantities_use_the_largest_exact_binary_unit() {
        assert_eq!(quantity(0), "0");
        assert_eq!(quantity(512 << 20), "512Mi");
        assert_eq!(quantity(3 << 30), "3Gi");
        assert_eq!(quantity(1 << 40), "1Ti");
        assert_eq!(quantity(1536), "1536");
        assert_eq!(quantity(2048), "2Ki");
        assert_eq!(quantity(1000), "1000");
    }

    #[test]
    fn no_nodes_is_pending() {
        let totals = compute(&[], Some(1), &[], now());
        assert_eq!(
            (totals.phase, totals.ready_nodes, totals.capacity.as_str()),
            ("Pending", 0, "0")
        );
        assert_eq!(find(&totals, "Ready").reason, "NoNodes");
        assert_eq!(find(&totals, "Degraded").status, "False");
    }

    #[test]
    fn all_healthy_is_ready_and_sums_capacity() {
        let nodes = [
            node("a", HEALTHY, Some(256 * MIB)),
            node("b", HEALTHY, Some(256 * MIB)),
        ];
        let totals = compute(&nodes, Some(3), &[], now());
        assert_eq!(totals.phase, "Ready");
        assert_eq!(totals.ready_nodes, 2);
        assert_eq!(
            (
                totals.capacity.as_str(),
                totals.allocated.as_str(),
                totals.free.as_str()
            ),
            ("512Mi", "0", "512Mi")
        );
        let ready = find(&totals, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.observed_generation),
            ("True", Some(3))
        );
    }

    #[test]
    fn a_pending_node_keeps_the_pool_pending() {
        let nodes = [node("a", HEALTHY, Some(MIB)), node("b", "Pending", None)];
        let totals = compute(&nodes, None, &[], now());
        assert_eq!((totals.phase, totals.ready_nodes), ("Pending", 1));
        assert_eq!(find(&totals, "Ready").message, "not healthy on: b");
    }

    #[test]
    fn a_degraded_or_failed_node_degrades_the_pool_and_times_are_kept() {
        let nodes = [
            node("a", DEGRADED, Some(MIB)),
            node("b", FAILED, None),
            node("c", HEALTHY, Some(MIB)),
        ];
        let totals = compute(&nodes, None, &[], now());
        assert_eq!(totals.phase, "Degraded");
        let degraded = find(&totals, "Degraded");
        assert_eq!(degraded.status, "True");
        assert_eq!(degraded.message, "degraded on a; failed on b");

        // Same status later: the transition time stays; a changed status gets now.
        let later: Timestamp = "2026-11-30T13:00:00Z".parse().unwrap();
        let again = compute(&nodes, None, &totals.conditions, later);
        assert_eq!(find(&again, "Degraded").last_transition_time, Time(now()));
        let healed = [node("a", HEALTHY, Some(MIB)), node("c", HEALTHY, Some(MIB))];
        let healed = compute(&healed, None, &totals.conditions, later);
        assert_eq!(healed.phase, "Ready");
        assert_eq!(find(&healed, "Degraded").last_transition_time, Time(later));
        assert_eq!(find(&healed, "Ready").last_transition_time, Time(later));
    }
}
