use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outrigger_types::CircuitState;

use super::*;
use crate::labels::TraceId;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn trace() -> Option<TraceId> {
    TraceId::from_hex(TRACE)
}

fn gaps(ms: &[u64]) -> ChunkGaps {
    let mut gaps = ChunkGaps::default();
    for &ms in ms {
        gaps.push(Duration::from_millis(ms));
    }
    gaps
}

/// A long stream's mean is of every gap; the histogram gets its first
/// `ChunkGaps::KEPT`, each as measured.
#[test]
fn chunk_gaps_keep_the_mean_of_every_gap_and_a_bounded_sample() {
    let mut g = ChunkGaps::default();
    let n = ChunkGaps::KEPT as u64 * 2;
    for i in 0..n {
        g.push(Duration::from_millis(if i < n / 2 { 10 } else { 30 }));
    }
    assert_eq!(g.len(), n);
    assert_eq!(g.mean(), Some(Duration::from_millis(20)));
    assert_eq!(g.iter().count(), ChunkGaps::KEPT);
    assert!(g.iter().all(|gap| gap == Duration::from_millis(10)));
    let mut g = ChunkGaps::default();
    g.push(Duration::from_secs(1 << 40));
    assert_eq!(
        g.iter().last(),
        Some(Duration::from_micros(u64::from(u32::MAX)))
    );
}

/// Records one of everything, so every family has a series.
fn exercised() -> Metrics {
    let m = Metrics::with_options(&MetricsOptions {
        models: vec!["gpt-4o".into()],
        tools: vec!["payments".into()],
        providers: vec!["openai".into()],
        ..MetricsOptions::default()
    });
    m.request(
        HttpLabels {
            route: RouteLabel::ChatCompletions,
            target: "openai".into(),
            status: 200,
        },
        0.2,
    );
    drop(m.inflight(RouteLabel::Tools));
    m.unprotected_tool_call("payments");
    m.model_call(&ModelCallRecord {
        provider: "openai",
        request_model: "gpt-4o",
        response_model: Some("gpt-4o-2024-08-06"),
        operation: names::OPERATION_CHAT,
        stream: true,
        duration: Duration::from_millis(900),
        ttft: Some(Duration::from_millis(150)),
        chunk_gaps: &gaps(&[20, 30]),
        tokens_in: Some(120),
        tokens_out: Some(40),
        error_type: None,
        trace_id: trace(),
    });
    m.tool_call(&ToolCallRecord {
        tool: "payments",
        protocol: "http",
        duration: Duration::from_millis(50),
        journal_state: "completed",
        error_type: None,
        trace_id: trace(),
    });
    m.retry("openai", "server_error");
    m.stream_continuation("openai", true);
    m.retry_budget_exhausted("openai");
    m.fallback("openai", "anthropic");
    m.breaker_state("openai", CircuitState::Open);
    m.budget_rejection("cost");
    m.replay(ReplayKind::Tool);
    m.policy_event("retry", PolicyEventKind::Trap);
    m.journal(&outrigger_journal::Stats::default());
    m.task_ended(Duration::from_secs(42), "success", Some(true));
    m.recovery(true);
    m.slo_event(
        &SloLabels {
            slo: Label::new("llm-availability"),
            outcome: "bad",
            cause: "network",
        },
        trace(),
    );
    m.slo_objective(&Label::new("llm-availability"), 0.999);
    m.dropped_counter("spans", "queue_full").inc();
    m.fault_injected("provider:mock", "rate_limit");
    m.faults_active(true);
    m
}

/// `name -> (type, unit)` from the `# TYPE` and `# UNIT` lines of an exposition.
fn families(text: &str) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("#"), Some("TYPE"), Some(name), Some(kind)) => {
                out.insert(name.to_owned(), (kind.to_owned(), "-".to_owned()));
            }
            (Some("#"), Some("UNIT"), Some(name), Some(unit)) => {
                if let Some(entry) = out.get_mut(name) {
                    entry.1 = unit.to_owned();
                }
            }
            _ => {}
        }
    }
    out
}

fn checked_in() -> BTreeMap<String, (String, String)> {
    include_str!("../../tests/metric-names.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_owned(), (f[1].to_owned(), f[2].to_owned()))
        })
        .collect()
}

#[test]
fn emitted_names_types_and_units_match_the_checked_in_list() {
    let emitted = families(&exercised().encode());
    let expected = checked_in();
    let missing: Vec<_> = expected
        .keys()
        .filter(|k| !emitted.contains_key(*k))
        .collect();
    let extra: Vec<_> = emitted
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, unexpected {extra:?}"
    );
    assert_eq!(emitted, expected);
    // And the constants module lists the same families.
    let constants: BTreeMap<String, String> = names::EXPOSED_METRICS
        .iter()
        .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
        .collect();
    let file: BTreeMap<String, String> = expected.into_iter().map(|(n, (t, _))| (n, t)).collect();
    assert_eq!(constants, file);
}

#[test]
fn genai_histograms_use_the_semconv_buckets() {
    let text = exercised().encode();
    let bounds = |metric: &str| -> Vec<String> {
        let prefix = format!("{metric}_bucket{{");
        let mut seen = Vec::new();
        for line in text.lines().filter(|l| l.starts_with(&prefix)) {
            let le = line.split("le=\"").nth(1).and_then(|r| r.split('"').next());
            if let Some(le) = le
                && !seen.iter().any(|s| s == le)
            {
                seen.push(le.to_owned());
            }
        }
        seen
    };
    let expect = |buckets: &[f64]| -> Vec<String> {
        let mut v: Vec<String> = buckets.iter().map(|b| format!("{b:?}")).collect();
        v.push("+Inf".to_owned());
        v
    };
    let duration = expect(&names::GEN_AI_DURATION_BUCKETS);
    assert_eq!(bounds("gen_ai_client_operation_duration_seconds"), duration);
    assert_eq!(
        bounds("gen_ai_client_operation_time_to_first_chunk_seconds"),
        duration
    );
    assert_eq!(
        bounds("gen_ai_client_operation_time_per_output_chunk_seconds"),
        duration
    );
    assert_eq!(bounds("gen_ai_execute_tool_duration_seconds"), duration);
    assert_eq!(
        bounds("gen_ai_client_token_usage"),
        expect(&names::GEN_AI_TOKEN_BUCKETS)
    );
    assert_eq!(
        bounds("outrigger_task_duration_seconds"),
        expect(&names::TASK_DURATION_BUCKETS)
    );
}

#[test]
fn exemplars_carry_the_trace_id_where_promised() {
    let text = exercised().encode();
    let exemplar = format!("# {{trace_id=\"{TRACE}\"}}");
    for metric in [
        "gen_ai_client_operation_duration_seconds_bucket",
        "gen_ai_client_operation_time_to_first_chunk_seconds_bucket",
        "outrigger_slo_events_total",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(metric) && l.contains(&exemplar)),
            "no exemplar on {metric}:\n{text}"
        );
    }
    // 0.9 s falls in the 0.64 < v <= 1.28 bucket: the exemplar sits on that line.
    let line = text.lines().find(|l| {
        l.starts_with("gen_ai_client_operation_duration_seconds_bucket") && l.contains(&exemplar)
    });
    assert!(
        line.is_some_and(|l| l.contains("le=\"1.28\"") && l.ends_with(" 0.9")),
        "{line:?}"
    );
}

#[test]
fn model_call_records_tokens_ttft_and_each_chunk_gap() {
    let text = exercised().encode();
    let series = "gen_ai_operation_name=\"chat\",gen_ai_provider_name=\"openai\",gen_ai_request_model=\"gpt-4o\",gen_ai_response_model=\"gpt-4o-2024-08-06\"";
    assert!(text.contains(&format!(
        "gen_ai_client_operation_time_per_output_chunk_seconds_count{{{series},error_type=\"\"}} 2"
    )), "{text}");
    assert!(
        text.contains(&format!(
            "gen_ai_client_token_usage_sum{{{series},gen_ai_token_type=\"input\"}} 120.0"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "gen_ai_client_token_usage_sum{{{series},gen_ai_token_type=\"output\"}} 40.0"
        )),
        "{text}"
    );
    assert!(
        text.contains("outrigger_breaker_state{target=\"openai\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("outrigger_slo_objective{slo=\"llm-availability\"} 0.999"),
        "{text}"
    );
    assert!(
        text.contains(
            "outrigger_telemetry_dropped_total{signal=\"spans\",reason=\"queue_full\"} 1"
        )
    );
}

#[test]
fn unreported_usage_is_not_recorded_as_zero() {
    let m = Metrics::new();
    m.model_call(&ModelCallRecord {
        provider: "openai",
        request_model: "gpt-4o",
        response_model: None,
        operation: names::OPERATION_CHAT,
        stream: false,
        duration: Duration::from_millis(10),
        ttft: Some(Duration::from_millis(5)),
        chunk_gaps: &ChunkGaps::default(),
        tokens_in: None,
        tokens_out: None,
        error_type: Some("stream_interrupted"),
        trace_id: None,
    });
    let text = m.encode();
    assert!(!text.contains("gen_ai_client_token_usage_count"), "{text}");
    // Not a stream: no TTFT even though one was passed.
    assert!(!text.contains("gen_ai_client_operation_time_to_first_chunk_seconds_count"));
    assert!(text.contains("error_type=\"stream_interrupted\""));
}

#[test]
fn labels_are_bounded_and_ids_never_become_labels() {
    let m = Metrics::with_options(&MetricsOptions {
        models: vec!["gpt-4o".into()],
        learn_cap: 3,
        ..MetricsOptions::default()
    });
    for i in 0..100 {
        m.model_call(&ModelCallRecord {
            provider: "openai",
            request_model: &format!("model-{i}"),
            response_model: None,
            operation: names::OPERATION_CHAT,
            stream: false,
            duration: Duration::from_millis(10),
            ttft: None,
            chunk_gaps: &ChunkGaps::default(),
            tokens_in: None,
            tokens_out: None,
            error_type: None,
            trace_id: None,
        });
    }
    let text = m.encode();
    let models: BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("gen_ai_client_operation_duration_seconds_count"))
        .filter_map(|l| l.split("gen_ai_request_model=\"").nth(1)?.split('"').next())
        .collect();
    // openai and chat took two of the three learned slots in other interners; the
    // model interner learned three models, then folded the other 97.
    assert_eq!(models.len(), 4, "{models:?}");
    assert!(models.contains(names::OTHER));

    let forbidden = [
        "request_id",
        "task_id",
        "response_id",
        "tool_call_id",
        "idempotency_key",
        "trace_id",
    ];
    let text = exercised().encode();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        // Exemplars follow " # "; only the series' own labels count.
        let series = line.split(" # ").next().unwrap_or(line);
        for key in forbidden {
            assert!(
                !series.contains(&format!("{key}=")),
                "{key} used as a label: {line}"
            );
        }
    }
}
