//! Workloads on the process-backed nodes, checked from outside as a user would: with
//! kubectl, HTTP requests to pod and Service addresses, and the host's process table.
//! Needs the local cluster with its nodes and proxy (see `cluster/mod.rs`).

mod cluster;

use std::time::Duration;

use cluster::{Cluster, http_status, processes_with, real_uid, wait_until};

/// A Deployment or StatefulSet pod template of python's HTTP server, listening on the
/// pod's own address and Ready once it answers.
fn http_server_template(app: &str, marker: &str) -> String {
    format!(
        r#"
    metadata:
      labels: {{app: {app}}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: server
        image: docker.io/library/python:3
        command: [python3, -u, -m, http.server, --bind, $(POD_IP), "8080", --directory, /srv]
        env: [{{name: MARKER, value: {marker}}}]
        ports: [{{name: http, containerPort: 8080}}]
        readinessProbe:
          httpGet: {{path: /, port: http}}
          periodSeconds: 1
        volumeMounts: [{{name: content, mountPath: /srv}}]
      volumes:
      - name: content
        downwardAPI:
          items: [{{path: name, fieldRef: {{fieldPath: metadata.name}}}}]
"#
    )
}

fn wait_ready_count(
    cluster: &Cluster,
    namespace: &str,
    selector: &str,
    count: usize,
) -> Vec<(String, String, String)> {
    wait_until(
        Duration::from_secs(90),
        &format!("{count} ready pods {selector}"),
        || {
            let ready = cluster.ready_pods(namespace, selector);
            (ready.len() == count).then_some(ready)
        },
    )
}

#[test]
fn deployment_serves_on_pod_ips_and_through_its_service_and_scales() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-deploy");
    let ns = namespace.name.as_str();
    let manifest = format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:{template}
---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: http}}]
"#,
        template = http_server_template("web", ns),
    );
    cluster.apply(ns, &manifest);
    let pods = wait_ready_count(&cluster, ns, "app=web", 2);
    for (name, ip, _) in &pods {
        assert!(ip.starts_with("127."), "pod {name} has address {ip}");
        assert_eq!(
            http_status(&format!("{ip}:8080")),
            Some(200),
            "pod {name} at {ip}:8080"
        );
    }
    let cluster_ip = cluster
        .jsonpath(ns, "service/web", "{.spec.clusterIP}")
        .expect("the Service exists");
    wait_until(Duration::from_secs(10), "the Service to answer", || {
        (http_status(&format!("{cluster_ip}:80")) == Some(200)).then_some(())
    });
    assert_eq!(servers_in(ns), 2);

    cluster.kubectl(&["scale", "-n", ns, "deployment/web", "--replicas", "3"]);
    wait_ready_count(&cluster, ns, "app=web", 3);
    wait_until(Duration::from_secs(30), "3 server processes", || {
        (servers_in(ns) == 3).then_some(())
    });
    cluster.kubectl(&["scale", "-n", ns, "deployment/web", "--replicas", "1"]);
    wait_until(Duration::from_secs(60), "1 server process", || {
        (servers_in(ns) == 1).then_some(())
    });
    let remaining = wait_ready_count(&cluster, ns, "app=web", 1);
    // The Service follows: every request lands on the one pod left.
    wait_until(
        Duration::from_secs(10),
        "the Service to reach the remaining pod",
        || {
            (0..5)
                .all(|_| http_status(&format!("{cluster_ip}:80")) == Some(200))
                .then_some(())
        },
    );
    assert_eq!(remaining.len(), 1);
}

/// Server processes of the pods in `namespace`, found by the MARKER in their environment.
fn servers_in(namespace: &str) -> usize {
    let marker = format!("MARKER={namespace}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            environ
                .split(|byte| *byte == 0)
                .any(|entry| entry == marker.as_bytes())
                && String::from_utf8_lossy(&cmdline).contains("http.server")
        })
        .count()
}

#[test]
fn statefulset_pods_get_stable_names_and_answer_on_their_addresses() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-sts");
    let ns = namespace.name.as_str();
    let manifest = format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: db}}
spec:
  clusterIP: None
  selector: {{app: db}}
  ports: [{{port: 8080, name: http}}]
---
apiVersion: v1
kind: Service
metadata: {{name: db-any}}
spec:
  selector: {{app: db}}
  ports: [{{port: 8080, targetPort: 8080}}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: db}}
spec:
  serviceName: db
  replicas: 2
  selector: {{matchLabels: {{app: db}}}}
  template:{template}
"#,
        template = http_server_template("db", ns)
    );
    cluster.apply(ns, &manifest);
    let pods = wait_ready_count(&cluster, ns, "app=db", 2);
    let mut names: Vec<&str> = pods.iter().map(|(name, _, _)| name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["db-0", "db-1"]);
    for (name, ip, _) in &pods {
        // The downwardAPI volume mounted at /srv holds the pod's name: the server serves it.
        let body = http_get_body(&format!("{ip}:8080"), "/name").expect("the pod answers");
        assert_eq!(body, *name, "pod {name} at {ip} serves its own name");
    }
    let cluster_ip = cluster
        .jsonpath(ns, "service/db-any", "{.spec.clusterIP}")
        .expect("the Service exists");
    let mut seen = std::collections::BTreeSet::new();
    wait_until(
        Duration::from_secs(15),
        "the Service to reach both pods",
        || {
            if let Some(body) = http_get_body(&format!("{cluster_ip}:8080"), "/name") {
                seen.insert(body);
            }
            (seen.len() == 2).then_some(())
        },
    );
    assert_eq!(servers_in(ns), 2);
}

fn http_get_body(address: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let socket: std::net::SocketAddr = address.parse().ok()?;
    let mut stream = std::net::TcpStream::connect_timeout(&socket, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.contains(" 200 ").then(|| body.to_string())
}

#[test]
fn logs_restarts_and_previous_logs() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-logs");
    let ns = namespace.name.as_str();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: crasher}}
spec:
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'echo "run $(cat /proc/self/stat | cut -d" " -f1) {ns}"; sleep 1; exit 3']
"#
        ),
    );
    let restarts = |cluster: &Cluster| -> u32 {
        cluster
            .jsonpath(
                ns,
                "pod/crasher",
                "{.status.containerStatuses[0].restartCount}",
            )
            .and_then(|count| count.parse().ok())
            .unwrap_or(0)
    };
    wait_until(Duration::from_secs(60), "2 restarts", || {
        (restarts(&cluster) >= 2).then_some(())
    });
    let last_exit = cluster
        .jsonpath(
            ns,
            "pod/crasher",
            "{.status.containerStatuses[0].lastState.terminated.exitCode}",
        )
        .expect("the pod exists");
    assert_eq!(last_exit, "3");
    let reason = wait_until(Duration::from_secs(30), "CrashLoopBackOff", || {
        cluster
            .jsonpath(
                ns,
                "pod/crasher",
                "{.status.containerStatuses[0].state.waiting.reason}",
            )
            .filter(|reason| reason == "CrashLoopBackOff")
    });
    assert_eq!(reason, "CrashLoopBackOff");
    let current = cluster.kubectl(&["logs", "-n", ns, "crasher"]);
    let previous = cluster.kubectl(&["logs", "-n", ns, "crasher", "--previous"]);
    assert!(
        current.starts_with("run ") && current.contains(ns),
        "current log: {current:?}"
    );
    assert!(
        previous.starts_with("run ") && previous.contains(ns),
        "previous log: {previous:?}"
    );
    assert_ne!(current, previous, "each run logs its own pid");
    let later = wait_until(Duration::from_secs(90), "a third restart", || {
        let count = restarts(&cluster);
        (count >= 3).then_some(count)
    });
    assert!(later >= 3);
}

#[test]
fn deletion_sends_sigterm_and_run_as_user_is_the_real_uid() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-term");
    let ns = namespace.name.as_str();
    let witness = std::env::temp_dir().join(ns);
    std::fs::create_dir_all(&witness).expect("creating the witness directory");
    std::fs::set_permissions(
        &witness,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("opening the witness directory");
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: graceful}}
spec:
  terminationGracePeriodSeconds: 20
  securityContext: {{runAsUser: 4321, runAsGroup: 4321}}
  volumes: [{{name: witness, hostPath: {{path: {witness}}}}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'trap "echo SIGTERM > /witness/signal; exit 0" TERM; echo started > /witness/started; while true; do sleep 0.1; done; : {ns}']
    volumeMounts: [{{name: witness, mountPath: /witness}}]
"#,
            witness = witness.display()
        ),
    );
    wait_until(Duration::from_secs(60), "the pod to be Ready", || {
        (cluster.ready_pods(ns, "").len() == 1).then_some(())
    });
    wait_until(Duration::from_secs(10), "the container to start", || {
        witness.join("started").exists().then_some(())
    });
    let pids = processes_with(ns);
    assert!(!pids.is_empty(), "no process of the pod found");
    for pid in &pids {
        assert_eq!(real_uid(*pid), Some(4321), "uid of process {pid}");
    }
    let started = std::time::Instant::now();
    cluster.kubectl(&["delete", "pod", "-n", ns, "graceful", "--wait=true"]);
    let signal = std::fs::read_to_string(witness.join("signal"))
        .expect("the process wrote what it received");
    assert_eq!(signal.trim(), "SIGTERM");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "a process that exits on SIGTERM does not wait out the grace period"
    );
    assert!(
        processes_with(ns).is_empty(),
        "the pod's processes are gone once it is deleted"
    );
    std::fs::remove_dir_all(&witness).expect("removing the witness directory");
}

#[test]
fn sigkill_after_the_grace_period() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-kill");
    let ns = namespace.name.as_str();
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: stubborn}}
spec:
  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'trap "echo ignoring SIGTERM" TERM; while true; do sleep 0.1; done; : {ns}']
"#
        ),
    );
    wait_until(Duration::from_secs(60), "the pod to be Ready", || {
        (cluster.ready_pods(ns, "").len() == 1).then_some(())
    });
    let started = std::time::Instant::now();
    cluster.kubectl(&["delete", "pod", "-n", ns, "stubborn", "--wait=true"]);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "deleted after {took:?}, before the grace period ended"
    );
    assert!(took < Duration::from_secs(15), "deleted after {took:?}");
    assert!(processes_with(ns).is_empty());
}

#[test]
fn local_volume_binds_on_first_consumer_and_the_pod_writes_into_it() {
    let cluster = Cluster::get();
    let namespace = cluster.namespace("devnode-pv");
    let ns = namespace.name.as_str();
    let directory = std::env::temp_dir().join(format!("{ns}-pv"));
    std::fs::create_dir_all(&directory).expect("creating the PV's directory");
    let class = format!("{ns}-local");
    let manifest = format!(
        r#"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: {class}}}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {ns}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: {class}
  persistentVolumeReclaimPolicy: Retain
  local: {{path: {path}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [node-2]}}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: data}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: {class}
  resources: {{requests: {{storage: 1Gi}}}}
"#,
        path = directory.display()
    );
    cluster.apply(ns, &manifest);
    // WaitForFirstConsumer: no binding before a pod uses the claim.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        cluster
            .jsonpath(ns, "pvc/data", "{.status.phase}")
            .as_deref(),
        Some("Pending")
    );
    cluster.apply(
        ns,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: writer}}
spec:
  restartPolicy: Never
  volumes: [{{name: data, persistentVolumeClaim: {{claimName: data}}}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'echo "written by $(hostname)" > /var/lib/data/proof; : {ns}']
    volumeMounts: [{{name: data, mountPath: /var/lib/data}}]
"#
        ),
    );
    let phase = cluster.wait_finished(ns, "writer");
    assert_eq!(phase, "Succeeded");
    assert_eq!(
        cluster
            .jsonpath(ns, "pvc/data", "{.status.phase}")
            .as_deref(),
        Some("Bound")
    );
    assert_eq!(
        cluster
            .jsonpath(ns, "pod/writer", "{.spec.nodeName}")
            .as_deref(),
        Some("node-2")
    );
    let proof = std::fs::read_to_string(directory.join("proof"))
        .expect("the pod wrote into the PV's directory");
    assert_eq!(proof.trim(), "written by writer");
    // The mount was the container's own: the host has no /var/lib/data/proof.
    assert!(!std::path::Path::new("/var/lib/data/proof").exists());
    cluster.kubectl(&["delete", "pod", "-n", ns, "writer", "--wait=true"]);

    // The directory gone (its disk lost): a pod of the claim does not start on an
    // empty directory made in its place, as a kubelet does not; it waits, saying why,
    // and starts once the directory is back.
    std::fs::remove_dir_all(&directory).expect("removing the PV's directory");
    let reader = format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: reader}}
spec:
  restartPolicy: Never
  volumes: [{{name: data, persistentVolumeClaim: {{claimName: data}}}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'test -e /var/lib/data/back; : {ns}']
    volumeMounts: [{{name: data, mountPath: /var/lib/data}}]
"#
    );
    cluster.apply(ns, &reader);
    let refused = wait_until(Duration::from_secs(30), "a FailedMount Event", || {
        cluster
            .event_messages(ns, "reason=FailedMount")
            .filter(|messages| messages.contains("does not exist"))
    });
    println!("a lost local volume: {refused}");
    assert!(
        !directory.exists(),
        "the node made the lost directory again"
    );
    assert_ne!(
        cluster
            .jsonpath(ns, "pod/reader", "{.status.phase}")
            .as_deref(),
        Some("Succeeded")
    );
    std::fs::create_dir_all(&directory).expect("bringing the PV's directory back");
    std::fs::write(directory.join("back"), "").expect("marking it");
    let phase = cluster.wait_finished(ns, "reader");
    assert_eq!(phase, "Succeeded", "it ran on the directory that came back");
    cluster.kubectl(&["delete", "pod", "-n", ns, "reader", "--wait=true"]);
    cluster.kubectl(&["delete", "pvc", "-n", ns, "data", "--wait=true"]);
    cluster.kubectl(&["delete", "pv", ns, "--wait=true"]);
    cluster.kubectl(&["delete", "storageclass", &class]);
    std::fs::remove_dir_all(&directory).expect("removing the PV's directory");
}
