//! One pass over a `DatabaseCluster`, run by its `ClusterActor`'s shell (the `Converge`
//! effect):
//! make the owned objects match the spec, remove the surplus instances the machine
//! cleared, then write status from the instances' latest views. Idempotent: a second
//! pass with nothing changed creates nothing and writes the same status.

use std::collections::{BTreeMap, BTreeSet};

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::{
    DatabaseClusterStatus, InstanceStatus, ReplicationSlotStatus,
};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::state::{Assessment, ConvergeOrder, Converged, Member, Note};
use super::volumes;
use crate::instance_api::RunningRole;
use crate::operator::build::{self, CLUSTER_LABEL, INSTANCE_API_PORT, ROLE_LABEL, StartRole};
use crate::operator::context::Shared;
use crate::operator::endpoints::Metrics;
use crate::operator::instance_client;

pub const MANAGER: &str = "castellan-operator";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} for DatabaseCluster {cluster}: {source}")]
    Kube {
        what: String,
        cluster: String,
        source: kube::Error,
    },
    #[error("generating a password: {0}")]
    Password(std::io::Error),
    #[error(transparent)]
    Certificates(#[from] crate::operator::certificates::Error),
}

fn kube_error(
    what: impl Into<String>,
    cluster: &DatabaseCluster,
) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    let cluster = format!(
        "{}/{}",
        cluster.namespace().unwrap_or_default(),
        cluster.name_any()
    );
    move |source| Error::Kube {
        what,
        cluster,
        source,
    }
}

/// A random password of letters and digits (no characters that need quoting in a URI
/// or a connection string).
fn password() -> Result<String, Error> {
    use std::io::Read;
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789";
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(Error::Password)?;
    Ok(bytes
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect())
}

/// The instance number of a pod named `<cluster>-<n>`.
fn instance_number(cluster: &DatabaseCluster, pod: &Pod) -> Option<u32> {
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

/// The StorageClasses that `claims` waiting for a volume name and that do not exist,
/// for `VolumesBound`. A lookup that fails counts as "exists": a missing permission to
/// read StorageClasses must not fail the whole pass.
async fn missing_storage_classes(
    client: &Client,
    claims: &[PersistentVolumeClaim],
) -> BTreeSet<String> {
    let classes: Api<StorageClass> = Api::all(client.clone());
    let mut missing = BTreeSet::new();
    for class in volumes::classes_of_unbound(claims) {
        match classes.get_opt(&class).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                missing.insert(class);
            }
            Err(error) => tracing::warn!(%class, %error, "could not read StorageClass"),
        }
    }
    missing
}

/// The condition `type_` as the API server has it now. `None` when it cannot be read.
async fn written_condition(
    client: &Client,
    cluster: &DatabaseCluster,
    type_: &str,
) -> Option<Condition> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), &namespace);
    match clusters.get_status(&cluster.name_any()).await {
        Ok(fresh) => fresh
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == type_),
        Err(error) => {
            tracing::warn!(cluster = %cluster.name_any(), %error, "could not read the cluster's status");
            None
        }
    }
}

pub async fn run(order: &ConvergeOrder, context: &Shared) -> Result<Converged, Error> {
    let cluster = order.cluster.as_ref();
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let client = &context.client;
    let name = cluster.name_any();
    let apply = PatchParams::apply(MANAGER).force();

    // Credentials: made once, never rewritten. Passwords are generated only when a
    // Secret is missing.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let mut missing = Vec::new();
    for what in ["superuser", "replication", "app"] {
        let secret_name = build::secret_name(cluster, what);
        let found = secrets
            .get_opt(&secret_name)
            .await
            .map_err(kube_error(format!("reading Secret {secret_name}"), cluster))?;
        if found.is_none() {
            missing.push(secret_name);
        }
    }
    if !missing.is_empty() {
        for secret in build::secrets(cluster, &password()?, &password()?, &password()?) {
            let secret_name = secret.name_any();
            if !missing.contains(&secret_name) {
                continue;
            }
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(kube_error(
                    format!("creating Secret {secret_name}"),
                    cluster,
                ))?;
            tracing::info!(cluster = %name, secret = %secret_name, "created credentials");
            context
                .record(
                    cluster,
                    Note::normal(
                        "CreatedCredentials",
                        format!("created Secret {secret_name}"),
                    ),
                )
                .await;
        }
    }

    // The instance API's certificate, before any pod mounts it.
    if let Some(note) =
        crate::operator::certificates::ensure_instance_tls(client, cluster, &context.authority)
            .await?
    {
        context.record(cluster, note).await;
    }

    // Replicas follow the primary through the -rw Service's address, so a failover
    // moves them without touching their configuration. The address comes back with the
    // applied Service.
    let services: Api<Service> = Api::namespaced(client.clone(), &namespace);
    let rw_name = build::service_name(cluster, "rw");
    let mut upstream = String::new();
    for service in build::services(cluster) {
        let service_name = service.name_any();
        let applied = services
            .patch(&service_name, &apply, &Patch::Apply(&service))
            .await
            .map_err(kube_error(
                format!("applying Service {service_name}"),
                cluster,
            ))?;
        if service_name == rw_name {
            upstream = applied
                .spec
                .and_then(|spec| spec.cluster_ip)
                .unwrap_or_default();
        }
    }

    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &namespace);
    let wanted = build::disruption_budgets(cluster);
    // Scaled down to one instance: the replicas' budget (named after the cluster) goes.
    if !wanted.iter().any(|budget| budget.name_any() == name) {
        match budgets.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            // Already gone: the usual case.
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => return Err(kube_error("deleting the replicas' budget", cluster)(error)),
        }
    }
    for budget in wanted {
        let budget_name = budget.name_any();
        budgets
            .patch(&budget_name, &apply, &Patch::Apply(&budget))
            .await
            .map_err(kube_error(
                format!("applying PodDisruptionBudget {budget_name}"),
                cluster,
            ))?;
    }

    let desired = u32::try_from(cluster.spec.replicas.max(1)).unwrap_or(1);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
    let mut applied_claims = Vec::new();
    for n in 1..=desired {
        let claim = build::volume_claim(cluster, n);
        let claim_name = claim.name_any();
        let applied = claims
            .patch(&claim_name, &apply, &Patch::Apply(&claim))
            .await
            .map_err(kube_error(
                format!("applying volume claim {claim_name}"),
                cluster,
            ))?;
        applied_claims.push(applied);
    }

    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let selector = format!("{CLUSTER_LABEL}={name}");
    let existing: BTreeMap<u32, Pod> = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(kube_error("listing pods", cluster))?
        .items
        .into_iter()
        .filter_map(|pod| Some((instance_number(cluster, &pod)?, pod)))
        .collect();

    // The primary is the one the machine decided on, else the one status names; a new
    // cluster's first instance.
    let primary = order
        .primary
        .as_deref()
        .or_else(|| {
            cluster
                .status
                .as_ref()
                .and_then(|s| s.current_primary.as_deref())
        })
        .and_then(|p| p.strip_prefix(&format!("{name}-")))
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(1);
    let primary_ready = existing.get(&primary).is_some_and(pod_ready);
    // Once any instance has data the cluster has had data: from then on no empty
    // volume is initialised again.
    let initialized = cluster
        .status
        .as_ref()
        .and_then(|s| s.initialized)
        .unwrap_or(false)
        || order.views.iter().any(|v| v.role.is_some());

    // -rw follows the primary's label: only the primary has it, and nobody while a
    // failover replaces it (the old primary leaves -rw at once).
    for (n, pod) in &existing {
        let wanted = if *n == primary && order.failover.is_none() {
            StartRole::Primary
        } else {
            StartRole::Replica
        };
        if pod.labels().get(ROLE_LABEL).map(String::as_str) != Some(wanted.as_str()) {
            let pod_name = pod.name_any();
            let patch = json!({"metadata": {"labels": {ROLE_LABEL: wanted.as_str()}}});
            pods.patch(&pod_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(kube_error(format!("labelling pod {pod_name}"), cluster))?;
            tracing::info!(cluster = %name, pod = %pod_name, role = wanted.as_str(), "relabelled instance");
        }
    }

    let mut created = BTreeMap::new();
    for n in 1..=desired {
        if existing.contains_key(&n) {
            continue;
        }
        let role = if n == primary {
            StartRole::Primary
        } else {
            StartRole::Replica
        };
        // A replica copies the primary: wait until there is a ready one.
        if role == StartRole::Replica && !primary_ready {
            continue;
        }
        // A primary starts asynchronous; synchronous standbys are named once they
        // stream (below), or its own bootstrap writes would wait for replicas that
        // cannot exist before it is ready.
        let allow_initdb = role == StartRole::Primary && !initialized;
        let pod = build::pod(cluster, n, role, &upstream, allow_initdb, &context.settings);
        let pod_name = pod.name_any();
        pods.create(&PostParams::default(), &pod)
            .await
            .map_err(kube_error(format!("creating pod {pod_name}"), cluster))?;
        Metrics::count(&context.metrics.instances_created);
        tracing::info!(cluster = %name, pod = %pod_name, role = role.as_str(), "created instance");
        context
            .record(
                cluster,
                Note::normal(
                    "CreatedInstance",
                    format!("created {pod_name} as {}", role.as_str()),
                )
                .about(&pod_name),
            )
            .await;
        created.insert(n, pod_name);
    }

    // Scale down: the surplus instances the machine cleared (never the primary; a sync
    // standby only once the primary no longer waits for it).
    let mut removed = Vec::new();
    for (n, pod) in existing.iter().rev() {
        let pod_name = pod.name_any();
        if *n > desired && *n != primary && order.remove.contains(&pod_name) {
            pods.delete(&pod_name, &DeleteParams::default())
                .await
                .map_err(kube_error(format!("deleting pod {pod_name}"), cluster))?;
            claims
                .delete(&pod_name, &DeleteParams::default())
                .await
                .map_err(kube_error(
                    format!("deleting volume claim {pod_name}"),
                    cluster,
                ))?;
            tracing::info!(cluster = %name, pod = %pod_name, "removed instance (scale down)");
            context
                .record(
                    cluster,
                    Note::normal(
                        "RemovedInstance",
                        format!("removed {pod_name} (scale down)"),
                    )
                    .about(&pod_name),
                )
                .await;
            removed.push(*n);
        }
    }

    // Status from the instances' latest views (their actors read them): the role is what
    // each instance manager reports, not what its labels say.
    let primary_view = order
        .views
        .iter()
        .find(|v| v.role == Some(RunningRole::Primary) && v.reachable && v.running);
    let instances: Vec<InstanceStatus> = existing
        .values()
        .map(|pod| {
            let pod_name = pod.name_any();
            let view = order
                .views
                .iter()
                .find(|v| v.name == pod_name && v.reachable);
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
                ready: pod_ready(pod)
                    && order
                        .views
                        .iter()
                        .find(|v| v.name == pod_name)
                        .is_none_or(|v| v.ready),
                lsn: view.and_then(|v| v.lsn).map(|lsn| lsn.to_string()),
                lag_seconds: view.and_then(|v| v.lag_seconds),
                lag_bytes: primary_view.and_then(|p| {
                    p.standbys
                        .iter()
                        .find(|s| s.name == pod_name)
                        .and_then(|s| s.lag_bytes)
                }),
                name: pod_name,
            }
        })
        .collect();
    let replication_slots: Vec<ReplicationSlotStatus> = order
        .views
        .iter()
        .find(|v| v.name == build::instance_name(cluster, primary) && v.reachable)
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
        .unwrap_or_default();

    let ready = i32::try_from(instances.iter().filter(|i| i.ready).count()).unwrap_or(i32::MAX);
    let remaining = existing.len() - removed.len();
    let all_ready = ready == cluster.spec.replicas
        && remaining == desired as usize
        && existing.len() == desired as usize;
    let phase = if order.degraded.is_some() {
        "Degraded"
    } else if order.failover.as_ref().is_some_and(|f| f.switchover) {
        "Switchover"
    } else if order.failover.is_some() {
        "FailingOver"
    } else if order.primary_condition.reason == "Fenced" {
        "Fenced"
    } else if all_ready {
        "Ready"
    } else if existing.is_empty() {
        "Creating"
    } else if existing.len() != desired as usize {
        "Scaling"
    } else {
        "Progressing"
    };
    let previous = cluster.status.clone().unwrap_or_default();
    let previous_volumes = previous
        .conditions
        .iter()
        .find(|c| c.type_ == volumes::CONDITION);
    let volumes_bound = volumes::condition(
        &applied_claims,
        existing.values(),
        &missing_storage_classes(client, &applied_claims).await,
        previous_volumes,
        cluster.metadata.generation,
        Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let mut volumes_warning = volumes::warning(previous_volumes, &volumes_bound);
    if volumes_warning.is_some() {
        // The cluster this pass started from may predate the status the previous pass
        // wrote (the controller's cache lags the write): decide again on a fresh read,
        // so that the Warning is recorded once, not once per pass until the cache catches up.
        let written = written_condition(client, cluster, volumes::CONDITION).await;
        volumes_warning = volumes::warning(written.as_ref(), &volumes_bound);
    }
    if let Some(note) = volumes_warning {
        context.record(cluster, note).await;
    }
    let status = DatabaseClusterStatus {
        observed_generation: cluster.metadata.generation,
        conditions: vec![
            condition(
                cluster,
                "Ready",
                all_ready,
                if all_ready {
                    "AllInstancesReady"
                } else {
                    "InstancesNotReady"
                },
                format!("{ready} of {} instances ready", cluster.spec.replicas),
            ),
            condition(
                cluster,
                "Progressing",
                !all_ready,
                if all_ready { "Settled" } else { "Reconciling" },
                if all_ready {
                    "nothing to do".to_owned()
                } else {
                    "creating, removing or starting instances".to_owned()
                },
            ),
            degraded_condition(cluster, order.degraded.as_deref()),
            assessed(cluster, "PrimaryAvailable", &order.primary_condition),
            volumes_bound,
        ]
        .into_iter()
        .chain(
            order
                .synchronous_condition
                .as_ref()
                .map(|a| assessed(cluster, "SynchronousReplication", a)),
        )
        .collect(),
        phase: Some(phase.to_owned()),
        current_primary: Some(build::instance_name(cluster, primary)),
        target_primary: order.failover.as_ref().and_then(|f| f.target.clone()),
        initialized: initialized.then_some(true),
        replication_slots,
        ready_instances: Some(ready),
        instances,
        version: Some(cluster.spec.version.clone()),
        ..previous.clone()
    };
    if cluster.status.as_ref() != Some(&status) {
        write_status(client, cluster, &json!({ "status": status })).await?;
    }

    // Nodes being drained: the primary is switched over before its pod is evicted.
    let nodes: Api<Node> = Api::all(client.clone());
    let mut cordoned = std::collections::BTreeSet::new();
    let node_names: std::collections::BTreeSet<&String> = existing
        .values()
        .filter_map(|pod| pod.spec.as_ref()?.node_name.as_ref())
        .collect();
    for node_name in node_names {
        let node = nodes
            .get_opt(node_name)
            .await
            .map_err(kube_error(format!("reading node {node_name}"), cluster))?;
        // A drain cordons a node that works; a lost node is failover's business, and
        // a switchover away from it could not stop its primary cleanly anyway.
        let draining = node.is_some_and(|n| {
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            ready && n.spec.and_then(|s| s.unschedulable).unwrap_or(false)
        });
        if draining {
            cordoned.insert(node_name.clone());
        }
    }
    let server_name = crate::pki::server_name(&name, &namespace);
    let mut members: BTreeMap<String, Member> = existing
        .iter()
        .filter(|(n, _)| !removed.contains(n))
        .map(|(n, pod)| {
            let address = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_ref())
                .map(|ip| instance_client::address(&server_name, ip, INSTANCE_API_PORT));
            let cordoned = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some_and(|node| cordoned.contains(node));
            let member = Member {
                number: *n,
                address,
                primary: *n == primary,
                cordoned,
            };
            (pod.name_any(), member)
        })
        .collect();
    for (n, pod_name) in created {
        members.insert(
            pod_name,
            Member {
                number: n,
                address: None,
                primary: n == primary,
                cordoned: false,
            },
        );
    }
    Ok(Converged {
        members,
        ready: all_ready,
    })
}

/// A condition the machine assessed.
fn assessed(cluster: &DatabaseCluster, type_: &str, assessment: &Assessment) -> Condition {
    condition(
        cluster,
        type_,
        assessment.status,
        assessment.reason,
        assessment.message.clone(),
    )
}

/// A condition, keeping its transition time when its status did not change.
fn condition(
    cluster: &DatabaseCluster,
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
) -> Condition {
    let status = if status { "True" } else { "False" }.to_owned();
    let unchanged = cluster
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status);
    Condition {
        type_: type_.to_owned(),
        status,
        reason: reason.to_owned(),
        message,
        observed_generation: cluster.metadata.generation,
        last_transition_time: unchanged
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now())),
    }
}

/// `Degraded`: true with the reason while the cluster's actors keep failing.
pub fn degraded_condition(cluster: &DatabaseCluster, reason: Option<&str>) -> Condition {
    match reason {
        Some(reason) => condition(
            cluster,
            "Degraded",
            true,
            "ReconcileFailing",
            reason.to_owned(),
        ),
        None => condition(
            cluster,
            "Degraded",
            false,
            "Healthy",
            "reconciling works".to_owned(),
        ),
    }
}

/// Server-side apply of a status patch (`{"status": …}`) by `manager`.
pub async fn write_status(
    client: &Client,
    cluster: &DatabaseCluster,
    patch: &serde_json::Value,
) -> Result<(), Error> {
    write_status_as(client, cluster, patch, MANAGER).await
}

pub async fn write_status_as(
    client: &Client,
    cluster: &DatabaseCluster,
    patch: &serde_json::Value,
    manager: &str,
) -> Result<(), Error> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), &namespace);
    let mut patch = patch.clone();
    patch["apiVersion"] = json!("castellan.io/v1alpha1");
    patch["kind"] = json!("DatabaseCluster");
    clusters
        .patch_status(
            &cluster.name_any(),
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(kube_error("writing status", cluster))?;
    Ok(())
}
