//! Where the operator keeps Castellan's PKI (`crate::pki` makes the certificates):
//!
//! - the CA in the Secret `castellan-ca` of the operator's own namespace
//!   (`kubernetes.io/tls`: `tls.crt`, `tls.key`), made by the first operator that finds
//!   none and never rewritten: two replicas racing to make it end with the one the API
//!   server stored first;
//! - each cluster's certificates beside the cluster, owned by it: the instance API's
//!   (`<cluster>-instance-tls`), PostgreSQL's server certificate (`<cluster>-server-tls`)
//!   and the replicas' client certificate (`<cluster>-replication-tls`), each made once
//!   and issued again only when it is no longer right (a third of its life left, or
//!   signed by a CA that is no longer the CA).

use std::collections::BTreeMap;
use std::time::SystemTime;

use castellan_crds::DatabaseCluster;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::build;
use super::cluster::{Assessment, Note};
use crate::pki::{self, Authority, Issued, PkiError, Standing};

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

fn read_authority(secret: &Secret, namespace: &str) -> Result<Authority, Error> {
    let name = secret.name_any();
    let data = secret.data.clone().unwrap_or_default();
    let field = |key: &'static str| {
        text(&data, key).ok_or_else(|| Error::Incomplete {
            namespace: namespace.to_owned(),
            secret: name.clone(),
            key,
        })
    };
    Authority::from_pem(&field("tls.crt")?, &field("tls.key")?).map_err(pki_error(format!(
        "reading the CA from Secret {namespace}/{name}"
    )))
}

fn ca_secret(authority: &Authority, namespace: &str) -> Secret {
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
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_owned(),
                ByteString(authority.cert_pem().as_bytes().to_vec()),
            ),
            (
                "tls.key".to_owned(),
                ByteString(authority.key_pem().as_bytes().to_vec()),
            ),
        ])),
        ..Secret::default()
    }
}

/// The CA of this installation: the one the user brings in `user_secret` (read, never
/// written), or Castellan's own, read from `castellan-ca` or made and stored there if
/// there is none.
pub async fn ensure_authority(
    client: &Client,
    namespace: &str,
    user_secret: Option<&str>,
) -> Result<Authority, Error> {
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
        return read_authority(&found, namespace);
    }
    let reading = format!("reading Secret {namespace}/{CA_SECRET}");
    if let Some(found) = secrets
        .get_opt(CA_SECRET)
        .await
        .map_err(kube_error(reading.clone()))?
    {
        tracing::info!(secret = %format!("{namespace}/{CA_SECRET}"), "using the existing CA");
        return read_authority(&found, namespace);
    }
    let authority = Authority::generate(SystemTime::now()).map_err(pki_error("making a new CA"))?;
    match secrets
        .create(&PostParams::default(), &ca_secret(&authority, namespace))
        .await
    {
        Ok(_) => {
            tracing::info!(secret = %format!("{namespace}/{CA_SECRET}"), "made a new CA");
            Ok(authority)
        }
        // Another replica stored its CA first; that one is the CA, and this one is
        // forgotten before it signed anything.
        Err(kube::Error::Api(status)) if status.code == 409 => {
            tracing::info!("another operator made the CA first; using it");
            let found = secrets.get(CA_SECRET).await.map_err(kube_error(reading))?;
            read_authority(&found, namespace)
        }
        Err(source) => Err(Error::Kube {
            what: format!("creating Secret {namespace}/{CA_SECRET}"),
            source,
        }),
    }
}

/// Why a cluster's instance Secret must be written, if it must.
fn reissue_reason(
    secret: Option<&Secret>,
    authority: &Authority,
    server_name: &str,
    now: SystemTime,
) -> Option<String> {
    let Some(secret) = secret else {
        return Some("there is none".to_owned());
    };
    let data = secret.data.clone().unwrap_or_default();
    let (Some(cert), Some(_key)) = (data.get("tls.crt"), data.get("tls.key")) else {
        return Some("the Secret lacks tls.crt or tls.key".to_owned());
    };
    match authority.examine(&cert.0, server_name, now) {
        Standing::Current => {}
        Standing::Expiring => return Some("it has a third of its life left or less".to_owned()),
        Standing::Foreign(why) | Standing::Unreadable(why) => return Some(why),
    }
    // The instances trust the callers that ca.crt lists; it must list the CA that
    // signed the operator's certificate.
    let trusted = data
        .get("ca.crt")
        .map(|bundle| {
            CertificateDer::pem_slice_iter(&bundle.0)
                .filter_map(Result::ok)
                .any(|ca| ca == *authority.cert_der())
        })
        .unwrap_or(false);
    if trusted {
        None
    } else {
        Some("its ca.crt does not hold the current CA".to_owned())
    }
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
pub async fn ensure_certificate(
    client: &Client,
    cluster: &DatabaseCluster,
    authority: &Authority,
    which: ClusterCertificate,
) -> Result<Option<Note>, Error> {
    let namespace = cluster.namespace().unwrap_or_else(|| "default".to_owned());
    let name = build::secret_name(cluster, which.suffix());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let existing = secrets
        .get_opt(&name)
        .await
        .map_err(kube_error(format!("reading Secret {namespace}/{name}")))?;
    let expected = which.expected_name(&cluster.name_any(), &namespace);
    let now = SystemTime::now();
    let Some(reason) = reissue_reason(existing.as_ref(), authority, &expected, now) else {
        return Ok(None);
    };
    let issued = which
        .issue(authority, &cluster.name_any(), &namespace, now)
        .map_err(pki_error(format!(
            "issuing {} for {expected}",
            which.describe()
        )))?;
    let secret = build::tls_secret(cluster, which.suffix(), authority.cert_pem(), &issued);
    let expires = k8s_openapi::jiff::Timestamp::try_from(issued.not_after)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "?".to_owned());
    if !write_secret(&secrets, existing, secret).await? {
        return Ok(None);
    }
    tracing::info!(secret = %name, %reason, %expires, "issued {}", which.describe());
    Ok(Some(Note::normal(
        "IssuedCertificate",
        format!(
            "issued {} for {expected} into Secret {name}, valid until {expires} ({reason})",
            which.describe()
        ),
    )))
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
        let ca = Authority::generate(now).expect("a CA");
        let name = pki::server_name("orders", "shop");
        let issued = ca.issue_server("orders", "shop", now).expect("issued");
        let good = secret(&[
            ("ca.crt", ca.cert_pem()),
            ("tls.crt", &issued.cert_pem),
            ("tls.key", &issued.key_pem),
        ]);
        assert_eq!(reissue_reason(Some(&good), &ca, &name, now), None);
        assert!(reissue_reason(None, &ca, &name, now).is_some());
        assert!(
            reissue_reason(Some(&good), &ca, &name, now + pki::SERVER_VALIDITY * 3 / 4).is_some(),
            "renewed in the last third of its life"
        );
        let other = Authority::generate(now).expect("another CA");
        assert!(
            reissue_reason(Some(&good), &other, &name, now).is_some(),
            "re-issued when the CA changed"
        );
        let stale_bundle = secret(&[
            ("ca.crt", other.cert_pem()),
            ("tls.crt", &issued.cert_pem),
            ("tls.key", &issued.key_pem),
        ]);
        assert!(reissue_reason(Some(&stale_bundle), &ca, &name, now).is_some());
        let bundle = format!("{}{}", other.cert_pem(), ca.cert_pem());
        let rotating = secret(&[
            ("ca.crt", &bundle),
            ("tls.crt", &issued.cert_pem),
            ("tls.key", &issued.key_pem),
        ]);
        assert_eq!(
            reissue_reason(Some(&rotating), &ca, &name, now),
            None,
            "a bundle that holds the current CA is right"
        );
        let keyless = secret(&[("ca.crt", ca.cert_pem()), ("tls.crt", &issued.cert_pem)]);
        assert!(reissue_reason(Some(&keyless), &ca, &name, now).is_some());
    }

    #[test]
    fn the_ca_secret_reads_back_as_the_same_ca() {
        let ca = Authority::generate(SystemTime::now()).expect("a CA");
        let stored = ca_secret(&ca, "castellan-system");
        assert_eq!(stored.type_.as_deref(), Some("kubernetes.io/tls"));
        let read = read_authority(&stored, "castellan-system").expect("reads back");
        assert_eq!(read.cert_der(), ca.cert_der());
        let mut broken = secret(&[("tls.crt", ca.cert_pem())]);
        broken.metadata.name = Some(CA_SECRET.to_owned());
        assert!(matches!(
            read_authority(&broken, "castellan-system"),
            Err(Error::Incomplete { key: "tls.key", .. })
        ));
    }
}
