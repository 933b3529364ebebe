//! The TLS configurations of the two ends of the instance API.
//!
//! - The operator ([`operator_client_config`]) trusts Castellan's CAs (two during a
//!   rotation), verifies the instance's server certificate for the cluster's name (not
//!   the IP it dials), and presents its client certificate, re-issued in memory when a
//!   third of its life is left.
//! - An instance manager ([`instance_server_config`]) serves its cluster's certificate
//!   (re-read when the mounted Secret changes) and requires a client certificate that
//!   chains to the CA, carries EKU clientAuth, and names the operator.
//!
//! TLS 1.3 only: both ends are Castellan, so there is no older peer to serve.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::client::ResolvesClientCert;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};

use super::{Authority, OPERATOR_NAME, PkiError, dns_names};

/// The crypto provider both ends use. Explicit, because the process links rustls with
/// more than one dependency's choice of provider, and an implicit default would panic.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certified(
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    what: &'static str,
) -> Result<CertifiedKey, PkiError> {
    CertifiedKey::from_der(vec![cert], key, &provider())
        .map_err(|source| PkiError::Tls { what, source })
}

/// Checks a server certificate the user brings for PostgreSQL (a `kubernetes.io/tls`
/// Secret: `tls.crt` with any intermediates after the leaf, `tls.key`, and `ca.crt`,
/// what clients and replicas verify it with): the key belongs to the certificate, and
/// the chain verifies against `ca.crt` for `name` (the `-rw` Service's, which replicas
/// verify and the application URI names) now, with serverAuth, as a client would
/// (webpki, the verifier rustls itself uses). Returns when the certificate ends, or why
/// it cannot be served: serving it would leave replicas unable to follow their primary.
pub fn check_server_certificate(
    cert_pem: &[u8],
    key_pem: &[u8],
    ca_pem: &[u8],
    name: &str,
    now: SystemTime,
) -> Result<SystemTime, String> {
    let chain = super::certificates(cert_pem, "tls.crt").map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("tls.key is not a PEM private key: {e}"))?;
    CertifiedKey::from_der(chain.clone(), key, &provider())
        .map_err(|e| format!("tls.key does not belong to tls.crt: {e}"))?;
    let mut roots = RootCertStore::empty();
    for ca in super::certificates(ca_pem, "ca.crt").map_err(|e| e.to_string())? {
        roots
            .add(ca)
            .map_err(|e| format!("ca.crt cannot be trusted as a CA: {e}"))?;
    }
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| format!("building a verifier from ca.crt: {e}"))?;
    let server_name = rustls::pki_types::ServerName::try_from(name.to_owned())
        .map_err(|e| format!("{name} is no server name: {e}"))?;
    let (leaf, intermediates) = chain.split_first().ok_or("tls.crt holds no certificate")?;
    let at = UnixTime::since_unix_epoch(
        now.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    verifier
        .verify_server_cert(leaf, intermediates, &server_name, &[], at)
        .map_err(|e| {
            format!("clients and replicas could not verify it for {name} with ca.crt: {e}")
        })?;
    super::not_after(leaf).map_err(|e| e.to_string())
}

/// The operator's client configuration for the instance API: its certificate from
/// the issuing CA, and every CA of the bundle trusted as a server's issuer (during a
/// rotation, instances serve certificates of either CA).
pub fn operator_client_config(trust: &super::Trust) -> Result<ClientConfig, PkiError> {
    client_config(trust.authority.clone(), trust.bundle())
}

/// A client configuration with a certificate from `authority` that trusts only
/// `roots`: what a rotation proves an instance with (it trusts the coming CA; it
/// serves a certificate of the new CA).
pub fn client_config(
    authority: Arc<Authority>,
    roots: &[CertificateDer<'static>],
) -> Result<ClientConfig, PkiError> {
    let mut store = RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).map_err(|source| PkiError::Tls {
            what: "the operator's trust in the CA",
            source,
        })?;
    }
    let roots = store;
    let certificate = OperatorCertificate::new(authority, SystemTime::now())?;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| PkiError::Tls {
            what: "the operator's TLS client",
            source,
        })?
        .with_root_certificates(roots)
        .with_client_cert_resolver(Arc::new(certificate));
    // No session tickets: each instance's connection is kept for a minute
    // (instance_client's `KEPT_FOR`), so resuming would save one handshake a minute
    // per instance. rustls' store keeps the tickets of 32 servers, each with the
    // server's certificate chain: with more instances than that it churns, resumes
    // little and holds up to 256 tickets.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

/// The operator's client certificate, renewed when a third of its life is left. It
/// never leaves memory, so renewing it needs no Secret and no restart.
struct OperatorCertificate {
    authority: Arc<Authority>,
    current: Mutex<(Arc<CertifiedKey>, SystemTime)>,
}

impl std::fmt::Debug for OperatorCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorCertificate")
            .finish_non_exhaustive()
    }
}

impl OperatorCertificate {
    fn new(authority: Arc<Authority>, now: SystemTime) -> Result<Self, PkiError> {
        let current = Self::issue(&authority, now)?;
        Ok(Self {
            authority,
            current: Mutex::new(current),
        })
    }

    /// A new certificate, and when to replace it.
    fn issue(
        authority: &Authority,
        now: SystemTime,
    ) -> Result<(Arc<CertifiedKey>, SystemTime), PkiError> {
        let issued = authority.issue_operator(now)?;
        let key = certified(
            issued.cert_der()?,
            issued.key_der()?,
            "the operator's client certificate",
        )?;
        let renew_at = now + super::CLIENT_VALIDITY * 2 / 3;
        Ok((Arc::new(key), renew_at))
    }
}

impl ResolvesClientCert for OperatorCertificate {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        let mut current = match self.current.lock() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        let now = SystemTime::now();
        if now >= current.1 {
            match Self::issue(&self.authority, now) {
                Ok(renewed) => {
                    tracing::info!("renewed the operator's client certificate");
                    *current = renewed;
                }
                // The old one is still valid for a third of its life: keep using it.
                Err(error) => {
                    tracing::warn!(%error, "could not renew the operator's client certificate")
                }
            }
        }
        Some(current.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// An instance manager's server configuration: its certificate and key from files
/// (the mounted Secret), and only the operator as a client, as vouched for by the CA
/// certificates in `ca_file` (several may be listed: a trust bundle during rotation).
/// Both are read again when their files change, so a renewed certificate is served,
/// and a CA added to `ca.crt` trusted, without a restart.
pub fn instance_server_config(
    ca_file: &Path,
    cert_file: &Path,
    key_file: &Path,
) -> Result<ServerConfig, PkiError> {
    let trust = FileTrust::load(ca_file)?;
    let certificate = FileCertificate::load(cert_file, key_file)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| PkiError::Tls {
            what: "the instance API's TLS server",
            source,
        })?
        .with_client_cert_verifier(Arc::new(OperatorOnly(trust)))
        .with_cert_resolver(Arc::new(certificate));
    // No resumption: a resumed session is not verified again, so a client certificate
    // of a CA the instance has stopped trusting would get through on a ticket of
    // before; and the operator resumes none (`client_config`). Nothing is sent or
    // stored for it either.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(config)
}

/// The CA's verdict (chain, validity, EKU clientAuth), and then the client's name: the
/// same CA may one day sign client certificates for other purposes (PostgreSQL users),
/// and none of those may call the instance API.
#[derive(Debug)]
struct OperatorOnly(FileTrust);

impl ClientCertVerifier for OperatorOnly {
    /// None: the hints would have to be borrowed from a verifier that may be replaced
    /// meanwhile, and the operator presents its one certificate whatever they say.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .0
            .current()
            .verify_client_cert(end_entity, intermediates, now)?;
        let names = dns_names(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if names.iter().any(|name| name == OPERATOR_NAME) {
            Ok(verified)
        } else {
            tracing::warn!(
                ?names,
                "refused a client certificate of the CA that does not name the operator"
            );
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.current().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.current().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().supported_verify_schemes()
    }
}

/// The CAs whose client certificates are accepted, kept in a file (the mounted
/// Secret's `ca.crt`) and read again when it changes: a CA rotation first adds the new
/// CA to every `ca.crt` (docs/pki.md), and the instances must trust it before the
/// operator presents a certificate from it, without a restart.
#[derive(Debug)]
struct FileTrust {
    ca_file: PathBuf,
    current: Mutex<(Option<SystemTime>, Arc<dyn ClientCertVerifier>)>,
}

impl FileTrust {
    fn load(ca_file: &Path) -> Result<Self, PkiError> {
        let stamp = modified(ca_file);
        let verifier = Self::read(ca_file)?;
        Ok(Self {
            ca_file: ca_file.to_owned(),
            current: Mutex::new((stamp, verifier)),
        })
    }

    fn read(ca_file: &Path) -> Result<Arc<dyn ClientCertVerifier>, PkiError> {
        let ca_pem = std::fs::read(ca_file).map_err(|source| PkiError::Io {
            path: ca_file.to_owned(),
            source,
        })?;
        let mut roots = RootCertStore::empty();
        for certificate in super::certificates(&ca_pem, &ca_file.display().to_string())? {
            roots.add(certificate).map_err(|source| PkiError::Tls {
                what: "the instance's trust in the CA",
                source,
            })?;
        }
        Ok(WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider()).build()?)
    }

    /// The verifier of the file as it is now; the previous one while the file cannot
    /// be read (a half-written replacement is read again at the next handshake).
    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        let mut current = match self.current.lock() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        let stamp = modified(&self.ca_file);
        if stamp != current.0 {
            match Self::read(&self.ca_file) {
                Ok(verifier) => {
                    tracing::info!(file = %self.ca_file.display(), "trusting the CAs of the changed file");
                    *current = (stamp, verifier);
                }
                Err(error) => tracing::warn!(%error, "keeping the previous trust in the CA"),
            }
        }
        current.1.clone()
    }
}

/// A server certificate kept in files, read again when the certificate file changes:
/// the kubelet replaces a mounted Secret's files when the operator renews it, and the
/// instance manager keeps running.
#[derive(Debug)]
struct FileCertificate {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: Mutex<(Option<SystemTime>, Arc<CertifiedKey>)>,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl FileCertificate {
    fn load(cert_file: &Path, key_file: &Path) -> Result<Self, PkiError> {
        let stamp = modified(cert_file);
        let key = Self::read(cert_file, key_file)?;
        Ok(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: Mutex::new((stamp, Arc::new(key))),
        })
    }

    fn read(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, PkiError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| PkiError::Io {
                path: path.to_owned(),
                source,
            })
        };
        let cert_pem = read(cert_file)?;
        let key_pem = read(key_file)?;
        let cert = super::first_certificate(&cert_pem, &cert_file.display().to_string())?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| PkiError::Pem {
            what: key_file.display().to_string(),
            reason: e.to_string(),
        })?;
        certified(cert, key, "the instance API's server certificate")
    }
}

impl ResolvesServerCert for FileCertificate {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut current = match self.current.lock() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        let stamp = modified(&self.cert_file);
        if stamp != current.0 {
            // Between the two reads the other file may still be the old one; then the
            // pair does not match, and the next handshake tries again.
            match Self::read(&self.cert_file, &self.key_file) {
                Ok(key) => {
                    tracing::info!(file = %self.cert_file.display(), "serving the renewed certificate");
                    *current = (stamp, Arc::new(key));
                }
                Err(error) => {
                    tracing::warn!(%error, "keeping the previous server certificate")
                }
            }
        }
        Some(current.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{Trust, server_name};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    #[test]
    fn a_brought_server_certificate_must_verify_for_the_rw_name_with_its_ca() {
        let now = SystemTime::now();
        let ca = Authority::generate(now).expect("a CA");
        let other = Authority::generate(now).expect("another CA");
        let issued = ca
            .issue_postgres_server("vault", "shop", now)
            .expect("issued");
        let name = crate::pki::postgres_server_name("vault", "shop");
        let check = |cert: &str, key: &str, ca_pem: &str, name: &str, at: SystemTime| {
            check_server_certificate(cert.as_bytes(), key.as_bytes(), ca_pem.as_bytes(), name, at)
        };
        let ends = check(&issued.cert_pem, &issued.key_pem, ca.cert_pem(), &name, now)
            .expect("its own certificate, key and CA");
        assert!(ends > now + Duration::from_secs(300 * 24 * 3600));
        let other_key = other
            .issue_postgres_server("vault", "shop", now)
            .expect("issued");
        let mismatch = check(
            &issued.cert_pem,
            &other_key.key_pem,
            ca.cert_pem(),
            &name,
            now,
        )
        .expect_err("another key");
        assert!(mismatch.contains("does not belong"), "{mismatch}");
        let foreign = check(
            &issued.cert_pem,
            &issued.key_pem,
            other.cert_pem(),
            &name,
            now,
        )
        .expect_err("another CA");
        assert!(foreign.contains("could not verify"), "{foreign}");
        let wrong_name = check(
            &issued.cert_pem,
            &issued.key_pem,
            ca.cert_pem(),
            "vault-rw.other.svc",
            now,
        )
        .expect_err("another name");
        assert!(wrong_name.contains("could not verify"), "{wrong_name}");
        let later = now + Duration::from_secs(2 * 365 * 24 * 3600);
        let expired = check(
            &issued.cert_pem,
            &issued.key_pem,
            ca.cert_pem(),
            &name,
            later,
        )
        .expect_err("expired");
        assert!(expired.contains("could not verify"), "{expired}");
        let missing_ca =
            check(&issued.cert_pem, &issued.key_pem, "", &name, now).expect_err("no ca.crt");
        assert!(missing_ca.contains("ca.crt"), "{missing_ca}");
    }

    struct Files(PathBuf);

    impl Files {
        fn write(name: &str, ca: &Authority, server: &crate::pki::Issued) -> Self {
            let dir = std::env::temp_dir().join(format!("pki-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("directory");
            std::fs::write(dir.join("ca.crt"), ca.cert_pem()).expect("ca");
            std::fs::write(dir.join("tls.crt"), &server.cert_pem).expect("cert");
            std::fs::write(dir.join("tls.key"), &server.key_pem).expect("key");
            Self(dir)
        }

        fn server_config(&self) -> ServerConfig {
            instance_server_config(
                &self.0.join("ca.crt"),
                &self.0.join("tls.crt"),
                &self.0.join("tls.key"),
            )
            .expect("server config")
        }
    }

    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A client configuration presenting `client` (any certificate), trusting `ca`.
    fn client_with(ca: &Authority, client: Option<&crate::pki::Issued>) -> ClientConfig {
        let mut roots = RootCertStore::empty();
        roots.add(ca.cert_der().clone()).expect("root");
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_root_certificates(roots);
        match client {
            Some(client) => builder
                .with_client_auth_cert(
                    vec![client.cert_der().expect("der")],
                    client.key_der().expect("key"),
                )
                .expect("client cert"),
            None => builder.with_no_client_auth(),
        }
    }

    /// One exchange over an in-memory pipe: the server's certificate as the client saw
    /// it, if the server accepted the client and echoed a byte back.
    async fn exchange(
        server: Arc<ServerConfig>,
        client: ClientConfig,
        name: &str,
    ) -> Option<CertificateDer<'static>> {
        exchange_seen(server, client, name)
            .await
            .map(|(seen, _)| seen)
    }

    /// [`exchange`], and whether the server saw a full or a resumed handshake.
    async fn exchange_seen(
        server: Arc<ServerConfig>,
        client: ClientConfig,
        name: &str,
    ) -> Option<(CertificateDer<'static>, rustls::HandshakeKind)> {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let acceptor = TlsAcceptor::from(server);
        let server = tokio::spawn(async move {
            let mut stream = acceptor.accept(far).await.ok()?;
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.ok()?;
            stream.write_all(&byte).await.ok()?;
            stream.flush().await.ok()?;
            stream.get_ref().1.handshake_kind()
        });
        let name = rustls::pki_types::ServerName::try_from(name.to_owned()).expect("name");
        let client = async move {
            let mut stream = TlsConnector::from(Arc::new(client))
                .connect(name, near)
                .await
                .ok()?;
            stream.write_all(b"x").await.ok()?;
            stream.flush().await.ok()?;
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.ok()?;
            let seen = stream.get_ref().1.peer_certificates()?.first()?.clone();
            (byte == *b"x").then_some(seen)
        };
        let seen = client.await;
        let kind = server.await.ok().flatten()?;
        Some((seen?, kind))
    }

    /// An instance's side of the tests: a CA, the server certificate it issued for
    /// instance `orders` of cluster `shop`, written as the instance reads them (under
    /// `tag`), and the name the operator verifies.
    fn an_instance(tag: &str) -> (Arc<Authority>, crate::pki::Issued, Files, String) {
        let now = SystemTime::now();
        let ca = Arc::new(Authority::generate(now).expect("ca"));
        let server = ca.issue_server("orders", "shop", now).expect("server");
        let files = Files::write(tag, &ca, &server);
        (ca, server, files, server_name("orders", "shop"))
    }

    /// The kinds of two handshakes, one after the other, of `client` with `server`.
    async fn two_handshakes(
        server: Arc<ServerConfig>,
        client: &ClientConfig,
        name: &str,
    ) -> Vec<rustls::HandshakeKind> {
        let mut kinds = Vec::new();
        for _ in 0..2 {
            let (_, kind) = exchange_seen(server.clone(), client.clone(), name)
                .await
                .expect("an exchange");
            kinds.push(kind);
        }
        kinds
    }

    #[tokio::test]
    async fn no_session_is_resumed_on_either_side() {
        use rustls::HandshakeKind::{Full, Resumed};
        let (ca, _, files, name) = an_instance("full");
        let instance = Arc::new(files.server_config());
        let operator = operator_client_config(&Trust::single(ca.clone())).expect("operator config");

        // rustls' defaults on both sides: the second handshake resumes the first.
        let mut resuming_server = (*instance).clone();
        resuming_server.send_tls13_tickets = 2;
        resuming_server.session_storage = rustls::server::ServerSessionMemoryCache::new(256);
        let resuming_server = Arc::new(resuming_server);
        let mut resuming_client = operator.clone();
        resuming_client.resumption = rustls::client::Resumption::default();
        assert_eq!(
            two_handshakes(resuming_server.clone(), &resuming_client, &name).await,
            [Full, Resumed]
        );

        // The operator's client asks for none, and the instance's server gives none.
        assert_eq!(
            two_handshakes(resuming_server, &operator, &name).await,
            [Full, Full]
        );
        assert_eq!(
            two_handshakes(instance, &resuming_client, &name).await,
            [Full, Full]
        );
    }

    #[tokio::test]
    async fn only_the_operator_gets_through() {
        let now = SystemTime::now();
        let (ca, server, files, name) = an_instance("through");

        let operator = operator_client_config(&Trust::single(ca.clone())).expect("operator config");
        let config = Arc::new(files.server_config());
        assert!(
            exchange(config.clone(), operator.clone(), &name)
                .await
                .is_some(),
            "the operator's certificate is accepted"
        );
        assert!(
            exchange(config.clone(), client_with(&ca, None), &name)
                .await
                .is_none(),
            "no client certificate: refused"
        );
        assert!(
            exchange(config.clone(), client_with(&ca, Some(&server)), &name)
                .await
                .is_none(),
            "a server certificate of the same CA is refused as a client certificate"
        );
        let other = Authority::generate(now).expect("another CA");
        let foreign = other.issue_operator(now).expect("foreign operator");
        assert!(
            exchange(config.clone(), client_with(&ca, Some(&foreign)), &name)
                .await
                .is_none(),
            "an operator certificate of another CA is refused"
        );
        // A clientAuth certificate of the same CA for someone else: refused too.
        let stranger = ca
            .issue(
                "a stranger".to_owned(),
                "stranger",
                &["stranger.castellan.io".to_owned()],
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
                now,
                crate::pki::CLIENT_VALIDITY,
            )
            .expect("a stranger's certificate");
        assert!(
            exchange(config.clone(), client_with(&ca, Some(&stranger)), &name)
                .await
                .is_none(),
            "a client certificate of the CA that does not name the operator is refused"
        );
        // Nor can the replicas' certificate, which every pod of a cluster holds.
        let replication = ca
            .issue_replication("orders", "shop", now)
            .expect("the replication certificate");
        assert!(
            exchange(config.clone(), client_with(&ca, Some(&replication)), &name)
                .await
                .is_none(),
            "the replication client certificate cannot call the instance API"
        );
        assert!(
            exchange(config, operator, &server_name("orders", "elsewhere"))
                .await
                .is_none(),
            "the operator refuses an instance that is not of the cluster it dials"
        );
    }

    #[tokio::test]
    async fn a_ca_added_to_the_trust_file_is_trusted_without_a_restart() {
        let now = SystemTime::now();
        let old = Arc::new(Authority::generate(now).expect("ca"));
        let new = Arc::new(Authority::generate(now).expect("the next ca"));
        let server = old.issue_server("orders", "shop", now).expect("server");
        let files = Files::write("trust", &old, &server);
        let config = Arc::new(files.server_config());
        let name = server_name("orders", "shop");
        // The operator of the new CA, still trusting the old one for the server.
        let next_operator = || {
            let certificate = new.issue_operator(now).expect("an operator certificate");
            client_with(&old, Some(&certificate))
        };
        assert!(
            exchange(config.clone(), next_operator(), &name)
                .await
                .is_none(),
            "a CA not in ca.crt is not trusted"
        );
        // The bundle, as the first step of a rotation writes it.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(
            files.0.join("ca.crt"),
            format!("{}{}", old.cert_pem(), new.cert_pem()),
        )
        .expect("bundle");
        assert!(
            exchange(config.clone(), next_operator(), &name)
                .await
                .is_some(),
            "the new CA is trusted once ca.crt lists it"
        );
        let operator =
            operator_client_config(&Trust::single(old.clone())).expect("operator config");
        assert!(
            exchange(config.clone(), operator, &name).await.is_some(),
            "and the old one still is"
        );
        // A file that cannot be read keeps the trust it had.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(files.0.join("ca.crt"), "half written").expect("broken");
        assert!(
            exchange(config, next_operator(), &name).await.is_some(),
            "an unreadable ca.crt keeps the previous trust"
        );
    }

    #[tokio::test]
    async fn a_renewed_certificate_is_served_without_a_restart() {
        let now = SystemTime::now();
        let (ca, server, files, name) = an_instance("renewed");
        let config = Arc::new(files.server_config());
        // A new client each time: with one, a resumed session would show the first
        // certificate wherever resumption were turned on again.
        let operator =
            || operator_client_config(&Trust::single(ca.clone())).expect("operator config");
        let first = exchange(config.clone(), operator(), &name).await;
        assert_eq!(first, Some(server.cert_der().expect("der")));
        // Replaced as the kubelet does it: new files with a new modification time.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let renewed = ca.issue_server("orders", "shop", now).expect("renewed");
        std::fs::write(files.0.join("tls.key"), &renewed.key_pem).expect("key");
        std::fs::write(files.0.join("tls.crt"), &renewed.cert_pem).expect("cert");
        let second = exchange(config, operator(), &name).await;
        assert_eq!(second, Some(renewed.cert_der().expect("der")));
    }
}
