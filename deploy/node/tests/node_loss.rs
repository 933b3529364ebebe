//! Losing a node: stopping a `castellan-devnode` process ends its pods' processes, the
//! controller-manager marks its Node NotReady, and a Deployment's pods come back on the
//! other nodes; started again, the node is Ready and runs pods anew.
//!
//! Its own test binary, so that no other test runs while a node is down.

mod cluster;

use std::time::Duration;

use cluster::{Cluster, process_groups_with, wait_until};

#[test]
fn a_stopped_node_goes_not_ready_and_its_pods_move() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-loss");
    let ns = namespace.name.as_str();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: spread}}
spec:
  replicas: 3
  selector: {{matchLabels: {{app: spread}}}}
  template:
    metadata: {{labels: {{app: spread}}}}
    spec:
      terminationGracePeriodSeconds: 2
      topologySpreadConstraints:
      # Honor: a lost node (tainted unreachable) does not count in the skew, or the
      # replacement pod could not be placed.
      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, nodeTaintsPolicy: Honor, labelSelector: {{matchLabels: {{app: spread}}}}}}
      containers:
      - name: main
        image: busybox
        command: [sh, -c, 'while true; do sleep 0.2; done; : {ns}']
"#
        ),
    );
    let pods = wait_until(Duration::from_secs(90), "3 ready pods", || {
        let ready = cluster.ready_pods(ns, "app=spread");
        (ready.len() == 3).then_some(ready)
    });
    let victim = "node-3";
    let on_victim: Vec<String> = pods
        .iter()
        .filter(|(_, _, node)| node == victim)
        .map(|(name, _, _)| name.clone())
        .collect();
    assert_eq!(on_victim.len(), 1, "one pod per node: {pods:?}");
    let processes_before = process_groups_with(ns).len();
    assert_eq!(processes_before, 3, "one process per pod");

    let _restart = RestartOnFailure {
        cluster: &cluster,
        node: victim,
    };
    cluster.nodes_script(&["stop", victim]);
    // Its processes die with it, at once.
    wait_until(
        Duration::from_secs(5),
        "the lost node's process to die",
        || (process_groups_with(ns).len() == 2).then_some(()),
    );
    wait_until(Duration::from_secs(60), "the Node to go NotReady", || {
        cluster
            .jsonpath(
                "default",
                &format!("node/{victim}"),
                "{.status.conditions[?(@.type==\"Ready\")].status}",
            )
            .filter(|status| status != "True")
    });
    // Tainted unreachable, its pods are evicted after the 20 s toleration and the
    // ReplicaSet replaces them on one of the two nodes left.
    let moved = wait_until(
        Duration::from_secs(120),
        "the Deployment to be whole again elsewhere",
        || {
            let ready = cluster.ready_pods(ns, "app=spread");
            let elsewhere = ready.iter().filter(|(_, _, node)| node != victim).count();
            (elsewhere == 3).then_some(ready)
        },
    );
    assert!(
        moved.iter().all(|(name, _, _)| !on_victim.contains(name)),
        "replacement pods are new: {moved:?}"
    );
    assert_eq!(process_groups_with(ns).len(), 3);

    cluster.nodes_script(&["start", victim]);
    wait_until(
        Duration::from_secs(60),
        "the Node to be Ready again",
        || {
            cluster
                .jsonpath(
                    "default",
                    &format!("node/{victim}"),
                    "{.status.conditions[?(@.type==\"Ready\")].status}",
                )
                .filter(|status| status == "True")
        },
    );
    // Back, the node finishes the deletion of its evicted pod and runs nothing of it.
    wait_until(
        Duration::from_secs(60),
        "the evicted pod to be gone",
        || {
            on_victim
                .iter()
                .all(|name| {
                    cluster
                        .try_kubectl(&["get", "pod", "-n", ns, name])
                        .is_none()
                })
                .then_some(())
        },
    );
    assert_eq!(process_groups_with(ns).len(), 3);
}

/// Brings the stopped node back if the test fails half-way, so that the tests after it
/// find the cluster whole.
struct RestartOnFailure<'a> {
    cluster: &'a Cluster,
    node: &'static str,
}

impl Drop for RestartOnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.cluster.try_nodes_script(&["start", self.node]) {
            eprintln!(
                "could not start {} again: run deploy/local/nodes.sh start {}",
                self.node, self.node
            );
        }
    }
}
