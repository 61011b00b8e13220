//! Write Outrigger retry, fallback and budget policies in Rust, compiled to
//! WebAssembly components (`wasm32-wasip2`) that the sidecar loads and hot-swaps.
//!
//! A policy is a `cdylib` crate with one type per hook it implements, each exported
//! with a macro: [`export_retry!`], [`export_fallback!`], [`export_budget!`] (or
//! [`export_policy!`] for a type that implements all three). The component then
//! exports exactly those hooks; the sidecar detects which. The types are the WIT
//! package `outrigger:policy@0.1.0` (`wit/policy.wit`), generated once here and
//! shared by every hook; [`host`] wraps the only capabilities a policy has (log,
//! monotonic time, randomness, its own parameters, the ids of the call being
//! decided). There is no filesystem, network
//! or environment, and a policy runs under a deadline and a memory cap, so decide
//! quickly and allocate little.
//!
//! Keep the decision logic in plain functions that take their parameters and random
//! draws as arguments: they then run in native unit tests (`cargo test`), where the
//! host imports do not exist, and the trait impl is a thin shell that reads
//! [`host::param`] and [`host::random`] and calls them.
//!
//! ```
//! use outrigger_policy_sdk::{CallContext, Failure, RetryDecision, RetryPolicy};
//!
//! struct FixedDelay;
//!
//! impl RetryPolicy for FixedDelay {
//!     fn decide(ctx: CallContext, failure: Failure) -> RetryDecision {
//!         match failure {
//!             Failure::ContentFiltered | Failure::ToolParseError => {
//!                 RetryDecision::give_up("not retryable")
//!             }
//!             _ if ctx.attempt >= 3 => RetryDecision::give_up("three attempts"),
//!             _ => RetryDecision::retry_after(std::time::Duration::from_millis(250)),
//!         }
//!     }
//! }
//!
//! outrigger_policy_sdk::export_retry!(FixedDelay);
//! # fn main() {}
//! ```
//!
//! The numbered examples in `sdk/examples/` walk through a minimal retry policy,
//! parameters and logging, a fallback policy and a component with all three hooks.
#![deny(missing_docs)]

use std::time::Duration;

mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "imports",
        additional_derives: [PartialEq, Eq],
    });
}

pub use bindings::outrigger::policy::types::{
    Attempt, BudgetDecision, BudgetRequest, CallContext, CallKind, Candidate, CircuitState,
    DowngradeOption, Failure, FallbackRequest, GpuHealth, Limits, Modalities, RetryBudget,
    RetryDecision, StreamInterruption, ToolClass, Usage,
};

pub mod alloc;

include!(concat!(env!("OUT_DIR"), "/export_macros.rs"));

/// Not public API: what the export macros need from inside the caller's crate.
#[doc(hidden)]
pub mod __private {
    pub use crate::bindings::outrigger::policy::{host, types};
    pub use wit_bindgen;
}

/// A retry policy: what to do after an attempt of a call failed.
pub trait RetryPolicy {
    /// Decides after `failure` ended attempt `ctx.attempt` (1-based). The host checks
    /// the answer: a delay beyond its configured maximum, a fall-back target that is
    /// not in `ctx.fallbacks`, a retry while `ctx.retry_budget.available` is false, or
    /// a re-send of an `unsafe`/`probe` tool call that may have been dispatched is
    /// refused and counted as a policy failure.
    fn decide(ctx: CallContext, failure: Failure) -> RetryDecision;
}

/// A fallback policy: which candidate targets to try, in which order.
pub trait FallbackPolicy {
    /// Returns the candidates to try, best first, as indices into
    /// `request.candidates`, at most once each; candidates left out are not tried.
    fn order(request: FallbackRequest) -> Vec<u32>;
}

/// A budget policy: admit, reject or downgrade a call before it is sent.
pub trait BudgetPolicy {
    /// Decides for one call. A downgrade must name a model from `request.downgrades`.
    fn admit(request: BudgetRequest) -> BudgetDecision;
}

/// The host's capabilities: logging, monotonic time, randomness, the policy's
/// parameters from the sidecar's config and the ids of the call being decided.
///
/// These are WebAssembly imports: they exist only inside the sidecar (or the test
/// kit). Calling them from a native unit test panics, which is why decision logic
/// belongs in functions that take parameters and random draws as arguments.
pub mod host {
    use std::str::FromStr;
    use std::time::Duration;

    use crate::bindings::outrigger::policy::host as imports;

    pub use imports::Level;

    /// Writes a line to the sidecar's log, tagged with this policy's version. The
    /// host truncates long lines.
    pub fn log(level: Level, message: &str) {
        imports::log(level, message);
    }

    /// Logs at debug level.
    pub fn debug(message: &str) {
        log(Level::Debug, message);
    }

    /// Logs at info level.
    pub fn info(message: &str) {
        log(Level::Info, message);
    }

    /// Logs at warn level.
    pub fn warn(message: &str) {
        log(Level::Warn, message);
    }

    /// Logs at error level.
    pub fn error(message: &str) {
        log(Level::Error, message);
    }

    /// Monotonic time since an arbitrary origin; only differences are meaningful.
    pub fn now() -> Duration {
        Duration::from_nanos(imports::monotonic_now())
    }

    /// A random number, for jitter. Seeded by the host in tests, so a given input
    /// gets the same decision.
    pub fn random() -> u64 {
        imports::random()
    }

    /// A uniformly distributed number in `0..=max` (for full-jitter backoff).
    pub fn random_up_to(max: u64) -> u64 {
        crate::uniform_up_to(random(), max)
    }

    /// The policy's parameter `name` from the sidecar's config, as written there.
    pub fn param(name: &str) -> Option<String> {
        imports::param(name)
    }

    /// The agent's task id of the call being decided, when it sent one.
    pub fn task_id() -> Option<String> {
        imports::task_id()
    }

    /// The sidecar's id for the request being decided.
    pub fn request_id() -> String {
        imports::request_id()
    }

    /// The parameter `name` parsed as `T`, or `default` when it is absent. A value
    /// that does not parse is logged (warn) and `default` is used, so a typo in
    /// config degrades to the documented default rather than failing every call.
    pub fn param_or<T: FromStr>(name: &str, default: T) -> T {
        match param(name) {
            None => default,
            Some(raw) => match raw.trim().parse() {
                Ok(value) => value,
                Err(_) => {
                    warn(&format!(
                        "parameter {name}={raw:?} does not parse; using the default"
                    ));
                    default
                }
            },
        }
    }
}

/// Maps a random `u64` onto `0..=max` without the bias of a plain `%` where it
/// matters (the multiply-shift method; exact for `max == u64::MAX`).
pub fn uniform_up_to(random: u64, max: u64) -> u64 {
    match max.checked_add(1) {
        None => random,
        Some(span) => {
            let wide = u128::from(random) * u128::from(span);
            // The high half of a 128-bit product of two u64s always fits in a u64.
            u64::try_from(wide >> 64).unwrap_or(max)
        }
    }
}

impl Failure {
    /// Whether the failed attempt may have reached the upstream (and so may have had
    /// an effect there). Only a connection that failed before sending is known not to.
    pub fn may_have_dispatched(&self) -> bool {
        match self {
            Self::ConnectError(sent) => *sent,
            Self::RateLimited(_)
            | Self::ServerError(_)
            | Self::Timeout
            | Self::StreamInterrupted(_)
            | Self::ContextOverflow
            | Self::ContentFiltered
            | Self::ToolParseError => true,
        }
    }

    /// The upstream's `Retry-After`, when this is a rate limit that sent one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::RateLimited(Some(ms)) => Some(Duration::from_millis(*ms)),
            _ => None,
        }
    }

    /// A short stable name for the failure (`rate_limited`, `server_error`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::RateLimited(_) => "rate_limited",
            Self::ServerError(_) => "server_error",
            Self::Timeout => "timeout",
            Self::ConnectError(_) => "connect_error",
            Self::StreamInterrupted(_) => "stream_interrupted",
            Self::ContextOverflow => "context_overflow",
            Self::ContentFiltered => "content_filtered",
            Self::ToolParseError => "tool_parse_error",
        }
    }
}

impl ToolClass {
    /// Whether a call of this class may be sent again after it may already have
    /// reached the tool (`keyed` and `idempotent` may; `probe` and `unsafe` may not).
    pub fn resend_in_doubt(self) -> bool {
        match self {
            Self::Keyed | Self::Idempotent => true,
            Self::Probe | Self::Unsafe => false,
        }
    }
}

impl CallContext {
    /// Whether re-sending this call could repeat a side effect the host cannot
    /// deduplicate: a tool call of class `unsafe` or `probe` that may have been
    /// dispatched.
    pub fn resend_forbidden(&self, failure: &Failure) -> bool {
        let in_doubt = self.dispatched || failure.may_have_dispatched();
        self.kind == CallKind::Tool
            && in_doubt
            && self
                .tool_class
                .is_some_and(|class| !class.resend_in_doubt())
    }

    /// The 1-based number of the failed attempt on its own target: `attempt` less
    /// the attempts that went elsewhere before the call came to `target` (the
    /// history up to its trailing run on `target`). `attempt` counts every attempt
    /// of the call, so after a fall-back it is past the first attempt on the new
    /// target; bound retries and grow backoff with this number instead, so that a
    /// target fallen back to gets its own retries.
    pub fn attempt_on_target(&self) -> u32 {
        let on_target = self
            .history
            .iter()
            .rev()
            .take_while(|a| a.target == self.target)
            .count();
        let elsewhere = self.history.len() - on_target;
        self.attempt
            .saturating_sub(u32::try_from(elsewhere).unwrap_or(u32::MAX))
    }

    /// The first of `fallbacks` not tried yet by this call (neither the current
    /// target nor one in the history). The host passes only targets not tried yet;
    /// the check keeps hand-made contexts (tests, scenarios) honest too.
    pub fn next_fallback(&self) -> Option<&str> {
        self.fallbacks
            .iter()
            .map(String::as_str)
            .find(|name| *name != self.target && !self.history.iter().any(|a| a.target == *name))
    }
}

impl FallbackRequest {
    /// The index of the candidate called `name`, as [`FallbackPolicy::order`]
    /// returns it.
    pub fn index_of(&self, name: &str) -> Option<u32> {
        self.candidates
            .iter()
            .position(|c| c.name == name)
            .and_then(|i| u32::try_from(i).ok())
    }
}

impl RetryDecision {
    /// Retry the same target after `delay` (whole milliseconds, saturating).
    pub fn retry_after(delay: Duration) -> Self {
        Self::RetryAfter(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
    }

    /// Try `target` (a name from `ctx.fallbacks`) instead.
    pub fn fall_back(target: impl Into<String>) -> Self {
        Self::FallBack(target.into())
    }

    /// Stop, for `reason` (logged and journaled).
    pub fn give_up(reason: impl Into<String>) -> Self {
        Self::GiveUp(reason.into())
    }
}

impl BudgetDecision {
    /// Refuse the call, for `reason` (name the limit).
    pub fn reject(reason: impl Into<String>) -> Self {
        Self::Reject(reason.into())
    }

    /// Admit the call on `model` instead.
    pub fn downgrade(model: impl Into<String>) -> Self {
        Self::Downgrade(model.into())
    }
}

impl Usage {
    /// Prompt plus completion tokens (saturating).
    pub fn tokens_total(&self) -> u64 {
        self.tokens_in.saturating_add(self.tokens_out)
    }

    /// Adds `other` (saturating); wall-clock is not additive and is kept as the max.
    pub fn plus(&self, other: &Usage) -> Usage {
        Usage {
            tokens_in: self.tokens_in.saturating_add(other.tokens_in),
            tokens_out: self.tokens_out.saturating_add(other.tokens_out),
            cost_micros: self.cost_micros.saturating_add(other.cost_micros),
            wall_clock_ms: self.wall_clock_ms.max(other.wall_clock_ms),
            calls: self.calls.saturating_add(other.calls),
            retries: self.retries.saturating_add(other.retries),
        }
    }
}

/// One limit of a task, as `(name, used, limit)`; see [`Limits::checks`].
pub type LimitCheck = (&'static str, u64, u64);

impl Limits {
    /// Every limit that is set, paired with the matching figure of `usage`, in a
    /// fixed order: `tokens_in`, `tokens_out`, `tokens_total`, `cost`, `wall_clock`,
    /// `calls`, `retries`.
    pub fn checks(&self, usage: &Usage) -> Vec<LimitCheck> {
        let all = [
            ("tokens_in", usage.tokens_in, self.tokens_in),
            ("tokens_out", usage.tokens_out, self.tokens_out),
            ("tokens_total", usage.tokens_total(), self.tokens_total),
            ("cost", usage.cost_micros, self.cost_micros),
            ("wall_clock", usage.wall_clock_ms, self.wall_clock_ms),
            ("calls", u64::from(usage.calls), self.calls.map(u64::from)),
            (
                "retries",
                u64::from(usage.retries),
                self.retries.map(u64::from),
            ),
        ];
        all.into_iter()
            .filter_map(|(name, used, limit)| limit.map(|limit| (name, used, limit)))
            .collect()
    }

    /// The first limit `usage` exceeds (strictly), if any.
    pub fn exceeded_by(&self, usage: &Usage) -> Option<LimitCheck> {
        self.checks(usage)
            .into_iter()
            .find(|(_, used, limit)| used > limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> CallContext {
        CallContext {
            kind: CallKind::Tool,
            target: "a".into(),
            model: None,
            tool_class: Some(ToolClass::Unsafe),
            attempt: 1,
            elapsed_ms: 0,
            dispatched: false,
            history: vec![Attempt {
                target: "b".into(),
                failure: Failure::Timeout,
                elapsed_ms: 1,
            }],
            retry_budget: RetryBudget {
                available: true,
                retries_in_window: 0,
                requests_in_window: 0,
            },
            fallbacks: vec!["a".into(), "b".into(), "c".into()],
        }
    }

    #[test]
    fn uniform_stays_in_range() {
        for (random, max) in [
            (0, 0),
            (u64::MAX, 0),
            (u64::MAX, 9),
            (1 << 63, 9),
            (7, u64::MAX),
        ] {
            assert!(uniform_up_to(random, max) <= max, "{random} {max}");
        }
        assert_eq!(uniform_up_to(u64::MAX, 9), 9);
        assert_eq!(uniform_up_to(0, 9), 0);
    }

    #[test]
    fn unsafe_tool_is_not_resent_once_dispatched() {
        let c = ctx();
        assert!(!c.resend_forbidden(&Failure::ConnectError(false)));
        assert!(c.resend_forbidden(&Failure::ConnectError(true)));
        assert!(c.resend_forbidden(&Failure::ServerError(503)));
        let keyed = CallContext {
            tool_class: Some(ToolClass::Keyed),
            ..ctx()
        };
        assert!(!keyed.resend_forbidden(&Failure::ServerError(503)));
    }

    #[test]
    fn attempts_on_target_start_over_after_a_fall_back() {
        let failed = |target: &str| Attempt {
            target: target.into(),
            failure: Failure::RateLimited(None),
            elapsed_ms: 1,
        };
        let on = |target: &str, earlier: &[&str], attempt: u32| CallContext {
            target: target.into(),
            attempt,
            history: earlier.iter().map(|t| failed(t)).collect(),
            ..ctx()
        };
        let primary4 = ["primary"; 4];
        let cases = [
            ("first attempt", on("primary", &[], 1), 1),
            ("third on the primary", on("primary", &["primary"; 2], 3), 3),
            ("first on the backup", on("backup", &primary4, 5), 1),
            (
                "second on the backup",
                on("backup", &["primary", "primary", "backup"], 4),
                2,
            ),
            // An attempt number without the history to match (a hand-made context).
            ("no history", on("primary", &[], 4), 4),
            ("fewer attempts than history", on("backup", &primary4, 2), 0),
            ("saturated", on("primary", &[], u32::MAX), u32::MAX),
        ];
        for (name, c, want) in cases {
            assert_eq!(c.attempt_on_target(), want, "{name}");
        }
    }

    #[test]
    fn next_fallback_skips_tried_targets() {
        assert_eq!(ctx().next_fallback(), Some("c"));
        let none_left = CallContext {
            fallbacks: vec!["a".into(), "b".into()],
            ..ctx()
        };
        assert_eq!(none_left.next_fallback(), None);
    }

    #[test]
    fn limits_name_what_is_exceeded() {
        let limits = Limits {
            tokens_in: None,
            tokens_out: None,
            tokens_total: Some(100),
            cost_micros: Some(5),
            wall_clock_ms: None,
            calls: Some(0),
            retries: None,
        };
        let usage = Usage {
            tokens_in: 60,
            tokens_out: 41,
            cost_micros: 5,
            wall_clock_ms: 0,
            calls: 0,
            retries: 0,
        };
        assert_eq!(limits.exceeded_by(&usage), Some(("tokens_total", 101, 100)));
        assert_eq!(limits.checks(&usage).len(), 3);
    }

    #[test]
    fn decision_constructors_saturate() {
        assert_eq!(
            RetryDecision::retry_after(Duration::from_secs(2)),
            RetryDecision::RetryAfter(2000)
        );
        assert_eq!(
            RetryDecision::retry_after(Duration::MAX),
            RetryDecision::RetryAfter(u64::MAX)
        );
    }
}
