//! What a single pod's containers get from their node: environment from every kind of
//! reference, ConfigMap/Secret/downward API volumes at their mount paths, init
//! containers in order, probes that gate readiness and restart what is unhealthy, and
//! logs that can be followed to the end of a run.
//! Needs the local cluster with its nodes (see `cluster/mod.rs`).

mod cluster;

use std::time::{Duration, Instant};

use cluster::{Cluster, wait_until};

#[test]
fn environment_config_volumes_and_init_containers() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-env");
    let ns = namespace.name.as_str();
    // Mount points under a directory of this test, removed at the end: a bind mount
    // needs a mount point, which is created on the host when missing.
    let base = std::env::temp_dir().join(ns);
    let base = base.display();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: ConfigMap
metadata: {{name: settings}}
data: {{greeting: hello, file.txt: from-configmap}}
---
apiVersion: v1
kind: Secret
metadata: {{name: credentials}}
stringData: {{password: s3cret}}
---
apiVersion: v1
kind: Pod
metadata:
  name: inspect
  labels: {{tier: test}}
spec:
  restartPolicy: Never
  volumes:
  - {{name: work, emptyDir: {{}}}}
  - {{name: config, configMap: {{name: settings}}}}
  - {{name: secret, secret: {{secretName: credentials}}}}
  - name: podinfo
    downwardAPI:
      items: [{{path: labels, fieldRef: {{fieldPath: metadata.labels}}}}]
  initContainers:
  - name: first
    image: busybox
    command: [sh, -c, 'echo first > {base}/work/order']
    volumeMounts: [{{name: work, mountPath: {base}/work}}]
  - name: second
    image: busybox
    command: [sh, -c, 'echo second >> {base}/work/order']
    volumeMounts: [{{name: work, mountPath: {base}/work}}]
  containers:
  - name: main
    image: busybox
    workingDir: {base}/work
    env:
    - {{name: NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    - {{name: IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
    - {{name: TIER, valueFrom: {{fieldRef: {{fieldPath: "metadata.labels['tier']"}}}}}}
    - {{name: GREETING, valueFrom: {{configMapKeyRef: {{name: settings, key: greeting}}}}}}
    - {{name: PASSWORD, valueFrom: {{secretKeyRef: {{name: credentials, key: password}}}}}}
    - {{name: COMPOSED, value: "$(GREETING)-world"}}
    envFrom: [{{prefix: CM_, configMapRef: {{name: settings}}}}]
    command:
    - sh
    - -c
    - |
      echo "order=$(cat order | tr '\n' ,)"
      echo "name=$NAME tier=$TIER greeting=$GREETING password=$PASSWORD composed=$COMPOSED cm=$CM_greeting"
      echo "ip=$IP pod_ip=$POD_IP pwd=$(pwd) host=$(hostname)"
      echo "file=$(cat {base}/config/file.txt) secret=$(cat {base}/secret/password) labels=$(grep ^tier= {base}/podinfo/labels)"
    volumeMounts:
    - {{name: work, mountPath: {base}/work}}
    - {{name: config, mountPath: {base}/config}}
    - {{name: secret, mountPath: {base}/secret, readOnly: true}}
    - {{name: podinfo, mountPath: {base}/podinfo}}
"#
        ),
    );
    assert_eq!(cluster.wait_finished(ns, "inspect"), "Succeeded");
    let ip = cluster
        .jsonpath(ns, "pod/inspect", "{.status.podIP}")
        .expect("the pod exists");
    let logs = cluster.kubectl(&["logs", "-n", ns, "inspect"]);
    let expected = [
        "order=first,second,".to_string(),
        "name=inspect tier=test greeting=hello password=s3cret composed=hello-world cm=hello"
            .to_string(),
        format!("ip={ip} pod_ip={ip} pwd={base}/work host=inspect"),
        "file=from-configmap secret=s3cret labels=tier=\"test\"".to_string(),
    ];
    assert_eq!(
        logs.lines().collect::<Vec<_>>(),
        expected,
        "the container's output"
    );
    let init_states = cluster
        .jsonpath(
            ns,
            "pod/inspect",
            "{.status.initContainerStatuses[*].state.terminated.reason}",
        )
        .expect("the pod exists");
    assert_eq!(init_states, "Completed Completed");
    let conditions = cluster
        .jsonpath(
            ns,
            "pod/inspect",
            "{.status.conditions[?(@.type==\"Initialized\")].status}",
        )
        .expect("the pod exists");
    assert_eq!(conditions, "True");
    cluster.kubectl(&["delete", "pod", "-n", ns, "inspect", "--wait=true"]);
    std::fs::remove_dir_all(std::env::temp_dir().join(ns)).expect("removing the mount points");
}

#[test]
fn probes_gate_readiness_and_restart_unhealthy_containers() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-probe");
    let ns = namespace.name.as_str();
    let flag = std::env::temp_dir().join(format!("{ns}-ready"));
    let flag = flag.display();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: unhealthy}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'while true; do sleep 0.2; done; : {ns}']
    livenessProbe:
      tcpSocket: {{port: 9}}
      periodSeconds: 1
      failureThreshold: 2
---
apiVersion: v1
kind: Pod
metadata: {{name: gated}}
spec:
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'while true; do sleep 0.2; done; : {ns}']
    startupProbe:
      exec: {{command: ["true"]}}
      periodSeconds: 1
    readinessProbe:
      exec: {{command: [test, -f, {flag}]}}
      periodSeconds: 1
"#
        ),
    );
    // Liveness: nothing listens on port 9, so the container is killed and restarted.
    let restarted = wait_until(Duration::from_secs(60), "a liveness restart", || {
        cluster
            .jsonpath(
                ns,
                "pod/unhealthy",
                "{.status.containerStatuses[0].restartCount}",
            )
            .and_then(|count| count.parse::<u32>().ok())
            .filter(|count| *count >= 1)
    });
    assert!(restarted >= 1);
    let killed_by = cluster
        .jsonpath(
            ns,
            "pod/unhealthy",
            "{.status.containerStatuses[0].lastState.terminated.exitCode}",
        )
        .expect("the pod exists");
    assert!(
        killed_by == "143" || killed_by == "137",
        "exit code of a probe-killed container: {killed_by}"
    );

    // And says so, as a kubelet does, in Events.
    let unhealthy = wait_until(Duration::from_secs(15), "an Unhealthy event", || {
        cluster.event_messages(ns, "reason=Unhealthy,involvedObject.name=unhealthy")
    });
    assert!(
        unhealthy.contains("Liveness probe failed"),
        "Unhealthy events: {unhealthy}"
    );

    // Readiness: started (the startup probe passes) but not Ready until the flag exists.
    wait_until(
        Duration::from_secs(30),
        "the gated pod to run and be started",
        || {
            cluster
                .jsonpath(ns, "pod/gated", "{.status.containerStatuses[0].started}")
                .filter(|started| started == "true")
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        cluster
            .ready_pods(ns, "")
            .iter()
            .all(|(name, _, _)| name != "gated"),
        "Ready before its probe passed"
    );
    std::fs::write(std::env::temp_dir().join(format!("{ns}-ready")), b"")
        .expect("writing the readiness flag");
    wait_until(Duration::from_secs(15), "the gated pod to be Ready", || {
        cluster
            .ready_pods(ns, "")
            .iter()
            .any(|(name, _, _)| name == "gated")
            .then_some(())
    });
    std::fs::remove_file(std::env::temp_dir().join(format!("{ns}-ready")))
        .expect("removing the readiness flag");
    wait_until(
        Duration::from_secs(15),
        "the gated pod to be unready again",
        || {
            cluster
                .ready_pods(ns, "")
                .iter()
                .all(|(name, _, _)| name != "gated")
                .then_some(())
        },
    );
}

#[test]
fn following_logs_ends_with_the_run() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-follow");
    let ns = namespace.name.as_str();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: talker}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'for i in 1 2 3 4 5; do echo "line $i"; sleep 1; done; : {ns}']
"#
        ),
    );
    wait_until(Duration::from_secs(30), "the pod to run", || {
        cluster
            .jsonpath(ns, "pod/talker", "{.status.phase}")
            .filter(|phase| phase == "Running")
    });
    let started = Instant::now();
    let followed = cluster.kubectl(&["logs", "-n", ns, "talker", "-f", "--request-timeout=30s"]);
    assert_eq!(followed, "line 1\nline 2\nline 3\nline 4\nline 5\n");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "following ended with the container"
    );
    let tail = cluster.kubectl(&["logs", "-n", ns, "talker", "--tail=2"]);
    assert_eq!(tail, "line 4\nline 5\n");
}

#[test]
fn processes_that_leave_the_process_group_die_with_their_container() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-escape");
    let ns = namespace.name.as_str();
    // The daemon calls setsid: it is in no process group of the container any more.
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: daemonizer}}
spec:
  terminationGracePeriodSeconds: 2
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'setsid sh -c "while true; do sleep 0.2; done; : {ns}-daemon" & while true; do sleep 0.2; done']
"#
        ),
    );
    // Two process groups carry the namespace's name: the container's, and the daemon's.
    wait_until(
        Duration::from_secs(30),
        "the container and its daemon to run",
        || (cluster::process_groups_with(ns).len() == 2).then_some(()),
    );
    cluster.kubectl(&["delete", "pod", "-n", ns, "daemonizer", "--wait=true"]);
    let left = cluster::processes_with(ns);
    assert!(
        left.is_empty(),
        "processes outlived their container: {left:?}"
    );
}

#[test]
fn in_cluster_clients_reach_the_api_server_with_their_service_account() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-sa");
    let ns = namespace.name.as_str();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: client}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: curlimages/curl
    command:
    - sh
    - -c
    - |
      cd /var/run/secrets/kubernetes.io/serviceaccount
      curl -sS --cacert ca.crt -H "Authorization: Bearer $(cat token)" \
        "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/apis/authentication.k8s.io/v1/selfsubjectreviews" \
        -X POST -H 'Content-Type: application/json' \
        -d '{{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}}'
      echo; echo "namespace=$(cat namespace) {ns}"
"#
        ),
    );
    assert_eq!(cluster.wait_finished(ns, "client"), "Succeeded");
    let logs = cluster.kubectl(&["logs", "-n", ns, "client"]);
    assert!(
        logs.contains(&format!(
            "\"username\": \"system:serviceaccount:{ns}:default\""
        )),
        "the API server saw the pod's service account: {logs}"
    );
    assert!(logs.contains(&format!("namespace={ns}")), "{logs}");
}
