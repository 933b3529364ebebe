//! `kubectl castellan`, end to end: the built binary run as `kubectl-castellan` (a
//! symlink of that name, as `make up` installs it) against a 2-instance cluster that
//! archives to the local S3 server, one cluster for every step: `status` as a table
//! within 80 columns without colour codes off a terminal and as JSON (also through
//! kubectl's plugin discovery), `logs` (also to a reader that leaves after a line) and `psql`, fence/unfence and switchover
//! changing the annotations with the cluster following, `reload` and `restart` done
//! once on every instance (the configuration's load time and the postmaster's start
//! time move) and recorded as handled, `backup` to completion off a terminal and, in a
//! tmux terminal of fixed size, with its progress bar rendered and ending at 100%, and
//! `report` with every object and log and no Secret value in it.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use support::cluster::{
    LocalVolumes, Operator, describe, events, jsonpath, phase_and_ready, try_superuser, wait_for,
};
use support::faults::postmaster_started;
use support::{TestNamespace, client, kubeconfig_path, kubectl_ok, kubectl_program, s3};

const CLUSTER: &str = "shop";
const OPERATOR: &str = "127.0.71.1:8080";

/// A directory holding the binary as `kubectl-castellan`, the name kubectl looks for.
struct Plugin {
    dir: PathBuf,
    namespace: String,
}

impl Plugin {
    fn install(namespace: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("plugin-bin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for the plugin");
        let link = dir.join("kubectl-castellan");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_castellan"), &link)
            .expect("linking kubectl-castellan");
        Self {
            dir,
            namespace: namespace.to_owned(),
        }
    }

    fn program(&self) -> PathBuf {
        self.dir.join("kubectl-castellan")
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(self.program())
            .arg("-n")
            .arg(&self.namespace)
            .args(args)
            .env("KUBECONFIG", kubeconfig_path())
            .output()
            .expect("running kubectl-castellan")
    }

    /// Runs it and returns stdout, failing the test with stderr when it fails.
    fn ok(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            output.status.success(),
            "kubectl castellan {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn annotation(namespace: &str, key: &str) -> String {
    let key = key.replace('.', "\\.").replace('/', "\\/");
    jsonpath(
        "dbc",
        CLUSTER,
        namespace,
        &format!("{{.metadata.annotations.{key}}}"),
    )
}

async fn conf_load_time(namespace: &str, pod: &str) -> Result<String, String> {
    let mut connection = try_superuser(namespace, CLUSTER, pod).await?;
    sqlx::query_scalar::<_, String>("select pg_conf_load_time()::text")
        .fetch_one(&mut connection)
        .await
        .map_err(|e| e.to_string())
}

/// Every value of `namespace`'s Secrets that is secret (not a user name, database,
/// host, port or certificate), decoded.
fn secret_values(namespace: &str) -> Vec<String> {
    let list: serde_json::Value = serde_json::from_str(&kubectl_ok(&[
        "get", "secrets", "-n", namespace, "-o", "json",
    ]))
    .expect("secrets as JSON");
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|secret| secret["data"].as_object().cloned().unwrap_or_default())
        .filter(|(key, _)| {
            !["username", "dbname", "host", "port", "ca.crt", "tls.crt"].contains(&key.as_str())
        })
        .filter_map(|(_, value)| {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(value.as_str()?)
                .ok()?;
            Some(String::from_utf8_lossy(&bytes).into_owned())
        })
        .filter(|value| !value.is_empty())
        .collect()
}

/// Every file under `dir`, as (path, text).
fn files_under(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)
        .expect("reading the bundle")
        .flatten()
    {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            let text = String::from_utf8_lossy(&std::fs::read(&path).expect("a file")).into_owned();
            out.push((path, text));
        }
    }
    out
}

/// A tmux server of this test's own (its socket name), killed on drop.
struct Tmux(String);

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let output = Command::new("tmux")
            .args(["-L", &self.0])
            .args(args)
            .output()
            .expect("running tmux (deploy/local/deps.sh installs it)");
        assert!(
            output.status.success(),
            "tmux {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.0, "kill-server"])
            .status();
    }
}

#[tokio::test]
async fn kubectl_castellan_reads_and_drives_a_cluster() {
    let client = client().await;
    let namespace = TestNamespace::create(&client, "plugin").await;
    let ns = namespace.name.clone();
    let volumes = LocalVolumes::create(&format!("{ns}-local"), 1);
    let operator = Operator::start(&ns, OPERATOR);
    let logs = vec![operator.log.clone()];
    let diagnostics = || describe(&ns, &logs);
    s3::archiving_cluster(&ns, CLUSTER, 2, &volumes.class, "", diagnostics);
    let plugin = Plugin::install(&ns);
    let primary = jsonpath("dbc", CLUSTER, &ns, "{.status.currentPrimary}");
    let replica = if primary == format!("{CLUSTER}-1") {
        format!("{CLUSTER}-2")
    } else {
        format!("{CLUSTER}-1")
    };

    // status: a table that fits 80 columns, no colour codes into a pipe.
    let table = plugin.ok(&["status", CLUSTER]);
    eprintln!("kubectl castellan status {CLUSTER}:\n{table}");
    for needle in [
        format!("{ns}/{CLUSTER}"),
        primary.clone(),
        replica.clone(),
        "primary".into(),
        "replica".into(),
        "ContinuousArchiving".into(),
        "Ready".into(),
    ] {
        assert!(table.contains(&needle), "{needle} in\n{table}");
    }
    for line in table.lines() {
        assert!(line.chars().count() <= 80, "wider than 80: {line:?}");
    }
    assert!(
        !table.contains('\u{1b}'),
        "colour codes off a terminal:\n{table}"
    );
    // … and as JSON, through kubectl's own plugin discovery (PATH).
    let path = format!(
        "{}:{}",
        plugin.dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new(kubectl_program())
        .args(["castellan", "-n", &ns, "status", CLUSTER, "-o", "json"])
        .env("PATH", &path)
        .env("KUBECONFIG", kubeconfig_path())
        .output()
        .expect("running kubectl castellan");
    assert!(
        output.status.success(),
        "kubectl castellan status -o json: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).expect("status as JSON");
    assert_eq!(status["primary"], primary.as_str());
    assert_eq!(status["instances"].as_array().map(Vec::len), Some(2));
    assert_eq!(status["archiving"]["status"], "True", "{status}");

    // logs: both instances, each line with its pod.
    let lines = plugin.ok(&["logs", CLUSTER, "--tail", "3"]);
    for pod in [&primary, &replica] {
        assert!(lines.contains(&format!("[{pod}] ")), "{pod} in\n{lines}");
    }
    // Read by something that stops after a line (`| head -1`): the plugin ends quietly,
    // as command-line tools do, and does not panic on the closed pipe.
    let mut follow = Command::new(plugin.program())
        .args(["-n", &plugin.namespace, "logs", CLUSTER, "--follow"])
        .env("KUBECONFIG", kubeconfig_path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running kubectl-castellan logs --follow");
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(follow.stdout.take().expect("stdout")),
        &mut first,
    )
    .expect("the first line of the logs");
    assert!(first.starts_with('['), "{first}");
    // The reader is gone now: the next line it writes (PostgreSQL logs the failing
    // statement) ends the plugin.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ended = loop {
        let _ = plugin.run(&["psql", CLUSTER, "--", "-tAc", "select 1/0"]);
        match follow.try_wait().expect("waiting for the plugin") {
            Some(status) => break Some(status),
            None if Instant::now() > deadline => {
                let _ = follow.kill();
                break None;
            }
            None => std::thread::sleep(Duration::from_secs(1)),
        }
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut follow.stderr.take().expect("stderr"), &mut stderr)
        .expect("its stderr");
    assert!(
        ended.is_some_and(|status| status.success()),
        "logs --follow after its reader left: {ended:?}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // psql: the application user through the -rw Service, over verified TLS.
    let answer = plugin.ok(&[
        "psql",
        CLUSTER,
        "--",
        "-tAc",
        "select current_user || ' ' || pg_is_in_recovery()",
    ]);
    assert_eq!(answer.trim(), "clerk false");
    let answer = plugin.ok(&[
        "psql",
        CLUSTER,
        "--replica",
        "--",
        "-tAc",
        "select pg_is_in_recovery()",
    ]);
    assert_eq!(answer.trim(), "t");
    // A failing statement: psql's own error and exit status (1), nothing added.
    let failed = plugin.run(&["psql", CLUSTER, "--", "-tAc", "select 1/0"]);
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("division by zero"), "{stderr}");
    assert!(!stderr.contains("Error:"), "{stderr}");

    // fence / unfence: the annotation, and the instance stops and runs again.
    plugin.ok(&["fence", CLUSTER, &replica]);
    assert_eq!(
        annotation(&ns, "castellan.io/fenced-instances"),
        format!("[\"{replica}\"]")
    );
    let fenced = || {
        jsonpath(
            "dbc",
            CLUSTER,
            &ns,
            &format!("{{.status.instances[?(@.name==\"{replica}\")].fenced}}"),
        )
    };
    wait_for(
        "the replica fenced",
        Duration::from_secs(60),
        || fenced() == "true",
        diagnostics,
    );
    plugin.ok(&["unfence", CLUSTER, &replica]);
    assert_eq!(annotation(&ns, "castellan.io/fenced-instances"), "");
    wait_for(
        "the replica unfenced and the cluster Ready/2",
        Duration::from_secs(90),
        || fenced().is_empty() && phase_and_ready(&ns, CLUSTER) == "Ready/2",
        diagnostics,
    );

    // reload: once on every instance, then recorded as handled.
    let mut loaded = Vec::new();
    for pod in [&primary, &replica] {
        loaded.push(
            conf_load_time(&ns, pod)
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        );
    }
    plugin.ok(&["reload", CLUSTER]);
    let asked = annotation(&ns, "castellan.io/reload");
    assert!(!asked.is_empty(), "the reload annotation is set");
    wait_for(
        "the reload recorded as handled",
        Duration::from_secs(60),
        || annotation(&ns, "castellan.io/reloaded") == asked,
        diagnostics,
    );
    for (pod, before) in [&primary, &replica].into_iter().zip(&loaded) {
        let after = conf_load_time(&ns, pod)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(&after > before, "{pod} reloaded: {before} → {after}");
    }
    assert!(
        events(&ns, "ReloadCompleted").contains(&asked),
        "{}",
        events(&ns, "ReloadCompleted")
    );

    // restart: every postmaster starts again, replica first, and it is done once.
    let started: Vec<_> = [&primary, &replica]
        .into_iter()
        .map(|pod| postmaster_started(&ns, pod).expect("a running postmaster"))
        .collect();
    // postmaster.pid counts whole seconds.
    std::thread::sleep(Duration::from_millis(1100));
    plugin.ok(&["restart", CLUSTER]);
    let asked = annotation(&ns, "castellan.io/restart");
    wait_for(
        "the restart recorded as handled",
        Duration::from_secs(120),
        || annotation(&ns, "castellan.io/restarted") == asked,
        diagnostics,
    );
    for (pod, before) in [&primary, &replica].into_iter().zip(&started) {
        let after = postmaster_started(&ns, pod);
        assert!(
            after.is_some_and(|after| after > *before),
            "{pod} restarted: {before:?} → {after:?}"
        );
    }
    let rolling = events(&ns, "RollingRestart");
    assert!(
        rolling.find(&replica) < rolling.find(&primary),
        "replica first: {rolling}"
    );
    wait_for(
        "Ready/2 after the restart",
        Duration::from_secs(90),
        || phase_and_ready(&ns, CLUSTER) == "Ready/2",
        diagnostics,
    );
    let restarted_once = postmaster_started(&ns, &replica);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        postmaster_started(&ns, &replica),
        restarted_once,
        "a handled restart is not done again"
    );

    // switchover: the annotation; the replica becomes primary and it is removed.
    plugin.ok(&["switchover", CLUSTER, &replica]);
    wait_for(
        "the switchover carried out",
        Duration::from_secs(90),
        || {
            jsonpath("dbc", CLUSTER, &ns, "{.status.currentPrimary}") == replica
                && annotation(&ns, "castellan.io/switchover-to").is_empty()
                && phase_and_ready(&ns, CLUSTER) == "Ready/2"
        },
        diagnostics,
    );

    // Enough data that a backup shows progress for a moment (about 60 MiB).
    let mut connection = try_superuser(&ns, CLUSTER, &replica)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "create table filler as select g as id, repeat(md5(g::text), 16) as pad \
         from generate_series(1, 100000) g",
    )
    .execute(&mut connection)
    .await
    .expect("writing filler");
    drop(connection);

    // backup off a terminal: plain progress lines, the result on stdout.
    let output = plugin.run(&["backup", CLUSTER, "--name", "plain"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("backup plain: Completed 100%"), "{stderr}");
    assert!(
        stdout.contains("backup plain of shop completed"),
        "{stdout}"
    );
    assert_eq!(
        jsonpath("backup", "plain", &ns, "{.status.phase}"),
        "Completed"
    );

    // backup with its standard error a pipe nobody reads any more (a wrapper that
    // stopped listening): the progress lines fail with EPIPE, and the wait still ends
    // well with the result on stdout.
    let mut child = Command::new(plugin.program())
        .args(["-n", &ns, "backup", CLUSTER, "--name", "quiet"])
        .env("KUBECONFIG", kubeconfig_path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running kubectl-castellan");
    drop(child.stderr.take());
    let output = child
        .wait_with_output()
        .expect("waiting for kubectl-castellan");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{:?}: {stdout}", output.status);
    assert!(
        stdout.contains("backup quiet of shop completed"),
        "{stdout}"
    );

    // backup on a terminal: a tmux pane of 100×12; its bar while it runs and at the end.
    let tmux = Tmux(format!("castellan-plugin-{}", std::process::id()));
    let command = format!(
        "{} -n {ns} backup {CLUSTER} --name tty; echo EXIT=$?; sleep 600",
        plugin.program().display()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "backup",
        "-x",
        "100",
        "-y",
        "12",
        "-e",
        &format!("KUBECONFIG={}", kubeconfig_path().display()),
        &command,
    ]);
    let mut screens = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let last = loop {
        let screen = tmux.run(&["capture-pane", "-p", "-t", "backup"]);
        if screen.contains("EXIT=") {
            break screen;
        }
        assert!(
            Instant::now() < deadline,
            "the backup never ended:\n{screen}"
        );
        screens.push(screen);
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        screens
            .iter()
            .any(|s| s.lines().any(|l| l.contains(" tty [") && l.contains('%'))),
        "the bar rendered while it ran; screens:\n{}",
        screens.join("\n---\n")
    );
    eprintln!(
        "the pane while the backup ran ({} captures):\n{}\nat the end:\n{last}",
        screens.len(),
        screens.last().map_or("", String::as_str)
    );
    assert!(last.contains("EXIT=0"), "{last}");
    let bar = last
        .lines()
        .find(|l| l.contains(" tty ["))
        .unwrap_or_else(|| panic!("the bar stays on the screen:\n{last}"));
    assert!(bar.contains("100%"), "{bar}");
    assert!(bar.contains("completed"), "{bar}");
    assert!(bar.contains("[====="), "a full bar: {bar}");
    assert!(last.contains("backup tty of shop completed"), "{last}");
    assert_eq!(
        jsonpath("backup", "tty", &ns, "{.status.progressPercent}"),
        "100"
    );

    // report: a tar.gz with the objects, logs and status; no Secret value in it.
    let work = std::env::temp_dir().join(format!("plugin-report-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("a directory for the report");
    let archive = work.join("report.tar.gz");
    plugin.ok(&["report", CLUSTER, "-o", archive.to_str().expect("utf-8")]);
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&work)
        .status()
        .expect("running tar");
    assert!(status.success(), "the report is a tar.gz");
    let bundle = work.join(format!("{CLUSTER}-report"));
    for file in [
        "databasecluster.yaml",
        "pods.yaml",
        "persistentvolumeclaims.yaml",
        "services.yaml",
        "backups.yaml",
        "events.yaml",
        "secrets.txt",
        "status.txt",
        "status.json",
    ] {
        assert!(bundle.join(file).is_file(), "{file} in the report");
    }
    for pod in [&primary, &replica] {
        let log = std::fs::read_to_string(bundle.join(format!("logs/{pod}.log")))
            .unwrap_or_else(|e| panic!("the log of {pod}: {e}"));
        assert!(!log.is_empty(), "{pod}'s log has lines");
    }
    let secrets = std::fs::read_to_string(bundle.join("secrets.txt")).expect("secrets.txt");
    assert!(secrets.contains(&format!("{CLUSTER}-app")), "{secrets}");
    assert!(secrets.contains("password: <redacted>"), "{secrets}");
    let values = secret_values(&ns);
    assert!(values.len() >= 4, "the cluster's Secrets hold values");
    for (path, text) in files_under(&bundle) {
        for value in &values {
            assert!(
                !text.contains(value.as_str()),
                "a Secret value in {}",
                path.display()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    drop(operator);
}
