//! The per-task budget ledger: every call reserves its estimate before it is sent
//! and settles on the usage the provider reports, so the budget a policy sees
//! includes what concurrent calls may still spend and a task cannot overshoot its
//! limit by sending many calls at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use outrigger_types::Usage;

#[derive(Debug)]
struct Account {
    committed: Usage,
    reserved: Usage,
    /// When the task was first seen, for its wall-clock budget.
    since: std::time::Instant,
}

impl Default for Account {
    fn default() -> Self {
        Self {
            committed: Usage::default(),
            reserved: Usage::default(),
            since: std::time::Instant::now(),
        }
    }
}

/// The most tasks the ledger keeps accounts for. A new task beyond it takes the place
/// of the task whose account was used longest ago and holds no reservation: an agent
/// that sends a fresh task id per request cannot grow the ledger without bound. The
/// task that lost its account starts its budget over if it comes back.
pub const MAX_ACCOUNTS: usize = 10_000;

#[derive(Debug)]
struct Kept {
    account: Arc<Mutex<Account>>,
    /// When the account was last looked up.
    used: std::time::Instant,
}

/// Usage per task. Each task's account has a lock of its own: a budget decision runs
/// a policy under it (so two calls of one task cannot both slip under the limit),
/// and a slow policy holds up only its own task's calls.
#[derive(Debug, Default)]
pub struct Ledger {
    accounts: Mutex<HashMap<String, Kept>>,
}

/// A provider's prices, in micro-dollars per million input and output tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Price {
    pub per_mtok_in: u64,
    pub per_mtok_out: u64,
}

impl Price {
    /// Micro-dollars for `tokens_in` and `tokens_out` tokens.
    pub fn cost(self, tokens_in: u64, tokens_out: u64) -> u64 {
        let micros = (u128::from(tokens_in) * u128::from(self.per_mtok_in)
            + u128::from(tokens_out) * u128::from(self.per_mtok_out))
            / 1_000_000;
        u64::try_from(micros).unwrap_or(u64::MAX)
    }

    /// `tokens_in` and `tokens_out` tokens of one call, at these prices.
    pub fn usage(self, tokens_in: u64, tokens_out: u64) -> Usage {
        Usage {
            tokens_in,
            tokens_out,
            cost_micros: self.cost(tokens_in, tokens_out),
            calls: 1,
            ..Usage::default()
        }
    }
}

/// A reservation; settle it with what was really used, or drop it to release it
/// (a call that never ran costs nothing).
#[derive(Debug)]
pub struct Reservation {
    /// Held, so the account is not given up while a call has a reservation on it.
    account: Arc<Mutex<Account>>,
    /// What was reserved, and is released when the reservation is settled.
    reserved: Usage,
    /// What an attempt is charged when its real usage is unknown: the reserved
    /// estimate, its cost at the prices of the provider the attempt went to.
    estimate: Usage,
    settled: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ledger {
    /// The task's account, if it has one.
    fn find(&self, task: &str) -> Option<Arc<Mutex<Account>>> {
        lock(&self.accounts).get(task).map(|k| k.account.clone())
    }

    /// The task's account, opened on first use (making room if the ledger is full).
    fn account(&self, task: &str) -> Arc<Mutex<Account>> {
        let now = std::time::Instant::now();
        let mut accounts = lock(&self.accounts);
        if let Some(kept) = accounts.get_mut(task) {
            kept.used = now;
            return kept.account.clone();
        }
        if accounts.len() >= MAX_ACCOUNTS {
            // Held by no call (no reservation, no decision under way).
            let idle = accounts
                .iter()
                .filter(|(_, k)| Arc::strong_count(&k.account) == 1)
                .min_by_key(|(_, k)| k.used)
                .map(|(task, _)| task.clone());
            if let Some(idle) = idle {
                accounts.remove(&idle);
            }
        }
        let account = Arc::new(Mutex::new(Account::default()));
        let kept = Kept {
            account: account.clone(),
            used: now,
        };
        accounts.insert(task.to_string(), kept);
        account
    }

    /// Opens `task`'s account with what it had spent before (a task loaded after a
    /// restart), and a wall-clock of `age`, unless it has an account already (whose
    /// usage is then the truth). Called as the data plane starts.
    pub fn seed(&self, task: &str, spent: &Usage, age: std::time::Duration) {
        if lock(&self.accounts).contains_key(task) {
            return;
        }
        let account = self.account(task);
        let mut acc = lock(&account);
        acc.committed = acc.committed.plus(spent);
        if let Some(since) = std::time::Instant::now().checked_sub(age) {
            acc.since = acc.since.min(since);
        }
    }

    /// Committed plus reserved usage of `task`.
    pub fn usage(&self, task: &str) -> Usage {
        self.find(task)
            .map(|acc| {
                let acc = lock(&acc);
                acc.committed.plus(&acc.reserved)
            })
            .unwrap_or_default()
    }

    /// How long the task has been known.
    pub fn wall_clock(&self, task: &str) -> std::time::Duration {
        self.find(task)
            .map(|acc| lock(&acc).since.elapsed())
            .unwrap_or_default()
    }

    /// What `task` has been charged, if it has an account (a budget decided one of
    /// its calls, or it was seeded).
    pub fn charged(&self, task: &str) -> Option<Usage> {
        self.find(task).map(|acc| lock(&acc).committed)
    }

    /// Usage that has really happened (without reservations).
    pub fn committed(&self, task: &str) -> Usage {
        self.find(task)
            .map(|acc| lock(&acc).committed)
            .unwrap_or_default()
    }

    /// Reserves `estimate` if `admit` (given the usage including all reservations)
    /// says so, atomically for the task: two of its calls deciding at once cannot
    /// both slip under the limit. Other tasks' calls do not wait for `admit`.
    pub fn reserve_if<T>(
        &self,
        task: &str,
        estimate: Usage,
        admit: impl FnOnce(&Usage) -> (bool, T),
    ) -> (Option<Reservation>, T) {
        self.reserve_with(task, |usage| {
            let (ok, value) = admit(usage);
            (ok.then_some(estimate), value)
        })
    }

    /// [`Ledger::reserve_if`], where `admit` also says what to reserve (a call it
    /// downgrades is reserved at the cheaper model's estimate), or `None` to refuse.
    pub fn reserve_with<T>(
        &self,
        task: &str,
        admit: impl FnOnce(&Usage) -> (Option<Usage>, T),
    ) -> (Option<Reservation>, T) {
        let account = self.account(task);
        let mut acc = lock(&account);
        let (estimate, value) = admit(&acc.committed.plus(&acc.reserved));
        let Some(estimate) = estimate else {
            return (None, value);
        };
        acc.reserved = acc.reserved.plus(&estimate);
        drop(acc);
        (
            Some(Reservation {
                account,
                reserved: estimate,
                estimate,
                settled: false,
            }),
            value,
        )
    }

    /// Takes one retry for `task` if it has used fewer than `max`, atomically: two of
    /// its calls retrying at once cannot both take the last one.
    pub fn try_take_retry(&self, task: &str, max: Option<u32>) -> bool {
        let acc = self.account(task);
        let mut acc = lock(&acc);
        let used = acc.committed.plus(&acc.reserved).retries;
        if max.is_some_and(|max| used >= max) {
            return false;
        }
        acc.committed.retries = acc.committed.retries.saturating_add(1);
        true
    }

    /// Gives back a retry taken with [`Ledger::try_take_retry`] that did not happen.
    pub fn give_back_retry(&self, task: &str) {
        let acc = self.account(task);
        let mut acc = lock(&acc);
        acc.committed.retries = acc.committed.retries.saturating_sub(1);
    }

    /// Adds usage that was not reserved.
    pub fn add(&self, task: &str, usage: &Usage) {
        let acc = self.account(task);
        let mut acc = lock(&acc);
        acc.committed = acc.committed.plus(usage);
    }
}

impl Reservation {
    /// Prices the estimate from now on at `price`: that of the provider the call's
    /// attempt went to, which a fallback may make other than the one it was
    /// reserved at.
    pub fn price_at(&mut self, price: Price) {
        self.estimate.cost_micros = price.cost(self.estimate.tokens_in, self.estimate.tokens_out);
    }

    /// Charges now, on top of this call's own cost, attempts that the provider
    /// generated for and the agent never received (each broke inside a tool call it
    /// had streamed and was retried): each costs the estimate's tokens, at the
    /// prices of the provider it went to, and is not a call of its own.
    pub fn charge_generated(&self, prices: &[Price]) {
        if prices.is_empty() {
            return;
        }
        let e = &self.estimate;
        let generated = prices.iter().fold(Usage::default(), |sum, price| {
            sum.plus(&Usage {
                tokens_in: e.tokens_in,
                tokens_out: e.tokens_out,
                cost_micros: price.cost(e.tokens_in, e.tokens_out),
                ..Usage::default()
            })
        });
        let mut acc = lock(&self.account);
        acc.committed = acc.committed.plus(&generated);
    }

    /// Charges the estimate itself (the real usage is unknown).
    pub fn settle_estimate(self) {
        let estimate = self.estimate;
        self.settle(&estimate);
    }

    /// Settles a call that did not complete: the provider bills what it generated,
    /// which an interrupted stream's reported usage (Anthropic's running count, or
    /// none at all) falls short of, so it costs at least the estimate.
    pub fn settle_at_least(self, reported: &Usage) {
        let e = self.estimate;
        let charged = Usage {
            tokens_in: reported.tokens_in.max(e.tokens_in),
            tokens_out: reported.tokens_out.max(e.tokens_out),
            cost_micros: reported.cost_micros.max(e.cost_micros),
            calls: reported.calls.max(e.calls),
            ..*reported
        };
        self.settle(&charged);
    }

    /// Replaces the estimate with what the call really used.
    pub fn settle(mut self, actual: &Usage) {
        self.settled = true;
        self.release(Some(actual));
    }

    fn release(&self, actual: Option<&Usage>) {
        let mut acc = lock(&self.account);
        acc.reserved = acc.reserved.minus(&self.reserved);
        if let Some(actual) = actual {
            acc.committed = acc.committed.plus(actual);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.release(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outrigger_types::Limits;

    #[test]
    fn concurrent_reservations_never_overshoot_the_limit() {
        let ledger = Arc::new(Ledger::default());
        let limits = Limits {
            tokens_total: Some(1_000),
            ..Limits::default()
        };
        let estimate = Usage {
            tokens_in: 100,
            tokens_out: 150,
            calls: 1,
            ..Usage::default()
        };
        let mut threads = Vec::new();
        for _ in 0..16 {
            let ledger = ledger.clone();
            threads.push(std::thread::spawn(move || {
                let (r, _) = ledger.reserve_if("t", estimate, |u| {
                    (limits.exceeded_by(&u.plus(&estimate)).is_none(), ())
                });
                r
            }));
        }
        let admitted: Vec<Reservation> = threads
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(
            admitted.len(),
            4,
            "4 × 250 = 1000 tokens fit, a fifth would not"
        );
        assert_eq!(ledger.usage("t").tokens_total(), 1_000);
        // Settling on less than the estimate frees room.
        for r in admitted {
            r.settle(&Usage {
                tokens_in: 100,
                tokens_out: 50,
                calls: 1,
                ..Usage::default()
            });
        }
        assert_eq!(ledger.usage("t").tokens_total(), 600);
        assert_eq!(ledger.committed("t").calls, 4);
    }

    /// A budget decision that takes its time holds up its own task's calls only.
    #[test]
    fn a_slow_decision_does_not_hold_up_other_tasks() {
        let ledger = Arc::new(Ledger::default());
        let (inside_tx, inside_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let slow = {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                ledger.reserve_if("slow", Usage::default(), |_| {
                    inside_tx.send(()).unwrap();
                    let _ = go_rx.recv_timeout(std::time::Duration::from_secs(10));
                    (true, ())
                })
            })
        };
        inside_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the slow decision started");
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let other = {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                let (r, ()) = ledger.reserve_if("other", Usage::default(), |_| (true, ()));
                ledger.add("slow-other", &Usage::default());
                done_tx.send(r.is_some()).unwrap();
            })
        };
        let admitted = done_rx.recv_timeout(std::time::Duration::from_secs(2));
        go_tx.send(()).unwrap();
        assert_eq!(
            admitted,
            Ok(true),
            "another task's call waited for the slow decision"
        );
        other.join().unwrap();
        assert!(slow.join().unwrap().0.is_some());
    }

    /// The ledger keeps at most `MAX_ACCOUNTS` tasks: a new one takes the place of
    /// the one used longest ago, never of one a call holds a reservation on.
    #[test]
    fn accounts_are_bounded_and_a_reserved_one_is_kept() {
        let ledger = Arc::new(Ledger::default());
        let spent = Usage {
            tokens_in: 10,
            calls: 1,
            ..Usage::default()
        };
        let (held, ()) = ledger.reserve_if("held", spent, |_| (true, ()));
        let held = held.expect("admitted");
        ledger.add("old", &spent);
        for i in 0..MAX_ACCOUNTS + 50 {
            ledger.add(&format!("task-{i}"), &spent);
        }
        assert_eq!(lock(&ledger.accounts).len(), MAX_ACCOUNTS);
        assert_eq!(
            ledger.usage("held").tokens_in,
            10,
            "the reserved account stays"
        );
        assert_eq!(ledger.committed("old").calls, 0, "the oldest went first");
        held.settle(&spent);
        assert_eq!(ledger.committed("held").tokens_in, 10);
        assert_eq!(
            ledger
                .committed(&format!("task-{}", MAX_ACCOUNTS + 49))
                .calls,
            1
        );
    }

    #[test]
    fn an_incomplete_call_costs_at_least_its_estimate() {
        let ledger = Arc::new(Ledger::default());
        let estimate = Usage {
            tokens_in: 100,
            tokens_out: 400,
            cost_micros: 50,
            calls: 1,
            ..Usage::default()
        };
        let reserve = || ledger.reserve_if("t", estimate, |_| (true, ())).0.unwrap();
        // A placeholder count (Anthropic's `message_start`) charges the estimate.
        reserve().settle_at_least(&Usage {
            tokens_in: 120,
            tokens_out: 1,
            cost_micros: 10,
            calls: 1,
            ..Usage::default()
        });
        let after_one = ledger.committed("t");
        assert_eq!(
            (
                after_one.tokens_in,
                after_one.tokens_out,
                after_one.cost_micros
            ),
            (120, 400, 50)
        );
        // A count past the estimate is charged as reported.
        reserve().settle_at_least(&Usage {
            tokens_in: 100,
            tokens_out: 900,
            cost_micros: 90,
            calls: 1,
            ..Usage::default()
        });
        let after_two = ledger.committed("t");
        assert_eq!(
            (after_two.tokens_out, after_two.cost_micros, after_two.calls),
            (1_300, 140, 2)
        );
        assert_eq!(
            ledger.usage("t"),
            ledger.committed("t"),
            "nothing left reserved"
        );
    }

    #[test]
    fn a_dropped_reservation_costs_nothing() {
        let ledger = Arc::new(Ledger::default());
        let (r, ()) = ledger.reserve_if(
            "t",
            Usage {
                tokens_in: 10,
                ..Usage::default()
            },
            |_| (true, ()),
        );
        assert_eq!(ledger.usage("t").tokens_in, 10);
        drop(r);
        assert_eq!(ledger.usage("t"), Usage::default());
    }
}
