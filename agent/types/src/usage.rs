//! Budget arithmetic: what a task has used and what it may use.

use serde::{Deserialize, Serialize};

/// What a task has used so far (or what one call is estimated to use).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub tokens_in: u64,
    pub tokens_out: u64,
    /// Cost in micro-dollars.
    pub cost_micros: u64,
    pub wall_clock_ms: u64,
    pub calls: u32,
    pub retries: u32,
}

impl Usage {
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

    /// Subtracts `other` (saturating at zero); wall-clock is kept.
    pub fn minus(&self, other: &Usage) -> Usage {
        Usage {
            tokens_in: self.tokens_in.saturating_sub(other.tokens_in),
            tokens_out: self.tokens_out.saturating_sub(other.tokens_out),
            cost_micros: self.cost_micros.saturating_sub(other.cost_micros),
            wall_clock_ms: self.wall_clock_ms,
            calls: self.calls.saturating_sub(other.calls),
            retries: self.retries.saturating_sub(other.retries),
        }
    }
}

/// A task's limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub tokens_total: Option<u64>,
    pub cost_micros: Option<u64>,
    pub wall_clock_ms: Option<u64>,
    pub calls: Option<u32>,
    pub retries: Option<u32>,
}

impl Limits {
    pub fn is_unlimited(&self) -> bool {
        *self == Limits::default()
    }

    /// The name of the first limit `usage` exceeds, if any.
    pub fn exceeded_by(&self, usage: &Usage) -> Option<&'static str> {
        let over = |limit: Option<u64>, used: u64| limit.is_some_and(|l| used > l);
        if over(self.tokens_in, usage.tokens_in) {
            Some("tokens_in")
        } else if over(self.tokens_out, usage.tokens_out) {
            Some("tokens_out")
        } else if over(self.tokens_total, usage.tokens_total()) {
            Some("tokens_total")
        } else if over(self.cost_micros, usage.cost_micros) {
            Some("cost")
        } else if over(self.wall_clock_ms, usage.wall_clock_ms) {
            Some("wall_clock")
        } else if over(self.calls.map(u64::from), u64::from(usage.calls)) {
            Some("calls")
        } else if over(self.retries.map(u64::from), u64::from(usage.retries)) {
            Some("retries")
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exceeded_names_the_limit() {
        let limits = Limits {
            tokens_total: Some(100),
            ..Limits::default()
        };
        let mut u = Usage {
            tokens_in: 60,
            tokens_out: 40,
            ..Usage::default()
        };
        assert_eq!(limits.exceeded_by(&u), None);
        u.tokens_out = 41;
        assert_eq!(limits.exceeded_by(&u), Some("tokens_total"));
    }

    #[test]
    fn plus_minus_round_trip() {
        let a = Usage {
            tokens_in: 5,
            calls: 1,
            ..Usage::default()
        };
        let b = Usage {
            tokens_in: 7,
            calls: 2,
            ..Usage::default()
        };
        assert_eq!(a.plus(&b).minus(&b), a);
    }
}
