//! Castellan's certificate authority and what it issues.
//!
//! One CA per installation (the operator keeps it in the Secret `castellan-ca` of its
//! own namespace) signs two kinds of certificate, and nothing else yet:
//!
//! - the operator's **client** certificate (EKU clientAuth only, SAN
//!   `operator.castellan.io`), issued in memory at startup and renewed in memory;
//! - one **server** certificate per `DatabaseCluster` (EKU serverAuth only, SAN
//!   `<cluster>.<namespace>.instance.castellan.io`), which every instance manager of
//!   the cluster serves its API with.
//!
//! Because the two kinds never share an EKU, a database pod's own certificate cannot be
//! used to call another instance, and the operator's cannot serve. This module owns the
//! certificates themselves (issuing, reading, deciding when one must be re-issued) and
//! the TLS configurations of both ends of the instance API (`tls`); where they are kept
//! (Secrets, files) belongs to the callers. The design, validity periods and what comes
//! next (PostgreSQL's own TLS, rotation of the CA, a CA the user brings) are in
//! `docs/pki.md`.

pub mod cli;
pub mod tls;
mod trust;

pub use trust::Trust;

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData as _, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The DNS suffix of the names instance managers' certificates carry. It is never
/// resolved: the operator dials pods by IP and verifies this name instead (a pod's IP
/// changes with every pod, a cluster's name does not).
pub const INSTANCE_DOMAIN: &str = "instance.castellan.io";
/// The DNS name in the operator's client certificate; the instance API accepts no
/// other client.
pub const OPERATOR_NAME: &str = "operator.castellan.io";

/// The CA lives long: replacing it means re-issuing everything it signed.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);
/// A cluster's server certificate; the operator renews it once a third is left.
pub const SERVER_VALIDITY: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// The operator's client certificate exists only in its memory and is renewed there,
/// so it can be short-lived.
pub const CLIENT_VALIDITY: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// Certificates start this long before they are made, so that a peer whose clock is a
/// little behind does not refuse them as not yet valid.
const BACKDATE: Duration = Duration::from_secs(5 * 60);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("issuing the certificate of {what}: {source}")]
    Issue { what: String, source: rcgen::Error },
    #[error("reading {what} as PEM: {reason}")]
    Pem { what: String, reason: String },
    #[error("reading {what}: {reason}")]
    Certificate { what: String, reason: String },
    #[error("the CA's private key does not belong to its certificate")]
    CaKeyMismatch,
    #[error("the CA certificate is not a CA (it lacks basicConstraints CA:TRUE)")]
    NotACa,
    #[error("building {what}: {source}")]
    Tls {
        what: &'static str,
        source: rustls::Error,
    },
    #[error("building the verifier of client certificates: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("reading {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The name an instance manager of `cluster` in `namespace` is verified by.
pub fn server_name(cluster: &str, namespace: &str) -> String {
    format!("{cluster}.{namespace}.{INSTANCE_DOMAIN}")
}

/// The role replicas stream as; their client certificate's common name.
pub const REPLICATION_ROLE: &str = "streaming_replica";

/// The name PostgreSQL's server certificate is verified by (by replicas, and by
/// clients using the application Secret's `uri`): the `-rw` Service's.
pub fn postgres_server_name(cluster: &str, namespace: &str) -> String {
    format!("{cluster}-rw.{namespace}.svc")
}

/// Every name a client may reach a cluster's PostgreSQL by: the `-rw`, `-ro` and `-r`
/// Services, short, namespaced and fully qualified. The `-rw` one with `.svc` first.
pub fn postgres_server_names(cluster: &str, namespace: &str) -> Vec<String> {
    let mut names = vec![postgres_server_name(cluster, namespace)];
    for service in ["rw", "ro", "r"] {
        let base = format!("{cluster}-{service}");
        for name in [
            base.clone(),
            format!("{base}.{namespace}"),
            format!("{base}.{namespace}.svc"),
            format!("{base}.{namespace}.svc.cluster.local"),
        ] {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// The DNS name in a cluster's replication client certificate.
pub fn replication_name(cluster: &str, namespace: &str) -> String {
    format!("{cluster}.{namespace}.replication.{INSTANCE_DOMAIN}")
}

/// A certificate and its private key, as PEM, with its validity.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: SystemTime,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key: Debug output ends up in logs.
        f.debug_struct("Issued")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Issued {
    pub fn cert_der(&self) -> Result<CertificateDer<'static>, PkiError> {
        first_certificate(self.cert_pem.as_bytes(), "an issued certificate")
    }

    pub fn key_der(&self) -> Result<PrivateKeyDer<'static>, PkiError> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|e| PkiError::Pem {
            what: "an issued private key".to_owned(),
            reason: e.to_string(),
        })
    }
}

/// The CA: its certificate, and the key it signs with.
pub struct Authority {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

/// How an existing server certificate stands against the CA and the clock.
#[derive(Debug, PartialEq, Eq)]
pub enum Standing {
    /// Signed by this CA, for the expected name, with more than a third of its life left.
    Current,
    /// A third or less of its life is left (or none).
    Expiring,
    /// Not signed by this CA (the CA was replaced), or made for another name.
    Foreign(String),
    /// Not a certificate that can be read.
    Unreadable(String),
}

fn offset(time: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(time)
}

fn first_certificate(pem: &[u8], what: &str) -> Result<CertificateDer<'static>, PkiError> {
    CertificateDer::pem_slice_iter(pem)
        .next()
        .ok_or_else(|| PkiError::Pem {
            what: what.to_owned(),
            reason: "no CERTIFICATE block".to_owned(),
        })?
        .map_err(|e| PkiError::Pem {
            what: what.to_owned(),
            reason: e.to_string(),
        })
}

/// Every certificate of a PEM bundle (a CA bundle a user brings), each read as X.509;
/// an error when one cannot be read or there is none, which a TLS client would
/// otherwise take as "no extra roots" and fail later with an unknown issuer.
pub fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let mut found = Vec::new();
    for certificate in CertificateDer::pem_slice_iter(pem) {
        let der = certificate.map_err(|e| PkiError::Pem {
            what: what.to_owned(),
            reason: format!("not PEM certificates: {e}"),
        })?;
        parse(&der, what).map_err(|e| PkiError::Certificate {
            what: what.to_owned(),
            reason: format!("certificate {} cannot be read: {e}", found.len() + 1),
        })?;
        found.push(der);
    }
    if found.is_empty() {
        return Err(PkiError::Pem {
            what: what.to_owned(),
            reason: "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned(),
        });
    }
    Ok(found)
}

fn parse<'a>(
    der: &'a CertificateDer<'_>,
    what: &str,
) -> Result<x509_parser::certificate::X509Certificate<'a>, PkiError> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, certificate)| certificate)
        .map_err(|e| PkiError::Certificate {
            what: what.to_owned(),
            reason: e.to_string(),
        })
}

/// When a certificate ends (its notAfter).
pub fn not_after(der: &CertificateDer<'_>) -> Result<SystemTime, PkiError> {
    let certificate = parse(der, "a certificate")?;
    let seconds = certificate.validity().not_after.timestamp();
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(seconds).unwrap_or_default()))
}

/// The DNS names in a certificate's subjectAltName.
pub fn dns_names(der: &CertificateDer<'_>) -> Result<Vec<String>, PkiError> {
    let certificate = parse(der, "a certificate")?;
    let names = certificate
        .subject_alternative_name()
        .map_err(|e| PkiError::Certificate {
            what: "a certificate's subjectAltName".to_owned(),
            reason: e.to_string(),
        })?
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|name| match name {
                    x509_parser::extensions::GeneralName::DNSName(dns) => Some((*dns).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(names)
}

/// A certificate's subject: Castellan's organisation and `common_name`.
fn subject(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "castellan.io");
    name.push(DnType::CommonName, common_name);
    name
}

impl Authority {
    /// A new CA, valid from now for [`CA_VALIDITY`].
    pub fn generate(now: SystemTime) -> Result<Self, PkiError> {
        let issuing = |source| PkiError::Issue {
            what: "the CA".to_owned(),
            source,
        };
        let key = KeyPair::generate().map_err(issuing)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject("Castellan CA");
        // No intermediates below it: everything it signs is an end entity.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = offset(now - BACKDATE);
        params.not_after = offset(now + CA_VALIDITY);
        let certificate = params.self_signed(&key).map_err(issuing)?;
        let cert_pem = certificate.pem();
        let key_pem = key.serialize_pem();
        Self::from_pem(&cert_pem, &key_pem)
    }

    /// The CA kept in PEM (a Secret's `tls.crt` and `tls.key`).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, PkiError> {
        let cert_der = first_certificate(cert_pem.as_bytes(), "the CA certificate")?;
        let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::Pem {
            what: "the CA's private key".to_owned(),
            reason: e.to_string(),
        })?;
        let certificate = parse(&cert_der, "the CA certificate")?;
        if !certificate.is_ca() {
            return Err(PkiError::NotACa);
        }
        if certificate.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(PkiError::CaKeyMismatch);
        }
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(|source| PkiError::Issue {
                what: "the CA (reading it back)".to_owned(),
                source,
            })?;
        Ok(Self {
            cert_pem: cert_pem.to_owned(),
            cert_der,
            key_pem: key_pem.to_owned(),
            issuer,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    fn issue(
        &self,
        what: String,
        common_name: &str,
        dns_names: &[String],
        usage: ExtendedKeyUsagePurpose,
        now: SystemTime,
        validity: Duration,
    ) -> Result<Issued, PkiError> {
        let issuing = |source| PkiError::Issue {
            what: what.clone(),
            source,
        };
        let key = KeyPair::generate().map_err(issuing)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = subject(common_name);
        params.subject_alt_names = dns_names
            .iter()
            .map(|name| Ok(SanType::DnsName(name.clone().try_into()?)))
            .collect::<Result<_, rcgen::Error>>()
            .map_err(issuing)?;
        params.is_ca = IsCa::ExplicitNoCa;
        // ECDSA keys only sign; one usage each, so a certificate cannot play the other
        // role.
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let not_after = now + validity;
        params.not_before = offset(now - BACKDATE);
        params.not_after = offset(not_after);
        let certificate = params.signed_by(&key, &self.issuer).map_err(issuing)?;
        Ok(Issued {
            cert_pem: certificate.pem(),
            key_pem: key.serialize_pem(),
            not_after,
        })
    }

    /// The server certificate of a cluster's instance managers.
    pub fn issue_server(
        &self,
        cluster: &str,
        namespace: &str,
        now: SystemTime,
    ) -> Result<Issued, PkiError> {
        let name = server_name(cluster, namespace);
        self.issue(
            format!("the instances of {namespace}/{cluster}"),
            &name,
            std::slice::from_ref(&name),
            ExtendedKeyUsagePurpose::ServerAuth,
            now,
            SERVER_VALIDITY,
        )
    }

    /// PostgreSQL's server certificate for a cluster: every name its Services are
    /// reached by (`postgres_server_names`); the first is also its common name.
    pub fn issue_postgres_server(
        &self,
        cluster: &str,
        namespace: &str,
        now: SystemTime,
    ) -> Result<Issued, PkiError> {
        let names = postgres_server_names(cluster, namespace);
        self.issue(
            format!("PostgreSQL of {namespace}/{cluster}"),
            &names[0],
            &names,
            ExtendedKeyUsagePurpose::ServerAuth,
            now,
            SERVER_VALIDITY,
        )
    }

    /// The client certificate a cluster's replicas authenticate with as
    /// `streaming_replica`: PostgreSQL's `cert` method takes the role from the common
    /// name. Its DNS name (`replication_name`) is not the operator's, so the instance
    /// API refuses it.
    pub fn issue_replication(
        &self,
        cluster: &str,
        namespace: &str,
        now: SystemTime,
    ) -> Result<Issued, PkiError> {
        self.issue(
            format!("the replication role of {namespace}/{cluster}"),
            REPLICATION_ROLE,
            &[replication_name(cluster, namespace)],
            ExtendedKeyUsagePurpose::ClientAuth,
            now,
            SERVER_VALIDITY,
        )
    }

    /// The operator's client certificate.
    pub fn issue_operator(&self, now: SystemTime) -> Result<Issued, PkiError> {
        self.issue(
            "the operator".to_owned(),
            "castellan-operator",
            &[OPERATOR_NAME.to_owned()],
            ExtendedKeyUsagePurpose::ClientAuth,
            now,
            CLIENT_VALIDITY,
        )
    }

    /// Whether a server certificate kept for `expected_name` can stay, or must be
    /// issued again.
    pub fn examine(&self, cert_pem: &[u8], expected_name: &str, now: SystemTime) -> Standing {
        let der = match first_certificate(cert_pem, "the certificate") {
            Ok(der) => der,
            Err(error) => return Standing::Unreadable(error.to_string()),
        };
        let certificate = match parse(&der, "the certificate") {
            Ok(certificate) => certificate,
            Err(error) => return Standing::Unreadable(error.to_string()),
        };
        let ca = match parse(&self.cert_der, "the CA certificate") {
            Ok(ca) => ca,
            Err(error) => return Standing::Unreadable(error.to_string()),
        };
        if certificate.verify_signature(Some(ca.public_key())).is_err() {
            return Standing::Foreign("it is not signed by the current CA".to_owned());
        }
        match dns_names(&der) {
            Ok(names) if names.iter().any(|n| n == expected_name) => {}
            Ok(names) => {
                return Standing::Foreign(format!("it names {names:?}, not {expected_name}"));
            }
            Err(error) => return Standing::Unreadable(error.to_string()),
        }
        if third_left(&certificate, now) {
            Standing::Expiring
        } else {
            Standing::Current
        }
    }

    /// Whether a third or less of the CA's own life is left: time to rotate it.
    pub fn expiring(&self, now: SystemTime) -> bool {
        parse(&self.cert_der, "the CA certificate").is_ok_and(|ca| third_left(&ca, now))
    }

    /// The SHA-256 fingerprint of the CA's certificate.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert_der)
    }
}

/// Whether a third or less of a certificate's life is left. Renewing then gives a
/// year's certificate four months, time for pods to pick the new one up and for a
/// person to notice if renewal keeps failing.
fn third_left(
    certificate: &x509_parser::certificate::X509Certificate<'_>,
    now: SystemTime,
) -> bool {
    let validity = certificate.validity();
    let start = validity.not_before.timestamp();
    let end = validity.not_after.timestamp();
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    (end - now).saturating_mul(3) <= end - start
}

/// The SHA-256 of a certificate's DER, in lowercase hex: how an instance names the
/// certificates it loaded, and the operator the ones in its Secrets.
pub fn fingerprint(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The fingerprints of the certificates in a PEM text, in order; blocks that cannot be
/// read are left out.
pub fn fingerprints(pem: &[u8]) -> Vec<String> {
    CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .map(|der| fingerprint(&der))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> SystemTime {
        SystemTime::now()
    }

    #[test]
    fn a_ca_bundle_must_hold_readable_certificates() {
        let authority = Authority::generate(now()).expect("a CA");
        let pem = authority.cert_pem().to_owned();
        let read = |text: &str| certificates(text.as_bytes(), "the bundle").map(|c| c.len());
        assert_eq!(read(&pem).ok(), Some(1));
        assert_eq!(read(&format!("{pem}\n{pem}")).ok(), Some(2));
        let empty = read("just text").expect_err("no certificate").to_string();
        assert!(empty.contains("holds no PEM certificate"), "{empty}");
        let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let unreadable = read(broken).expect_err("not a certificate").to_string();
        assert!(unreadable.contains("cannot be read"), "{unreadable}");
    }

    fn eku(der: &CertificateDer<'_>) -> (bool, bool) {
        let certificate = parse(der, "test").expect("parses");
        let eku = certificate
            .extended_key_usage()
            .expect("readable")
            .expect("present")
            .value;
        (eku.server_auth, eku.client_auth)
    }

    #[test]
    fn issued_certificates_chain_to_the_ca_with_one_usage_each() {
        let ca = Authority::generate(now()).expect("a CA");
        let ca_cert = parse(ca.cert_der(), "ca").expect("parses");
        assert!(ca_cert.is_ca());

        let server = ca.issue_server("orders", "shop", now()).expect("server");
        let server_der = server.cert_der().expect("der");
        let parsed = parse(&server_der, "server").expect("parses");
        assert!(parsed.verify_signature(Some(ca_cert.public_key())).is_ok());
        assert!(!parsed.is_ca());
        assert_eq!(eku(&server_der), (true, false), "serverAuth only");
        assert_eq!(
            dns_names(&server_der).expect("names"),
            vec!["orders.shop.instance.castellan.io".to_owned()]
        );

        let client = ca.issue_operator(now()).expect("client");
        let client_der = client.cert_der().expect("der");
        let parsed = parse(&client_der, "client").expect("parses");
        assert!(parsed.verify_signature(Some(ca_cert.public_key())).is_ok());
        assert_eq!(eku(&client_der), (false, true), "clientAuth only");
        assert_eq!(
            dns_names(&client_der).expect("names"),
            vec![OPERATOR_NAME.to_owned()]
        );
    }

    fn common_name(der: &CertificateDer<'_>) -> String {
        let certificate = parse(der, "test").expect("parses");
        certificate
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .expect("a common name")
            .to_owned()
    }

    #[test]
    fn postgres_certificates_name_the_services_and_the_replication_role() {
        let ca = Authority::generate(now()).expect("a CA");
        let server = ca
            .issue_postgres_server("orders", "shop", now())
            .expect("server");
        let der = server.cert_der().expect("der");
        assert_eq!(eku(&der), (true, false), "serverAuth only");
        let names = dns_names(&der).expect("names");
        assert_eq!(names[0], "orders-rw.shop.svc");
        for name in [
            "orders-rw",
            "orders-ro.shop",
            "orders-r.shop.svc",
            "orders-ro.shop.svc.cluster.local",
        ] {
            assert!(names.contains(&name.to_owned()), "{name} in {names:?}");
        }
        assert_eq!(names.len(), 12, "each name once: {names:?}");
        assert_eq!(common_name(&der), "orders-rw.shop.svc");
        assert_eq!(
            ca.examine(server.cert_pem.as_bytes(), "orders-rw.shop.svc", now()),
            Standing::Current
        );

        let replication = ca
            .issue_replication("orders", "shop", now())
            .expect("replication");
        let der = replication.cert_der().expect("der");
        assert_eq!(eku(&der), (false, true), "clientAuth only");
        assert_eq!(
            common_name(&der),
            "streaming_replica",
            "PostgreSQL's cert authentication maps the common name to the role"
        );
        assert_ne!(
            dns_names(&der).expect("names"),
            vec![OPERATOR_NAME.to_owned()],
            "the instance API accepts only the operator's name"
        );
    }

    #[test]
    fn a_ca_read_back_from_pem_signs_for_the_same_chain() {
        let ca = Authority::generate(now()).expect("a CA");
        let again = Authority::from_pem(ca.cert_pem(), ca.key_pem()).expect("reads back");
        let server = again.issue_server("a", "b", now()).expect("server");
        assert_eq!(
            ca.examine(
                server.cert_pem.as_bytes(),
                "a.b.instance.castellan.io",
                now()
            ),
            Standing::Current
        );
        let other = Authority::generate(now()).expect("another CA");
        assert!(matches!(
            Authority::from_pem(ca.cert_pem(), other.key_pem()),
            Err(PkiError::CaKeyMismatch)
        ));
        let leaf = ca.issue_operator(now()).expect("leaf");
        assert!(matches!(
            Authority::from_pem(&leaf.cert_pem, &leaf.key_pem),
            Err(PkiError::NotACa)
        ));
    }

    #[test]
    fn a_server_certificate_is_renewed_in_the_last_third_of_its_life() {
        let ca = Authority::generate(now()).expect("a CA");
        let name = "a.b.instance.castellan.io";
        let issued_at = now();
        let server = ca.issue_server("a", "b", issued_at).expect("server");
        let pem = server.cert_pem.as_bytes();
        assert_eq!(ca.examine(pem, name, issued_at), Standing::Current);
        assert_eq!(
            ca.examine(pem, name, issued_at + SERVER_VALIDITY / 2),
            Standing::Current
        );
        assert_eq!(
            ca.examine(pem, name, issued_at + SERVER_VALIDITY * 7 / 10),
            Standing::Expiring
        );
        assert_eq!(
            ca.examine(pem, name, issued_at + SERVER_VALIDITY * 2),
            Standing::Expiring
        );
        assert!(matches!(
            ca.examine(pem, "c.b.instance.castellan.io", issued_at),
            Standing::Foreign(_)
        ));
        let other = Authority::generate(now()).expect("another CA");
        assert!(matches!(
            other.examine(pem, name, issued_at),
            Standing::Foreign(_)
        ));
        assert!(matches!(
            ca.examine(b"garbage", name, issued_at),
            Standing::Unreadable(_)
        ));
    }

    #[test]
    fn the_debug_output_never_shows_a_key() {
        let ca = Authority::generate(now()).expect("a CA");
        let issued = ca.issue_operator(now()).expect("client");
        assert!(!format!("{issued:?}").contains("PRIVATE"));
        assert!(!format!("{ca:?}").contains("PRIVATE"));
    }
}
