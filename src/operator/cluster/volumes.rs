//! `VolumesBound`: whether every instance's volume claim of a `DatabaseCluster` got a
//! volume, and when one did not, why and what the user can do about it.
//!
//! Pure: decided from the claims the pass applied, the cluster's pods (the scheduler
//! writes why it cannot place a pod in its `PodScheduled` condition) and which of the
//! StorageClasses the claims name do not exist (looked up by the shell, `pass.rs`).
//! Without this a cluster whose claims cannot bind sits in `Creating` with nothing on
//! the cluster saying why; the reason was only on the claim's or the pod's Events.
//!
//! `VolumesHealthy` and each instance's `volumeHealth`: what the node agents wrote on
//! the claims about the pools under them, so that a degraded disk under an instance
//! shows on the cluster and on the instance's row.

use std::collections::BTreeSet;

use castellan_crds::storage_pool::{
    FAILED, HEALTHY, POOL_HEALTH_ANNOTATION, POOL_HEALTH_MESSAGE_ANNOTATION,
};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use super::state::Note;

/// The condition's type.
pub const CONDITION: &str = "VolumesBound";

/// Every claim has its volume.
pub const BOUND: &str = "Bound";
/// A claim names no StorageClass and the cluster has no default one.
pub const NO_STORAGE_CLASS: &str = "NoStorageClass";
/// A claim names a StorageClass that does not exist.
pub const STORAGE_CLASS_NOT_FOUND: &str = "StorageClassNotFound";
/// A claim's volume is gone (`Lost`).
pub const VOLUME_LOST: &str = "VolumeLost";
/// The scheduler cannot place a pod with its claim.
pub const UNSCHEDULABLE: &str = "Unschedulable";
/// Claims wait for a volume that is on its way: their pods are not created or not
/// placed yet (a `WaitForFirstConsumer` class binds only then), or the volume is being
/// provisioned. Normal for a few seconds while instances are created.
pub const WAITING_FOR_VOLUME: &str = "WaitingForVolume";

/// What one claim waits for, most serious first (the condition reports the most
/// serious one over all claims).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Problem {
    NoStorageClass,
    StorageClassNotFound(String),
    Lost { volume: Option<String> },
    Unschedulable { pod: String, message: String },
    Waiting { node: Option<String> },
}

/// The `VolumesBound` condition of a cluster whose instances' claims are `claims`,
/// whose pods are `pods`, where the StorageClasses in `missing_classes` do not exist.
/// `previous` is the condition the status holds now: its transition time is kept while
/// the status stays the same.
pub fn condition<'a>(
    claims: &[PersistentVolumeClaim],
    pods: impl IntoIterator<Item = &'a Pod>,
    missing_classes: &BTreeSet<String>,
    previous: Option<&Condition>,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    let pods: Vec<&Pod> = pods.into_iter().collect();
    let mut problems: Vec<(Problem, String)> = claims
        .iter()
        .filter_map(|claim| {
            let problem = problem(claim, &pods, missing_classes)?;
            Some((problem, claim.name_any()))
        })
        .collect();
    problems.sort();
    let (status, reason, message) = match problems.first() {
        None => (
            "True",
            BOUND,
            format!("{} of {} volume claims bound", claims.len(), claims.len()),
        ),
        Some((worst, _)) => {
            // Every claim with the same problem, named in the message.
            let group: Vec<&(Problem, String)> = problems
                .iter()
                .filter(|(problem, _)| same_group(problem, worst))
                .collect();
            let (reason, message) = explain(worst, &group, claims.len() - problems.len());
            ("False", reason, message)
        }
    };
    let last_transition_time = previous
        .filter(|previous| previous.status == status)
        .map_or(now, |previous| previous.last_transition_time.clone());
    Condition {
        type_: CONDITION.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// The condition's type for the volumes' health.
pub const HEALTH_CONDITION: &str = "VolumesHealthy";
/// Every volume's pool is healthy on its node.
pub const POOL_HEALTHY: &str = "PoolHealthy";
/// A volume's pool is degraded (a disk missing, failing or being replaced) or not
/// built on its node: the data may have one copy left.
pub const POOL_DEGRADED: &str = "PoolDegraded";
/// A volume's pool failed on its node.
pub const POOL_FAILED: &str = "PoolFailed";
/// No volume is on a Castellan pool (no agent reports on them).
pub const NOT_REPORTED: &str = "NotReported";
/// A volume's node is not Ready: its agent cannot report, and the health it last wrote
/// is not taken for the health now.
pub const NODE_NOT_READY: &str = "NodeNotReady";
/// An instance's `volumeHealth` while its volume's node is not Ready.
pub const UNKNOWN_HEALTH: &str = "Unknown";

/// The annotation the scheduler puts on a claim of a `WaitForFirstConsumer` class: the
/// node its volume is made on, and a local volume stays on.
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// The node `claim`'s volume is on: the scheduler's choice for a provisioned volume,
/// else the node of a pod that mounts it (a volume made beforehand binds without that
/// annotation).
fn claim_node<'a>(claim: &'a PersistentVolumeClaim, pods: &[&'a Pod]) -> Option<&'a str> {
    claim
        .annotations()
        .get(SELECTED_NODE)
        .map(String::as_str)
        .or_else(|| {
            let name = claim.name_any();
            pods.iter()
                .filter(|pod| uses(pod, &name))
                .find_map(|pod| pod.spec.as_ref()?.node_name.as_deref())
        })
}

/// The nodes the claims' volumes are on, where the scheduler chose them (a reflector
/// looks them up; the pods' own nodes are looked up beside them).
pub fn claim_nodes(claims: &[PersistentVolumeClaim]) -> impl Iterator<Item = &str> {
    claims.iter().filter_map(|claim| claim_node(claim, &[]))
}

/// How bad a pool health word is: `Failed` worst, then any other word but `Healthy`
/// (`Degraded`, `Pending`, or one a newer agent writes: not known to be healthy, so
/// not taken for it), then `Healthy`.
fn severity(health: &str) -> u8 {
    match health {
        HEALTHY => 0,
        FAILED => 2,
        _ => 1,
    }
}

/// The worst of `healths` (the first of equally bad ones), `None` when there is none.
pub fn worst<'a>(healths: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    healths.into_iter().fold(None, |worst, health| match worst {
        Some(worst) if severity(worst) >= severity(health) => Some(worst),
        _ => Some(health),
    })
}

/// An instance's `volumeHealth`: the worst pool health the agents wrote on the claims
/// its pod mounts (its data volume, and any other volume it is given), `None` when no
/// agent reports on them (not on a Castellan pool, or not reported yet). Matched by
/// what the pod mounts rather than by name, so that a second volume of the instance
/// counts too.
/// A volume on a node in `down` (not Ready) counts as `Unknown` unless its agent last
/// wrote something worse.
pub fn instance_health(
    pod: &Pod,
    claims: &[PersistentVolumeClaim],
    down: &BTreeSet<String>,
) -> Option<String> {
    let healths = claims
        .iter()
        .filter(|claim| uses(pod, &claim.name_any()))
        .filter_map(|claim| {
            let health = claim.annotations().get(POOL_HEALTH_ANNOTATION)?;
            Some(match claim_node(claim, &[pod]) {
                Some(node) if down.contains(node) && health == HEALTHY => UNKNOWN_HEALTH,
                _ => health.as_str(),
            })
        });
    worst(healths).map(str::to_owned)
}

/// The `VolumesHealthy` condition: what the node agents wrote on the instances'
/// claims about the pools under them (`castellan.io/pool-health`, see
/// `agent::health`). A volume on a node in `down` (not Ready: its agent cannot write)
/// makes it `Unknown` rather than `True` on what that agent wrote before; a pool
/// reported unhealthy still makes it `False`. `previous` keeps its transition time
/// while the status stays.
pub fn health_condition(
    claims: &[PersistentVolumeClaim],
    pods: &[&Pod],
    down: &BTreeSet<String>,
    previous: Option<&Condition>,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    let reports: Vec<(String, &str, &str)> = claims
        .iter()
        .filter_map(|claim| {
            let annotations = claim.annotations();
            let health = annotations.get(POOL_HEALTH_ANNOTATION)?;
            let message = annotations
                .get(POOL_HEALTH_MESSAGE_ANNOTATION)
                .map_or("", String::as_str);
            Some((claim.name_any(), health.as_str(), message))
        })
        .collect();
    let unhealthy: Vec<&(String, &str, &str)> = reports
        .iter()
        .filter(|(_, health, _)| *health != HEALTHY)
        .collect();
    let unreachable: Vec<String> = claims
        .iter()
        .filter(|claim| claim.annotations().contains_key(POOL_HEALTH_ANNOTATION))
        .filter_map(|claim| {
            let node = claim_node(claim, pods).filter(|node| down.contains(*node))?;
            Some(format!("{} (node {node})", claim.name_any()))
        })
        .collect();
    let (status, reason, message) = if reports.is_empty() {
        (
            "Unknown",
            NOT_REPORTED,
            "no volume of this cluster is on a Castellan StoragePool, so none reports its disks' health".to_string(),
        )
    } else if unhealthy.is_empty() && !unreachable.is_empty() {
        (
            "Unknown",
            NODE_NOT_READY,
            format!(
                "the node under {} is not Ready: its agent cannot report, so the health of the pool there is not known now",
                unreachable.join(", ")
            ),
        )
    } else if unhealthy.is_empty() {
        (
            "True",
            POOL_HEALTHY,
            format!(
                "the pools under {} of {} volumes are healthy on their nodes",
                reports.len(),
                claims.len()
            ),
        )
    } else {
        let failed = unhealthy.iter().any(|(_, health, _)| *health == FAILED);
        let told: Vec<String> = unhealthy
            .iter()
            .map(|(claim, health, message)| {
                if message.is_empty() {
                    format!("{claim}: pool {health}")
                } else {
                    format!("{claim}: pool {health}: {message}")
                }
            })
            .collect();
        (
            "False",
            if failed { POOL_FAILED } else { POOL_DEGRADED },
            told.join("; "),
        )
    };
    let last_transition_time = previous
        .filter(|previous| previous.status == status)
        .map_or(now, |previous| previous.last_transition_time.clone());
    Condition {
        type_: HEALTH_CONDITION.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// The Warning Event when `current` newly says a volume's pool is unhealthy (or its
/// reason changes while False).
pub fn health_warning(previous: Option<&Condition>, current: &Condition) -> Option<Note> {
    if current.status != "False" {
        return None;
    }
    let already = previous.is_some_and(|previous| {
        previous.status == current.status && previous.reason == current.reason
    });
    let reason = if current.reason == POOL_FAILED {
        POOL_FAILED
    } else {
        POOL_DEGRADED
    };
    (!already).then(|| Note::warning(reason, current.message.clone()))
}

/// The StorageClasses named by claims that are not bound yet: the ones whose existence
/// the shell looks up for [`condition`] (bound claims need no lookup).
pub fn classes_of_unbound(claims: &[PersistentVolumeClaim]) -> BTreeSet<String> {
    claims
        .iter()
        .filter(|claim| claim.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound"))
        .filter_map(|claim| claim.spec.as_ref()?.storage_class_name.clone())
        .filter(|class| !class.is_empty())
        .collect()
}

/// The Warning Event to record when `current` newly reports a problem the user has to
/// act on: once when the condition turns False, or when the reason changes while False.
/// Waiting for a volume that is on its way is not one: every new cluster waits a few
/// seconds, and a Warning for it would be noise.
pub fn warning(previous: Option<&Condition>, current: &Condition) -> Option<Note> {
    if current.status != "False" || current.reason == WAITING_FOR_VOLUME {
        return None;
    }
    let already = previous.is_some_and(|previous| {
        previous.status == current.status && previous.reason == current.reason
    });
    if already {
        return None;
    }
    let reason = match current.reason.as_str() {
        NO_STORAGE_CLASS => NO_STORAGE_CLASS,
        STORAGE_CLASS_NOT_FOUND => STORAGE_CLASS_NOT_FOUND,
        VOLUME_LOST => VOLUME_LOST,
        _ => UNSCHEDULABLE,
    };
    Some(Note::warning(reason, current.message.clone()))
}

/// Whether two claims' problems are told in one message: the same missing class, any
/// wait; the others are about one claim's own volume or pod.
fn same_group(a: &Problem, b: &Problem) -> bool {
    matches!((a, b), (Problem::Waiting { .. }, Problem::Waiting { .. })) || a == b
}

/// What `claim` waits for, or `None` when it is bound.
fn problem(
    claim: &PersistentVolumeClaim,
    pods: &[&Pod],
    missing_classes: &BTreeSet<String>,
) -> Option<Problem> {
    let phase = claim.status.as_ref().and_then(|s| s.phase.as_deref());
    match phase {
        Some("Bound") => return None,
        Some("Lost") => {
            return Some(Problem::Lost {
                volume: claim.spec.as_ref().and_then(|s| s.volume_name.clone()),
            });
        }
        // Pending, or not yet looked at by the volume controller.
        _ => {}
    }
    let class = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .filter(|class| !class.is_empty());
    // The DefaultStorageClass admission plugin fills in the default class when the claim
    // is created, and the volume controller does so later for claims made before a
    // default existed; a claim still without one means there is no default.
    let Some(class) = class else {
        return Some(Problem::NoStorageClass);
    };
    if missing_classes.contains(&class) {
        return Some(Problem::StorageClassNotFound(class));
    }
    let pod = pods.iter().find(|pod| uses(pod, &claim.name_any()));
    if let Some(pod) = pod
        && let Some(message) = unschedulable(pod)
    {
        return Some(Problem::Unschedulable {
            pod: pod.name_any(),
            message,
        });
    }
    Some(Problem::Waiting {
        node: claim
            .annotations()
            .get("volume.kubernetes.io/selected-node")
            .cloned(),
    })
}

fn uses(pod: &Pod, claim: &str) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|volumes| {
            volumes.iter().any(|volume| {
                volume
                    .persistent_volume_claim
                    .as_ref()
                    .is_some_and(|source| source.claim_name == claim)
            })
        })
}

/// The scheduler's account of why it cannot place `pod`, if it gave up on it.
fn unschedulable(pod: &Pod) -> Option<String> {
    let scheduled = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled")?;
    if scheduled.status != "False" {
        return None;
    }
    let message = scheduled.message.clone().unwrap_or_default();
    Some(if message.is_empty() {
        scheduled
            .reason
            .clone()
            .unwrap_or_else(|| "no reason given".to_owned())
    } else {
        message
    })
}

fn explain(
    problem: &Problem,
    group: &[&(Problem, String)],
    bound: usize,
) -> (&'static str, String) {
    let claims: Vec<&str> = group.iter().map(|(_, name)| name.as_str()).collect();
    let claims_text = claims.join(", ");
    let plural = claims.len() > 1;
    match problem {
        Problem::NoStorageClass => (
            NO_STORAGE_CLASS,
            format!(
                "volume claim{s} {claims_text} name{v} no StorageClass and the cluster has no \
                 default one: mark a StorageClass as the default (for a StoragePool, \
                 spec.storageClass.default: true) or set spec.storage.storageClassName",
                s = if plural { "s" } else { "" },
                v = if plural { "" } else { "s" },
            ),
        ),
        Problem::StorageClassNotFound(class) => (
            STORAGE_CLASS_NOT_FOUND,
            format!(
                "StorageClass {class} does not exist, so volume claim{s} {claims_text} cannot \
                 be provisioned: create it (for example a StoragePool with \
                 spec.storageClass.name: {class}); spec.storage.storageClassName cannot be \
                 changed once set, so a cluster meant for another class must be recreated",
                s = if plural { "s" } else { "" },
            ),
        ),
        Problem::Lost { volume } => (
            VOLUME_LOST,
            format!(
                "volume claim {claims_text} lost its volume{volume}: delete the claim and its \
                 pod, and the operator rebuilds the instance on a new volume",
                volume = volume
                    .as_deref()
                    .map(|v| format!(" {v}"))
                    .unwrap_or_default(),
            ),
        ),
        Problem::Unschedulable { pod, message } => (
            UNSCHEDULABLE,
            format!(
                "pod {pod} cannot be scheduled, so volume claim {claims_text} stays unbound: \
                 {message}{hint}",
                // The provisioner's own reason (a pool without room on the node the
                // scheduler tried) is an Event on the claim, not on any object here.
                hint = if volume_related(message) {
                    format!(
                        " (why: kubectl describe pvc {claims_text}; the StorageClass needs \
                         room: disks for its StoragePool on more nodes, free space, or \
                         PersistentVolumes it can bind)"
                    )
                } else {
                    String::new()
                },
            ),
        ),
        Problem::Waiting { .. } => (
            WAITING_FOR_VOLUME,
            format!(
                "{bound} of {total} volume claims bound; waiting: {waits}",
                total = bound + claims.len(),
                waits = group
                    .iter()
                    .map(|(problem, name)| match problem {
                        Problem::Waiting { node: Some(node) } => {
                            format!("{name} (its volume is being provisioned on {node})")
                        }
                        _ => format!("{name} (binds once a pod using it is scheduled)"),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
        ),
    }
}

/// Whether the scheduler's message is about volumes (the VolumeBinding plugin's
/// reasons), rather than CPU, memory or taints.
fn volume_related(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    [
        "persistent volume",
        "persistentvolumeclaim",
        "volume node affinity",
        "enough space",
        // PreBind, when the provisioner gave up on the node the scheduler picked.
        "binding volumes",
        "provisioning failed",
    ]
    .iter()
    .any(|phrase| message.contains(phrase))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;
    use serde_json::json;

    fn at(seconds: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap())
    }

    fn claim(name: &str, class: Option<&str>, phase: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "storageClassName": class, "accessModes": ["ReadWriteOnce"] },
            "status": { "phase": phase },
        }))
        .unwrap()
    }

    fn pod(name: &str, scheduled: Option<(&str, &str, &str)>) -> Pod {
        let conditions: Vec<_> = scheduled
            .into_iter()
            .map(|(status, reason, message)| {
                json!({ "type": "PodScheduled", "status": status, "reason": reason, "message": message })
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": {
                "containers": [{ "name": "postgres" }],
                "volumes": [{ "name": "data", "persistentVolumeClaim": { "claimName": name } }],
            },
            "status": { "conditions": conditions },
        }))
        .unwrap()
    }

    fn decide(claims: &[PersistentVolumeClaim], pods: &[Pod], missing: &[&str]) -> Condition {
        let missing = missing.iter().map(|s| s.to_string()).collect();
        condition(claims, pods, &missing, None, Some(4), at(100))
    }

    const NO_VOLUMES: &str = "0/3 nodes are available: 3 node(s) didn't find available \
        persistent volumes to bind. preemption: 0/3 nodes are available: 3 Preemption is not \
        helpful for scheduling.";

    #[test]
    fn every_claim_bound_is_true() {
        let claims = [
            claim("db-1", Some("fast"), "Bound"),
            claim("db-2", Some("fast"), "Bound"),
        ];
        let c = decide(&claims, &[pod("db-1", Some(("True", "", "")))], &[]);
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            ("VolumesBound", "True", "Bound")
        );
        assert_eq!(c.message, "2 of 2 volume claims bound");
        assert_eq!(c.observed_generation, Some(4));
    }

    #[test]
    fn a_claim_without_class_says_there_is_no_default() {
        let claims = [
            claim("db-1", None, "Pending"),
            claim("db-2", None, "Pending"),
        ];
        let pods = [pod(
            "db-1",
            Some((
                "False",
                "Unschedulable",
                "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
            )),
        )];
        let c = decide(&claims, &pods, &[]);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "NoStorageClass")
        );
        assert!(
            c.message
                .starts_with("volume claims db-1, db-2 name no StorageClass"),
            "{}",
            c.message
        );
        assert!(
            c.message.contains("spec.storageClass.default: true"),
            "{}",
            c.message
        );
    }

    #[test]
    fn a_missing_class_is_named_before_what_the_scheduler_says() {
        let claims = [claim("db-1", Some("nope"), "Pending")];
        let pods = [pod(
            "db-1",
            Some((
                "False",
                "Unschedulable",
                "0/3 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
            )),
        )];
        let c = decide(&claims, &pods, &["nope"]);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "StorageClassNotFound")
        );
        assert!(
            c.message.starts_with(
                "StorageClass nope does not exist, so volume claim db-1 cannot be provisioned"
            ),
            "{}",
            c.message
        );
    }

    #[test]
    fn an_unschedulable_pod_quotes_the_scheduler_with_a_hint_when_volumes_are_the_cause() {
        let claims = [claim("db-1", Some("fast"), "Pending")];
        let c = decide(
            &claims,
            &[pod("db-1", Some(("False", "Unschedulable", NO_VOLUMES)))],
            &[],
        );
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Unschedulable")
        );
        assert!(
            c.message.starts_with(
                "pod db-1 cannot be scheduled, so volume claim db-1 stays unbound: 0/3 nodes"
            ),
            "{}",
            c.message
        );
        assert!(
            c.message
                .contains("(why: kubectl describe pvc db-1; the StorageClass needs room"),
            "{}",
            c.message
        );

        // What the scheduler says when the agent refused to provision on its node (seen
        // on the local cluster with a 50Gi claim and 10 GiB disks).
        let refused = "running PreBind plugin \"VolumeBinding\": binding volumes: \
            provisioning failed for PVC \"db-1\"";
        let c = decide(
            &claims,
            &[pod("db-1", Some(("False", "SchedulerError", refused)))],
            &[],
        );
        assert_eq!(c.reason, "Unschedulable");
        assert!(
            c.message
                .contains("provisioning failed for PVC \"db-1\" (why: kubectl describe pvc db-1"),
            "{}",
            c.message
        );

        let cpu = "0/3 nodes are available: 3 Insufficient cpu.";
        let c = decide(
            &claims,
            &[pod("db-1", Some(("False", "Unschedulable", cpu)))],
            &[],
        );
        assert_eq!(c.reason, "Unschedulable");
        assert!(
            c.message.ends_with("Insufficient cpu."),
            "no volume hint for CPU: {}",
            c.message
        );
    }

    #[test]
    fn claims_whose_pods_are_not_placed_yet_are_waiting() {
        let mut provisioning = claim("db-1", Some("fast"), "Pending");
        provisioning.metadata.annotations = Some(
            [(
                "volume.kubernetes.io/selected-node".to_owned(),
                "node-2".to_owned(),
            )]
            .into(),
        );
        let claims = [provisioning, claim("db-2", Some("fast"), "Bound")];
        let c = decide(&claims, &[pod("db-1", None)], &[]);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "WaitingForVolume")
        );
        assert_eq!(
            c.message,
            "1 of 2 volume claims bound; waiting: db-1 (its volume is being provisioned on node-2)"
        );

        // Replicas' claims before their pods exist (they follow a ready primary).
        let claims = [
            claim("db-1", Some("fast"), "Bound"),
            claim("db-2", Some("fast"), "Pending"),
            claim("db-3", Some("fast"), "Pending"),
        ];
        let c = decide(&claims, &[pod("db-1", Some(("True", "", "")))], &[]);
        assert_eq!(c.reason, "WaitingForVolume");
        assert_eq!(
            c.message,
            "1 of 3 volume claims bound; waiting: db-2 (binds once a pod using it is scheduled), \
             db-3 (binds once a pod using it is scheduled)"
        );
    }

    #[test]
    fn a_lost_volume_says_how_the_instance_comes_back() {
        let mut lost = claim("db-2", Some("fast"), "Lost");
        lost.spec.as_mut().unwrap().volume_name = Some("pvc-123".into());
        let claims = [claim("db-1", Some("fast"), "Bound"), lost];
        let c = decide(&claims, &[], &[]);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "VolumeLost")
        );
        assert!(
            c.message
                .starts_with("volume claim db-2 lost its volume pvc-123: delete the claim"),
            "{}",
            c.message
        );
    }

    #[test]
    fn the_most_serious_problem_wins() {
        let claims = [
            claim("db-1", Some("fast"), "Pending"),
            claim("db-2", Some("nope"), "Pending"),
            claim("db-3", None, "Pending"),
        ];
        let pods = [pod("db-1", Some(("False", "Unschedulable", NO_VOLUMES)))];
        assert_eq!(decide(&claims, &pods, &["nope"]).reason, "NoStorageClass");
        assert_eq!(
            decide(&claims[..2], &pods, &["nope"]).reason,
            "StorageClassNotFound"
        );
        assert_eq!(
            decide(&claims[..1], &pods, &["nope"]).reason,
            "Unschedulable"
        );
    }

    #[test]
    fn only_classes_of_unbound_claims_are_looked_up() {
        let claims = [
            claim("db-1", Some("fast"), "Bound"),
            claim("db-2", Some("nope"), "Pending"),
            claim("db-3", None, "Pending"),
            claim("db-4", Some("nope"), "Pending"),
        ];
        assert_eq!(classes_of_unbound(&claims), ["nope".to_owned()].into());
    }

    #[test]
    fn the_transition_time_stays_while_the_status_does() {
        let claims = [claim("db-1", None, "Pending")];
        let missing = BTreeSet::new();
        let first = condition(&claims, &[], &missing, None, None, at(100));
        assert_eq!(first.last_transition_time, at(100));
        let again = condition(&claims, &[], &missing, Some(&first), None, at(200));
        assert_eq!(again.last_transition_time, at(100), "still False");
        let bound = [claim("db-1", Some("fast"), "Bound")];
        let flipped = condition(&bound, &[], &missing, Some(&again), None, at(300));
        assert_eq!(flipped.last_transition_time, at(300), "turned True");
    }

    #[test]
    fn a_warning_once_per_problem_and_none_for_waiting() {
        let claims = [claim("db-1", None, "Pending")];
        let missing = BTreeSet::new();
        let false_now = condition(&claims, &[], &missing, None, None, at(1));
        let note = warning(None, &false_now).expect("a warning when it turns False");
        assert!(note.warning);
        assert_eq!(note.reason, "NoStorageClass");
        assert_eq!(note.message, false_now.message);
        assert_eq!(warning(Some(&false_now), &false_now), None, "only once");

        let gone: BTreeSet<String> = ["nope".to_owned()].into();
        let other = condition(
            &[claim("db-1", Some("nope"), "Pending")],
            &[],
            &gone,
            Some(&false_now),
            None,
            at(2),
        );
        assert_eq!(
            warning(Some(&false_now), &other).map(|n| n.reason),
            Some("StorageClassNotFound"),
            "a new reason warns again"
        );

        let waiting = condition(
            &[claim("db-1", Some("fast"), "Pending")],
            &[],
            &missing,
            None,
            None,
            at(3),
        );
        assert_eq!(waiting.reason, "WaitingForVolume");
        assert_eq!(warning(None, &waiting), None);
        let bound = condition(
            &[claim("db-1", Some("fast"), "Bound")],
            &[],
            &missing,
            None,
            None,
            at(4),
        );
        assert_eq!(warning(Some(&false_now), &bound), None);
    }

    fn told(name: &str, health: Option<(&str, &str)>) -> PersistentVolumeClaim {
        let mut claim = claim(name, Some("fast"), "Bound");
        if let Some((health, message)) = health {
            claim.metadata.annotations = Some(
                [
                    (POOL_HEALTH_ANNOTATION.to_string(), health.to_string()),
                    (
                        POOL_HEALTH_MESSAGE_ANNOTATION.to_string(),
                        message.to_string(),
                    ),
                ]
                .into(),
            );
        }
        claim
    }

    #[test]
    fn volumes_are_healthy_as_the_agents_say_their_pools_are() {
        let none = BTreeSet::new();
        let healthy = [
            told("db-1", Some(("Healthy", ""))),
            told("db-2", Some(("Healthy", ""))),
        ];
        let c = health_condition(&healthy, &[], &none, None, Some(4), at(100));
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            ("VolumesHealthy", "True", POOL_HEALTHY)
        );
        assert_eq!(health_warning(None, &c), None);

        let degraded = [
            told("db-1", Some(("Healthy", ""))),
            told(
                "db-2",
                Some(("Degraded", "1 disk reports I/O or checksum errors")),
            ),
        ];
        let d = health_condition(&degraded, &[], &none, Some(&c), Some(4), at(200));
        assert_eq!(
            (d.status.as_str(), d.reason.as_str(), d.message.as_str()),
            (
                "False",
                POOL_DEGRADED,
                "db-2: pool Degraded: 1 disk reports I/O or checksum errors"
            )
        );
        assert_eq!(d.last_transition_time, at(200));
        assert!(
            health_warning(Some(&c), &d).is_some(),
            "a Warning when it turns False"
        );
        assert_eq!(health_warning(Some(&d), &d), None, "once");

        let failed = [told("db-1", Some(("Failed", "mkfs failed")))];
        assert_eq!(
            health_condition(&failed, &[], &none, Some(&d), Some(4), at(300)).reason,
            POOL_FAILED
        );

        let elsewhere = [told("db-1", None)];
        let u = health_condition(&elsewhere, &[], &none, None, Some(4), at(100));
        assert_eq!(
            (u.status.as_str(), u.reason.as_str()),
            ("Unknown", NOT_REPORTED)
        );
    }

    #[test]
    fn the_worst_health_wins_failed_over_any_unhealthy_over_healthy() {
        assert_eq!(worst([]), None);
        assert_eq!(worst(["Healthy"]), Some("Healthy"));
        assert_eq!(worst(["Healthy", "Degraded"]), Some("Degraded"));
        assert_eq!(worst(["Degraded", "Healthy"]), Some("Degraded"));
        assert_eq!(worst(["Degraded", "Failed", "Healthy"]), Some("Failed"));
        assert_eq!(worst(["Failed", "Degraded"]), Some("Failed"));
        assert_eq!(
            worst(["Healthy", "Rebuilding"]),
            Some("Rebuilding"),
            "a word this operator does not know is not taken for healthy"
        );
        assert_eq!(
            worst(["Pending", "Degraded"]),
            Some("Pending"),
            "the first of equally bad ones"
        );
    }

    #[test]
    fn an_instance_reports_the_worst_of_the_volumes_its_pod_mounts() {
        let none = BTreeSet::new();
        let mut two_volumes = pod("db-1", None);
        if let Some(volumes) = two_volumes.spec.as_mut().and_then(|s| s.volumes.as_mut()) {
            volumes.push(
                serde_json::from_value(
                    json!({ "name": "wal", "persistentVolumeClaim": { "claimName": "db-1-wal" } }),
                )
                .unwrap(),
            );
        }
        let claims = [
            told("db-1", Some(("Healthy", ""))),
            told("db-1-wal", Some(("Degraded", "1 disk missing"))),
            told("db-2", Some(("Failed", "not this instance's"))),
        ];
        assert_eq!(
            instance_health(&two_volumes, &claims, &none).as_deref(),
            Some("Degraded")
        );
        assert_eq!(
            instance_health(&pod("db-1", None), &claims, &none).as_deref(),
            Some("Healthy"),
            "only the claims the pod mounts"
        );
        assert_eq!(
            instance_health(&pod("db-2", None), &claims, &none).as_deref(),
            Some("Failed")
        );
        let unreported = [told("db-1", None)];
        assert_eq!(
            instance_health(&pod("db-1", None), &unreported, &none),
            None
        );
        assert_eq!(
            instance_health(&pod("db-3", None), &claims, &none),
            None,
            "no claim of its own"
        );
    }

    fn on_node(mut claim: PersistentVolumeClaim, node: &str) -> PersistentVolumeClaim {
        claim
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(SELECTED_NODE.to_string(), node.to_string());
        claim
    }

    #[test]
    fn a_volume_on_a_node_that_is_not_ready_is_of_unknown_health() {
        let down = BTreeSet::from(["node-3".to_string()]);
        let claims = [
            on_node(told("db-1", Some(("Healthy", ""))), "node-1"),
            on_node(told("db-2", Some(("Healthy", ""))), "node-3"),
        ];
        let c = health_condition(&claims, &[], &down, None, Some(4), at(100));
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("Unknown", NODE_NOT_READY)
        );
        assert!(c.message.contains("db-2 (node node-3)"), "{}", c.message);
        assert_eq!(
            health_warning(None, &c),
            None,
            "no Warning: the node's own say"
        );
        // Back to True once the node is Ready again.
        let c = health_condition(&claims, &[], &BTreeSet::new(), Some(&c), Some(4), at(200));
        assert_eq!(
            (c.status.as_str(), c.last_transition_time),
            ("True", at(200))
        );
        // A pool reported unhealthy elsewhere still makes it False.
        let claims = [
            on_node(told("db-1", Some(("Degraded", "1 disk missing"))), "node-1"),
            on_node(told("db-2", Some(("Healthy", ""))), "node-3"),
        ];
        let c = health_condition(&claims, &[], &down, None, Some(4), at(300));
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", POOL_DEGRADED)
        );
        // The instance's own column: Unknown on the lost node, unless worse was said.
        assert_eq!(
            instance_health(&pod("db-2", None), &claims, &down).as_deref(),
            Some(UNKNOWN_HEALTH)
        );
        // A volume made beforehand binds without the scheduler's annotation: the node
        // of the pod that mounts it tells.
        let mut placed = pod("db-2", None);
        placed.spec.as_mut().expect("a spec").node_name = Some("node-3".into());
        let unannotated = [told("db-2", Some(("Healthy", "")))];
        let c = health_condition(&unannotated, &[&placed], &down, None, Some(4), at(400));
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("Unknown", NODE_NOT_READY)
        );
        assert_eq!(
            instance_health(&placed, &unannotated, &down).as_deref(),
            Some(UNKNOWN_HEALTH)
        );
        assert_eq!(
            health_condition(&unannotated, &[], &down, None, Some(4), at(400)).status,
            "True",
            "no node known, nothing to doubt"
        );
        let failed = [on_node(
            told("db-2", Some(("Failed", "mkfs failed"))),
            "node-3",
        )];
        assert_eq!(
            instance_health(&pod("db-2", None), &failed, &down).as_deref(),
            Some("Failed")
        );
        assert_eq!(
            instance_health(&pod("db-1", None), &claims, &down).as_deref(),
            Some("Degraded")
        );
    }
}
