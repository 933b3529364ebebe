//! The Helm chart (`deploy/helm/castellan`) as a user installs it: it lints, the API
//! server accepts what it renders (cluster-wide, and for one watched namespace), the
//! plain manifests in `deploy/` are its rendering and its CRDs are `crds/`, no role it
//! renders has a wildcard, and an operator installed for one namespace can read
//! Secrets there and nowhere else. helm is the pinned one `deploy/helm/build.sh`
//! builds (`make test` builds it beside the control plane).
//!
//! What RBAC cannot say about the agent (no pool's spec, no other node's volumes) is
//! its admission policies' job; `tests/admission.rs` shows them with real requests on
//! the plain manifests, which `the_plain_manifests_are_the_chart_rendered` holds equal
//! to the chart's.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::{TestNamespace, can_i, client, kubectl, kubectl_ok, repo};

/// The pinned helm, built (once per machine) by `deploy/helm/build.sh`.
fn helm() -> PathBuf {
    let output = Command::new(repo().join("deploy/helm/build.sh"))
        .output()
        .expect("running deploy/helm/build.sh");
    assert!(
        output.status.success(),
        "deploy/helm/build.sh failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

fn chart() -> PathBuf {
    repo().join("deploy/helm/castellan")
}

/// Runs helm with `args`, failing the test with its stderr.
fn helm_ok(args: &[&str]) -> String {
    let helm = helm();
    let output = Command::new(&helm)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", helm.display()));
    assert!(
        output.status.success(),
        "helm {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `helm template` of the chart as `release` in `namespace`, with `--set`s.
fn render(release: &str, namespace: &str, sets: &[&str]) -> String {
    let chart = chart();
    let mut args = vec![
        "template",
        release,
        chart.to_str().expect("utf-8 path"),
        "--namespace",
        namespace,
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    helm_ok(&args)
}

fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|document| {
            serde::Deserialize::deserialize(document)
                .unwrap_or_else(|e| panic!("parsing helm's output: {e}\n{yaml}"))
        })
        .filter(|document: &Value| !document.is_null())
        .collect()
}

fn kinds(yaml: &str) -> Vec<String> {
    documents(yaml)
        .iter()
        .filter_map(|d| d["kind"].as_str().map(str::to_owned))
        .collect()
}

/// Writes `yaml` to a file of its own and returns its path.
fn temp_file(name: &str, yaml: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("helm-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[test]
fn the_chart_lints() {
    let chart = chart();
    let chart = path_str(&chart);
    helm_ok(&["lint", "--strict", chart]);
    helm_ok(&[
        "lint",
        "--strict",
        chart,
        "--set",
        "watchNamespace=databases",
    ]);
}

/// The chart carries the CRDs (helm installs its `crds/` before anything else); they
/// are copies of `crds/`, which `make crds` generates and writes to both.
#[test]
fn the_charts_crds_are_the_generated_ones() {
    let listing = |dir: &Path| -> Vec<(String, String)> {
        let mut files: Vec<(String, String)> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
            .map(|path| {
                let name = path
                    .file_name()
                    .expect("a file")
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                (name, text)
            })
            .collect();
        files.sort();
        files
    };
    let generated = listing(&repo().join("crds"));
    assert!(!generated.is_empty(), "crds/ has the CRDs");
    let names = |files: &[(String, String)]| files.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
    let carried = listing(&chart().join("crds"));
    assert_eq!(
        names(&carried),
        names(&generated),
        "deploy/helm/castellan/crds/ holds other files than crds/; run `make crds`"
    );
    for ((name, ours), (_, theirs)) in carried.iter().zip(&generated) {
        assert!(
            ours == theirs,
            "deploy/helm/castellan/crds/{name} differs from crds/{name}; run `make crds`"
        );
    }
}

/// `deploy/operator/*.yaml` and `deploy/agent/*.yaml` are the chart rendered with its
/// defaults by `make manifests` (deploy/helm/manifests.sh); this renders them again and
/// fails when a file in the repository is stale or edited by hand.
#[test]
fn the_plain_manifests_are_the_chart_rendered() {
    let out = std::env::temp_dir().join(format!("helm-manifests-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let helm = helm();
    let output = Command::new(repo().join("deploy/helm/manifests.sh"))
        .arg(&helm)
        .arg(&out)
        .output()
        .expect("running deploy/helm/manifests.sh");
    assert!(
        output.status.success(),
        "deploy/helm/manifests.sh failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for file in [
        "deploy/operator/operator.yaml",
        "deploy/operator/policies.yaml",
        "deploy/agent/agent.yaml",
        "deploy/agent/policies.yaml",
    ] {
        let rendered = std::fs::read_to_string(out.join(file))
            .unwrap_or_else(|e| panic!("reading the rendered {file}: {e}"));
        let committed = std::fs::read_to_string(repo().join(file))
            .unwrap_or_else(|e| panic!("reading {file}: {e}"));
        assert!(
            rendered == committed,
            "{file} is not the chart's rendering; edit deploy/helm/castellan and run `make manifests`"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// No Role or ClusterRole the chart renders, with any of the values that change RBAC,
/// grants a wildcard; and one watched namespace leaves nothing but Nodes and
/// StorageClasses in the operator's ClusterRole.
#[test]
fn no_rendered_role_has_a_wildcard() {
    for sets in [
        &[][..],
        &["watchNamespace=databases"][..],
        &["watchNamespace=databases", "caSecret=my-ca"][..],
    ] {
        let rendered = render("castellan", "castellan-system", sets);
        let roles: Vec<Value> = documents(&rendered)
            .into_iter()
            .filter(|d| matches!(d["kind"].as_str(), Some("ClusterRole" | "Role")))
            .collect();
        assert!(
            roles.len() >= 3,
            "{sets:?}: the operator's and the agent's roles"
        );
        for role in &roles {
            for rule in role["rules"].as_array().into_iter().flatten() {
                for field in ["apiGroups", "resources", "verbs", "resourceNames"] {
                    assert!(
                        rule[field]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .all(|v| v != "*"),
                        "{sets:?}: {} grants '*' in {field}: {rule}",
                        role["metadata"]["name"]
                    );
                }
            }
        }
        if !sets.is_empty() {
            let cluster_role = roles
                .iter()
                .find(|r| {
                    r["kind"] == "ClusterRole" && r["metadata"]["name"] == "castellan-operator"
                })
                .expect("the operator's ClusterRole");
            let resources: Vec<&str> = cluster_role["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|rule| rule["resources"].as_array().into_iter().flatten())
                .filter_map(Value::as_str)
                .collect();
            assert_eq!(
                resources,
                ["nodes", "storageclasses"],
                "{sets:?}: a namespaced operator's ClusterRole"
            );
        }
    }
}

/// A cluster-wide operator releases the pools of nodes that never come back
/// (`--release-pools`): it may list, watch and patch pools and their status and let
/// volumes go, and nothing more on them; a namespaced one neither runs it nor has it.
#[test]
fn only_a_cluster_wide_operator_releases_pools_with_just_those_rights() {
    let rules_of = |sets: &[&str]| -> Vec<(String, Vec<String>)> {
        let rendered = render("castellan", "castellan-system", sets);
        let role = documents(&rendered)
            .into_iter()
            .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "castellan-operator")
            .expect("the operator's ClusterRole");
        let mut rules = Vec::new();
        for rule in role["rules"].as_array().into_iter().flatten() {
            let verbs: Vec<String> = rule["verbs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            for resource in rule["resources"].as_array().into_iter().flatten() {
                rules.push((
                    resource.as_str().unwrap_or_default().to_string(),
                    verbs.clone(),
                ));
            }
        }
        rules
    };
    let wide = rules_of(&[]);
    let verbs = |resource: &str| -> Vec<String> {
        wide.iter()
            .filter(|(r, _)| r == resource)
            .flat_map(|(_, verbs)| verbs.clone())
            .collect()
    };
    assert_eq!(verbs("storagepools"), ["list", "watch", "patch"]);
    assert_eq!(verbs("storagepools/status"), ["patch"]);
    assert_eq!(verbs("persistentvolumes"), ["list", "patch", "delete"]);
    let rendered = render("castellan", "castellan-system", &[]);
    assert!(
        rendered.contains("CASTELLAN_RELEASE_POOLS"),
        "the cluster-wide operator runs the releaser"
    );
    let namespaced = render(
        "castellan",
        "castellan-system",
        &["watchNamespace=databases"],
    );
    assert!(!namespaced.contains("CASTELLAN_RELEASE_POOLS"));
    assert!(
        !rules_of(&["watchNamespace=databases"])
            .iter()
            .any(|(resource, _)| resource.starts_with("storagepools")
                || resource == "persistentvolumes")
    );
}

/// The Prometheus Operator's kinds need its CRDs: rendered only when asked for.
#[test]
fn monitors_are_rendered_only_when_enabled() {
    let default = kinds(&render("castellan", "castellan-system", &[]));
    assert!(
        !default
            .iter()
            .any(|k| k == "PodMonitor" || k == "ServiceMonitor"),
        "no monitor by default: {default:?}"
    );
    let enabled = kinds(&render(
        "castellan",
        "castellan-system",
        &[
            "metrics.podMonitor.enabled=true",
            "metrics.serviceMonitor.enabled=true",
        ],
    ));
    for kind in ["PodMonitor", "ServiceMonitor", "Service"] {
        assert!(
            enabled.iter().any(|k| k == kind),
            "{kind} when enabled: {enabled:?}"
        );
    }
}

/// What the chart renders, cluster-wide and for one watched namespace, is accepted by
/// the API server as it stands (the CRDs installed, admission run in full): a server
/// dry run of everything, as `helm install` would send it.
#[tokio::test]
async fn the_api_server_accepts_the_rendered_chart() {
    let client = client().await;
    let home = TestNamespace::create(&client, "helm-dry").await;
    let watched = TestNamespace::create(&client, "helm-dry-watched").await;
    let release = format!("dry-{}", std::process::id());
    let with_namespace = format!("watchNamespace={}", watched.name);
    for (label, sets) in [
        ("cluster-wide", vec![]),
        (
            "namespaced",
            vec![with_namespace.as_str(), "caSecret=my-ca"],
        ),
    ] {
        let rendered = render(&release, &home.name, &sets);
        let file = temp_file(&format!("dry-{label}"), &rendered);
        let output = kubectl(&["apply", "--dry-run=server", "-f", path_str(&file)]);
        let _ = std::fs::remove_file(&file);
        assert!(
            output.status.success(),
            "{label}: the API server refuses the chart's rendering: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let applied = String::from_utf8_lossy(&output.stdout);
        for kind in [
            "deployment.apps",
            "daemonset.apps",
            "validatingadmissionpolicy",
        ] {
            assert!(
                applied.contains(kind),
                "{label}: {kind} was sent: {applied}"
            );
        }
    }
}

/// An operator installed for one namespace, its identity and rights applied for real
/// (a release of its own beside the tests' operator), may read and write Secrets and
/// pods in the namespace it watches, and may not read a Secret anywhere else; in its
/// own namespace it reads only its CA and keeps only its Lease. And the verbs it never
/// calls are not granted.
#[tokio::test]
async fn a_namespaced_operator_reads_secrets_only_where_it_watches() {
    let client = client().await;
    let home = TestNamespace::create(&client, "helm-home").await;
    let watched = TestNamespace::create(&client, "helm-watched").await;
    let other = TestNamespace::create(&client, "helm-other").await;
    let release = format!("ns-{}", std::process::id());
    let rendered = render(
        &release,
        &home.name,
        &[&format!("watchNamespace={}", watched.name)],
    );
    let identity: Vec<String> = documents(&rendered)
        .into_iter()
        .filter(|d| {
            matches!(
                d["kind"].as_str(),
                Some(
                    "ServiceAccount"
                        | "Role"
                        | "RoleBinding"
                        | "ClusterRole"
                        | "ClusterRoleBinding"
                )
            )
        })
        .map(|d| serde_json::to_string(&d).expect("JSON"))
        .collect();
    let file = temp_file(
        "identity",
        &format!(
            "{{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[{}]}}",
            identity.join(",")
        ),
    );
    kubectl_ok(&["apply", "-f", path_str(&file)]);

    let operator = format!(
        "--as=system:serviceaccount:{}:{release}-operator",
        home.name
    );
    let agent = format!("--as=system:serviceaccount:{}:{release}-agent", home.name);
    let can = |who: &str, verb: &str, resource: &str, namespace: &str| {
        can_i(verb, resource, namespace, &[who])
    };
    let (home, watched, other) = (&home.name, &watched.name, &other.name);
    for (verb, resource, namespace) in [
        ("get", "secrets", watched.as_str()),
        ("list", "secrets", watched),
        ("create", "pods", watched),
        ("patch", "databaseclusters.castellan.io", watched),
        ("create", "persistentvolumeclaims", watched),
        ("list", "nodes", watched),
        ("get", "storageclasses.storage.k8s.io", watched),
        ("get", "secrets/castellan-ca", home),
        // A CA rotation rewrites it, and tells how it stands in Events about it.
        ("update", "secrets/castellan-ca", home),
        ("patch", "secrets/castellan-ca", home),
        ("create", "events.events.k8s.io", home),
        // The image catalog: made when missing, read and watched by name.
        ("watch", "configmaps/castellan-images", home),
        ("create", "configmaps", home),
        ("create", "secrets", home),
        ("get", "leases.coordination.k8s.io/castellan-operator", home),
        (
            "update",
            "leases.coordination.k8s.io/castellan-operator",
            home,
        ),
        ("create", "leases.coordination.k8s.io", home),
    ] {
        assert!(
            can(&operator, verb, resource, namespace),
            "the namespaced operator may {verb} {resource} in {namespace}"
        );
    }
    assert!(
        can_i(
            "patch",
            "databaseclusters.castellan.io",
            watched,
            &["--subresource=status", &operator]
        ),
        "the namespaced operator may patch its clusters' status"
    );
    for (verb, resource, namespace) in [
        // Another namespace: nothing of what it manages.
        ("get", "secrets", other.as_str()),
        ("list", "secrets", other),
        ("get", "secrets", "default"),
        ("create", "pods", other),
        ("watch", "databaseclusters.castellan.io", other),
        // Its own namespace: its CA and its Lease, nothing else.
        ("get", "secrets/someone-elses", home),
        ("update", "secrets/someone-elses", home),
        ("get", "configmaps/someone-elses", home),
        ("update", "configmaps/castellan-images", home),
        ("list", "secrets", home),
        ("list", "pods", home),
        ("update", "leases.coordination.k8s.io/another-lease", home),
        (
            "get",
            "leases.coordination.k8s.io/castellan-operator",
            watched,
        ),
        // Verbs it never calls, where it manages.
        ("update", "pods", watched),
        ("delete", "services", watched),
        ("delete", "secrets", watched),
        ("update", "databaseclusters.castellan.io", watched),
        ("delete", "databaseclusters.castellan.io", watched),
        ("get", "configmaps", watched),
        // What only the agent manages.
        ("patch", "storagepools.castellan.io", watched),
        ("delete", "persistentvolumes", watched),
    ] {
        assert!(
            !can(&operator, verb, resource, namespace),
            "the namespaced operator may {verb} {resource} in {namespace}"
        );
    }
    // The agent: what it calls, and not what it never does (RBAC; which node's objects
    // is admission's, tests/admission.rs).
    assert!(can(&agent, "patch", "storagepools.castellan.io", "default"));
    assert!(can(&agent, "delete", "persistentvolumes", "default"));
    for (verb, resource) in [
        ("create", "storagepools.castellan.io"),
        ("update", "storagepools.castellan.io"),
        ("delete", "storagepools.castellan.io"),
        ("delete", "blockdevices.castellan.io"),
        ("get", "secrets"),
        ("create", "pods"),
        ("update", "persistentvolumes"),
        ("delete", "storageclasses.storage.k8s.io"),
    ] {
        assert!(
            !can(&agent, verb, resource, other),
            "the agent may {verb} {resource}"
        );
    }

    // The cluster-scoped objects outlive the namespaces; the rest goes with them.
    let _ = kubectl(&["delete", "-f", path_str(&file), "--wait=false"]);
    let _ = std::fs::remove_file(&file);
}
