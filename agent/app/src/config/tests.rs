use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn load_str(text: &str, env: &[(String, String)]) -> Result<Config, Error> {
    let dir = std::env::temp_dir().join(format!("outrigger-config-test-{}", ulid_like()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outrigger.toml");
    std::fs::write(&path, text).unwrap();
    let result = load(Some(&path), env);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn ulid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

fn paths(e: &Error) -> Vec<&str> {
    e.problems.iter().map(|p| p.path.as_str()).collect()
}

#[test]
fn embedded_defaults() {
    let c = load(None, &[]).unwrap();
    assert_eq!(c.data_addr.to_string(), "127.0.0.1:7070");
    assert_eq!(c.admin_addr.to_string(), "127.0.0.1:7071");
    assert_eq!(c.data_dir, PathBuf::from("./outrigger-data"));
    assert!(c.proxy.providers.is_empty());
    assert_eq!(c.workers, 0, "one data-plane worker per core");
    assert_eq!(c.tasks.max_tasks, 10_000);
}

#[test]
fn the_task_cap_from_the_file_or_the_environment() {
    let c = load_str("[tasks]\nmax_tasks = 500\n", &[]).unwrap();
    assert_eq!(c.tasks.max_tasks, 500);
    let c = load(None, &env(&[("OUTRIGGER_TASKS_MAX_TASKS", "20")])).unwrap();
    assert_eq!(c.tasks.max_tasks, 20);
    let err = load_str("[tasks]\nmax_tasks = 0\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["tasks.max_tasks"]);
}

#[test]
fn a_corrupt_journal_fails_closed_unless_quarantine_is_chosen() {
    assert_eq!(load(None, &[]).unwrap().on_corrupt, OnCorrupt::FailClosed);
    let c = load_str("[journal]\non_corrupt = \"quarantine\"\n", &[]).unwrap();
    assert_eq!(c.on_corrupt, OnCorrupt::Quarantine);
    let c = load(
        None,
        &env(&[("OUTRIGGER_JOURNAL_ON_CORRUPT", "fail-closed")]),
    )
    .unwrap();
    assert_eq!(c.on_corrupt, OnCorrupt::FailClosed);
    let err = load_str("[journal]\non_corrupt = \"ignore\"\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["journal.on_corrupt"]);
}

#[test]
fn data_plane_workers_from_the_file_or_the_environment() {
    let c = load_str("[listen]\nworkers = 3\n", &[]).unwrap();
    assert_eq!(c.workers, 3);
    let c = load_str(
        "[listen]\nworkers = 3\n",
        &env(&[("OUTRIGGER_LISTEN_WORKERS", "1")]),
    )
    .unwrap();
    assert_eq!(c.workers, 1);
    let err = load_str("[listen]\nworkers = -1\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["listen.workers"]);
}

#[test]
fn providers_from_the_environment() {
    let c = load(
        None,
        &env(&[
            ("OPENAI_API_KEY", "sk-test"),
            ("OPENAI_BASE_URL", "http://127.0.0.1:9/v1"),
            ("ANTHROPIC_API_KEY", "ak-test"),
        ]),
    )
    .unwrap();
    let names: Vec<_> = c.proxy.providers.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["openai", "anthropic"]);
    assert_eq!(
        c.proxy.providers[0].base_url.to_string(),
        "http://127.0.0.1:9/v1"
    );
    assert_eq!(
        c.proxy.providers[1].api_key.as_ref().map(|k| k.expose()),
        Some("ak-test")
    );
}

#[test]
fn every_problem_is_reported_at_once_with_its_path() {
    let err = load_str(
        r#"
[listen]
data = "nonsense"
admin = "0.0.0.0:7071"
colour = "blue"

[limits]
connect_timeout = "soon"

[[providers]]
name = "p"
kind = "gemini"
base_url = "ftp://x"
api_key_env = "OUTRIGGER_TEST_UNSET_VAR"
models = []
modalities = ["text", "video"]

[[tools]]
name = "bad name"
kind = "http"
base_url = "http://127.0.0.1:9"
class = "sometimes"
"#,
        &[],
    )
    .unwrap_err();
    let got = paths(&err);
    for want in [
        "listen.colour",
        "listen.data",
        "admin.token",
        "limits.connect_timeout",
        "providers[0].kind",
        "providers[0].base_url",
        "providers[0].api_key_env",
        "providers[0].models",
        "providers[0].modalities[1]",
        "tools[0].name",
        "tools[0].class",
    ] {
        assert!(got.contains(&want), "missing {want} in {got:?}");
    }
    let text = err.to_string();
    assert!(text.contains("problems:"), "{text}");
    assert!(
        text.contains("unknown modality \"video\"; known: text, image, audio, document"),
        "{text}"
    );
}

#[test]
fn environment_overrides_keys() {
    let c = load_str(
        "[listen]\ndata = \"127.0.0.1:1\"\n",
        &env(&[
            ("OUTRIGGER_LISTEN_DATA", "127.0.0.1:7777"),
            ("OUTRIGGER_LIMITS_MAX_BODY_BYTES", "1024"),
            ("OUTRIGGER_UNRELATED_THING", "ignored"),
        ]),
    )
    .unwrap();
    assert_eq!(c.data_addr.to_string(), "127.0.0.1:7777");
    assert_eq!(c.proxy.limits.max_body_bytes, 1024);
}

#[test]
fn variables_naming_no_section_are_found_for_a_warning() {
    let vars = env(&[
        ("OUTRIGGER_LISTN_DATA", "127.0.0.1:1"),
        ("OUTRIGGER_LISTEN_DATA", "127.0.0.1:2"),
        ("OUTRIGGER_BIN", "/bin/true"),
        ("OUTRIGGER_REQUIRE_EXAMPLES", "1"),
        ("PATH", "/bin"),
    ]);
    assert_eq!(unread_env(&vars), ["OUTRIGGER_LISTN_DATA"]);
}

#[test]
fn an_override_to_an_unknown_key_is_reported() {
    let err = load(None, &env(&[("OUTRIGGER_LIMITS_MAX_BODY", "1")])).unwrap_err();
    assert_eq!(paths(&err), ["limits.max_body"]);
}

#[test]
fn non_loopback_admin_needs_a_token() {
    assert!(load(None, &env(&[("OUTRIGGER_LISTEN_ADMIN", "0.0.0.0:7071")])).is_err());
    assert!(
        load(
            None,
            &env(&[
                ("OUTRIGGER_LISTEN_ADMIN", "0.0.0.0:7071"),
                ("OUTRIGGER_ADMIN_TOKEN", "t0k3n")
            ])
        )
        .is_ok()
    );
}

#[test]
fn syntax_errors_name_the_file() {
    let err = load_str("[listen\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["(syntax)"]);
    assert!(err.to_string().contains("outrigger.toml"));
}

#[test]
fn tools_are_validated() {
    let c = load_str(
        r#"
[[tools]]
name = "payments"
kind = "http"
base_url = "http://127.0.0.1:9000"
class = "keyed"
key_required = true

[[tools]]
name = "lookup"
kind = "http"
base_url = "http://127.0.0.1:9001"
class = "probe"
probe_path = "/status/{key}"
"#,
        &[],
    )
    .unwrap();
    assert_eq!(c.proxy.tools.len(), 2);
    assert_eq!(c.proxy.tools[0].class, ToolClass::Keyed);
    assert!(c.proxy.tools[0].key_required);
    let err = load_str(
        "[[tools]]\nname = \"x\"\nkind = \"http\"\nbase_url = \"http://127.0.0.1:1\"\nclass = \"probe\"\n",
        &[],
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["tools[0].probe_path"]);
    // MCP cannot be asked whether a call happened.
    let err = load_str(
        "[[tools]]\nname = \"m\"\nkind = \"mcp\"\nbase_url = \"http://127.0.0.1:1\"\nclass = \"probe\"\nprobe_path = \"/s/{key}\"\n",
        &[],
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["tools[0].class"]);
    assert!(err.to_string().contains("MCP"), "{err}");
    // A probe path that is not a path naming the key would probe the wrong place,
    // and a 404 there executes the call again.
    for bad in [
        "status/{key}",
        "/status?key={key}",
        "/status/{key}#x",
        "/status",
    ] {
        let err = load_str(
            &format!(
                "[[tools]]\nname = \"x\"\nkind = \"http\"\nbase_url = \"http://127.0.0.1:1/api/\"\nclass = \"probe\"\nprobe_path = {bad:?}\n"
            ),
            &[],
        )
        .unwrap_err();
        assert_eq!(paths(&err), ["tools[0].probe_path"], "{bad}");
    }
}

#[test]
fn out_of_range_counts_and_durations_are_refused() {
    for (toml, path) in [
        ("[listen]\nworkers = 100000\n", "listen.workers"),
        ("[gpu]\nwatch = [4294967296]\n", "gpu.watch[0]"),
        ("[budget]\nwall_clock = \"500us\"\n", "budget.wall_clock"),
    ] {
        let err = load_str(toml, &[]).unwrap_err();
        assert_eq!(paths(&err), [path], "{toml}");
    }
    assert!(load_str("[gpu]\nwatch = [4294967295]\n", &[]).is_ok());
    assert!(load_str("[budget]\nwall_clock = \"1ms\"\n", &[]).is_ok());
}

#[test]
fn out_of_range_sizes_and_unsendable_api_keys_are_refused() {
    let err = load_str("[journal]\ncache_bytes = 500000\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["journal.cache_bytes"]);
    for mb in ["0", "5000"] {
        let err = load_str(&format!("[policies]\nmemory_limit_mb = {mb}\n"), &[]).unwrap_err();
        assert_eq!(paths(&err), ["policies.memory_limit_mb"], "{mb}");
    }
    // A key mounted from a secret file ends in a newline: trimmed, and sent.
    let env = [("OPENAI_API_KEY".to_string(), "sk-test\n".to_string())];
    let c = load_str("", &env).unwrap();
    let key = c.proxy.providers[0].api_key.as_ref().expect("a key");
    assert_eq!(key.expose(), "sk-test");
    let env = [("OPENAI_API_KEY".to_string(), "sk test".to_string())];
    let err = load_str("", &env).unwrap_err();
    assert_eq!(paths(&err), ["(OPENAI_API_KEY)"]);
}

#[test]
fn environment_values_take_the_type_their_key_takes() {
    let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let c = load_str(
        "",
        &env(&[
            ("OUTRIGGER_ADMIN_TOKEN", "123456"),
            ("OUTRIGGER_RESILIENCE_RETRY_BUDGET_RATIO", "0.3"),
            ("OUTRIGGER_LIMITS_MAX_BODY_BYTES", "1024"),
            ("OUTRIGGER_STREAMS_REPLAY_IN_TASK", "false"),
        ]),
    )
    .unwrap();
    assert_eq!(c.admin_token.as_ref().map(|t| t.expose()), Some("123456"));
    assert_eq!(c.proxy.limits.max_body_bytes, 1024);
    assert!(!c.proxy.streams.replay_in_task);
    let err = load_str("", &env(&[("OUTRIGGER_LIMITS_MAX_BODY_BYTES", "lots")])).unwrap_err();
    assert_eq!(paths(&err), ["limits.max_body_bytes"]);
}

#[test]
fn every_wrong_type_is_reported_with_its_path() {
    let err = load_str(
        "[limits]\nmax_body_bytes = \"big\"\ncolour = 1\n[listen]\ndata = 7070\n\
         [[providers]]\nname = \"a\"\nprice_in = \"x\"\n",
        &[],
    )
    .unwrap_err();
    assert_eq!(
        paths(&err),
        [
            "limits.colour",
            "limits.max_body_bytes",
            "listen.data",
            "providers[0].price_in"
        ]
    );
}

#[test]
fn a_zero_duration_is_refused_wherever_zero_breaks_something() {
    let err = load_str(
        r#"
[limits]
connect_timeout = "0s"
first_byte_timeout = "0ms"
stream_idle_timeout = "0s"
client_stall_timeout = "0s"
client_read_timeout = "0s"

[drain]
deadline = "0s"

[journal]
tombstone_retention = "0s"
stream_retention = "0s"

[policies]
deadline = "0ms"
max_retry_delay = "0s"

[resilience]
retry_budget_window = "0s"
breaker_min_penalty = "0s"
breaker_max_penalty = "0s"
queue_timeout = "0s"

[budget]
wall_clock = "0s"

[streams]
detach_timeout = "0s"

[tasks]
idle_timeout = "0s"
retention = "0s"

[[tools]]
name = "payments"
kind = "http"
base_url = "http://127.0.0.1:9000"
timeout = "0s"
"#,
        &[],
    )
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "budget.wall_clock",
            "drain.deadline",
            "journal.stream_retention",
            "journal.tombstone_retention",
            "limits.client_read_timeout",
            "limits.client_stall_timeout",
            "limits.connect_timeout",
            "limits.first_byte_timeout",
            "limits.stream_idle_timeout",
            "policies.deadline",
            "policies.max_retry_delay",
            "resilience.breaker_max_penalty",
            "resilience.breaker_min_penalty",
            "resilience.queue_timeout",
            "resilience.retry_budget_window",
            "streams.detach_timeout",
            "tasks.idle_timeout",
            "tasks.retention",
            "tools[0].timeout",
        ]
    );
    let text = err.to_string();
    assert!(
        text.contains("tools[0].timeout: must be greater than 0: every call would time out"),
        "{text}"
    );
    assert!(
        text.contains("streams.cancel_on_disconnect = true"),
        "the detach timeout says what to set instead: {text}"
    );
}

#[test]
fn a_bad_duration_is_one_problem_not_two() {
    let err = load_str("[budget]\nwall_clock = \"soon\"\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["budget.wall_clock"]);
    assert!(err.to_string().contains("is not a duration"), "{err}");
}

#[test]
fn the_first_breaker_penalty_cannot_exceed_the_longest() {
    let err = load_str(
        "[resilience]\nbreaker_min_penalty = \"2m\"\nbreaker_max_penalty = \"1m\"\n",
        &[],
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["resilience.breaker_min_penalty"]);
    assert!(err.to_string().contains("2m is longer than"), "{err}");
}

#[test]
fn tool_redactions_are_checked() {
    let tool = |extra: &str| {
        format!(
            "[[tools]]\nname = \"t\"\nkind = \"http\"\nbase_url = \"http://127.0.0.1:9\"\n{extra}\n"
        )
    };
    let c = load_str(
        &tool("redact_headers = [\"X-Tenant-Pin\"]\nredact_json = [\"/card/number\"]"),
        &[],
    )
    .unwrap();
    let r = &c.proxy.tools[0].redact;
    assert_eq!(r.headers, [http::HeaderName::from_static("x-tenant-pin")]);
    assert_eq!(r.json, ["/card/number"]);
    let err = load_str(
        &tool("redact_headers = [\"bad header\"]\nredact_json = [\"card\", \"\"]"),
        &[],
    )
    .unwrap_err();
    assert_eq!(
        paths(&err),
        [
            "tools[0].redact_headers[0]",
            "tools[0].redact_json[0]",
            "tools[0].redact_json[1]"
        ]
    );
    assert!(err.to_string().contains("must start with '/'"), "{err}");
}

#[test]
fn a_tool_name_is_at_most_64_characters() {
    let tool = |name: &str| {
        format!(
            "[[tools]]\nname = \"{name}\"\nkind = \"http\"\nbase_url = \"http://127.0.0.1:9\"\n"
        )
    };
    assert!(load_str(&tool(&"t".repeat(64)), &[]).is_ok());
    let err = load_str(&tool(&"t".repeat(65)), &[]).unwrap_err();
    assert_eq!(paths(&err), ["tools[0].name"]);
    assert!(err.to_string().contains("1 to 64"), "{err}");
}

#[test]
fn max_attempts_defaults_to_10_and_is_bounded() {
    let c = load_str("", &[]).unwrap();
    assert_eq!(c.proxy.resilience.max_attempts, 10);
    let c = load_str("[resilience]\nmax_attempts = 1\n", &[]).unwrap();
    assert_eq!(c.proxy.resilience.max_attempts, 1);
    for bad in ["0", "101"] {
        let err = load_str(&format!("[resilience]\nmax_attempts = {bad}\n"), &[]).unwrap_err();
        assert_eq!(paths(&err), ["resilience.max_attempts"]);
        assert!(err.to_string().contains("between 1 and 100"), "{err}");
    }
}

#[test]
fn a_configured_fatal_xid_wins_over_the_built_in_ignore_list() {
    let c = load_str("[gpu]\nfatal_xids = [13, 79]\n", &[]).unwrap();
    assert!(c.gpu.fatal_xids.contains(&13));
    assert!(
        c.gpu.ignored_xids.contains(&13),
        "the ignore list is not edited"
    );
    let err = load_str("[gpu]\nwatch = []\nsample_interval = \"0s\"\n", &[]);
    // An empty watch list is "all"; a zero interval is named by its own key.
    assert_eq!(paths(&err.unwrap_err()), ["gpu.sample_interval"]);
}

#[test]
fn the_admin_token_is_trimmed_and_a_blank_one_refused() {
    // As a Kubernetes secret created from a file hands it over: newline included.
    let c = load_str("[admin]\ntoken = \"s3cret\\n\"\n", &[]).unwrap();
    assert_eq!(c.admin_token.as_ref().map(|t| t.expose()), Some("s3cret"));
    let c = load(None, &env(&[("OUTRIGGER_ADMIN_TOKEN", " s3cret\r\n")])).unwrap();
    assert_eq!(c.admin_token.as_ref().map(|t| t.expose()), Some("s3cret"));

    for blank in ["[admin]\ntoken = \" \"\n", "[admin]\ntoken = \"\\n\\t\"\n"] {
        let err = load_str(blank, &[]).unwrap_err();
        assert_eq!(paths(&err), ["admin.token"], "{blank:?}");
        assert!(err.to_string().contains("only whitespace"), "{err}");
    }
    // A blank token does not count as set: a public admin bind still needs one.
    let err = load_str(
        "[listen]\nadmin = \"0.0.0.0:7071\"\n[admin]\ntoken = \" \"\n",
        &[],
    )
    .unwrap_err();
    assert_eq!(paths(&err), ["admin.token", "admin.token"]);

    let err = load_str("[admin]\ntoken = \"ab\\u0000cd\"\n", &[]).unwrap_err();
    assert!(err.to_string().contains("control character"), "{err}");
    // Empty is "no token", as before.
    assert!(
        load_str("[admin]\ntoken = \"\"\n", &[])
            .unwrap()
            .admin_token
            .is_none()
    );
}

#[test]
fn the_gpu_sample_interval_is_bounded() {
    let c = load_str("[gpu]\nsample_interval = \"200ms\"\n", &[]).unwrap();
    assert_eq!(c.gpu.sample_interval, Duration::from_millis(200));
    for outside in ["50ms", "10s"] {
        let err = load_str(&format!("[gpu]\nsample_interval = {outside:?}\n"), &[]).unwrap_err();
        assert_eq!(paths(&err), ["gpu.sample_interval"]);
        assert!(
            err.to_string()
                .contains(&format!("{outside} is outside 100ms..=5s")),
            "{err}"
        );
    }
}

#[test]
fn a_problem_with_a_value_from_the_environment_names_the_variable() {
    let err = load_str(
        "[gpu]\nsample_interval = \"5s\"\n[limits]\nconnect_timeout = \"0s\"\n",
        &env(&[
            ("OUTRIGGER_GPU_SAMPLE_INTERVAL", "10s"),
            ("OUTRIGGER_LIMITS_MAX_BODY_BYTES", "lots"),
            ("OUTRIGGER_TOOLS_TIMEOUT", "1s"),
        ]),
    );
    let err = err.unwrap_err();
    // Type errors stop validation: the wrong type alone is reported, with its variable.
    assert_eq!(paths(&err), ["limits.max_body_bytes"]);
    assert_eq!(
        err.problems[0].from_env.as_deref(),
        Some("OUTRIGGER_LIMITS_MAX_BODY_BYTES")
    );
    assert!(
        err.to_string()
            .contains("  - limits.max_body_bytes (from OUTRIGGER_LIMITS_MAX_BODY_BYTES): "),
        "{err}"
    );

    let err = load_str(
        "[gpu]\nsample_interval = \"5s\"\n[limits]\nconnect_timeout = \"0s\"\n",
        &env(&[
            ("OUTRIGGER_GPU_SAMPLE_INTERVAL", "10s"),
            ("OUTRIGGER_ADMIN_TOKEN", " "),
            ("OUTRIGGER_LIMITS_MAX_BODY", "1"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
        ]),
    )
    .unwrap_err();
    let text = err.to_string();
    for line in [
        "  - gpu.sample_interval (from OUTRIGGER_GPU_SAMPLE_INTERVAL): 10s is outside",
        "  - admin.token (from OUTRIGGER_ADMIN_TOKEN): is only whitespace",
        "  - limits.max_body (from OUTRIGGER_LIMITS_MAX_BODY): unknown key",
        "  - telemetry.otlp_endpoint (from OTEL_EXPORTER_OTLP_ENDPOINT): ",
        // From the file: no variable.
        "  - limits.connect_timeout: must be greater than 0",
    ] {
        assert!(text.contains(line), "{line:?} missing in:\n{text}");
    }
}

#[test]
fn every_section_with_scalar_keys_takes_overrides_of_any_scalar_type() {
    let c = load_str(
        "",
        &env(&[
            ("OUTRIGGER_STREAMS_DETACH_TIMEOUT", "2m"),
            ("OUTRIGGER_STREAMS_MAX_STREAM_BYTES", "1048576"),
            ("OUTRIGGER_BUDGET_COST", "1.5"),
            ("OUTRIGGER_GPU_ENABLED", "false"),
            ("OUTRIGGER_TASKS_RETENTION", "1h"),
        ]),
    )
    .unwrap();
    assert_eq!(c.proxy.streams.detach_timeout, Duration::from_secs(120));
    assert_eq!(c.proxy.streams.max_stream_bytes, 1 << 20);
    assert_eq!(c.proxy.budget.limits.cost_micros, Some(1_500_000));
    assert!(!c.gpu.enabled);
    assert_eq!(c.tasks.retention, Duration::from_secs(3600));
}

/// An empty override is as if unset: an empty `OUTRIGGER_ADMIN_TOKEN` (a secret that
/// was not mounted) leaves the file's token in force, and is named for the log.
#[test]
fn an_empty_environment_override_is_ignored() {
    let vars = env(&[
        ("OUTRIGGER_ADMIN_TOKEN", ""),
        ("OUTRIGGER_LIMITS_MAX_BODY_BYTES", ""),
    ]);
    let c = load_str("[admin]\ntoken = \"from-file\"\n", &vars).unwrap();
    assert_eq!(
        c.admin_token.as_ref().map(|t| t.expose()),
        Some("from-file")
    );
    assert_eq!(c.proxy.limits.max_body_bytes, 8 << 20);
    assert_eq!(
        super::empty_env(&vars),
        ["OUTRIGGER_ADMIN_TOKEN", "OUTRIGGER_LIMITS_MAX_BODY_BYTES"]
    );
}

/// Limits that would make every stream fail, or a retry budget never refill, are
/// refused with their key.
#[test]
fn limits_too_small_to_work_are_refused() {
    let err = load_str(
        "[limits]\nmax_event_bytes = 0\n[streams]\nmax_stream_bytes = 100\n\
         [resilience]\nretry_budget_window = \"5ns\"\n",
        &[],
    )
    .unwrap_err();
    let mut got = paths(&err);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "limits.max_event_bytes",
            "resilience.retry_budget_window",
            "streams.max_stream_bytes"
        ]
    );
    load_str(
        "[limits]\nmax_event_bytes = 4096\n[streams]\nmax_stream_bytes = 65536\n\
         [resilience]\nretry_budget_window = \"100ms\"\n",
        &[],
    )
    .expect("the smallest accepted values");
}

/// A duration a clock cannot add (it would panic at the first request) is refused.
#[test]
fn a_duration_past_1000_years_is_refused() {
    let err = load_str("[limits]\nclient_read_timeout = \"300000000000y\"\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["limits.client_read_timeout"]);
    assert!(err.to_string().contains("1000 years"), "{err}");
    load_str("[journal]\nretention = \"1000years\"\n", &[]).expect("1000 years is accepted");
}

#[test]
fn listeners_that_cannot_both_be_bound_are_a_config_problem() {
    for (data, admin) in [
        ("127.0.0.1:7070", "127.0.0.1:7070"),
        ("0.0.0.0:7070", "127.0.0.1:7070"),
        ("127.0.0.1:7070", "0.0.0.0:7070"),
        ("[::]:7070", "127.0.0.1:7070"),
        ("[::1]:7070", "[::]:7070"),
    ] {
        let toml =
            format!("[listen]\ndata = \"{data}\"\nadmin = \"{admin}\"\n[admin]\ntoken = \"t\"\n");
        let err = load_str(&toml, &[]).unwrap_err();
        assert_eq!(paths(&err), ["listen.admin"], "{data} {admin}");
    }
    for (data, admin) in [
        ("127.0.0.1:7070", "127.0.0.2:7070"),
        ("0.0.0.0:7070", "[::1]:7070"),
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("0.0.0.0:7070", "127.0.0.1:7071"),
    ] {
        let toml =
            format!("[listen]\ndata = \"{data}\"\nadmin = \"{admin}\"\n[admin]\ntoken = \"t\"\n");
        assert!(load_str(&toml, &[]).is_ok(), "{data} {admin}");
    }
}

#[test]
fn the_journal_lock_wait() {
    assert_eq!(
        load(None, &[]).unwrap().journal_lock_wait,
        Duration::from_secs(60)
    );
    let c = load_str("[journal]\nlock_wait = \"0s\"\n", &[]).unwrap();
    assert_eq!(c.journal_lock_wait, Duration::ZERO);
    let err = load_str("[journal]\nlock_wait = \"soon\"\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["journal.lock_wait"]);
}

#[test]
fn a_continuation_is_a_named_recipe_and_openai_takes_only_instruction() {
    let provider = |kind: &str, continuation: &str| {
        format!(
            "[[providers]]\nname = \"p\"\nkind = \"{kind}\"\nbase_url = \"http://127.0.0.1:1\"\n\
             models = [\"*\"]\ncontinuation = \"{continuation}\"\n"
        )
    };
    let c = load_str(&provider("anthropic", "prefill"), &[]).unwrap();
    assert_eq!(
        c.proxy.providers[0].caps.continuation,
        Some(popts::Continuation::Prefill)
    );
    assert_eq!(c.proxy.streams.max_continuations, 1);
    let c = load_str(&provider("anthropic", "instruction"), &[]).unwrap();
    assert_eq!(
        c.proxy.providers[0].caps.continuation,
        Some(popts::Continuation::Instruction)
    );
    let c = load_str(&provider("openai", "instruction"), &[]).unwrap();
    assert_eq!(
        c.proxy.providers[0].caps.continuation,
        Some(popts::Continuation::Instruction)
    );
    let err = load_str(&provider("openai", "prefill"), &[]).unwrap_err();
    assert_eq!(paths(&err), ["providers[0].continuation"]);
    assert!(err.to_string().contains("\"instruction\""), "{err}");
    let err = load_str(&provider("anthropic", "stitch"), &[]).unwrap_err();
    assert_eq!(paths(&err), ["providers[0].continuation"]);
    assert!(err.to_string().contains("\"prefill\""), "{err}");
    let err = load_str("[streams]\nmax_continuations = 6\n", &[]).unwrap_err();
    assert_eq!(paths(&err), ["streams.max_continuations"]);
    let c = load_str("[streams]\nmax_continuations = 0\n", &[]).unwrap();
    assert_eq!(c.proxy.streams.max_continuations, 0);
}
