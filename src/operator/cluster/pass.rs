//! One pass over a `DatabaseCluster`, run by its `ClusterActor`'s shell (the `Converge`
//! effect); the I/O half of it. It applies the owned objects that follow from the spec
//! alone (Secrets, the instance API's certificate, Services, budgets, volume claims),
//! reads what the decisions need (the pods, missing StorageClasses, the pods' nodes from
//! the operator's Node reflector), asks `plan.rs` what the cluster should look like, and
//! carries that out: role labels, new and removed instances, Events, and status when it
//! changed. It decides nothing itself. Idempotent: a second pass with nothing changed
//! creates nothing and writes the same status.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use castellan_crds::DatabaseCluster;
use castellan_crds::backup::{Backup, BackupMethod, BackupSpec};
use castellan_crds::database_cluster::DatabaseClusterStatus;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use serde_json::json;

use super::plan::{self, NodeHealth, Observed, Plan, SERVER_CERTIFICATE};
use super::state::{ConvergeOrder, Converged, Note, desired_count};
use super::upgrade::{Job, JobSeen};
use super::volumes;
use crate::kube_ops::{self, CLUSTER_LABEL, apply_status, apply_status_onto};
use crate::operator::build::{self, ROLE_LABEL};
use crate::operator::catalog;
use crate::operator::certificates::{self, ClusterCertificate};
use crate::operator::context::Shared;
use crate::upgrade::report::{Outcome, Report};

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

/// Keeps the application Secret's derived keys right: `uri` follows a changed
/// `password`, and `ca.crt` holds the CA the server's certificate is verified with (a
/// Secret made before TLS lacks it; a replaced CA changes it).
async fn follow_app_secret(
    secrets: &Api<Secret>,
    cluster: &DatabaseCluster,
    secret: &Secret,
    ca_pem: Option<&str>,
) -> Result<(), Error> {
    let data = secret.data.as_ref();
    let value = |key: &str| {
        data.and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
    };
    let mut changed = serde_json::Map::new();
    if let Some(password) = value("password") {
        let uri = build::app_uri(cluster, &password);
        if value("uri").as_deref() != Some(uri.as_str()) {
            changed.insert("uri".to_owned(), uri.into());
        }
    }
    // Without a served certificate yet (the user's cannot be served) it stays as is.
    if let Some(ca_pem) = ca_pem
        && value("ca.crt").as_deref() != Some(ca_pem)
    {
        changed.insert("ca.crt".to_owned(), ca_pem.into());
    }
    if changed.is_empty() {
        return Ok(());
    }
    let name = secret.name_any();
    let keys: Vec<String> = changed.keys().cloned().collect();
    let patch = json!({"stringData": changed});
    secrets
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_error(
            format!("updating {} in Secret {name}", keys.join(" and ")),
            cluster,
        ))?;
    tracing::info!(cluster = %cluster.name_any(), secret = %name, ?keys, "the application Secret follows its password and the CA");
    Ok(())
}

pub async fn run(order: &ConvergeOrder, context: &Shared) -> Result<Converged, Error> {
    let order = &with_current_status(order, &context.client).await?;
    let cluster = order.cluster.as_ref();
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let client = &context.client;
    let name = cluster.name_any();
    let apply = PatchParams::apply(MANAGER).force();

    // The certificates, before any pod mounts them, and before the application Secret,
    // whose ca.crt is the CA the served certificate is verified with.
    let mut server_certificate = None;
    let trust = context.trust();
    let mut server_ca = Some(trust.bundle_pem());
    for which in ClusterCertificate::ALL {
        let note = match (which, cluster.spec.server_certificate_secret()) {
            (ClusterCertificate::Postgres, Some(source)) => {
                // A refusal's Warning is recorded with the condition's, after the plan.
                let brought =
                    certificates::follow_brought_certificate(client, cluster, source).await?;
                server_ca = brought.served_ca;
                server_certificate = Some(brought.assessment);
                brought.note
            }
            _ => certificates::ensure_certificate(client, cluster, &trust, which).await?,
        };
        if let Some(note) = note {
            context.record(cluster, note).await;
        }
    }

    // Credentials: made once; passwords are generated only when a Secret is missing.
    // A user may rotate a password by writing it into its Secret (the instances follow
    // the mounted files): the application's `uri` follows its `password` here.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let mut missing = Vec::new();
    for what in ["superuser", "replication", "app"] {
        let secret_name = build::secret_name(cluster, what);
        let found = secrets
            .get_opt(&secret_name)
            .await
            .map_err(kube_error(format!("reading Secret {secret_name}"), cluster))?;
        match found {
            None => missing.push(secret_name),
            Some(secret) if what == "app" => {
                follow_app_secret(&secrets, cluster, &secret, server_ca.as_deref()).await?
            }
            Some(_) => {}
        }
    }
    if !missing.is_empty() {
        let ca_pem = server_ca.as_deref().unwrap_or_default();
        for secret in build::secrets(cluster, &password()?, &password()?, &password()?, ca_pem) {
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

    let policies: Api<NetworkPolicy> = Api::namespaced(client.clone(), &namespace);
    let policy = build::network_policy(cluster);
    policies
        .patch(&name, &apply, &Patch::Apply(&policy))
        .await
        .map_err(kube_error(
            format!("applying NetworkPolicy {name}"),
            cluster,
        ))?;

    let desired = desired_count(cluster);
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
        .filter_map(|pod| Some((plan::instance_number(cluster, &pod)?, pod)))
        .collect();
    // What new pods run: the image of the version the data is in.
    let catalog = context.catalog();
    let (version, image) = catalog::for_cluster(&catalog, cluster);
    let target = catalog.image(&cluster.spec.version);
    let version_condition = catalog::assessment(
        &cluster.spec.version,
        &version,
        &image,
        &target,
        &catalog.source,
    );
    let upgrade_job = upgrade_job(&pods, cluster).await?;
    let observed = Observed {
        runs: image.ok().map(|image| build::Runs { image, version }),
        version_condition,
        target_available: target.is_ok(),
        upgrade_job,
        missing_storage_classes: missing_storage_classes(client, &applied_claims).await,
        nodes: nodes_of(&context.nodes, existing.values(), &applied_claims),
        pods: existing,
        claims: applied_claims,
        server_certificate,
        now: Time(k8s_openapi::jiff::Timestamp::now()),
    };
    let plan = plan::plan(order, &observed);
    enact(&plan, observed.runs.as_ref(), cluster, &upstream, context).await?;
    let restore = if super::restoring::awaiting_restore(cluster) {
        crate::operator::restore::request(client, cluster).await
    } else {
        None
    };
    Ok(Converged {
        archive: Some(crate::operator::object_store::archive_setting(client, cluster).await),
        restore,
        ..plan.converged
    })
}

/// The major-upgrade pod as it is: absent, running, or finished with the outcome its
/// log's last line reports.
async fn upgrade_job(pods: &Api<Pod>, cluster: &DatabaseCluster) -> Result<JobSeen, Error> {
    let pod_name = build::upgrade_pod_name(cluster);
    let Some(pod) = pods
        .get_opt(&pod_name)
        .await
        .map_err(kube_error(format!("reading pod {pod_name}"), cluster))?
    else {
        return Ok(JobSeen::Absent);
    };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let succeeded = match phase {
        Some("Succeeded") => true,
        Some("Failed") => false,
        _ => return Ok(JobSeen::Running),
    };
    let params = LogParams {
        container: Some("upgrade".to_owned()),
        tail_lines: Some(40),
        ..LogParams::default()
    };
    let unreported = |message: String| Report {
        outcome: Outcome::Failed,
        method: None,
        seconds: 0.0,
        message,
    };
    let outcome = match pods.logs(&pod_name, &params).await {
        Ok(log) => Report::from_log(&log).unwrap_or_else(|| {
            unreported(format!(
                "{pod_name} ended without reporting an outcome; its log ends: {}",
                log.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
            ))
        }),
        Err(error) => unreported(format!(
            "{pod_name} ended ({}) and its log could not be read: {error}",
            phase.unwrap_or_default()
        )),
    };
    Ok(JobSeen::Finished { succeeded, outcome })
}

/// A major upgrade's side of the pass: stop the instances, run, replace or remove the
/// upgrade pod, and say so.
async fn enact_upgrade(
    plan: &Plan,
    cluster: &DatabaseCluster,
    context: &Shared,
) -> Result<(), Error> {
    let step = &plan.upgrade;
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let pods: Api<Pod> = Api::namespaced(context.client.clone(), &namespace);
    for pod_name in &plan.stop {
        match pods.delete(pod_name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(kube_error(
                    format!("stopping {pod_name} for the major upgrade"),
                    cluster,
                )(error));
            }
        }
        tracing::info!(cluster = %cluster.name_any(), pod = %pod_name, "stopped instance for the major upgrade");
    }
    let job_name = build::upgrade_pod_name(cluster);
    if step.remove_job {
        match pods.delete(&job_name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(kube_error(format!("deleting pod {job_name}"), cluster)(
                    error,
                ));
            }
        }
    }
    if let Some(job) = &step.job {
        let catalog = context.catalog();
        let (old, new) = match job {
            Job::Upgrade { from, to, .. } => (catalog.image(from), catalog.image(to)),
            Job::Rollback { to, .. } => (catalog.image(to), catalog.image(to)),
            Job::Forget { version, .. } => (catalog.image(version), catalog.image(version)),
        };
        match (old, new) {
            (Ok(old), Ok(new)) => {
                let pod = build::upgrade_pod(cluster, job, (&old, &new), &context.settings);
                match pods.create(&PostParams::default(), &pod).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(error) => {
                        return Err(kube_error(format!("creating pod {job_name}"), cluster)(
                            error,
                        ));
                    }
                }
                tracing::info!(cluster = %cluster.name_any(), pod = %job_name, ?job, "started the upgrade pod");
            }
            (Err(why), _) | (_, Err(why)) => {
                context
                    .record(cluster, Note::warning("UpgradeWaiting", why))
                    .await;
            }
        }
    }
    if let Some(backup_name) = &step.backup {
        let backups: Api<Backup> = Api::namespaced(context.client.clone(), &namespace);
        let backup = Backup {
            metadata: ObjectMeta {
                name: Some(backup_name.clone()),
                namespace: Some(namespace.clone()),
                labels: Some([(CLUSTER_LABEL.to_owned(), cluster.name_any())].into()),
                ..ObjectMeta::default()
            },
            spec: BackupSpec {
                cluster: cluster.name_any(),
                method: BackupMethod::default(),
                verify: false,
            },
            status: None,
        };
        match backups.create(&PostParams::default(), &backup).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => {
                return Err(kube_error(
                    format!("creating Backup {backup_name} after the upgrade"),
                    cluster,
                )(error));
            }
        }
    }
    for note in &step.notes {
        context.record(cluster, note.clone()).await;
    }
    Ok(())
}

/// What the nodes of `pods` and of the `claims`' volumes are known to be, from the
/// operator's reflector of Nodes.
fn nodes_of<'a>(
    nodes: &Store<Node>,
    pods: impl IntoIterator<Item = &'a Pod>,
    claims: &[PersistentVolumeClaim],
) -> BTreeMap<String, NodeHealth> {
    pods.into_iter()
        .filter_map(|pod| pod.spec.as_ref()?.node_name.clone())
        .chain(super::volumes::claim_nodes(claims).map(str::to_owned))
        .filter_map(|node_name| {
            let node = nodes.get(&ObjectRef::new(&node_name))?;
            Some((node_name, NodeHealth::of(&node)))
        })
        .collect()
}

/// Carries out `plan`'s changes to the pods, then writes its status when it differs.
/// `upstream` is the -rw Service's address, which new replicas follow.
async fn enact(
    plan: &Plan,
    runs: Option<&build::Runs>,
    cluster: &DatabaseCluster,
    upstream: &str,
    context: &Shared,
) -> Result<(), Error> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let client = &context.client;
    let name = cluster.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    for (pod_name, role) in &plan.relabel {
        let patch = json!({"metadata": {"labels": {ROLE_LABEL: role.as_str()}}});
        pods.patch(pod_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_error(format!("labelling pod {pod_name}"), cluster))?;
        tracing::info!(cluster = %name, pod = %pod_name, role = role.as_str(), "relabelled instance");
    }

    for pod_name in &plan.mark_initialized {
        let patch = json!({"metadata": {"annotations": {build::INITIALIZED_ANNOTATION: "true"}}});
        pods.patch(pod_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_error(
                format!("marking pod {pod_name} initialized"),
                cluster,
            ))?;
        tracing::info!(cluster = %name, pod = %pod_name, "marked instance: its cluster has had data");
    }

    for creation in &plan.create {
        // The plan creates nothing without an image.
        let Some(runs) = runs else { break };
        let role = creation.role;
        let pod = build::pod(
            cluster,
            creation.number,
            role,
            upstream,
            creation.allow_initdb,
            runs,
            &context.settings,
        );
        let pod_name = pod.name_any();
        pods.create(&PostParams::default(), &pod)
            .await
            .map_err(kube_error(format!("creating pod {pod_name}"), cluster))?;
        context.metrics.instance_created();
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
    }

    // A minor update: the pod goes, its volume stays, and the next pass makes it again
    // with the catalog's image.
    if let (Some(update), Some(runs)) = (&plan.update, runs) {
        let pod_name = &update.pod;
        pods.delete(pod_name, &DeleteParams::default())
            .await
            .map_err(kube_error(
                format!("replacing pod {pod_name} (minor update)"),
                cluster,
            ))?;
        let message = if update.in_place {
            format!(
                "restarting {pod_name} on {}: the only instance, so writes pause until it is back",
                runs.image
            )
        } else {
            format!(
                "replacing {pod_name} to run {} (rolling minor update: replicas first, the primary after a switchover)",
                runs.image
            )
        };
        tracing::info!(cluster = %name, pod = %pod_name, image = %runs.image, "minor update");
        context
            .record(
                cluster,
                Note::normal("MinorUpdate", message).about(pod_name),
            )
            .await;
    }

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &namespace);
    for pod_name in &plan.remove {
        pods.delete(pod_name, &DeleteParams::default())
            .await
            .map_err(kube_error(format!("deleting pod {pod_name}"), cluster))?;
        claims
            .delete(pod_name, &DeleteParams::default())
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
                .about(pod_name),
            )
            .await;
    }

    // A Warning Event when a condition that needs the user turns False (or changes its
    // reason while False), once.
    type Warning = fn(Option<&Condition>, &Condition) -> Option<Note>;
    let warnings: [(&str, Warning); 4] = [
        (volumes::CONDITION, volumes::warning),
        (volumes::HEALTH_CONDITION, volumes::health_warning),
        (SERVER_CERTIFICATE, plan::certificate_warning),
        (catalog::CONDITION, plan::version_warning),
    ];
    for (type_, warning) in warnings {
        let Some(current) = condition_of(&plan.status, type_) else {
            continue;
        };
        let previous = cluster
            .status
            .as_ref()
            .and_then(|status| condition_of(status, type_));
        // `previous` is the status as the API server holds it (read at the start of
        // the pass), so the Warning is recorded once.
        if let Some(note) = warning(previous, current) {
            context.record(cluster, note).await;
        }
    }
    // Before the status that records it: a Backup named in status exists.
    enact_upgrade(plan, cluster, context).await?;
    if cluster.status.as_ref() != Some(&plan.status) {
        write_status(client, cluster, &plan.status).await?;
    }
    Ok(())
}

fn condition_of<'a>(status: &'a DatabaseClusterStatus, type_: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

/// The order with the cluster's status and resource version as the API server holds
/// them now ([`kube_ops::with_current_status`]): decided on the cache's, a pass could
/// write back what the previous one had replaced (an upgrade's old data `Kept` again
/// after it was removed, so that a rollback to it would be admitted). The spec stays
/// the machine's, which its decisions (the primary, the instances to remove) were made
/// on.
async fn with_current_status(
    order: &ConvergeOrder,
    client: &Client,
) -> Result<ConvergeOrder, Error> {
    let cluster = order.cluster.as_ref();
    let merged = kube_ops::with_current_status(&clusters(client, cluster), cluster)
        .await
        .map_err(kube_error("reading status", cluster))?;
    Ok(ConvergeOrder {
        cluster: Arc::new(merged),
        ..order.clone()
    })
}

/// Server-side apply of the cluster's `status` (the fields this controller owns), onto
/// the resource version the pass read it at: when anything wrote the cluster since,
/// the API server refuses it (409 Conflict) and the next pass decides again on what
/// is there.
async fn write_status(
    client: &Client,
    cluster: &DatabaseCluster,
    status: &impl Serialize,
) -> Result<(), Error> {
    apply_status_onto(&clusters(client, cluster), cluster, MANAGER, status)
        .await
        .map_err(kube_error("writing status", cluster))?;
    Ok(())
}

/// Server-side apply of the fields of the cluster's `status` that `manager` owns.
pub async fn write_status_as(
    client: &Client,
    cluster: &DatabaseCluster,
    status: &impl Serialize,
    manager: &str,
) -> Result<(), Error> {
    apply_status(
        &clusters(client, cluster),
        &cluster.name_any(),
        manager,
        status,
    )
    .await
    .map_err(kube_error("writing status", cluster))?;
    Ok(())
}

/// The DatabaseClusters of `cluster`'s namespace.
fn clusters(client: &Client, cluster: &DatabaseCluster) -> Api<DatabaseCluster> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    Api::namespaced(client.clone(), &namespace)
}
