//! PostgreSQL's TLS on one instance: where its certificate files are, copying them
//! from the Secrets the pod mounts, and whether this build of PostgreSQL can serve TLS.
//!
//! The mounted files are copied into a directory only the instance's user may enter:
//! PostgreSQL refuses a server key that others can read and libpq a client key, and a
//! mounted Secret's files have the kubelet's modes and owner, not ours. The copies are
//! compared with the mounts every second (`install`), so a certificate the operator
//! renewed reaches PostgreSQL without a restart: the server reads its files again at
//! a reload, a replica's WAL receiver at its next connection. Deciding the
//! configuration from these paths is `config`'s job.

use std::path::{Path, PathBuf};

use super::bootstrap::{self, Binaries, BootstrapError, io};

/// The certificate Secrets as the pod mounts them (`ca.crt`, `tls.crt`, `tls.key`
/// each).
#[derive(Clone, Debug)]
pub struct Mounted {
    /// `<cluster>-server-tls`: PostgreSQL's server certificate, and the CA that
    /// signed it (what a replica verifies its primary with).
    pub server: PathBuf,
    /// `<cluster>-replication-tls`: the replicas' client certificate, and the CA that
    /// signed it (what the server accepts client certificates from).
    pub replication: PathBuf,
}

/// The private copies PostgreSQL and libpq read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Files {
    dir: PathBuf,
}

impl Files {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// `ssl_cert_file`.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    /// `ssl_key_file`.
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// `ssl_ca_file`: client certificates are accepted from this CA only.
    pub fn client_ca(&self) -> PathBuf {
        self.dir.join("client-ca.crt")
    }

    /// libpq's `sslrootcert` towards the primary.
    pub fn server_ca(&self) -> PathBuf {
        self.dir.join("server-ca.crt")
    }

    /// libpq's `sslcert`.
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.crt")
    }

    /// libpq's `sslkey`.
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// Each copy and the mounted file it comes from.
    fn sources(&self, mounted: &Mounted) -> [(PathBuf, PathBuf); 6] {
        [
            (mounted.server.join("tls.crt"), self.server_cert()),
            (mounted.server.join("tls.key"), self.server_key()),
            (mounted.server.join("ca.crt"), self.server_ca()),
            (mounted.replication.join("tls.crt"), self.client_cert()),
            (mounted.replication.join("tls.key"), self.client_key()),
            (mounted.replication.join("ca.crt"), self.client_ca()),
        ]
    }
}

/// The certificates an instance was given, and whether its build can serve them.
#[derive(Clone, Debug)]
pub struct Certificates {
    pub mounted: Mounted,
    pub files: Files,
    /// Whether the build can serve TLS (`supported`, asked once at start).
    pub supported: bool,
}

/// Copies every mounted file whose content differs from its copy (each copy written
/// atomically, mode 0600); returns whether any changed.
pub async fn install(mounted: &Mounted, files: &Files) -> Result<bool, BootstrapError> {
    tokio::fs::create_dir_all(&files.dir)
        .await
        .map_err(io("creating", &files.dir))?;
    let mut changed = false;
    for (source, copy) in files.sources(mounted) {
        let wanted = tokio::fs::read_to_string(&source)
            .await
            .map_err(io("reading the mounted certificate file", &source))?;
        let current = tokio::fs::read_to_string(&copy).await.ok();
        if current.as_deref() != Some(wanted.as_str()) {
            bootstrap::write_private(&copy, &wanted).await?;
            changed = true;
        }
    }
    Ok(changed)
}

/// The certificates the copies hold, by fingerprint: what PostgreSQL runs with once
/// it started or reloaded after they were written.
pub async fn loaded(files: &Files) -> crate::instance_api::LoadedCertificates {
    let read = |path: PathBuf| async move {
        crate::pki::fingerprints(&tokio::fs::read(path).await.unwrap_or_default())
    };
    crate::instance_api::LoadedCertificates {
        client_cas: read(files.client_ca()).await,
        server_cas: read(files.server_ca()).await,
        served: read(files.server_cert()).await.into_iter().next(),
        client: read(files.client_cert()).await.into_iter().next(),
    }
}

/// How this instance's PostgreSQL talks over TCP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TLS with Castellan's certificates: the server serves it, replicas stream with
    /// their client certificate and verify their primary.
    Tls(Files),
    /// No TLS: the pod mounts no certificates (a scratch instance that nothing reaches
    /// over TCP), or the build cannot serve TLS and the cluster allows plain text.
    Plain,
}

/// What an instance does about TLS, from what it was given and what its build can do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Run(Transport),
    /// The server must not run: it would serve plain text the cluster does not allow,
    /// or nothing at all. The reason is for the status report.
    Refuse(String),
}

/// Decides the transport from the certificates an instance was given (none: a scratch
/// instance) and whether plain text is allowed.
pub fn decide(certificates: Option<&Certificates>, allow_plaintext: bool) -> Decision {
    match certificates {
        None => Decision::Run(Transport::Plain),
        Some(given) if given.supported => Decision::Run(Transport::Tls(given.files.clone())),
        Some(_) if allow_plaintext => Decision::Run(Transport::Plain),
        Some(_) => Decision::Refuse(
            "this instance's PostgreSQL was built without TLS support (its ssl_library is \
             empty), so it cannot serve the cluster's certificates, and spec.tls.allowPlaintext \
             is false: the server is not started rather than serve plain text. Use an image \
             whose PostgreSQL is built with OpenSSL, or allow plain text"
                .to_owned(),
        ),
    }
}

/// Whether these binaries can serve TLS: `postgres -C ssl_library` names the library
/// (`OpenSSL`) or is empty in a build without one. PostgreSQL reads a data directory
/// for `-C`, so an empty configuration is written in `scratch`, a directory only the
/// instance's user may enter (PostgreSQL refuses another); the value is the first line
/// of the output.
pub async fn supported(binaries: &Binaries, scratch: &Path) -> Result<bool, BootstrapError> {
    // Both files, so that PostgreSQL has nothing to log about a missing one.
    for name in ["postgresql.conf", "postgresql.auto.conf"] {
        bootstrap::write_private(&scratch.join(name), "").await?;
    }
    let output = binaries
        .run(
            "postgres",
            &["-C", "ssl_library", "-D", &scratch.to_string_lossy()],
            &[],
        )
        .await?;
    Ok(output
        .lines()
        .next()
        .is_some_and(|library| !library.trim().is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> Files {
        Files::new(PathBuf::from("/data/run/tls"))
    }

    fn given(supported: bool) -> Certificates {
        Certificates {
            mounted: Mounted {
                server: PathBuf::from("/etc/castellan/secrets/server-tls"),
                replication: PathBuf::from("/etc/castellan/secrets/replication-tls"),
            },
            files: files(),
            supported,
        }
    }

    #[test]
    fn a_build_with_tls_serves_the_certificates() {
        assert_eq!(
            decide(Some(&given(true)), false),
            Decision::Run(Transport::Tls(files()))
        );
        assert_eq!(
            decide(Some(&given(true)), true),
            Decision::Run(Transport::Tls(files())),
            "allowing plain text does not turn TLS off"
        );
    }

    #[test]
    fn a_build_without_tls_runs_only_where_plain_text_is_allowed() {
        assert_eq!(
            decide(Some(&given(false)), true),
            Decision::Run(Transport::Plain)
        );
        match decide(Some(&given(false)), false) {
            Decision::Refuse(reason) => {
                assert!(reason.contains("built without TLS"), "{reason}");
                assert!(reason.contains("allowPlaintext"), "{reason}");
            }
            other => panic!("a build without TLS must not serve plain text: {other:?}"),
        }
    }

    #[test]
    fn an_instance_without_certificates_runs_without_tls() {
        assert_eq!(decide(None, false), Decision::Run(Transport::Plain));
    }

    #[tokio::test]
    async fn mounted_files_are_copied_privately_and_only_when_they_change() {
        use std::os::unix::fs::PermissionsExt;
        let root = std::env::temp_dir().join(format!("castellan-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mounted = Mounted {
            server: root.join("server-tls"),
            replication: root.join("replication-tls"),
        };
        for dir in [&mounted.server, &mounted.replication] {
            std::fs::create_dir_all(dir).expect("mount dir");
            for name in ["ca.crt", "tls.crt", "tls.key"] {
                std::fs::write(dir.join(name), format!("{} {name}", dir.display()))
                    .expect("mounted file");
            }
        }
        let files = Files::new(root.join("copies"));
        assert!(install(&mounted, &files).await.expect("installs"));
        let key = std::fs::metadata(files.server_key()).expect("copied key");
        assert_eq!(key.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_to_string(files.client_ca()).expect("client CA"),
            format!("{} ca.crt", mounted.replication.display()),
            "client certificates are checked against the replication Secret's CA"
        );
        assert!(
            !install(&mounted, &files).await.expect("installs"),
            "nothing changed"
        );
        std::fs::write(mounted.server.join("tls.crt"), "renewed").expect("renewed");
        assert!(install(&mounted, &files).await.expect("installs"));
        assert_eq!(
            std::fs::read_to_string(files.server_cert()).expect("server cert"),
            "renewed"
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
