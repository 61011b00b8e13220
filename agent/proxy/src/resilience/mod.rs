//! The mechanics that policies steer: retry budgets, circuit breakers, the
//! token-aware concurrency limiter with its fair queue, and the per-task budget
//! ledger. None of these decide anything on their own; they count, gate and report,
//! and the decisions come through [`crate::decider::Decider`].

pub mod breaker;
pub mod ledger;
pub mod limiter;
pub mod retry_budget;

pub use breaker::{Breaker, Breakers};
pub use ledger::{Ledger, Price, Reservation};
pub use limiter::{Limiter, Limiters, Permit};
pub use retry_budget::RetryBudgets;
