//! `kubectl castellan report CLUSTER -o FILE`: a diagnostic bundle to attach to an
//! issue or hand to a colleague — the DatabaseCluster, its pods, PVCs, Services,
//! Backups and the Events about them, every instance's log, and the operator's view
//! (the status as `status` prints it). Secrets appear by name, type and key names
//! only: their values never leave the cluster, so a bundle is safe to share.
//! `FILE` ending in `.tar.gz` or `.tgz` is an archive; anything else a directory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::Context;
use castellan_crds::{Backup, DatabaseCluster};
use clap::Args;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim, Pod, Secret, Service};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::Serialize;

use super::Target;
use crate::kube_ops::CLUSTER_LABEL;

#[derive(Args)]
pub struct ReportArgs {
    cluster: String,
    /// Where to write it: `NAME.tar.gz` (or `.tgz`) for an archive, else a directory.
    /// Default `<cluster>-report-<time>.tar.gz` here.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Lines of each instance's log to include.
    #[arg(long, default_value_t = 2000)]
    tail: i64,
}

/// What a redacted Secret looks like in the bundle.
pub const REDACTED: &str = "<redacted>";

/// The Secrets as the bundle lists them: name, type and keys, every value replaced
/// by [`REDACTED`].
pub fn redacted_secrets(secrets: &[Secret]) -> String {
    let mut out = String::from("# Secrets: values are not included\n");
    for secret in secrets {
        let keys: BTreeSet<&String> = secret
            .data
            .iter()
            .flat_map(|d| d.keys())
            .chain(secret.string_data.iter().flat_map(|d| d.keys()))
            .collect();
        out.push_str(&format!(
            "{} (type {}):\n",
            secret.name_any(),
            secret.type_.as_deref().unwrap_or("Opaque")
        ));
        for key in keys {
            out.push_str(&format!("  {key}: {REDACTED}\n"));
        }
    }
    out
}

/// Objects as one YAML list, without `managedFields` (noise in a report).
fn yaml_list<K: Serialize + kube::Resource>(objects: &[K]) -> anyhow::Result<Vec<u8>> {
    let mut values = Vec::new();
    for object in objects {
        let mut value = serde_json::to_value(object).context("encoding an object")?;
        if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            meta.remove("managedFields");
        }
        values.push(value);
    }
    Ok(serde_yaml_ng::to_string(&values)
        .context("writing YAML")?
        .into_bytes())
}

async fn list<K>(target: &Target, params: &ListParams, what: &str) -> anyhow::Result<Vec<K>>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(target.client.clone(), &target.namespace);
    Ok(api
        .list(params)
        .await
        .with_context(|| format!("listing {what} in {}", target.namespace))?
        .items)
}

pub async fn run(target: &Target, args: ReportArgs) -> anyhow::Result<()> {
    let name = &args.cluster;
    // The bundle is read by people and tools alike: no colour codes in it.
    console::set_colors_enabled(false);
    let clusters: Api<DatabaseCluster> = Api::namespaced(target.client.clone(), &target.namespace);
    let cluster = clusters
        .get(name)
        .await
        .with_context(|| format!("reading DatabaseCluster {}/{name}", target.namespace))?;
    let owned = ListParams::default().labels(&format!("{CLUSTER_LABEL}={name}"));
    let all = ListParams::default();
    let pods: Vec<Pod> = list(target, &owned, "pods").await?;
    let claims: Vec<PersistentVolumeClaim> = list(target, &owned, "PersistentVolumeClaims").await?;
    let services: Vec<Service> = list(target, &owned, "Services").await?;
    let backups: Vec<Backup> = list::<Backup>(target, &all, "Backups")
        .await?
        .into_iter()
        .filter(|b| &b.spec.cluster == name)
        .collect();
    // The cluster's own Secrets and the object store's credentials it names.
    let credentials = cluster
        .spec
        .backup
        .as_ref()
        .map(|b| b.credentials.secret_name.clone());
    let secrets: Vec<Secret> = list::<Secret>(target, &all, "Secrets")
        .await?
        .into_iter()
        .filter(|s| {
            s.labels().get(CLUSTER_LABEL) == Some(name) || Some(s.name_any()) == credentials
        })
        .collect();
    let mut involved: BTreeSet<String> = BTreeSet::from([name.clone()]);
    involved.extend(pods.iter().map(ResourceExt::name_any));
    involved.extend(claims.iter().map(ResourceExt::name_any));
    involved.extend(backups.iter().map(ResourceExt::name_any));
    let events: Vec<Event> = list::<Event>(target, &all, "Events")
        .await?
        .into_iter()
        .filter(|e| {
            e.involved_object
                .name
                .as_ref()
                .is_some_and(|n| involved.contains(n))
        })
        .collect();

    let mut files: Vec<(String, Vec<u8>)> = vec![
        (
            "databasecluster.yaml".into(),
            yaml_list(std::slice::from_ref(&cluster))?,
        ),
        ("pods.yaml".into(), yaml_list(&pods)?),
        ("persistentvolumeclaims.yaml".into(), yaml_list(&claims)?),
        ("services.yaml".into(), yaml_list(&services)?),
        ("backups.yaml".into(), yaml_list(&backups)?),
        ("events.yaml".into(), yaml_list(&events)?),
        (
            "secrets.txt".into(),
            redacted_secrets(&secrets).into_bytes(),
        ),
    ];
    let summary = super::status::summarise(&cluster, &backups);
    files.push((
        "status.txt".into(),
        super::status::render(&summary, 160).into_bytes(),
    ));
    files.push((
        "status.json".into(),
        serde_json::to_vec_pretty(&summary).context("encoding the status")?,
    ));
    for pod in &pods {
        let pod = pod.name_any();
        let log = match super::logs::pod_log(target, &pod, Some(args.tail)).await {
            Ok(log) => log,
            // A pod that never started has no log: say so in its place.
            Err(error) => format!("{error:#}\n"),
        };
        files.push((format!("logs/{pod}.log"), log.into_bytes()));
    }

    let output = args.output.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "{name}-report-{}.tar.gz",
            jiff::Timestamp::now().strftime("%Y%m%dT%H%M%SZ")
        ))
    });
    write_bundle(&output, &format!("{name}-report"), &files)?;
    super::out_line(format_args!(
        "wrote {} ({} files; Secrets by name only)",
        output.display(),
        files.len()
    ))?;
    Ok(())
}

fn is_archive(path: &Path) -> bool {
    let name = path.to_string_lossy();
    name.ends_with(".tar.gz") || name.ends_with(".tgz")
}

/// Writes `files` as `output`: a gzip'd tar with everything under `root/`, or a
/// directory.
fn write_bundle(output: &Path, root: &str, files: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
    if !is_archive(output) {
        for (name, bytes) in files {
            let path = output.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let file =
        std::fs::File::create(output).with_context(|| format!("creating {}", output.display()))?;
    let mut archive = tar::Builder::new(flate2::write::GzEncoder::new(
        file,
        flate2::Compression::default(),
    ));
    let now = u64::try_from(jiff::Timestamp::now().as_second()).unwrap_or(0);
    for (name, bytes) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(now);
        archive
            .append_data(&mut header, format!("{root}/{name}"), bytes.as_slice())
            .with_context(|| format!("adding {name} to {}", output.display()))?;
    }
    archive
        .into_inner()
        .and_then(|gzip| gzip.finish())
        .with_context(|| format!("finishing {}", output.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    #[test]
    fn secrets_show_their_keys_and_never_their_values() {
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("shop-app".into()),
                ..Default::default()
            },
            data: Some(
                [
                    ("password", "hunter2-very-secret"),
                    ("uri", "postgresql://clerk:hunter2-very-secret@x"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
            ),
            string_data: Some([("extra".to_owned(), "also-secret".to_owned())].into()),
            ..Secret::default()
        };
        let listing = redacted_secrets(&[secret]);
        assert!(listing.contains("shop-app"));
        assert!(listing.contains(&format!("password: {REDACTED}")));
        assert!(listing.contains(&format!("extra: {REDACTED}")));
        assert!(!listing.contains("hunter2"), "{listing}");
        assert!(!listing.contains("also-secret"), "{listing}");
    }

    #[test]
    fn a_tar_gz_holds_every_file_under_one_root() {
        let dir =
            std::env::temp_dir().join(format!("castellan-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let path = dir.join("r.tar.gz");
        let files = vec![
            ("a.yaml".to_owned(), b"a: 1\n".to_vec()),
            ("logs/p.log".to_owned(), b"line\n".to_vec()),
        ];
        write_bundle(&path, "shop-report", &files).expect("written");
        let file = std::fs::File::open(&path).expect("the archive");
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
        let names: Vec<String> = archive
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("an entry")
                    .path()
                    .expect("a path")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(names, vec!["shop-report/a.yaml", "shop-report/logs/p.log"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
