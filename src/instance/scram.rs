//! SCRAM-SHA-256 password verifiers (RFC 5802, RFC 7677), computed here so that a
//! password reaches PostgreSQL only as the verifier it stores
//! (`SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`), never as plain text in
//! a statement a log could keep.
//!
//! PostgreSQL normalises a password with SASLprep before hashing it, and uses the raw
//! bytes when SASLprep refuses it; for ASCII (what Castellan generates) SASLprep
//! changes nothing. A password with other characters is refused here rather than hashed
//! in a way a client might not reproduce.

use std::num::NonZeroU32;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ring::{digest, hmac, pbkdf2, rand};

/// PostgreSQL's default (`scram_iterations`).
pub const ITERATIONS: u32 = 4096;

/// The verifier of `password` with a fresh random 16-byte salt.
pub fn verifier(password: &str) -> Result<String, String> {
    let mut salt = [0u8; 16];
    rand::SecureRandom::fill(&rand::SystemRandom::new(), &mut salt)
        .map_err(|_| "no random bytes for a SCRAM salt".to_owned())?;
    verifier_with(password, &salt, ITERATIONS)
}

/// The verifier of `password` with `salt` and `iterations`.
pub fn verifier_with(password: &str, salt: &[u8], iterations: u32) -> Result<String, String> {
    if !password.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err("the password has characters other than printable ASCII, which SASLprep may change; use printable ASCII".to_owned());
    }
    let rounds = NonZeroU32::new(iterations).ok_or("SCRAM needs at least one iteration")?;
    let mut salted = [0u8; 32];
    pbkdf2::derive(
        pbkdf2::PBKDF2_HMAC_SHA256,
        rounds,
        salt,
        password.as_bytes(),
        &mut salted,
    );
    let key = hmac::Key::new(hmac::HMAC_SHA256, &salted);
    let client_key = hmac::sign(&key, b"Client Key");
    let stored_key = digest::digest(&digest::SHA256, client_key.as_ref());
    let server_key = hmac::sign(&key, b"Server Key");
    Ok(format!(
        "SCRAM-SHA-256${iterations}:{}${}:{}",
        STANDARD.encode(salt),
        STANDARD.encode(stored_key.as_ref()),
        STANDARD.encode(server_key.as_ref())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What PostgreSQL 15 stored for `create role x password 'correct horse battery
    /// staple'`: the same salt gives the same verifier.
    #[test]
    fn verifiers_match_postgresql() {
        let stored = "SCRAM-SHA-256$4096:Yzc/ot1doCmFZf1ISyH1MQ==$cKeFoFL0rm39P04C4BePfziquxifS7nhQw0V//vflL8=:UUFUKNNVsCo8Ocug56lTY+hxBFWQm9EW2no5mzzHjlo=";
        let salt = STANDARD
            .decode("Yzc/ot1doCmFZf1ISyH1MQ==")
            .expect("test value");
        assert_eq!(
            verifier_with("correct horse battery staple", &salt, 4096).expect("a verifier"),
            stored
        );
    }

    #[test]
    fn salts_are_fresh_and_other_characters_refused() {
        let a = verifier("s3cret").expect("a verifier");
        let b = verifier("s3cret").expect("a verifier");
        assert_ne!(a, b, "a new salt each time");
        assert!(a.starts_with("SCRAM-SHA-256$4096:"));
        assert!(!a.contains("s3cret"));
        assert!(verifier("pässword").is_err());
    }
}
