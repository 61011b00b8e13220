//! The built-in fallback policy: the configured chain, filtered by capability and
//! health.
//!
//! A candidate is dropped when it cannot serve the request (tools needed but not
//! supported, streaming needed but not supported, a known context window smaller than
//! the known prompt estimate, a modality it does not accept), when its circuit is
//! open, or when it is served by this node's GPUs and they are unhealthy. The rest
//! keep the configured order, except that half-open circuits (still being probed) go
//! after closed ones. The result never names a candidate twice, so a misconfigured
//! duplicate cannot make the host try a target twice. [`order`] is a pure function so
//! it is unit-tested natively.

use outrigger_policy_sdk::{Candidate, CircuitState, FallbackPolicy, FallbackRequest, GpuHealth};

/// The built-in fallback policy.
pub struct BuiltinFallback;

impl FallbackPolicy for BuiltinFallback {
    fn order(request: FallbackRequest) -> Vec<String> {
        order(&request)
    }
}

outrigger_policy_sdk::export_fallback!(BuiltinFallback);

/// The candidates to try, in order.
pub fn order(request: &FallbackRequest) -> Vec<String> {
    let usable: Vec<&Candidate> = request
        .candidates
        .iter()
        .filter(|c| can_serve(request, c))
        .filter(|c| c.circuit != CircuitState::Open)
        .filter(|c| !(c.local && c.gpu == GpuHealth::Unhealthy))
        .collect();
    let closed = usable.iter().filter(|c| c.circuit == CircuitState::Closed);
    let half_open = usable
        .iter()
        .filter(|c| c.circuit == CircuitState::HalfOpen);
    let mut names: Vec<String> = Vec::with_capacity(usable.len());
    for candidate in closed.chain(half_open) {
        if !names.contains(&candidate.name) {
            names.push(candidate.name.clone());
        }
    }
    names
}

/// Whether `candidate` has what `request` needs. Unknowns (a context window or a
/// prompt estimate of 0, an empty modality list) do not disqualify.
pub fn can_serve(request: &FallbackRequest, candidate: &Candidate) -> bool {
    if request.needs_tools && !candidate.supports_tools {
        return false;
    }
    if request.streaming && !candidate.supports_streaming {
        return false;
    }
    if request.estimated_tokens > 0
        && candidate.context_window > 0
        && request.estimated_tokens > candidate.context_window
    {
        return false;
    }
    candidate.modalities.is_empty()
        || request
            .modalities
            .iter()
            .all(|m| candidate.modalities.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str) -> Candidate {
        Candidate {
            name: name.into(),
            provider: "p".into(),
            model: "m".into(),
            supports_tools: true,
            supports_streaming: true,
            context_window: 0,
            modalities: Vec::new(),
            circuit: CircuitState::Closed,
            local: false,
            gpu: GpuHealth::NotApplicable,
            cost_per_mtok_in: 0,
            cost_per_mtok_out: 0,
        }
    }

    fn request(candidates: Vec<Candidate>) -> FallbackRequest {
        FallbackRequest {
            task_id: None,
            request_id: "r".into(),
            model: "m".into(),
            needs_tools: false,
            streaming: false,
            estimated_tokens: 0,
            modalities: Vec::new(),
            candidates,
        }
    }

    #[test]
    fn keeps_configured_order_when_all_fit() {
        let r = request(vec![candidate("a"), candidate("b"), candidate("c")]);
        assert_eq!(order(&r), ["a", "b", "c"]);
    }

    #[test]
    fn table() {
        let no_tools = Candidate {
            supports_tools: false,
            ..candidate("no-tools")
        };
        let no_stream = Candidate {
            supports_streaming: false,
            ..candidate("no-stream")
        };
        let small = Candidate {
            context_window: 8_000,
            ..candidate("small")
        };
        let open = Candidate {
            circuit: CircuitState::Open,
            ..candidate("open")
        };
        let half = Candidate {
            circuit: CircuitState::HalfOpen,
            ..candidate("half")
        };
        let sick_gpu = Candidate {
            local: true,
            gpu: GpuHealth::Unhealthy,
            ..candidate("sick-gpu")
        };
        let ok_gpu = Candidate {
            local: true,
            gpu: GpuHealth::Degraded,
            ..candidate("ok-gpu")
        };
        let text_only = Candidate {
            modalities: vec!["text".into()],
            ..candidate("text-only")
        };
        let all = vec![
            half.clone(),
            no_tools.clone(),
            no_stream.clone(),
            small.clone(),
            open.clone(),
            sick_gpu.clone(),
            ok_gpu.clone(),
            text_only.clone(),
        ];

        let plain = request(all.clone());
        assert_eq!(
            order(&plain),
            [
                "no-tools",
                "no-stream",
                "small",
                "ok-gpu",
                "text-only",
                "half"
            ],
            "open circuits and unhealthy local GPUs are skipped; half-open goes last"
        );

        let tools = FallbackRequest {
            needs_tools: true,
            ..request(all.clone())
        };
        assert!(!order(&tools).contains(&"no-tools".to_string()));

        let stream = FallbackRequest {
            streaming: true,
            ..request(all.clone())
        };
        assert!(!order(&stream).contains(&"no-stream".to_string()));

        let long = FallbackRequest {
            estimated_tokens: 8_001,
            ..request(all.clone())
        };
        assert!(!order(&long).contains(&"small".to_string()));
        let fits = FallbackRequest {
            estimated_tokens: 8_000,
            ..request(all.clone())
        };
        assert!(order(&fits).contains(&"small".to_string()));

        let image = FallbackRequest {
            modalities: vec!["image".into()],
            ..request(all)
        };
        assert!(!order(&image).contains(&"text-only".to_string()));
    }

    #[test]
    fn never_names_a_candidate_twice() {
        let r = request(vec![candidate("a"), candidate("a"), candidate("b")]);
        assert_eq!(order(&r), ["a", "b"]);
    }

    #[test]
    fn empty_in_empty_out() {
        assert!(order(&request(Vec::new())).is_empty());
    }
}
