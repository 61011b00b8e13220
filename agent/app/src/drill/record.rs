//! The drill record: the fields of a fault-drill record (detection, drain, in-flight
//! outcomes, recovery, consistency, error budget, negative checks), adapted to what
//! Outrigger can measure, and the one function that turns them into a verdict.
//!
//! Times are milliseconds since the scenario's t0 (a monotonic clock), which is the
//! moment the drill began the scenario's traffic on a ready sidecar.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;

/// How a scenario ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    Skipped,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Skipped => "skipped",
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Build {
    #[serde(rename = "service.version")]
    pub service_version: String,
    /// Hex SHA-256 of the JCS form of the config file text and the `OUTRIGGER_*`
    /// environment.
    #[serde(rename = "config.hash")]
    pub config_hash: String,
    pub config_source: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Fault {
    pub kind: String,
    /// What injected it: `sidecar:/v1/faults`, `drill:sigkill`, `nvml-stub`, …
    pub injector: String,
    pub params: Value,
}

/// Work in flight at the instant the fault was injected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Inflight {
    pub llm_streams: u32,
    pub llm_calls: u32,
    pub tool_calls: u32,
}

impl Inflight {
    pub fn total(&self) -> u32 {
        self.llm_streams + self.llm_calls + self.tool_calls
    }
}

/// What became of the in-flight work: every unit lands in exactly one bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct InflightOutcomes {
    /// Finished as if nothing happened.
    pub completed: u32,
    /// The agent got an error (typed, or a broken connection) and did not retry.
    pub failed_to_client: u32,
    /// The agent got an error, retried the same request, and it completed.
    pub retried_safely: u32,
    /// Retried against the restarted sidecar, and it completed.
    pub resumed_after_restart: u32,
    /// Left with an unknown outcome at the end of the drill.
    pub in_doubt: u32,
    /// Side effects that happened more than once (counted, not a bucket).
    pub duplicated_effects: u32,
}

impl InflightOutcomes {
    pub fn accounted(&self) -> u32 {
        self.completed
            + self.failed_to_client
            + self.retried_safely
            + self.resumed_after_restart
            + self.in_doubt
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Derived {
    pub detection_time_s: Option<f64>,
    pub drain_time_s: Option<f64>,
    pub recovery_time_s: Option<f64>,
}

/// Tokens as the task reports (the sidecar's books), `/metrics` and the provider's
/// `usage` (as the agent saw it) count them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Metering {
    /// Sum of `tokens_in + tokens_out` over the drill's task reports.
    pub tokens_tasks: u64,
    /// Provider `usage` on the task calls that were generated (not replayed).
    pub tokens_provider_in_tasks: u64,
    /// The increase of `gen_ai_client_token_usage_sum` over the scenario.
    pub tokens_metrics: Option<u64>,
    /// Provider `usage` on every generated call the agent saw.
    pub tokens_provider: u64,
    /// Calls that ended without a usage report (interrupted, failed, refused).
    pub incomplete_requests: u64,
}

/// Exactly-once bookkeeping of the drill's tool calls (see `ledger`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Consistency {
    /// Journal records of the drill's tasks.
    pub journal_entries: u64,
    /// Keys whose effect the tool itself reports (`None`: it cannot say).
    pub effects_observed: Option<u64>,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    /// Keys first answered "unknown" and later shown to have taken effect once.
    pub recovered: u64,
    /// Keys still unresolved at the end.
    pub in_doubt: u64,
    pub metering: Metering,
    /// The same, per tool class.
    pub by_class: BTreeMap<String, ClassTally>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClassTally {
    pub keys: u64,
    pub effects: u64,
    pub duplicated: u64,
    pub lost: u64,
    pub recovered: u64,
    pub in_doubt: u64,
    /// Journal states the keys ended in.
    pub final_states: BTreeMap<String, u64>,
}

/// One SLO's budget over the scenario.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SloBudget {
    pub slo: String,
    pub bad_events: u64,
    pub eligible_events: u64,
    /// bad / ((1 − target) × eligible): 1.0 is the whole budget of this traffic.
    pub budget_fraction_burned: f64,
    pub by_cause: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ErrorBudget {
    pub slos: Vec<SloBudget>,
    /// The causes this fault may legitimately be charged to.
    pub expected_causes: Vec<String>,
}

/// A signal an operator relies on (readiness, an alert metric): did it react?
#[derive(Debug, Clone, Serialize)]
pub struct SignalCheck {
    pub signal: String,
    pub expected: bool,
    pub observed: bool,
    pub at_ms: Option<u64>,
    /// A mismatch fails the scenario (otherwise it is a warning).
    pub required: bool,
}

/// Time limits a scenario holds the sidecar to.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Limits {
    pub max_detection_ms: Option<u64>,
    pub max_recovery_ms: Option<u64>,
}

/// One scenario's record (`<out>/<scenario>.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub drill_id: String,
    pub scenario: String,
    pub started_at: String,
    pub build: Build,
    pub fault: Fault,
    pub t_fault_injected_ms: Option<u64>,
    pub t_detected_ms: Option<u64>,
    pub detection_source: Option<String>,
    pub t_drain_started_ms: Option<u64>,
    pub t_drain_completed_ms: Option<u64>,
    pub inflight_at_fault: Inflight,
    pub inflight_outcomes: InflightOutcomes,
    pub t_fault_removed_ms: Option<u64>,
    pub t_recovered_ms: Option<u64>,
    pub recovery_definition: String,
    pub derived: Derived,
    /// Every request the drill sent, by how it ended (the counts add up to `sent`).
    pub traffic: BTreeMap<String, u64>,
    pub consistency: Consistency,
    pub error_budget: ErrorBudget,
    pub negative_checks: Vec<SignalCheck>,
    pub limits: Limits,
    /// Scenario-specific measurements.
    pub figures: BTreeMap<String, Value>,
    pub verdict: Verdict,
    pub skipped_reason: Option<String>,
    pub violations: Vec<String>,
    /// Contract gaps seen that are not pass criteria of this scenario.
    pub warnings: Vec<String>,
    /// Checks the drill could not make against this configuration, and why (a tool
    /// that cannot report its effects by key): the verdict does not rest on them.
    pub skipped_checks: Vec<String>,
    pub duration_s: f64,
}

impl Record {
    pub fn new(drill_id: String, scenario: &str, build: Build) -> Self {
        Self {
            drill_id,
            scenario: scenario.to_owned(),
            started_at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            build,
            fault: Fault::default(),
            t_fault_injected_ms: None,
            t_detected_ms: None,
            detection_source: None,
            t_drain_started_ms: None,
            t_drain_completed_ms: None,
            inflight_at_fault: Inflight::default(),
            inflight_outcomes: InflightOutcomes::default(),
            t_fault_removed_ms: None,
            t_recovered_ms: None,
            recovery_definition: String::new(),
            derived: Derived::default(),
            traffic: BTreeMap::new(),
            consistency: Consistency::default(),
            error_budget: ErrorBudget::default(),
            negative_checks: Vec::new(),
            limits: Limits {
                max_detection_ms: None,
                max_recovery_ms: None,
            },
            figures: BTreeMap::new(),
            verdict: Verdict::Pass,
            skipped_reason: None,
            violations: Vec::new(),
            warnings: Vec::new(),
            skipped_checks: Vec::new(),
            duration_s: 0.0,
        }
    }

    pub fn figure(&mut self, name: &str, value: impl Serialize) {
        self.figures.insert(
            name.to_owned(),
            serde_json::to_value(value).unwrap_or(Value::Null),
        );
    }

    /// Records a check: a violation unless `ok`.
    pub fn check(&mut self, ok: bool, violation: impl FnOnce() -> String) {
        if !ok {
            self.violations.push(violation());
        }
    }

    pub fn signal(&mut self, signal: &str, expected: bool, at_ms: Option<u64>, required: bool) {
        self.negative_checks.push(SignalCheck {
            signal: signal.to_owned(),
            expected,
            observed: at_ms.is_some(),
            at_ms,
            required,
        });
    }

    /// The exactly-once books of the scenario; their duplicates are also the
    /// in-flight outcomes' `duplicated_effects`.
    pub fn set_consistency(&mut self, consistency: Consistency) {
        self.inflight_outcomes.duplicated_effects =
            u32::try_from(consistency.duplicated).unwrap_or(u32::MAX);
        self.consistency = consistency;
    }

    pub fn skip(&mut self, why: impl Into<String>) {
        self.verdict = Verdict::Skipped;
        self.skipped_reason = Some(why.into());
    }

    /// Derives the times and decides the verdict from everything recorded: the
    /// scenario's own violations, plus the rules every drill shares (exactly-once,
    /// metering, in-flight accounting, causes, signals, time limits).
    pub fn conclude(&mut self) {
        let since_fault = |t: Option<u64>| match (t, self.t_fault_injected_ms) {
            (Some(t), Some(f)) => Some(t.saturating_sub(f) as f64 / 1000.0),
            _ => None,
        };
        self.derived = Derived {
            detection_time_s: since_fault(self.t_detected_ms),
            drain_time_s: match (self.t_drain_started_ms, self.t_drain_completed_ms) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1000.0),
                _ => None,
            },
            recovery_time_s: since_fault(self.t_recovered_ms),
        };
        if self.verdict == Verdict::Skipped {
            return;
        }
        let mut found = Vec::new();
        let c = &self.consistency;
        if c.lost > 0 {
            found.push(format!("{} acknowledged side effect(s) were lost", c.lost));
        }
        if c.duplicated > 0 {
            found.push(format!(
                "{} side effect(s) happened more than once",
                c.duplicated
            ));
        }
        if c.unexpected > 0 {
            found.push(format!(
                "{} side effect(s) happened although the agent was told they did not",
                c.unexpected
            ));
        }
        let m = &c.metering;
        if m.tokens_tasks != m.tokens_provider_in_tasks {
            found.push(format!(
                "metering: the task reports count {} tokens, the provider reported {} for the \
                 same calls",
                m.tokens_tasks, m.tokens_provider_in_tasks
            ));
        }
        if let Some(t) = m.tokens_metrics
            && t != m.tokens_provider
        {
            found.push(format!(
                "metering: /metrics counts {t} tokens, the provider reported {}",
                m.tokens_provider
            ));
        }
        let total = self.inflight_at_fault.total();
        let accounted = self.inflight_outcomes.accounted();
        if accounted != total {
            found.push(format!(
                "in-flight accounting: {total} request(s) were in flight at the fault, {accounted} \
                 are accounted for"
            ));
        }
        let expected = &self.error_budget.expected_causes;
        for slo in &self.error_budget.slos {
            for (cause, n) in &slo.by_cause {
                if !expected.iter().any(|e| e == cause) {
                    found.push(format!(
                        "SLO {}: {n} bad event(s) charged to {cause}, expected only {}",
                        slo.slo,
                        if expected.is_empty() {
                            "none".to_owned()
                        } else {
                            expected.join(", ")
                        }
                    ));
                }
            }
        }
        for s in &self.negative_checks {
            if s.observed != s.expected {
                let text = format!(
                    "signal {}: expected it {}, it {}",
                    s.signal,
                    if s.expected {
                        "to react"
                    } else {
                        "to stay quiet"
                    },
                    if s.observed {
                        "reacted"
                    } else {
                        "did not react"
                    }
                );
                if s.required {
                    found.push(text);
                } else if !self.warnings.contains(&text) {
                    self.warnings.push(text);
                }
            }
        }
        if self.t_fault_injected_ms.is_some() && self.t_detected_ms.is_none() {
            found.push("the fault was never detected".to_owned());
        }
        if let (Some(max), Some(d)) = (self.limits.max_detection_ms, self.derived.detection_time_s)
            && d * 1000.0 > max as f64
        {
            found.push(format!(
                "detection took {d:.3} s, more than the {:.3} s allowed",
                max as f64 / 1000.0
            ));
        }
        if let (Some(max), Some(r)) = (self.limits.max_recovery_ms, self.derived.recovery_time_s)
            && r * 1000.0 > max as f64
        {
            found.push(format!(
                "recovery took {r:.3} s, more than the {:.3} s allowed",
                max as f64 / 1000.0
            ));
        }
        if self.t_fault_removed_ms.is_some() && self.t_recovered_ms.is_none() {
            found.push("the fault was removed but recovery was never observed".to_owned());
        }
        self.violations.extend(found);
        self.verdict = if self.violations.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail
        };
    }

    /// The record as Markdown, for people.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let opt = |v: Option<u64>| v.map_or("—".to_owned(), |v| format!("{v} ms"));
        let secs = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{v:.3} s"));
        let _ = writeln!(
            s,
            "# Drill `{}`: **{}**\n",
            self.scenario,
            self.verdict.as_str()
        );
        let _ = writeln!(
            s,
            "- drill id `{}`, started {}, took {:.1} s",
            self.drill_id, self.started_at, self.duration_s
        );
        let _ = writeln!(
            s,
            "- build {} (config hash `{}…`, {})",
            self.build.service_version,
            self.build.config_hash.get(..16).unwrap_or_default(),
            self.build.config_source
        );
        if let Some(why) = &self.skipped_reason {
            let _ = writeln!(s, "\n**Skipped:** {why}");
            return s;
        }
        let _ = writeln!(
            s,
            "- fault `{}` by {}: `{}`\n",
            self.fault.kind, self.fault.injector, self.fault.params
        );
        if !self.violations.is_empty() {
            let _ = writeln!(s, "## Violations\n");
            for v in &self.violations {
                let _ = writeln!(s, "- {v}");
            }
            let _ = writeln!(s);
        }
        if !self.warnings.is_empty() {
            let _ = writeln!(s, "## Warnings\n");
            for w in &self.warnings {
                let _ = writeln!(s, "- {w}");
            }
            let _ = writeln!(s);
        }
        if !self.skipped_checks.is_empty() {
            let _ = writeln!(s, "## Checks not made\n");
            for c in &self.skipped_checks {
                let _ = writeln!(s, "- {c}");
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(s, "## Timeline (from t0)\n\n| event | at |\n| --- | --- |");
        for (name, at) in [
            ("fault injected", self.t_fault_injected_ms),
            ("detected", self.t_detected_ms),
            ("drain started", self.t_drain_started_ms),
            ("drain completed", self.t_drain_completed_ms),
            ("fault removed", self.t_fault_removed_ms),
            ("recovered", self.t_recovered_ms),
        ] {
            let _ = writeln!(s, "| {name} | {} |", opt(at));
        }
        let _ = writeln!(
            s,
            "\nDetection {} via {}; drain {}; recovery {} ({}).\n",
            secs(self.derived.detection_time_s),
            self.detection_source.as_deref().unwrap_or("—"),
            secs(self.derived.drain_time_s),
            secs(self.derived.recovery_time_s),
            self.recovery_definition
        );
        let i = &self.inflight_at_fault;
        let o = &self.inflight_outcomes;
        let _ = writeln!(
            s,
            "## In flight at the fault\n\n{} stream(s), {} model call(s), {} tool call(s): \
             {} completed, {} failed to the client, {} retried safely, {} resumed after a \
             restart, {} in doubt; {} duplicated effect(s).\n",
            i.llm_streams,
            i.llm_calls,
            i.tool_calls,
            o.completed,
            o.failed_to_client,
            o.retried_safely,
            o.resumed_after_restart,
            o.in_doubt,
            o.duplicated_effects
        );
        let _ = writeln!(s, "## Traffic\n\n| outcome | requests |\n| --- | --- |");
        for (k, v) in &self.traffic {
            let _ = writeln!(s, "| {k} | {v} |");
        }
        let c = &self.consistency;
        let m = &c.metering;
        let _ = writeln!(
            s,
            "\n## Consistency\n\n{} journal record(s); effects seen by the tools: {}; lost {}, \
             duplicated {}, unexpected {}, recovered {}, in doubt {}.\n",
            c.journal_entries,
            c.effects_observed
                .map_or("not reported".to_owned(), |n| n.to_string()),
            c.lost,
            c.duplicated,
            c.unexpected,
            c.recovered,
            c.in_doubt
        );
        if !c.by_class.is_empty() {
            let _ = writeln!(
                s,
                "| tool class | keys | effects | duplicated | lost | recovered | in doubt | final states |\n\
                 | --- | --- | --- | --- | --- | --- | --- | --- |"
            );
            for (class, t) in &c.by_class {
                let states: Vec<String> = t
                    .final_states
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                let _ = writeln!(
                    s,
                    "| {class} | {} | {} | {} | {} | {} | {} | {} |",
                    t.keys,
                    t.effects,
                    t.duplicated,
                    t.lost,
                    t.recovered,
                    t.in_doubt,
                    states.join(", ")
                );
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "Metering: task reports {} tokens, provider usage on the same calls {}, /metrics {}, \
             provider usage on all calls {}; {} incomplete request(s).\n",
            m.tokens_tasks,
            m.tokens_provider_in_tasks,
            m.tokens_metrics
                .map_or("not scraped".to_owned(), |t| t.to_string()),
            m.tokens_provider,
            m.incomplete_requests
        );
        let _ = writeln!(
            s,
            "## Error budget\n\nExpected causes: {}.\n\n| SLO | bad | eligible | budget burned | by cause |\n| --- | --- | --- | --- | --- |",
            if self.error_budget.expected_causes.is_empty() {
                "none".to_owned()
            } else {
                self.error_budget.expected_causes.join(", ")
            }
        );
        for b in &self.error_budget.slos {
            let causes: Vec<String> = b.by_cause.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} | {} |",
                b.slo,
                b.bad_events,
                b.eligible_events,
                b.budget_fraction_burned,
                causes.join(", ")
            );
        }
        let _ = writeln!(
            s,
            "\n## Signals\n\n| signal | expected | observed | at | required |\n| --- | --- | --- | --- | --- |"
        );
        for c in &self.negative_checks {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                c.signal,
                c.expected,
                c.observed,
                opt(c.at_ms),
                c.required
            );
        }
        if !self.figures.is_empty() {
            let _ = writeln!(s, "\n## Figures\n\n| figure | value |\n| --- | --- |");
            for (k, v) in &self.figures {
                let _ = writeln!(s, "| {k} | `{v}` |");
            }
        }
        s
    }
}

/// `summary.md`: one line per scenario.
pub fn summary(records: &[Record]) -> String {
    let mut s = String::from(
        "# Drill summary\n\n| scenario | verdict | detection | recovery | lost | duplicated | violations |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in records {
        let secs = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{v:.3} s"));
        let why = match (&r.skipped_reason, r.violations.first()) {
            (Some(skip), _) => format!("skipped: {skip}"),
            (None, Some(v)) if r.violations.len() > 1 => {
                format!("{v} (+{} more)", r.violations.len() - 1)
            }
            (None, Some(v)) => v.clone(),
            (None, None) if !r.skipped_checks.is_empty() => {
                format!(
                    "{} check(s) not made (see the record)",
                    r.skipped_checks.len()
                )
            }
            (None, None) => String::new(),
        };
        let _ = writeln!(
            s,
            "| [{0}]({0}.md) | {1} | {2} | {3} | {4} | {5} | {6} |",
            r.scenario,
            r.verdict.as_str(),
            secs(r.derived.detection_time_s),
            secs(r.derived.recovery_time_s),
            r.consistency.lost,
            r.consistency.duplicated,
            why.replace('|', "\\|")
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean() -> Record {
        let mut r = Record::new("d-1".into(), "x", Build::default());
        r.t_fault_injected_ms = Some(100);
        r.t_detected_ms = Some(350);
        r.t_fault_removed_ms = Some(1000);
        r.t_recovered_ms = Some(1400);
        r.inflight_at_fault = Inflight {
            llm_streams: 2,
            llm_calls: 0,
            tool_calls: 1,
        };
        r.inflight_outcomes = InflightOutcomes {
            completed: 1,
            retried_safely: 2,
            ..InflightOutcomes::default()
        };
        r.error_budget.expected_causes = vec!["network".into()];
        r.error_budget.slos.push(SloBudget {
            slo: "s".into(),
            bad_events: 2,
            eligible_events: 10,
            budget_fraction_burned: 0.2,
            by_cause: BTreeMap::from([("network".to_owned(), 2)]),
        });
        r
    }

    #[test]
    fn a_clean_record_passes_with_derived_times() {
        let mut r = clean();
        r.conclude();
        assert_eq!(r.verdict, Verdict::Pass, "{:?}", r.violations);
        assert_eq!(r.derived.detection_time_s, Some(0.25));
        assert_eq!(r.derived.recovery_time_s, Some(1.3));
        assert_eq!(r.derived.drain_time_s, None);
    }

    #[test]
    fn each_shared_rule_fails_the_record() {
        type Breaker = fn(&mut Record);
        let cases: [(Breaker, &str); 10] = [
            (|r| r.consistency.duplicated = 1, "more than once"),
            (|r| r.consistency.lost = 1, "were lost"),
            (|r| r.consistency.unexpected = 1, "told they did not"),
            (
                |r| r.consistency.metering.tokens_tasks = 5,
                "the task reports count 5",
            ),
            (
                |r| r.consistency.metering.tokens_metrics = Some(3),
                "/metrics counts 3",
            ),
            (|r| r.inflight_outcomes.completed = 0, "2 are accounted for"),
            (
                |r| {
                    r.error_budget.slos[0].by_cause.insert("unknown".into(), 1);
                },
                "charged to unknown",
            ),
            (|r| r.t_detected_ms = None, "never detected"),
            (|r| r.t_recovered_ms = None, "never observed"),
            (
                |r| r.limits.max_detection_ms = Some(100),
                "detection took 0.250 s",
            ),
        ];
        for (breaker, words) in cases {
            let mut r = clean();
            breaker(&mut r);
            r.conclude();
            assert_eq!(r.verdict, Verdict::Fail, "{words}");
            assert!(
                r.violations.iter().any(|v| v.contains(words)),
                "{words}: {:?}",
                r.violations
            );
        }
    }

    #[test]
    fn signals_fail_when_required_and_warn_otherwise() {
        let mut r = clean();
        r.signal("readiness flipped", true, None, false);
        r.signal("outrigger_faults_active = 1", true, Some(120), true);
        r.conclude();
        assert_eq!(r.verdict, Verdict::Pass);
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
        let mut r = clean();
        r.signal("outrigger_faults_active = 1", true, None, true);
        r.conclude();
        assert_eq!(r.verdict, Verdict::Fail);
    }

    #[test]
    fn duplicated_effects_come_from_the_ledger_and_fail_the_record() {
        let mut r = clean();
        r.set_consistency(Consistency {
            duplicated: 2,
            ..Consistency::default()
        });
        assert_eq!(r.inflight_outcomes.duplicated_effects, 2);
        r.conclude();
        assert_eq!(r.verdict, Verdict::Fail);
        assert!(r.markdown().contains("2 duplicated effect(s)"));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["inflight_outcomes"]["duplicated_effects"], 2);
    }

    #[test]
    fn checks_not_made_are_stated_in_the_record_and_the_summary() {
        let mut r = clean();
        r.skipped_checks
            .push("tool t: GET /status/{key} does not report effects by key".into());
        r.conclude();
        assert_eq!(r.verdict, Verdict::Pass);
        assert!(r.markdown().contains("## Checks not made"));
        assert!(summary(&[r]).contains("1 check(s) not made"));
    }

    #[test]
    fn a_skipped_record_stays_skipped_and_renders() {
        let mut r = clean();
        r.skip("needs --nvml-stub");
        r.consistency.lost = 3;
        r.conclude();
        assert_eq!(r.verdict, Verdict::Skipped);
        assert!(r.violations.is_empty());
        assert!(r.markdown().contains("needs --nvml-stub"));
        assert!(summary(&[r]).contains("| skipped |"));
    }

    #[test]
    fn the_record_serializes_every_field() {
        let mut r = clean();
        r.conclude();
        let v = serde_json::to_value(&r).unwrap();
        for field in [
            "drill_id",
            "scenario",
            "build",
            "fault",
            "t_fault_injected_ms",
            "t_detected_ms",
            "detection_source",
            "t_drain_started_ms",
            "t_drain_completed_ms",
            "inflight_at_fault",
            "inflight_outcomes",
            "t_fault_removed_ms",
            "t_recovered_ms",
            "recovery_definition",
            "derived",
            "consistency",
            "error_budget",
            "negative_checks",
            "verdict",
            "violations",
            "skipped_checks",
        ] {
            assert!(v.get(field).is_some(), "{field} missing");
        }
        assert_eq!(v["verdict"], "pass");
        assert!(v["build"].get("service.version").is_some());
        assert!(
            v["consistency"]["metering"]
                .get("incomplete_requests")
                .is_some()
        );
        assert!(r.markdown().contains("## Consistency"));
    }
}
