//! The built-in fallback policy: the configured chain, filtered by capability and
//! health.
//!
//! A candidate is dropped when it cannot serve the request (tools needed but not
//! supported, streaming needed but not supported, a known context window smaller than
//! the known prompt estimate, a modality it does not accept), when its circuit is
//! open, or when it is served by this node's GPUs and they are unhealthy. The rest
//! keep the configured order, except that half-open circuits (still being probed) go
//! after closed ones. The result (indices into the candidates) never names a
//! candidate twice, nor two candidates of the same name, so a misconfigured
//! duplicate cannot make the host try a target twice. [`order`] is a pure function
//! so it is unit-tested natively.

use outrigger_policy_sdk::{Candidate, CircuitState, FallbackPolicy, FallbackRequest, GpuHealth};

// Decisions allocate a few small blocks each; recycle them (see the SDK's `alloc`).
#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: outrigger_policy_sdk::alloc::SmallBlockCache =
    outrigger_policy_sdk::alloc::SmallBlockCache::new();

/// The built-in fallback policy.
pub struct BuiltinFallback;

impl FallbackPolicy for BuiltinFallback {
    fn order(request: FallbackRequest) -> Vec<u32> {
        order(&request)
    }
}

outrigger_policy_sdk::export_fallback!(BuiltinFallback);

/// The candidates to try, in order, as indices into `request.candidates`.
pub fn order(request: &FallbackRequest) -> Vec<u32> {
    let candidates = &request.candidates;
    let usable = |circuit: CircuitState| {
        candidates.iter().enumerate().filter(move |(_, c)| {
            c.circuit == circuit
                && can_serve(request, c)
                && !(c.local && c.gpu == GpuHealth::Unhealthy)
        })
    };
    let mut order: Vec<u32> = Vec::with_capacity(candidates.len());
    for (i, candidate) in usable(CircuitState::Closed).chain(usable(CircuitState::HalfOpen)) {
        let named_before = order.iter().any(|&j| {
            candidates
                .get(j as usize)
                .is_some_and(|c| c.name == candidate.name)
        });
        if let (false, Ok(i)) = (named_before, u32::try_from(i)) {
            order.push(i);
        }
    }
    order
}

/// Whether `candidate` has what `request` needs. Unknowns (a context window or a
/// prompt estimate of 0, an empty modality set) do not disqualify.
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
    candidate.modalities.is_empty() || candidate.modalities.contains(request.modalities)
}

#[cfg(test)]
mod tests {
    use super::*;
    use outrigger_policy_sdk::Modalities;

    /// The names of the candidates `order` picks, in its order.
    fn names(request: &FallbackRequest) -> Vec<&str> {
        order(request)
            .into_iter()
            .map(|i| {
                request.candidates[usize::try_from(i).unwrap()]
                    .name
                    .as_str()
            })
            .collect()
    }

    fn candidate(name: &str) -> Candidate {
        Candidate {
            name: name.into(),
            supports_tools: true,
            supports_streaming: true,
            context_window: 0,
            modalities: Modalities::empty(),
            circuit: CircuitState::Closed,
            local: false,
            gpu: GpuHealth::NotApplicable,
            cost_per_mtok_in: 0,
            cost_per_mtok_out: 0,
        }
    }

    fn request(candidates: Vec<Candidate>) -> FallbackRequest {
        FallbackRequest {
            model: "m".into(),
            needs_tools: false,
            streaming: false,
            estimated_tokens: 0,
            modalities: Modalities::TEXT,
            candidates,
        }
    }

    #[test]
    fn keeps_configured_order_when_all_fit() {
        let r = request(vec![candidate("a"), candidate("b"), candidate("c")]);
        assert_eq!(names(&r), ["a", "b", "c"]);
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
            modalities: Modalities::TEXT,
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
            names(&plain),
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
        assert!(!names(&tools).contains(&"no-tools"));

        let stream = FallbackRequest {
            streaming: true,
            ..request(all.clone())
        };
        assert!(!names(&stream).contains(&"no-stream"));

        let long = FallbackRequest {
            estimated_tokens: 8_001,
            ..request(all.clone())
        };
        assert!(!names(&long).contains(&"small"));
        let fits = FallbackRequest {
            estimated_tokens: 8_000,
            ..request(all.clone())
        };
        assert!(names(&fits).contains(&"small"));

        let image = FallbackRequest {
            modalities: Modalities::TEXT | Modalities::IMAGE,
            ..request(all)
        };
        assert!(!names(&image).contains(&"text-only"));
    }

    #[test]
    fn never_names_a_candidate_twice() {
        let r = request(vec![candidate("a"), candidate("a"), candidate("b")]);
        assert_eq!(names(&r), ["a", "b"]);
    }

    #[test]
    fn empty_in_empty_out() {
        assert!(names(&request(Vec::new())).is_empty());
    }
}
