//! The PostgreSQL server process: started as a child of the instance manager (which
//! is PID 1 of the pod), stopped with a fast shutdown, and watched for exits.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use super::bootstrap::{Binaries, BootstrapError};

/// A running (or exited) `postgres` process.
pub struct Postmaster {
    child: Child,
}

impl Postmaster {
    /// Starts `postgres` on `data_dir`. What it prints (before its logging collector
    /// runs; then its log comes through the pipes of `pglog`) is passed on as the
    /// manager's own lines, so the pod's log holds the server log in one format.
    pub fn start(binaries: &Binaries, data_dir: &Path) -> Result<Self, BootstrapError> {
        let program = binaries.program("postgres");
        let mut child = Command::new(&program)
            .arg("-D")
            .arg(data_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // If the manager dies, the server must not run on unsupervised.
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| BootstrapError::Spawn {
                program: program.display().to_string(),
                source,
            })?;
        super::pglog::pass_on_output(&mut child);
        Ok(Self { child })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Resolves when the server exits.
    pub async fn exited(&mut self) -> std::io::Result<ExitStatus> {
        self.child.wait().await
    }

    /// Stops the server (`pg_ctl stop -m <mode>`) and waits for it to exit.
    pub async fn stop(
        mut self,
        binaries: &Binaries,
        data_dir: &Path,
        mode: Shutdown,
        timeout: Duration,
    ) -> Result<(), BootstrapError> {
        let data = data_dir.to_string_lossy();
        let seconds = timeout.as_secs().max(1).to_string();
        let stopped = binaries
            .run(
                "pg_ctl",
                &[
                    "stop",
                    "-D",
                    &data,
                    "-m",
                    mode.as_str(),
                    "-w",
                    "-t",
                    &seconds,
                ],
                &[],
            )
            .await;
        if stopped.is_err() {
            // Not stoppable politely (hung, or already gone): make sure it is gone.
            let _ = self.child.start_kill();
        }
        let _ = self.child.wait().await;
        stopped.map(|_| ())
    }
}

/// How the server is stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Active sessions are ended, and a primary sends all its WAL to connected standbys
    /// and writes a shutdown checkpoint before it exits: nothing needs recovery later.
    Fast,
    /// Every process quits at once and no session gets another statement through;
    /// the next start runs crash recovery. For fencing, where stopping writes now
    /// matters more than a clean stop.
    Immediate,
}

impl Shutdown {
    fn as_str(self) -> &'static str {
        match self {
            Shutdown::Fast => "fast",
            Shutdown::Immediate => "immediate",
        }
    }
}

/// How waiting for the server to accept connections ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Startup {
    Accepting,
    /// The server exited while starting (its log says why).
    Exited,
    TimedOut,
}

impl Postmaster {
    /// Waits until the server accepts connections on its socket, exits, or `timeout`
    /// passes. A server that exits is reported at once rather than waited out.
    pub async fn wait_accepting(
        &mut self,
        binaries: &Binaries,
        socket_dir: &Path,
        port: u16,
        timeout: Duration,
    ) -> Startup {
        let deadline = tokio::time::Instant::now() + timeout;
        let socket = socket_dir.to_string_lossy().into_owned();
        let port = port.to_string();
        while tokio::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return Startup::Exited;
            }
            let ready = binaries
                .run("pg_isready", &["-h", &socket, "-p", &port, "-q"], &[])
                .await
                .is_ok();
            if ready {
                return Startup::Accepting;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Startup::TimedOut
    }
}
