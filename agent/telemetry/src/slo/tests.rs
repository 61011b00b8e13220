use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outrigger_types::{Cause, Exclusion, Failure, Outcome};

use super::*;
use crate::metrics::Metrics;

fn spec(metric: &str) -> SloSpec {
    SloSpec {
        name: Some("s".into()),
        object: Some("model_calls".into()),
        metric: Some(metric.into()),
        threshold: None,
        target: Some(0.99),
        window: Some("28d".into()),
        exclusions: Some(vec!["invalid_client".into()]),
        data_source: Some("prometheus:outrigger_slo_events_total".into()),
    }
}

fn problems(specs: &[SloSpec]) -> Vec<String> {
    match Slo::from_specs(specs, "slos") {
        Ok(_) => Vec::new(),
        Err(Error::SloConfig(p)) => p.into_iter().map(|p| p.to_string()).collect(),
        Err(other) => vec![other.to_string()],
    }
}

#[test]
fn each_missing_part_is_named() {
    type Clear = fn(&mut SloSpec);
    let cases: [(&str, Clear); 7] = [
        ("slos[0].name", |s| s.name = None),
        ("slos[0].object", |s| s.object = None),
        ("slos[0].metric", |s| s.metric = None),
        ("slos[0].target", |s| s.target = None),
        ("slos[0].window", |s| s.window = None),
        ("slos[0].exclusions", |s| s.exclusions = None),
        ("slos[0].data_source", |s| s.data_source = None),
    ];
    for (path, clear) in cases {
        let mut s = spec("availability");
        clear(&mut s);
        let p = problems(&[s]);
        assert_eq!(p.len(), 1, "{path}: {p:?}");
        assert!(p[0].starts_with(&format!("{path}: missing")), "{p:?}");
    }
    // All at once: every part reported, not just the first.
    assert_eq!(problems(&[SloSpec::default()]).len(), 7);
    // An empty exclusion list is a stated choice, not a missing part.
    let mut none_excluded = spec("availability");
    none_excluded.exclusions = Some(Vec::new());
    assert!(problems(&[none_excluded]).is_empty());
}

#[test]
fn invalid_values_are_rejected_with_their_path() {
    let cases: Vec<(SloSpec, &str)> = vec![
        (
            SloSpec {
                metric: Some("latency".into()),
                ..spec("x")
            },
            "slos[0].metric: \"latency\" is not a built-in SLI",
        ),
        (
            spec("ttft_p99"),
            "slos[0].threshold: missing: ttft_p99 needs a threshold",
        ),
        (
            SloSpec {
                threshold: Some("2s".into()),
                ..spec("availability")
            },
            "slos[0].threshold: availability takes no threshold",
        ),
        (
            SloSpec {
                threshold: Some("2s".into()),
                target: Some(0.9),
                ..spec("ttft_p95")
            },
            "slos[0].target: ttft_p95 means 95% of streamed calls",
        ),
        (
            SloSpec {
                target: Some(1.0),
                ..spec("availability")
            },
            "slos[0].target: 1 must be strictly between 0 and 1",
        ),
        (
            SloSpec {
                window: Some("5m".into()),
                ..spec("availability")
            },
            "slos[0].window: \"5m\" must be between 1h and 400d",
        ),
        (
            SloSpec {
                window: Some("soon".into()),
                ..spec("availability")
            },
            "slos[0].window: \"soon\" is not a duration",
        ),
        (
            SloSpec {
                exclusions: Some(vec!["weekends".into()]),
                ..spec("availability")
            },
            "slos[0].exclusions[0]: \"weekends\"",
        ),
        (
            SloSpec {
                data_source: Some("grafana".into()),
                ..spec("availability")
            },
            "slos[0].data_source: \"grafana\"",
        ),
        (
            SloSpec {
                object: Some("gpus".into()),
                ..spec("availability")
            },
            "slos[0].object: \"gpus\"",
        ),
        (
            SloSpec {
                object: Some("tasks:x".into()),
                ..spec("recovery_success")
            },
            "slos[0].object: tasks cannot be narrowed",
        ),
        (
            SloSpec {
                object: Some("tool_calls".into()),
                ..spec("abort_rate")
            },
            "slos[0].metric: abort_rate measures model_calls, not tool_calls",
        ),
        (
            SloSpec {
                name: Some("has space".into()),
                ..spec("availability")
            },
            "slos[0].name: \"has space\" must be",
        ),
    ];
    for (s, expected) in cases {
        let p = problems(&[s]);
        assert!(
            p.iter().any(|m| m.starts_with(expected)),
            "expected {expected:?}, got {p:?}"
        );
    }
    let p = problems(&[spec("availability"), spec("availability")]);
    assert_eq!(
        p,
        ["slos[1].name: \"s\" names another SLO too; names must be unique"]
    );
}

#[test]
fn the_documented_example_parses_and_validates() -> Result<(), Box<dyn std::error::Error>> {
    #[derive(serde::Deserialize)]
    struct Doc {
        slos: Vec<SloSpec>,
    }
    let doc = include_str!("../../../../docs/telemetry.md");
    let toml_block = doc
        .split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.contains("[[slos]]"))
        .ok_or("no [[slos]] example in docs/telemetry.md")?;
    let parsed: Doc = toml::from_str(toml_block)?;
    let slos = Slo::from_specs(&parsed.slos, "slos")?;
    assert!(slos.len() >= 4);
    assert!(
        slos.iter()
            .any(|s| s.metric == Sli::TtftP95(Duration::from_secs(2)))
    );
    Ok(())
}

#[test]
fn cause_precedence_table() {
    use Failed::*;
    let s = |failure: Option<Failed>| Signals {
        failure,
        ..Signals::default()
    };
    let gpu = |failure: Option<Failed>| Signals {
        failure,
        gpu_unhealthy: true,
        ..Signals::default()
    };
    let cancelled = |failure: Option<Failed>| Signals {
        failure,
        client_cancelled: true,
        ..Signals::default()
    };
    let table: Vec<(Signals, Outcome)> = vec![
        (s(None), Outcome::Good),
        (gpu(None), Outcome::Good),
        (
            Signals {
                synthetic: true,
                maintenance: true,
                failure: Some(Internal),
                ..Signals::default()
            },
            Outcome::Excluded(Exclusion::Synthetic),
        ),
        (
            Signals {
                maintenance: true,
                failure: Some(Transport),
                gpu_unhealthy: true,
                ..Signals::default()
            },
            Outcome::Excluded(Exclusion::Maintenance),
        ),
        (
            cancelled(None),
            Outcome::Excluded(Exclusion::ClientCancelled),
        ),
        (
            cancelled(Some(Transport)),
            Outcome::Excluded(Exclusion::ClientCancelled),
        ),
        (
            s(Some(InvalidRequest)),
            Outcome::Excluded(Exclusion::InvalidClient),
        ),
        (
            gpu(Some(PolicyDenied)),
            Outcome::Excluded(Exclusion::InvalidClient),
        ),
        (gpu(Some(Internal)), Outcome::Bad(Cause::Hardware)),
        (gpu(Some(Transport)), Outcome::Bad(Cause::Hardware)),
        (s(Some(Internal)), Outcome::Bad(Cause::Release)),
        (s(Some(Admission)), Outcome::Bad(Cause::Capacity)),
        (s(Some(RateLimited)), Outcome::Bad(Cause::Capacity)),
        (s(Some(Transport)), Outcome::Bad(Cause::Network)),
        (s(Some(Timeout)), Outcome::Bad(Cause::UpstreamModel)),
        (
            s(Some(UpstreamStatus(503))),
            Outcome::Bad(Cause::UpstreamModel),
        ),
        (s(Some(UpstreamStream)), Outcome::Bad(Cause::UpstreamModel)),
        (s(Some(Unclassified)), Outcome::Bad(Cause::Unknown)),
    ];
    for (signals, expected) in table {
        assert_eq!(classify(&signals), expected, "{signals:?}");
    }
    let from_status = [
        (429, RateLimited),
        (408, Timeout),
        (401, Internal),
        (403, Internal),
        (400, InvalidRequest),
        (404, InvalidRequest),
        (422, InvalidRequest),
        (500, UpstreamStatus(500)),
        (529, UpstreamStatus(529)),
        (418, Unclassified),
    ];
    for (status, expected) in from_status {
        assert_eq!(Failed::from_upstream_status(status), expected, "{status}");
    }
    let from_tool_status = [
        (200, None),
        (201, None),
        (304, None),
        (429, Some(RateLimited)),
        (408, Some(Timeout)),
        // The agent's own credentials and arguments: the agent's request.
        (401, Some(InvalidRequest)),
        (409, Some(InvalidRequest)),
        (422, Some(InvalidRequest)),
        (502, Some(UpstreamStatus(502))),
    ];
    for (status, expected) in from_tool_status {
        assert_eq!(Failed::of_tool_status(status), expected, "{status}");
    }
    assert_eq!(
        Failed::from_failure(&Failure::Connect { sent: true }),
        Transport
    );
    assert_eq!(
        Failed::from_failure(&Failure::ContextOverflow),
        InvalidRequest
    );
    assert_eq!(
        Failed::from_failure(&Failure::StreamInterrupted {
            events_delivered: 3,
            inside_tool_call: false
        }),
        Transport
    );
    assert_eq!(
        Signals {
            gpu_unhealthy: true,
            ..Signals::default()
        }
        .latency_cause(),
        Cause::Hardware
    );
    assert_eq!(Signals::default().latency_cause(), Cause::UpstreamModel);
}

fn t0() -> SystemTime {
    // A bucket boundary, so "n buckets ago" arithmetic in the tests is exact.
    UNIX_EPOCH + Duration::from_secs(1_800_000_000 / 300 * 300)
}

fn slo(metric: &str, threshold: Option<&str>, target: f64, exclusions: &[&str]) -> Slo {
    let mut s = spec(metric);
    s.name = Some(metric.into());
    s.object = Some(
        match metric {
            "tool_success" => "tool_calls",
            "recovery_success" | "task_wall_clock" => "tasks",
            _ => "model_calls",
        }
        .into(),
    );
    s.threshold = threshold.map(Into::into);
    s.target = Some(target);
    s.exclusions = Some(exclusions.iter().map(|e| (*e).to_owned()).collect());
    match Slo::from_specs(&[s], "slos") {
        Ok(mut v) => v.remove(0),
        Err(e) => panic!("{e}"),
    }
}

fn model_event(outcome: Outcome, at: SystemTime) -> SloEvent<'static> {
    let mut e = SloEvent::new(ObjectKind::ModelCalls, outcome, at);
    e.provider = Some("openai");
    e.model = Some("gpt-4o");
    e
}

fn report_of(slos: &Slos, name: &str, now: SystemTime) -> SloReport {
    match slos.report(now).into_iter().find(|r| r.name == name) {
        Some(r) => r,
        None => panic!("no report for {name}"),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn budget_and_burn_by_cause_add_up() {
    let metrics = Metrics::new();
    let slos = Slos::new(
        vec![slo("availability", None, 0.99, &["invalid_client"])],
        metrics.clone(),
    );
    let now = t0();
    let record = |n: usize, outcome: Outcome, at: SystemTime| {
        for _ in 0..n {
            slos.record(&model_event(outcome, at));
        }
    };
    record(980, Outcome::Good, now);
    record(10, Outcome::Bad(Cause::Network), now);
    record(6, Outcome::Bad(Cause::UpstreamModel), now);
    record(4, Outcome::Bad(Cause::Hardware), now);
    record(50, Outcome::Excluded(Exclusion::InvalidClient), now);
    // Not declared by this SLO: the sidecar let the client go as it should.
    record(5, Outcome::Excluded(Exclusion::ClientCancelled), now);

    let r = report_of(&slos, "availability", now);
    assert_eq!((r.good, r.bad, r.excluded), (985, 20, 50));
    assert_eq!(r.bad_by_cause.get("network"), Some(&10));
    assert_eq!(r.excluded_by_reason.get("invalid_client"), Some(&50));
    let eligible = 1005.0;
    assert!(close(r.sli.unwrap_or(0.0), 985.0 / eligible));
    assert!(close(r.budget_total, 0.01 * eligible));
    assert!(close(r.burn_rate, 20.0 / eligible / 0.01));
    assert!(close(
        r.budget_left_fraction,
        1.0 - 20.0 / (0.01 * eligible)
    ));
    let sum: f64 = r.burn_by_cause.values().sum();
    assert!(
        close(sum, r.burn_rate),
        "{:?} vs {}",
        r.burn_by_cause,
        r.burn_rate
    );
    assert!(close(r.burn_by_cause["hardware"], 4.0 / eligible / 0.01));
    // Every window holds the same events (all recorded now).
    assert!(close(r.burn_rates.h1, r.burn_rate) && close(r.burn_rates.d3, r.burn_rate));

    let text = metrics.encode();
    assert!(
        text.contains(
            "outrigger_slo_events_total{slo=\"availability\",outcome=\"good\",cause=\"none\"} 985"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "outrigger_slo_events_total{slo=\"availability\",outcome=\"bad\",cause=\"network\"} 10"
        ),
        "{text}"
    );
    assert!(text.contains("outrigger_slo_events_total{slo=\"availability\",outcome=\"excluded\",cause=\"invalid_client\"} 50"), "{text}");
}

#[test]
fn burn_windows_see_only_their_own_buckets() {
    let slos = Slos::new(vec![slo("availability", None, 0.9, &[])], Metrics::new());
    let now = t0();
    let ago = |d: Duration| now - d;
    // Two days ago: a bad hour. Now: a good hour with one hardware failure.
    for _ in 0..8 {
        slos.record(&model_event(
            Outcome::Good,
            ago(Duration::from_secs(2 * 86400)),
        ));
    }
    for _ in 0..2 {
        slos.record(&model_event(
            Outcome::Bad(Cause::Capacity),
            ago(Duration::from_secs(2 * 86400)),
        ));
    }
    for _ in 0..9 {
        slos.record(&model_event(Outcome::Good, now));
    }
    slos.record(&model_event(Outcome::Bad(Cause::Hardware), now));
    // Forty days ago: outside the 28d window altogether.
    slos.record(&model_event(
        Outcome::Bad(Cause::Release),
        ago(Duration::from_secs(40 * 86400)),
    ));

    let r = report_of(&slos, "availability", now);
    assert!(close(r.burn_rates.h1, (1.0 / 10.0) / 0.1));
    assert!(close(r.burn_rates.h6, 1.0));
    assert!(close(r.burn_rates.d1, 1.0));
    assert!(close(r.burn_rates.d3, (3.0 / 20.0) / 0.1));
    assert_eq!((r.good, r.bad), (17, 3));
    assert!(!r.bad_by_cause.contains_key("release"));
    assert!(close(
        r.burn_by_cause["capacity"] + r.burn_by_cause["hardware"],
        r.burn_rate
    ));
}

#[test]
fn a_window_covers_at_least_its_length() {
    let slos = Slos::new(vec![slo("availability", None, 0.9, &[])], Metrics::new());
    // Two and a half minutes into a bucket.
    let now = t0() + Duration::from_secs(150);
    let ago = |secs: u64| now - Duration::from_secs(secs);
    for _ in 0..9 {
        slos.record(&model_event(Outcome::Good, now));
    }
    // An hour old: inside "1h", which covers 60 to 65 minutes.
    slos.record(&model_event(Outcome::Bad(Cause::Network), ago(3600)));
    // 66 minutes old: outside it.
    slos.record(&model_event(Outcome::Bad(Cause::Capacity), ago(66 * 60)));
    let r = report_of(&slos, "availability", now);
    assert!(
        close(r.burn_rates.h1, (1.0 / 10.0) / 0.1),
        "{:?}",
        r.burn_rates
    );
    assert!(close(r.burn_rates.h6, (2.0 / 11.0) / 0.1));

    // The SLO's own window is whole buckets too: a "1h" SLO sees the hour-old event.
    let mut hourly = slo("availability", None, 0.9, &[]);
    hourly.window = Duration::from_secs(3600);
    let slos = Slos::new(vec![hourly], Metrics::new());
    slos.record(&model_event(Outcome::Bad(Cause::Network), ago(3600)));
    slos.record(&model_event(Outcome::Bad(Cause::Capacity), ago(66 * 60)));
    let r = report_of(&slos, "availability", now);
    assert_eq!(r.bad_by_cause.get("network"), Some(&1));
    assert_eq!(r.bad_by_cause.get("capacity"), None);
}

/// An exclusion an SLO does not declare counts as good, whatever the SLI.
#[test]
fn undeclared_exclusions_are_good_for_every_sli() {
    let at = t0();
    let aborts = slo("abort_rate", None, 0.999, &[]);
    let mut cancelled = model_event(Outcome::Excluded(Exclusion::ClientCancelled), at);
    cancelled.stream = true;
    cancelled.aborted = true;
    assert_eq!(aborts.judge(&cancelled), Some(Verdict::Good));
    let declared = slo("abort_rate", None, 0.999, &["client_cancelled"]);
    assert_eq!(
        declared.judge(&cancelled),
        Some(Verdict::Excluded(Exclusion::ClientCancelled))
    );

    let tools = slo("tool_success", None, 0.999, &[]);
    let mut refused = SloEvent::new(
        ObjectKind::ToolCalls,
        Outcome::Excluded(Exclusion::InvalidClient),
        at,
    );
    refused.tool = Some("payments");
    assert_eq!(tools.judge(&refused), Some(Verdict::Good));

    let recovery = slo("recovery_success", None, 0.99, &[]);
    let mut given_up = SloEvent::new(
        ObjectKind::Tasks,
        Outcome::Excluded(Exclusion::ClientCancelled),
        at,
    );
    given_up.recovered = Some(false);
    assert_eq!(recovery.judge(&given_up), Some(Verdict::Good));

    // A latency SLI still judges the latency it measured.
    let ttft = slo("ttft_p95", Some("2s"), 0.95, &[]);
    let mut slow = cancelled;
    slow.ttft = Some(Duration::from_secs(3));
    assert_eq!(ttft.judge(&slow), Some(Verdict::Bad(Cause::UpstreamModel)));
}

#[test]
fn each_sli_judges_its_own_events() {
    let at = t0();
    let ttft = slo("ttft_p95", Some("2s"), 0.95, &["client_cancelled"]);
    let mut fast = model_event(Outcome::Bad(Cause::Network), at);
    fast.stream = true;
    fast.ttft = Some(Duration::from_millis(300));
    let mut slow = model_event(Outcome::Good, at);
    slow.stream = true;
    slow.ttft = Some(Duration::from_secs(3));
    slow.latency_cause = Cause::Hardware;
    let no_first_chunk = model_event(Outcome::Bad(Cause::Network), at);
    // A broken stream whose first chunk was fast is good for TTFT.
    assert_eq!(ttft.judge(&fast), Some(Verdict::Good));
    assert_eq!(ttft.judge(&slow), Some(Verdict::Bad(Cause::Hardware)));
    assert_eq!(ttft.judge(&no_first_chunk), None);

    let aborts = slo("abort_rate", None, 0.999, &[]);
    let mut aborted = fast;
    aborted.aborted = true;
    assert_eq!(aborts.judge(&aborted), Some(Verdict::Bad(Cause::Network)));
    assert_eq!(aborts.judge(&slow), Some(Verdict::Good));
    assert_eq!(aborts.judge(&no_first_chunk), None, "not a stream");

    let mut tools = slo("tool_success", None, 0.999, &["invalid_client"]);
    tools.object = Object {
        kind: ObjectKind::ToolCalls,
        selector: Some("payments".into()),
    };
    let mut settled = SloEvent::new(ObjectKind::ToolCalls, Outcome::Good, at);
    settled.tool = Some("payments");
    settled.definitive = true;
    let mut in_doubt = settled;
    in_doubt.definitive = false;
    in_doubt.outcome = Outcome::Bad(Cause::Network);
    let mut other_tool = settled;
    other_tool.tool = Some("mailer");
    let mut refused = settled;
    refused.outcome = Outcome::Excluded(Exclusion::InvalidClient);
    assert_eq!(tools.judge(&settled), Some(Verdict::Good));
    assert_eq!(tools.judge(&in_doubt), Some(Verdict::Bad(Cause::Network)));
    assert_eq!(tools.judge(&other_tool), None);
    assert_eq!(
        tools.judge(&refused),
        Some(Verdict::Excluded(Exclusion::InvalidClient))
    );
    assert_eq!(tools.judge(&slow), None, "a model call is not a tool call");

    let mut recovery = slo("recovery_success", None, 0.99, &[]);
    recovery.object = Object {
        kind: ObjectKind::Tasks,
        selector: None,
    };
    let mut recovered = SloEvent::new(ObjectKind::Tasks, Outcome::Good, at);
    recovered.recovered = Some(true);
    let mut duplicated = recovered;
    duplicated.recovered = Some(false);
    duplicated.outcome = Outcome::Bad(Cause::Release);
    let faultless = SloEvent::new(ObjectKind::Tasks, Outcome::Good, at);
    assert_eq!(recovery.judge(&recovered), Some(Verdict::Good));
    assert_eq!(
        recovery.judge(&duplicated),
        Some(Verdict::Bad(Cause::Release))
    );
    assert_eq!(recovery.judge(&faultless), None);

    let mut wall = slo("task_wall_clock", Some("30m"), 0.9, &[]);
    wall.object = Object {
        kind: ObjectKind::Tasks,
        selector: None,
    };
    let mut long = faultless;
    long.wall_clock = Some(Duration::from_secs(3600));
    assert_eq!(wall.judge(&long), Some(Verdict::Bad(Cause::UpstreamModel)));
}

/// An in-memory [`SloStore`] that can be told to fail.
#[derive(Default)]
struct MemStore {
    data: Mutex<HashMap<String, Vec<u8>>>,
    fail: std::sync::atomic::AtomicBool,
}

impl SloStore for MemStore {
    fn load(&self) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let data = self
            .data
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    fn save(
        &self,
        key: String,
        value: Option<Vec<u8>>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let result = if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            Err(Error::Store("disk full".into()))
        } else {
            let mut data = self
                .data
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match value {
                Some(v) => data.insert(key, v),
                None => data.remove(&key),
            };
            Ok(())
        };
        std::future::ready(result)
    }
}

#[tokio::test]
async fn counts_survive_a_restart_and_old_buckets_are_deleted() -> Result<(), Error> {
    let store = MemStore::default();
    let now = t0();
    let first = Slos::new(vec![slo("availability", None, 0.99, &[])], Metrics::new());
    first.record(&model_event(Outcome::Good, now));
    first.record(&model_event(Outcome::Bad(Cause::Network), now));
    first.record(&model_event(Outcome::Good, now - Duration::from_secs(3600)));
    store.fail.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(first.persist(&store, now).await.is_err());
    store
        .fail
        .store(false, std::sync::atomic::Ordering::Relaxed);
    // The failed writes are retried.
    assert_eq!(first.persist(&store, now).await?, 2);
    assert_eq!(
        first.persist(&store, now).await?,
        0,
        "nothing changed since"
    );

    let second = Slos::new(vec![slo("availability", None, 0.99, &[])], Metrics::new());
    assert_eq!(second.restore(&store)?, 2);
    assert_eq!(
        report_of(&second, "availability", now),
        report_of(&first, "availability", now)
    );

    // Thirty days later every bucket has left the 28d window: deleted from the store.
    let later = now + Duration::from_secs(30 * 86400);
    assert_eq!(second.persist(&store, later).await?, 2);
    assert!(store.load()?.is_empty());
    assert_eq!(report_of(&second, "availability", later).good, 0);
    Ok(())
}

#[tokio::test]
async fn the_journal_kv_is_a_store() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let (journal, writer, _) =
        outrigger_journal::Journal::open(outrigger_journal::Options::new(dir.path().join("j")))?;
    let writer = tokio::spawn(writer.run());
    let now = t0();
    let first = Slos::new(vec![slo("availability", None, 0.99, &[])], Metrics::new());
    first.record(&model_event(Outcome::Bad(Cause::Capacity), now));
    assert_eq!(first.persist(&journal, now).await?, 1);
    let second = Slos::new(vec![slo("availability", None, 0.99, &[])], Metrics::new());
    assert_eq!(second.restore(&journal)?, 1);
    assert_eq!(
        report_of(&second, "availability", now)
            .bad_by_cause
            .get("capacity"),
        Some(&1)
    );
    drop((journal, first, second));
    writer.abort();
    Ok(())
}

/// A maintenance window is open until its end, or until it is closed.
#[test]
fn a_maintenance_window_lasts_until_its_end_or_until_closed() {
    let slos = Slos::new(vec![slo("availability", None, 0.9, &[])], Metrics::new());
    let now = SystemTime::now();
    assert_eq!(slos.maintenance(now), None);
    assert!(!slos.maintenance_active());

    let end = now + Duration::from_secs(600);
    slos.open_maintenance(Some(end));
    let got = slos.maintenance(now).flatten().expect("open with an end");
    assert!(got.duration_since(end).unwrap_or_else(|e| e.duration()) < Duration::from_millis(1));
    assert!(slos.maintenance_active());
    assert_eq!(
        slos.maintenance(end + Duration::from_millis(1)),
        None,
        "past its end"
    );

    slos.open_maintenance(Some(now - Duration::from_secs(1)));
    assert!(
        !slos.maintenance_active(),
        "an end in the past opens nothing"
    );

    slos.open_maintenance(None);
    assert_eq!(
        slos.maintenance(now + Duration::from_secs(86400 * 365)),
        Some(None)
    );
    slos.close_maintenance();
    assert!(!slos.maintenance_active());
}

/// A sidecar without a journal still drops the buckets every window has left.
#[tokio::test]
async fn counts_kept_nowhere_are_forgotten_once_every_window_has_left_them() {
    let slos = Slos::new(vec![slo("availability", None, 0.99, &[])], Metrics::new());
    let now = t0();
    for minutes in 0..30 {
        let at = now + Duration::from_secs(minutes * 60);
        slos.record(&model_event(Outcome::Bad(Cause::Capacity), at));
    }
    let held = |slos: &Slos| -> (usize, usize) {
        let state = slos.state.lock().unwrap_or_else(PoisonError::into_inner);
        (state[0].buckets.len(), state[0].dirty.len())
    };
    assert!(held(&slos).0 >= 6, "{:?}", held(&slos));
    slos.forget_old(now + Duration::from_secs(3600)).await;
    assert_eq!(held(&slos).1, 0, "nothing is waiting to be stored");
    assert!(held(&slos).0 >= 6, "the buckets are still in the window");
    slos.forget_old(now + Duration::from_secs(40 * 86400)).await;
    assert_eq!(held(&slos), (0, 0));
}
