//! The PostgreSQL release the instance's binaries carry, against the major version the
//! cluster asks for (`spec.version`). A pod must never run another major than the one
//! asked for: an image of the wrong major would initialise, copy or start data of that
//! major silently (a cluster created with `version: "17"` ran PostgreSQL 15). So the
//! manager asks its `postgres` once at start and, on a mismatch, touches no data and
//! starts nothing, and says why; the operator reports what the instances really run in
//! `status.version`.

use super::bootstrap::{Binaries, BootstrapError};

/// The release `postgres --version` names, such as `15.18` or `18.1` (`None` when the
/// output names none).
pub fn release_of(output: &str) -> Option<String> {
    // "postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)"
    let after = output.split("(PostgreSQL)").nth(1)?;
    let release = after.split_whitespace().next()?;
    release
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit())
        .then(|| release.to_owned())
}

/// The major version of a release: its first number (PostgreSQL 10 and later).
pub fn major_of(release: &str) -> &str {
    release
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or(release)
}

/// Why these binaries must not run for a cluster that asks for `asked`, if they must
/// not.
pub fn refusal(asked: Option<&str>, release: &str) -> Option<String> {
    let asked = asked?;
    let carried = major_of(release);
    (carried != asked).then(|| {
        format!(
            "this instance's image carries PostgreSQL {release}, but the cluster asks for version {asked}: \
             nothing is initialised, copied or started with another major version; \
             give the operator an image with PostgreSQL {asked}"
        )
    })
}

/// The release of the binaries, asked once at start (`postgres --version`).
pub async fn release(binaries: &Binaries) -> Result<String, BootstrapError> {
    let output = binaries.run("postgres", &["--version"], &[]).await?;
    Ok(release_of(&output).unwrap_or_else(|| output.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_is_read_from_postgres_version() {
        assert_eq!(
            release_of("postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)\n").as_deref(),
            Some("15.18")
        );
        assert_eq!(
            release_of("postgres (PostgreSQL) 18.1\n").as_deref(),
            Some("18.1")
        );
        assert_eq!(release_of("postgres (PostgreSQL) devel"), None);
        assert_eq!(release_of("something else"), None);
        assert_eq!(major_of("15.18"), "15");
        assert_eq!(major_of("18beta1"), "18");
    }

    #[test]
    fn only_the_major_asked_for_may_run() {
        assert_eq!(refusal(Some("15"), "15.18"), None);
        assert_eq!(
            refusal(None, "15.18"),
            None,
            "nothing asked: nothing to refuse"
        );
        let refused = refusal(Some("17"), "15.18").unwrap_or_default();
        assert!(
            refused.contains("carries PostgreSQL 15.18") && refused.contains("version 17"),
            "{refused}"
        );
        assert!(refusal(Some("18"), "18.1").is_none());
        assert!(refusal(Some("1"), "15.18").is_some(), "15 is not 1");
    }
}
