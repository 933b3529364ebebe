//! The Kubernetes objects a `DatabaseCluster` owns, built as pure functions of its
//! spec (and of the few facts that are not in it: generated passwords, the `-rw`
//! Service's address). Nothing here talks to the API server; `reconcile` applies what
//! these return.

use std::collections::BTreeMap;

use castellan_crds::DatabaseCluster;
use castellan_crds::database_cluster::ReplicationMode;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, Pod, PodAffinityTerm, PodAntiAffinity, PodSecurityContext,
    PodSpec, Probe, SeccompProfile, Secret, SecretKeySelector, SecretVolumeSource, SecurityContext,
    Service, ServicePort, ServiceSpec, Volume, VolumeMount, VolumeResourceRequirements,
    WeightedPodAffinityTerm,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::instance_api::Access;
use crate::kube_ops::{CLUSTER_LABEL, INSTANCE_LABEL};
use crate::pki::Issued;

/// Label of a pod: `primary` or `replica`; the Services select on it.
pub const ROLE_LABEL: &str = "castellan.io/role";
/// On an instance pod once its cluster has had data (`"true"`): its instance manager
/// reads it when its container starts and then never runs initdb, whatever the pod was
/// created with.
pub const INITIALIZED_ANNOTATION: &str = "castellan.io/initialized";
/// The image every database pod runs (the instance manager with PostgreSQL).
pub const IMAGE: &str = "ghcr.io/castellan-io/castellan";
pub const POSTGRES_PORT: i32 = 5432;
/// The instance API (TLS, the operator's client certificate required).
pub const INSTANCE_API_PORT: i32 = 8000;
/// The kubelet's probes (plain HTTP, `/healthz` and `/readyz` only).
pub const INSTANCE_PROBE_PORT: i32 = 8001;
/// The instance manager's `/metrics` (plain HTTP; docs/metrics.md): postgres_exporter's
/// port, where a Prometheus set up for it or for CloudNativePG looks.
pub const INSTANCE_METRICS_PORT: i32 = 9187;
const DATA_MOUNT: &str = "/var/lib/postgresql/data";
const SECRETS_MOUNT: &str = "/etc/castellan/secrets";
/// Suffix of the Secret with the instance API's certificate (`<cluster>-instance-tls`).
pub const INSTANCE_TLS: &str = "instance-tls";
/// Suffix of the Secret with PostgreSQL's server certificate (`<cluster>-server-tls`).
pub const SERVER_TLS: &str = "server-tls";
/// Suffix of the Secret with the replicas' client certificate
/// (`<cluster>-replication-tls`).
pub const REPLICATION_TLS: &str = "replication-tls";

/// What an instance pod runs: the image (from the image catalog) and the PostgreSQL
/// major it carries, which the instance manager checks its binaries against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Runs {
    pub image: String,
    pub version: String,
}

/// What the operator knows that the spec does not say.
#[derive(Clone, Debug)]
pub struct Settings {
    /// uid and gid the database processes run as (PostgreSQL refuses root).
    pub postgres_uid: i64,
    pub postgres_gid: i64,
    /// `OTEL_*` variables passed on to the instance managers, so that their spans
    /// reach the same collector as the operator's.
    pub telemetry_env: Vec<(String, String)>,
    /// The Secret whose key `headers` the instance managers' `OTEL_EXPORTER_OTLP_HEADERS`
    /// is read from (headers can carry credentials: they are never copied in clear).
    pub otlp_headers_secret: Option<String>,
}

/// The `OTEL_*` variables of this process that say where traces go and how they are
/// batched; the instance managers get the same (but their own service name). Not
/// `OTEL_EXPORTER_OTLP_HEADERS`, which can hold credentials: pods read theirs from a
/// Secret (`Settings::otlp_headers_secret`).
pub fn telemetry_env_from(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    const PASSED: [&str; 4] = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_BSP_SCHEDULE_DELAY",
    ];
    let mut passed: Vec<(String, String)> = vars
        .filter(|(name, _)| PASSED.contains(&name.as_str()))
        .collect();
    passed.sort();
    passed
}

fn name(cluster: &DatabaseCluster) -> String {
    cluster.name_any()
}

/// Pod (and volume) name of instance `n` (1-based).
pub fn instance_name(cluster: &DatabaseCluster, n: u32) -> String {
    format!("{}-{n}", name(cluster))
}

pub fn secret_name(cluster: &DatabaseCluster, what: &str) -> String {
    format!("{}-{what}", name(cluster))
}

pub fn service_name(cluster: &DatabaseCluster, suffix: &str) -> String {
    format!("{}-{suffix}", name(cluster))
}

/// The label everything Castellan makes carries, and its value: the operator's watches
/// select on it (`managed_selector`), and its admission policy lets it write only
/// Secrets that carry it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "castellan";

/// The label selector of everything Castellan makes.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY}")
}

fn labels(cluster: &DatabaseCluster, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (CLUSTER_LABEL.to_owned(), name(cluster)),
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
    ]);
    for (key, value) in extra {
        labels.insert((*key).to_owned(), (*value).to_owned());
    }
    labels
}

/// Metadata of an owned object: namespace, labels and the owner reference that makes
/// deleting the cluster delete it.
fn metadata(
    cluster: &DatabaseCluster,
    object_name: String,
    labels: BTreeMap<String, String>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(object_name),
        namespace: cluster.namespace(),
        labels: Some(labels),
        owner_references: cluster.controller_owner_ref(&()).map(|owner| vec![owner]),
        ..ObjectMeta::default()
    }
}

/// The three credential Secrets. Passwords are inputs: they are generated once, and a
/// Secret that exists is never rewritten.
pub fn secrets(
    cluster: &DatabaseCluster,
    superuser: &str,
    replication: &str,
    app: &str,
    ca_pem: &str,
) -> Vec<Secret> {
    let (database, owner) = application(cluster);
    let host = app_host(cluster);
    let secret = |what: &str, data: Vec<(&str, String)>| {
        owned_secret(cluster, what, "kubernetes.io/basic-auth", data)
    };
    vec![
        secret(
            "superuser",
            vec![
                ("username", "postgres".to_owned()),
                ("password", superuser.to_owned()),
            ],
        ),
        secret(
            "replication",
            vec![
                ("username", "streaming_replica".to_owned()),
                ("password", replication.to_owned()),
            ],
        ),
        secret(
            "app",
            vec![
                ("username", owner.clone()),
                ("password", app.to_owned()),
                ("dbname", database.clone()),
                ("host", host),
                ("port", POSTGRES_PORT.to_string()),
                ("uri", app_uri(cluster, app)),
                // What a client verifies the server's certificate with.
                ("ca.crt", ca_pem.to_owned()),
            ],
        ),
    ]
}

/// Where applications connect: the -rw Service's name in the cluster's namespace.
fn app_host(cluster: &DatabaseCluster) -> String {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    format!("{}.{namespace}.svc", service_name(cluster, "rw"))
}

/// The application's connection URI with `password` (percent-encoded, so that a
/// password a user chose with `@` or `/` in it still parses).
pub fn app_uri(cluster: &DatabaseCluster, password: &str) -> String {
    let (database, owner) = application(cluster);
    let host = app_host(cluster);
    let encoded: String = password
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect();
    // verify-full: the server's certificate names the -rw Service (and the others);
    // the client verifies it with the CA in the Secret's `ca.crt` (libpq:
    // `sslrootcert`, or PGSSLROOTCERT).
    format!("postgresql://{owner}:{encoded}@{host}:{POSTGRES_PORT}/{database}?sslmode=verify-full")
}

/// The instance API's Secret, in the layout of a `kubernetes.io/tls` Secret: `tls.crt`
/// and `tls.key` (the cluster's server certificate) and `ca.crt` (the CA whose client
/// certificates may call the API). Issued by the operator, renewed when it runs out.
pub fn tls_secret(
    cluster: &DatabaseCluster,
    suffix: &str,
    ca_pem: &str,
    issued: &Issued,
) -> Secret {
    owned_tls_secret(cluster, suffix, ca_pem, &issued.cert_pem, &issued.key_pem)
}

/// A `kubernetes.io/tls` Secret `<cluster>-<suffix>` the cluster owns: `ca.crt`,
/// `tls.crt`, `tls.key`.
pub fn owned_tls_secret(
    cluster: &DatabaseCluster,
    suffix: &str,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Secret {
    let data = vec![
        ("ca.crt", ca_pem.to_owned()),
        ("tls.crt", cert_pem.to_owned()),
        ("tls.key", key_pem.to_owned()),
    ];
    owned_secret(cluster, suffix, "kubernetes.io/tls", data)
}

/// A Secret `<cluster>-<suffix>` of `type_` the cluster owns, holding `data`.
fn owned_secret(
    cluster: &DatabaseCluster,
    suffix: &str,
    type_: &str,
    data: Vec<(&str, String)>,
) -> Secret {
    Secret {
        metadata: metadata(cluster, secret_name(cluster, suffix), labels(cluster, &[])),
        type_: Some(type_.to_owned()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k.to_owned(), ByteString(v.into_bytes())))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// The application database and its owner, from `bootstrap.initdb` or the defaults.
pub fn application(cluster: &DatabaseCluster) -> (String, String) {
    match cluster
        .spec
        .bootstrap
        .as_ref()
        .and_then(|b| b.initdb.as_ref())
    {
        Some(initdb) => (initdb.database.clone(), initdb.owner.clone()),
        None => ("app".to_owned(), "app".to_owned()),
    }
}

/// `<name>-rw` (the primary), `<name>-ro` (replicas), `<name>-r` (any instance).
pub fn services(cluster: &DatabaseCluster) -> Vec<Service> {
    let service = |suffix: &str, role: Option<&str>| {
        let mut selector = BTreeMap::from([(CLUSTER_LABEL.to_owned(), name(cluster))]);
        if let Some(role) = role {
            selector.insert(ROLE_LABEL.to_owned(), role.to_owned());
        }
        Service {
            metadata: metadata(cluster, service_name(cluster, suffix), labels(cluster, &[])),
            spec: Some(ServiceSpec {
                selector: Some(selector),
                ports: Some(vec![ServicePort {
                    name: Some("postgres".to_owned()),
                    port: POSTGRES_PORT,
                    target_port: Some(IntOrString::Int(POSTGRES_PORT)),
                    protocol: Some("TCP".to_owned()),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        }
    };
    vec![
        service("rw", Some("primary")),
        service("ro", Some("replica")),
        service("r", None),
    ]
}

/// Disruption budgets, as CloudNativePG keeps them: the primary may not be evicted by a
/// voluntary disruption (a drain waits for a switchover), and at most one replica is
/// down at a time. A single-instance cluster gets the primary's budget only.
pub fn disruption_budgets(cluster: &DatabaseCluster) -> Vec<PodDisruptionBudget> {
    let budget = |suffix: &str, role: &str, min_available: i32| PodDisruptionBudget {
        metadata: metadata(
            cluster,
            format!("{}{suffix}", name(cluster)),
            labels(cluster, &[]),
        ),
        spec: Some(PodDisruptionBudgetSpec {
            selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([
                    (CLUSTER_LABEL.to_owned(), name(cluster)),
                    (ROLE_LABEL.to_owned(), role.to_owned()),
                ])),
                ..LabelSelector::default()
            }),
            min_available: Some(IntOrString::Int(min_available)),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    };
    let mut budgets = vec![budget("-primary", "primary", 1)];
    let replicas = cluster.spec.replicas.max(1) - 1;
    if replicas > 0 {
        budgets.push(budget("", "replica", replicas - 1));
    }
    budgets
}

/// The label the operator's pods carry (`deploy/operator/operator.yaml`, the Helm chart).
pub const OPERATOR_POD_LABEL: (&str, &str) = ("app.kubernetes.io/name", "castellan-operator");

/// Who may reach the cluster's pods: anyone on PostgreSQL's port (clients, and replicas
/// streaming from the primary), anyone on the probe port (`/readyz`, `/healthz` only)
/// and the metrics port (Prometheus, wherever it runs; metrics hold no data), and only the operator's pods, in any namespace, on the instance API (which also
/// requires the operator's client certificate). Enforced where the network plugin
/// enforces NetworkPolicies.
pub fn network_policy(cluster: &DatabaseCluster) -> NetworkPolicy {
    let port = |port: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".to_owned()),
        ..NetworkPolicyPort::default()
    };
    NetworkPolicy {
        metadata: metadata(cluster, name(cluster), labels(cluster, &[])),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(CLUSTER_LABEL.to_owned(), name(cluster))])),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    ports: Some(vec![
                        port(POSTGRES_PORT),
                        port(INSTANCE_PROBE_PORT),
                        port(INSTANCE_METRICS_PORT),
                    ]),
                    ..NetworkPolicyIngressRule::default()
                },
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        namespace_selector: Some(LabelSelector::default()),
                        pod_selector: Some(LabelSelector {
                            match_labels: Some(BTreeMap::from([(
                                OPERATOR_POD_LABEL.0.to_owned(),
                                OPERATOR_POD_LABEL.1.to_owned(),
                            )])),
                            ..LabelSelector::default()
                        }),
                        ..NetworkPolicyPeer::default()
                    }]),
                    ports: Some(vec![port(INSTANCE_API_PORT)]),
                },
            ]),
            ..NetworkPolicySpec::default()
        }),
    }
}

/// The volume of instance `n`.
pub fn volume_claim(cluster: &DatabaseCluster, n: u32) -> PersistentVolumeClaim {
    let instance = instance_name(cluster, n);
    PersistentVolumeClaim {
        metadata: metadata(
            cluster,
            instance.clone(),
            labels(cluster, &[(INSTANCE_LABEL, &instance)]),
        ),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            storage_class_name: cluster.spec.storage.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_owned(),
                    Quantity(cluster.spec.storage.size.clone()),
                )])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    }
}

/// Label of a scratch instance: the cluster whose backup it verifies. It has none of
/// the cluster's own labels, so no Service, budget or pass of the cluster ever selects it.
pub const VERIFY_LABEL: &str = "castellan.io/verifies";

/// Annotation of a scratch instance: the `Backup` it verifies.
pub const VERIFYING_ANNOTATION: &str = "castellan.io/backup";

/// Name of the scratch instance (pod and volume claim) verifying backup `id` (its
/// object-store id): one per backup, so that the last one's volume, still going away,
/// never stands in the way.
pub fn scratch_name(cluster: &DatabaseCluster, id: &str) -> String {
    let short: String = id
        .rsplit('-')
        .next()
        .unwrap_or(id)
        .chars()
        .take(8)
        .collect();
    format!("{}-verify-{short}", name(cluster))
}

/// The scratch instance that restores `backup` to verify it: an instance pod that
/// waits for `POST /restore`, and its own volume claim, owned by the cluster (deleting
/// the cluster deletes them) and labelled only [`VERIFY_LABEL`].
pub fn scratch(
    cluster: &DatabaseCluster,
    backup: &str,
    scratch: &str,
    runs: &Runs,
    settings: &Settings,
) -> (PersistentVolumeClaim, Pod) {
    let scratch = scratch.to_owned();
    let labels = BTreeMap::from([
        (VERIFY_LABEL.to_owned(), name(cluster)),
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
    ]);
    let annotations = BTreeMap::from([(VERIFYING_ANNOTATION.to_owned(), backup.to_owned())]);
    let mut claim = volume_claim(cluster, 0);
    claim.metadata.name = Some(scratch.clone());
    claim.metadata.labels = Some(labels.clone());
    let mut pod = pod(cluster, 0, StartRole::Primary, "", false, runs, settings);
    pod.metadata.name = Some(scratch.clone());
    pod.metadata.labels = Some(labels);
    pod.metadata.annotations = Some(annotations);
    if let Some(spec) = pod.spec.as_mut() {
        for container in &mut spec.containers {
            for variable in container.env.iter_mut().flatten() {
                if variable.name == "CASTELLAN_AWAIT_RESTORE" {
                    variable.value = Some("true".to_owned());
                }
            }
        }
        for volume in spec.volumes.iter_mut().flatten() {
            if let Some(source) = volume.persistent_volume_claim.as_mut() {
                source.claim_name = scratch.clone();
            }
        }
    }
    (claim, pod)
}

/// Who may connect to the cluster's PostgreSQL how, as its spec says: what every
/// instance writes pg_hba.conf from (the pods start with it, reloads keep it current).
pub fn access(cluster: &DatabaseCluster) -> Access {
    Access {
        allow_plaintext: cluster.spec.allows_plaintext(),
        superuser: cluster.spec.enable_superuser_access,
        hba: cluster.spec.pg_hba.clone(),
    }
}

/// `synchronous_standby_names` for a primary whose standbys are `standbys`: empty
/// (asynchronous) unless the spec asks for a sync quorum, then `ANY n (…)` over the
/// standbys, with `n` capped by how many exist so that writes are not blocked forever
/// waiting for a replica that was never created.
pub fn synchronous_standby_names(cluster: &DatabaseCluster, standbys: &[String]) -> String {
    let Some(replication) = cluster
        .spec
        .replication
        .as_ref()
        .filter(|_| synchronous(cluster))
    else {
        return String::new();
    };
    if standbys.is_empty() {
        return String::new();
    }
    let wanted = usize::try_from(replication.sync_replicas.unwrap_or(1).max(1)).unwrap_or(1);
    let quorum = wanted.min(standbys.len());
    let names: Vec<String> = standbys.iter().map(|s| format!("\"{s}\"")).collect();
    format!("ANY {quorum} ({})", names.join(", "))
}

/// Whether the spec asks for synchronous replication.
pub fn synchronous(cluster: &DatabaseCluster) -> bool {
    cluster
        .spec
        .replication
        .as_ref()
        .is_some_and(|r| r.mode == ReplicationMode::Sync)
}

/// The role an instance's pod is created in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartRole {
    Primary,
    Replica,
}

impl StartRole {
    pub fn as_str(self) -> &'static str {
        match self {
            StartRole::Primary => "primary",
            StartRole::Replica => "replica",
        }
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// The most WAL a replication slot may hold back on an instance's volume: a quarter of
/// it (at least 64 MiB), so that a standby that is gone for good can never fill the
/// primary's disk. Past it the slot is invalidated and that standby is rebuilt.
pub fn max_slot_wal_keep_size(cluster: &DatabaseCluster) -> String {
    format!("{}MB", slot_wal_limit_bytes(cluster) >> 20)
}

/// That quarter of the volume (at least 64 MiB), in bytes: also where WAL waiting for a
/// failing archive is worth a Warning.
pub fn slot_wal_limit_bytes(cluster: &DatabaseCluster) -> u64 {
    let bytes = castellan_crds::quantity::parse_bytes(&cluster.spec.storage.size).unwrap_or(0);
    (bytes / 4).max(64 << 20)
}

/// The pod of instance `n`: the instance manager as PID 1, its volume, the credential
/// files, a readiness probe on "accepting connections in its role", and a preference
/// for a node without another instance of the cluster. `allow_initdb` only for the
/// first instance of a cluster that never had data: it runs initdb, or with
/// `bootstrap.recovery` waits for the backup to restore.
pub fn pod(
    cluster: &DatabaseCluster,
    n: u32,
    role: StartRole,
    upstream_host: &str,
    allow_initdb: bool,
    runs: &Runs,
    settings: &Settings,
) -> Pod {
    let instance = instance_name(cluster, n);
    let (database, owner) = application(cluster);
    let restore = allow_initdb
        && cluster
            .spec
            .bootstrap
            .as_ref()
            .is_some_and(|b| b.recovery.is_some());
    let parameters =
        serde_json::to_string(&cluster.spec.parameters).unwrap_or_else(|_| "{}".to_owned());
    let access = access(cluster);
    let secret_volume = |what: &str| Volume {
        name: what.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret_name(cluster, what)),
            default_mode: Some(0o440),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    };
    let secret_mount = |what: &str| VolumeMount {
        name: what.to_owned(),
        mount_path: format!("{SECRETS_MOUNT}/{what}"),
        read_only: Some(true),
        ..VolumeMount::default()
    };
    let container = Container {
        name: "postgres".to_owned(),
        image: Some(runs.image.clone()),
        args: Some(vec!["instance".to_owned()]),
        env: Some(
            vec![
                env("CASTELLAN_CLUSTER", name(cluster)),
                field_env("POD_NAME", "metadata.name"),
                field_env("POD_IP", "status.podIP"),
                env("PGDATA", format!("{DATA_MOUNT}/pgdata")),
                env("CASTELLAN_ROLE", role.as_str()),
                env(
                    "CASTELLAN_ALLOW_INITDB",
                    if allow_initdb && !restore {
                        "true"
                    } else {
                        "false"
                    },
                ),
                field_env(
                    "CASTELLAN_CLUSTER_INITIALIZED",
                    &format!("metadata.annotations['{INITIALIZED_ANNOTATION}']"),
                ),
                env(
                    "CASTELLAN_AWAIT_RESTORE",
                    if restore { "true" } else { "false" },
                ),
                env("CASTELLAN_UPSTREAM_HOST", upstream_host),
                env("CASTELLAN_PARAMETERS", parameters),
                env(
                    "CASTELLAN_MAX_SLOT_WAL_KEEP_SIZE",
                    max_slot_wal_keep_size(cluster),
                ),
                env("CASTELLAN_APP_DATABASE", database),
                env("CASTELLAN_APP_OWNER", owner),
                env(
                    "CASTELLAN_SUPERUSER_PASSWORD_FILE",
                    format!("{SECRETS_MOUNT}/superuser/password"),
                ),
                env(
                    "CASTELLAN_REPLICATION_PASSWORD_FILE",
                    format!("{SECRETS_MOUNT}/replication/password"),
                ),
                env(
                    "CASTELLAN_APP_PASSWORD_FILE",
                    format!("{SECRETS_MOUNT}/app/password"),
                ),
                env("CASTELLAN_HTTP_PORT", INSTANCE_API_PORT.to_string()),
                env("CASTELLAN_PROBE_PORT", INSTANCE_PROBE_PORT.to_string()),
                env("CASTELLAN_METRICS_PORT", INSTANCE_METRICS_PORT.to_string()),
                env(
                    "CASTELLAN_TLS_CERT_FILE",
                    format!("{SECRETS_MOUNT}/{INSTANCE_TLS}/tls.crt"),
                ),
                env(
                    "CASTELLAN_TLS_KEY_FILE",
                    format!("{SECRETS_MOUNT}/{INSTANCE_TLS}/tls.key"),
                ),
                env(
                    "CASTELLAN_TLS_CA_FILE",
                    format!("{SECRETS_MOUNT}/{INSTANCE_TLS}/ca.crt"),
                ),
                env(
                    "CASTELLAN_SERVER_TLS_DIR",
                    format!("{SECRETS_MOUNT}/{SERVER_TLS}"),
                ),
                env(
                    "CASTELLAN_REPLICATION_TLS_DIR",
                    format!("{SECRETS_MOUNT}/{REPLICATION_TLS}"),
                ),
                env(
                    "CASTELLAN_UPSTREAM_SERVER_NAME",
                    crate::pki::postgres_server_name(
                        &name(cluster),
                        &cluster.namespace().unwrap_or_else(|| "default".to_owned()),
                    ),
                ),
                env(
                    "CASTELLAN_ALLOW_PLAINTEXT",
                    access.allow_plaintext.to_string(),
                ),
                env("CASTELLAN_SUPERUSER_ACCESS", access.superuser.to_string()),
                // The instance refuses binaries of another major.
                env("CASTELLAN_POSTGRES_VERSION", runs.version.clone()),
                // A list of strings always serialises.
                env(
                    "CASTELLAN_PG_HBA",
                    serde_json::to_string(&access.hba).unwrap_or_else(|_| "[]".into()),
                ),
            ]
            .into_iter()
            .chain(
                settings
                    .telemetry_env
                    .iter()
                    .map(|(n, v)| env(n, v.as_str())),
            )
            .chain(settings.otlp_headers_secret.as_ref().map(|secret| EnvVar {
                name: "OTEL_EXPORTER_OTLP_HEADERS".to_owned(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: secret.clone(),
                        key: "headers".to_owned(),
                        optional: Some(true),
                    }),
                    ..EnvVarSource::default()
                }),
                ..EnvVar::default()
            }))
            .collect(),
        ),
        // Least privilege: no privilege escalation, no capabilities, nothing written
        // outside the volume (the instance manager and PostgreSQL need no /tmp; an
        // emptyDir would also make `kubectl drain` refuse the pod without
        // --delete-emptydir-data).
        security_context: Some(restricted_container()),
        ports: Some(vec![
            ContainerPort {
                name: Some("postgres".to_owned()),
                container_port: POSTGRES_PORT,
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("instance-api".to_owned()),
                container_port: INSTANCE_API_PORT,
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("probes".to_owned()),
                container_port: INSTANCE_PROBE_PORT,
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("metrics".to_owned()),
                container_port: INSTANCE_METRICS_PORT,
                ..ContainerPort::default()
            },
        ]),
        // The probe port: the API port requires the operator's client certificate,
        // which a kubelet does not have.
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".to_owned()),
                port: IntOrString::Int(INSTANCE_PROBE_PORT),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(2),
            failure_threshold: Some(3),
            ..Probe::default()
        }),
        resources: cluster.spec.resources.clone(),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "data".to_owned(),
                mount_path: DATA_MOUNT.to_owned(),
                ..VolumeMount::default()
            },
            secret_mount("superuser"),
            secret_mount("replication"),
            secret_mount("app"),
            secret_mount(INSTANCE_TLS),
            secret_mount(SERVER_TLS),
            secret_mount(REPLICATION_TLS),
        ]),
        ..Container::default()
    };
    let cluster_selector = LabelSelector {
        match_labels: Some(BTreeMap::from([(CLUSTER_LABEL.to_owned(), name(cluster))])),
        ..LabelSelector::default()
    };
    let mut metadata = metadata(
        cluster,
        instance.clone(),
        labels(
            cluster,
            &[(INSTANCE_LABEL, &instance), (ROLE_LABEL, role.as_str())],
        ),
    );
    metadata.annotations = Some(scrape_annotations(INSTANCE_METRICS_PORT));
    Pod {
        metadata,
        spec: Some(PodSpec {
            containers: vec![container],
            // The instance manager stops PostgreSQL with a fast shutdown; give it time.
            termination_grace_period_seconds: Some(60),
            security_context: Some(database_pod(settings)),
            // The instance manager never calls the Kubernetes API.
            automount_service_account_token: Some(false),
            affinity: Some(Affinity {
                pod_anti_affinity: Some(PodAntiAffinity {
                    preferred_during_scheduling_ignored_during_execution: Some(vec![
                        WeightedPodAffinityTerm {
                            weight: 100,
                            pod_affinity_term: PodAffinityTerm {
                                label_selector: Some(cluster_selector),
                                topology_key: "kubernetes.io/hostname".to_owned(),
                                ..PodAffinityTerm::default()
                            },
                        },
                    ]),
                    ..PodAntiAffinity::default()
                }),
                ..Affinity::default()
            }),
            volumes: Some(vec![
                Volume {
                    name: "data".to_owned(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: instance,
                        ..PersistentVolumeClaimVolumeSource::default()
                    }),
                    ..Volume::default()
                },
                secret_volume("superuser"),
                secret_volume("replication"),
                secret_volume("app"),
                secret_volume(INSTANCE_TLS),
                secret_volume(SERVER_TLS),
                secret_volume(REPLICATION_TLS),
            ]),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// The annotations of Prometheus' widespread `kubernetes_sd` pod scrape configuration
/// (and of the Helm charts that ship it): scrape this pod's `/metrics` on `port`.
pub fn scrape_annotations(port: i32) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("prometheus.io/scrape".to_owned(), "true".to_owned()),
        ("prometheus.io/port".to_owned(), port.to_string()),
        ("prometheus.io/path".to_owned(), "/metrics".to_owned()),
    ])
}

/// A database container's security: no privilege escalation, no capabilities,
/// nothing written outside its volumes.
fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// A database pod's security: PostgreSQL's user and group, which own the volume.
fn database_pod(settings: &Settings) -> PodSecurityContext {
    PodSecurityContext {
        run_as_user: Some(settings.postgres_uid),
        run_as_group: Some(settings.postgres_gid),
        fs_group: Some(settings.postgres_gid),
        run_as_non_root: Some(true),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// The name of a cluster's upgrade pod (one at a time).
pub fn upgrade_pod_name(cluster: &DatabaseCluster) -> String {
    format!("{}-upgrade", name(cluster))
}

/// Labels the upgrade pod carries: the cluster's (it goes with it) and this one, and
/// no role, so no Service sends it clients.
pub const UPGRADE_LABEL: &str = "castellan.io/upgrade";

/// Where the upgrade pod mounts the instance's volume (the instances' `PGDATA` is
/// `pgdata` in it) and the old version's programs.
const OLD_BINARIES: &str = "/old";

/// The pod that runs one step of a major upgrade (`castellan upgrade …`) on the volume
/// of instance `job.instance()`, and nothing else: pg_upgrade with the old version's
/// programs, copied by an init container of the old image, and the new image's; a
/// rollback's swap of the data directories; the removal of the kept previous data.
/// Its log's last line is the outcome. `images` are the catalog's images of the old
/// and the new major (for a rollback and a removal only the first is used).
pub fn upgrade_pod(
    cluster: &DatabaseCluster,
    job: &crate::operator::cluster::upgrade::Job,
    images: (&str, &str),
    settings: &Settings,
) -> Pod {
    use crate::operator::cluster::upgrade::Job;
    let data = DATA_MOUNT.to_owned();
    let (old_image, new_image) = images;
    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    let superuser_file = format!("{SECRETS_MOUNT}/superuser/password");
    let container =
        |name: &str, image: &str, args: Vec<String>, mounts: Vec<VolumeMount>| Container {
            name: name.to_owned(),
            image: Some(image.to_owned()),
            args: Some(args),
            security_context: Some(restricted_container()),
            resources: cluster.spec.resources.clone(),
            volume_mounts: Some(mounts),
            ..Container::default()
        };
    let data_mounts = vec![
        mount("data", &data, false),
        mount("old", OLD_BINARIES, false),
        mount("superuser", &format!("{SECRETS_MOUNT}/superuser"), true),
    ];
    let strings = |words: &[&str]| words.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
    let (init, main) = match job {
        Job::Upgrade { from, to, .. } => (
            Some(container(
                "export",
                old_image,
                strings(&["upgrade", "export", "--to", OLD_BINARIES]),
                vec![mount("old", OLD_BINARIES, false)],
            )),
            container(
                "upgrade",
                new_image,
                strings(&[
                    "upgrade",
                    "run",
                    "--data",
                    &data,
                    "--old-bindir-file",
                    &format!("{OLD_BINARIES}/bindir"),
                    "--from",
                    from,
                    "--to",
                    to,
                    "--superuser-password-file",
                    &superuser_file,
                ]),
                data_mounts,
            ),
        ),
        Job::Rollback { from, to, .. } => (
            None,
            container(
                "upgrade",
                old_image,
                strings(&[
                    "upgrade", "rollback", "--data", &data, "--from", from, "--to", to,
                ]),
                data_mounts,
            ),
        ),
        Job::Forget { .. } => (
            None,
            container(
                "upgrade",
                old_image,
                strings(&["upgrade", "forget-previous", "--data", &data]),
                data_mounts,
            ),
        ),
    };
    let step = match job {
        Job::Upgrade { .. } => "upgrade",
        Job::Rollback { .. } => "rollback",
        Job::Forget { .. } => "forget-previous",
    };
    Pod {
        metadata: metadata(
            cluster,
            upgrade_pod_name(cluster),
            labels(cluster, &[(UPGRADE_LABEL, step)]),
        ),
        spec: Some(PodSpec {
            init_containers: init.map(|init| vec![init]),
            containers: vec![main],
            restart_policy: Some("Never".to_owned()),
            termination_grace_period_seconds: Some(60),
            security_context: Some(database_pod(settings)),
            automount_service_account_token: Some(false),
            volumes: Some(vec![
                Volume {
                    name: "data".to_owned(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: job.instance().to_owned(),
                        ..PersistentVolumeClaimVolumeSource::default()
                    }),
                    ..Volume::default()
                },
                Volume {
                    name: "old".to_owned(),
                    empty_dir: Some(Default::default()),
                    ..Volume::default()
                },
                Volume {
                    name: "superuser".to_owned(),
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(secret_name(cluster, "superuser")),
                        default_mode: Some(0o440),
                        ..SecretVolumeSource::default()
                    }),
                    ..Volume::default()
                },
            ]),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use castellan_crds::DatabaseClusterSpec;

    #[test]
    fn the_app_uri_carries_any_password_percent_encoded() {
        let cluster = cluster(
            serde_json::json!({"engine": "postgresql", "version": "15", "replicas": 1,
                                     "storage": {"size": "1Gi"},
                                     "bootstrap": {"initdb": {"database": "shop", "owner": "clerk"}}}),
        );
        assert_eq!(
            app_uri(&cluster, "n3w:p@ss/word~"),
            "postgresql://clerk:n3w%3Ap%40ss%2Fword~@orders-rw.shop.svc:5432/shop?sslmode=verify-full"
        );
    }

    #[test]
    fn a_scratch_instance_has_none_of_the_clusters_labels_and_waits_for_a_restore() {
        let cluster = cluster(
            serde_json::json!({"engine": "postgresql", "version": "15", "replicas": 1,
                                     "storage": {"size": "1Gi"}}),
        );
        let name = scratch_name(&cluster, "nightly-1-0a1b2c3d");
        assert_eq!(name, "orders-verify-0a1b2c3d");
        let (claim, pod) = scratch(&cluster, "nightly-1", &name, &runs(), &settings());
        assert_eq!(
            claim.metadata.name.as_deref(),
            Some("orders-verify-0a1b2c3d")
        );
        let labels = pod.metadata.labels.clone().expect("labels");
        assert!(!labels.contains_key(CLUSTER_LABEL) && !labels.contains_key(ROLE_LABEL));
        assert_eq!(labels[VERIFY_LABEL], "orders");
        assert_eq!(
            pod.metadata.annotations.expect("annotations")[VERIFYING_ANNOTATION],
            "nightly-1"
        );
        let spec = pod.spec.expect("spec");
        let env: BTreeMap<_, _> = spec.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect();
        assert_eq!(env["CASTELLAN_AWAIT_RESTORE"].as_deref(), Some("true"));
        assert_eq!(env["CASTELLAN_ALLOW_INITDB"].as_deref(), Some("false"));
        let claims: Vec<_> = spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.persistent_volume_claim.as_ref())
            .map(|c| c.claim_name.clone())
            .collect();
        assert_eq!(claims, vec!["orders-verify-0a1b2c3d"]);
        assert!(
            pod.metadata.owner_references.is_some(),
            "owned by the cluster"
        );
    }

    fn cluster(spec: serde_json::Value) -> DatabaseCluster {
        let spec: DatabaseClusterSpec = serde_json::from_value(spec).expect("a valid spec");
        let mut cluster = DatabaseCluster::new("orders", spec);
        cluster.metadata.namespace = Some("shop".to_owned());
        cluster.metadata.uid = Some("3f1c".to_owned());
        cluster
    }

    fn three_sync() -> DatabaseCluster {
        cluster(serde_json::json!({
            "engine": "postgresql", "version": "15", "replicas": 3,
            "storage": {"size": "1Gi", "storageClassName": "local"},
            "replication": {"mode": "sync", "syncReplicas": 1},
            "parameters": {"max_connections": "150"},
            "bootstrap": {"initdb": {"database": "orders", "owner": "clerk"}}
        }))
    }

    /// The first instance of `three_sync`, as a new cluster's primary.
    fn first_pod() -> Pod {
        pod(
            &three_sync(),
            1,
            StartRole::Primary,
            "10.0.0.1",
            true,
            &runs(),
            &settings(),
        )
    }

    fn runs() -> Runs {
        Runs {
            image: "ghcr.io/castellan-io/castellan:0.1.0-pg15".to_owned(),
            version: "15".to_owned(),
        }
    }

    fn settings() -> Settings {
        Settings {
            postgres_uid: 101,
            postgres_gid: 104,
            telemetry_env: vec![(
                "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
                "http://collector:4318".to_owned(),
            )],
            otlp_headers_secret: Some("otlp".to_owned()),
        }
    }

    #[test]
    fn only_the_operator_reaches_the_instance_api() {
        let policy = network_policy(&three_sync());
        let spec = policy.spec.expect("spec");
        let rules = spec.ingress.expect("ingress rules");
        let open: Vec<i32> = rules
            .iter()
            .filter(|rule| rule.from.is_none())
            .flat_map(|rule| rule.ports.iter().flatten())
            .filter_map(|p| match p.port {
                Some(IntOrString::Int(port)) => Some(port),
                _ => None,
            })
            .collect();
        assert_eq!(
            open,
            vec![POSTGRES_PORT, INSTANCE_PROBE_PORT, INSTANCE_METRICS_PORT]
        );
        let api = rules
            .iter()
            .find(|rule| rule.from.is_some())
            .expect("the instance API's rule");
        assert_eq!(
            api.ports
                .iter()
                .flatten()
                .map(|p| p.port.clone())
                .collect::<Vec<_>>(),
            vec![Some(IntOrString::Int(INSTANCE_API_PORT))]
        );
        let peer = &api.from.as_ref().expect("peers")[0];
        assert_eq!(
            peer.pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .map(|l| l["app.kubernetes.io/name"].as_str()),
            Some("castellan-operator")
        );
    }

    #[test]
    fn database_pods_run_with_least_privilege() {
        let pod = first_pod();
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.automount_service_account_token, Some(false));
        let pod_context = spec.security_context.expect("a pod security context");
        assert_eq!(pod_context.run_as_non_root, Some(true));
        assert_eq!(
            pod_context.seccomp_profile.map(|p| p.type_).as_deref(),
            Some("RuntimeDefault")
        );
        let container = &spec.containers[0];
        let context = container
            .security_context
            .clone()
            .expect("a container context");
        assert_eq!(context.allow_privilege_escalation, Some(false));
        assert_eq!(context.read_only_root_filesystem, Some(true));
        assert_eq!(
            context.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_owned()])
        );
        assert!(
            spec.volumes.iter().flatten().all(|v| v.empty_dir.is_none()),
            "no emptyDir: kubectl drain takes the pod without --delete-emptydir-data"
        );
    }

    #[test]
    fn only_the_exporter_settings_are_passed_on() {
        let vars = [
            ("OTEL_SERVICE_NAME", "castellan-operator"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cr3t"),
            ("HOME", "/root"),
            ("OTEL_BSP_SCHEDULE_DELAY", "500"),
        ]
        .map(|(n, v)| (n.to_owned(), v.to_owned()));
        assert_eq!(
            telemetry_env_from(vars.into_iter()),
            vec![
                ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "500".to_owned()),
                (
                    "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
                    "http://c:4318".to_owned()
                ),
            ]
        );
        let pod = first_pod();
        let env = pod.spec.expect("spec").containers[0]
            .env
            .clone()
            .expect("env");
        assert!(env.iter().any(|e| e.name == "OTEL_EXPORTER_OTLP_ENDPOINT"
            && e.value.as_deref() == Some("http://collector:4318")));
        // Headers only by reference to a Secret, never a value.
        let headers = env
            .iter()
            .find(|e| e.name == "OTEL_EXPORTER_OTLP_HEADERS")
            .expect("the headers variable");
        assert_eq!(headers.value, None);
        assert_eq!(
            headers
                .value_from
                .as_ref()
                .and_then(|v| v.secret_key_ref.as_ref())
                .map(|s| (s.name.as_str(), s.key.as_str())),
            Some(("otlp", "headers"))
        );
    }

    #[test]
    fn everything_is_owned_by_the_cluster() {
        let cluster = three_sync();
        let pod = pod(
            &cluster,
            1,
            StartRole::Primary,
            "127.96.0.9",
            true,
            &runs(),
            &settings(),
        );
        let owner = &pod.metadata.owner_references.expect("owned")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("DatabaseCluster", "orders", Some(true))
        );
        for service in services(&cluster) {
            assert!(service.metadata.owner_references.is_some());
        }
        assert!(
            volume_claim(&cluster, 2)
                .metadata
                .owner_references
                .is_some()
        );
    }

    #[test]
    fn services_follow_roles() {
        let services = services(&three_sync());
        let selectors: Vec<(String, Option<String>)> = services
            .iter()
            .map(|s| {
                let selector = s
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.selector.clone())
                    .unwrap_or_default();
                (
                    s.metadata.name.clone().unwrap_or_default(),
                    selector.get(ROLE_LABEL).cloned(),
                )
            })
            .collect();
        assert_eq!(
            selectors,
            vec![
                ("orders-rw".to_owned(), Some("primary".to_owned())),
                ("orders-ro".to_owned(), Some("replica".to_owned())),
                ("orders-r".to_owned(), None),
            ]
        );
    }

    #[test]
    fn everything_a_cluster_owns_is_selected_by_the_operators_watches() {
        let cluster = three_sync();
        let ca = crate::pki::Authority::generate(std::time::SystemTime::now()).expect("a CA");
        let issued = ca
            .issue_postgres_server("orders", "shop", std::time::SystemTime::now())
            .expect("issued");
        let mut owned: Vec<ObjectMeta> = Vec::new();
        owned.extend(
            secrets(&cluster, "s", "r", "a", ca.cert_pem())
                .into_iter()
                .map(|o| o.metadata),
        );
        for suffix in [INSTANCE_TLS, SERVER_TLS, REPLICATION_TLS] {
            owned.push(tls_secret(&cluster, suffix, ca.cert_pem(), &issued).metadata);
        }
        owned.extend(services(&cluster).into_iter().map(|o| o.metadata));
        owned.extend(disruption_budgets(&cluster).into_iter().map(|o| o.metadata));
        owned.push(network_policy(&cluster).metadata);
        owned.push(volume_claim(&cluster, 1).metadata);
        owned.push(
            pod(
                &cluster,
                1,
                StartRole::Primary,
                "",
                true,
                &runs(),
                &settings(),
            )
            .metadata,
        );
        let (claim, scratch_pod) =
            scratch(&cluster, "first", "orders-verify-1", &runs(), &settings());
        owned.extend([claim.metadata, scratch_pod.metadata]);
        for meta in owned {
            assert_eq!(
                meta.labels
                    .as_ref()
                    .and_then(|l| l.get(MANAGED_BY_LABEL))
                    .map(String::as_str),
                Some(MANAGED_BY),
                "{:?} would be invisible to the operator's watch",
                meta.name
            );
        }
    }

    #[test]
    fn the_app_secret_holds_a_connection_uri() {
        let secrets = secrets(&three_sync(), "s", "r", "pw", "the CA");
        let app = secrets
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some("orders-app"))
            .expect("app secret");
        let data = app.data.as_ref().expect("data");
        assert_eq!(
            data["uri"].0,
            b"postgresql://clerk:pw@orders-rw.shop.svc:5432/orders?sslmode=verify-full".to_vec()
        );
        assert_eq!(data["username"].0, b"clerk".to_vec());
        assert_eq!(
            data["ca.crt"].0,
            b"the CA".to_vec(),
            "clients verify the server with it"
        );
    }

    #[test]
    fn the_pod_runs_the_instance_manager_in_its_role() {
        let pod = pod(
            &three_sync(),
            2,
            StartRole::Replica,
            "127.96.0.9",
            false,
            &runs(),
            &settings(),
        );
        assert_eq!(pod.metadata.name.as_deref(), Some("orders-2"));
        let labels = pod.metadata.labels.clone().expect("labels");
        assert_eq!(labels[ROLE_LABEL], "replica");
        assert_eq!(labels[INSTANCE_LABEL], "orders-2");
        let spec = pod.spec.expect("spec");
        let container = &spec.containers[0];
        assert_eq!(
            container.image.as_deref(),
            Some("ghcr.io/castellan-io/castellan:0.1.0-pg15")
        );
        assert_eq!(
            container.args.as_deref(),
            Some(&["instance".to_owned()][..])
        );
        let env: BTreeMap<String, Option<String>> = container
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name, e.value))
            .collect();
        assert_eq!(env["CASTELLAN_ROLE"].as_deref(), Some("replica"));
        assert_eq!(env["CASTELLAN_ALLOW_INITDB"].as_deref(), Some("false"));
        // Read when the container starts, not fixed at creation: the mark withdraws
        // initdb from a pod created allowing it.
        let initialized = container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "CASTELLAN_CLUSTER_INITIALIZED")
            .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
            .map(|field| field.field_path.clone());
        assert_eq!(
            initialized.as_deref(),
            Some("metadata.annotations['castellan.io/initialized']")
        );
        assert_eq!(
            env["CASTELLAN_MAX_SLOT_WAL_KEEP_SIZE"].as_deref(),
            Some("256MB"),
            "a quarter of the 1Gi volume"
        );
        assert_eq!(
            env["CASTELLAN_UPSTREAM_HOST"].as_deref(),
            Some("127.96.0.9")
        );
        assert_eq!(
            env["CASTELLAN_PARAMETERS"].as_deref(),
            Some(r#"{"max_connections":"150"}"#)
        );
        assert_eq!(env["CASTELLAN_APP_OWNER"].as_deref(), Some("clerk"));
        assert_eq!(
            env["CASTELLAN_UPSTREAM_SERVER_NAME"].as_deref(),
            Some("orders-rw.shop.svc"),
            "replicas verify the primary's certificate for the -rw Service's name"
        );
        assert_eq!(
            env["CASTELLAN_SERVER_TLS_DIR"].as_deref(),
            Some("/etc/castellan/secrets/server-tls")
        );
        assert_eq!(
            env["CASTELLAN_REPLICATION_TLS_DIR"].as_deref(),
            Some("/etc/castellan/secrets/replication-tls")
        );
        assert_eq!(
            env["CASTELLAN_ALLOW_PLAINTEXT"].as_deref(),
            Some("false"),
            "TLS only unless spec.tls.allowPlaintext"
        );
        assert_eq!(
            env["CASTELLAN_SUPERUSER_ACCESS"].as_deref(),
            Some("false"),
            "no superuser login over the network unless spec.enableSuperuserAccess"
        );
        assert_eq!(env["CASTELLAN_PG_HBA"].as_deref(), Some("[]"));
        assert_eq!(
            env["CASTELLAN_POSTGRES_VERSION"].as_deref(),
            Some("15"),
            "the instance refuses binaries of another major"
        );
        let mounted: Vec<&str> = container
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        for path in [
            "/etc/castellan/secrets/server-tls",
            "/etc/castellan/secrets/replication-tls",
        ] {
            assert!(mounted.contains(&path), "{path} in {mounted:?}");
        }
        assert_eq!(
            env["POD_IP"], None,
            "the pod IP comes from the downward API"
        );
        let security = spec.security_context.expect("security context");
        assert_eq!(
            (security.run_as_user, security.run_as_group),
            (Some(101), Some(104))
        );
        let claim = spec.volumes.expect("volumes")[0]
            .persistent_volume_claim
            .clone()
            .expect("data volume");
        assert_eq!(claim.claim_name, "orders-2");
    }

    #[test]
    fn the_instance_api_serves_the_clusters_certificate_and_probes_get_their_own_port() {
        let pod = pod(
            &three_sync(),
            1,
            StartRole::Primary,
            "127.96.0.9",
            true,
            &runs(),
            &settings(),
        );
        let spec = pod.spec.expect("spec");
        let volume = spec
            .volumes
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|v| v.name == INSTANCE_TLS)
            .expect("a volume with the instance certificate");
        let secret = volume.secret.expect("from a Secret");
        assert_eq!(secret.secret_name.as_deref(), Some("orders-instance-tls"));
        assert_eq!(
            secret.default_mode,
            Some(0o440),
            "the key is readable by the pod's group only"
        );
        let container = &spec.containers[0];
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == INSTANCE_TLS)
            .expect("mounted");
        assert_eq!(mount.read_only, Some(true));
        let env: BTreeMap<String, Option<String>> = container
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| (e.name, e.value))
            .collect();
        for (variable, file) in [
            ("CASTELLAN_TLS_CERT_FILE", "tls.crt"),
            ("CASTELLAN_TLS_KEY_FILE", "tls.key"),
            ("CASTELLAN_TLS_CA_FILE", "ca.crt"),
        ] {
            assert_eq!(
                env[variable].as_deref(),
                Some(format!("{}/{file}", mount.mount_path).as_str()),
                "{variable} points into the mounted Secret"
            );
        }
        assert_eq!(env["CASTELLAN_HTTP_PORT"].as_deref(), Some("8000"));
        assert_eq!(env["CASTELLAN_PROBE_PORT"].as_deref(), Some("8001"));
        // Metrics on a plain-HTTP port of their own, declared and announced to
        // Prometheus' pod discovery.
        assert_eq!(env["CASTELLAN_METRICS_PORT"].as_deref(), Some("9187"));
        let metrics_port = container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("metrics"))
            .expect("a metrics port");
        assert_eq!(metrics_port.container_port, INSTANCE_METRICS_PORT);
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations["prometheus.io/scrape"], "true");
        assert_eq!(annotations["prometheus.io/port"], "9187");
        let probe = container
            .readiness_probe
            .clone()
            .and_then(|p| p.http_get)
            .expect("an HTTP readiness probe");
        assert_eq!(probe.port, IntOrString::Int(INSTANCE_PROBE_PORT));
        assert_eq!(probe.path.as_deref(), Some("/readyz"));
        assert_eq!(
            probe.scheme, None,
            "plain HTTP: the kubelet has no client certificate"
        );
    }

    #[test]
    fn the_instance_certificate_secret_is_a_tls_secret_owned_by_the_cluster() {
        let ca = crate::pki::Authority::generate(std::time::SystemTime::now()).expect("a CA");
        let issued = ca
            .issue_server("orders", "shop", std::time::SystemTime::now())
            .expect("a certificate");
        let secret = tls_secret(&three_sync(), INSTANCE_TLS, ca.cert_pem(), &issued);
        assert_eq!(secret.metadata.name.as_deref(), Some("orders-instance-tls"));
        assert_eq!(secret.metadata.namespace.as_deref(), Some("shop"));
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert!(secret.metadata.owner_references.is_some());
        let data = secret.data.expect("data");
        assert_eq!(
            data.keys().map(String::as_str).collect::<Vec<_>>(),
            vec!["ca.crt", "tls.crt", "tls.key"]
        );
        assert_eq!(data["ca.crt"].0, ca.cert_pem().as_bytes());
    }

    #[test]
    fn disruption_budgets_keep_the_primary_and_all_but_one_replica() {
        let budgets = disruption_budgets(&three_sync());
        let summary: Vec<(String, String, Option<IntOrString>)> = budgets
            .iter()
            .map(|b| {
                let spec = b.spec.clone().expect("spec");
                let role = spec
                    .selector
                    .and_then(|s| s.match_labels)
                    .expect("selector")[ROLE_LABEL]
                    .clone();
                (
                    b.metadata.name.clone().unwrap_or_default(),
                    role,
                    spec.min_available,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "orders-primary".to_owned(),
                    "primary".to_owned(),
                    Some(IntOrString::Int(1))
                ),
                (
                    "orders".to_owned(),
                    "replica".to_owned(),
                    Some(IntOrString::Int(1))
                ),
            ]
        );
        let mut single = three_sync();
        single.spec.replicas = 1;
        assert_eq!(
            disruption_budgets(&single).len(),
            1,
            "no replica budget without replicas"
        );
    }

    #[test]
    fn the_volume_claim_asks_for_the_spec_size_and_class() {
        let claim = volume_claim(&three_sync(), 3);
        let spec = claim.spec.expect("spec");
        assert_eq!(spec.storage_class_name.as_deref(), Some("local"));
        let requests = spec.resources.and_then(|r| r.requests).expect("requests");
        assert_eq!(requests["storage"], Quantity("1Gi".to_owned()));
    }

    #[test]
    fn sync_names_are_a_quorum_over_existing_standbys() {
        let cluster = three_sync();
        assert_eq!(synchronous_standby_names(&cluster, &[]), "");
        assert_eq!(
            synchronous_standby_names(&cluster, &["orders-2".into(), "orders-3".into()]),
            "ANY 1 (\"orders-2\", \"orders-3\")"
        );
        let mut two = cluster.clone();
        two.spec
            .replication
            .as_mut()
            .expect("replication")
            .sync_replicas = Some(2);
        assert_eq!(
            synchronous_standby_names(&two, &["orders-2".into()]),
            "ANY 1 (\"orders-2\")",
            "capped by the standbys that exist"
        );
        let mut asynchronous = cluster;
        asynchronous.spec.replication = None;
        assert_eq!(
            synchronous_standby_names(&asynchronous, &["orders-2".into()]),
            ""
        );
    }
}
