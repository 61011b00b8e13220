//! Example 2: a fallback hook that prefers local targets and cheap ones.
//!
//! `order` gets every configured candidate with its capabilities, circuit state and
//! GPU health, and returns the candidates to try, in order, as indices into
//! `request.candidates`, at most once each; leaving one out means "do not try it".

use outrigger_policy_sdk::{Candidate, CircuitState, FallbackPolicy, FallbackRequest, GpuHealth};

/// Healthy local targets first, then the rest by input price; never open circuits.
pub struct LocalFirst;

impl FallbackPolicy for LocalFirst {
    fn order(request: FallbackRequest) -> Vec<u32> {
        order(&request)
    }
}

/// The ordering as a plain function.
pub fn order(request: &FallbackRequest) -> Vec<u32> {
    let mut usable: Vec<(u32, &Candidate)> = (0..)
        .zip(&request.candidates)
        .filter(|(_, c)| c.circuit != CircuitState::Open)
        .filter(|(_, c)| !(c.local && c.gpu == GpuHealth::Unhealthy))
        .filter(|(_, c)| !request.needs_tools || c.supports_tools)
        .collect();
    // A stable sort keeps the configured order among equals.
    usable.sort_by_key(|(_, c)| (!c.local, c.cost_per_mtok_in));
    usable.into_iter().map(|(i, _)| i).collect()
}

outrigger_policy_sdk::export_fallback!(LocalFirst);
