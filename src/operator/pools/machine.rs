//! Releasing the part of a `StoragePool` on a node that never comes back, decided
//! without I/O.
//!
//! Each node's agent releases its own part of a pool (its status entry, and on deletion
//! its filesystem and disks). A node that is gone for good leaves its entry behind and,
//! for a deleted pool, the finalizer with it, and its volumes' finalizers too: nobody
//! is there to clean them. The declared way out is the pool's annotation
//! [`RELEASE_ANNOTATION`] naming such nodes (`kubectl annotate storagepool P
//! castellan.io/release-nodes=node-3`). For each named node that is not `Ready` (a Ready
//! node's agent releases its own part; the request is refused with the reason):
//!
//! - its status entry is removed;
//! - its volumes of the pool whose claims are gone are let go: their finalizer is removed
//!   and they are deleted (their data was on the lost node); a volume whose claim still
//!   exists is kept and named, since deleting it under a claim would break whoever uses
//!   it: delete the claim, then annotate again;
//! - a deleted pool with no entry and no volume left loses its finalizer;
//! - the annotation is removed, and Events say what was done and what was not.
//!
//! Nothing here touches a disk: the node's disks are unreachable, and if the node ever
//! returns its agent finds them carrying the old pool's label (refused by any other pool
//! unless `allowWipe`).

use std::collections::BTreeMap;

/// The pool annotation that names the nodes to release (commas or spaces between).
pub const RELEASE_ANNOTATION: &str = "castellan.io/release-nodes";

/// One PersistentVolume of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    pub name: String,
    pub node: String,
    /// `namespace/name` of the claim it is bound to, when that claim exists.
    pub claim: Option<String>,
}

/// What the shell sees of the pool.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// The annotation's value.
    pub requested: Option<String>,
    /// The nodes with a status entry.
    pub entries: Vec<String>,
    /// Every named node's readiness; absent: no such Node object.
    pub ready: BTreeMap<String, bool>,
    pub volumes: Vec<Volume>,
    pub deleting: bool,
    pub has_finalizer: bool,
}

/// What to do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Nodes whose status entry goes.
    pub release: Vec<String>,
    /// Named nodes left alone, and why.
    pub refused: Vec<(String, String)>,
    /// Volumes let go (finalizer removed, deleted).
    pub drop_volumes: Vec<String>,
    /// Volumes of released nodes kept because their claim exists: (volume, claim).
    pub kept_volumes: Vec<(String, String)>,
    pub remove_finalizer: bool,
    /// Remove the annotation (it was acted on).
    pub clear_annotation: bool,
}

/// The nodes an annotation value names.
pub fn named(value: &str) -> Vec<String> {
    let mut nodes: Vec<String> = value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|node| !node.is_empty())
        .map(str::to_string)
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

pub fn decide(observed: &Observed) -> Plan {
    let Some(requested) = observed.requested.as_deref() else {
        return Plan::default();
    };
    let mut plan = Plan {
        clear_annotation: true,
        ..Plan::default()
    };
    for node in named(requested) {
        if observed.ready.get(&node) == Some(&true) {
            plan.refused.push((
                node.clone(),
                format!("node {node} is Ready: its agent releases its own part of the pool"),
            ));
            continue;
        }
        for volume in observed.volumes.iter().filter(|v| v.node == node) {
            match &volume.claim {
                Some(claim) => plan.kept_volumes.push((volume.name.clone(), claim.clone())),
                None => plan.drop_volumes.push(volume.name.clone()),
            }
        }
        plan.release.push(node);
    }
    let entries_left = observed
        .entries
        .iter()
        .filter(|entry| !plan.release.contains(entry))
        .count();
    let volumes_left = observed.volumes.len() - plan.drop_volumes.len();
    plan.remove_finalizer =
        observed.deleting && observed.has_finalizer && entries_left == 0 && volumes_left == 0;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, node: &str, claim: Option<&str>) -> Volume {
        Volume {
            name: name.into(),
            node: node.into(),
            claim: claim.map(Into::into),
        }
    }

    fn observed() -> Observed {
        Observed {
            requested: Some("node-3, node-2 node-3".into()),
            entries: vec!["node-1".into(), "node-2".into(), "node-3".into()],
            ready: [("node-1".to_string(), true), ("node-2".to_string(), true)].into(),
            volumes: vec![
                volume("pv-a", "node-1", Some("db/data-1")),
                volume("pv-b", "node-3", None),
                volume("pv-c", "node-3", Some("db/data-3")),
            ],
            deleting: false,
            has_finalizer: true,
        }
    }

    #[test]
    fn nothing_without_the_annotation() {
        let mut o = observed();
        o.requested = None;
        assert_eq!(decide(&o), Plan::default());
    }

    #[test]
    fn a_gone_node_is_released_a_ready_one_refused_and_claimed_volumes_kept() {
        let plan = decide(&observed());
        assert_eq!(plan.release, ["node-3"]);
        assert_eq!(
            plan.refused,
            [(
                "node-2".to_string(),
                "node node-2 is Ready: its agent releases its own part of the pool".to_string()
            )]
        );
        assert_eq!(plan.drop_volumes, ["pv-b"]);
        assert_eq!(
            plan.kept_volumes,
            [("pv-c".to_string(), "db/data-3".to_string())]
        );
        assert!(!plan.remove_finalizer, "not being deleted");
        assert!(plan.clear_annotation);
    }

    #[test]
    fn a_deleted_pool_loses_its_finalizer_when_nothing_is_left() {
        let o = Observed {
            requested: Some("node-3".into()),
            entries: vec!["node-3".into()],
            ready: BTreeMap::new(),
            volumes: vec![volume("pv-b", "node-3", None)],
            deleting: true,
            has_finalizer: true,
        };
        let plan = decide(&o);
        assert_eq!(plan.release, ["node-3"]);
        assert!(plan.remove_finalizer);
        let mut claimed = o.clone();
        claimed.volumes[0].claim = Some("db/data".into());
        assert!(
            !decide(&claimed).remove_finalizer,
            "a volume under a claim keeps the pool"
        );
        let mut other = o;
        other.entries.push("node-1".into());
        assert!(
            !decide(&other).remove_finalizer,
            "another node's agent still releases its part"
        );
    }
}
