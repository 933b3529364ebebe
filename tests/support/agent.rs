//! The node agent on the local cluster, as the storage tests use it: the DaemonSet that
//! `deploy/local/agent.sh` deploys, and the cluster's state directory its disks and
//! pools live in.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The local cluster's state directory: the kubeconfig's.
pub fn dev_dir() -> PathBuf {
    super::kubeconfig_path()
        .parent()
        .expect("the kubeconfig is in the cluster's state directory")
        .to_path_buf()
}

/// Deploys (or keeps) the agent DaemonSet.
pub fn agent_up(dev: &Path) {
    let output = Command::new(super::repo().join("deploy/local/agent.sh"))
        .arg("up")
        .env("CASTELLAN_DEV_DIR", dev)
        .output()
        .expect("running deploy/local/agent.sh");
    assert!(
        output.status.success(),
        "agent.sh up failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
