//! One pass of the `DatabaseCluster` controller: make the owned objects match the
//! spec, then write what was observed to status. Idempotent: a second pass with
//! nothing changed creates nothing and writes the same status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::{DatabaseClusterStatus, InstanceStatus};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::build::{self, CLUSTER_LABEL, INSTANCE_API_PORT, ROLE_LABEL, StartRole};
use super::endpoints::Metrics;
use super::instance_client;

const MANAGER: &str = "castellan-operator";

pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub settings: build::Settings,
}

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

pub async fn reconcile(
    cluster: Arc<DatabaseCluster>,
    context: Arc<Context>,
) -> Result<Action, Error> {
    Metrics::count(&context.metrics.reconciles);
    let outcome = reconcile_cluster(&cluster, &context).await;
    if outcome.is_err() {
        Metrics::count(&context.metrics.reconcile_errors);
    }
    outcome
}

async fn reconcile_cluster(cluster: &DatabaseCluster, context: &Context) -> Result<Action, Error> {
    if cluster.metadata.deletion_timestamp.is_some() {
        // Owner references delete everything the cluster owns.
        return Ok(Action::await_change());
    }
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
        }
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
    for n in 1..=desired {
        let claim = build::volume_claim(cluster, n);
        let claim_name = claim.name_any();
        claims
            .patch(&claim_name, &apply, &Patch::Apply(&claim))
            .await
            .map_err(kube_error(
                format!("applying volume claim {claim_name}"),
                cluster,
            ))?;
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

    // The primary is the one status names; a new cluster's first instance.
    let primary = cluster
        .status
        .as_ref()
        .and_then(|s| s.current_primary.as_deref())
        .and_then(|p| p.strip_prefix(&format!("{name}-")))
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(1);
    let primary_ready = existing.get(&primary).is_some_and(pod_ready);

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
        let pod = build::pod(cluster, n, role, &upstream, "", &context.settings);
        let pod_name = pod.name_any();
        pods.create(&PostParams::default(), &pod)
            .await
            .map_err(kube_error(format!("creating pod {pod_name}"), cluster))?;
        Metrics::count(&context.metrics.instances_created);
        tracing::info!(cluster = %name, pod = %pod_name, role = role.as_str(), "created instance");
    }

    // Scale down: the highest-numbered replicas go first, never the primary.
    for (n, pod) in existing.iter().rev() {
        if *n > desired && *n != primary {
            let pod_name = pod.name_any();
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
        }
    }

    // Observe each instance through its API, once per pass.
    let mut instances = Vec::new();
    let mut primary_view = None;
    for (n, pod) in &existing {
        let mut instance = InstanceStatus {
            name: pod.name_any(),
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            role: pod.labels().get(ROLE_LABEL).cloned(),
            ready: pod_ready(pod),
            ..InstanceStatus::default()
        };
        if let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_ref()) {
            let address = format!("{ip}:{INSTANCE_API_PORT}");
            match instance_client::call("GET", &address, "/status", None).await {
                Ok(status) => {
                    instance.lsn = status["lsn"].as_str().map(str::to_owned);
                    instance.lag_seconds = status["lagSeconds"].as_f64();
                    if *n == primary {
                        primary_view = Some((address, status));
                    }
                }
                Err(error) => {
                    tracing::debug!(cluster = %name, %error, "instance status unavailable")
                }
            }
        }
        instances.push(instance);
    }
    // The primary's view of its standbys gives their lag in bytes and which stream; the
    // sync quorum is kept on those, and the primary is reconfigured only when it differs
    // or the spec changed since status last said it was applied.
    if let Some((address, status)) = &primary_view {
        let mut streaming_standbys = Vec::new();
        for standby in status["standbys"].as_array().into_iter().flatten() {
            if let Some(instance) = instances
                .iter_mut()
                .find(|i| standby["name"] == i.name.as_str())
            {
                instance.lag_bytes = standby["lagBytes"].as_i64();
            }
            if standby["state"] == "streaming"
                && let Some(standby_name) = standby["name"].as_str()
            {
                streaming_standbys.push(standby_name.to_owned());
            }
        }
        streaming_standbys.sort();
        let sync_names = build::synchronous_standby_names(cluster, &streaming_standbys);
        let spec_changed = cluster.status.as_ref().and_then(|s| s.observed_generation)
            != cluster.metadata.generation;
        if spec_changed || status["synchronousStandbyNames"] != sync_names.as_str() {
            let body = json!({ "synchronousStandbyNames": sync_names, "parameters": cluster.spec.parameters });
            if let Err(error) = instance_client::call("POST", address, "/reload", Some(&body)).await
            {
                tracing::warn!(cluster = %name, %error, "could not update the primary's configuration");
            }
        }
    }

    let ready = i32::try_from(instances.iter().filter(|i| i.ready).count()).unwrap_or(i32::MAX);
    let all_ready = ready == cluster.spec.replicas && existing.len() == desired as usize;
    let phase = if all_ready {
        "Ready"
    } else if existing.is_empty() {
        "Creating"
    } else {
        "Progressing"
    };
    let previous = cluster.status.clone().unwrap_or_default();
    let condition = |type_: &str, status: bool, reason: &str, message: String| {
        let status = if status { "True" } else { "False" }.to_owned();
        let unchanged = previous
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
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
    };
    let status = DatabaseClusterStatus {
        observed_generation: cluster.metadata.generation,
        conditions: vec![
            condition(
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
                "Progressing",
                !all_ready,
                if all_ready { "Settled" } else { "Reconciling" },
                if all_ready {
                    "nothing to do".to_owned()
                } else {
                    "creating or starting instances".to_owned()
                },
            ),
        ],
        phase: Some(phase.to_owned()),
        current_primary: existing.get(&primary).map(|pod| pod.name_any()),
        ready_instances: Some(ready),
        instances,
        version: Some(cluster.spec.version.clone()),
        ..previous.clone()
    };
    if cluster.status.as_ref() != Some(&status) {
        let clusters: Api<DatabaseCluster> = Api::namespaced(client.clone(), &namespace);
        let patch = json!({
            "apiVersion": "castellan.io/v1alpha1",
            "kind": "DatabaseCluster",
            "status": status,
        });
        clusters
            .patch_status(&name, &apply, &Patch::Apply(&patch))
            .await
            .map_err(kube_error("writing status", cluster))?;
    }
    // Status (lag, readiness) changes without any object changing: look again soon.
    Ok(Action::requeue(Duration::from_secs(if all_ready {
        10
    } else {
        2
    })))
}
