//! The bridge between the operator's multi-threaded tokio world (kube-rs controllers,
//! HTTP servers) and the actor tree. actix actors are `!Send` and must live on a thread
//! that runs an actix `System`, so [`ActorSystem`] starts one on a dedicated std thread
//! and lets `Send` code run constructors there ([`ActorSystem::run`]), getting back
//! `Addr`s and `Recipient`s, which are `Send`: messages sent through them from any
//! runtime reach the actors, and their replies come back to the awaiting task.
//!
//! It owns only the thread and the `System` handle; it knows nothing about the tree.
//! Dropping it, or [`ActorSystem::shutdown`], stops the system and every actor on it.

use std::thread::JoinHandle;

use thiserror::Error;
use tokio::sync::oneshot;
use tracing::{info, warn};

#[derive(Debug, Error)]
pub enum SystemError {
    #[error("starting the actor system thread {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the actor system thread {name}: it exited before reporting ready")]
    NotReady { name: String },
    #[error("running work on actor system {name}: the system has stopped")]
    Stopped { name: String },
    #[error("running work on actor system {name}: the work panicked")]
    WorkPanicked { name: String },
    #[error("joining actor system thread {name}: the thread panicked")]
    ThreadPanicked { name: String },
    #[error("running actor system {name}: {source}")]
    Run {
        name: String,
        #[source]
        source: std::io::Error,
    },
}

/// A running actix `System` on its own thread; `Send + Sync`, so it can be shared
/// with tokio tasks (behind an `Arc`).
pub struct ActorSystem {
    name: String,
    system: actix_rt::System,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl ActorSystem {
    /// Starts the system on a new thread named `name` and waits (briefly, blocking)
    /// until it runs.
    pub fn start(name: impl Into<String>) -> Result<Self, SystemError> {
        let name = name.into();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let runner = actix_rt::System::new();
                // The receiver only disappears if `start` already gave up.
                let _ = ready_tx.send(actix_rt::System::current());
                runner.run()
            })
            .map_err(|source| SystemError::Spawn {
                name: name.clone(),
                source,
            })?;
        let system = ready_rx
            .recv()
            .map_err(|_| SystemError::NotReady { name: name.clone() })?;
        info!(system = %name, "actor system started");
        Ok(Self {
            name,
            system,
            thread: Some(thread),
        })
    }

    /// Runs `work` on the actor thread and returns what it returns. This is how actors
    /// are created from `Send` code: `work` starts them and returns their addresses.
    pub async fn run<F, T>(&self, work: F) -> Result<T, SystemError>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let (reply_tx, reply_rx) = oneshot::channel();
        let accepted = self.system.arbiter().spawn_fn(move || {
            // The caller may have stopped waiting; then the result is simply dropped.
            let _ = reply_tx.send(work());
        });
        if !accepted {
            return Err(SystemError::Stopped {
                name: self.name.clone(),
            });
        }
        // A dropped sender means `work` panicked (the task was torn down) or the
        // system stopped before running it.
        reply_rx.await.map_err(|_| {
            if self.system.arbiter().spawn_fn(|| ()) {
                SystemError::WorkPanicked {
                    name: self.name.clone(),
                }
            } else {
                SystemError::Stopped {
                    name: self.name.clone(),
                }
            }
        })
    }

    /// Stops the system and waits for its thread, so every actor has been dropped
    /// when this returns. Blocks briefly: from async code call it inside
    /// `tokio::task::spawn_blocking`.
    pub fn shutdown(mut self) -> Result<(), SystemError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), SystemError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.system.stop();
        let outcome = match thread.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(SystemError::Run {
                name: self.name.clone(),
                source,
            }),
            Err(_) => Err(SystemError::ThreadPanicked {
                name: self.name.clone(),
            }),
        };
        info!(system = %self.name, "actor system stopped");
        outcome
    }
}

impl Drop for ActorSystem {
    fn drop(&mut self) {
        if let Err(error) = self.stop_and_join() {
            warn!(%error, "stopping actor system on drop");
        }
    }
}

#[cfg(test)]
mod tests {
    fn shareable<T: Send + Sync + 'static>() {}

    #[test]
    fn handle_can_be_shared_with_tokio_tasks() {
        // Compile-time: tokio/kube-rs code holds the handle in an `Arc` across tasks.
        shareable::<super::ActorSystem>();
    }
}
