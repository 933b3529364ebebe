//! The node's stand-in for image pulls: a YAML file that maps image names to local
//! executables, the way an image's `ENTRYPOINT`/`CMD`/`ENV` would.
//!
//! ```yaml
//! images:
//!   - image: ghcr.io/castellan-io/castellan     # matches any tag or digest of it
//!     entrypoint: [/var/cache/castellan/target/debug/castellan]
//!     path: [/usr/lib/postgresql/17/bin]        # prepended to PATH
//!     env: {PGDATA: /var/lib/postgresql/data}
//! ```
//!
//! `${NAME}` in an entrypoint, cmd, path or env value is replaced by the node's
//! environment variable NAME (an unset one is an error), so the map can follow
//! `CARGO_TARGET_DIR`.
//!
//! An image without an entry runs the container's `command`/`args` from the host as
//! given, so `command: [sh, -c, "…"]` works with any image name.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// What an image provides, as an image's config would.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Image {
    /// Image name without tag or digest (`registry/repository`), or with a tag to match
    /// only that tag.
    pub image: String,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default)]
    pub path: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Images {
    #[serde(default)]
    images: Vec<Image>,
}

impl Images {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading image map {}", path.display()))?;
        let mut images: Self = serde_yaml_ng::from_str(&text)
            .with_context(|| format!("parsing image map {}", path.display()))?;
        for image in &mut images.images {
            let lookup = |name: &str| std::env::var(name).ok();
            let fields = image.entrypoint.iter_mut().chain(&mut image.cmd);
            for value in fields.chain(&mut image.path).chain(image.env.values_mut()) {
                *value = expand(value, lookup).with_context(|| {
                    format!("image {} in image map {}", image.image, path.display())
                })?;
            }
        }
        Ok(images)
    }

    /// The entry for `reference`: an exact match first, then a match of its name
    /// without tag or digest.
    pub fn find(&self, reference: &str) -> Option<&Image> {
        let name = image_name(reference);
        self.images
            .iter()
            .find(|image| image.image == reference)
            .or_else(|| self.images.iter().find(|image| image.image == name))
    }
}

/// `text` with every `${NAME}` replaced by `lookup(NAME)`.
fn expand(text: &str, lookup: impl Fn(&str) -> Option<String>) -> anyhow::Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find('}') else {
            anyhow::bail!("unterminated ${{ in {:?}", &rest[start..]);
        };
        let name = &rest[start + 2..start + end];
        let value =
            lookup(name).with_context(|| format!("environment variable {name} is not set"))?;
        out.push_str(&value);
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `registry:5000/repo:tag@sha256:…` → `registry:5000/repo`.
fn image_name(reference: &str) -> &str {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    match without_digest.rfind(':') {
        // A colon after the last slash separates the tag; before it, a registry port.
        Some(colon) if !without_digest[colon..].contains('/') => &without_digest[..colon],
        _ => without_digest,
    }
}

/// The argv of a container, following Kubernetes' rules: `command` replaces the image's
/// entrypoint (and drops its cmd), `args` replaces the cmd.
pub fn argv(image: Option<&Image>, command: &[String], args: &[String]) -> Vec<String> {
    let (entrypoint, cmd) = image
        .map(|image| (image.entrypoint.as_slice(), image.cmd.as_slice()))
        .unwrap_or_default();
    let mut argv: Vec<String> = if command.is_empty() {
        entrypoint.to_vec()
    } else {
        command.to_vec()
    };
    if !args.is_empty() {
        argv.extend(args.iter().cloned());
    } else if command.is_empty() {
        argv.extend(cmd.iter().cloned());
    }
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_expanded_and_unset_ones_refused() {
        let lookup = |name: &str| (name == "T").then(|| "/cache/target".to_string());
        assert_eq!(
            expand("entrypoint: [${T}/debug/castellan]", lookup).expect("T is set"),
            "entrypoint: [/cache/target/debug/castellan]"
        );
        assert_eq!(
            expand("no variables", lookup).expect("nothing to expand"),
            "no variables"
        );
        let unset = expand("${MISSING}/x", lookup).expect_err("MISSING is unset");
        assert!(unset.to_string().contains("MISSING"), "{unset:#}");
        assert!(expand("${T", lookup).is_err());
    }

    #[test]
    fn names_drop_tags_and_digests_but_not_ports() {
        assert_eq!(image_name("postgres:17"), "postgres");
        assert_eq!(
            image_name("registry:5000/castellan"),
            "registry:5000/castellan"
        );
        assert_eq!(
            image_name("registry:5000/castellan:v1@sha256:ab"),
            "registry:5000/castellan"
        );
    }

    #[test]
    fn command_and_args_override_the_image() {
        let image = Image {
            image: "x".into(),
            entrypoint: vec!["/bin/entry".into()],
            cmd: vec!["serve".into()],
            ..Image::default()
        };
        let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            argv(Some(&image), &[], &[]),
            strings(&["/bin/entry", "serve"])
        );
        assert_eq!(
            argv(Some(&image), &[], &strings(&["run"])),
            strings(&["/bin/entry", "run"])
        );
        assert_eq!(argv(Some(&image), &strings(&["sh"]), &[]), strings(&["sh"]));
        assert_eq!(
            argv(None, &strings(&["sh"]), &strings(&["-c", "true"])),
            strings(&["sh", "-c", "true"])
        );
    }
}
