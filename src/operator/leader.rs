//! Leader election on a `coordination.k8s.io` Lease, so that two replicas of the
//! operator can run and only one acts. The rules are the client-go ones: the holder
//! renews the lease every few seconds; anyone may take it once it has not been renewed
//! for its whole duration; every write carries the resourceVersion it read, so two
//! candidates cannot both win. A leader that cannot renew in time exits, and its
//! Deployment restarts it as a candidate (as controller-runtime does): acting on a lost
//! lease is how two primaries happen.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};

/// How long a lease stays valid without renewal.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the holder renews, and candidates look.
pub const RETRY_PERIOD: Duration = Duration::from_secs(2);

/// What to do with the lease as last read.
#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nobody holds it: create it.
    Create,
    /// We hold it, or its holder let it expire: write ourselves in (renew or take over).
    Claim,
    /// Someone else holds a valid lease: wait.
    Wait,
}

/// Pure: whether `me` may write itself into `lease` at `now`.
pub fn decide(lease: Option<&Lease>, me: &str, now: Timestamp) -> Decision {
    let Some(spec) = lease.and_then(|lease| lease.spec.as_ref()) else {
        return if lease.is_none() {
            Decision::Create
        } else {
            Decision::Claim
        };
    };
    // Ours, or given up (`release`): a released lease keeps its acquireTime, which
    // must not make the next operator wait out a lease nobody holds.
    match spec.holder_identity.as_deref() {
        Some(holder) if holder == me => return Decision::Claim,
        None | Some("") => return Decision::Claim,
        Some(_) => {}
    }
    let duration = spec
        .lease_duration_seconds
        .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
        .unwrap_or(LEASE_DURATION);
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0);
    match renewed {
        Some(renewed) if renewed + duration > now => Decision::Wait,
        _ => Decision::Claim,
    }
}

fn lease_spec(me: &str, previous: Option<&LeaseSpec>, now: Timestamp) -> LeaseSpec {
    let ours = previous.and_then(|p| p.holder_identity.as_deref()) == Some(me);
    let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(me.to_owned()),
        lease_duration_seconds: i32::try_from(LEASE_DURATION.as_secs()).ok(),
        acquire_time: if ours {
            previous.and_then(|p| p.acquire_time.clone())
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if ours || previous.is_none() {
            transitions
        } else {
            transitions + 1
        }),
        ..LeaseSpec::default()
    }
}

/// One attempt to hold the lease; true when `me` holds it afterwards.
pub async fn try_hold(api: &Api<Lease>, name: &str, me: &str) -> Result<bool, kube::Error> {
    let current = api.get_opt(name).await?;
    let now = Timestamp::now();
    match decide(current.as_ref(), me, now) {
        Decision::Wait => Ok(false),
        Decision::Create => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    ..ObjectMeta::default()
                },
                spec: Some(lease_spec(me, None, now)),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
        Decision::Claim => {
            let Some(mut lease) = current else {
                return Ok(false);
            };
            lease.spec = Some(lease_spec(me, lease.spec.as_ref(), now));
            // `replace` sends the resourceVersion we read: a concurrent writer makes
            // this fail with a conflict instead of both of us holding the lease.
            match api.replace(name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(error) => Err(error),
            }
        }
    }
}

/// Waits until `me` holds the lease, then keeps renewing it in the background; the
/// returned future resolves (with the reason) if the lease is lost.
pub async fn acquire(
    client: Client,
    namespace: &str,
    name: &str,
    me: &str,
) -> tokio::task::JoinHandle<String> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    loop {
        match try_hold(&api, name, me).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(error) => tracing::warn!(%error, lease = name, "reading the leader lease"),
        }
        tokio::time::sleep(RETRY_PERIOD).await;
    }
    tracing::info!(lease = name, identity = me, "became the leader");
    let name = name.to_owned();
    let me = me.to_owned();
    tokio::spawn(async move {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(RETRY_PERIOD).await;
            match try_hold(&api, &name, &me).await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => return format!("lease {name} is held by another operator"),
                Err(error) => tracing::warn!(%error, lease = %name, "renewing the leader lease"),
            }
            // Stop acting well before another candidate may take over.
            if last_renewal.elapsed() > LEASE_DURATION - RETRY_PERIOD * 2 {
                return format!(
                    "lease {name} could not be renewed for {:?}",
                    last_renewal.elapsed()
                );
            }
        }
    })
}

/// Gives the lease up on a clean shutdown, so that the other replica takes over at
/// once instead of after the lease expires: only if `me` still holds it, and with the
/// read resourceVersion, so a lease someone else took meanwhile is left alone.
pub async fn release(client: Client, namespace: &str, name: &str, me: &str) {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let outcome = async {
        let Some(mut lease) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let Some(spec) = lease
            .spec
            .as_mut()
            .filter(|s| s.holder_identity.as_deref() == Some(me))
        else {
            return Ok(false);
        };
        spec.holder_identity = None;
        spec.renew_time = None;
        api.replace(name, &PostParams::default(), &lease).await?;
        Ok::<_, kube::Error>(true)
    }
    .await;
    match outcome {
        Ok(true) => tracing::info!(lease = name, identity = me, "released the leader lease"),
        Ok(false) => {}
        Err(error) => tracing::warn!(%error, lease = name, "releasing the leader lease"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed: Timestamp) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                lease_duration_seconds: Some(15),
                renew_time: Some(MicroTime(renewed)),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn an_absent_lease_is_created() {
        assert_eq!(decide(None, "a", Timestamp::now()), Decision::Create);
    }

    #[test]
    fn the_holder_renews() {
        let now = Timestamp::now();
        assert_eq!(decide(Some(&lease("a", now)), "a", now), Decision::Claim);
    }

    #[test]
    fn a_valid_lease_of_another_is_waited_for() {
        let now = Timestamp::now();
        let renewed = now - Duration::from_secs(10);
        assert_eq!(decide(Some(&lease("b", renewed)), "a", now), Decision::Wait);
    }

    #[test]
    fn an_expired_lease_is_taken_over() {
        let now = Timestamp::now();
        let renewed = now - Duration::from_secs(16);
        assert_eq!(
            decide(Some(&lease("b", renewed)), "a", now),
            Decision::Claim
        );
    }

    #[test]
    fn a_lease_without_spec_or_times_is_claimable() {
        let empty = Lease::default();
        assert_eq!(decide(Some(&empty), "a", Timestamp::now()), Decision::Claim);
        let mut no_times = lease("b", Timestamp::now());
        if let Some(spec) = no_times.spec.as_mut() {
            spec.renew_time = None;
        }
        assert_eq!(
            decide(Some(&no_times), "a", Timestamp::now()),
            Decision::Claim
        );
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        // As `release` leaves it: no holder, no renewTime, an acquireTime seconds ago.
        let mut released = lease("b", Timestamp::now());
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
            spec.acquire_time = Some(MicroTime(Timestamp::now() - Duration::from_secs(3)));
        }
        assert_eq!(
            decide(Some(&released), "a", Timestamp::now()),
            Decision::Claim
        );
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_does_not() {
        let now = Timestamp::now();
        let previous = lease_spec("b", None, now);
        let taken = lease_spec("a", Some(&previous), now);
        assert_eq!(taken.lease_transitions, Some(1));
        let renewed = lease_spec("a", Some(&taken), now);
        assert_eq!(renewed.lease_transitions, Some(1));
        assert_eq!(renewed.acquire_time, taken.acquire_time);
    }
}
