//! Where the operator keeps Castellan's PKI (`crate::pki` makes the certificates):
//!
//! - the CA in the Secret `castellan-ca` of the operator's own namespace
//!   (`kubernetes.io/tls`: `tls.crt`, `tls.key` of the issuing CA, `ca.crt` the CAs
//!   everything trusts, and during a rotation `next.crt`, `next.key` of the coming CA),
//!   made by the first operator that finds none: two replicas racing to make it end
//!   with the one the API server stored first. Only a rotation (`rotation`) rewrites
//!   it, each step conditional on what it read;
//! - each cluster's certificates beside the cluster, owned by it: the instance API's
//!   (`<cluster>-instance-tls`), PostgreSQL's server certificate (`<cluster>-server-tls`)
//!   and the replicas' client certificate (`<cluster>-replication-tls`), each made once
//!   and issued again only when it is no longer right (a third of its life left, or
//!   signed by a CA that is no longer the CA).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use castellan_crds::DatabaseCluster;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};

use super::build;
use super::cluster::{Assessment, Note};
use crate::pki::{self, Authority, Issued, PkiError, Standing, Trust};

/// The CA's Secret, in the operator's namespace.
pub const CA_SECRET: &str = "castellan-ca";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
    #[error("{what}: {source}")]
    Pki { what: String, source: PkiError },
    #[error(
        "the CA Secret {namespace}/{secret} has no {key}; Castellan never overwrites it: \
         restore it, or (for Castellan's own CA) delete it to have a new CA made (every \
         certificate is then issued again)"
    )]
    Incomplete {
        namespace: String,
        secret: String,
        key: &'static str,
    },
    #[error(
        "the CA Secret {namespace}/{secret} named by --ca-secret does not exist; Castellan \
         never makes a CA in a Secret the user names: create it (kubernetes.io/tls with \
         tls.crt and tls.key of a CA certificate), or leave --ca-secret out to have \
         Castellan keep its own in {CA_SECRET}"
    )]
    UserCaMissing { namespace: String, secret: String },
}

fn kube_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

fn pki_error(what: impl Into<String>) -> impl FnOnce(PkiError) -> Error {
    let what = what.into();
    move |source| Error::Pki { what, source }
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .map(|value| String::from_utf8_lossy(&value.0).into_owned())
}

/// The CAs a CA Secret holds: the issuing one (`tls.crt`, `tls.key`), a coming one
/// (`next.crt`, `next.key`) and the bundle (`ca.crt`).
pub fn read_trust(secret: &Secret, namespace: &str) -> Result<Trust, Error> {
    let name = secret.name_any();
    let data = secret.data.clone().unwrap_or_default();
    let field = |key: &'static str| {
        text(&data, key).ok_or_else(|| Error::Incomplete {
            namespace: namespace.to_owned(),
            secret: name.clone(),
            key,
        })
    };
    let reading = |what: &str| pki_error(format!("reading {what} from Secret {namespace}/{name}"));
    let authority =
        Authority::from_pem(&field("tls.crt")?, &field("tls.key")?).map_err(reading("the CA"))?;
    let next = match (text(&data, "next.crt"), text(&data, "next.key")) {
        (Some(cert), Some(key)) => Some(Arc::new(
            Authority::from_pem(&cert, &key).map_err(reading("the coming CA"))?,
        )),
        _ => None,
    };
    let bundle = text(&data, "ca.crt").unwrap_or_default();
    Trust::new(Arc::new(authority), next, bundle.as_bytes()).map_err(reading("the CA bundle"))
}

/// The CA Secret's data for `trust`.
pub fn trust_data(trust: &Trust) -> BTreeMap<String, ByteString> {
    let mut data = BTreeMap::from([
        ("tls.crt", trust.authority.cert_pem().to_owned()),
        ("tls.key", trust.authority.key_pem().to_owned()),
        ("ca.crt", trust.bundle_pem()),
    ]);
    if let Some(next) = &trust.next {
        data.insert("next.crt", next.cert_pem().to_owned());
        data.insert("next.key", next.key_pem().to_owned());
    }
    data.into_iter()
        .map(|(key, value)| (key.to_owned(), ByteString(value.into_bytes())))
        .collect()
}

fn ca_secret(trust: &Trust, namespace: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(CA_SECRET.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                build::MANAGED_BY_LABEL.to_owned(),
                build::MANAGED_BY.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(trust_data(trust)),
        ..Secret::default()
    }
}

/// The CAs of this installation: the one the user brings in `user_secret` (read, never
/// written), or Castellan's own, read from `castellan-ca` or made and stored there if
/// there is none.
pub async fn ensure_trust(
    client: &Client,
    namespace: &str,
    user_secret: Option<&str>,
) -> Result<Trust, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    if let Some(user_secret) = user_secret {
        let found = secrets
            .get_opt(user_secret)
            .await
            .map_err(kube_error(format!(
                "reading Secret {namespace}/{user_secret}"
            )))?
            .ok_or_else(|| Error::UserCaMissing {
                namespace: namespace.to_owned(),
                secret: user_secret.to_owned(),
            })?;
        tracing::info!(secret = %format!("{namespace}/{user_secret}"), "using the CA the user brings");
        // Only its CA: a ca.crt beside it (cert-manager writes the issuer's) is not
        // trusted on that account.
        let mut found = found;
        if let Some(data) = found.data.as_mut() {
            data.retain(|key, _| key == "tls.crt" || key == "tls.key");
        }
        return read_trust(&found, namespace);
    }
    let reading = format!("reading Secret {namespace}/{CA_SECRET}");
    if let Some(found) = secrets
        .get_opt(CA_SECRET)
        .await
        .map_err(kube_error(reading.clone()))?
    {
        tracing::info!(secret = %format!("{namespace}/{CA_SECRET}"), "using the existing CA");
        return read_trust(&found, namespace);
    }
    let authority = Authority::generate(SystemTime::now()).map_err(pki_error("making a new CA"))?;
    let trust = Trust::single(Arc::new(authority));
    match secrets
        .create(&PostParams::default(), &ca_secret(&trust, namespace))
        .await
    {
        Ok(_) => {
            tracing::info!(secret = %format!("{namespace}/{CA_SECRET}"), "made a new CA");
            Ok(trust)
        }
        // Another replica stored its CA first; that one is the CA, and this one is
        // forgotten before it signed anything.
        Err(kube::Error::Api(status)) if status.code == 409 => {
            tracing::info!("another operator made the CA first; using it");
            let found = secrets.get(CA_SECRET).await.map_err(kube_error(reading))?;
            read_trust(&found, namespace)
        }
        Err(source) => Err(Error::Kube {
            what: format!("creating Secret {namespace}/{CA_SECRET}"),
            source,
        }),
    }
}

/// What a cluster's certificate Secret needs.
#[derive(Debug, PartialEq, Eq)]
enum Renewal {
    /// A new certificate, for this reason.
    Issue(String),
    /// The certificate stays; `ca.crt` becomes the trust bundle (a rotation added or
    /// dropped a CA).
    Rebundle,
}

/// What a cluster's certificate Secret needs, if anything.
fn renewal(
    secret: Option<&Secret>,
    trust: &Trust,
    server_name: &str,
    now: SystemTime,
) -> Option<Renewal> {
    let Some(secret) = secret else {
        return Some(Renewal::Issue("there is none".to_owned()));
    };
    let data = secret.data.clone().unwrap_or_default();
    let (Some(cert), Some(_key)) = (data.get("tls.crt"), data.get("tls.key")) else {
        return Some(Renewal::Issue(
            "the Secret lacks tls.crt or tls.key".to_owned(),
        ));
    };
    match trust.authority.examine(&cert.0, server_name, now) {
        Standing::Current => {}
        Standing::Expiring => {
            return Some(Renewal::Issue(
                "it has a third of its life left or less".to_owned(),
            ));
        }
        Standing::Foreign(why) | Standing::Unreadable(why) => return Some(Renewal::Issue(why)),
    }
    // The instances trust the callers (and each other's certificates) that ca.crt
    // lists: exactly the CAs of the bundle.
    let bundle = data
        .get("ca.crt")
        .map(|b| b.0.as_slice())
        .unwrap_or_default();
    (!trust.is_bundle(bundle)).then_some(Renewal::Rebundle)
}

/// The certificates a cluster's pods mount, each in a Secret of its own beside the
/// cluster (`<cluster>-<suffix>`, `kubernetes.io/tls`: `ca.crt`, `tls.crt`, `tls.key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterCertificate {
    /// The instance API's server certificate.
    Instance,
    /// PostgreSQL's server certificate, for the Services' names.
    Postgres,
    /// The replicas' client certificate (`CN=streaming_replica`).
    Replication,
}

impl ClusterCertificate {
    pub const ALL: [Self; 3] = [Self::Instance, Self::Postgres, Self::Replication];

    pub fn suffix(self) -> &'static str {
        match self {
            Self::Instance => build::INSTANCE_TLS,
            Self::Postgres => build::SERVER_TLS,
            Self::Replication => build::REPLICATION_TLS,
        }
    }

    /// The DNS name the certificate must carry.
    fn expected_name(self, cluster: &str, namespace: &str) -> String {
        match self {
            Self::Instance => pki::server_name(cluster, namespace),
            Self::Postgres => pki::postgres_server_name(cluster, namespace),
            Self::Replication => pki::replication_name(cluster, namespace),
        }
    }

    fn issue(
        self,
        authority: &Authority,
        cluster: &str,
        namespace: &str,
        now: SystemTime,
    ) -> Result<Issued, PkiError> {
        match self {
            Self::Instance => authority.issue_server(cluster, namespace, now),
            Self::Postgres => authority.issue_postgres_server(cluster, namespace, now),
            Self::Replication => authority.issue_replication(cluster, namespace, now),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Instance => "the instance API's certificate",
            Self::Postgres => "PostgreSQL's server certificate",
            Self::Replication => "the replication client certificate",
        }
    }
}

/// Makes sure the cluster's pods have a current certificate of kind `which` in its
/// Secret before any pod mounts it; returns the Event to record when one was written.
/// A cluster's certificate Secret of kind `which` as the API server has it.
struct Held {
    secrets: Api<Secret>,
    namespace: String,
    name: String,
    /// The DNS name its certificate must carry.
    expected: String,
    found: Option<Secret>,
}

async fn held(
    client: &Client,
    cluster: &DatabaseCluster,
    which: ClusterCertificate,
) -> Result<Held, Error> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let name = build::secret_name(cluster, which.suffix());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let found = secrets
        .get_opt(&name)
        .await
        .map_err(kube_error(format!("reading Secret {namespace}/{name}")))?;
    let expected = which.expected_name(&cluster.name_any(), &namespace);
    Ok(Held {
        secrets,
        namespace,
        name,
        expected,
        found,
    })
}

pub async fn ensure_certificate(
    client: &Client,
    cluster: &DatabaseCluster,
    trust: &Trust,
    which: ClusterCertificate,
) -> Result<Option<Note>, Error> {
    let Held {
        secrets,
        namespace,
        name,
        expected,
        found: existing,
    } = held(client, cluster, which).await?;
    let now = SystemTime::now();
    let reason = match renewal(existing.as_ref(), trust, &expected, now) {
        None => return Ok(None),
        Some(Renewal::Issue(reason)) => reason,
        Some(Renewal::Rebundle) => {
            let Some(mut secret) = existing.clone() else {
                return Ok(None);
            };
            let bundle = trust.bundle_pem();
            secret
                .data
                .get_or_insert_default()
                .insert("ca.crt".to_owned(), ByteString(bundle.into_bytes()));
            if !write_secret(&secrets, existing, secret).await? {
                return Ok(None);
            }
            tracing::info!(secret = %name, cas = trust.bundle().len(), "updated the CAs a Secret trusts");
            // About the Secret: one Event per Secret, not a series keeping the first's
            // message.
            return Ok(Some(
                Note::normal(
                    "UpdatedTrust",
                    format!(
                        "Secret {name} now trusts {} CA(s): a CA rotation is under way or done",
                        trust.bundle().len()
                    ),
                )
                .about_object("v1", "Secret", &name),
            ));
        }
    };
    let issued = which
        .issue(&trust.authority, &cluster.name_any(), &namespace, now)
        .map_err(pki_error(format!(
            "issuing {} for {expected}",
            which.describe()
        )))?;
    let secret = build::tls_secret(cluster, which.suffix(), &trust.bundle_pem(), &issued);
    let expires = k8s_openapi::jiff::Timestamp::try_from(issued.not_after)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "?".to_owned());
    if !write_secret(&secrets, existing, secret).await? {
        return Ok(None);
    }
    tracing::info!(secret = %name, %reason, %expires, "issued {}", which.describe());
    Ok(Some(
        Note::normal(
            "IssuedCertificate",
            format!(
                "issued {} for {expected} into Secret {name}, valid until {expires} ({reason})",
                which.describe()
            ),
        )
        .about_object("v1", "Secret", &name),
    ))
}

/// The fingerprint of the certificate of kind `which` in the cluster's Secret, once it
/// is right for `trust` (issued by its issuing CA, `ca.crt` its bundle); otherwise what
/// is not right yet, which the cluster's next pass mends.
pub async fn settled_certificate(
    client: &Client,
    cluster: &DatabaseCluster,
    trust: &Trust,
    which: ClusterCertificate,
) -> Result<String, String> {
    let Held {
        name,
        expected,
        found,
        ..
    } = held(client, cluster, which)
        .await
        .map_err(|error| error.to_string())?;
    match renewal(found.as_ref(), trust, &expected, SystemTime::now()) {
        Some(Renewal::Issue(why)) => Err(format!("Secret {name} is to be issued again ({why})")),
        Some(Renewal::Rebundle) => Err(format!("Secret {name} does not list the CAs yet")),
        None => Ok(found
            .and_then(|secret| secret.data?.get("tls.crt").cloned())
            .and_then(|cert| pki::fingerprints(&cert.0).into_iter().next())
            .unwrap_or_default()),
    }
}

/// Creates `secret`, or replaces `existing` with it conditionally on what was read, so
/// that two writers cannot both win. `false` when someone else wrote it meanwhile (the
/// next pass looks at theirs).
async fn write_secret(
    secrets: &Api<Secret>,
    existing: Option<Secret>,
    mut secret: Secret,
) -> Result<bool, Error> {
    let name = secret.name_any();
    let written = match existing {
        None => secrets.create(&PostParams::default(), &secret).await,
        Some(old) => {
            secret.metadata.resource_version = old.resource_version();
            secrets
                .replace(&name, &PostParams::default(), &secret)
                .await
        }
    };
    match written {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(source) => Err(Error::Kube {
            what: format!(
                "writing Secret {}/{name}",
                secret.namespace().unwrap_or_default()
            ),
            source,
        }),
    }
}

/// What following the user's own server certificate (`spec.tls.serverCertificate`)
/// came to.
pub struct Brought {
    /// The Event to record when `<cluster>-server-tls` was written.
    pub note: Option<Note>,
    /// The `ServerCertificate` condition.
    pub assessment: Assessment,
    /// The CA clients verify the served certificate with (the application Secret's
    /// `ca.crt`), when one is served.
    pub served_ca: Option<String>,
}

/// Keeps `<cluster>-server-tls`, which the pods mount, a copy of the user's Secret
/// `source`, as long as it can be served: the key belongs to the certificate and the
/// certificate verifies for the `-rw` name with the Secret's `ca.crt`. A Secret that is
/// missing or cannot be served never replaces what is served (replicas verify their
/// primary with it, so a wrong one would cut replication); the condition says why.
/// Copying, rather than mounting the user's Secret, lets the setting change on a
/// running cluster without new pods, and keeps the pods' Secrets Castellan's own.
pub async fn follow_brought_certificate(
    client: &Client,
    cluster: &DatabaseCluster,
    source: &str,
) -> Result<Brought, Error> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let target = build::secret_name(cluster, build::SERVER_TLS);
    let read = |name: String| {
        let secrets = secrets.clone();
        let namespace = namespace.clone();
        async move {
            secrets
                .get_opt(&name)
                .await
                .map_err(kube_error(format!("reading Secret {namespace}/{name}")))
        }
    };
    let served = read(target.clone()).await?;
    let served_ca = served
        .as_ref()
        .and_then(|s| s.data.as_ref())
        .and_then(|data| text(data, "ca.crt"));
    let expected = pki::postgres_server_name(&cluster.name_any(), &namespace);
    let refused = |why: String| Brought {
        note: None,
        assessment: Assessment::new(
            false,
            "CertificateRefused",
            format!(
                "the server certificate in Secret {source} (spec.tls.serverCertificate) is not served: {why}; {}",
                if served.is_some() {
                    "PostgreSQL keeps serving the certificate it has"
                } else {
                    "the instances wait for a certificate they can serve"
                }
            ),
        ),
        served_ca: served_ca.clone(),
    };
    let Some(brought) = read(source.to_owned()).await? else {
        return Ok(refused("the Secret does not exist".to_owned()));
    };
    let data = brought.data.unwrap_or_default();
    let (Some(cert), Some(key), Some(ca)) = (
        text(&data, "tls.crt"),
        text(&data, "tls.key"),
        text(&data, "ca.crt"),
    ) else {
        return Ok(refused(
            "it must hold tls.crt, tls.key and ca.crt (the CA clients and replicas verify it with)"
                .to_owned(),
        ));
    };
    let ends = match pki::tls::check_server_certificate(
        cert.as_bytes(),
        key.as_bytes(),
        ca.as_bytes(),
        &expected,
        SystemTime::now(),
    ) {
        Ok(ends) => k8s_openapi::jiff::Timestamp::try_from(ends)
            .map(|t| t.to_string())
            .unwrap_or_else(|_| "?".to_owned()),
        Err(why) => return Ok(refused(why)),
    };
    let copy = build::owned_tls_secret(cluster, build::SERVER_TLS, &ca, &cert, &key);
    let assessment = Assessment::new(
        true,
        "Brought",
        format!("serving the certificate of Secret {source} for {expected}, valid until {ends}"),
    );
    if served.as_ref().and_then(|s| s.data.as_ref()) == copy.data.as_ref() {
        return Ok(Brought {
            note: None,
            assessment,
            served_ca: Some(ca),
        });
    }
    if !write_secret(&secrets, served, copy).await? {
        return Ok(Brought {
            note: None,
            assessment,
            served_ca,
        });
    }
    tracing::info!(secret = %target, from = %source, %ends, "PostgreSQL's server certificate follows the user's Secret");
    Ok(Brought {
        note: Some(Note::normal(
            "CopiedCertificate",
            format!(
                "PostgreSQL's server certificate for {expected} now comes from Secret {source} (into {target}), valid until {ends}"
            ),
        )),
        assessment,
        served_ca: Some(ca),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn an_instance_secret_is_written_only_when_it_is_not_right() {
        let now = SystemTime::now();
        let ca = Arc::new(Authority::generate(now).expect("a CA"));
        let trust = Trust::single(ca.clone());
        let name = pki::server_name("orders", "shop");
        let issued = ca.issue_server("orders", "shop", now).expect("issued");
        let good = secret(&[
            ("ca.crt", ca.cert_pem()),
            ("tls.crt", &issued.cert_pem),
            ("tls.key", &issued.key_pem),
        ]);
        let issue = |found: Option<&Secret>, trust: &Trust, at: SystemTime| {
            matches!(renewal(found, trust, &name, at), Some(Renewal::Issue(_)))
        };
        assert_eq!(renewal(Some(&good), &trust, &name, now), None);
        assert!(issue(None, &trust, now));
        assert!(
            issue(Some(&good), &trust, now + pki::SERVER_VALIDITY * 3 / 4),
            "renewed in the last third of its life"
        );
        let other = Arc::new(Authority::generate(now).expect("another CA"));
        assert!(
            issue(Some(&good), &Trust::single(other.clone()), now),
            "re-issued when the CA changed"
        );
        let keyless = secret(&[("ca.crt", ca.cert_pem()), ("tls.crt", &issued.cert_pem)]);
        assert!(issue(Some(&keyless), &trust, now));
    }

    #[test]
    fn a_rotation_changes_ca_crt_without_issuing_while_the_certificate_is_the_issuing_cas() {
        let now = SystemTime::now();
        let old = Arc::new(Authority::generate(now).expect("the old CA"));
        let new = Arc::new(Authority::generate(now).expect("the new CA"));
        let name = pki::server_name("orders", "shop");
        let issued = old.issue_server("orders", "shop", now).expect("issued");
        let with_bundle = |bundle: &str| {
            secret(&[
                ("ca.crt", bundle),
                ("tls.crt", &issued.cert_pem),
                ("tls.key", &issued.key_pem),
            ])
        };
        let steady = with_bundle(old.cert_pem());
        // First step: the coming CA is trusted, nothing is issued.
        let trusting =
            Trust::new(old.clone(), Some(new.clone()), old.cert_pem().as_bytes()).expect("two");
        assert_eq!(
            renewal(Some(&steady), &trusting, &name, now),
            Some(Renewal::Rebundle)
        );
        let bundled = with_bundle(&trusting.bundle_pem());
        assert_eq!(renewal(Some(&bundled), &trusting, &name, now), None);
        // Second: the new CA issues; the old certificate is replaced.
        let retiring = trusting.switched().expect("switched");
        assert!(matches!(
            renewal(Some(&bundled), &retiring, &name, now),
            Some(Renewal::Issue(why)) if why.contains("not signed by the current CA")
        ));
        // Last: the old CA leaves ca.crt; a certificate of the new one stays.
        let renewed = new.issue_server("orders", "shop", now).expect("issued");
        let current = secret(&[
            ("ca.crt", &retiring.bundle_pem()),
            ("tls.crt", &renewed.cert_pem),
            ("tls.key", &renewed.key_pem),
        ]);
        assert_eq!(renewal(Some(&current), &retiring, &name, now), None);
        assert_eq!(
            renewal(Some(&current), &retiring.retired(), &name, now),
            Some(Renewal::Rebundle)
        );
    }

    #[test]
    fn the_ca_secret_reads_back_as_the_same_cas() {
        let now = SystemTime::now();
        let ca = Arc::new(Authority::generate(now).expect("a CA"));
        let stored = ca_secret(&Trust::single(ca.clone()), "castellan-system");
        assert_eq!(stored.type_.as_deref(), Some("kubernetes.io/tls"));
        let read = read_trust(&stored, "castellan-system").expect("reads back");
        assert_eq!(read.authority.cert_der(), ca.cert_der());
        assert!(read.next.is_none() && !read.retiring());
        // A rotation's first step reads back with its coming CA.
        let next = Arc::new(Authority::generate(now).expect("the coming CA"));
        let trusting = Trust::new(ca.clone(), Some(next.clone()), b"").expect("two");
        let stored = ca_secret(&trusting, "castellan-system");
        let read = read_trust(&stored, "castellan-system").expect("reads back");
        assert_eq!(
            read.next.as_ref().map(|n| n.fingerprint()),
            Some(next.fingerprint())
        );
        assert_eq!(read.fingerprints(), trusting.fingerprints());
        // Made before rotation existed: no ca.crt, trust is the issuing CA.
        let old_layout = secret(&[("tls.crt", ca.cert_pem()), ("tls.key", ca.key_pem())]);
        let read = read_trust(&old_layout, "castellan-system").expect("reads");
        assert_eq!(read.bundle().len(), 1);
        let mut broken = secret(&[("tls.crt", ca.cert_pem())]);
        broken.metadata.name = Some(CA_SECRET.to_owned());
        assert!(matches!(
            read_trust(&broken, "castellan-system"),
            Err(Error::Incomplete { key: "tls.key", .. })
        ));
    }
}
