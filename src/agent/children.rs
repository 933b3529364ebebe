//! What the node actor and its children share: the inbox through which the children
//! ask the node for a look (and what a pool's pass needs next), the node's storage
//! lock, and running slow work in a task of its own, where a panic is the actor's
//! failure, reported to it, and not the agent's.
//!
//! A leaf: the pool and volume actors use it without naming the node's actor, so the
//! tree's modules import downward only (`node` → `pool`/`volume`/`disk` → here).

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use castellan_actors::{Event, StateMachine};
use tokio::runtime::Handle;
use tracing::Instrument;

/// The node's storage lock: held while the node's storage changes — a look's
/// BlockDevice writes, a pool's pass, a volume pass — so that these never interleave
/// (a claim must see the inventory's writes and the other pools' claims; a volume is
/// never made in a pool being unmounted). Observing the disks does not take it.
pub type StorageLock = std::sync::Arc<tokio::sync::Mutex<()>>;

/// What a pass over the pools asks of the agent next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Next {
    /// Disks were released: look at them again now, so their BlockDevices become
    /// `Unclaimed` at once.
    pub look_again: bool,
    /// Releasing a deleted pool failed on something that passes (a disk still held
    /// busy): try again in a few seconds rather than at the next periodic look.
    pub retry_soon: bool,
    /// Look again after this long: a missing member's grace period ends then, or a
    /// replacement runs.
    pub look_in: Option<Duration>,
}

/// What a child asks of the node's actor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ask {
    /// A look now, for this cause.
    Look(&'static str),
    /// What a pool's pass needs next.
    Next(Next),
}

/// Where the children send what they ask: a channel, so that a restarted node actor
/// (a new address) still gets it.
pub type NodeInbox = tokio::sync::mpsc::UnboundedSender<Ask>;

/// Runs `work` in a task of its own; a panic in it comes back as an error naming
/// `what`.
pub async fn contained<T: Send + 'static>(
    runtime: &Handle,
    what: &str,
    work: impl Future<Output = Result<T, String>> + Send + 'static,
) -> Result<T, String> {
    runtime
        .spawn(work.in_current_span())
        .await
        .unwrap_or_else(|error| Err(format!("{what} panicked: {error}")))
}

/// Runs one pass of a one-pass-at-a-time actor in a task of its own, in `span`, and
/// sends its end back as the event `finished` makes of it.
pub fn run_pass<M, O>(
    runtime: &Handle,
    span: tracing::Span,
    what: String,
    pass: impl Future<Output = Result<O, String>> + Send + 'static,
    events: &Recipient<Event<M>>,
    finished: fn(Result<O, String>) -> M::Event,
) where
    M: StateMachine,
    M::Event: Send,
    O: Send + 'static,
{
    let (inner, events) = (runtime.clone(), events.clone());
    runtime.spawn(
        async move {
            let outcome = contained(&inner, &what, pass).await;
            if let Err(error) = &outcome {
                tracing::error!(%error, "{what} failed");
            }
            events.do_send(Event::new(finished(outcome)));
        }
        .instrument(span),
    );
}
