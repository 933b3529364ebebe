//! The API as a user meets it: the CRDs are installed and Established, the examples
//! in `deploy/examples/` are accepted, and `kubectl get castellan` lists every kind
//! with its printer columns.

mod support;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;

use support::manifests::{apply_identity, manifests};
use support::{TestNamespace, can_i, client, kubectl, kubectl_ok, repo};

#[tokio::test]
async fn every_crd_is_installed_and_established() {
    let crds: Api<CustomResourceDefinition> = Api::all(client().await);
    for expected in castellan_crds::render::all() {
        let name = expected
            .metadata
            .name
            .clone()
            .expect("generated CRDs are named");
        let installed = crds
            .get(&name)
            .await
            .unwrap_or_else(|e| panic!("getting CRD {name}: {e}"));
        let established = installed
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        assert!(established, "CRD {name} is Established");
        // The API server fills in defaults (the conversion strategy, listKind), so
        // compare what the types generate: names, scope and every version's schema.
        let mut names = installed.spec.names.clone();
        names.list_kind = expected.spec.names.list_kind.clone();
        assert!(
            names == expected.spec.names
                && installed.spec.scope == expected.spec.scope
                && installed.spec.versions == expected.spec.versions,
            "the installed {name} is not the one generated from the types: run `make crds` and reinstall"
        );
    }
}

#[tokio::test]
async fn examples_are_accepted_and_listed_by_category() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "examples").await;
    let ns = namespace.name.as_str();
    let examples = repo().join("deploy/examples");
    let examples = examples.to_str().expect("repository path is UTF-8");

    // The StoragePool is cluster-scoped: give it a name only this test uses.
    let pool_yaml = std::fs::read_to_string(repo().join("deploy/examples/storagepool.yaml"))
        .expect("reading the StoragePool example");
    let pool_name = format!("example-{}", std::process::id());
    let pool_yaml = pool_yaml.replace("name: fast", &format!("name: {pool_name}"));
    let pool_file = std::env::temp_dir().join(format!("{pool_name}.yaml"));
    std::fs::write(&pool_file, pool_yaml).expect("writing the renamed example");
    let pool_file = pool_file.to_str().expect("temp path is UTF-8");

    kubectl_ok(&["apply", "--dry-run=server", "-f", examples, "-n", ns]);
    for file in ["databasecluster", "backup", "backupschedule"] {
        kubectl_ok(&["apply", "-f", &format!("{examples}/{file}.yaml"), "-n", ns]);
    }
    kubectl_ok(&["apply", "-f", pool_file]);

    let listing = kubectl_ok(&["get", "castellan", "-n", ns]);
    for expected in [
        "databasecluster.castellan.io/orders",
        "backup.castellan.io/orders-manual-1",
        "backupschedule.castellan.io/orders-nightly",
        &format!("storagepool.castellan.io/{pool_name}"),
    ] {
        assert!(
            listing.contains(expected),
            "`kubectl get castellan` lists {expected}:\n{listing}"
        );
    }

    let clusters = kubectl_ok(&["get", "dbc", "-n", ns]);
    let header = clusters.lines().next().unwrap_or_default();
    for column in [
        "NAME", "ENGINE", "VERSION", "REPLICAS", "READY", "PRIMARY", "PHASE", "AGE",
    ] {
        assert!(
            header.contains(column),
            "DatabaseCluster printer columns include {column}: {header}"
        );
    }
    let row = clusters.lines().nth(1).unwrap_or_default();
    assert!(
        row.starts_with("orders") && row.contains("postgresql") && row.contains("17"),
        "the example cluster's row shows its engine and version: {row}"
    );

    let pools = kubectl_ok(&["get", "sp", &pool_name]);
    let header = pools.lines().next().unwrap_or_default();
    for column in ["LAYOUT", "STORAGECLASS", "CAPACITY", "PHASE"] {
        assert!(
            header.contains(column),
            "StoragePool printer columns include {column}: {header}"
        );
    }
    assert!(
        pools.contains("raid1") && pools.contains("castellan-raid1"),
        "{pools}"
    );

    let schedules = kubectl_ok(&["get", "cbs", "-n", ns]);
    assert!(
        schedules.contains("0 3 * * *"),
        "the schedule column shows the cron: {schedules}"
    );
    let backups = kubectl_ok(&["get", "cbk", "-n", ns]);
    assert!(
        backups.contains("objectStore"),
        "the method default is applied: {backups}"
    );

    // Defaults land where a user reads them back.
    let replicas = kubectl_ok(&[
        "get",
        "dbc",
        "orders",
        "-n",
        ns,
        "-o",
        "jsonpath={.spec.backup.credentials.accessKeyIdKey}",
    ]);
    assert_eq!(replicas, "accessKeyId");

    let deleted = kubectl(&["delete", "-f", pool_file]);
    assert!(deleted.status.success(), "deleting the example pool");
}

/// A typo in a field name is refused, not silently dropped: kubectl's strict field
/// validation meets a schema without `x-kubernetes-preserve-unknown-fields`.
#[tokio::test]
async fn a_misspelled_field_is_refused() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "typo").await;
    let manifest = std::env::temp_dir().join(format!("typo-{}.yaml", std::process::id()));
    std::fs::write(
        &manifest,
        "apiVersion: castellan.io/v1alpha1\nkind: DatabaseCluster\nmetadata: {name: typo}\n\
         spec: {engine: postgresql, version: \"17\", replica: 3, storage: {size: 1Gi}}\n",
    )
    .expect("writing the manifest");
    let manifest = manifest.to_str().expect("temp path is UTF-8");
    for mode in ["--server-side=false", "--server-side=true"] {
        let output = kubectl(&["apply", mode, "-f", manifest, "-n", &namespace.name]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "kubectl apply {mode} refuses spec.replica"
        );
        assert!(
            stderr.contains("replica")
                && (stderr.contains("unknown field") || stderr.contains("not declared in schema")),
            "kubectl apply {mode} names the misspelled field: {stderr}"
        );
    }
}

/// The shipped RBAC names no wildcard, and the operator's service account, bound as
/// `deploy/operator/operator.yaml` binds it, cannot make or remove what only the agent
/// manages (StoragePools, BlockDevices) — it may only patch pools and let volumes go, to
/// release a node that never comes back — nor ConfigMaps, which it never uses, nor use
/// a verb it never calls; its leader Lease it keeps only in its own namespace. (The
/// chart's renderings with other values: tests/helm.rs.)
#[tokio::test]
async fn the_shipped_rbac_has_no_wildcards_and_the_operator_only_what_it_uses() {
    for path in ["deploy/operator/operator.yaml", "deploy/agent/agent.yaml"] {
        for role in manifests(path)
            .iter()
            .filter(|d| matches!(d["kind"].as_str(), Some("ClusterRole" | "Role")))
        {
            for rule in role["rules"].as_array().into_iter().flatten() {
                for field in ["apiGroups", "resources", "verbs", "resourceNames"] {
                    let values = rule[field].as_array().into_iter().flatten();
                    assert!(
                        values.into_iter().all(|v| v.as_str() != Some("*")),
                        "{path}: {} grants '*' in {field}: {rule}",
                        role["metadata"]["name"]
                    );
                }
            }
        }
    }

    // Only the identity and its rights: the Deployment would start an operator.
    apply_identity("deploy/operator/operator.yaml");
    let operator = "--as=system:serviceaccount:castellan-system:castellan-operator";
    let can_in =
        |namespace: &str, verb: &str, resource: &str| can_i(verb, resource, namespace, &[operator]);
    let can = |verb: &str, resource: &str| can_in("default", verb, resource);
    let lease = "leases.coordination.k8s.io/castellan-operator";
    assert!(
        can("watch", "databaseclusters.castellan.io"),
        "the binding is in force"
    );
    assert!(can("create", "pods"));
    // The pool releaser (castellan.io/release-nodes).
    assert!(can("patch", "storagepools.castellan.io"));
    assert!(can("delete", "persistentvolumes"));
    for (verb, resource) in [
        ("create", "storagepools.castellan.io"),
        ("update", "storagepools.castellan.io"),
        ("delete", "storagepools.castellan.io"),
        ("delete", "blockdevices.castellan.io"),
        ("patch", "blockdevices.castellan.io"),
        ("get", "configmaps"),
        ("create", "persistentvolumes"),
        ("update", "persistentvolumes"),
        ("update", "pods"),
        ("delete", "services"),
        ("delete", "secrets"),
        ("delete", "databaseclusters.castellan.io"),
        ("update", lease),
    ] {
        assert!(!can(verb, resource), "the operator may {verb} {resource}");
    }
    // Its leader Lease, in its own namespace only.
    assert!(can_in("castellan-system", "update", lease));
    assert!(!can_in(
        "castellan-system",
        "update",
        "leases.coordination.k8s.io/another-lease"
    ));
}
