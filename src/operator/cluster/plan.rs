//! What one pass over a `DatabaseCluster` should leave behind, decided as pure code:
//! from the machine's order (the spec, the primary, the instances' views, the surplus
//! instances that may go) and what the shell read ([`Observed`]: pods, volume claims,
//! missing StorageClasses, nodes, the time), the [`Plan`] — which role label each pod
//! carries, which instances are created and how they start, which surplus instances
//! are removed, the whole status to write, and the members the pass reports to the
//! machine.
//!
//! No I/O and no clock (the time comes in with `Observed`): `pass.rs` reads, calls
//! [`plan`] and applies the result. The `VolumesBound` condition is `volumes.rs`'s.

use std::collections::{BTreeMap, BTreeSet};

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::{
    DatabaseClusterStatus, InstanceStatus, ReplicationSlotStatus,
};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use super::state::{Assessment, ConvergeOrder, Converged, Member, Note, desired_count};
use super::{upgrade, volumes};
use crate::instance_api::RunningRole;
use crate::operator::build::{self, ROLE_LABEL, StartRole};
use crate::operator::catalog;
use crate::operator::instance_client;
use crate::operator::replica::InstanceView;

/// The condition on the user's own server certificate (`spec.tls.serverCertificate`),
/// present only while the spec names one.
pub const SERVER_CERTIFICATE: &str = "ServerCertificate";

/// The Warning `reason` when a condition turns False, or says something new while
/// False (its reason is told in the message).
fn turned_false(
    reason: &'static str,
    previous: Option<&Condition>,
    current: &Condition,
) -> Option<Note> {
    let already = previous
        .is_some_and(|previous| previous.status == "False" && previous.message == current.message);
    (current.status == "False" && !already).then(|| Note::warning(reason, current.message.clone()))
}

/// The Warning when `VersionAvailable` turns False.
pub fn version_warning(previous: Option<&Condition>, current: &Condition) -> Option<Note> {
    turned_false("VersionUnavailable", previous, current)
}

/// The Warning for the user's server certificate, once it is refused.
pub fn certificate_warning(previous: Option<&Condition>, current: &Condition) -> Option<Note> {
    turned_false("CertificateRefused", previous, current)
}

/// What the shell read for a pass.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The cluster's pods, by instance number.
    pub pods: BTreeMap<u32, Pod>,
    /// Every desired instance's volume claim, as the pass applied it.
    pub claims: Vec<PersistentVolumeClaim>,
    /// The StorageClasses that unbound claims name and that do not exist.
    pub missing_storage_classes: BTreeSet<String>,
    /// The nodes the pods run on, by name; a node missing here is unknown.
    pub nodes: BTreeMap<String, NodeHealth>,
    /// With `spec.tls.serverCertificate`: whether the user's certificate is served.
    pub server_certificate: Option<Assessment>,
    /// What new pods run, from the image catalog (`catalog::choose`): `None` when the
    /// data's version has no image, and nothing is created.
    pub runs: Option<build::Runs>,
    /// `VersionAvailable`: whether the version has an image, and the spec asks for it.
    pub version_condition: Assessment,
    /// The spec's version has an image (a major upgrade can start).
    pub target_available: bool,
    /// The major-upgrade pod, if any.
    pub upgrade_job: upgrade::JobSeen,
    /// When the pass runs: the transition time of a condition whose status changes.
    pub now: Time,
}

impl Observed {
    /// The known nodes whose `Ready` condition is not True.
    pub fn down_nodes(&self) -> BTreeSet<String> {
        self.nodes
            .iter()
            .filter(|(_, health)| !health.ready)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// What a pass needs to know of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeHealth {
    /// Its `Ready` condition is True.
    pub ready: bool,
    /// `spec.unschedulable`, as `kubectl cordon` and the first step of `kubectl drain`
    /// set it.
    pub cordoned: bool,
}

impl NodeHealth {
    pub fn of(node: &Node) -> Self {
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        Self {
            ready,
            cordoned: node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false),
        }
    }

    /// Being drained: cordoned while it works. A lost node is failover's business, and
    /// a switchover away from it could not stop its primary cleanly anyway.
    pub fn draining(self) -> bool {
        self.ready && self.cordoned
    }
}

/// What a pass does and writes.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Pods whose role label is not the one they should carry, with that role, in
    /// instance order. The Services select on the label.
    pub relabel: Vec<(String, StartRole)>,
    /// Pods to mark as of a cluster that has had data (`INITIALIZED_ANNOTATION`), so
    /// that their instance managers never run initdb on an emptied volume.
    pub mark_initialized: Vec<String>,
    /// Missing instances to create, in instance order.
    pub create: Vec<Creation>,
    /// Surplus instances to remove with their volume claims (named like their pods),
    /// highest number first.
    pub remove: Vec<String>,
    /// The status to write (when it differs from the cluster's).
    pub status: DatabaseClusterStatus,
    /// What the pass reports to the machine: the instances after it, created ones
    /// included (without an address yet).
    pub converged: Converged,
    /// A pod to replace (delete; the next pass makes it again from its volume) for a
    /// minor update, one at a time.
    pub update: Option<MinorUpdate>,
    /// A major upgrade's step: its pod, and the instance pods to stop for it.
    pub upgrade: upgrade::Step,
    /// Instance pods to delete (their volumes stay) for a major upgrade.
    pub stop: Vec<String>,
}

/// One step of a rolling minor update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MinorUpdate {
    pub pod: String,
    /// The only instance, the primary: writes pause until it is back.
    pub in_place: bool,
}

/// An instance to create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Creation {
    pub number: u32,
    pub role: StartRole,
    /// Its instance manager may initialise an empty volume: only the primary of a
    /// cluster that never had data.
    pub allow_initdb: bool,
}

pub fn plan(order: &ConvergeOrder, observed: &Observed) -> Plan {
    let cluster = order.cluster.as_ref();
    let primary = primary_number(order);
    let initialized = initialized(order);
    // Without an image for the data's version, nothing is created; VersionAvailable
    // says why.
    let remove = removals(order, observed, primary);
    let instances = instances(order, observed);
    let ready = i32::try_from(instances.iter().filter(|i| i.ready).count()).unwrap_or(i32::MAX);
    let desired = desired_count(cluster) as usize;
    // Counted on the pods found: an instance created by this pass is not ready yet.
    let all_ready =
        ready == cluster.spec.replicas && observed.pods.len() == desired && remove.is_empty();
    let previous = cluster.status.clone().unwrap_or_default();
    let now = &observed.now;
    let upgrade = upgrade::step(&upgrade::Facts {
        cluster,
        data_version: previous.version.as_deref(),
        target_available: observed.target_available,
        primary: build::instance_name(cluster, primary),
        instance_pods: observed.pods.len(),
        all_ready,
        job: observed.upgrade_job.clone(),
        now: now.0.to_string(),
        now_seconds: now.0.as_second(),
    });
    let create = if observed.runs.is_some() && !upgrade.hold_instances {
        creations(order, observed, primary, initialized)
    } else {
        Vec::new()
    };
    let stop = if upgrade.stop_instances {
        observed
            .pods
            .values()
            .filter(|pod| pod.metadata.deletion_timestamp.is_none())
            .map(|pod| pod.name_any())
            .collect()
    } else {
        Vec::new()
    };
    let phase = match upgrade.status.as_ref().map(|u| u.phase.as_str()) {
        Some(upgrade::STOPPING | upgrade::UPGRADING | upgrade::STARTING) => "Upgrading",
        Some(upgrade::ROLLING_BACK) => "RollingBack",
        _ => phase(order, observed, all_ready),
    };
    let previous_volumes = previous
        .conditions
        .iter()
        .find(|c| c.type_ == volumes::CONDITION);
    let volumes_bound = volumes::condition(
        &observed.claims,
        observed.pods.values(),
        &observed.missing_storage_classes,
        previous_volumes,
        cluster.metadata.generation,
        now.clone(),
    );
    let volumes_healthy = volumes::health_condition(
        &observed.claims,
        &observed.pods.values().collect::<Vec<_>>(),
        &observed.down_nodes(),
        previous
            .conditions
            .iter()
            .find(|c| c.type_ == volumes::HEALTH_CONDITION),
        cluster.metadata.generation,
        now.clone(),
    );
    let conditions = vec![
        condition(
            cluster,
            "Ready",
            Assessment::new(
                all_ready,
                if all_ready {
                    "AllInstancesReady"
                } else {
                    "InstancesNotReady"
                },
                format!("{ready} of {} instances ready", cluster.spec.replicas),
            ),
            now,
        ),
        condition(
            cluster,
            "Progressing",
            Assessment::new(
                !all_ready,
                if all_ready { "Settled" } else { "Reconciling" },
                if all_ready {
                    "nothing to do"
                } else {
                    "creating, removing or starting instances"
                },
            ),
            now,
        ),
        degraded_condition(cluster, order.degraded.as_deref(), now),
        condition(
            cluster,
            "PrimaryAvailable",
            order.primary_condition.clone(),
            now,
        ),
        volumes_bound,
        volumes_healthy,
    ]
    .into_iter()
    .chain(
        order
            .synchronous_condition
            .clone()
            .map(|a| condition(cluster, "SynchronousReplication", a, now)),
    )
    .chain(
        order
            .archive_condition
            .clone()
            .map(|a| condition(cluster, "ContinuousArchiving", a, now)),
    )
    .chain(
        order
            .restore_condition
            .clone()
            .map(|a| condition(cluster, "Restored", a, now)),
    )
    .chain(
        order
            .parameters_condition
            .clone()
            .map(|a| condition(cluster, "ParametersValid", a, now)),
    )
    .chain(
        observed
            .server_certificate
            .clone()
            .map(|a| condition(cluster, SERVER_CERTIFICATE, a, now)),
    )
    .chain(std::iter::once(condition(
        cluster,
        catalog::CONDITION,
        observed.version_condition.clone(),
        now,
    )))
    .chain(
        upgrade
            .condition
            .clone()
            .map(|a| condition(cluster, upgrade::CONDITION, a, now)),
    )
    .collect();
    let status = DatabaseClusterStatus {
        observed_generation: cluster.metadata.generation,
        conditions,
        phase: Some(phase.to_owned()),
        current_primary: Some(build::instance_name(cluster, primary)),
        target_primary: order.failover.as_ref().and_then(|f| f.target.clone()),
        initialized: initialized.then_some(true),
        replication_slots: replication_slots(order, primary),
        ready_instances: Some(ready),
        instances,
        // Mid-upgrade, the data's version is the upgrade's to say.
        version: upgrade
            .data_version
            .clone()
            .or_else(|| running_version(order, &build::instance_name(cluster, primary)))
            .or(previous.version.clone()),
        upgrade: upgrade.status.clone(),
        ..previous
    };
    let status = match &cluster.status {
        Some(shown) if !order.refresh_progress => unless_only_moved(shown, status),
        _ => status,
    };
    Plan {
        relabel: relabels(order, observed, primary),
        mark_initialized: if initialized {
            unmarked(observed)
        } else {
            Vec::new()
        },
        converged: Converged {
            members: members(order, observed, primary, &create, &remove),
            ready: all_ready,
            planned_outage: upgrade.hold_instances,
            archive: None,
            restore: None,
        },
        update: minor_update(order, observed, primary, all_ready && create.is_empty())
            .filter(|_| !upgrade.hold_instances),
        create,
        remove,
        status,
        upgrade,
        stop,
    }
}

/// `status` as shown if it differs from it only in positions, lag and WAL kept for
/// slots (see `PROGRESS_REFRESH`): then nothing is written. Otherwise status is written
/// anyway, with everything as viewed now: any other field of a row (a role, the
/// volume's health) is compared whole, so its change is never held back.
fn unless_only_moved(
    shown: &DatabaseClusterStatus,
    status: DatabaseClusterStatus,
) -> DatabaseClusterStatus {
    let mut kept = status.clone();
    for row in &mut kept.instances {
        if let Some(old) = shown.instances.iter().find(|o| o.name == row.name)
            && old.lsn.is_some() == row.lsn.is_some()
            && old.lag_bytes.is_some() == row.lag_bytes.is_some()
            && old.lag_seconds.is_some() == row.lag_seconds.is_some()
        {
            row.lsn.clone_from(&old.lsn);
            row.lag_bytes = old.lag_bytes;
            row.lag_seconds = old.lag_seconds;
        }
    }
    for slot in &mut kept.replication_slots {
        if let Some(old) = shown.replication_slots.iter().find(|o| o.name == slot.name)
            && old.retained_wal_bytes.is_some() == slot.retained_wal_bytes.is_some()
        {
            slot.retained_wal_bytes = old.retained_wal_bytes;
        }
    }
    if kept == *shown { kept } else { status }
}

/// Whether `pod` runs another image than `runs` names for the same major (a pod of
/// another major is never replaced by a minor update).
fn outdated(pod: &Pod, runs: Option<&build::Runs>) -> bool {
    let Some(runs) = runs else {
        return false;
    };
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return false;
    };
    let major = container
        .env
        .iter()
        .flatten()
        .find(|v| v.name == "CASTELLAN_POSTGRES_VERSION")
        .and_then(|v| v.value.as_deref());
    major == Some(runs.version.as_str()) && container.image.as_deref() != Some(&runs.image)
}

/// The next step of a rolling minor update, once everything is settled (every
/// instance there and ready, nothing being removed or failed over, no pod going
/// away): the highest-numbered outdated replica; the primary only when it is the only
/// instance. An outdated primary with updated replicas is switched over first (the
/// machine does it, from `Member::outdated`), then replaced as a replica.
fn minor_update(
    order: &ConvergeOrder,
    observed: &Observed,
    primary: u32,
    settled: bool,
) -> Option<MinorUpdate> {
    if !settled
        || order.failover.is_some()
        || observed
            .pods
            .values()
            .any(|pod| pod.metadata.deletion_timestamp.is_some())
    {
        return None;
    }
    let runs = observed.runs.as_ref();
    let outdated_pods: Vec<(u32, &Pod)> = observed
        .pods
        .iter()
        .filter(|(_, pod)| outdated(pod, runs))
        .map(|(n, pod)| (*n, pod))
        .collect();
    if let Some((_, pod)) = outdated_pods.iter().rev().find(|(n, _)| *n != primary) {
        return Some(MinorUpdate {
            pod: pod.name_any(),
            in_place: false,
        });
    }
    let (_, pod) = outdated_pods.first()?;
    (observed.pods.len() == 1).then(|| MinorUpdate {
        pod: pod.name_any(),
        in_place: true,
    })
}

/// The PostgreSQL major version the instances run, as their managers report it from
/// their binaries, not the one the spec asks for (an instance whose image carries
/// another major starts nothing and says so): the primary's, else the lowest any
/// running instance reports; `None` while none runs.
fn running_version(order: &ConvergeOrder, primary: &str) -> Option<String> {
    // Only a running server runs its release: an instance that refuses its binaries
    // (another major) runs nothing.
    let major = |view: &InstanceView| {
        view.release
            .as_deref()
            .filter(|_| view.running)
            .and_then(|release| release.split('.').next())
            .and_then(|major| major.parse::<u32>().ok())
    };
    order
        .views
        .iter()
        .find(|view| view.name == primary)
        .and_then(major)
        .or_else(|| order.views.iter().filter_map(major).min())
        .map(|major| major.to_string())
}

/// The instance number of a pod named `<cluster>-<n>`.
pub fn instance_number(cluster: &DatabaseCluster, pod: &Pod) -> Option<u32> {
    pod.name_any()
        .strip_prefix(&format!("{}-", cluster.name_any()))?
        .parse()
        .ok()
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// The primary is the one the machine decided on, else the one status names; a new
/// cluster's first instance.
fn primary_number(order: &ConvergeOrder) -> u32 {
    let cluster = order.cluster.as_ref();
    order
        .primary
        .as_deref()
        .or_else(|| {
            cluster
                .status
                .as_ref()
                .and_then(|s| s.current_primary.as_deref())
        })
        .and_then(|p| p.strip_prefix(&format!("{}-", cluster.name_any())))
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(1)
}

/// Once any instance has data the cluster has had data: from then on no empty volume
/// is initialised again.
fn initialized(order: &ConvergeOrder) -> bool {
    order
        .cluster
        .status
        .as_ref()
        .and_then(|s| s.initialized)
        .unwrap_or(false)
        || order.views.iter().any(|v| v.role.is_some())
}

/// The pods that do not say yet that their cluster has had data.
fn unmarked(observed: &Observed) -> Vec<String> {
    observed
        .pods
        .values()
        .filter(|pod| {
            pod.annotations()
                .get(build::INITIALIZED_ANNOTATION)
                .map(String::as_str)
                != Some("true")
        })
        .map(ResourceExt::name_any)
        .collect()
}

/// -rw follows the primary's label: only the primary has it, and nobody while a
/// failover replaces it (the old primary leaves -rw as soon as its lease is withheld).
fn relabels(order: &ConvergeOrder, observed: &Observed, primary: u32) -> Vec<(String, StartRole)> {
    observed
        .pods
        .iter()
        .filter_map(|(n, pod)| {
            let replaced = order.failover.as_ref().is_some_and(|f| f.lease_withheld);
            let wanted = if *n == primary && !replaced {
                StartRole::Primary
            } else {
                StartRole::Replica
            };
            let labelled = pod.labels().get(ROLE_LABEL).map(String::as_str);
            (labelled != Some(wanted.as_str())).then(|| (pod.name_any(), wanted))
        })
        .collect()
}

fn creations(
    order: &ConvergeOrder,
    observed: &Observed,
    primary: u32,
    initialized: bool,
) -> Vec<Creation> {
    let primary_ready = observed.pods.get(&primary).is_some_and(pod_ready);
    (1..=desired_count(&order.cluster))
        .filter(|n| !observed.pods.contains_key(n))
        .map(|n| {
            let role = if n == primary {
                StartRole::Primary
            } else {
                StartRole::Replica
            };
            Creation {
                number: n,
                role,
                // A primary starts asynchronous; synchronous standbys are named once
                // they stream, or its own bootstrap writes would wait for replicas
                // that cannot exist before it is ready.
                allow_initdb: role == StartRole::Primary && !initialized,
            }
        })
        // A replica copies the primary: wait until there is a ready one.
        .filter(|creation| creation.role == StartRole::Primary || primary_ready)
        .collect()
}

/// Scale down: the surplus instances the machine cleared (never the primary; a sync
/// standby only once the primary no longer waits for it).
fn removals(order: &ConvergeOrder, observed: &Observed, primary: u32) -> Vec<String> {
    let desired = desired_count(&order.cluster);
    observed
        .pods
        .iter()
        .rev()
        .filter(|(n, _)| **n > desired && **n != primary)
        .map(|(_, pod)| pod.name_any())
        .filter(|name| order.remove.contains(name))
        .collect()
}

/// Each pod's row in status, from its instance's latest view (its actor reads it): the
/// role is what the instance manager reports, not what the pod's labels say; the
/// volume's health is what its node's agent wrote on the instance's claims (`Unknown`
/// while that node is not Ready).
fn instances(order: &ConvergeOrder, observed: &Observed) -> Vec<InstanceStatus> {
    let primary_view = order
        .views
        .iter()
        .find(|v| v.role == Some(RunningRole::Primary) && v.reachable && v.running);
    let down = observed.down_nodes();
    observed
        .pods
        .values()
        .map(|pod| {
            let name = pod.name_any();
            let own_view = order.views.iter().find(|v| v.name == name);
            let view = own_view.filter(|v| v.reachable);
            InstanceStatus {
                node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                role: view
                    .and_then(|v| v.role)
                    .map(|role| role.as_str().to_owned())
                    .or_else(|| pod.labels().get(ROLE_LABEL).cloned()),
                fenced: view.is_some_and(|v| v.fenced),
                timeline: view.and_then(|v| v.timeline),
                // A lost node's pods stay Ready in the API for the node controller's
                // grace period; the instance's own view says at once that it is not.
                ready: pod_ready(pod) && own_view.is_none_or(|v| v.ready),
                lsn: view.and_then(|v| v.lsn).map(|lsn| lsn.to_string()),
                lag_seconds: view.and_then(|v| v.lag_seconds),
                lag_bytes: primary_view.and_then(|p| standby_lag_bytes(p, &name)),
                volume_health: volumes::instance_health(pod, &observed.claims, &down),
                name,
            }
        })
        .collect()
}

fn standby_lag_bytes(primary: &InstanceView, standby: &str) -> Option<i64> {
    primary
        .standbys
        .iter()
        .find(|s| s.name == standby)
        .and_then(|s| s.lag_bytes)
}

/// The primary's replication slots, as its own view reports them.
fn replication_slots(order: &ConvergeOrder, primary: u32) -> Vec<ReplicationSlotStatus> {
    let name = build::instance_name(&order.cluster, primary);
    order
        .views
        .iter()
        .find(|v| v.name == name && v.reachable)
        .map(|view| {
            view.slots
                .iter()
                .map(|slot| ReplicationSlotStatus {
                    name: slot.name.clone(),
                    active: slot.active,
                    retained_wal_bytes: slot.retained_bytes,
                    wal_status: slot.wal_status.clone(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One word for the cluster, the most pressing first.
fn phase(order: &ConvergeOrder, observed: &Observed, all_ready: bool) -> &'static str {
    let desired = desired_count(&order.cluster) as usize;
    if order.degraded.is_some() {
        "Degraded"
    } else if order.failover.as_ref().is_some_and(|f| f.switchover) {
        "Switchover"
    } else if order.failover.is_some() {
        "FailingOver"
    } else if order.primary_condition.reason == "Fenced" {
        "Fenced"
    } else if all_ready {
        "Ready"
    } else if observed.pods.is_empty() {
        "Creating"
    } else if observed.pods.len() != desired {
        "Scaling"
    } else {
        "Progressing"
    }
}

/// The members after the pass: the pods found, less the removed ones, and the created
/// ones (no address until their pods get one).
fn members(
    order: &ConvergeOrder,
    observed: &Observed,
    primary: u32,
    create: &[Creation],
    remove: &[String],
) -> BTreeMap<String, Member> {
    let cluster = order.cluster.as_ref();
    let found = observed.pods.iter().filter_map(|(n, pod)| {
        let name = pod.name_any();
        if remove.contains(&name) {
            return None;
        }
        let address = instance_client::pod_address(cluster, pod);
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .and_then(|node| observed.nodes.get(node));
        let member = Member {
            number: *n,
            address,
            primary: *n == primary,
            cordoned: node.is_some_and(|node| node.draining()),
            // An unknown node is not taken for a lost one.
            node_ready: node.is_none_or(|node| node.ready),
            outdated: outdated(pod, observed.runs.as_ref()),
        };
        Some((name, member))
    });
    let created = create.iter().map(|creation| {
        let member = Member {
            number: creation.number,
            address: None,
            primary: creation.number == primary,
            cordoned: false,
            node_ready: true,
            outdated: false,
        };
        (build::instance_name(cluster, creation.number), member)
    });
    found.chain(created).collect()
}

/// A condition, keeping its transition time when its status did not change.
fn condition(
    cluster: &DatabaseCluster,
    type_: &str,
    assessment: Assessment,
    now: &Time,
) -> Condition {
    let status = if assessment.status { "True" } else { "False" }.to_owned();
    let unchanged = cluster
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status);
    Condition {
        type_: type_.to_owned(),
        status,
        reason: assessment.reason.to_owned(),
        message: assessment.message,
        observed_generation: cluster.metadata.generation,
        last_transition_time: unchanged
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone()),
    }
}

/// `Degraded`: true with the reason while the cluster's actors keep failing.
pub fn degraded_condition(
    cluster: &DatabaseCluster,
    reason: Option<&str>,
    now: &Time,
) -> Condition {
    let assessment = match reason {
        Some(reason) => Assessment::new(true, "ReconcileFailing", reason),
        None => Assessment::new(false, "Healthy", "reconciling works"),
    };
    condition(cluster, "Degraded", assessment, now)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;

    use super::*;
    use crate::instance_api::Lsn;
    use crate::operator::cluster::fixtures::{cluster, primary_view, unreachable, view};
    use crate::operator::cluster::state::FailoverStatus;

    /// When the pass in these tests runs.
    fn now() -> Time {
        Time(Timestamp::from_second(2_000_000).expect("a time in range"))
    }

    /// When the conditions of a status written before were set.
    fn earlier() -> Time {
        Time(Timestamp::from_second(1_000_000).expect("a time in range"))
    }

    /// Pod `db-<n>` on node `node-<n>` at 10.0.0.`<n>`, labelled `role`, with its
    /// volume claim `db-<n>`.
    fn pod(n: u32, role: StartRole, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": format!("db-{n}"), "labels": {ROLE_LABEL: role.as_str()}},
            "spec": {
                "nodeName": format!("node-{n}"),
                "containers": [],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("db-{n}")}}],
            },
            "status": {
                "podIP": format!("10.0.0.{n}"),
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .expect("a valid pod")
    }

    /// Ready pods db-1 (labelled primary) to db-`count` (labelled replica).
    fn pods(count: u32) -> BTreeMap<u32, Pod> {
        (1..=count)
            .map(|n| {
                let role = if n == 1 {
                    StartRole::Primary
                } else {
                    StartRole::Replica
                };
                (n, pod(n, role, true))
            })
            .collect()
    }

    /// The machine's order for `cluster` with db-1 as its serving primary and nothing
    /// else going on.
    fn order(cluster: Arc<DatabaseCluster>) -> ConvergeOrder {
        ConvergeOrder {
            cluster,
            views: Vec::new(),
            remove: Vec::new(),
            degraded: None,
            primary: Some("db-1".into()),
            failover: None,
            primary_condition: Assessment::new(true, "Available", "the primary serves"),
            synchronous_condition: None,
            archive_condition: None,
            restore_condition: None,
            parameters_condition: None,
            refresh_progress: true,
        }
    }

    fn observed(pods: BTreeMap<u32, Pod>) -> Observed {
        Observed {
            pods,
            claims: Vec::new(),
            missing_storage_classes: BTreeSet::new(),
            nodes: BTreeMap::new(),
            server_certificate: None,
            runs: Some(build::Runs {
                image: "ghcr.io/castellan-io/castellan:0.1.0-pg15".to_owned(),
                version: "15".to_owned(),
            }),
            version_condition: Assessment::new(true, "InCatalog", "PostgreSQL 15 runs it"),
            target_available: true,
            upgrade_job: upgrade::JobSeen::Absent,
            now: now(),
        }
    }

    /// `pod` running `image`, given PostgreSQL `major`.
    fn running(mut pod: Pod, image: &str, major: &str) -> Pod {
        let container: k8s_openapi::api::core::v1::Container = serde_json::from_value(json!({
            "name": "postgres",
            "image": image,
            "env": [{"name": "CASTELLAN_POSTGRES_VERSION", "value": major}],
        }))
        .expect("a container");
        if let Some(spec) = pod.spec.as_mut() {
            spec.containers = vec![container];
        }
        pod
    }

    #[test]
    fn a_minor_update_replaces_one_replica_at_a_time_and_a_lone_primary_in_place() {
        const OLD: &str = "ghcr.io/castellan-io/castellan:0.0.9-pg15";
        let (order, mut observed) = settled(3);
        let new = observed.runs.clone().expect("runs").image;
        for pod in observed.pods.values_mut() {
            *pod = running(pod.clone(), OLD, "15");
        }
        let update = |order: &ConvergeOrder, observed: &Observed| {
            plan(order, observed).update.map(|u| (u.pod, u.in_place))
        };
        // The highest-numbered replica first; every member is known to be outdated.
        assert_eq!(update(&order, &observed), Some(("db-3".to_owned(), false)));
        assert!(
            plan(&order, &observed)
                .converged
                .members
                .values()
                .all(|m| m.outdated)
        );
        // While it goes away, or is made again and not ready yet: nothing else.
        let mut going = observed.clone();
        if let Some(pod) = going.pods.get_mut(&3) {
            pod.metadata.deletion_timestamp = Some(now());
        }
        assert_eq!(update(&order, &going), None);
        let mut gone = observed.clone();
        gone.pods.remove(&3);
        assert_eq!(update(&order, &gone), None);
        assert_eq!(plan(&order, &gone).create.len(), 1, "made again");
        let mut back = observed.clone();
        back.pods
            .insert(3, running(pod(3, StartRole::Replica, false), &new, "15"));
        assert_eq!(update(&order, &back), None, "not ready yet");
        // Back and ready on the new image: the next replica.
        back.pods
            .insert(3, running(pod(3, StartRole::Replica, true), &new, "15"));
        assert_eq!(update(&order, &back), Some(("db-2".to_owned(), false)));
        // Every replica updated: the primary is not replaced here, the machine
        // switches over to an updated replica first.
        back.pods
            .insert(2, running(pod(2, StartRole::Replica, true), &new, "15"));
        let last = plan(&order, &back);
        assert_eq!(last.update, None);
        assert!(last.converged.members["db-1"].outdated);
        assert!(!last.converged.members["db-2"].outdated);
        // A pod of another major is no minor update's business.
        let mut other_major = observed.clone();
        for pod in other_major.pods.values_mut() {
            *pod = running(pod.clone(), OLD, "14");
        }
        assert_eq!(update(&order, &other_major), None);
        // A lone primary: restarted in place.
        let (order, mut observed) = settled(1);
        for pod in observed.pods.values_mut() {
            *pod = running(pod.clone(), OLD, "15");
        }
        assert_eq!(update(&order, &observed), Some(("db-1".to_owned(), true)));
    }

    /// `count` ready instances of a cluster that wants `count`, each with its view: db-1
    /// the primary, streaming to the others.
    fn settled(count: u32) -> (ConvergeOrder, Observed) {
        let replicas = i32::try_from(count).expect("a small count");
        let mut order = order(cluster(replicas, false, &[]));
        let standbys: Vec<String> = (2..=count).map(|n| format!("db-{n}")).collect();
        let names: Vec<&str> = standbys.iter().map(String::as_str).collect();
        order.views = std::iter::once(primary_view(&names, ""))
            .chain(names.iter().map(|name| view(name, &[])))
            .collect();
        (order, observed(pods(count)))
    }

    /// `order`'s cluster, with `status` as the API server has it.
    fn with_status(mut order: ConvergeOrder, status: DatabaseClusterStatus) -> ConvergeOrder {
        let mut cluster = (*order.cluster).clone();
        cluster.status = Some(status);
        order.cluster = Arc::new(cluster);
        order
    }

    fn condition_of<'a>(plan: &'a Plan, type_: &str) -> &'a Condition {
        plan.status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .unwrap_or_else(|| panic!("no {type_} condition"))
    }

    /// A condition's status, reason and message.
    fn said(condition: &Condition) -> (&str, &str, &str) {
        (&condition.status, &condition.reason, &condition.message)
    }

    fn phase_of(order: &ConvergeOrder, observed: &Observed) -> String {
        plan(order, observed).status.phase.unwrap_or_default()
    }

    fn failover(switchover: bool) -> Option<FailoverStatus> {
        Some(FailoverStatus {
            from: "db-1".into(),
            target: Some("db-2".into()),
            switchover,
            lease_withheld: true,
        })
    }

    #[test]
    fn a_settled_cluster_is_ready_and_needs_nothing() {
        let (order, observed) = settled(3);
        let plan = plan(&order, &observed);
        assert!(plan.relabel.is_empty());
        assert!(plan.create.is_empty());
        assert!(plan.remove.is_empty());
        assert!(plan.converged.ready);
        assert_eq!(plan.status.phase.as_deref(), Some("Ready"));
        assert_eq!(plan.status.ready_instances, Some(3));
        assert_eq!(plan.status.current_primary.as_deref(), Some("db-1"));
        assert_eq!(plan.status.target_primary, None);
        assert_eq!(plan.status.version.as_deref(), Some("15"));
        assert_eq!(plan.status.observed_generation, Some(1));
        assert_eq!(
            said(condition_of(&plan, "Ready")),
            ("True", "AllInstancesReady", "3 of 3 instances ready")
        );
        assert_eq!(condition_of(&plan, "Progressing").status, "False");
        assert_eq!(condition_of(&plan, "Degraded").status, "False");
        assert_eq!(condition_of(&plan, "PrimaryAvailable").reason, "Available");
        assert_eq!(condition_of(&plan, volumes::CONDITION).status, "True");
    }

    #[test]
    fn the_version_is_what_the_instances_run_not_what_the_spec_asks() {
        let (mut order, observed) = settled(3);
        let mut cluster = (*order.cluster).clone();
        cluster.spec.version = "17".into();
        order.cluster = Arc::new(cluster);
        assert_eq!(
            plan(&order, &observed).status.version.as_deref(),
            Some("15"),
            "the binaries carry 15.18"
        );
        // The primary's, else the lowest reported; the last written while none reports.
        order.views[0].release = Some("18.1".into());
        assert_eq!(
            plan(&order, &observed).status.version.as_deref(),
            Some("18")
        );
        order.views[0].release = None;
        order.views[1].release = Some("18.1".into());
        assert_eq!(
            plan(&order, &observed).status.version.as_deref(),
            Some("15")
        );
        for view in &mut order.views {
            view.release = None;
        }
        assert_eq!(plan(&order, &observed).status.version, None);
        let order = with_status(
            order,
            DatabaseClusterStatus {
                version: Some("15".into()),
                ..DatabaseClusterStatus::default()
            },
        );
        assert_eq!(
            plan(&order, &observed).status.version.as_deref(),
            Some("15")
        );
    }

    #[test]
    fn planning_again_from_the_written_status_writes_the_same_status() {
        let (order, observed) = settled(3);
        let first = plan(&order, &observed);
        let order = with_status(order, first.status.clone());
        let later = Observed {
            now: Time(Timestamp::from_second(3_000_000).expect("a time in range")),
            ..observed
        };
        assert_eq!(plan(&order, &later), first);
    }

    #[test]
    fn the_phase_names_the_most_pressing_state() {
        let (settled_order, settled_pods) = settled(3);
        let mut degraded = settled_order.clone();
        degraded.degraded = Some("the pass keeps failing".into());
        degraded.failover = failover(false);
        assert_eq!(phase_of(&degraded, &settled_pods), "Degraded");

        let mut switchover = settled_order.clone();
        switchover.failover = failover(true);
        switchover.primary_condition = Assessment::new(false, "Fenced", "fenced");
        assert_eq!(phase_of(&switchover, &settled_pods), "Switchover");

        let mut failing_over = settled_order.clone();
        failing_over.failover = failover(false);
        assert_eq!(phase_of(&failing_over, &settled_pods), "FailingOver");

        let mut fenced = settled_order.clone();
        fenced.primary_condition = Assessment::new(false, "Fenced", "db-1 is fenced");
        assert_eq!(phase_of(&fenced, &settled_pods), "Fenced");

        assert_eq!(phase_of(&settled_order, &settled_pods), "Ready");
        assert_eq!(
            phase_of(&settled_order, &observed(BTreeMap::new())),
            "Creating"
        );
        assert_eq!(phase_of(&settled_order, &observed(pods(2))), "Scaling");
        assert_eq!(phase_of(&settled_order, &observed(pods(4))), "Scaling");

        let mut starting = pods(3);
        starting.insert(3, pod(3, StartRole::Replica, false));
        assert_eq!(phase_of(&settled_order, &observed(starting)), "Progressing");
    }

    #[test]
    fn an_instance_is_ready_only_when_its_pod_and_its_own_view_say_so() {
        let (mut order, mut observed) = settled(4);
        // A stopped node: its pod still shows Ready, the instance cannot be reached.
        order.views[1] = unreachable("db-2", 1);
        // Started, not yet accepting connections in its role.
        order.views[2].ready = false;
        // Its view says ready, its pod does not (yet).
        observed.pods.insert(4, pod(4, StartRole::Replica, false));
        let plan = plan(&order, &observed);
        let ready: Vec<bool> = plan.status.instances.iter().map(|i| i.ready).collect();
        assert_eq!(ready, [true, false, false, false]);
        assert_eq!(plan.status.ready_instances, Some(1));
        assert!(!plan.converged.ready);
        assert_eq!(
            said(condition_of(&plan, "Ready")),
            ("False", "InstancesNotReady", "1 of 4 instances ready")
        );
        assert_eq!(condition_of(&plan, "Progressing").status, "True");
    }

    #[test]
    fn an_instance_without_a_view_is_ready_by_its_pod() {
        let (mut order, observed) = settled(2);
        order.views.clear();
        let plan = plan(&order, &observed);
        assert!(plan.converged.ready);
        assert_eq!(plan.status.ready_instances, Some(2));
    }

    #[test]
    fn only_the_primary_carries_the_primary_label() {
        let (order, mut observed) = settled(3);
        observed.pods.insert(1, pod(1, StartRole::Replica, true));
        observed.pods.insert(3, pod(3, StartRole::Primary, true));
        let plan = plan(&order, &observed);
        assert_eq!(
            plan.relabel,
            [
                ("db-1".to_owned(), StartRole::Primary),
                ("db-3".to_owned(), StartRole::Replica)
            ]
        );
    }

    #[test]
    fn nobody_carries_the_primary_label_during_a_failover() {
        let (mut order, observed) = settled(3);
        order.failover = failover(false);
        let plan = plan(&order, &observed);
        assert_eq!(plan.relabel, [("db-1".to_owned(), StartRole::Replica)]);
        assert_eq!(plan.status.target_primary.as_deref(), Some("db-2"));
        // One that no replica could carry out yet leaves the primary its label.
        order.failover = Some(FailoverStatus {
            target: None,
            lease_withheld: false,
            ..failover(false).expect("test value")
        });
        assert!(super::plan(&order, &observed).relabel.is_empty());
    }

    #[test]
    fn the_primary_is_the_ordered_one_else_the_written_one_else_the_first() {
        let (mut order, observed) = settled(3);
        order.primary = Some("db-2".into());
        let ordered = plan(&order, &observed);
        assert_eq!(ordered.status.current_primary.as_deref(), Some("db-2"));
        assert!(ordered.converged.members["db-2"].primary);
        assert!(!ordered.converged.members["db-1"].primary);

        order.primary = None;
        let written = with_status(
            order.clone(),
            DatabaseClusterStatus {
                current_primary: Some("db-3".into()),
                ..DatabaseClusterStatus::default()
            },
        );
        let from_status = plan(&written, &observed);
        assert_eq!(from_status.status.current_primary.as_deref(), Some("db-3"));

        let first = plan(&order, &observed);
        assert_eq!(first.status.current_primary.as_deref(), Some("db-1"));
    }

    #[test]
    fn a_new_cluster_creates_its_primary_alone_and_lets_it_initialise() {
        let order = order(cluster(3, false, &[]));
        let plan = plan(&order, &observed(BTreeMap::new()));
        assert_eq!(
            plan.create,
            [Creation {
                number: 1,
                role: StartRole::Primary,
                allow_initdb: true,
            }]
        );
        assert_eq!(plan.status.initialized, None);
        assert_eq!(plan.status.phase.as_deref(), Some("Creating"));
    }

    #[test]
    fn replicas_are_created_once_the_primary_is_ready() {
        let order = order(cluster(3, false, &[]));
        let starting = BTreeMap::from([(1, pod(1, StartRole::Primary, false))]);
        assert!(plan(&order, &observed(starting)).create.is_empty());

        let ready = BTreeMap::from([(1, pod(1, StartRole::Primary, true))]);
        let replica = |number| Creation {
            number,
            role: StartRole::Replica,
            allow_initdb: false,
        };
        assert_eq!(
            plan(&order, &observed(ready)).create,
            [replica(2), replica(3)]
        );
    }

    #[test]
    fn a_cluster_that_had_data_never_initialises_an_empty_volume_again() {
        // The primary's pod is gone; the cluster was initialised long ago.
        let (order, mut observed) = settled(3);
        observed.pods.remove(&1);
        let written = with_status(
            order.clone(),
            DatabaseClusterStatus {
                initialized: Some(true),
                ..DatabaseClusterStatus::default()
            },
        );
        let mut without_views = written.clone();
        without_views.views.clear();
        let recreated = Creation {
            number: 1,
            role: StartRole::Primary,
            allow_initdb: false,
        };
        assert_eq!(plan(&without_views, &observed).create, [recreated]);
        // Not yet written, but an instance reports a role: it has data.
        assert_eq!(plan(&order, &observed).create, [recreated]);
    }

    #[test]
    fn initialized_is_recorded_once_an_instance_reports_a_role() {
        let mut order = order(cluster(1, false, &[]));
        let starting = BTreeMap::from([(1, pod(1, StartRole::Primary, false))]);
        order.views = vec![InstanceView {
            role: None,
            ..view("db-1", &[])
        }];
        assert_eq!(
            plan(&order, &observed(starting.clone())).status.initialized,
            None
        );
        order.views = vec![primary_view(&[], "")];
        assert_eq!(
            plan(&order, &observed(starting)).status.initialized,
            Some(true)
        );
    }

    #[test]
    fn once_initialized_every_unmarked_pod_is_marked_once() {
        let mut order = order(cluster(2, false, &[]));
        let mut marked = pod(2, StartRole::Replica, false);
        marked
            .annotations_mut()
            .insert(build::INITIALIZED_ANNOTATION.into(), "true".into());
        let pods = BTreeMap::from([(1, pod(1, StartRole::Primary, false)), (2, marked)]);
        // A new cluster: nothing has data yet, nothing is marked.
        order.views = vec![InstanceView {
            role: None,
            ..view("db-1", &[])
        }];
        assert!(
            plan(&order, &observed(pods.clone()))
                .mark_initialized
                .is_empty()
        );
        // The first instance has data: the pod that lacks the mark gets it, the
        // other already has it.
        order.views = vec![primary_view(&[], "")];
        assert_eq!(plan(&order, &observed(pods)).mark_initialized, ["db-1"]);
    }

    #[test]
    fn scale_down_removes_the_cleared_surplus_instances_highest_first() {
        let (mut order, observed) = settled(3);
        order.cluster = cluster(1, false, &[]);
        order.remove = vec!["db-2".into(), "db-3".into()];
        let plan = plan(&order, &observed);
        assert_eq!(plan.remove, ["db-3", "db-2"]);
        assert_eq!(plan.converged.members.keys().collect::<Vec<_>>(), ["db-1"]);
        assert!(!plan.converged.ready);
        assert_eq!(plan.status.phase.as_deref(), Some("Scaling"));
        // Status still shows them: they are gone only once the deletes are done.
        assert_eq!(plan.status.instances.len(), 3);
    }

    #[test]
    fn scale_down_keeps_what_the_machine_did_not_clear() {
        let (mut order, observed) = settled(3);
        order.cluster = cluster(2, false, &[]);
        order.remove = Vec::new();
        assert!(plan(&order, &observed).remove.is_empty());
        // An instance within the desired count is never surplus.
        order.remove = vec!["db-2".into()];
        assert!(plan(&order, &observed).remove.is_empty());
    }

    #[test]
    fn scale_down_never_removes_the_primary() {
        let (mut order, observed) = settled(3);
        order.cluster = cluster(1, false, &[]);
        order.primary = Some("db-3".into());
        order.remove = vec!["db-2".into(), "db-3".into()];
        let plan = plan(&order, &observed);
        assert_eq!(plan.remove, ["db-2"]);
        assert!(plan.converged.members.contains_key("db-3"));
    }

    #[test]
    fn members_are_the_instances_after_the_pass_created_ones_included() {
        let order = order(cluster(3, false, &[]));
        let plan = plan(&order, &observed(pods(1)));
        let found = &plan.converged.members["db-1"];
        assert_eq!(
            found.address.as_deref(),
            Some("db.default.instance.castellan.io@10.0.0.1:8000")
        );
        assert!(found.primary);
        for name in ["db-2", "db-3"] {
            let created = &plan.converged.members[name];
            assert_eq!(created.address, None);
            assert!(!created.primary);
            assert!(created.node_ready);
            assert!(!created.cordoned);
        }
        assert_eq!(plan.converged.members["db-3"].number, 3);
    }

    #[test]
    fn members_on_a_draining_node_are_cordoned_and_on_a_lost_node_not_ready() {
        let (order, mut observed) = settled(4);
        let health = |ready, cordoned| NodeHealth { ready, cordoned };
        observed.nodes = BTreeMap::from([
            ("node-1".to_owned(), health(true, true)),
            ("node-2".to_owned(), health(false, true)),
            ("node-3".to_owned(), health(false, false)),
        ]);
        let members = plan(&order, &observed).converged.members;
        let of = |name: &str| (members[name].cordoned, members[name].node_ready);
        // Cordoned and working: a drain.
        assert_eq!(of("db-1"), (true, true));
        // A lost node is failover's business, cordoned or not.
        assert_eq!(of("db-2"), (false, false));
        assert_eq!(of("db-3"), (false, false));
        // A node the store does not know is not taken for a lost one.
        assert_eq!(of("db-4"), (false, true));
    }

    #[test]
    fn node_health_is_the_ready_condition_and_the_cordon() {
        let node = |status: &str, unschedulable: Option<bool>| -> Node {
            serde_json::from_value(json!({
                "metadata": {"name": "node-1"},
                "spec": {"unschedulable": unschedulable},
                "status": {"conditions": [
                    {"type": "MemoryPressure", "status": "False"},
                    {"type": "Ready", "status": status},
                ]},
            }))
            .expect("a valid node")
        };
        let of = |node: Node| {
            let health = NodeHealth::of(&node);
            (health.ready, health.cordoned, health.draining())
        };
        assert_eq!(of(node("True", None)), (true, false, false));
        assert_eq!(of(node("True", Some(true))), (true, true, true));
        assert_eq!(of(node("Unknown", Some(true))), (false, true, false));
        assert_eq!(of(Node::default()), (false, false, false));
    }

    #[test]
    fn conditions_keep_their_transition_time_while_their_status_holds() {
        let (order, observed) = settled(3);
        let mut written = plan(&order, &observed).status;
        for condition in &mut written.conditions {
            condition.last_transition_time = earlier();
        }
        let order = with_status(order, written);
        let held = plan(&order, &observed);
        assert!(
            held.status
                .conditions
                .iter()
                .all(|c| c.last_transition_time == earlier())
        );

        let mut not_ready = observed.clone();
        not_ready.pods.insert(3, pod(3, StartRole::Replica, false));
        let changed = plan(&order, &not_ready);
        assert_eq!(condition_of(&changed, "Ready").last_transition_time, now());
        assert_eq!(
            condition_of(&changed, "Progressing").last_transition_time,
            now()
        );
        assert_eq!(
            condition_of(&changed, "Degraded").last_transition_time,
            earlier()
        );
        assert_eq!(
            condition_of(&changed, "PrimaryAvailable").last_transition_time,
            earlier()
        );
    }

    #[test]
    fn degraded_says_why_while_the_actors_keep_failing() {
        let cluster = cluster(1, false, &[]);
        let failing = degraded_condition(&cluster, Some("the pass failed 3 times"), &now());
        assert_eq!(
            said(&failing),
            ("True", "ReconcileFailing", "the pass failed 3 times")
        );
        assert_eq!(failing.last_transition_time, now());
        assert_eq!(
            said(&degraded_condition(&cluster, None, &now())),
            ("False", "Healthy", "reconciling works")
        );
    }

    #[test]
    fn a_brought_server_certificate_is_reported_only_while_named() {
        let (order, mut observed) = settled(2);
        assert!(
            plan(&order, &observed)
                .status
                .conditions
                .iter()
                .all(|c| c.type_ != SERVER_CERTIFICATE)
        );
        observed.server_certificate = Some(Assessment::new(
            false,
            "CertificateRefused",
            "the Secret does not exist",
        ));
        let plan = plan(&order, &observed);
        assert_eq!(
            said(condition_of(&plan, SERVER_CERTIFICATE)),
            ("False", "CertificateRefused", "the Secret does not exist")
        );
    }

    #[test]
    fn a_refused_certificate_is_warned_about_once_per_reason() {
        let condition = |status: &str, message: &str| Condition {
            type_: SERVER_CERTIFICATE.into(),
            status: status.into(),
            reason: "CertificateRefused".into(),
            message: message.into(),
            last_transition_time: now(),
            observed_generation: None,
        };
        let missing = condition("False", "the Secret does not exist");
        let served = condition("True", "serving");
        assert!(certificate_warning(None, &missing).is_some());
        assert!(certificate_warning(Some(&served), &missing).is_some());
        assert!(certificate_warning(Some(&missing), &missing).is_none());
        let wrong = condition("False", "it names another server");
        let note = certificate_warning(Some(&missing), &wrong).expect("a new reason");
        assert!(note.warning && note.message == "it names another server");
        assert!(certificate_warning(Some(&missing), &served).is_none());
    }

    #[test]
    fn synchronous_replication_is_reported_only_when_assessed() {
        let (mut order, observed) = settled(2);
        assert!(
            plan(&order, &observed)
                .status
                .conditions
                .iter()
                .all(|c| c.type_ != "SynchronousReplication")
        );
        order.synchronous_condition = Some(Assessment::new(
            false,
            "QuorumNotStreaming",
            "no standby streams",
        ));
        let plan = plan(&order, &observed);
        assert_eq!(
            said(condition_of(&plan, "SynchronousReplication")),
            ("False", "QuorumNotStreaming", "no standby streams")
        );
    }

    #[test]
    fn status_rows_come_from_the_views_and_the_primary_reports_lag_and_slots() {
        let (mut order, mut observed) = settled(3);
        order.views[0].standbys[0].lag_bytes = Some(4096);
        order.views[0].slots[0].retained_bytes = Some(8192);
        order.views[0].timeline = Some(2);
        // db-3 cannot be reached: its row falls back to its pod's label.
        order.views[2] = unreachable("db-3", 1);
        observed.pods.insert(3, pod(3, StartRole::Primary, true));
        let plan = plan(&order, &observed);
        let [primary, streaming, lost] = &plan.status.instances[..] else {
            panic!("one row per pod, in instance order");
        };
        assert_eq!(primary.name, "db-1");
        assert_eq!(primary.role.as_deref(), Some("primary"));
        assert_eq!(primary.timeline, Some(2));
        assert_eq!(primary.node.as_deref(), Some("node-1"));
        assert_eq!(primary.lsn.as_deref(), Some("0/3000000"));
        assert_eq!(streaming.role.as_deref(), Some("replica"));
        assert_eq!(streaming.lag_bytes, Some(4096));
        assert_eq!(lost.name, "db-3");
        assert_eq!(lost.role.as_deref(), Some("primary"));
        assert_eq!(lost.lsn, None);
        assert_eq!(plan.status.replication_slots.len(), 2);
        assert_eq!(
            plan.status.replication_slots[0].retained_wal_bytes,
            Some(8192)
        );
    }

    #[test]
    fn positions_and_lag_alone_are_written_only_when_due() {
        let (order, observed) = settled(2);
        let shown = plan(&order, &observed).status;
        let order = with_status(order, shown.clone());
        // Only positions and lag moved: status as shown, nothing to write.
        let mut moved = ConvergeOrder {
            refresh_progress: false,
            ..order.clone()
        };
        moved.views[0].lsn = Lsn::parse("0/4000000");
        moved.views[0].standbys[0].lag_bytes = Some(512);
        assert_eq!(plan(&moved, &observed).status, shown);
        // Due: written as viewed now.
        let due = ConvergeOrder {
            refresh_progress: true,
            ..moved.clone()
        };
        let status = plan(&due, &observed).status;
        assert_eq!(status.instances[0].lsn.as_deref(), Some("0/4000000"));
        assert_eq!(status.instances[1].lag_bytes, Some(512));
        // Anything else changed: status is written anyway, and as viewed now.
        let mut changed = moved;
        changed.views[0].timeline = Some(2);
        let status = plan(&changed, &observed).status;
        assert_eq!(status.instances[0].timeline, Some(2));
        assert_eq!(status.instances[0].lsn.as_deref(), Some("0/4000000"));
        // A position that appears is no mere move either.
        let mut appeared = ConvergeOrder {
            refresh_progress: false,
            ..order
        };
        appeared.views[0].standbys[0].lag_bytes = None;
        let without = with_status(appeared.clone(), plan(&appeared, &observed).status);
        let mut back = without;
        back.views[0].standbys[0].lag_bytes = Some(64);
        assert_eq!(
            plan(&back, &observed).status.instances[1].lag_bytes,
            Some(64)
        );
    }

    /// Bound claim `db-<n>`, on which its node's agent wrote `health` (none: not on
    /// a Castellan pool).
    fn claim(n: u32, health: Option<&str>) -> PersistentVolumeClaim {
        let annotations: BTreeMap<&str, &str> = health
            .map(|health| (castellan_crds::storage_pool::POOL_HEALTH_ANNOTATION, health))
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": format!("db-{n}"), "annotations": annotations},
            "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"]},
            "status": {"phase": "Bound"},
        }))
        .expect("a valid claim")
    }

    #[test]
    fn each_row_has_the_health_of_the_pool_under_its_volume() {
        let (order, mut observed) = settled(3);
        observed.claims = vec![
            claim(1, Some("Healthy")),
            claim(2, Some("Degraded")),
            claim(3, None),
        ];
        let rows = plan(&order, &observed).status.instances;
        let healths: Vec<(&str, Option<&str>)> = rows
            .iter()
            .map(|row| (row.name.as_str(), row.volume_health.as_deref()))
            .collect();
        assert_eq!(
            healths,
            [
                ("db-1", Some("Healthy")),
                ("db-2", Some("Degraded")),
                ("db-3", None),
            ]
        );
    }

    #[test]
    fn a_volume_turning_unhealthy_is_written_at_once_not_held_as_a_move() {
        let (order, mut observed) = settled(2);
        observed.claims = vec![claim(1, Some("Healthy")), claim(2, Some("Healthy"))];
        let shown = plan(&order, &observed).status;
        let mut between_refreshes = with_status(order, shown.clone());
        between_refreshes.refresh_progress = false;
        between_refreshes.views[0].lsn = Lsn::parse("0/4000000");
        assert_eq!(
            plan(&between_refreshes, &observed).status,
            shown,
            "a position alone waits for the refresh"
        );
        observed.claims[1] = claim(2, Some("Degraded"));
        let status = plan(&between_refreshes, &observed).status;
        assert_eq!(
            status.instances[1].volume_health.as_deref(),
            Some("Degraded")
        );
        assert_eq!(
            status.instances[0].lsn.as_deref(),
            Some("0/4000000"),
            "written as viewed now"
        );
    }

    #[test]
    fn only_positions_lag_and_kept_wal_count_as_a_move() {
        let (order, observed) = settled(2);
        let shown = plan(&order, &observed).status;
        let mut moved = shown.clone();
        moved.instances[0].lsn = Some("0/4000000".into());
        moved.instances[1].lag_bytes = Some(512);
        assert_eq!(unless_only_moved(&shown, moved.clone()), shown);
        // The row's volume health alone, with no condition changing beside it: still
        // written, positions and all.
        let mut told = moved;
        told.instances[1].volume_health = Some("Failed".into());
        assert_eq!(unless_only_moved(&shown, told.clone()), told);
    }

    #[test]
    fn instance_numbers_come_from_the_pod_names() {
        let cluster = cluster(1, false, &[]);
        assert_eq!(
            instance_number(&cluster, &pod(7, StartRole::Replica, true)),
            Some(7)
        );
        let other: Pod =
            serde_json::from_value(json!({"metadata": {"name": "dbx-1"}})).expect("a valid pod");
        assert_eq!(instance_number(&cluster, &other), None);
    }
}
