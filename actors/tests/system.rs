//! The actor system on its own thread, driven from a multi-threaded tokio runtime the
//! way kube-rs controllers will drive it.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix::prelude::*;
use castellan_actors::{
    ActorSystem, Child, ChildFailing, ChildKey, ChildLink, RestartPolicy, Shutdown, StartChild,
    Supervisor, SystemError,
};
use tokio::sync::mpsc;

const THREAD: &str = "castellan-actors-test";

struct Echo {
    _link: ChildLink,
    drops: Arc<AtomicUsize>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl Actor for Echo {
    type Context = Context<Self>;
}

impl Child for Echo {
    type Spec = Arc<AtomicUsize>;
    fn build(_key: &ChildKey, drops: &Arc<AtomicUsize>, link: ChildLink) -> Self {
        Self {
            _link: link,
            drops: drops.clone(),
        }
    }
}

impl Handler<Shutdown> for Echo {
    type Result = ();
    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// Replies with the text and the name of the thread that handled it.
#[derive(Message)]
#[rtype(result = "(String, String)")]
struct Say(String);

impl Handler<Say> for Echo {
    type Result = MessageResult<Say>;
    fn handle(&mut self, Say(text): Say, _ctx: &mut Self::Context) -> Self::Result {
        let thread = std::thread::current().name().unwrap_or("").to_owned();
        MessageResult((text, thread))
    }
}

async fn start_tree(
    system: &ActorSystem,
    drops: Arc<AtomicUsize>,
    keys: &[&str],
) -> (Addr<Supervisor<Echo>>, Vec<Addr<Echo>>) {
    let keys: Vec<String> = keys.iter().map(|key| key.to_string()).collect();
    let (sink, _reports) = mpsc::unbounded_channel::<ChildFailing>();
    let parent = system
        .run(move || Supervisor::<Echo>::new("root", RestartPolicy::default(), sink).start())
        .await
        .unwrap();
    let mut children = Vec::new();
    for key in keys {
        children.push(
            parent
                .send(StartChild {
                    key,
                    spec: drops.clone(),
                })
                .await
                .unwrap()
                .expect("child started"),
        );
    }
    // The caller keeps the parent: children live as long as their parent does.
    (parent, children)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokio_tasks_reach_actors_and_get_replies() {
    let system = Arc::new(ActorSystem::start(THREAD).unwrap());
    let (_parent, children) = start_tree(&system, Arc::default(), &["a", "b"]).await;

    // Many tasks, spread over the runtime's workers, all talking to the actor thread.
    let mut tasks = Vec::new();
    for n in 0..32 {
        let child = children[n % 2].clone();
        tasks.push(tokio::spawn(async move {
            child.send(Say(format!("hello {n}"))).await
        }));
    }
    for (n, task) in tasks.into_iter().enumerate() {
        let (text, thread) = task.await.unwrap().unwrap();
        assert_eq!(text, format!("hello {n}"));
        assert_eq!(thread, THREAD, "handled on the actor thread");
    }

    assert_eq!(system.run(|| 40 + 2).await.unwrap(), 42);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_every_actor() {
    let system = ActorSystem::start(THREAD).unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let (_parent, children) = start_tree(&system, drops.clone(), &["a", "b", "c"]).await;
    for child in &children {
        assert!(child.send(Say("up".into())).await.is_ok());
    }
    assert_eq!(drops.load(Ordering::SeqCst), 0, "all alive before shutdown");

    tokio::task::spawn_blocking(move || system.shutdown())
        .await
        .unwrap()
        .unwrap();

    // The thread has been joined, so every actor has been dropped by now.
    assert_eq!(drops.load(Ordering::SeqCst), 3);
    for child in &children {
        let reply = tokio::time::timeout(Duration::from_secs(10), child.send(Say("x".into())))
            .await
            .expect("a stopped actor answers at once");
        assert!(reply.is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_panics_is_an_error_not_a_hang() {
    let system = ActorSystem::start(THREAD).unwrap();
    let outcome: Result<(), SystemError> = tokio::time::timeout(
        Duration::from_secs(10),
        system.run(|| panic!("constructor bug")),
    )
    .await
    .expect("no hang");
    assert!(
        matches!(outcome, Err(SystemError::WorkPanicked { .. })),
        "{outcome:?}"
    );
    // The system survives and still runs work.
    assert_eq!(system.run(|| 7).await.unwrap(), 7);
}
