//! Declared actions: a restart or a reload of every instance, asked for by annotating
//! the `DatabaseCluster` (`castellan.io/restart`, `castellan.io/reload`) with a new
//! value — a timestamp, as `kubectl castellan restart` writes it, the way
//! `kubectl rollout restart` stamps a Deployment. The machine carries a request out
//! once, through the paths it already has (the rolling restart, replicas first and the
//! primary last; the reload call on every instance), then records the value it handled
//! in `castellan.io/restarted` / `castellan.io/reloaded`, so a restarted operator does
//! not do it again and a user sees it is done. Pure: the machine calls these.

use std::collections::BTreeSet;

use castellan_crds::DatabaseCluster;
use kube::ResourceExt;

use super::state::{ClusterEffect, ClusterState, Note};
use crate::operator::replica::Command;

/// Annotation asking for a rolling restart of every instance: any new value.
pub const RESTART_ANNOTATION: &str = "castellan.io/restart";
/// Annotation asking for every instance to reload its configuration: any new value.
pub const RELOAD_ANNOTATION: &str = "castellan.io/reload";
/// The `castellan.io/restart` value last carried out, written by the operator.
pub const RESTARTED_ANNOTATION: &str = "castellan.io/restarted";
/// The `castellan.io/reload` value last carried out, written by the operator.
pub const RELOADED_ANNOTATION: &str = "castellan.io/reloaded";

/// One of the declared actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeclaredAction {
    Restart,
    Reload,
}

impl DeclaredAction {
    pub const ALL: [Self; 2] = [Self::Restart, Self::Reload];

    /// The annotation a user sets to ask for it.
    pub fn annotation(self) -> &'static str {
        match self {
            Self::Restart => RESTART_ANNOTATION,
            Self::Reload => RELOAD_ANNOTATION,
        }
    }

    /// The annotation the operator records the handled value in.
    pub fn handled_annotation(self) -> &'static str {
        match self {
            Self::Restart => RESTARTED_ANNOTATION,
            Self::Reload => RELOADED_ANNOTATION,
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::Reload => "reload",
        }
    }

    /// Whether `command` carries this action out on an instance.
    fn done_by(self, command: &Command) -> bool {
        matches!(
            (self, command),
            (Self::Restart, Command::Restart) | (Self::Reload, Command::Reload { .. })
        )
    }
}

/// A declared action being carried out: the value asked for, and the instances it is
/// done on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rollout {
    pub value: String,
    pub done: BTreeSet<String>,
}

impl Rollout {
    /// Whether `instance` still needs it.
    pub fn owes(&self, instance: &str) -> bool {
        !self.done.contains(instance)
    }
}

/// The declared actions the machine follows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Declared {
    pub restart: Option<Rollout>,
    pub reload: Option<Rollout>,
    /// Values recorded as handled by this machine, which the cluster it was sent may
    /// not show yet (the annotation write and the next `Desired` cross).
    pub restart_handled: Option<String>,
    pub reload_handled: Option<String>,
}

impl Declared {
    pub fn rollout(&self, action: DeclaredAction) -> Option<&Rollout> {
        match action {
            DeclaredAction::Restart => self.restart.as_ref(),
            DeclaredAction::Reload => self.reload.as_ref(),
        }
    }

    fn slots(&mut self, action: DeclaredAction) -> (&mut Option<Rollout>, &mut Option<String>) {
        match action {
            DeclaredAction::Restart => (&mut self.restart, &mut self.restart_handled),
            DeclaredAction::Reload => (&mut self.reload, &mut self.reload_handled),
        }
    }
}

/// The value of `action` the cluster asks for and that has not been handled: set, and
/// different from the value recorded on the object and the one this machine recorded.
pub fn requested(
    cluster: &DatabaseCluster,
    declared: &Declared,
    action: DeclaredAction,
) -> Option<String> {
    let annotations = cluster.annotations();
    let value = annotations.get(action.annotation())?;
    let handled_here = match action {
        DeclaredAction::Restart => &declared.restart_handled,
        DeclaredAction::Reload => &declared.reload_handled,
    };
    let handled = annotations.get(action.handled_annotation()) == Some(value)
        || handled_here.as_ref() == Some(value);
    (!handled && !value.is_empty()).then(|| value.clone())
}

/// Follows the annotations: a new value starts a rollout (with an Event), a removed or
/// handled one ends it. A value changed mid-way starts over: the instances done were
/// done for the old one.
pub fn follow_requests(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    let Some(cluster) = state.cluster.clone() else {
        return;
    };
    let members = state.members.len();
    for action in DeclaredAction::ALL {
        let wanted = requested(&cluster, &state.declared, action);
        let (rollout, _) = state.declared.slots(action);
        match wanted {
            None => *rollout = None,
            Some(value) if rollout.as_ref().is_none_or(|r| r.value != value) => {
                let how = match action {
                    DeclaredAction::Restart => "one at a time, replicas first, the primary last",
                    DeclaredAction::Reload => "on every instance",
                };
                effects.push(ClusterEffect::Record(Note::normal(
                    match action {
                        DeclaredAction::Restart => "RestartRequested",
                        DeclaredAction::Reload => "ReloadRequested",
                    },
                    format!(
                        "{} {members} instances {how}, as {}={value} asks",
                        action.verb(),
                        action.annotation()
                    ),
                )));
                *rollout = Some(Rollout {
                    value,
                    done: BTreeSet::new(),
                });
            }
            Some(_) => {}
        }
    }
}

/// A command finished on `instance`: a successful restart or reload counts for the
/// rollout of that action; once every instance has it, the value is recorded as
/// handled (the annotation, and an Event).
pub fn command_finished(
    state: &mut ClusterState,
    effects: &mut Vec<ClusterEffect>,
    instance: &str,
    command: &Command,
    succeeded: bool,
) {
    if succeeded {
        for action in DeclaredAction::ALL {
            if action.done_by(command)
                && let (Some(rollout), _) = state.declared.slots(action)
            {
                rollout.done.insert(instance.to_owned());
            }
        }
    }
    complete(state, effects);
}

/// Records every rollout that reached all members as handled.
pub fn complete(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) {
    if state.members.is_empty() {
        return;
    }
    for action in DeclaredAction::ALL {
        let members = &state.members;
        let (rollout, handled) = state.declared.slots(action);
        let Some(done) = rollout
            .take_if(|r| members.keys().all(|name| r.done.contains(name)))
            .map(|r| r.value)
        else {
            continue;
        };
        effects.push(ClusterEffect::Record(Note::normal(
            match action {
                DeclaredAction::Restart => "RestartCompleted",
                DeclaredAction::Reload => "ReloadCompleted",
            },
            format!(
                "every instance ({}) did the {} {}={done} asked for",
                members.keys().cloned().collect::<Vec<_>>().join(", "),
                action.verb(),
                action.annotation()
            ),
        )));
        effects.push(ClusterEffect::Acknowledge {
            annotation: action.handled_annotation(),
            value: done.clone(),
        });
        *handled = Some(done);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::fixtures::*;
    use super::*;
    use crate::operator::cluster::state::ClusterEvent;

    fn annotated(replicas: i32, annotations: &[(&str, &str)]) -> ClusterState {
        let mut cluster = (*cluster(replicas, false, &[])).clone();
        cluster.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        let mut state = settled(std::sync::Arc::new(cluster.clone()), replicas as u32);
        state.cluster = Some(std::sync::Arc::new(cluster));
        state
    }

    fn acknowledged(effects: &[ClusterEffect]) -> Vec<(&'static str, String)> {
        effects
            .iter()
            .filter_map(|e| match e {
                ClusterEffect::Acknowledge { annotation, value } => {
                    Some((*annotation, value.clone()))
                }
                _ => None,
            })
            .collect()
    }

    fn finished(state: ClusterState, instance: &str, command: Command) -> ClusterState {
        let (state, _) = step(
            state,
            ClusterEvent::Finished {
                instance: instance.into(),
                command,
                outcome: Ok(json!({})),
                at: at(0),
            },
        );
        state
    }

    #[test]
    fn a_value_already_handled_is_not_requested() {
        let state = annotated(
            2,
            &[(RESTART_ANNOTATION, "t1"), (RESTARTED_ANNOTATION, "t1")],
        );
        let cluster = state.cluster.clone().expect("a cluster");
        assert_eq!(
            requested(&cluster, &state.declared, DeclaredAction::Restart),
            None
        );
        let state = annotated(
            2,
            &[(RESTART_ANNOTATION, "t2"), (RESTARTED_ANNOTATION, "t1")],
        );
        let cluster = state.cluster.clone().expect("a cluster");
        assert_eq!(
            requested(&cluster, &state.declared, DeclaredAction::Restart),
            Some("t2".into())
        );
        let declared = Declared {
            restart_handled: Some("t2".into()),
            ..Declared::default()
        };
        assert_eq!(
            requested(&cluster, &declared, DeclaredAction::Restart),
            None,
            "handled here, not yet seen on the object"
        );
        assert_eq!(
            requested(&cluster, &declared, DeclaredAction::Reload),
            None,
            "no reload annotation"
        );
    }

    #[test]
    fn a_new_request_starts_a_rollout_with_an_event_and_a_removed_one_ends_it() {
        let mut state = annotated(2, &[(RELOAD_ANNOTATION, "t1")]);
        let mut effects = Vec::new();
        follow_requests(&mut state, &mut effects);
        assert_eq!(notes(&effects), vec!["ReloadRequested"]);
        assert_eq!(
            state.declared.reload.as_ref().map(|r| r.value.as_str()),
            Some("t1")
        );
        // The same value again: no second Event, progress kept.
        state
            .declared
            .reload
            .as_mut()
            .expect("a rollout")
            .done
            .insert("db-1".into());
        let mut effects = Vec::new();
        follow_requests(&mut state, &mut effects);
        assert!(notes(&effects).is_empty());
        assert!(!state.declared.reload.as_ref().expect("kept").owes("db-1"));
        // A new value starts over.
        let mut cluster = (**state.cluster.as_ref().expect("a cluster")).clone();
        cluster
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(RELOAD_ANNOTATION.into(), "t2".into());
        state.cluster = Some(std::sync::Arc::new(cluster.clone()));
        follow_requests(&mut state, &mut effects);
        assert!(state.declared.reload.as_ref().expect("new").owes("db-1"));
        // Removed: nothing is owed.
        cluster.metadata.annotations = None;
        state.cluster = Some(std::sync::Arc::new(cluster));
        follow_requests(&mut state, &mut effects);
        assert_eq!(state.declared.reload, None);
    }

    #[test]
    fn reload_goes_to_every_instance_and_is_recorded_once_all_did_it() {
        let state = annotated(2, &[(RELOAD_ANNOTATION, "t1")]);
        let desired = state.cluster.clone().expect("a cluster");
        let (state, effects) = step(idle(state), ClusterEvent::Desired(desired));
        let mut sent: Vec<String> = commands(&effects)
            .into_iter()
            .filter(|(_, c)| matches!(c, Command::Reload { .. }))
            .map(|(name, _)| name)
            .collect();
        sent.sort();
        assert_eq!(sent, vec!["db-1", "db-2"], "{effects:?}");
        let reload = commands(&effects)
            .into_iter()
            .find(|(name, _)| name == "db-1")
            .map(|(_, c)| c)
            .expect("the primary's reload");
        let state = finished(state, "db-1", reload.clone());
        assert!(state.declared.reload.is_some(), "db-2 has not reloaded yet");
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-2".into(),
                command: reload,
                outcome: Ok(json!({})),
                at: at(0),
            },
        );
        assert_eq!(
            acknowledged(&effects),
            vec![(RELOADED_ANNOTATION, "t1".into())]
        );
        assert_eq!(notes(&effects), vec!["Reloaded", "ReloadCompleted"]);
        assert_eq!(state.declared.reload, None);
        // The cluster as the API has it before the annotation write comes back: not
        // asked again.
        let desired = state.cluster.clone().expect("a cluster");
        let (_, effects) = step(idle(state), ClusterEvent::Desired(desired));
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| matches!(c, Command::Reload { .. })),
            "{effects:?}"
        );
    }

    #[test]
    fn a_failed_reload_is_not_counted() {
        let state = annotated(1, &[(RELOAD_ANNOTATION, "t1")]);
        let desired = state.cluster.clone().expect("a cluster");
        let (state, effects) = step(idle(state), ClusterEvent::Desired(desired));
        let (_, reload) = commands(&effects).pop().expect("a reload");
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: reload,
                outcome: Err("connection refused".into()),
                at: at(0),
            },
        );
        assert!(acknowledged(&effects).is_empty());
        assert!(
            state
                .declared
                .reload
                .as_ref()
                .expect("still owed")
                .owes("db-1")
        );
    }

    #[test]
    fn restart_rolls_replicas_first_and_is_recorded_after_the_primary() {
        let state = annotated(3, &[(RESTART_ANNOTATION, "t1")]);
        let desired = state.cluster.clone().expect("a cluster");
        let (state, effects) = step(idle(state), ClusterEvent::Desired(desired));
        assert_eq!(commands(&effects), vec![("db-2".into(), Command::Restart)]);
        assert_eq!(notes(&effects), vec!["RestartRequested", "RollingRestart"]);
        let state = finished(state, "db-2", Command::Restart);
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-2", &[])));
        assert_eq!(commands(&effects), vec![("db-3".into(), Command::Restart)]);
        let state = finished(state, "db-3", Command::Restart);
        let (state, effects) = step(state, ClusterEvent::Observed(view("db-3", &[])));
        assert_eq!(commands(&effects), vec![("db-1".into(), Command::Restart)]);
        let (state, effects) = step(
            state,
            ClusterEvent::Finished {
                instance: "db-1".into(),
                command: Command::Restart,
                outcome: Ok(json!({})),
                at: at(0),
            },
        );
        assert_eq!(
            acknowledged(&effects),
            vec![(RESTARTED_ANNOTATION, "t1".into())]
        );
        assert!(notes(&effects).contains(&"RestartCompleted"));
        let primary = primary_view(&["db-2", "db-3"], "");
        let (_, effects) = step(state, ClusterEvent::Observed(primary));
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| matches!(c, Command::Restart)),
            "done once: {effects:?}"
        );
    }

    #[test]
    fn restart_waits_while_an_instance_is_not_ready() {
        let mut state = annotated(2, &[(RESTART_ANNOTATION, "t1")]);
        if let Some(view) = state.views.get_mut("db-2") {
            view.ready = false;
        }
        let desired = state.cluster.clone().expect("a cluster");
        let (_, effects) = step(idle(state), ClusterEvent::Desired(desired));
        assert!(
            !commands(&effects)
                .iter()
                .any(|(_, c)| matches!(c, Command::Restart)),
            "{effects:?}"
        );
    }
}
