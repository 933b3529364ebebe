//! The CA rotation's decisions, pure: which step the CA Secret is at, whether a
//! rotation is due, and whether every instance showed what the next step needs.
//!
//! A rotation has two steps between three states of the CA Secret:
//!
//! - **Steady**: one CA issues and is trusted. A rotation begins when the user asks
//!   (the annotation [`ROTATE_ANNOTATION`] differs from [`ROTATED_ANNOTATION`]) or the
//!   CA has a third of its life left: a new CA is made and stored beside the old one
//!   (`next.crt`), and the bundle (`ca.crt`) holds both.
//! - **Trusting**: every cluster's Secrets list both CAs; nothing is issued by the new
//!   one yet. Once every instance shows it trusts the new CA (its instance API accepts
//!   a client certificate of the new CA, and its PostgreSQL loaded both as issuers of
//!   client and server certificates), the new CA becomes the issuing one.
//! - **Retiring**: the new CA issues, the old one is still trusted. Every cluster's
//!   certificates are issued again; once every instance serves them (its instance API
//!   verifies with the new CA alone, its PostgreSQL loaded the new server and client
//!   certificates), the old CA leaves the bundle and the rotation is done.
//!
//! An instance that cannot show it (a pod without an address, an unreachable manager)
//! holds the rotation where it is: the step waits, and says for whom and why.

use crate::pki::Trust;

/// Set by the user on the CA Secret to ask for a rotation; any new value asks again.
pub const ROTATE_ANNOTATION: &str = "castellan.io/rotate-ca";
/// The value of [`ROTATE_ANNOTATION`] the last finished rotation carried out.
pub const ROTATED_ANNOTATION: &str = "castellan.io/ca-rotated";
/// Where a rotation stands, for people: the step and what it waits for.
pub const PROGRESS_ANNOTATION: &str = "castellan.io/ca-rotation";

/// Where the CA Secret is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Steady,
    Trusting,
    Retiring,
}

impl Phase {
    pub fn of(trust: &Trust) -> Self {
        if trust.next.is_some() {
            Self::Trusting
        } else if trust.retiring() {
            Self::Retiring
        } else {
            Self::Steady
        }
    }
}

/// What one instance showed for the step under way: nothing missing, or what is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proof {
    /// `namespace/pod`.
    pub instance: String,
    pub missing: Option<String>,
}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing is due.
    Nothing,
    /// Make the new CA and have it trusted; why the rotation starts.
    Begin(String),
    /// Stay at this step; for whom and why.
    Wait(String),
    /// Every instance trusts the new CA: it becomes the issuing one.
    Switch,
    /// Every instance serves certificates of the new CA: the old one leaves the bundle.
    Finish,
}

/// The step for `phase`, given the user's request, the last one carried out, whether
/// the issuing CA has a third of its life left, and what the instances showed.
pub fn decide(
    phase: Phase,
    requested: Option<&str>,
    rotated: Option<&str>,
    expiring: bool,
    proofs: &[Proof],
) -> Step {
    if phase == Phase::Steady {
        return match requested {
            Some(request) if Some(request) != rotated => {
                Step::Begin(format!("asked for ({ROTATE_ANNOTATION}={request})"))
            }
            _ if expiring => Step::Begin("the CA has a third of its life left".to_owned()),
            _ => Step::Nothing,
        };
    }
    let missing: Vec<String> = proofs
        .iter()
        .filter_map(|proof| {
            proof
                .missing
                .as_ref()
                .map(|why| format!("{}: {why}", proof.instance))
        })
        .collect();
    if !missing.is_empty() {
        return Step::Wait(missing.join("; "));
    }
    match phase {
        Phase::Trusting => Step::Switch,
        Phase::Retiring | Phase::Steady => Step::Finish,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::SystemTime;

    use super::*;
    use crate::pki::Authority;

    fn shown(instance: &str) -> Proof {
        Proof {
            instance: instance.to_owned(),
            missing: None,
        }
    }

    fn lacking(instance: &str, why: &str) -> Proof {
        Proof {
            instance: instance.to_owned(),
            missing: Some(why.to_owned()),
        }
    }

    #[test]
    fn the_phase_is_read_from_the_cas_the_secret_holds() {
        let old = Arc::new(Authority::generate(SystemTime::now()).expect("a CA"));
        let new = Arc::new(Authority::generate(SystemTime::now()).expect("a CA"));
        let steady = Trust::single(old.clone());
        assert_eq!(Phase::of(&steady), Phase::Steady);
        let trusting = Trust::new(old, Some(new), b"").expect("two");
        assert_eq!(Phase::of(&trusting), Phase::Trusting);
        let retiring = trusting.switched().expect("switched");
        assert_eq!(Phase::of(&retiring), Phase::Retiring);
        assert_eq!(Phase::of(&retiring.retired()), Phase::Steady);
    }

    #[test]
    fn steady_begins_when_asked_again_or_when_the_ca_ages() {
        let decide_steady =
            |requested, rotated, expiring| decide(Phase::Steady, requested, rotated, expiring, &[]);
        assert_eq!(decide_steady(None, None, false), Step::Nothing);
        assert!(matches!(
            decide_steady(Some("1"), None, false),
            Step::Begin(why) if why.contains("castellan.io/rotate-ca=1")
        ));
        assert_eq!(
            decide_steady(Some("1"), Some("1"), false),
            Step::Nothing,
            "a request carried out is not carried out again"
        );
        assert!(matches!(
            decide_steady(Some("2"), Some("1"), false),
            Step::Begin(_)
        ));
        assert!(matches!(
            decide_steady(None, None, true),
            Step::Begin(why) if why.contains("third of its life")
        ));
    }

    #[test]
    fn trusting_switches_only_once_every_instance_showed_it() {
        let proofs = [shown("shop/db-1"), lacking("shop/db-2", "unreachable")];
        assert_eq!(
            decide(Phase::Trusting, None, None, false, &proofs),
            Step::Wait("shop/db-2: unreachable".to_owned())
        );
        let proofs = [shown("shop/db-1"), shown("shop/db-2")];
        assert_eq!(
            decide(Phase::Trusting, None, None, false, &proofs),
            Step::Switch
        );
        // No instance anywhere: nothing to wait for.
        assert_eq!(
            decide(Phase::Trusting, None, None, false, &[]),
            Step::Switch
        );
    }

    #[test]
    fn retiring_finishes_only_once_every_instance_serves_the_new_certificates() {
        let proofs = [
            lacking("a/x-1", "serves a certificate of the old CA"),
            lacking("b/y-1", "has no address"),
        ];
        assert_eq!(
            decide(Phase::Retiring, Some("1"), None, false, &proofs),
            Step::Wait(
                "a/x-1: serves a certificate of the old CA; b/y-1: has no address".to_owned()
            )
        );
        assert_eq!(
            decide(Phase::Retiring, Some("1"), None, false, &[shown("a/x-1")]),
            Step::Finish
        );
    }
}
