//! Castellan's operator as a host process for the end-to-end tests, scoped to one
//! namespace (so that tests running side by side do not act on each other's clusters),
//! and plain HTTP GETs of its endpoints.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::kubeconfig_path;
use super::postgres::postgres_ids;

pub fn http_get(address: &str, path: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5", "-w", "\n%{http_code}"])
        .arg(format!("http://{address}{path}"))
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// The operator as a host process, stopped when dropped.
pub struct Operator {
    child: Child,
    pub address: &'static str,
    pub log: PathBuf,
}

impl Operator {
    pub fn start(namespace: &str, address: &'static str) -> Self {
        let (uid, gid) = postgres_ids();
        let (uid, gid) = (uid.to_string(), gid.to_string());
        let log_path =
            std::env::temp_dir().join(format!("operator-{}-{address}.log", std::process::id()));
        let log = std::fs::File::create(&log_path).expect("operator log");
        let child = Command::new(env!("CARGO_BIN_EXE_castellan"))
            .args(["operator", "--postgres-uid", &uid, "--postgres-gid", &gid])
            .args([
                "--metrics-address",
                address,
                "--namespace",
                namespace,
                "--identity",
                address,
            ])
            .env("KUBECONFIG", kubeconfig_path())
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting castellan operator");
        Self {
            child,
            address,
            log: log_path,
        }
    }

    pub fn is_leader(&self) -> bool {
        http_get(self.address, "/metrics")
            .1
            .contains("castellan_leader 1\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
