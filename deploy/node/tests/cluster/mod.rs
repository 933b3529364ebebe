//! The local cluster as the node tests see it: kubectl against `CASTELLAN_KUBECONFIG`
//! (set by `make test`), a namespace per test that is deleted (and checked to leave no
//! process behind) when the test ends, and the host's processes.
//!
//! The nodes and the proxy must already run (`deploy/local/nodes.sh up`); a test fails,
//! never skips, when they do not.

#![allow(dead_code)] // Each test binary uses a different part of this module.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub struct Cluster {
    pub kubeconfig: PathBuf,
    pub dev_dir: PathBuf,
    kubectl: PathBuf,
}

impl Cluster {
    /// The cluster named by `CASTELLAN_KUBECONFIG`, with its process-backed nodes Ready.
    pub fn get() -> Self {
        let kubeconfig = PathBuf::from(std::env::var("CASTELLAN_KUBECONFIG").expect(
            "CASTELLAN_KUBECONFIG must name the local cluster's kubeconfig (make test sets it; \
             by hand: CASTELLAN_KUBECONFIG=.dev/kubeconfig after cluster.sh up and nodes.sh up)",
        ));
        let dev_dir = kubeconfig
            .parent()
            .expect("the kubeconfig is in the cluster's directory")
            .to_path_buf();
        let kubectl = dev_dir.join("bin/kubectl");
        assert!(kubectl.exists(), "no kubectl at {}", kubectl.display());
        let cluster = Self {
            kubeconfig,
            dev_dir,
            kubectl,
        };
        let ready = cluster.kubectl(&[
            "get",
            "nodes",
            "-l",
            "node.castellan.io/process-backed=true",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Ready\")].status} {end}",
        ]);
        let ready_count = ready
            .split_whitespace()
            .filter(|node| node.ends_with("=True"))
            .count();
        assert!(
            ready_count >= 3,
            "the tests need 3 Ready process-backed nodes, found: {ready:?} (start them with deploy/local/nodes.sh up)"
        );
        cluster
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.kubectl);
        command.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        command
    }

    /// Runs kubectl; panics with its output when it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let output = self.command(args).output().expect("running kubectl");
        assert!(
            output.status.success(),
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs kubectl; its stdout, or None when it fails.
    pub fn try_kubectl(&self, args: &[&str]) -> Option<String> {
        let output = self.command(args).output().expect("running kubectl");
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
    }

    pub fn apply(&self, namespace: &str, manifest: &str) {
        let mut child = self
            .command(&["apply", "-n", namespace, "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running kubectl apply");
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("kubectl's stdin")
            .write_all(manifest.as_bytes())
            .expect("writing the manifest to kubectl");
        let output = child.wait_with_output().expect("waiting for kubectl apply");
        assert!(
            output.status.success(),
            "kubectl apply failed: {}\n{manifest}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// Runs a `deploy/local/nodes.sh` command against this cluster.
    pub fn nodes_script(&self, args: &[&str]) {
        assert!(
            self.try_nodes_script(args),
            "nodes.sh {} failed",
            args.join(" ")
        );
    }

    /// Runs a `deploy/local/nodes.sh` command; whether it succeeded.
    pub fn try_nodes_script(&self, args: &[&str]) -> bool {
        // The package root when the test runs (cargo sets it), not when it was compiled:
        // a test binary from a shared build cache may come from another checkout.
        let package = std::env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
        let script = package.join("../local/nodes.sh");
        Command::new(&script)
            .args(args)
            .env("CASTELLAN_DEV_DIR", &self.dev_dir)
            .status()
            .is_ok_and(|status| status.success())
    }

    /// A fresh namespace, deleted when the returned guard drops.
    pub fn namespace(&self, prefix: &str) -> Namespace<'_> {
        let name = format!("{prefix}-{}", std::process::id());
        self.kubectl(&["create", "namespace", &name]);
        // The ServiceAccount controller creates `default` shortly after; pods need it.
        wait_until(
            Duration::from_secs(30),
            "the default ServiceAccount",
            || {
                self.try_kubectl(&["get", "serviceaccount", "default", "-n", &name])
                    .map(|_| ())
            },
        );
        Namespace {
            cluster: self,
            name,
        }
    }

    /// `kubectl get -o jsonpath` of one object, or None when it does not exist.
    pub fn jsonpath(&self, namespace: &str, object: &str, path: &str) -> Option<String> {
        self.try_kubectl(&[
            "get",
            "-n",
            namespace,
            object,
            "-o",
            &format!("jsonpath={path}"),
        ])
    }

    /// Waits up to 60 s until pod `pod` has finished; its phase (`Succeeded`, `Failed`).
    pub fn wait_finished(&self, namespace: &str, pod: &str) -> String {
        wait_until(
            Duration::from_secs(60),
            &format!("pod {pod} to finish"),
            || {
                self.jsonpath(namespace, &format!("pod/{pod}"), "{.status.phase}")
                    .filter(|phase| phase == "Succeeded" || phase == "Failed")
            },
        )
    }

    /// The messages of the namespace's Events that `field_selector` selects, space
    /// separated; None while there is none.
    pub fn event_messages(&self, namespace: &str, field_selector: &str) -> Option<String> {
        self.try_kubectl(&[
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            field_selector,
            "-o",
            "jsonpath={.items[*].message}",
        ])
        .filter(|messages| !messages.is_empty())
    }

    /// Names of the pods matching `selector` that are Ready.
    pub fn ready_pods(&self, namespace: &str, selector: &str) -> Vec<(String, String, String)> {
        let mut args = vec!["get", "pods", "-n", namespace];
        if !selector.is_empty() {
            args.extend(["-l", selector]);
        }
        args.extend([
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.status.podIP} {.spec.nodeName} {.metadata.deletionTimestamp} {.status.conditions[?(@.type==\"Ready\")].status}\n{end}",
        ]);
        let out = self.kubectl(&args);
        out.lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                match fields.as_slice() {
                    [name, ip, node, "True"] => {
                        Some((name.to_string(), ip.to_string(), node.to_string()))
                    }
                    _ => None,
                }
            })
            .collect()
    }
}

pub struct Namespace<'a> {
    cluster: &'a Cluster,
    pub name: String,
}

impl Drop for Namespace<'_> {
    fn drop(&mut self) {
        let _ = self.cluster.try_kubectl(&[
            "delete",
            "namespace",
            &self.name,
            "--wait=true",
            "--timeout=120s",
        ]);
        if std::thread::panicking() {
            return;
        }
        // Nothing the test started may outlive its namespace.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !processes_with(&self.name).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        let left = processes_with(&self.name);
        assert!(
            left.is_empty(),
            "processes of namespace {} still run: {left:?}",
            self.name
        );
    }
}

/// Polls `check` until it returns Some, or panics naming `what` after `timeout`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Pids of the processes whose command line or environment mentions `marker` (tests
/// put their namespace's name in their containers' command lines or environment).
pub fn processes_with(marker: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let own = std::process::id();
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != own)
        .filter(|pid| {
            ["cmdline", "environ"].iter().any(|file| {
                std::fs::read(format!("/proc/{pid}/{file}"))
                    .map(|contents| String::from_utf8_lossy(&contents).contains(marker))
                    .unwrap_or(false)
            })
        })
        .collect()
}

/// Process groups (one per container run) of the processes `processes_with(marker)`
/// finds: a count that a shell forking a child for a moment does not change.
pub fn process_groups_with(marker: &str) -> std::collections::BTreeSet<u32> {
    processes_with(marker)
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields after the parenthesised command name: state, ppid, pgrp, …
            stat[stat.rfind(')')? + 1..]
                .split_whitespace()
                .nth(2)?
                .parse()
                .ok()
        })
        .collect()
}

/// The real uid of a process.
pub fn real_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// An HTTP GET over a fresh connection; the status code, or None if nothing answered.
pub fn http_status(address: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let socket: std::net::SocketAddr = address.parse().ok()?;
    let mut stream = std::net::TcpStream::connect_timeout(&socket, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET / HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_whitespace().nth(1)?.parse().ok()
}
