//! `kubectl castellan logs CLUSTER`: every instance's log through the API server's pod
//! log endpoint (what `kubectl logs` reads), each line prefixed with its pod. With
//! `--follow` the pods' streams are interleaved as lines arrive.

use anyhow::Context;
use clap::Args;
use futures::{AsyncBufReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, LogParams};

use super::Target;
use crate::kube_ops::{CLUSTER_LABEL, INSTANCE_LABEL};

#[derive(Args)]
pub struct LogsArgs {
    cluster: String,
    /// Keep streaming new lines.
    #[arg(short, long)]
    follow: bool,
    /// Only the last N lines of each instance.
    #[arg(long)]
    tail: Option<i64>,
    /// Only this instance.
    #[arg(long)]
    instance: Option<String>,
}

/// The instance pods of `cluster` (not its scratch or upgrade pods), by name.
pub async fn instance_pods(target: &Target, cluster: &str) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(target.client.clone(), &target.namespace);
    let selector = format!("{CLUSTER_LABEL}={cluster},{INSTANCE_LABEL}");
    let mut pods = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .with_context(|| format!("listing the pods of {}/{cluster}", target.namespace))?
        .items;
    pods.sort_by_key(ResourceExt::name_any);
    Ok(pods)
}

/// A pod's log as text (what `kubectl logs POD` prints), the last `tail` lines.
pub async fn pod_log(target: &Target, pod: &str, tail: Option<i64>) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(target.client.clone(), &target.namespace);
    pods.logs(
        pod,
        &LogParams {
            tail_lines: tail,
            ..LogParams::default()
        },
    )
    .await
    .with_context(|| format!("reading the log of pod {}/{pod}", target.namespace))
}

/// The prefix of `pod`'s lines, in one of a few colours on a terminal so that the
/// instances' lines tell apart at a glance.
fn prefix(pod: &str, index: usize) -> String {
    const COLOURS: [console::Color; 5] = [
        console::Color::Cyan,
        console::Color::Magenta,
        console::Color::Blue,
        console::Color::Green,
        console::Color::Yellow,
    ];
    console::style(format!("[{pod}]"))
        .fg(COLOURS[index % COLOURS.len()])
        .to_string()
}

pub async fn run(target: &Target, args: LogsArgs) -> anyhow::Result<()> {
    let pods: Vec<String> = instance_pods(target, &args.cluster)
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .filter(|name| args.instance.as_ref().is_none_or(|only| only == name))
        .collect();
    if pods.is_empty() {
        anyhow::bail!(
            "{}/{} has no instance pods{}",
            target.namespace,
            args.cluster,
            args.instance
                .as_ref()
                .map(|i| format!(" named {i}"))
                .unwrap_or_default()
        );
    }
    let api: Api<Pod> = Api::namespaced(target.client.clone(), &target.namespace);
    let params = LogParams {
        follow: args.follow,
        tail_lines: args.tail,
        ..LogParams::default()
    };
    let mut streams = Vec::new();
    for (index, pod) in pods.iter().enumerate() {
        let reader = api
            .log_stream(pod, &params)
            .await
            .with_context(|| format!("reading the log of pod {}/{pod}", target.namespace))?;
        let prefix = prefix(pod, index);
        let pod = pod.clone();
        streams.push(
            reader
                .lines()
                .map_err(move |e| anyhow::anyhow!("reading the log of pod {pod}: {e}"))
                .map_ok(move |line| format!("{prefix} {line}"))
                .boxed(),
        );
    }
    if args.follow {
        // As lines arrive, from all of them.
        let mut all = futures::stream::select_all(streams);
        while let Some(line) = all.try_next().await? {
            super::out_line(&line)?;
        }
    } else {
        // One instance after the other: each log reads in order.
        for mut stream in streams {
            while let Some(line) = stream.try_next().await? {
                super::out_line(&line)?;
            }
        }
    }
    Ok(())
}
