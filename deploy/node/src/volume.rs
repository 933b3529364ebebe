//! A pod's volumes as directories on the host, under `<state>/pods/<uid>/volumes/`.
//!
//! `emptyDir`, `configMap`, `secret`, `downwardAPI` and `projected` (including the
//! service-account token the API server injects into every pod) are written there;
//! `hostPath` and `persistentVolumeClaim` (through the bound PV's `local.path` or
//! `hostPath.path`) are used in place. Containers see them at their `mountPath` through
//! bind mounts in a private mount namespace (see `sandbox.rs`).
//!
//! Contents are written when the pod starts. As the kubelet does, `secret` and
//! `configMap` volumes then follow their object ([`refresh`], every few seconds where
//! the kubelet takes up to a minute): a changed or added key's file is replaced by a
//! rename, so a reader sees the old or the new contents, never half (a removed key's
//! file stays, where the kubelet would remove it). `projected` and `downwardAPI`
//! volumes are not refreshed, nor tokens (they last an hour or more).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, PersistentVolume, PersistentVolumeClaim, Pod,
    Secret, ServiceAccount, Volume,
};
use kube::Api;
use kube::api::PostParams;

use crate::env::{EnvContext, field_value, format_map};
use crate::reference;

/// A file to write into a volume: its path in the volume, contents and mode.
type VolumeFile = (String, Vec<u8>, Option<i32>);

/// Where each of a pod's volumes is on the host, by volume name.
pub type VolumePaths = BTreeMap<String, PathBuf>;

pub fn pod_dir(state_dir: &Path, pod_uid: &str) -> PathBuf {
    state_dir.join("pods").join(pod_uid)
}

/// Prepares every volume of the pod. Fails (to be retried) while a referenced object
/// does not exist yet or a claim is not bound.
pub async fn prepare(context: &EnvContext<'_>, pod_dir: &Path) -> anyhow::Result<VolumePaths> {
    let pod = context.pod;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let fs_group = fs_group(pod);
    let mut paths = VolumePaths::new();
    for volume in pod
        .spec
        .iter()
        .flat_map(|spec| spec.volumes.iter().flatten())
    {
        let path = prepare_one(context, namespace, pod_dir, volume, fs_group)
            .await
            .with_context(|| format!("preparing volume {:?}", volume.name))?;
        paths.insert(volume.name.clone(), path);
    }
    Ok(paths)
}

/// The pod's `fsGroup`, which owns the files the node writes into its volumes.
fn fs_group(pod: &Pod) -> Option<u32> {
    pod.spec
        .as_ref()
        .and_then(|spec| spec.security_context.as_ref())
        .and_then(|security| security.fs_group)
        .and_then(|group| u32::try_from(group).ok())
}

async fn prepare_one(
    context: &EnvContext<'_>,
    namespace: &str,
    pod_dir: &Path,
    volume: &Volume,
    fs_group: Option<u32>,
) -> anyhow::Result<PathBuf> {
    let client = context.client;
    let dir = pod_dir.join("volumes").join(&volume.name);
    if volume.empty_dir.is_some() {
        create_dir(&dir, 0o777)?;
        apply_fs_group(&dir, fs_group)?;
        return Ok(dir);
    }
    if let Some(host_path) = &volume.host_path {
        let path = PathBuf::from(&host_path.path);
        match host_path.type_.as_deref().unwrap_or_default() {
            "DirectoryOrCreate" => create_dir(&path, 0o755)?,
            "FileOrCreate" if !path.exists() => {
                std::fs::File::create(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
            }
            "Directory" if !path.is_dir() => {
                bail!("hostPath {} is not a directory", path.display())
            }
            "File" if !path.is_file() => bail!("hostPath {} is not a file", path.display()),
            _ => {}
        }
        return Ok(path);
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        let path = claimed_path(client, namespace, &claim.claim_name).await?;
        apply_fs_group(&path, fs_group)?;
        return Ok(path);
    }
    // The rest are written as files in a fresh directory.
    let (files, default_mode) = volume_files(context, namespace, volume).await?;
    write_files(&dir, &files, default_mode.unwrap_or(0o644))?;
    give_to_group(&dir, fs_group)?;
    Ok(dir)
}

/// Rewrites the files of the pod's `secret` and `configMap` volumes whose object
/// changed since they were written.
pub async fn refresh(context: &EnvContext<'_>, pod_dir: &Path) -> anyhow::Result<()> {
    let pod = context.pod;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let fs_group = fs_group(pod);
    let followed = pod
        .spec
        .iter()
        .flat_map(|spec| spec.volumes.iter().flatten())
        .filter(|volume| volume.secret.is_some() || volume.config_map.is_some());
    for volume in followed {
        let dir = pod_dir.join("volumes").join(&volume.name);
        let (files, default_mode) = volume_files(context, namespace, volume)
            .await
            .with_context(|| format!("refreshing volume {:?}", volume.name))?;
        if write_files(&dir, &files, default_mode.unwrap_or(0o644))? {
            give_to_group(&dir, fs_group)?;
            tracing::info!(pod = describe(pod), volume = %volume.name, "volume updated");
        }
    }
    Ok(())
}

/// The files of a `configMap`, `secret`, `downwardAPI` or `projected` volume, and its
/// default mode.
async fn volume_files(
    context: &EnvContext<'_>,
    namespace: &str,
    volume: &Volume,
) -> anyhow::Result<(Vec<VolumeFile>, Option<i32>)> {
    let client = context.client;
    let mut files: Vec<VolumeFile> = Vec::new();
    let default_mode;
    if let Some(source) = &volume.config_map {
        default_mode = source.default_mode;
        let map = reference::read::<ConfigMap>(
            client,
            namespace,
            &source.name,
            source.optional.unwrap_or(false),
        )
        .await?;
        files.extend(select(
            config_map_entries(map),
            source.items.as_deref(),
            &source.name,
        )?);
    } else if let Some(source) = &volume.secret {
        default_mode = source.default_mode;
        let name = source.secret_name.clone().unwrap_or_default();
        let found =
            reference::read::<Secret>(client, namespace, &name, source.optional.unwrap_or(false))
                .await?;
        files.extend(select(
            secret_entries(found),
            source.items.as_deref(),
            &name,
        )?);
    } else if let Some(source) = &volume.downward_api {
        default_mode = source.default_mode;
        for item in source.items.iter().flatten() {
            files.push(downward_file(context, item)?);
        }
    } else if let Some(projected) = &volume.projected {
        default_mode = projected.default_mode;
        for source in projected.sources.iter().flatten() {
            if let Some(token) = &source.service_account_token {
                let value = service_account_token(
                    context,
                    token.audience.clone(),
                    token.expiration_seconds,
                )
                .await?;
                files.push((token.path.clone(), value.into_bytes(), None));
            }
            if let Some(map) = &source.config_map {
                let found = reference::read::<ConfigMap>(
                    client,
                    namespace,
                    &map.name,
                    map.optional.unwrap_or(false),
                )
                .await?;
                files.extend(select(
                    config_map_entries(found),
                    map.items.as_deref(),
                    &map.name,
                )?);
            }
            if let Some(secret) = &source.secret {
                let found = reference::read::<Secret>(
                    client,
                    namespace,
                    &secret.name,
                    secret.optional.unwrap_or(false),
                )
                .await?;
                files.extend(select(
                    secret_entries(found),
                    secret.items.as_deref(),
                    &secret.name,
                )?);
            }
            if let Some(downward) = &source.downward_api {
                for item in downward.items.iter().flatten() {
                    files.push(downward_file(context, item)?);
                }
            }
        }
    } else {
        bail!("volume type not supported by castellan-devnode");
    }
    Ok((files, default_mode))
}

/// `fsGroup` on files the node wrote (Secret, ConfigMap, downward API, projected): the
/// kubelet makes them group-owned by it, so a `defaultMode` of 0440 is readable by a
/// non-root container user in that group.
fn give_to_group(dir: &Path, fs_group: Option<u32>) -> anyhow::Result<()> {
    let Some(group) = fs_group else { return Ok(()) };
    let gid = nix::unistd::Gid::from_raw(group);
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        nix::unistd::chown(&path, None, Some(gid))
            .with_context(|| format!("giving {} to group {group}", path.display()))?;
        if path.is_dir() {
            for entry in
                std::fs::read_dir(&path).with_context(|| format!("listing {}", path.display()))?
            {
                pending.push(
                    entry
                        .with_context(|| format!("listing {}", path.display()))?
                        .path(),
                );
            }
        }
    }
    Ok(())
}

/// The directory of the PV bound to the claim; an unbound claim is an error to retry.
async fn claimed_path(
    client: &kube::Client,
    namespace: &str,
    claim_name: &str,
) -> anyhow::Result<PathBuf> {
    let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
        .get(claim_name)
        .await
        .with_context(|| format!("reading PersistentVolumeClaim {namespace}/{claim_name}"))?;
    let Some(volume_name) = claim
        .spec
        .and_then(|spec| spec.volume_name)
        .filter(|name| !name.is_empty())
    else {
        bail!("PersistentVolumeClaim {namespace}/{claim_name} is not bound yet");
    };
    let volume = Api::<PersistentVolume>::all(client.clone())
        .get(&volume_name)
        .await
        .with_context(|| format!("reading PersistentVolume {volume_name}"))?;
    let spec = volume.spec.unwrap_or_default();
    if let Some(local) = spec.local {
        // A local PV's directory must exist, as on a real node (the kubelet's "path
        // does not exist"): a volume whose disk is gone is never replaced by an empty
        // directory on the node's root filesystem.
        let path = PathBuf::from(local.path);
        if !path.is_dir() {
            bail!(
                "PersistentVolume {volume_name}: local path {} does not exist",
                path.display()
            );
        }
        return Ok(path);
    }
    let path = spec
        .host_path
        .map(|host_path| PathBuf::from(host_path.path))
        .with_context(|| format!("PersistentVolume {volume_name} is neither local nor hostPath"))?;
    // hostPath ones are created.
    if !path.is_dir() {
        create_dir(&path, 0o755)
            .with_context(|| format!("PersistentVolume {volume_name}'s directory"))?;
    }
    Ok(path)
}

fn config_map_entries(map: Option<ConfigMap>) -> BTreeMap<String, Vec<u8>> {
    let Some(map) = map else {
        return BTreeMap::new();
    };
    let mut entries: BTreeMap<String, Vec<u8>> = map
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(key, value)| (key, value.into_bytes()))
        .collect();
    entries.extend(
        map.binary_data
            .unwrap_or_default()
            .into_iter()
            .map(|(key, value)| (key, value.0)),
    );
    entries
}

fn secret_entries(secret: Option<Secret>) -> BTreeMap<String, Vec<u8>> {
    let Some(secret) = secret else {
        return BTreeMap::new();
    };
    let mut entries: BTreeMap<String, Vec<u8>> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(key, value)| (key, value.0))
        .collect();
    entries.extend(
        secret
            .string_data
            .unwrap_or_default()
            .into_iter()
            .map(|(key, value)| (key, value.into_bytes())),
    );
    entries
}

/// All keys as files, or only the listed `items` at their paths.
fn select(
    entries: BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    source: &str,
) -> anyhow::Result<Vec<VolumeFile>> {
    let Some(items) = items else {
        return Ok(entries
            .into_iter()
            .map(|(key, value)| (key, value, None))
            .collect());
    };
    items
        .iter()
        .map(|item| {
            let value = entries
                .get(&item.key)
                .with_context(|| format!("key {:?} not found in {source}", item.key))?;
            Ok((item.path.clone(), value.clone(), item.mode))
        })
        .collect()
}

fn downward_file(
    context: &EnvContext<'_>,
    item: &DownwardAPIVolumeFile,
) -> anyhow::Result<VolumeFile> {
    let value = match (&item.field_ref, &item.resource_field_ref) {
        (Some(field), _) => match field.field_path.as_str() {
            "metadata.labels" => format_map(context.pod.metadata.labels.as_ref()),
            "metadata.annotations" => format_map(context.pod.metadata.annotations.as_ref()),
            path => field_value(context, path)?,
        },
        (None, Some(resource)) => bail!(
            "downwardAPI resourceFieldRef {:?} is not supported",
            resource.resource
        ),
        (None, None) => bail!("downwardAPI item {:?} has no source", item.path),
    };
    Ok((item.path.clone(), value.into_bytes(), item.mode))
}

async fn service_account_token(
    context: &EnvContext<'_>,
    audience: Option<String>,
    expiration_seconds: Option<i64>,
) -> anyhow::Result<String> {
    let pod = context.pod;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let account = pod
        .spec
        .as_ref()
        .and_then(|spec| spec.service_account_name.clone())
        .unwrap_or_else(|| "default".to_string());
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(audience.into_iter().collect()),
            attestations: None,
            expiration_seconds: Some(expiration_seconds.unwrap_or(3607)),
            bound_object_ref: Some(k8s_openapi::api::authentication::v1::BoundObjectReference {
                api_version: Some("v1".to_string()),
                kind: Some("Pod".to_string()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
        }),
        ..TokenRequest::default()
    };
    let response: TokenRequest =
        Api::<ServiceAccount>::namespaced(context.client.clone(), namespace)
            .create_subresource("token", &account, &PostParams::default(), &request)
            .await
            .with_context(|| {
                format!("requesting a token for ServiceAccount {namespace}/{account}")
            })?;
    response
        .status
        .and_then(|status| status.token)
        .with_context(|| {
            format!("the API server returned no token for ServiceAccount {namespace}/{account}")
        })
}

/// Writes the files that are missing or differ, each through a temporary file and a
/// rename; true if any was written.
fn write_files(dir: &Path, files: &[VolumeFile], default_mode: i32) -> anyhow::Result<bool> {
    create_dir(dir, 0o755)?;
    let mut written = false;
    for (relative, contents, mode) in files {
        if relative.split('/').any(|part| part == "..") || relative.starts_with('/') {
            bail!("volume file path {relative:?} leaves the volume");
        }
        let path = dir.join(relative);
        if std::fs::read(&path).is_ok_and(|old| old == *contents) {
            continue;
        }
        if let Some(parent) = path.parent() {
            create_dir(parent, 0o755)?;
        }
        let temporary = path.with_file_name(format!(
            "..{}.new",
            path.file_name().unwrap_or_default().to_string_lossy()
        ));
        std::fs::write(&temporary, contents)
            .with_context(|| format!("writing {}", temporary.display()))?;
        let mode = u32::try_from(mode.unwrap_or(default_mode)).unwrap_or(0o644);
        std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting mode of {}", temporary.display()))?;
        std::fs::rename(&temporary, &path)
            .with_context(|| format!("replacing {}", path.display()))?;
        written = true;
    }
    Ok(written)
}

fn create_dir(dir: &Path, mode: u32) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating directory {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting mode of {}", dir.display()))
}

/// `fsGroup`: the volume's top directory belongs to the group, group-writable and
/// setgid, so files created in it do too (the kubelet also walks existing contents;
/// this does not).
fn apply_fs_group(dir: &Path, fs_group: Option<u32>) -> anyhow::Result<()> {
    let Some(group) = fs_group else { return Ok(()) };
    nix::unistd::chown(dir, None, Some(nix::unistd::Gid::from_raw(group)))
        .with_context(|| format!("giving {} to group {group}", dir.display()))?;
    let mode = std::fs::metadata(dir)
        .with_context(|| format!("reading mode of {}", dir.display()))?
        .permissions()
        .mode();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o2070))
        .with_context(|| format!("setting mode of {}", dir.display()))
}

/// Removes the pod's own directory (emptyDirs, copies of ConfigMaps…); `hostPath` and
/// PV directories are outside it and stay.
pub fn remove_pod_dir(pod_dir: &Path) {
    if let Err(error) = std::fs::remove_dir_all(pod_dir)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("removing {}: {error}", pod_dir.display());
    }
}

/// The pod whose volumes these are, for messages.
pub fn describe(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("?")
    )
}
