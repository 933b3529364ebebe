//! `DatabaseCluster`: a replicated database (PostgreSQL first) that Castellan runs.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::core::{Message, Reason, Rule};
use kube::{CustomResource, KubeSchema};
use regex::Regex;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::quantity::quantity_schema;
use crate::retention::Retention;

/// PostgreSQL major versions this release of Castellan can run.
pub const SUPPORTED_POSTGRESQL_VERSIONS: [&str; 4] = ["15", "16", "17", "18"];

/// Server parameters Castellan must own: where the server listens, how it replicates,
/// archives and recovers, where its files are, and everything that runs a command or
/// loads code (a superuser's power, which the cluster's users are not given through
/// the spec). Letting a user set them would break failover, backups or the instance
/// manager's control of the server, or escape it, so admission refuses them (and the
/// instance manager again, for a request that did not come through admission).
pub const RESERVED_POSTGRESQL_PARAMETERS: [&str; 41] = [
    "allow_system_table_mods",
    "cluster_name",
    "config_file",
    "data_directory",
    "dynamic_library_path",
    "external_pid_file",
    "full_page_writes",
    "hba_file",
    "hot_standby",
    "ident_file",
    "jit_provider",
    "listen_addresses",
    "local_preload_libraries",
    "log_destination",
    "log_directory",
    "log_filename",
    "logging_collector",
    "max_replication_slots",
    "max_slot_wal_keep_size",
    "max_wal_senders",
    "port",
    "promote_trigger_file",
    "restore_command",
    "session_preload_libraries",
    "shared_preload_libraries",
    "ssl",
    "ssl_ca_file",
    "ssl_cert_file",
    "ssl_crl_dir",
    "ssl_crl_file",
    "ssl_dh_params_file",
    "ssl_key_file",
    "ssl_passphrase_command",
    "ssl_passphrase_command_supports_reload",
    "synchronous_standby_names",
    "unix_socket_directories",
    "unix_socket_group",
    "unix_socket_permissions",
    "wal_keep_size",
    "wal_level",
    "wal_log_hints",
];

/// Prefixes of parameter names Castellan owns, for the families that grow with
/// PostgreSQL releases: `archive_*` (archive_command, archive_library…),
/// `recovery_*` (recovery_end_command, recovery_target_*…), `primary_*`
/// (primary_conninfo, primary_slot_name), `include*` (include, include_dir,
/// include_if_exists: other files read as configuration), and the WAL sender and
/// receiver settings replication and failover are tuned with.
pub const RESERVED_POSTGRESQL_PARAMETER_PREFIXES: [&str; 7] = [
    "archive_",
    "include",
    "primary_",
    "recovery_",
    "wal_receiver_",
    "wal_retrieve_",
    "wal_sender_",
];

/// Settings under a reserved prefix that a user may set all the same: `archive_timeout`
/// (how long a WAL segment with writes in it may stay open before it is closed and
/// archived: the most a point-in-time recovery can miss on a quiet database; Castellan
/// sets 5min when the user does not, as CloudNativePG does).
pub const USER_SETTABLE_RESERVED_PREFIX_PARAMETERS: [&str; 1] = ["archive_timeout"];

/// Roles a `DatabaseCluster` may not name as its application owner: the superuser and
/// the role replicas stream with (Castellan's own), and PostgreSQL's reserved `pg_*`.
pub const RESERVED_ROLES: [&str; 2] = ["postgres", "streaming_replica"];

/// `items` as the elements of a CEL list of strings: `'a', 'b'`.
fn cel_list(items: &[&str]) -> String {
    items
        .iter()
        .map(|item| format!("'{item}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The CEL rule of `bootstrap.initdb.owner`, from [`RESERVED_ROLES`].
fn owner_rule() -> Rule {
    Rule::new(format!(
        "!(self in [{}]) && !self.startsWith('pg_')",
        cel_list(&RESERVED_ROLES)
    ))
    .message("bootstrap.initdb.owner cannot be one of the roles PostgreSQL and Castellan keep for themselves: the superuser 'postgres', the replication role 'streaming_replica', or a pg_ role")
}

/// Whether `name` (case-insensitive, as PostgreSQL reads it) is a setting Castellan
/// owns.
pub fn is_reserved_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    RESERVED_POSTGRESQL_PARAMETERS.contains(&name.as_str())
        || (RESERVED_POSTGRESQL_PARAMETER_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
            && !USER_SETTABLE_RESERVED_PREFIX_PARAMETERS.contains(&name.as_str()))
}

/// What a PostgreSQL setting name must look like: an identifier, or for an
/// extension's setting two joined by a dot (`auto_explain.log_min_duration`).
pub const PARAMETER_NAME_PATTERN: &str = "^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)?$";

/// Why `name = value` cannot go into a configuration file, if it cannot: a name that is
/// no setting name (a space or a line break would inject other settings), a value that
/// would break the file (line breaks, NUL), or a setting Castellan owns.
pub fn parameter_problem(name: &str, value: &str) -> Option<String> {
    // The same pattern admission's CEL rule matches with.
    static NAME: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(PARAMETER_NAME_PATTERN).expect("a valid pattern"));
    if !NAME.is_match(name) {
        return Some(format!(
            "parameter {name:?} is not a PostgreSQL setting name (letters, digits and '_', with one '.' for an extension's setting)"
        ));
    }
    if value.contains(['\n', '\r', '\0']) {
        return Some(format!(
            "the value of parameter {name} holds a line break or NUL, which a configuration file cannot"
        ));
    }
    if is_reserved_parameter(name) {
        return Some(format!(
            "parameter {name} is managed by Castellan and cannot be set"
        ));
    }
    None
}

/// The CEL rules of `spec.parameters`' names, built from the lists above so that
/// admission and the instance manager refuse the same names. The messages are fixed:
/// a message expression naming the parameters (a `filter` over keys of unbounded
/// length) is estimated at over 100 times the API server's cost budget. (The value
/// rule sits on each value, so the error's path names the parameter.)
fn parameter_rules() -> [Rule; 2] {
    let name_ok = format!("k.matches('{PARAMETER_NAME_PATTERN}')");
    let owned = format!(
        "(k.lowerAscii() in [{}] || ([{}].exists(p, k.lowerAscii().startsWith(p)) && !(k.lowerAscii() in [{}])))",
        cel_list(&RESERVED_POSTGRESQL_PARAMETERS),
        cel_list(&RESERVED_POSTGRESQL_PARAMETER_PREFIXES),
        cel_list(&USER_SETTABLE_RESERVED_PREFIX_PARAMETERS)
    );
    [
        Rule::new(format!("self.all(k, {name_ok})")).message(
            "parameter names must be PostgreSQL setting names: letters, digits and _, with one . for an extension's setting such as auto_explain.log_min_duration (no spaces or line breaks)",
        ),
        Rule::new(format!("self.all(k, !{owned})"))
            .message(Message::Message(format!(
                "parameters cannot set what Castellan manages: {}, and every name starting with {} (except {})",
                RESERVED_POSTGRESQL_PARAMETERS.join(", "),
                RESERVED_POSTGRESQL_PARAMETER_PREFIXES.join(", "),
                USER_SETTABLE_RESERVED_PREFIX_PARAMETERS.join(", ")
            )))
            .reason(Reason::FieldValueForbidden),
    ]
}

/// The longest `DatabaseCluster` name. Castellan derives names from it: pods and
/// volumes `<name>-<n>`, Services `<name>-rw`/`-ro`/`-r`, Secrets `<name>-superuser`
/// and `<name>-app`, and the `castellan.io/cluster` label. Services and label values
/// allow 63 characters; 50 leaves room for every suffix Castellan uses or will use.
pub const MAX_NAME_LENGTH: usize = 50;

/// A replicated database cluster.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "castellan.io",
    version = "v1alpha1",
    kind = "DatabaseCluster",
    plural = "databaseclusters",
    namespaced,
    status = "DatabaseClusterStatus",
    shortname = "dbc",
    shortname = "dbcluster",
    category = "castellan",
    printcolumn = r#"{"name":"Engine","type":"string","jsonPath":".spec.engine"}"#,
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".spec.version"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyInstances"}"#,
    printcolumn = r#"{"name":"Primary","type":"string","jsonPath":".status.currentPrimary"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("size(self.metadata.name) <= 50").message("metadata.name must be at most 50 characters: Castellan derives pod, Service, volume and Secret names from it (such as <name>-rw), and those must stay within Kubernetes' 63-character limit").reason(Reason::FieldValueInvalid),
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must start with a lowercase letter and hold only lowercase letters, digits and '-': Services named after it must be DNS labels"),
    // Lowering the version: only back to the version a major upgrade came from, while
    // its data is still kept (a rollback, docs/upgrades.md). The rule sits at the root
    // because it reads the status.
    validation = Rule::new(ROLLBACK_RULE).message(Message::Expression(ROLLBACK_MESSAGE.into())).reason(Reason::FieldValueForbidden).field_path(".spec.version"),
)]
#[x_kube(
    validation = Rule::new("self.engine == 'postgresql'").message("engine 'mariadb' is planned but not supported by this version of Castellan; use engine: postgresql").reason(Reason::FieldValueForbidden).field_path(".engine"),
    validation = Rule::new("self.engine != 'postgresql' || self.version in ['15', '16', '17', '18']").message(Message::Expression("'unsupported PostgreSQL version \"' + self.version + '\": supported major versions are 15, 16, 17 and 18'".into())).reason(Reason::FieldValueInvalid).field_path(".version"),
    validation = Rule::new("!has(self.replication) || self.replication.mode != 'sync' || (has(self.replication.syncReplicas) && self.replication.syncReplicas < self.replicas)").message("with replication.mode sync, replication.syncReplicas is required and must be fewer than replicas: each synchronous standby is one of the replicas other than the primary").field_path(".replication.syncReplicas"),
    validation = Rule::new("!has(self.replication) || self.replication.mode == 'sync' || !has(self.replication.syncReplicas)").message("replication.syncReplicas only applies with replication.mode sync").field_path(".replication.syncReplicas"),
    validation = Rule::new("!has(self.replication) || self.replication.mode == 'sync' || !has(self.replication.dataDurability)").message("replication.dataDurability only applies with replication.mode sync").field_path(".replication.dataDurability"),
    validation = Rule::new("has(self.bootstrap) == has(oldSelf.bootstrap) && (!has(self.bootstrap) || self.bootstrap == oldSelf.bootstrap)").message("bootstrap cannot be changed after the cluster is created: it only says how the first instance was made").reason(Reason::FieldValueForbidden).field_path(".bootstrap"),
)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseClusterSpec {
    /// The database engine. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("engine is immutable: create a new cluster to change engines").reason(Reason::FieldValueForbidden))]
    pub engine: Engine,

    /// The engine's major version, such as "17". May be raised (a major upgrade); lowered
    /// only back to the version an upgrade came from while its data is kept (a
    /// rollback, which loses the writes made since the upgrade).
    #[schemars(length(min = 1, max = 8))]
    pub version: String,

    /// How major upgrades keep what they replace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<UpgradePolicy>,

    /// Number of instances: one primary and `replicas - 1` streaming replicas.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 9))]
    pub replicas: i32,

    /// The volume each instance keeps its data on.
    pub storage: Storage,

    /// How replicas follow the primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<Replication>,

    /// Database server parameters (`postgresql.conf` settings). Names must be setting
    /// names and values single lines; settings Castellan owns (ports, listen
    /// addresses, replication, archiving and recovery, TLS files, anything that runs a
    /// command or loads a library) are refused.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 128, "additionalProperties" = {"type": "string", "maxLength": 1024, "x-kubernetes-validations": [{"rule": "!self.contains('\\n') && !self.contains('\\r') && !self.contains('\\x00')", "message": "parameter values cannot hold line breaks or NUL characters"}]}))]
    #[x_kube(
        validation = parameter_rules()[0].clone(),
        validation = parameter_rules()[1].clone(),
    )]
    pub parameters: BTreeMap<String, String>,

    /// Compute resources of each instance's database container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// How the first instance gets its data. Without it: an empty database made by
    /// initdb with the defaults below. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<Bootstrap>,

    /// Where base backups and archived WAL go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<BackupTarget>,

    /// When another instance takes over from a primary that stopped working.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover: Option<FailoverPolicy>,

    /// How clients reach PostgreSQL: over TLS only, by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsPolicy>,

    /// Whether the superuser `postgres` may log in over the network (with the password
    /// in `<name>-superuser`). Default false: only the instance manager uses it, over
    /// the pod's local socket. Can be switched on a running cluster.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub enable_superuser_access: bool,

    /// More `pg_hba.conf` lines, such as `hostssl shop clerk 10.0.0.0/8 scram-sha-256`
    /// or `host all all 192.168.0.0/16 reject`. They come after Castellan's own lines
    /// (replication, the superuser) and before its default (a password over TLS for
    /// everyone else), so they can refuse or narrow access, or admit by certificate.
    /// Types host, hostssl, hostnossl; methods scram-sha-256, md5, cert, reject; see
    /// docs/security.md. Can be changed on a running cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "pg_hba_schema")]
    pub pg_hba: Vec<String>,
}

/// `spec.pgHba`'s schema: each line checked at admission with the patterns the
/// instance manager checks with again (`crate::pg_hba`).
fn pg_hba_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    use crate::pg_hba::{
        FORM_MESSAGE, IPV6_MESSAGE, IPV6_RULE, MAX_RULE_LENGTH, MAX_RULES, RESERVED_MESSAGE,
        RESERVED_PATTERN, RULE_PATTERN,
    };
    schemars::json_schema!({
        "type": "array",
        "maxItems": MAX_RULES,
        "items": {
            "type": "string",
            "maxLength": MAX_RULE_LENGTH,
            "x-kubernetes-validations": [
                {"rule": format!("self.matches('{}')", *RULE_PATTERN), "message": FORM_MESSAGE},
                {"rule": format!("!self.matches('{}')", *RESERVED_PATTERN), "message": RESERVED_MESSAGE, "reason": "FieldValueForbidden"},
                {"rule": IPV6_RULE, "message": IPV6_MESSAGE},
            ],
        },
    })
}

/// PostgreSQL's TLS. The server certificate (for the Services' names), the
/// replication client certificate and their CA come from Castellan's CA; clients
/// find the CA in the application Secret's `ca.crt`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TlsPolicy {
    /// Also accept clients over plain TCP (password authentication without
    /// encryption). Default false: a connection without TLS is refused. Replication
    /// uses TLS with certificate authentication either way.
    #[serde(default)]
    pub allow_plaintext: bool,

    /// PostgreSQL's server certificate from a Secret of yours (for example one
    /// cert-manager keeps) instead of Castellan's CA: a `kubernetes.io/tls` Secret in
    /// the cluster's namespace with `tls.crt` (intermediates after the leaf),
    /// `tls.key`, and `ca.crt`, the CA clients and replicas verify it with. It must
    /// name `<cluster>-rw.<namespace>.svc`. Followed as it changes (a renewal is
    /// served without a restart); a Secret that is missing or cannot be served is
    /// reported in the `ServerCertificate` condition and never replaces the
    /// certificate being served. May be set, changed or removed on a running cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_certificate: Option<SecretName>,
}

/// A Secret in the cluster's namespace, by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretName {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
}

impl DatabaseClusterSpec {
    /// Whether clients may connect without TLS (`spec.tls.allowPlaintext`).
    pub fn allows_plaintext(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.allow_plaintext)
    }

    /// The Secret of the user's own PostgreSQL server certificate, when they bring one
    /// (`spec.tls.serverCertificate`).
    pub fn server_certificate_secret(&self) -> Option<&str> {
        self.tls
            .as_ref()
            .and_then(|tls| tls.server_certificate.as_ref())
            .map(|secret| secret.secret_name.as_str())
    }
}

/// When another instance takes over from a failed primary.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FailoverPolicy {
    /// How long the primary may be unavailable (unreachable, or its server not
    /// accepting connections) before a replica is promoted, such as `5s` or `1m`.
    /// Default `5s`: a killed server is restarted in place within about a second and
    /// needs no failover. Between `1s` and `10m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9]+(ms|s|m)$') && duration(self) >= duration('1s') && duration(self) <= duration('10m')").message("failover.delay must be a duration between 1s and 10m, such as 5s, 1500ms or 1m"))]
    pub delay: Option<String>,
}

impl FailoverPolicy {
    /// `delay` as a duration, when it is one (admission checks the form).
    pub fn delay(&self) -> Option<std::time::Duration> {
        self.delay.as_deref().and_then(parse_duration)
    }
}

/// The ways to lower `spec.version`: back to the version the data is in (calling off
/// an upgrade that failed or has not started), or back to the `from` of a major upgrade
/// that succeeded while its previous data directory is still kept (a rollback).
const ROLLBACK_RULE: &str = "!(self.spec.version in ['15', '16', '17', '18']) || !(oldSelf.spec.version in ['15', '16', '17', '18']) || int(self.spec.version) >= int(oldSelf.spec.version) || (has(oldSelf.status) && has(oldSelf.status.version) && oldSelf.status.version == self.spec.version) || (has(oldSelf.status) && has(oldSelf.status.upgrade) && oldSelf.status.upgrade.phase == 'Succeeded' && has(oldSelf.status.upgrade.previous) && oldSelf.status.upgrade.previous == 'Kept' && oldSelf.status.upgrade.from == self.spec.version)";

const ROLLBACK_MESSAGE: &str = "'version cannot be lowered from ' + oldSelf.spec.version + ' to ' + self.spec.version + ': a database cannot be downgraded in place; the version can only go back to the one the data is in (status.version), or to the one a major upgrade came from while its previous data is kept (status.upgrade.previous: Kept); otherwise restore a backup into a new cluster'";

/// How a major upgrade keeps the data directory it replaced.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePolicy {
    /// How long the previous major's data directory is kept after an upgrade
    /// succeeded, such as `24h`, `90m` or `0s`; meanwhile lowering `version` back to
    /// it rolls the upgrade back (losing the writes made since). Default `24h`; at
    /// most `720h` (30 days). With `--clone` (btrfs pools) the kept directory shares
    /// its unchanged blocks with the new one; otherwise it is a full copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9]+(s|m|h)$') && duration(self) <= duration('720h')").message("upgrade.keepPreviousFor must be a duration of at most 720h, such as 24h, 90m or 0s"))]
    pub keep_previous_for: Option<String>,
}

impl UpgradePolicy {
    /// The default of `keepPreviousFor`.
    pub const DEFAULT_KEEP: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

    /// `keepPreviousFor` as a duration (the default when unset or unreadable).
    pub fn keep_previous_for(policy: Option<&Self>) -> std::time::Duration {
        policy
            .and_then(|p| p.keep_previous_for.as_deref())
            .and_then(parse_duration)
            .unwrap_or(Self::DEFAULT_KEEP)
    }
}

/// A duration written as a number and one unit: `ms`, `s`, `m` or `h`.
pub fn parse_duration(text: &str) -> Option<std::time::Duration> {
    let (number, unit) = if let Some(ms) = text.strip_suffix("ms") {
        (ms, 1u64)
    } else if let Some(s) = text.strip_suffix('s') {
        (s, 1_000)
    } else if let Some(m) = text.strip_suffix('m') {
        (m, 60_000)
    } else if let Some(h) = text.strip_suffix('h') {
        (h, 3_600_000)
    } else {
        return None;
    };
    let number: u64 = number.parse().ok()?;
    Some(std::time::Duration::from_millis(number.checked_mul(unit)?))
}

fn default_replicas() -> i32 {
    1
}

/// A database engine.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// PostgreSQL.
    Postgresql,
    /// MariaDB (reserved: not supported yet).
    Mariadb,
}

/// Each instance's volume.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.storageClassName) || (has(self.storageClassName) && self.storageClassName == oldSelf.storageClassName)").message("storage.storageClassName cannot be changed once set: existing volumes cannot move between storage classes").reason(Reason::FieldValueForbidden).field_path(".storageClassName"))]
pub struct Storage {
    /// Size of each instance's volume, such as `10Gi`. May grow, never shrink.
    #[schemars(schema_with = "quantity_schema")]
    #[x_kube(
        validation = Rule::new("isQuantity(self)").message("storage.size must be a Kubernetes quantity such as 10Gi or 500M"),
        validation = Rule::new("!isQuantity(self) || quantity(self).isGreaterThan(quantity('0'))").message("storage.size must be greater than zero"),
        validation = Rule::new("!isQuantity(self) || !isQuantity(oldSelf) || quantity(self).compareTo(quantity(oldSelf)) >= 0").message(Message::Expression("'storage.size cannot shrink from ' + oldSelf + ' to ' + self + ': volumes can only grow'".into())).reason(Reason::FieldValueForbidden),
    )]
    pub size: String,

    /// StorageClass of the volumes (for example one a `StoragePool` publishes); the
    /// cluster default when absent. Immutable once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub storage_class_name: Option<String>,
}

/// Streaming replication settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Replication {
    /// `async`: commits return without waiting for replicas. `sync`: a commit returns
    /// once `syncReplicas` replicas (any of them, a quorum) have it.
    #[serde(default)]
    pub mode: ReplicationMode,

    /// With `mode: sync`, how many replicas must confirm each commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("replication.syncReplicas must be at least 1"))]
    pub sync_replicas: Option<i32>,

    /// With `mode: sync`: `required` (the default) never lets a commit return before
    /// `syncReplicas` standbys have it, even when too few of them stream (commits wait),
    /// and promotes a replica only when it can be shown to hold every acknowledged
    /// commit. `preferred` keeps writes going with fewer standbys (down to none) and
    /// promotes the most advanced replica it can see, which may lose the last commits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_durability: Option<DataDurability>,
}

/// Whether synchronous replication may be given up for availability.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataDurability {
    /// Commits wait for the quorum; failover waits until no acknowledged commit can be
    /// lost.
    #[default]
    Required,
    /// Writes go on with fewer synchronous standbys; failover promotes the best replica
    /// it can see.
    Preferred,
}

/// Asynchronous or quorum-synchronous streaming replication.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationMode {
    /// Commits do not wait for replicas.
    #[default]
    Async,
    /// Commits wait for a quorum of replicas (`ANY n`).
    Sync,
}

/// How the first instance gets its data: exactly one method.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.initdb) != has(self.recovery)").message("bootstrap must hold exactly one of initdb or recovery"))]
pub struct Bootstrap {
    /// Create an empty database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initdb: Option<Initdb>,
    /// Restore a backup, optionally to a point in time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
}

/// An empty database made by initdb, with an application database and its owner.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Initdb {
    /// Name of the application database.
    #[serde(default = "default_application_name")]
    #[schemars(length(max = 63))]
    #[x_kube(
        validation = Rule::new("self.matches('^[a-z_][a-z0-9_]*$')").message("bootstrap.initdb.database must start with a lowercase letter or '_' and hold only lowercase letters, digits and '_'"),
        validation = Rule::new("!(self in ['postgres', 'template0', 'template1'])").message("bootstrap.initdb.database cannot be one of PostgreSQL's own databases (postgres, template0, template1)"),
    )]
    pub database: String,

    /// Role that owns the application database; its credentials go into the
    /// `<cluster>-app` Secret.
    #[serde(default = "default_application_name")]
    #[schemars(length(max = 63))]
    #[x_kube(
        validation = Rule::new("self.matches('^[a-z_][a-z0-9_]*$')").message("bootstrap.initdb.owner must start with a lowercase letter or '_' and hold only lowercase letters, digits and '_'"),
        validation = owner_rule(),
    )]
    pub owner: String,
}

fn default_application_name() -> String {
    "app".to_owned()
}

/// Restore a backup: a completed `Backup` of this namespace, or the newest suitable
/// backup found in an object-store location (when the source cluster and its objects
/// are gone).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.backup) != has(self.source)").message("bootstrap.recovery must name exactly one of backup (a Backup in this namespace) or source (an object-store location)"),
    validation = Rule::new("!(has(self.targetTime) && has(self.targetLsn))").message("bootstrap.recovery takes at most one of targetTime and targetLsn"),
    validation = Rule::new("!has(self.source) || has(self.source.path)").message("bootstrap.recovery.source.path is required: the prefix the source cluster archived under, such as default/shop"),
)]
pub struct Recovery {
    /// Name of the `Backup` to restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub backup: Option<String>,

    /// An object-store location a cluster archived to (its `spec.backup` then): the
    /// newest completed base backup there that ends before the target is restored.
    /// `retention` is ignored here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<BackupTarget>,

    /// Replay archived WAL up to this LSN (such as `0/3000060`) instead of a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 17))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$')").message("bootstrap.recovery.targetLsn must be an LSN such as 0/3000060"))]
    pub target_lsn: Option<String>,

    /// Replay archived WAL up to this moment (RFC 3339, such as
    /// `2026-11-30T12:00:00Z`); without it, up to the end of the archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\\\\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$') && timestamp(self) == timestamp(self)").message("bootstrap.recovery.targetTime must be an RFC 3339 timestamp such as 2026-11-30T12:00:00Z"))]
    pub target_time: Option<String>,
}

/// An S3-compatible object store for base backups and WAL.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackupTarget {
    /// URL of the S3 endpoint, such as `https://s3.example.com:9000`.
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("isURL(self) && url(self).getScheme() in ['http', 'https'] && url(self).getHostname() != ''").message("backup.endpoint must be an http:// or https:// URL, such as https://s3.example.com"))]
    pub endpoint: String,

    /// Bucket name.
    #[schemars(length(min = 3, max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9][a-z0-9.-]*[a-z0-9]$')").message("backup.bucket must be a valid S3 bucket name: 3 to 63 lowercase letters, digits, '.' and '-'"))]
    pub bucket: String,

    /// Prefix inside the bucket; defaults to `<namespace>/<cluster>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    #[x_kube(validation = Rule::new("!self.startsWith('/')").message("backup.path is a prefix inside the bucket and must not start with '/'"))]
    pub path: Option<String>,

    /// Region to sign requests for; most S3-compatible stores accept any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub region: Option<String>,

    /// The Secret (in the cluster's namespace) holding the access keys.
    pub credentials: S3Credentials,

    /// The certificate authority (PEM, one or more certificates) that signed an
    /// `https://` endpoint's certificate, when it is a private one; trusted beside the
    /// system's authorities.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "endpointCA"
    )]
    pub endpoint_ca: Option<SecretKey>,

    /// How base backups are compressed: `zstd` (default; level 1, about a fifth of
    /// the data's size for typical tables) or `none` (when the network to the store is
    /// faster than a core compresses). WAL is always compressed with zstd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,

    /// Which backups to keep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,
}

/// How a base backup's tar is stored.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// zstd level 1: `data.tar.zst`.
    #[default]
    Zstd,
    /// The plain tar: `data.tar`.
    None,
}

/// A key of a Secret in the cluster's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKey {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// The key in it; `ca.crt` when absent.
    #[serde(default = "default_ca_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_ca_key() -> String {
    "ca.crt".to_owned()
}

/// Names the Secret and the keys in it that hold S3 credentials.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct S3Credentials {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// Key holding the access key id.
    #[serde(default = "default_access_key_id_key")]
    #[schemars(length(min = 1, max = 253))]
    pub access_key_id_key: String,
    /// Key holding the secret access key.
    #[serde(default = "default_secret_access_key_key")]
    #[schemars(length(min = 1, max = 253))]
    pub secret_access_key_key: String,
}

fn default_access_key_id_key() -> String {
    "accessKeyId".to_owned()
}

fn default_secret_access_key_key() -> String {
    "secretAccessKey".to_owned()
}

/// What Castellan observed of a `DatabaseCluster`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DatabaseClusterStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing`, `Degraded` and others, per the Kubernetes conventions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// One word a person can read: `Creating`, `Ready`, `Scaling`, `Failing over`…
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Pod name of the current primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_primary: Option<String>,
    /// The instance being made primary, during a failover or switchover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_primary: Option<String>,
    /// The cluster has had data. From then on an empty volume is never initialised
    /// again: a primary whose volume was lost is replaced by a replica and rebuilt
    /// from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialized: Option<bool>,
    /// The primary's replication slots and the WAL each holds back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replication_slots: Vec<ReplicationSlotStatus>,
    /// Instances that are ready in their role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_instances: Option<i32>,
    /// Every instance with its role, position and readiness.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceStatus>,
    /// The engine version the instances run now (differs from the spec mid-upgrade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The latest major upgrade (or its rollback), step by step; it stays after it
    /// finished, with what became of the previous data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<UpgradeStatus>,
    /// The earliest moment the cluster can be restored to from its backups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_recoverability_point: Option<String>,
    /// Name of the newest successful `Backup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup: Option<String>,
}

/// A major upgrade as it goes: `phase` is one of `Stopping` (the instances shut down
/// cleanly), `Upgrading` (pg_upgrade on the primary's volume), `Starting` (the upgraded
/// primary starts, replicas are copied from it), `Succeeded`, `Failed` (nothing
/// changed: the instances run `from` again on their untouched data), `RollingBack`
/// and `RolledBack` (back to `from` on the kept previous data).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeStatus {
    /// The major version the data was in.
    pub from: String,
    /// The major version asked for.
    pub to: String,
    pub phase: String,
    /// The instance whose volume is upgraded (the primary when the upgrade started).
    pub instance: String,
    /// How pg_upgrade carried the files: `clone` (reflinks, btrfs) or `copy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The `metadata.generation` that asked for it: a failed upgrade is tried again only
    /// when the spec changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// What happened, or what failed and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The previous major's data directory: `Kept` (a rollback is possible until
    /// `previousKeptUntil`) or `Removed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_kept_until: Option<String>,
    /// The base backup taken after the upgrade (the archive starts a new history).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup: Option<String>,
}

/// One database instance as last observed.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    /// Pod name.
    pub name: String,
    /// Node the pod runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `primary` or `replica`, as the instance manager reports it (what the instance
    /// really runs as, whatever its labels say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Stopped on purpose (`castellan.io/fenced-instances`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
    /// The WAL timeline it is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<i64>,
    /// Current WAL position (write LSN on the primary, replay LSN on a replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lsn: Option<String>,
    /// Replication lag behind the primary, in bytes of WAL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<i64>,
    /// Replication lag behind the primary, in seconds, from the primary's heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_seconds: Option<f64>,
    /// Accepting connections in its role.
    #[serde(default)]
    pub ready: bool,
    /// The health of the pool under this instance's data volume on its node, as that
    /// node's agent reports it: `Healthy`, `Degraded`, `Failed`, … (the worst of its
    /// volumes when it has several). Absent when the volume is not on a Castellan
    /// StoragePool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_health: Option<String>,
}

/// A replication slot on the primary.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReplicationSlotStatus {
    pub name: String,
    /// A standby streams from it now.
    #[serde(default)]
    pub active: bool,
    /// Bytes of WAL the slot keeps on the primary's volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_wal_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost` (a slot past
    /// `max_slot_wal_keep_size` lost WAL its standby needed; that standby is rebuilt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wal_status: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_parameters_are_found_by_name_and_family_in_any_case() {
        for owned in [
            "archive_command",
            "Archive_Library",
            "recovery_end_command",
            "recovery_target_xid",
            "primary_conninfo",
            "include_dir",
            "shared_preload_libraries",
            "ssl_passphrase_command",
            "wal_receiver_status_interval",
        ] {
            assert!(is_reserved_parameter(owned), "{owned}");
        }
        for free in [
            "work_mem",
            "ssl_min_protocol_version",
            "wal_buffers",
            "log_statement",
            "archive_timeout",
            "Archive_Timeout",
        ] {
            assert!(!is_reserved_parameter(free), "{free}");
        }
    }

    #[test]
    fn parameter_names_are_setting_names() {
        assert_eq!(
            parameter_problem("auto_explain.log_min_duration", "1s"),
            None
        );
        assert_eq!(parameter_problem("search_path", "\"$user\", public"), None);
        for bad in [
            " work_mem",
            "work mem",
            "a.b.c",
            "1abc",
            "work_mem\narchive_command",
            "",
        ] {
            let problem = parameter_problem(bad, "x").expect("refused");
            assert!(
                problem.contains("is not a PostgreSQL setting name"),
                "{problem}"
            );
        }
        assert!(
            parameter_problem("search_path", "a\u{0}b")
                .is_some_and(|p| p.contains("line break or NUL"))
        );
    }

    #[test]
    fn the_admission_rules_come_from_the_same_lists() {
        let rules = serde_json::to_string(&parameter_rules()).expect("rules serialise");
        for name in RESERVED_POSTGRESQL_PARAMETERS
            .iter()
            .chain(&RESERVED_POSTGRESQL_PARAMETER_PREFIXES)
        {
            assert!(rules.contains(&format!("'{name}'")), "{name} in {rules}");
        }
        assert!(rules.contains(PARAMETER_NAME_PATTERN));
    }
}
