//! Volumes: the pure decisions of the node's local-volume provisioner.
//!
//! Given what this node's pools hold (capacity, the subvolumes and their quotas), the
//! claims of the pools' StorageClasses and the PersistentVolumes this node made, `plan`
//! says what to do: provision a claim the scheduler put on this node, refuse one that
//! does not fit, grow a volume whose claim asks for more, finish a resize that was cut
//! short, delete a released volume (`Delete`) or let go of a deleted one (`Retain`).
//! `volumes` (the shell) reads the inputs and performs the actions; nothing here does
//! I/O.
//!
//! Accounting: a pool's *allocated* bytes are the quotas of every subvolume under its
//! `volumes/` directory, whether or not a PersistentVolume still names it (a retained
//! volume whose PV was deleted still holds its data). A request is accepted only if it
//! fits in capacity − allocated, counting what this same pass already gave away, so two
//! claims arriving together cannot both take the last free bytes.

use std::collections::BTreeMap;

/// The provisioner name in StorageClasses and PV annotations.
pub const PROVISIONER: &str = "castellan.io/local";
/// The annotation the scheduler sets on a claim when it picked a node for its pod.
pub const SELECTED_NODE_ANNOTATION: &str = "volume.kubernetes.io/selected-node";
/// Who provisioned a PV (read by the PV controller).
pub const PROVISIONED_BY_ANNOTATION: &str = "pv.kubernetes.io/provisioned-by";
/// Directory of the volumes inside a pool's filesystem.
pub const VOLUMES_DIR: &str = "volumes";

/// What happens to a volume when its claim goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reclaim {
    Delete,
    Retain,
}

/// One pool mounted on this node.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolOnNode {
    pub pool: String,
    pub class: String,
    pub reclaim: Reclaim,
    /// Usable bytes (raw size / data ratio).
    pub capacity_bytes: u64,
    /// Subvolumes under `volumes/`, by name, with their quota (referenced limit).
    pub subvolumes: BTreeMap<String, Option<u64>>,
}

impl PoolOnNode {
    /// Bytes promised to subvolumes: the sum of their quotas.
    pub fn allocated_bytes(&self) -> u64 {
        self.subvolumes
            .values()
            .map(|limit| limit.unwrap_or(0))
            .sum()
    }
}

/// A PersistentVolumeClaim, as far as the provisioner cares.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub class: Option<String>,
    pub selected_node: Option<String>,
    pub request_bytes: Option<u64>,
    /// `spec.volumeName`: set once bound.
    pub volume_name: Option<String>,
    pub status_capacity_bytes: Option<u64>,
    /// `spec.volumeMode: Block` cannot be a subvolume.
    pub block: bool,
    /// `spec.dataSource`/`dataSourceRef`: cloning is not supported yet.
    pub data_source: bool,
    pub deleting: bool,
}

/// A PersistentVolume this node's agent made.
#[derive(Clone, Debug, PartialEq)]
pub struct Volume {
    pub name: String,
    pub pool: String,
    pub claim_uid: Option<String>,
    pub capacity_bytes: u64,
    /// `status.phase`: `Pending`, `Available`, `Bound`, `Released`, `Failed`.
    pub phase: Option<String>,
    pub reclaim: Reclaim,
    pub deleting: bool,
    pub finalizer: bool,
}

/// The claim a new PV is bound to.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimKey {
    fn of(claim: &Claim) -> Self {
        Self {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
        }
    }
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Create the subvolume (unless it exists) with a quota of `size_bytes`, then the PV
    /// bound to the claim.
    Provision {
        claim: ClaimKey,
        pool: String,
        class: String,
        volume: String,
        size_bytes: u64,
        reclaim: Reclaim,
    },
    /// Tell the claim's owner why it was not provisioned here (a Warning Event), and
    /// hand the claim back to the scheduler (remove the selected node) so another node
    /// with room can take it.
    Refuse { claim: ClaimKey, message: String },
    /// Raise the quota, then the PV's capacity, then the claim's status capacity.
    Expand {
        claim: ClaimKey,
        pool: String,
        volume: String,
        size_bytes: u64,
    },
    /// The quota and the PV are at the request already (a pass stopped after them):
    /// only the claim's status is behind.
    FinishExpansion { claim: ClaimKey, size_bytes: u64 },
    /// A growth that does not fit: a Warning Event, nothing else changes.
    RefuseExpansion { claim: ClaimKey, message: String },
    /// `Delete`: remove the subvolume, then the PV's finalizer, then the PV.
    Delete {
        pool: String,
        volume: String,
        subvolume: bool,
    },
    /// `Retain` and the PV is being deleted: keep the subvolume, drop the finalizer.
    Release { volume: String },
}

/// The PV name for a claim: stable, so a pass cut short and run again finds its work.
pub fn volume_name(claim_uid: &str) -> String {
    format!("pvc-{claim_uid}")
}

/// Decides every action for this node, in order.
pub fn plan(node: &str, pools: &[PoolOnNode], claims: &[Claim], volumes: &[Volume]) -> Vec<Action> {
    let mut actions = Vec::new();
    // Bytes each pool has left, reduced as this pass gives space away.
    let mut free: BTreeMap<&str, u64> = pools
        .iter()
        .map(|pool| {
            (
                pool.pool.as_str(),
                pool.capacity_bytes.saturating_sub(pool.allocated_bytes()),
            )
        })
        .collect();

    for claim in claims {
        let Some(pool) = claim
            .class
            .as_deref()
            .and_then(|class| pools.iter().find(|pool| pool.class == class))
        else {
            continue;
        };
        let key = ClaimKey::of(claim);
        let name = volume_name(&claim.uid);
        let ours = volumes
            .iter()
            .find(|volume| volume.claim_uid.as_deref() == Some(claim.uid.as_str()));
        match ours {
            None => {
                if claim.deleting
                    || claim.volume_name.is_some()
                    || claim.selected_node.as_deref() != Some(node)
                {
                    continue;
                }
                let refuse = |message: String| Action::Refuse {
                    claim: key.clone(),
                    message,
                };
                if claim.block {
                    actions.push(refuse(format!(
                        "pool {} on node {node} gives filesystem volumes only; volumeMode Block is not supported",
                        pool.pool
                    )));
                    continue;
                }
                if claim.data_source {
                    actions.push(refuse(format!(
                        "pool {} on node {node} cannot create a volume from a data source yet",
                        pool.pool
                    )));
                    continue;
                }
                let Some(size_bytes) = claim.request_bytes.filter(|bytes| *bytes > 0) else {
                    actions.push(refuse("the claim requests no storage size".to_string()));
                    continue;
                };
                // A subvolume left by a pass cut short before the PV was written is
                // this claim's own: its quota is already counted as allocated.
                let own = pool.subvolumes.get(&name).copied().flatten().unwrap_or(0);
                let left = free.get(pool.pool.as_str()).copied().unwrap_or(0);
                if size_bytes > left.saturating_add(own) {
                    actions.push(refuse(format!(
                        "requested {size_bytes} bytes, and pool {} on node {node} has {} bytes free ({} capacity, {} allocated to volumes)",
                        pool.pool,
                        left.saturating_add(own),
                        pool.capacity_bytes,
                        pool.capacity_bytes.saturating_sub(left),
                    )));
                    continue;
                }
                free.insert(pool.pool.as_str(), left.saturating_add(own) - size_bytes);
                actions.push(Action::Provision {
                    claim: key,
                    pool: pool.pool.clone(),
                    class: pool.class.clone(),
                    volume: name,
                    size_bytes,
                    reclaim: pool.reclaim,
                });
            }
            Some(volume) => {
                if claim.deleting || volume.deleting {
                    continue;
                }
                let Some(wanted) = claim.request_bytes else {
                    continue;
                };
                let status = claim.status_capacity_bytes.unwrap_or(0);
                if wanted > volume.capacity_bytes {
                    // Only a bound claim is grown: before that the PV controller may
                    // still be binding it, and its status says nothing yet.
                    if claim.volume_name.as_deref() != Some(volume.name.as_str()) {
                        continue;
                    }
                    let Some(on_node) = pools.iter().find(|pool| pool.pool == volume.pool) else {
                        continue;
                    };
                    let current = on_node
                        .subvolumes
                        .get(&volume.name)
                        .copied()
                        .flatten()
                        .unwrap_or(volume.capacity_bytes);
                    let left = free.get(on_node.pool.as_str()).copied().unwrap_or(0);
                    let growth = wanted.saturating_sub(current);
                    if growth > left {
                        actions.push(Action::RefuseExpansion {
                            claim: key,
                            message: format!(
                                "growing to {wanted} bytes needs {growth} more, and pool {} on node {node} has {left} bytes free",
                                on_node.pool
                            ),
                        });
                        continue;
                    }
                    free.insert(on_node.pool.as_str(), left - growth);
                    actions.push(Action::Expand {
                        claim: key,
                        pool: on_node.pool.clone(),
                        volume: volume.name.clone(),
                        size_bytes: wanted,
                    });
                } else if status < volume.capacity_bytes
                    && status > 0
                    && claim.volume_name.as_deref() == Some(volume.name.as_str())
                {
                    actions.push(Action::FinishExpansion {
                        claim: key,
                        size_bytes: volume.capacity_bytes,
                    });
                }
            }
        }
    }

    for volume in volumes {
        let subvolume = pools
            .iter()
            .find(|pool| pool.pool == volume.pool)
            .is_some_and(|pool| pool.subvolumes.contains_key(&volume.name));
        let released = volume.phase.as_deref() == Some("Released");
        match volume.reclaim {
            Reclaim::Delete
                if released || (volume.deleting && volume.phase.as_deref() != Some("Bound")) =>
            {
                actions.push(Action::Delete {
                    pool: volume.pool.clone(),
                    volume: volume.name.clone(),
                    subvolume,
                });
            }
            Reclaim::Retain if volume.deleting && volume.finalizer => {
                actions.push(Action::Release {
                    volume: volume.name.clone(),
                });
            }
            _ => {}
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn pool(capacity: u64, subvolumes: &[(&str, u64)]) -> PoolOnNode {
        PoolOnNode {
            pool: "fast".into(),
            class: "castellan-fast".into(),
            reclaim: Reclaim::Delete,
            capacity_bytes: capacity,
            subvolumes: subvolumes
                .iter()
                .map(|(name, limit)| (name.to_string(), Some(*limit)))
                .collect(),
        }
    }

    fn claim(uid: &str, request: u64) -> Claim {
        Claim {
            namespace: "db".into(),
            name: format!("data-{uid}"),
            uid: uid.into(),
            class: Some("castellan-fast".into()),
            selected_node: Some("n1".into()),
            request_bytes: Some(request),
            volume_name: None,
            status_capacity_bytes: None,
            block: false,
            data_source: false,
            deleting: false,
        }
    }

    fn bound(uid: &str, request: u64, status: u64) -> Claim {
        Claim {
            volume_name: Some(volume_name(uid)),
            status_capacity_bytes: Some(status),
            ..claim(uid, request)
        }
    }

    fn volume(uid: &str, capacity: u64, phase: &str) -> Volume {
        Volume {
            name: volume_name(uid),
            pool: "fast".into(),
            claim_uid: Some(uid.into()),
            capacity_bytes: capacity,
            phase: Some(phase.into()),
            reclaim: Reclaim::Delete,
            deleting: false,
            finalizer: true,
        }
    }

    fn key(uid: &str) -> ClaimKey {
        ClaimKey {
            namespace: "db".into(),
            name: format!("data-{uid}"),
            uid: uid.into(),
        }
    }

    fn provision(uid: &str, size: u64) -> Action {
        Action::Provision {
            claim: key(uid),
            pool: "fast".into(),
            class: "castellan-fast".into(),
            volume: volume_name(uid),
            size_bytes: size,
            reclaim: Reclaim::Delete,
        }
    }

    #[test]
    fn a_claim_scheduled_here_is_provisioned_with_its_request() {
        let actions = plan("n1", &[pool(10 * GI, &[])], &[claim("a", GI)], &[]);
        assert_eq!(actions, vec![provision("a", GI)]);
    }

    #[test]
    fn claims_of_other_nodes_classes_or_not_yet_scheduled_are_left_alone() {
        let elsewhere = Claim {
            selected_node: Some("n2".into()),
            ..claim("a", GI)
        };
        let unscheduled = Claim {
            selected_node: None,
            ..claim("b", GI)
        };
        let other_class = Claim {
            class: Some("standard".into()),
            ..claim("c", GI)
        };
        let no_class = Claim {
            class: None,
            ..claim("d", GI)
        };
        let bound_elsewhere = Claim {
            volume_name: Some("some-pv".into()),
            ..claim("e", GI)
        };
        let deleting = Claim {
            deleting: true,
            ..claim("f", GI)
        };
        let claims = [
            elsewhere,
            unscheduled,
            other_class,
            no_class,
            bound_elsewhere,
            deleting,
        ];
        assert_eq!(plan("n1", &[pool(10 * GI, &[])], &claims, &[]), vec![]);
    }

    #[test]
    fn no_pool_on_this_node_means_nothing_is_provisioned() {
        assert_eq!(plan("n1", &[], &[claim("a", GI)], &[]), vec![]);
    }

    #[test]
    fn a_request_larger_than_the_free_space_is_refused_counting_existing_quotas() {
        let full = pool(10 * GI, &[("pvc-x", 8 * GI)]);
        let actions = plan("n1", &[full], &[claim("a", 3 * GI)], &[]);
        assert_eq!(
            actions,
            vec![Action::Refuse {
                claim: key("a"),
                message: format!(
                    "requested {} bytes, and pool fast on node n1 has {} bytes free ({} capacity, {} allocated to volumes)",
                    3 * GI,
                    2 * GI,
                    10 * GI,
                    8 * GI
                ),
            }]
        );
    }

    #[test]
    fn two_claims_in_one_pass_cannot_both_take_the_last_space() {
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[])],
            &[claim("a", 6 * GI), claim("b", 6 * GI), claim("c", 4 * GI)],
            &[],
        );
        assert_eq!(actions.len(), 3);
        assert_eq!(actions[0], provision("a", 6 * GI));
        assert!(matches!(&actions[1], Action::Refuse { claim, .. } if claim.uid == "b"));
        assert_eq!(actions[2], provision("c", 4 * GI));
    }

    #[test]
    fn exactly_the_free_space_fits() {
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-x", 6 * GI)])],
            &[claim("a", 4 * GI)],
            &[],
        );
        assert_eq!(actions, vec![provision("a", 4 * GI)]);
    }

    #[test]
    fn a_subvolume_left_by_a_cut_short_pass_is_reused_not_counted_twice() {
        // The claim's own subvolume exists (with its quota) but the PV was not written.
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", 8 * GI)])],
            &[claim("a", 8 * GI)],
            &[],
        );
        assert_eq!(actions, vec![provision("a", 8 * GI)]);
    }

    #[test]
    fn block_mode_data_sources_and_missing_sizes_are_refused_with_a_reason() {
        let block = Claim {
            block: true,
            ..claim("a", GI)
        };
        let clone = Claim {
            data_source: true,
            ..claim("b", GI)
        };
        let sizeless = Claim {
            request_bytes: None,
            ..claim("c", GI)
        };
        let actions = plan("n1", &[pool(10 * GI, &[])], &[block, clone, sizeless], &[]);
        let messages: Vec<&str> = actions
            .iter()
            .map(|action| match action {
                Action::Refuse { message, .. } => message.as_str(),
                other => panic!("not a refusal: {other:?}"),
            })
            .collect();
        assert_eq!(
            messages,
            vec![
                "pool fast on node n1 gives filesystem volumes only; volumeMode Block is not supported",
                "pool fast on node n1 cannot create a volume from a data source yet",
                "the claim requests no storage size",
            ]
        );
    }

    #[test]
    fn a_provisioned_claim_is_not_provisioned_again() {
        let pending = claim("a", GI);
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", GI)])],
            &[pending],
            &[volume("a", GI, "Available")],
        );
        assert_eq!(actions, vec![]);
    }

    #[test]
    fn a_bound_claim_asking_for_more_is_grown_when_it_fits() {
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", GI)])],
            &[bound("a", 3 * GI, GI)],
            &[volume("a", GI, "Bound")],
        );
        assert_eq!(
            actions,
            vec![Action::Expand {
                claim: key("a"),
                pool: "fast".into(),
                volume: "pvc-a".into(),
                size_bytes: 3 * GI,
            }]
        );
    }

    #[test]
    fn a_growth_beyond_the_free_space_is_refused() {
        let actions = plan(
            "n1",
            &[pool(4 * GI, &[("pvc-a", GI), ("pvc-x", 2 * GI)])],
            &[bound("a", 3 * GI, GI)],
            &[volume("a", GI, "Bound")],
        );
        assert_eq!(
            actions,
            vec![Action::RefuseExpansion {
                claim: key("a"),
                message: format!(
                    "growing to {} bytes needs {} more, and pool fast on node n1 has {} bytes free",
                    3 * GI,
                    2 * GI,
                    GI
                ),
            }]
        );
    }

    #[test]
    fn a_growth_counts_the_quota_already_raised_by_a_cut_short_pass() {
        // Quota at 3 GiB already, PV still at 1 GiB: the growth needs nothing more.
        let actions = plan(
            "n1",
            &[pool(3 * GI, &[("pvc-a", 3 * GI)])],
            &[bound("a", 3 * GI, GI)],
            &[volume("a", GI, "Bound")],
        );
        assert!(
            matches!(&actions[..], [Action::Expand { size_bytes, .. }] if *size_bytes == 3 * GI)
        );
    }

    #[test]
    fn a_claim_status_behind_its_volume_is_caught_up() {
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", 3 * GI)])],
            &[bound("a", 3 * GI, GI)],
            &[volume("a", 3 * GI, "Bound")],
        );
        assert_eq!(
            actions,
            vec![Action::FinishExpansion {
                claim: key("a"),
                size_bytes: 3 * GI,
            }]
        );
    }

    #[test]
    fn a_claim_at_its_size_or_not_yet_bound_changes_nothing() {
        let at_size = bound("a", GI, GI);
        let unbound_bigger = claim("b", 2 * GI);
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", GI), ("pvc-b", GI)])],
            &[at_size, unbound_bigger],
            &[volume("a", GI, "Bound"), volume("b", GI, "Available")],
        );
        assert_eq!(actions, vec![]);
    }

    #[test]
    fn a_released_delete_volume_is_deleted_with_its_subvolume() {
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", GI)])],
            &[],
            &[volume("a", GI, "Released")],
        );
        assert_eq!(
            actions,
            vec![Action::Delete {
                pool: "fast".into(),
                volume: "pvc-a".into(),
                subvolume: true,
            }]
        );
    }

    #[test]
    fn a_deleted_volume_whose_subvolume_is_gone_is_only_removed() {
        let deleting = Volume {
            deleting: true,
            ..volume("a", GI, "Available")
        };
        let actions = plan("n1", &[pool(10 * GI, &[])], &[], &[deleting]);
        assert_eq!(
            actions,
            vec![Action::Delete {
                pool: "fast".into(),
                volume: "pvc-a".into(),
                subvolume: false,
            }]
        );
    }

    #[test]
    fn a_bound_volume_being_deleted_waits_for_its_claim() {
        let deleting = Volume {
            deleting: true,
            ..volume("a", GI, "Bound")
        };
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-a", GI)])],
            &[bound("a", GI, GI)],
            &[deleting],
        );
        assert_eq!(actions, vec![]);
    }

    #[test]
    fn retain_keeps_the_subvolume_and_only_lets_the_deleted_pv_go() {
        let retained = Volume {
            reclaim: Reclaim::Retain,
            ..volume("a", GI, "Released")
        };
        let pools = [pool(10 * GI, &[("pvc-a", GI)])];
        assert_eq!(
            plan("n1", &pools, &[], std::slice::from_ref(&retained)),
            vec![]
        );
        let deleted = Volume {
            deleting: true,
            ..retained.clone()
        };
        assert_eq!(
            plan("n1", &pools, &[], std::slice::from_ref(&deleted)),
            vec![Action::Release {
                volume: "pvc-a".into()
            }]
        );
        let without_finalizer = Volume {
            finalizer: false,
            ..deleted
        };
        assert_eq!(plan("n1", &pools, &[], &[without_finalizer]), vec![]);
    }

    #[test]
    fn a_retained_subvolume_without_pv_still_counts_as_allocated() {
        // pvc-old was retained and its PV deleted: its 8 GiB are still promised.
        let actions = plan(
            "n1",
            &[pool(10 * GI, &[("pvc-old", 8 * GI)])],
            &[claim("a", 3 * GI)],
            &[],
        );
        assert!(matches!(&actions[..], [Action::Refuse { .. }]));
    }

    #[test]
    fn allocated_is_the_sum_of_quotas_and_a_subvolume_without_quota_counts_zero() {
        let mut on_node = pool(10 * GI, &[("pvc-a", GI), ("pvc-b", 2 * GI)]);
        on_node.subvolumes.insert("pvc-c".into(), None);
        assert_eq!(on_node.allocated_bytes(), 3 * GI);
    }
}
