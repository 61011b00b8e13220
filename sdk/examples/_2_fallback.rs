//! Example 2: a fallback hook that prefers local targets and cheap ones.
//!
//! `order` gets every configured candidate with its capabilities, circuit state and
//! GPU health, and returns the names to try, in order. Names must come from the
//! candidates, at most once each; leaving a name out means "do not try it".

use outrigger_policy_sdk::{CircuitState, FallbackPolicy, FallbackRequest, GpuHealth};

/// Healthy local targets first, then the rest by input price; never open circuits.
pub struct LocalFirst;

impl FallbackPolicy for LocalFirst {
    fn order(request: FallbackRequest) -> Vec<String> {
        order(&request)
    }
}

/// The ordering as a plain function.
pub fn order(request: &FallbackRequest) -> Vec<String> {
    let mut usable: Vec<_> = request
        .candidates
        .iter()
        .filter(|c| c.circuit != CircuitState::Open)
        .filter(|c| !(c.local && c.gpu == GpuHealth::Unhealthy))
        .filter(|c| !request.needs_tools || c.supports_tools)
        .collect();
    // A stable sort keeps the configured order among equals.
    usable.sort_by_key(|c| (!c.local, c.cost_per_mtok_in));
    let mut names: Vec<String> = Vec::with_capacity(usable.len());
    for candidate in usable {
        if !names.contains(&candidate.name) {
            names.push(candidate.name.clone());
        }
    }
    names
}

outrigger_policy_sdk::export_fallback!(LocalFirst);
