//! The built-in budget policy: per-task limits on tokens, cost, wall-clock, calls and
//! retries, with a downgrade before the hard stop.
//!
//! The call's estimate is added to the task's usage (which already includes calls in
//! flight). If the projection would pass a limit, the call is rejected and the reason
//! names the limit — unless the limit is cost and the cheapest offered model keeps the
//! projection within it, in which case the call is downgraded. If the projection passes
//! `downgrade_at` (a share, default 0.8) of any limit, the call is downgraded to the
//! cheapest offered model; otherwise it is admitted as asked.
//!
//! "Cheapest" is [`cheapest`]: the offered model on which this call's estimate costs
//! least, and only when that is less than it costs as asked. The host offers the same
//! configured list for every call, so it may hold models that cost more than the one
//! asked for (a call to a free local model, say): moving a call there would spend more
//! of the budget it is meant to save, so such a call is admitted as asked (or rejected)
//! instead. A downgrade always names a model from the request's list. [`admit`] is a
//! pure function so it is unit-tested natively.
//!
//! Parameters: `downgrade_at` (0.8).

use std::sync::OnceLock;

use outrigger_policy_sdk::{
    BudgetDecision, BudgetPolicy, BudgetRequest, DowngradeOption, Usage, host,
};

// Decisions allocate a few small blocks each; recycle them (see the SDK's `alloc`).
#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: outrigger_policy_sdk::alloc::SmallBlockCache =
    outrigger_policy_sdk::alloc::SmallBlockCache::new();

/// The policy's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Share of a limit beyond which calls are downgraded (0.0–1.0).
    pub downgrade_at: f64,
}

impl Default for Params {
    fn default() -> Self {
        Self { downgrade_at: 0.8 }
    }
}

/// The built-in budget policy.
pub struct BuiltinBudget;

impl BudgetPolicy for BuiltinBudget {
    fn admit(request: BudgetRequest) -> BudgetDecision {
        // Parameters are fixed for an instance's life: read them once.
        static PARAMS: OnceLock<Params> = OnceLock::new();
        let params = PARAMS.get_or_init(|| Params {
            downgrade_at: host::param_or("downgrade_at", Params::default().downgrade_at),
        });
        admit(params, &request)
    }
}

outrigger_policy_sdk::export_budget!(BuiltinBudget);

/// Decides for one call.
pub fn admit(params: &Params, request: &BudgetRequest) -> BudgetDecision {
    let projected = request.usage.plus(&Usage {
        tokens_in: request.estimated_tokens_in,
        tokens_out: request.estimated_tokens_out,
        cost_micros: request.estimated_cost_micros,
        wall_clock_ms: 0,
        calls: 1,
        retries: 0,
    });
    let cheapest = cheapest(request);

    if let Some((limit, used, max)) = request.limits.exceeded_by(&projected) {
        let rescued = limit == "cost"
            && cheapest.is_some_and(|(_, cost)| {
                request
                    .limits
                    .exceeded_by(&Usage {
                        cost_micros: request.usage.cost_micros.saturating_add(cost),
                        ..projected
                    })
                    .is_none()
            });
        return match cheapest {
            Some((option, _)) if rescued => BudgetDecision::downgrade(option.model.clone()),
            _ => BudgetDecision::reject(format!(
                "{limit} limit reached: this call would bring the task to {used} of {max}"
            )),
        };
    }

    let share = params.downgrade_at.clamp(0.0, 1.0);
    let near_limit = request
        .limits
        .checks(&projected)
        .into_iter()
        .any(|(_, used, max)| used as f64 > share * max as f64);
    match cheapest {
        Some((option, _)) if near_limit => BudgetDecision::downgrade(option.model.clone()),
        _ => BudgetDecision::Admit,
    }
}

/// The offered model (not the one asked for) on which this call's estimate costs
/// least, with that cost, when it is less than the call costs as asked. A tie goes to
/// the lower price (input and output price added), then to the first listed. A call
/// asked at no cost has nothing cheaper.
pub fn cheapest(request: &BudgetRequest) -> Option<(&DowngradeOption, u64)> {
    request
        .downgrades
        .iter()
        .filter(|option| option.model != request.model)
        .map(|option| (option, estimated_cost(request, option)))
        .filter(|(_, cost)| *cost < request.estimated_cost_micros)
        .min_by_key(|(option, cost)| {
            let price = option
                .cost_per_mtok_in
                .saturating_add(option.cost_per_mtok_out);
            (*cost, price)
        })
}

/// The estimated cost of `request` on `option`, in micro-dollars.
fn estimated_cost(request: &BudgetRequest, option: &DowngradeOption) -> u64 {
    let micros = |tokens: u64, per_mtok: u64| {
        u64::try_from(u128::from(tokens) * u128::from(per_mtok) / 1_000_000).unwrap_or(u64::MAX)
    };
    micros(request.estimated_tokens_in, option.cost_per_mtok_in).saturating_add(micros(
        request.estimated_tokens_out,
        option.cost_per_mtok_out,
    ))
}

#[cfg(test)]
mod tests {
    use outrigger_policy_sdk::Limits;

    use super::*;

    fn no_limits() -> Limits {
        Limits {
            tokens_in: None,
            tokens_out: None,
            tokens_total: None,
            cost_micros: None,
            wall_clock_ms: None,
            calls: None,
            retries: None,
        }
    }

    fn usage(tokens_in: u64, cost_micros: u64, calls: u32) -> Usage {
        Usage {
            tokens_in,
            tokens_out: 0,
            cost_micros,
            wall_clock_ms: 0,
            calls,
            retries: 0,
        }
    }

    fn option(model: &str, price: u64) -> DowngradeOption {
        DowngradeOption {
            model: model.into(),
            cost_per_mtok_in: price,
            cost_per_mtok_out: price,
        }
    }

    fn request(
        limits: Limits,
        used: Usage,
        estimated_in: u64,
        estimated_cost: u64,
    ) -> BudgetRequest {
        BudgetRequest {
            model: "big".into(),
            estimated_tokens_in: estimated_in,
            estimated_tokens_out: 0,
            estimated_cost_micros: estimated_cost,
            usage: used,
            limits,
            downgrades: vec![option("medium", 5_000_000), option("small", 1_000_000)],
        }
    }

    #[test]
    fn table() {
        let p = Params::default();
        let tokens = Limits {
            tokens_total: Some(1_000),
            ..no_limits()
        };
        let cost = Limits {
            cost_micros: Some(1_000),
            ..no_limits()
        };
        let calls = Limits {
            calls: Some(3),
            ..no_limits()
        };
        let cases = [
            (
                "unlimited",
                request(no_limits(), usage(10_000, 10_000, 100), 500, 500),
                BudgetDecision::Admit,
            ),
            (
                "well within",
                request(tokens, usage(100, 0, 0), 100, 0),
                BudgetDecision::Admit,
            ),
            (
                "at the share",
                request(tokens, usage(700, 0, 0), 100, 0),
                BudgetDecision::Admit,
            ),
            (
                "past the share",
                request(tokens, usage(700, 0, 0), 101, 1_010),
                BudgetDecision::Downgrade("small".into()),
            ),
            (
                "at the limit",
                request(tokens, usage(900, 0, 0), 100, 1_000),
                BudgetDecision::Downgrade("small".into()),
            ),
            (
                "past the token limit",
                request(tokens, usage(900, 0, 0), 101, 0),
                BudgetDecision::Reject(
                    "tokens_total limit reached: this call would bring the task to 1001 of 1000"
                        .into(),
                ),
            ),
            // 1000 tokens on `small` cost 1000 micros: within the cost limit.
            (
                "cost rescued by downgrade",
                request(cost, usage(0, 0, 0), 1_000, 1_500),
                BudgetDecision::Downgrade("small".into()),
            ),
            (
                "cost not rescued",
                request(cost, usage(0, 900, 0), 1_000, 1_500),
                BudgetDecision::Reject(
                    "cost limit reached: this call would bring the task to 2400 of 1000".into(),
                ),
            ),
            (
                "calls",
                request(calls, usage(0, 0, 3), 1, 0),
                BudgetDecision::Reject(
                    "calls limit reached: this call would bring the task to 4 of 3".into(),
                ),
            ),
        ];
        for (name, r, want) in cases {
            assert_eq!(admit(&p, &r), want, "{name}");
        }
    }

    #[test]
    fn zero_limits_reject_and_name_the_limit() {
        let r = request(
            Limits {
                calls: Some(0),
                ..no_limits()
            },
            usage(0, 0, 0),
            0,
            0,
        );
        assert!(
            matches!(admit(&Params::default(), &r), BudgetDecision::Reject(reason) if reason.starts_with("calls"))
        );
    }

    #[test]
    fn no_downgrade_without_options_or_to_the_same_model() {
        let p = Params::default();
        let tokens = Limits {
            tokens_total: Some(1_000),
            ..no_limits()
        };
        let mut r = request(tokens, usage(850, 0, 0), 100, 1_000);
        r.downgrades.clear();
        assert_eq!(admit(&p, &r), BudgetDecision::Admit);
        r.downgrades = vec![option("big", 1)];
        assert_eq!(admit(&p, &r), BudgetDecision::Admit);
    }

    /// The host offers every configured downgrade model for every call, pricier ones
    /// included: a call that fits as asked must not be moved to one of them.
    #[test]
    fn a_model_that_costs_more_is_no_downgrade() {
        let p = Params::default();
        let cost = Limits {
            cost_micros: Some(1_000),
            ..no_limits()
        };
        let mini = DowngradeOption {
            model: "gpt-4o-mini".into(),
            cost_per_mtok_in: 150_000,
            cost_per_mtok_out: 600_000,
        };
        // A free local model at 90 % of the cost limit: the call as asked costs
        // nothing, so it is admitted as asked.
        let local = BudgetRequest {
            model: "local-llama".into(),
            estimated_tokens_in: 1_000,
            estimated_tokens_out: 500,
            estimated_cost_micros: 0,
            usage: usage(0, 900, 0),
            limits: cost,
            downgrades: vec![mini],
        };
        assert_eq!(admit(&p, &local), BudgetDecision::Admit);
        // A paid model near the limit, only pricier ones on offer: admitted as asked.
        let paid = BudgetRequest {
            model: "mid".into(),
            estimated_cost_micros: 100,
            usage: usage(0, 800, 0),
            ..local.clone()
        };
        assert_eq!(admit(&p, &paid), BudgetDecision::Admit);
        // Past the limit, a pricier model rescues nothing: rejected, the limit named.
        let over = BudgetRequest {
            usage: usage(0, 950, 0),
            ..paid
        };
        assert_eq!(
            admit(&p, &over),
            BudgetDecision::Reject(
                "cost limit reached: this call would bring the task to 1050 of 1000".into()
            )
        );
    }

    #[test]
    fn cheapest_is_cheapest_for_this_call_and_cheaper_than_asked() {
        let priced = |model: &str, per_mtok_in: u64, per_mtok_out: u64| DowngradeOption {
            model: model.into(),
            cost_per_mtok_in: per_mtok_in,
            cost_per_mtok_out: per_mtok_out,
        };
        // 1,000 prompt tokens and no completion: `a` costs 1,000 micros, `b` 5,000,
        // though `b` has the lower price for input and output together.
        let mut r = request(no_limits(), usage(0, 0, 0), 1_000, 10_000);
        r.downgrades = vec![
            priced("b", 5_000_000, 1_000_000),
            priced("a", 1_000_000, 10_000_000),
            priced("a2", 1_000_000, 10_000_000),
        ];
        let pick = |r: &BudgetRequest| cheapest(r).map(|(o, cost)| (o.model.clone(), cost));
        // `a` and `a2` tie: the first listed wins.
        assert_eq!(pick(&r), Some(("a".to_string(), 1_000)));
        // The same cost for this call: the lower price wins.
        r.downgrades.push(priced("c", 1_000_000, 1_000_000));
        assert_eq!(pick(&r), Some(("c".to_string(), 1_000)));
        // Nothing costs less than 1,000 micros: nothing is cheaper.
        r.estimated_cost_micros = 1_000;
        assert_eq!(pick(&r), None);
        r.estimated_cost_micros = 0;
        assert_eq!(pick(&r), None);
        r.downgrades.clear();
        assert_eq!(pick(&r), None);
    }
}
