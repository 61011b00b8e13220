//! The scenarios, and what they share: a fresh sidecar per scenario ([`Run`]), the
//! watcher on its admin plane, the agent on its data plane, and the closing books
//! (tasks ended, exactly-once ledger, metering, error budget, verdict).

mod gpu;
mod hot_swap;
mod journal;
mod restart;
mod storm;
mod stream_cut;
mod tool_reset;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::time::Instant;

use super::Error;
use super::agent::{Agent, StatusError, Told, ToolSeen};
use super::child::{Launch, Sidecar};
use super::http::{Admin, Http};
use super::observe::{self, Exposition, Look, SloCounts, Watcher};
use super::record::{Build, Metering, Record, SloBudget};
use super::setup::{self, Derive, Derived, Plan, ToolPlan};

/// The scenarios, in the order `all` runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    RateLimitStorm,
    StreamCutText,
    StreamCutToolCall,
    ToolResetAfterEffect,
    PolicyHotSwap,
    GpuUnhealthy,
    JournalWriteFailure,
    SidecarRestart,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Self::RateLimitStorm,
        Self::StreamCutText,
        Self::StreamCutToolCall,
        Self::ToolResetAfterEffect,
        Self::PolicyHotSwap,
        Self::GpuUnhealthy,
        Self::JournalWriteFailure,
        Self::SidecarRestart,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::RateLimitStorm => "rate_limit_storm",
            Self::StreamCutText => "stream_cut_text",
            Self::StreamCutToolCall => "stream_cut_tool_call",
            Self::ToolResetAfterEffect => "tool_reset_after_effect",
            Self::PolicyHotSwap => "policy_hot_swap",
            Self::GpuUnhealthy => "gpu_unhealthy",
            Self::JournalWriteFailure => "journal_write_failure",
            Self::SidecarRestart => "sidecar_restart",
        }
    }

    /// A short tag for task ids and keys.
    fn tag(self) -> &'static str {
        match self {
            Self::RateLimitStorm => "storm",
            Self::StreamCutText => "cut",
            Self::StreamCutToolCall => "cuttool",
            Self::ToolResetAfterEffect => "reset",
            Self::PolicyHotSwap => "swap",
            Self::GpuUnhealthy => "gpu",
            Self::JournalWriteFailure => "jfail",
            Self::SidecarRestart => "restart",
        }
    }

    /// `all`, one name, or a comma-separated list.
    pub fn parse_list(s: &str) -> Result<Vec<Scenario>, String> {
        if s.trim() == "all" {
            return Ok(Self::ALL.to_vec());
        }
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match Self::ALL.iter().find(|x| x.name() == part) {
                Some(x) if !out.contains(x) => out.push(*x),
                Some(_) => {}
                None => {
                    let names: Vec<&str> = Self::ALL.iter().map(|x| x.name()).collect();
                    return Err(format!(
                        "--scenario {part:?} is not a scenario; use all or one of: {}",
                        names.join(", ")
                    ));
                }
            }
        }
        if out.is_empty() {
            return Err("--scenario names no scenario".to_owned());
        }
        Ok(out)
    }
}

/// What every scenario of one drill run shares.
pub struct Drill {
    pub plan: Plan,
    pub env: Vec<(String, String)>,
    pub out: PathBuf,
    pub work: PathBuf,
    pub nvml_stub: Option<PathBuf>,
    pub exe: PathBuf,
    pub http: Http,
    pub build: Build,
    /// `YYYY-MM-DD`, for drill ids.
    pub date: String,
    pub run_id: String,
}

/// Runs one scenario to its record; a scenario that could not be carried out is a
/// failed record saying why.
pub async fn run(drill: &Drill, scenario: Scenario) -> Record {
    let started = Instant::now();
    let mut record = Record::new(
        format!("{}-{}-{}", drill.date, scenario.name(), drill.run_id),
        scenario.name(),
        drill.build.clone(),
    );
    if scenario == Scenario::GpuUnhealthy && drill.nvml_stub.is_none() {
        record
            .skip("needs --nvml-stub PATH: the drill breaks a stub NVML library, never a real GPU");
        record.conclude();
        return record;
    }
    let result = match Run::start(drill, scenario, record).await {
        Ok(mut run) => {
            let outcome = match scenario {
                Scenario::RateLimitStorm => storm::run(&mut run).await,
                Scenario::StreamCutText => stream_cut::run(&mut run, false).await,
                Scenario::StreamCutToolCall => stream_cut::run(&mut run, true).await,
                Scenario::ToolResetAfterEffect => tool_reset::run(&mut run).await,
                Scenario::PolicyHotSwap => hot_swap::run(&mut run).await,
                Scenario::GpuUnhealthy => gpu::run(&mut run).await,
                Scenario::JournalWriteFailure => journal::run(&mut run).await,
                Scenario::SidecarRestart => restart::run(&mut run).await,
            };
            if let Err(e) = outcome {
                run.record
                    .violations
                    .push(format!("the drill could not complete the scenario: {e}"));
            }
            Ok(run.finish().await)
        }
        Err((mut record, e)) => {
            record
                .violations
                .push(format!("the drill could not start the scenario: {e}"));
            Err(record)
        }
    };
    let mut record = result.unwrap_or_else(|r| r);
    record.duration_s = started.elapsed().as_secs_f64();
    record.conclude();
    record
}

/// One scenario's sidecar and the drill's view of it.
pub struct Run<'d> {
    pub drill: &'d Drill,
    pub scenario: Scenario,
    pub sidecar: Sidecar,
    pub derived: Derived,
    pub admin: Admin,
    pub agent: Agent,
    pub watcher: Watcher,
    pub t0: Instant,
    pub record: Record,
    /// `/metrics` at t0.
    pub before: Exposition,
    /// Tools whose status endpoint reports effects by key.
    pub status_supported: BTreeMap<String, bool>,
    /// Task tokens the sidecar already held when the books were (re)opened, by task.
    pub task_token_base: BTreeMap<String, u64>,
    /// SLO counts to add at the end (from a sidecar that was killed) and subtract
    /// (counts a restarted sidecar restored).
    pub slo_carry: BTreeMap<String, (SloCounts, SloCounts)>,
    /// `/metrics` counters restarted with the process: token counts not comparable.
    pub metrics_restarted: bool,
    seq: AtomicU64,
}

impl<'d> Run<'d> {
    async fn start(
        drill: &'d Drill,
        scenario: Scenario,
        record: Record,
    ) -> Result<Run<'d>, (Record, Error)> {
        let stub = (scenario == Scenario::GpuUnhealthy)
            .then_some(drill.nvml_stub.as_deref())
            .flatten();
        let mut env = Vec::new();
        if stub.is_some() {
            env.push((
                "OUTRIGGER_NVML_STUB_SCENARIO".to_owned(),
                "xid79".to_owned(),
            ));
        }
        let dir = drill.work.join(scenario.name());
        let derived = match setup::derive(
            &drill.plan,
            &dir,
            &drill.work.join("policy-cache"),
            &drill.env,
            &Derive { nvml_stub: stub },
        ) {
            Ok(d) => d,
            Err(e) => return Err((record, e)),
        };
        let launch = Launch {
            exe: drill.exe.clone(),
            config: derived.config.clone(),
            ready_file: dir.join("ready.json"),
            log: drill
                .out
                .join("logs")
                .join(format!("{}.log", scenario.name())),
            env,
            env_remove: derived.env_remove.clone(),
        };
        let _ = std::fs::remove_file(&launch.log);
        // t0 is the start of the scenario's sidecar process: a fault armed at start
        // (the GPU stub's) is injected then.
        let t0 = Instant::now();
        let sidecar = match Sidecar::start(launch).await {
            Ok(s) => s,
            Err(e) => return Err((record, e)),
        };
        let admin = Admin::new(
            drill.http.clone(),
            sidecar.admin,
            drill.plan.admin_token.clone(),
        );
        let agent = Agent::new(
            drill.http.clone(),
            sidecar.data,
            drill.plan.provider.clone(),
        );
        let before = match observe::scrape(&admin).await {
            Ok(e) => e,
            Err(e) => return Err((record, Error::Sidecar(e))),
        };
        let ready_ms = observe::ms(t0.elapsed());
        let watcher = Watcher::start(admin.clone(), t0);
        Ok(Run {
            drill,
            scenario,
            sidecar,
            derived,
            admin,
            agent,
            watcher,
            t0,
            record,
            before,
            status_supported: BTreeMap::new(),
            task_token_base: BTreeMap::new(),
            slo_carry: BTreeMap::new(),
            metrics_restarted: false,
            seq: AtomicU64::new(0),
        })
        .map(|mut run: Run<'d>| {
            run.record.figure("sidecar_ready_ms", ready_ms);
            run
        })
    }

    /// Milliseconds since t0.
    pub fn now_ms(&self) -> u64 {
        observe::ms(self.t0.elapsed())
    }

    /// A task id unique to this run and scenario.
    pub fn task(&self, name: &str) -> String {
        format!("drill-{}-{}-{name}", self.drill.run_id, self.scenario.tag())
    }

    /// An idempotency key unique to this run and scenario.
    pub fn key(&self, name: &str) -> String {
        format!("drill-{}-{}-{name}", self.drill.run_id, self.scenario.tag())
    }

    /// A prompt no other request of the run repeats.
    pub fn prompt(&self, what: &str) -> String {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        format!(
            "Outrigger drill {} ({}): {what} #{n}. Answer briefly.",
            self.drill.run_id,
            self.scenario.name()
        )
    }

    /// A tool-call body no other call of the run repeats.
    pub fn payload(&self, key: &str) -> Value {
        json!({"drill": self.drill.run_id, "scenario": self.scenario.name(), "key": key})
    }

    /// `POST /v1/faults`.
    pub async fn faults(&self, body: Value) -> Result<(), Error> {
        self.admin
            .post_json("/v1/faults", &body)
            .await
            .map(|_| ())
            .map_err(Error::Sidecar)
    }

    /// Learns whether `tool`'s status endpoint reports effects by key, from a key the
    /// agent was told is done and one never used. A tool that cannot say is a stated
    /// skip of the tool-side checks; one that could not be asked is a violation.
    pub async fn calibrate(&mut self, tool: &ToolPlan, done_key: &str) {
        if self.status_supported.contains_key(&tool.name) {
            return;
        }
        let present = self.agent.tool_status(tool, done_key).await;
        let absent = self.agent.tool_status(tool, &self.key("never-used")).await;
        let support = status_support(&present, &absent);
        match &support {
            StatusSupport::Supported => {}
            StatusSupport::Unsupported(why) => self.record.skipped_checks.push(format!(
                "tool {}: GET {} does not report effects by key ({why}): lost, duplicated and \
                 unexpected effects of its calls are judged from the journal and the agent's \
                 answers only, not from the tool",
                tool.name, tool.status_path
            )),
            StatusSupport::Failed(why) => self.record.violations.push(format!(
                "tool {}: its status endpoint could not be asked whether effects happened \
                 ({why}), so its effects were not checked",
                tool.name
            )),
        }
        self.status_supported
            .insert(tool.name.clone(), support == StatusSupport::Supported);
    }

    /// A tool call that must be done (a baseline); calibrates the tool's status.
    pub async fn baseline_tool_call(
        &mut self,
        tool: &ToolPlan,
        task: &str,
        name: &str,
    ) -> Result<ToolSeen, Error> {
        let key = self.key(name);
        let seen = self
            .agent
            .tool(tool, &key, task, &self.payload(&key), None)
            .await;
        if seen.told() != Told::Done {
            return Err(Error::Sidecar(format!(
                "the baseline call to tool {} did not complete before any fault: {:?} {}",
                tool.name,
                seen.status,
                seen.error.clone().unwrap_or_else(|| seen.body.to_string())
            )));
        }
        self.calibrate(tool, &key).await;
        Ok(seen)
    }

    /// The watcher's first look at or after `from_ms` where `metric` (summed over
    /// samples with `labels`) satisfies `test`.
    pub fn metric_first(
        &self,
        from_ms: u64,
        metric: &str,
        labels: &[(&str, &str)],
        test: impl Fn(f64) -> bool,
    ) -> Option<u64> {
        self.watcher.first_after(from_ms, |l: &Look| {
            l.metrics
                .as_ref()
                .is_some_and(|m| test(m.sum(metric, labels)))
        })
    }

    /// When the operator first saw `metric` satisfy `test` after `from_ms`: in the
    /// watcher's looks, or else in a scrape made now (a fault window can be shorter
    /// than the watcher's period).
    pub async fn metric_seen(
        &self,
        from_ms: u64,
        metric: &str,
        labels: &[(&str, &str)],
        test: impl Fn(f64) -> bool,
    ) -> Option<u64> {
        if let Some(at) = self.metric_first(from_ms, metric, labels, &test) {
            return Some(at);
        }
        let now = observe::scrape(&self.admin).await.ok()?;
        test(now.sum(metric, labels)).then(|| self.now_ms())
    }

    /// As an operator: resolves an in-doubt call after asking the tool whether it
    /// happened. Returns the action taken, or `None` when the tool cannot say.
    pub async fn resolve_in_doubt(&mut self, tool: &ToolPlan, key: &str) -> Option<&'static str> {
        if !self
            .status_supported
            .get(&tool.name)
            .copied()
            .unwrap_or(false)
        {
            return None;
        }
        let (action, body) = match self.agent.tool_status(tool, key).await {
            Ok(Some(status)) => (
                "mark_succeeded",
                json!({"action": "mark_succeeded", "status": 200, "body": status,
                       "actor": "outrigger-drill",
                       "reason": "the tool's status endpoint reports the effect for this key"}),
            ),
            Ok(None) => (
                "retry",
                json!({"action": "retry", "actor": "outrigger-drill",
                       "reason": "the tool's status endpoint reports no effect for this key"}),
            ),
            Err(e) => {
                self.record.violations.push(format!(
                    "{}/{key}: the tool could not be asked whether the call took effect, so \
                     the operator could not resolve it: {e}",
                    tool.name
                ));
                return None;
            }
        };
        match self
            .admin
            .post_json(&format!("/v1/journal/{}/{key}/resolve", tool.name), &body)
            .await
        {
            Ok(_) => Some(action),
            Err(e) => {
                self.record
                    .warnings
                    .push(format!("resolving {}/{key} failed: {e}", tool.name));
                None
            }
        }
    }

    /// Kills the sidecar (SIGKILL) and starts it again on the same journal, keeping
    /// the books straight across the gap; returns (kill ms, ready ms).
    pub async fn restart(&mut self, env: Option<(String, String)>) -> Result<(u64, u64), Error> {
        // What the killed process counted and never persisted is carried by hand.
        let before_kill = observe::slo_counts(&self.admin).await.unwrap_or_default();
        let tasks: Vec<String> = self.agent.tally().tasks.iter().cloned().collect();
        let mut held = BTreeMap::new();
        for task in &tasks {
            held.insert(task.clone(), self.task_tokens(task).await);
        }
        let killed = self.now_ms();
        self.sidecar.kill();
        if let Some(v) = env {
            self.sidecar.set_env(v);
        }
        self.sidecar.spawn().await?;
        let ready = self.now_ms();
        self.admin.moved_to(self.sidecar.admin);
        self.agent.moved_to(self.sidecar.data);
        let restored = observe::slo_counts(&self.admin).await.unwrap_or_default();
        for (name, counts) in before_kill {
            let r = restored.get(&name).cloned().unwrap_or_default();
            let carry = self.slo_carry.entry(name).or_default();
            add(&mut carry.0, &counts);
            add(&mut carry.1, &r);
        }
        self.metrics_restarted = true;
        // Task counters: what the new process loaded is the base; the usage the agent
        // saw before the kill is compared no more (it was counted by a dead process).
        let mut lost = 0;
        for task in &tasks {
            let loaded = self.task_tokens(task).await;
            lost += held.get(task).copied().unwrap_or(0).saturating_sub(loaded);
            self.task_token_base.insert(task.clone(), loaded);
        }
        let before: u64 = {
            let mut tally = self.agent.tally();
            let sum = tally.usage_by_task.values().sum();
            tally.usage_by_task.clear();
            sum
        };
        self.record.figure("provider_tokens_before_restart", before);
        self.record.figure("task_tokens_lost_in_kill", lost);
        if lost > 0 {
            self.record.warnings.push(format!(
                "{lost} task token(s) counted before the kill were not persisted (the task \
                 tracker persists every 10 s and at task end): metering across a crash under-counts"
            ));
        }
        Ok((killed, ready))
    }

    /// A task's `tokens_in + tokens_out` as the sidecar holds them now (0 if unknown).
    pub async fn task_tokens(&self, task: &str) -> u64 {
        match self.admin.get_json(&format!("/v1/tasks/{task}")).await {
            Ok(t) => t["tokens_in"].as_u64().unwrap_or(0) + t["tokens_out"].as_u64().unwrap_or(0),
            Err(_) => 0,
        }
    }

    /// Ends the drill's tasks, checks every key, and closes the record.
    async fn finish(mut self) -> Record {
        let end_ms = self.now_ms();
        self.record.figure("t_end_ms", end_ms);
        let (tasks, tool_calls, by_bucket, usage, incomplete, faults_seen) = {
            let t = self.agent.tally();
            (
                t.tasks.clone(),
                t.tool_calls.clone(),
                t.by_bucket.clone(),
                t.usage_by_task.clone(),
                t.incomplete,
                t.faults_seen.clone(),
            )
        };
        let mut tokens_tasks = 0u64;
        let mut journal_entries = 0u64;
        let mut verdicts = Vec::new();
        for task in &tasks {
            let end = self
                .admin
                .post_json(
                    &format!("/v1/tasks/{task}/end"),
                    &json!({"outcome": "success"}),
                )
                .await;
            match end {
                Ok(report) => {
                    let tokens = report["tokens_in"].as_u64().unwrap_or(0)
                        + report["tokens_out"].as_u64().unwrap_or(0);
                    let base = self.task_token_base.get(task).copied().unwrap_or(0);
                    tokens_tasks += tokens.saturating_sub(base);
                    let (streams, unknown) = faults_seen
                        .get(task)
                        .map(|(s, keys)| (*s, keys.len() as u64))
                        .unwrap_or((0, 0));
                    let judged =
                        judge_task_end(task, &report, streams, unknown, self.metrics_restarted);
                    self.record.violations.extend(judged.violations);
                    self.record.warnings.extend(judged.warnings);
                    verdicts.extend(judged.verdict);
                }
                Err(e) if self.metrics_restarted && e.contains("unknown-task") => {
                    self.record.warnings.push(format!(
                        "task {task} is unknown to the restarted sidecar: it was opened less than \
                         10 s before the kill, and open tasks are persisted only every 10 s"
                    ))
                }
                // Its recovery verdict and fault counts could not be checked.
                Err(e) => self
                    .record
                    .violations
                    .push(format!("task {task} could not be ended: {e}")),
            }
            // Every page of the task's records (a page holds at most `MAX_PAGE`).
            let mut after = String::new();
            loop {
                let page = self
                    .admin
                    .get_json(&format!(
                        "/v1/journal?task={task}&limit={}{after}",
                        crate::admin::MAX_PAGE
                    ))
                    .await;
                let j = match page {
                    Ok(j) => j,
                    Err(e) => {
                        self.record.violations.push(format!(
                            "the journal records of task {task} could not be counted: {e}"
                        ));
                        break;
                    }
                };
                journal_entries += j["count"].as_u64().unwrap_or(0);
                match j["next"].as_str() {
                    // A slot number: nothing to escape.
                    Some(next) if next.bytes().all(|b| b.is_ascii_digit()) => {
                        after = format!("&after={next}");
                    }
                    _ => break,
                }
            }
        }
        self.record.figure("task_recovery_verdicts", &verdicts);

        let (mut consistency, details) = super::ledger::check(
            &self.agent,
            &self.admin,
            &self.drill.plan.tools,
            &tool_calls,
            &self.status_supported,
        )
        .await;
        self.record.violations.extend(details);
        consistency.journal_entries = journal_entries;
        let after = match observe::scrape(&self.admin).await {
            Ok(after) => Some(after),
            Err(e) => {
                if !self.metrics_restarted {
                    self.record.violations.push(format!(
                        "metering against /metrics could not be checked: {e}"
                    ));
                }
                None
            }
        };
        let token_sum = |e: &Exposition| {
            e.sum(
                &format!(
                    "{}_sum",
                    outrigger_telemetry::names::GEN_AI_CLIENT_TOKEN_USAGE
                ),
                &[],
            )
        };
        consistency.metering = Metering {
            tokens_tasks,
            tokens_provider_in_tasks: usage
                .iter()
                .filter(|(t, _)| !t.is_empty())
                .map(|(_, n)| n)
                .sum(),
            tokens_metrics: match (&after, self.metrics_restarted) {
                (Some(a), false) => Some((token_sum(a) - token_sum(&self.before)).round() as u64),
                _ => None,
            },
            tokens_provider: usage.values().sum(),
            incomplete_requests: incomplete,
        };
        self.record.set_consistency(consistency);
        self.record.traffic = by_bucket;
        let sent: u64 = self.record.traffic.values().sum();
        self.record.traffic.insert("sent".to_owned(), sent);

        match observe::slo_counts(&self.admin).await {
            Ok(now) => {
                for (name, mut counts) in now {
                    if let Some((killed, restored)) = self.slo_carry.get(&name) {
                        add(&mut counts, killed);
                        sub(&mut counts, restored);
                    }
                    let bad = counts.bad();
                    let eligible = counts.good + bad;
                    let allowed = (1.0 - counts.target) * eligible as f64;
                    self.record.error_budget.slos.push(SloBudget {
                        slo: name,
                        bad_events: bad,
                        eligible_events: eligible,
                        budget_fraction_burned: if allowed > 0.0 {
                            bad as f64 / allowed
                        } else {
                            0.0
                        },
                        by_cause: counts.bad_by_cause,
                    });
                }
            }
            Err(e) => self
                .record
                .violations
                .push(format!("the error budget could not be read: {e}")),
        }
        drop(self.watcher);
        self.sidecar.kill();
        self.record
    }
}

/// What a task's end report says against what the agent saw of the task.
#[derive(Debug, Default)]
struct TaskJudged {
    violations: Vec<String>,
    warnings: Vec<String>,
    /// The task's recovery verdict, when it had faults to recover from.
    verdict: Option<Value>,
}

/// Judges `POST /v1/tasks/{task}/end`'s `report`: the tracker must charge at least
/// the faults the agent saw (`streams` typed interruptions, `unknown` tool-call keys
/// answered with an unknown outcome; a restart loses the dead process's counts, so
/// then the comparison is not made), and a task with faults must have recovered.
fn judge_task_end(
    task: &str,
    report: &Value,
    streams: u64,
    unknown: u64,
    restarted: bool,
) -> TaskJudged {
    let mut out = TaskJudged::default();
    let faults = report["faults"]
        .as_object()
        .map(|m| m.values().filter_map(Value::as_u64).sum::<u64>())
        .unwrap_or(0);
    for (kind, seen, what) in [
        (
            "stream_interrupted",
            streams,
            "stream(s) ended by the typed interruption event",
        ),
        (
            "tool_in_doubt",
            unknown,
            "tool-call key(s) answered with an unknown outcome",
        ),
    ] {
        if restarted {
            continue;
        }
        let charged = report["faults"][kind].as_u64().unwrap_or(0);
        let text =
            format!("task {task}: the tracker charged {charged} {kind} fault(s) for {seen} {what}");
        // More charges than keys is possible (a key answered "unknown" twice is two
        // calls in doubt); fewer means faults the agent met went uncounted.
        if charged < seen {
            out.violations.push(text);
        } else if charged > seen {
            out.warnings.push(text);
        }
    }
    if faults > 0 || streams + unknown > 0 {
        let recovery = &report["recovery"];
        out.verdict = Some(json!({"task": task, "faults": report["faults"],
            "recovered": recovery["succeeded"], "reason": recovery["reason"]}));
        if recovery["succeeded"] != true {
            out.violations.push(format!(
                "task {task} had {} fault(s) and did not recover: {}",
                faults.max(streams + unknown),
                recovery["reason"].as_str().unwrap_or("no verdict")
            ));
        }
    }
    out
}

fn add(into: &mut SloCounts, other: &SloCounts) {
    into.good += other.good;
    if into.target == 0.0 {
        into.target = other.target;
    }
    for (cause, n) in &other.bad_by_cause {
        *into.bad_by_cause.entry(cause.clone()).or_default() += n;
    }
}

fn sub(from: &mut SloCounts, other: &SloCounts) {
    from.good = from.good.saturating_sub(other.good);
    for (cause, n) in &other.bad_by_cause {
        if let Some(x) = from.bad_by_cause.get_mut(cause) {
            *x = x.saturating_sub(*n);
        }
    }
    from.bad_by_cause.retain(|_, n| *n > 0);
}

/// What a tool's status endpoint said of a done key and of an unused one.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StatusSupport {
    /// Yes for the done key, no for the unused one.
    Supported,
    /// It cannot say (no such endpoint, or the same answer for both).
    Unsupported(String),
    /// It could not be asked (no answer, a server error).
    Failed(String),
}

fn status_support(
    present: &Result<Option<Value>, StatusError>,
    absent: &Result<Option<Value>, StatusError>,
) -> StatusSupport {
    let describe = |s: &Result<Option<Value>, StatusError>| match s {
        Ok(Some(_)) => "2xx".to_owned(),
        Ok(None) => "404".to_owned(),
        Err(e) => e.detail.clone(),
    };
    match (present, absent) {
        (Ok(Some(_)), Ok(None)) => StatusSupport::Supported,
        (Err(e), _) | (_, Err(e)) if !e.unsupported() => StatusSupport::Failed(e.detail.clone()),
        _ => StatusSupport::Unsupported(format!(
            "done key: {}, unused key: {}",
            describe(present),
            describe(absent)
        )),
    }
}

/// Jain's fairness index over `xs`: 1 when all are equal, 1/n when one has all;
/// `None` when there is nothing to share out (no values, or all zero: every task
/// starved alike is not fairness).
pub fn jain(xs: &[f64]) -> Option<f64> {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    (squares > 0.0).then(|| sum * sum / (xs.len() as f64 * squares))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_lists_parse() {
        assert_eq!(Scenario::parse_list("all").unwrap().len(), 8);
        assert_eq!(
            Scenario::parse_list("stream_cut_text, sidecar_restart,stream_cut_text").unwrap(),
            vec![Scenario::StreamCutText, Scenario::SidecarRestart]
        );
        assert!(
            Scenario::parse_list("meteor_strike")
                .unwrap_err()
                .contains("rate_limit_storm")
        );
        assert!(Scenario::parse_list(" , ").is_err());
    }

    #[test]
    fn jain_index_bounds() {
        assert_eq!(jain(&[0.5, 0.5, 0.5, 0.5]), Some(1.0));
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]).unwrap() - 0.25).abs() < 1e-9);
        assert!((jain(&[0.0, 1.0, 1.0, 1.0]).unwrap() - 0.75).abs() < 1e-9);
        // Nobody served at all is not fair service.
        assert_eq!(jain(&[0.0, 0.0]), None);
        assert_eq!(jain(&[]), None);
    }

    #[test]
    fn a_task_end_is_held_to_the_faults_the_agent_saw() {
        let report = |interrupted: u64, in_doubt: u64, recovered: bool| {
            json!({"faults": {"stream_interrupted": interrupted, "tool_in_doubt": in_doubt,
                              "sidecar_restarts": 0, "agent_replays": 0},
                   "recovery": {"succeeded": recovered, "reason": "why"}})
        };
        // Charged what the agent saw, and recovered: clean.
        let j = judge_task_end("t", &report(2, 1, true), 2, 1, false);
        assert!(j.violations.is_empty() && j.warnings.is_empty(), "{j:?}");
        assert!(j.verdict.is_some());
        // Charged fewer than seen: the tracker lost faults, and with none charged the
        // recovery verdict is still required.
        let j = judge_task_end("t", &report(0, 0, false), 1, 0, false);
        assert_eq!(j.violations.len(), 2, "{j:?}");
        assert!(j.violations[0].contains("charged 0 stream_interrupted fault(s) for 1"));
        assert!(j.violations[1].contains("did not recover"));
        // Charged more than seen: a warning.
        let j = judge_task_end("t", &report(0, 3, true), 0, 2, false);
        assert!(j.violations.is_empty(), "{j:?}");
        assert_eq!(j.warnings.len(), 1);
        // Across a restart the counts are not comparable; the verdict still is.
        let j = judge_task_end("t", &report(0, 0, false), 2, 0, true);
        assert_eq!(j.violations.len(), 1, "{j:?}");
        assert!(j.violations[0].contains("did not recover"));
        // No fault at all: nothing to judge.
        let j = judge_task_end("t", &report(0, 0, false), 0, 0, false);
        assert!(j.violations.is_empty() && j.verdict.is_none(), "{j:?}");
    }

    #[test]
    fn a_status_endpoint_supports_says_it_cannot_or_fails() {
        let err = |status: Option<u16>| {
            Err(StatusError {
                status,
                detail: format!("answered {status:?}"),
            })
        };
        let yes = Ok(Some(json!({"effect": 1})));
        assert_eq!(status_support(&yes, &Ok(None)), StatusSupport::Supported);
        // No status endpoint: a stated skip.
        assert!(matches!(
            status_support(&Ok(None), &Ok(None)),
            StatusSupport::Unsupported(_)
        ));
        assert!(matches!(
            status_support(&err(Some(405)), &err(Some(405))),
            StatusSupport::Unsupported(_)
        ));
        // Not answered, or a server error: the check could not be made.
        assert!(matches!(
            status_support(&err(Some(503)), &Ok(None)),
            StatusSupport::Failed(_)
        ));
        assert!(matches!(
            status_support(&yes, &err(None)),
            StatusSupport::Failed(_)
        ));
    }

    #[test]
    fn carried_slo_counts_add_and_subtract() {
        let c = |good, bad: &[(&str, u64)]| SloCounts {
            target: 0.99,
            good,
            bad_by_cause: bad.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        };
        let mut now = c(10, &[("network", 2)]);
        add(&mut now, &c(5, &[("network", 1), ("capacity", 1)]));
        sub(&mut now, &c(3, &[("capacity", 1)]));
        assert_eq!(now, c(12, &[("network", 3)]));
    }
}
