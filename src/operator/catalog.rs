//! The image catalog: which instance image runs which PostgreSQL major version. One
//! ConfigMap in the operator's namespace (`castellan-images`, or `--image-catalog`),
//! a key per major (`"15": ghcr.io/castellan-io/castellan:0.1.0-pg15`), so the user
//! sees in one place what runs and overrides it there (a mirror, a patched build).
//! The operator makes it with its defaults when there is none, and never rewrites it.
//!
//! A pod runs the image of the version its data is in: the version the instances
//! report (`status.version`) once there is data, the spec's before. A version with no
//! entry runs nothing; `VersionAvailable` says why.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::runtime::reflector::Store;
use kube::{Api, Client, ResourceExt};

use super::build;
use super::cluster::Assessment;

/// The catalog's name, unless `--image-catalog` names another.
pub const CATALOG: &str = "castellan-images";

/// The majors the built images carry (`make images`): `<image>:<tag>-pg<major>`.
pub const BUILT_MAJORS: [&str; 2] = ["15", "18"];

/// The condition a cluster's version is judged in.
pub const CONDITION: &str = "VersionAvailable";

/// The catalog as the operator read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Catalog {
    /// `namespace/name`, for messages.
    pub source: String,
    /// Image by major version; `None` while the ConfigMap has not been read.
    pub images: Option<BTreeMap<String, String>>,
}

impl Catalog {
    /// The catalog in `store` (a watch of the one ConfigMap).
    pub fn read(store: &Store<ConfigMap>, source: &str) -> Self {
        let images = store
            .state()
            .first()
            .map(|map| map.data.clone().unwrap_or_default());
        Self {
            source: source.to_owned(),
            images,
        }
    }

    /// The image of major `version`, or why there is none.
    pub fn image(&self, version: &str) -> Result<String, String> {
        let Some(images) = &self.images else {
            return Err(format!(
                "the image catalog {} has not been read yet",
                self.source
            ));
        };
        match images.get(version).map(|image| image.trim()) {
            Some(image) if !image.is_empty() => Ok(image.to_owned()),
            _ => Err(format!(
                "the image catalog {} has no image for PostgreSQL {version} (it has {}): add one \
                 (kubectl -n {} edit configmap {}) or choose a version it has",
                self.source,
                if images.is_empty() {
                    "none".to_owned()
                } else {
                    images.keys().cloned().collect::<Vec<_>>().join(", ")
                },
                self.source.split('/').next().unwrap_or_default(),
                self.source.split('/').nth(1).unwrap_or_default(),
            )),
        }
    }
}

/// The images `make images` builds, for `tag`.
pub fn defaults(tag: &str) -> BTreeMap<String, String> {
    BUILT_MAJORS
        .iter()
        .map(|major| {
            (
                (*major).to_owned(),
                format!("{}:{tag}-pg{major}", build::IMAGE),
            )
        })
        .collect()
}

/// Makes the catalog with the defaults when there is none; an existing one is the
/// user's and stays as it is.
pub async fn ensure(client: &Client, namespace: &str, name: &str, tag: &str) -> kube::Result<()> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    if maps.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let map = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                build::MANAGED_BY_LABEL.to_owned(),
                build::MANAGED_BY.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(defaults(tag)),
        ..ConfigMap::default()
    };
    match maps.create(&PostParams::default(), &map).await {
        Ok(made) => {
            tracing::info!(catalog = %format!("{namespace}/{}", made.name_any()), "made the image catalog with the built images");
            Ok(())
        }
        // Another replica made it first.
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error),
    }
}

/// What a cluster runs: the version its data is in, and its image or why there is
/// none. `running` is the version its instances report (`status.version`).
pub fn choose(
    catalog: &Catalog,
    wanted: &str,
    running: Option<&str>,
) -> (String, Result<String, String>) {
    let version = running.unwrap_or(wanted).to_owned();
    let image = catalog.image(&version);
    (version, image)
}

/// [`choose`] for `cluster`, from its spec and status.
pub fn for_cluster(
    catalog: &Catalog,
    cluster: &castellan_crds::DatabaseCluster,
) -> (String, Result<String, String>) {
    choose(
        catalog,
        &cluster.spec.version,
        cluster.status.as_ref().and_then(|s| s.version.as_deref()),
    )
}

/// `VersionAvailable`: the data's version has an image, and so has the spec's when it
/// asks for a major upgrade (`target`: the catalog's answer for the spec's version).
pub fn assessment(
    wanted: &str,
    version: &str,
    image: &Result<String, String>,
    target: &Result<String, String>,
    source: &str,
) -> Assessment {
    match image {
        Err(why) => Assessment::new(false, "NotInCatalog", why.clone()),
        Ok(image) if version != wanted => match target {
            Err(why) => Assessment::new(
                false,
                "NotInCatalog",
                format!(
                    "the data is in PostgreSQL {version} (running {image}); the major upgrade to \
                     {wanted} waits for an image: {why}"
                ),
            ),
            Ok(next) => Assessment::new(
                true,
                "InCatalog",
                format!(
                    "PostgreSQL {version} runs {image}; {wanted} runs {next} once the change of \
                     major version (condition MajorUpgrade) is through (image catalog {source})"
                ),
            ),
        },
        Ok(image) => Assessment::new(
            true,
            "InCatalog",
            format!("PostgreSQL {version} runs {image} (image catalog {source})"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(entries: &[(&str, &str)]) -> Catalog {
        Catalog {
            source: "castellan-system/castellan-images".to_owned(),
            images: Some(
                entries
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
        }
    }

    #[test]
    fn the_defaults_name_the_built_images() {
        let images = defaults("0.1.0");
        assert_eq!(
            images.get("15").map(String::as_str),
            Some("ghcr.io/castellan-io/castellan:0.1.0-pg15")
        );
        assert_eq!(
            images.get("18").map(String::as_str),
            Some("ghcr.io/castellan-io/castellan:0.1.0-pg18")
        );
    }

    #[test]
    fn a_version_without_an_entry_has_no_image_and_says_which_exist() {
        let catalog = catalog(&[("15", "a:15"), ("18", "a:18"), ("16", " ")]);
        assert_eq!(catalog.image("18"), Ok("a:18".to_owned()));
        let missing = catalog.image("17").expect_err("no 17");
        assert!(missing.contains("no image for PostgreSQL 17"), "{missing}");
        assert!(missing.contains("it has 15, 16, 18"), "{missing}");
        assert!(
            missing.contains("kubectl -n castellan-system edit configmap castellan-images"),
            "{missing}"
        );
        assert!(catalog.image("16").is_err(), "a blank entry is none");
        let unread = Catalog {
            source: "ns/c".to_owned(),
            images: None,
        };
        assert!(
            unread
                .image("15")
                .expect_err("unread")
                .contains("not been read yet")
        );
    }

    #[test]
    fn pods_run_the_version_their_data_is_in() {
        let catalog = catalog(&[("15", "a:15"), ("18", "a:18")]);
        // A new cluster: the spec's version.
        assert_eq!(
            choose(&catalog, "18", None),
            ("18".to_owned(), Ok("a:18".to_owned()))
        );
        // Data in 15, the spec raised to 18: still 15, and the condition says why.
        let (version, image) = choose(&catalog, "18", Some("15"));
        assert_eq!((version.as_str(), &image), ("15", &Ok("a:15".to_owned())));
        // … and the condition says which image comes with the upgrade.
        let judged = assessment(
            "18",
            &version,
            &image,
            &catalog.image("18"),
            &catalog.source,
        );
        assert_eq!((judged.status, judged.reason), (true, "InCatalog"));
        assert!(
            judged.message.contains("18 runs a:18"),
            "{}",
            judged.message
        );
        // An upgrade to a version without an image waits, and says why.
        let judged = assessment("17", "15", &image, &catalog.image("17"), &catalog.source);
        assert_eq!((judged.status, judged.reason), (false, "NotInCatalog"));
        assert!(
            judged.message.contains("upgrade to 17 waits"),
            "{}",
            judged.message
        );
        let ok = Ok("a:15".to_owned());
        let judged = assessment("15", "15", &ok, &ok, &catalog.source);
        assert_eq!((judged.status, judged.reason), (true, "InCatalog"));
        let missing = catalog.image("17");
        let judged = assessment("17", "17", &missing, &missing, &catalog.source);
        assert_eq!((judged.status, judged.reason), (false, "NotInCatalog"));
    }
}
