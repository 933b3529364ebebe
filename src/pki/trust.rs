//! The CAs an installation trusts, and the one it issues with. Outside a rotation that
//! is one CA. During one, the bundle holds two: first the coming CA beside the issuing
//! one (trusted everywhere before it signs anything), then the retiring CA beside the
//! new issuing one (trusted until nothing it signed is served any more).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine;
use rustls::pki_types::CertificateDer;

use super::{Authority, PkiError, fingerprint};

/// What the operator issues with and what it has every party trust.
#[derive(Clone, Debug)]
pub struct Trust {
    /// Signs every certificate Castellan issues.
    pub authority: Arc<Authority>,
    /// The CA a rotation brings in: trusted, not issuing yet.
    pub next: Option<Arc<Authority>>,
    /// Every trusted CA's certificate, the issuing one first.
    bundle: Vec<CertificateDer<'static>>,
}

impl Trust {
    /// One CA, trusted and issuing.
    pub fn single(authority: Arc<Authority>) -> Self {
        let bundle = vec![authority.cert_der().clone()];
        Self {
            authority,
            next: None,
            bundle,
        }
    }

    /// The issuing CA, a coming one, and the bundle as kept (`ca.crt` of the CA
    /// Secret; empty when there is none). The issuing and coming CAs are always in
    /// the bundle, whatever the kept one lacks.
    pub fn new(
        authority: Arc<Authority>,
        next: Option<Arc<Authority>>,
        kept_bundle: &[u8],
    ) -> Result<Self, PkiError> {
        let kept = if kept_bundle.iter().all(u8::is_ascii_whitespace) {
            Vec::new()
        } else {
            super::certificates(kept_bundle, "the CA bundle (ca.crt)")?
        };
        let mut bundle = vec![authority.cert_der().clone()];
        for der in next.iter().map(|n| n.cert_der().clone()).chain(kept) {
            if !bundle.contains(&der) {
                bundle.push(der);
            }
        }
        Ok(Self {
            authority,
            next,
            bundle,
        })
    }

    /// The trusted CAs' certificates, the issuing one first.
    pub fn bundle(&self) -> &[CertificateDer<'static>] {
        &self.bundle
    }

    /// The bundle in PEM, as a Secret's `ca.crt` carries it.
    pub fn bundle_pem(&self) -> String {
        self.bundle.iter().map(|der| pem(der)).collect()
    }

    /// The fingerprints of the trusted CAs.
    pub fn fingerprints(&self) -> BTreeSet<String> {
        self.bundle.iter().map(|der| fingerprint(der)).collect()
    }

    /// Whether `other` issues with the same CA and trusts the same ones.
    pub fn same(&self, other: &Self) -> bool {
        self.authority.fingerprint() == other.authority.fingerprint()
            && self.next.as_ref().map(|n| n.fingerprint())
                == other.next.as_ref().map(|n| n.fingerprint())
            && self.fingerprints() == other.fingerprints()
    }

    /// Whether `pem` lists exactly the trusted CAs (in any order).
    pub fn is_bundle(&self, pem: &[u8]) -> bool {
        let listed: BTreeSet<String> = super::fingerprints(pem).into_iter().collect();
        listed == self.fingerprints()
    }

    /// Whether the bundle still holds a CA that is neither issuing nor coming: the
    /// retiring one of a rotation under way.
    pub fn retiring(&self) -> bool {
        let current: Vec<&CertificateDer<'_>> = std::iter::once(self.authority.cert_der())
            .chain(self.next.iter().map(|n| n.cert_der()))
            .collect();
        self.bundle.iter().any(|der| !current.contains(&der))
    }

    /// After the switch: `next` issues, and the CA that issued until now is trusted
    /// until it retires.
    pub fn switched(&self) -> Option<Self> {
        let next = self.next.clone()?;
        let mut bundle = vec![next.cert_der().clone()];
        bundle.extend(
            self.bundle
                .iter()
                .filter(|der| *der != next.cert_der())
                .cloned(),
        );
        Some(Self {
            authority: next,
            next: None,
            bundle,
        })
    }

    /// Once nothing the retiring CA signed is served: the issuing CA alone.
    pub fn retired(&self) -> Self {
        Self::single(self.authority.clone())
    }

    /// The issuing CA has a third of its life left: a rotation is due.
    pub fn expiring(&self, now: SystemTime) -> bool {
        self.authority.expiring(now)
    }
}

/// A certificate in PEM.
pub fn pem(der: &CertificateDer<'_>) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut text = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in encoded.as_bytes().chunks(64) {
        text.push_str(&String::from_utf8_lossy(line));
        text.push('\n');
    }
    text.push_str("-----END CERTIFICATE-----\n");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> Arc<Authority> {
        Arc::new(Authority::generate(SystemTime::now()).expect("a CA"))
    }

    #[test]
    fn a_rotation_trusts_the_coming_ca_then_the_retiring_one_then_only_the_new() {
        let old = ca();
        let new = ca();
        let steady = Trust::new(old.clone(), None, b"").expect("one CA");
        assert_eq!(steady.bundle().len(), 1);
        assert!(!steady.retiring());
        assert!(steady.is_bundle(old.cert_pem().as_bytes()));

        let trusting =
            Trust::new(old.clone(), Some(new.clone()), old.cert_pem().as_bytes()).expect("two");
        assert_eq!(trusting.bundle().len(), 2);
        assert!(!trusting.retiring(), "the old CA still issues");
        let both = trusting.bundle_pem();
        assert!(trusting.is_bundle(both.as_bytes()));
        assert!(!trusting.is_bundle(old.cert_pem().as_bytes()));
        // PEM written by us reads back as the same certificates.
        assert_eq!(
            crate::pki::fingerprints(both.as_bytes()),
            vec![old.fingerprint(), new.fingerprint()]
        );

        assert!(!trusting.same(&steady));
        let retiring = trusting.switched().expect("a coming CA to switch to");
        assert_eq!(retiring.authority.fingerprint(), new.fingerprint());
        assert!(retiring.next.is_none());
        assert!(retiring.retiring());
        assert!(retiring.is_bundle(both.as_bytes()));
        // As a new leader reads it back from the Secret.
        let reread = Trust::new(new.clone(), None, both.as_bytes()).expect("read back");
        assert!(reread.retiring());
        assert!(reread.same(&retiring));

        let done = retiring.retired();
        assert!(!done.retiring());
        assert!(done.is_bundle(new.cert_pem().as_bytes()));
        assert!(steady.switched().is_none(), "nothing to switch to");
    }

    #[test]
    fn a_kept_bundle_that_cannot_be_read_is_an_error_not_an_empty_trust() {
        let error = Trust::new(ca(), None, b"not pem").expect_err("unreadable");
        assert!(error.to_string().contains("ca.crt"), "{error}");
    }
}
