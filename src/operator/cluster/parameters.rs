//! `spec.parameters` as the cluster machine sees them: an instance writes a new set
//! only once PostgreSQL has accepted it (`postgres -C`), and otherwise keeps its last
//! good configuration and reports the refusal. The machine then stops asking that
//! instance for the refused set, and the `ParametersValid` condition names each
//! refused parameter with PostgreSQL's reason.

use std::collections::BTreeMap;

use super::state::{Assessment, ClusterEffect, ClusterState};
use crate::operator::replica::InstanceView;

/// Whether `view`'s instance refused exactly `wanted`.
pub fn refused(view: &InstanceView, wanted: &BTreeMap<String, String>) -> bool {
    view.refused_parameters
        .as_ref()
        .is_some_and(|refusal| &refusal.parameters == wanted)
}

/// `ParametersValid`: false while any instance refuses the spec's parameters.
pub fn parameters_assessment(state: &ClusterState) -> Option<Assessment> {
    let cluster = state.cluster.as_ref()?;
    let wanted = &cluster.spec.parameters;
    let mut reasons: Vec<String> = Vec::new();
    let mut refusing: Vec<&str> = Vec::new();
    for (name, view) in &state.views {
        if !refused(view, wanted) {
            continue;
        }
        refusing.push(name);
        for (parameter, reason) in view.refused_parameters.iter().flat_map(|r| &r.reasons) {
            let reason = format!("{parameter}: {reason}");
            if !reasons.contains(&reason) {
                reasons.push(reason);
            }
        }
    }
    if refusing.is_empty() {
        return Some(Assessment::new(
            true,
            "Valid",
            "no instance refuses spec.parameters",
        ));
    }
    Some(Assessment::new(
        false,
        "InvalidParameters",
        format!(
            "PostgreSQL refuses spec.parameters on {} ({}); they keep their last good configuration until the spec is corrected",
            refusing.join(", "),
            reasons.join("; ")
        ),
    ))
}

/// Records an Event when the parameters turn invalid (Warning `InvalidParameters`) or
/// valid again (`ParametersValid`), and says whether the condition flipped.
pub fn parameters_changed(state: &mut ClusterState, effects: &mut Vec<ClusterEffect>) -> bool {
    let Some(assessment) = parameters_assessment(state) else {
        return false;
    };
    // Valid from the start is no news: the next pass writes it anyway.
    let news = state.parameters_ok.is_some() || !assessment.status;
    assessment.record_flip(&mut state.parameters_ok, "ParametersValid", effects) && news
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;
    use crate::instance_api::RefusedParameters;
    use crate::operator::cluster::state::ClusterEvent;
    use crate::operator::replica::Command;

    fn refusing(name: &str, parameters: &[(&str, &str)], reason: &str) -> InstanceView {
        let mut view = view(name, &[]);
        view.refused_parameters = Some(RefusedParameters {
            parameters: parameters
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            reasons: reason
                .split_once(": ")
                .map(|(parameter, why)| (parameter.to_owned(), why.to_owned()))
                .into_iter()
                .collect(),
        });
        view
    }

    #[test]
    fn an_instance_that_refused_the_spec_is_not_asked_again() {
        let wanted = [("work_mem", "banana")];
        let state = settled(cluster(2, false, &wanted), 2);
        let reason = "work_mem: invalid value for parameter \"work_mem\": \"banana\"";
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(refusing("db-2", &wanted, reason)),
        );
        assert!(
            !commands(&effects)
                .iter()
                .any(|(name, command)| name == "db-2" && matches!(command, Command::Reload { .. })),
            "{effects:?}"
        );
    }

    #[test]
    fn a_corrected_spec_is_sent_to_an_instance_that_refused_the_old_one() {
        let state = settled(cluster(2, false, &[("work_mem", "8MB")]), 2);
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(refusing("db-2", &[("work_mem", "banana")], "work_mem: …")),
        );
        assert!(
            commands(&effects)
                .iter()
                .any(|(name, command)| name == "db-2" && matches!(command, Command::Reload { .. })),
            "{effects:?}"
        );
    }

    #[test]
    fn refusals_are_the_condition_with_a_warning_once_and_a_recovery_event() {
        let wanted = [("work_mem", "banana")];
        let state = settled(cluster(2, false, &wanted), 2);
        assert_eq!(
            parameters_assessment(&state).map(|a| (a.status, a.reason)),
            Some((true, "Valid"))
        );
        let reason = "work_mem: invalid value for parameter \"work_mem\": \"banana\"";
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(refusing("db-2", &wanted, reason)),
        );
        assert_eq!(notes(&effects), vec!["InvalidParameters"]);
        let assessment = parameters_assessment(&state).expect("a condition");
        assert!(!assessment.status);
        assert!(
            assessment.message.contains("db-2"),
            "{}",
            assessment.message
        );
        assert!(
            assessment.message.contains(reason),
            "{}",
            assessment.message
        );
        assert!(
            converge_order(&effects)
                .and_then(|o| o.parameters_condition.clone())
                .is_some_and(|a| !a.status),
            "status is written with the refusal"
        );

        let mut state = state;
        state.converging = false;
        let (state, effects) = step(
            state,
            ClusterEvent::Observed(refusing("db-2", &wanted, reason)),
        );
        assert!(notes(&effects).is_empty(), "one Warning, not one per poll");

        // The user corrected the spec: the condition the next pass writes is True, and
        // the Event comes with it, not with db-2's next report.
        let mut state = state;
        state.converging = false;
        let (state, effects) = step(
            state,
            ClusterEvent::Desired(cluster(2, false, &[("work_mem", "8MB")])),
        );
        assert_eq!(notes(&effects), vec!["ParametersValid"]);
        assert!(
            converge_order(&effects)
                .and_then(|o| o.parameters_condition.clone())
                .is_some_and(|a| a.status),
            "{effects:?}"
        );
        let mut state = state;
        state.converging = false;
        let (_, effects) = step(
            state,
            ClusterEvent::Observed(view("db-2", &[("work_mem", "8MB")])),
        );
        assert!(notes(&effects).is_empty(), "{effects:?}");
    }
}
