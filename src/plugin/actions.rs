//! The declared actions: each is an annotation on the DatabaseCluster that the
//! operator acts on (README, "What the operator does with it") — exactly what
//! `kubectl annotate` would write, so the plugin is a convenience, not a second way in.

use anyhow::{Context, bail};
use castellan_crds::DatabaseCluster;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::Target;
use crate::operator::cluster::{
    FENCED_ANNOTATION, RELOAD_ANNOTATION, RELOADED_ANNOTATION, RESTARTED_ANNOTATION,
    SWITCHOVER_ANNOTATION,
};

async fn get(
    target: &Target,
    name: &str,
) -> anyhow::Result<(Api<DatabaseCluster>, DatabaseCluster)> {
    let clusters: Api<DatabaseCluster> = Api::namespaced(target.client.clone(), &target.namespace);
    let cluster = clusters
        .get(name)
        .await
        .with_context(|| format!("reading DatabaseCluster {}/{name}", target.namespace))?;
    Ok((clusters, cluster))
}

/// The instances status lists.
fn members(cluster: &DatabaseCluster) -> Vec<String> {
    cluster
        .status
        .iter()
        .flat_map(|s| &s.instances)
        .map(|i| i.name.clone())
        .collect()
}

/// Sets one annotation (or removes it, with `None`), failing rather than overwriting
/// when the object changed since `cluster` was read (its resourceVersion goes along).
async fn annotate(
    clusters: &Api<DatabaseCluster>,
    cluster: &DatabaseCluster,
    annotation: &str,
    value: Option<&str>,
) -> anyhow::Result<()> {
    let name = cluster.name_any();
    let patch = json!({"metadata": {
        "resourceVersion": cluster.resource_version(),
        "annotations": {annotation: value},
    }});
    clusters
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("annotating DatabaseCluster {name} with {annotation}"))?;
    Ok(())
}

/// `promote` / `switchover`: `castellan.io/switchover-to=INSTANCE`.
pub async fn switchover(target: &Target, name: &str, instance: &str) -> anyhow::Result<()> {
    let (clusters, cluster) = get(target, name).await?;
    let members = members(&cluster);
    if !members.iter().any(|m| m == instance) {
        bail!(
            "{instance} is not an instance of {name} (its instances: {})",
            members.join(", ")
        );
    }
    let primary = cluster
        .status
        .as_ref()
        .and_then(|s| s.current_primary.as_deref());
    if primary == Some(instance) {
        super::out_line(format_args!("{instance} is already the primary of {name}"))?;
        return Ok(());
    }
    annotate(&clusters, &cluster, SWITCHOVER_ANNOTATION, Some(instance)).await?;
    super::out_line(format_args!(
        "switchover of {name} to {instance} requested ({SWITCHOVER_ANNOTATION}); the operator removes the annotation when done, with an Event SwitchedOver or SwitchoverRefused"
    ))?;
    Ok(())
}

/// The fenced-instances annotation after fencing (`fence`) or unfencing `instance`:
/// `None` when nothing stays fenced. `*` stands for every instance; unfencing one of
/// them while all are fenced leaves the others named.
pub fn fenced_after(
    current: Option<&str>,
    members: &[String],
    instance: &str,
    fence: bool,
) -> anyhow::Result<Option<String>> {
    let mut names: Vec<String> = match current {
        None | Some("") => Vec::new(),
        Some(value) => serde_json::from_str(value).with_context(|| {
            format!("{FENCED_ANNOTATION} is {value:?}, not a JSON list of instance names")
        })?,
    };
    if names.iter().any(|n| n == "*") && !fence && instance != "*" {
        names = members.to_vec();
    }
    if fence {
        if instance == "*" {
            names = vec!["*".to_owned()];
        } else if !names.iter().any(|n| n == instance || n == "*") {
            names.push(instance.to_owned());
            names.sort();
        }
    } else if instance == "*" {
        names.clear();
    } else {
        names.retain(|n| n != instance);
    }
    if names.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        serde_json::to_string(&names).context("writing the fenced list")?,
    ))
}

/// `fence` / `unfence`: edits `castellan.io/fenced-instances`.
pub async fn fence(target: &Target, name: &str, instance: &str, fence: bool) -> anyhow::Result<()> {
    let (clusters, cluster) = get(target, name).await?;
    let members = members(&cluster);
    if instance != "*" && !members.iter().any(|m| m == instance) {
        bail!(
            "{instance} is not an instance of {name} (its instances: {})",
            members.join(", ")
        );
    }
    let current = cluster
        .annotations()
        .get(FENCED_ANNOTATION)
        .map(String::as_str);
    let wanted = fenced_after(current, &members, instance, fence)?;
    if wanted.as_deref() == current {
        super::out_line(format_args!(
            "nothing to change: {FENCED_ANNOTATION} is {}",
            current.unwrap_or("unset")
        ))?;
        return Ok(());
    }
    annotate(&clusters, &cluster, FENCED_ANNOTATION, wanted.as_deref()).await?;
    super::out_line(format_args!(
        "{} {instance} of {name}: {FENCED_ANNOTATION} is now {}",
        if fence { "fencing" } else { "unfencing" },
        wanted.as_deref().unwrap_or("unset")
    ))?;
    Ok(())
}

/// `restart` / `reload`: a new timestamp in `annotation`, as `kubectl rollout restart`
/// stamps a Deployment; the operator records it in `castellan.io/restarted` /
/// `castellan.io/reloaded` when every instance did it.
pub async fn declare(target: &Target, name: &str, annotation: &str) -> anyhow::Result<()> {
    let (clusters, cluster) = get(target, name).await?;
    let value = jiff::Timestamp::now().to_string();
    annotate(&clusters, &cluster, annotation, Some(&value)).await?;
    let handled = if annotation == RELOAD_ANNOTATION {
        RELOADED_ANNOTATION
    } else {
        RESTARTED_ANNOTATION
    };
    super::out_line(format_args!(
        "{annotation}={value} set on {name}: done when {handled} shows the same value (Events RollingRestart/Reloaded per instance, then RestartCompleted/ReloadCompleted)"
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Vec<String> {
        vec!["db-1".into(), "db-2".into(), "db-3".into()]
    }

    #[test]
    fn fencing_adds_and_unfencing_removes_one_name() {
        let after = fenced_after(None, &members(), "db-2", true).expect("valid");
        assert_eq!(after.as_deref(), Some(r#"["db-2"]"#));
        let after = fenced_after(after.as_deref(), &members(), "db-1", true).expect("valid");
        assert_eq!(after.as_deref(), Some(r#"["db-1","db-2"]"#));
        let after = fenced_after(after.as_deref(), &members(), "db-1", true).expect("valid");
        assert_eq!(after.as_deref(), Some(r#"["db-1","db-2"]"#), "once");
        let after = fenced_after(after.as_deref(), &members(), "db-1", false).expect("valid");
        assert_eq!(after.as_deref(), Some(r#"["db-2"]"#));
        assert_eq!(
            fenced_after(after.as_deref(), &members(), "db-2", false).expect("valid"),
            None,
            "nothing fenced: the annotation goes"
        );
    }

    #[test]
    fn the_star_fences_all_and_unfencing_one_names_the_others() {
        let all = fenced_after(Some(r#"["db-1"]"#), &members(), "*", true).expect("valid");
        assert_eq!(all.as_deref(), Some(r#"["*"]"#));
        assert_eq!(
            fenced_after(all.as_deref(), &members(), "db-2", false)
                .expect("valid")
                .as_deref(),
            Some(r#"["db-1","db-3"]"#)
        );
        assert_eq!(
            fenced_after(all.as_deref(), &members(), "*", false).expect("valid"),
            None
        );
    }

    #[test]
    fn an_annotation_that_is_not_a_list_is_an_error_not_overwritten() {
        let error = fenced_after(Some("db-1"), &members(), "db-2", true).expect_err("refused");
        assert!(error.to_string().contains("not a JSON list"), "{error}");
    }
}
