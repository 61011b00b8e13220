//! What the drill drives, read from the user's configuration exactly as `serve`
//! reads it, and the derived configuration each scenario's sidecar runs on.
//!
//! The derived configuration is the user's file with only what a drill must own
//! replaced: loopback listeners on port 0, a journal of its own, a policy directory
//! holding a copy of the built-in retry component (the hot-swap scenario replaces
//! it), the NVML stub where a scenario asks for it, drill SLOs when the user
//! declared none, and no configured faults (the drill injects its own at run time).
//! Providers, tools, limits and resilience settings are the user's: they are what
//! is under test.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use outrigger_proxy::options::{Dialect, ModelPattern, ToolKind};
use outrigger_types::ToolClass;
use serde_json::json;

use super::Error;
use crate::config::{self, Config};

/// The environment variables that would override what the derived config owns.
const OWNED_ENV_PREFIXES: [&str; 4] = [
    "OUTRIGGER_LISTEN_",
    "OUTRIGGER_JOURNAL_DIR",
    "OUTRIGGER_POLICIES_DIR",
    "OUTRIGGER_GPU_",
];

/// The model the drill asks for, and where.
#[derive(Debug, Clone)]
pub struct ProviderPlan {
    pub name: String,
    pub dialect: Dialect,
    pub model: String,
}

/// An HTTP tool the drill calls.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    pub name: String,
    pub class: ToolClass,
    /// The tool's base URL, without a trailing `/`.
    pub base_url: String,
    /// Where the tool says whether a key's effect happened (`{key}` is replaced):
    /// the tool's `probe_path`, else `/status/{key}`.
    pub status_path: String,
}

/// Everything the drill derives from the user's configuration.
#[derive(Debug, Clone)]
pub struct Plan {
    pub config: Config,
    /// The configuration file as written (an empty table for the embedded defaults).
    pub table: toml::Table,
    pub provider: ProviderPlan,
    pub tools: Vec<ToolPlan>,
    /// SHA-256 (via JCS) of the file text and the `OUTRIGGER_*` environment.
    pub config_hash: String,
    pub admin_token: Option<String>,
}

impl Plan {
    /// Reads and checks the configuration: what `serve` would accept, with only
    /// loopback upstreams unless `allow_remote`, and at least one provider and one
    /// HTTP tool to drive.
    pub fn read(
        path: Option<&Path>,
        env: &[(String, String)],
        allow_remote: bool,
    ) -> Result<Self, Error> {
        let config = config::load(path, env).map_err(|e| Error::Usage(e.to_string()))?;
        let text = match path {
            Some(p) => {
                std::fs::read_to_string(p).map_err(|e| Error::io("read the config", p, e))?
            }
            None => String::new(),
        };
        let table: toml::Table = text
            .parse()
            .map_err(|e| Error::Usage(format!("{}: {e}", config.source)))?;

        let mut problems = Vec::new();
        if !allow_remote {
            for p in &config.proxy.providers {
                if !is_loopback(&p.base_url) {
                    problems.push(format!(
                        "provider {:?} is at {}, which is not loopback",
                        p.name, p.base_url
                    ));
                }
            }
            for t in &config.proxy.tools {
                if !is_loopback(&t.base_url) {
                    problems.push(format!(
                        "tool {:?} is at {}, which is not loopback",
                        t.name, t.base_url
                    ));
                }
            }
            if !problems.is_empty() {
                problems.push(
                    "a drill injects faults and performs real side effects: run it against \
                     loopback upstreams, or pass --allow-remote if you mean it"
                        .to_owned(),
                );
            }
        }
        let provider = match config.proxy.providers.first() {
            None => {
                problems.push(
                    "no model provider is configured: the drill needs one (an [[providers]] entry \
                     of kind \"openai\" or \"anthropic\", or OPENAI_API_KEY / ANTHROPIC_API_KEY)"
                        .to_owned(),
                );
                None
            }
            Some(p) => match choose_model(p.caps.default_model.as_deref(), &p.models) {
                Some(model) => Some(ProviderPlan {
                    name: p.name.clone(),
                    dialect: p.dialect,
                    model,
                }),
                None => {
                    problems.push(format!(
                        "provider {:?} serves any model (\"*\"): set its default_model so the \
                         drill knows which model to ask for",
                        p.name
                    ));
                    None
                }
            },
        };
        let tools: Vec<ToolPlan> = config
            .proxy
            .tools
            .iter()
            .filter(|t| t.kind == ToolKind::Http)
            .map(|t| ToolPlan {
                name: t.name.clone(),
                class: t.class,
                base_url: t.base_url.to_string().trim_end_matches('/').to_owned(),
                status_path: t
                    .probe_path
                    .clone()
                    .unwrap_or_else(|| "/status/{key}".to_owned()),
            })
            .collect();
        if tools.is_empty() {
            problems.push(
                "no HTTP tool is configured: the drill needs one to journal side effects against \
                 (a [[tools]] entry with kind = \"http\")"
                    .to_owned(),
            );
        }
        let (Some(provider), true) = (provider, problems.is_empty()) else {
            return Err(Error::Usage(format!(
                "{} cannot be drilled:\n  - {}",
                config.source,
                problems.join("\n  - ")
            )));
        };
        let mut overrides: Vec<(&String, &String)> = env
            .iter()
            .filter(|(k, _)| k.starts_with("OUTRIGGER_"))
            .map(|(k, v)| (k, v))
            .collect();
        overrides.sort();
        let config_hash = outrigger_proxy::keys::fingerprint(&json!({
            "file": text,
            "env": overrides,
        }))
        .to_hex();
        let admin_token = config.admin_token.as_ref().map(|t| t.expose().to_owned());
        Ok(Self {
            config,
            table,
            provider,
            tools,
            config_hash,
            admin_token,
        })
    }
}

/// A model name the provider serves: its default, an exact name, or a prefix
/// pattern's stem; `None` when it only has `*`.
pub fn choose_model(default: Option<&str>, patterns: &[ModelPattern]) -> Option<String> {
    if let Some(d) = default {
        return Some(d.to_owned());
    }
    let names = patterns.iter().filter_map(|p| match p {
        ModelPattern::Name(n) => Some(n),
        ModelPattern::Any => None,
    });
    let mut prefix = None;
    for n in names {
        match n.strip_suffix('*') {
            None => return Some(n.clone()),
            Some(stem) if !stem.is_empty() && prefix.is_none() => prefix = Some(stem.to_owned()),
            Some(_) => {}
        }
    }
    prefix
}

/// Loopback means a literal loopback address or `localhost`: the drill resolves
/// nothing, so any other name counts as remote.
pub fn is_loopback(url: &http::Uri) -> bool {
    let Some(host) = url.host() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// What one scenario's sidecar runs with, besides the plan.
#[derive(Debug, Clone, Default)]
pub struct Derive<'a> {
    /// `[gpu] library` = the NVML stub, sampled fast.
    pub nvml_stub: Option<&'a Path>,
}

/// A derived configuration written to disk.
#[derive(Debug, Clone)]
pub struct Derived {
    pub config: PathBuf,
    /// The retry component the derived config binds (what hot swap replaces).
    pub retry_component: PathBuf,
    /// Variables of the drill's environment the child must not inherit.
    pub env_remove: Vec<String>,
}

/// Writes `dir/outrigger.toml`, `dir/policies/` and `dir/data/` for one scenario.
/// `policy_cache` is shared by the run's sidecars, so only the first one compiles
/// the policy components.
pub fn derive(
    plan: &Plan,
    dir: &Path,
    policy_cache: &Path,
    env: &[(String, String)],
    options: &Derive<'_>,
) -> Result<Derived, Error> {
    let data_dir = dir.join("data");
    let policy_dir = dir.join("policies");
    for d in [&data_dir, &policy_dir, &policy_cache.to_path_buf()] {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create", d, e))?;
    }
    share_cache(&data_dir.join("policy-cache"), policy_cache)?;

    let mut t = plan.table.clone();
    t.remove("faults");
    let mut listen = take_section(&mut t, "listen");
    listen.insert("data".into(), "127.0.0.1:0".into());
    listen.insert("admin".into(), "127.0.0.1:0".into());
    t.insert("listen".into(), toml::Value::Table(listen));
    let mut journal = take_section(&mut t, "journal");
    journal.insert("dir".into(), path_value(&data_dir));
    t.insert("journal".into(), toml::Value::Table(journal));

    let retry_component = policy_dir.join("retry.wasm");
    std::fs::write(
        &retry_component,
        tagged_component(outrigger_builtins::RETRY, "v1"),
    )
    .map_err(|e| Error::io("write", &retry_component, e))?;
    let user_dir = plan.config.policies.dir.clone();
    let mut policies = take_section(&mut t, "policies");
    policies.insert("dir".into(), path_value(&policy_dir));
    let mut bindings = match policies.remove("bindings") {
        Some(toml::Value::Array(a)) => a,
        _ => Vec::new(),
    };
    let mut retry_bound = false;
    for b in bindings.iter_mut() {
        let Some(b) = b.as_table_mut() else { continue };
        let hook = b.get("hook").and_then(|v| v.as_str()).unwrap_or_default();
        if hook == "retry" {
            b.insert("policy".into(), "retry".into());
            retry_bound = true;
            continue;
        }
        // Another binding naming a file of the user's policy directory: the derived
        // directory replaces that one, so the file comes along.
        let policy = b.get("policy").and_then(|v| v.as_str()).unwrap_or_default();
        let named = !policy.starts_with("builtin:")
            && !policy.ends_with(".wasm")
            && !policy.contains('/')
            && !policy.is_empty();
        if let (true, Some(src_dir)) = (named, &user_dir) {
            let file = format!("{policy}.wasm");
            let from = src_dir.join(&file);
            let to = policy_dir.join(&file);
            std::fs::copy(&from, &to).map_err(|e| Error::io("copy the policy", &from, e))?;
        }
    }
    if !retry_bound {
        let mut b = toml::Table::new();
        b.insert("hook".into(), "retry".into());
        b.insert("policy".into(), "retry".into());
        bindings.push(toml::Value::Table(b));
    }
    policies.insert("bindings".into(), toml::Value::Array(bindings));
    t.insert("policies".into(), toml::Value::Table(policies));

    let mut env_remove: Vec<String> = env
        .iter()
        .map(|(k, _)| k)
        .filter(|k| {
            OWNED_ENV_PREFIXES
                .iter()
                .any(|p| k.starts_with(p) && (p.ends_with('_') || k.as_str() == *p))
        })
        .cloned()
        .collect();
    if let Some(stub) = options.nvml_stub {
        let mut gpu = take_section(&mut t, "gpu");
        gpu.insert("enabled".into(), true.into());
        gpu.insert("library".into(), path_value(stub));
        gpu.insert("sample_interval".into(), "200ms".into());
        t.insert("gpu".into(), toml::Value::Table(gpu));
    } else {
        // The user's [gpu] stands; only their environment overrides of it go.
        env_remove.retain(|k| !k.starts_with("OUTRIGGER_GPU_"));
    }
    if plan.config.slos.is_empty() {
        t.insert("slos".into(), toml::Value::Array(drill_slos()));
    }

    let text = toml::to_string(&t)
        .map_err(|e| Error::Usage(format!("cannot write the derived config: {e}")))?;
    let config_path = dir.join("outrigger.toml");
    std::fs::write(&config_path, text).map_err(|e| Error::io("write", &config_path, e))?;
    // The child must accept it: check here, where the message can say whose fault it is.
    let child_env: Vec<(String, String)> = env
        .iter()
        .filter(|(k, _)| !env_remove.contains(k))
        .cloned()
        .collect();
    config::load(Some(&config_path), &child_env).map_err(|e| {
        Error::Start(format!(
            "the derived config is not valid (a drill bug; please report it):\n{e}"
        ))
    })?;
    Ok(Derived {
        config: config_path,
        retry_component,
        env_remove,
    })
}

/// The SLOs the drill defines when the user's config has none: the error budget
/// must be reported against something.
fn drill_slos() -> Vec<toml::Value> {
    let slo = |name: &str, object: &str, metric: &str| {
        let mut t = toml::Table::new();
        t.insert("name".into(), name.into());
        t.insert("object".into(), object.into());
        t.insert("metric".into(), metric.into());
        t.insert("target".into(), 0.999.into());
        t.insert("window".into(), "28d".into());
        t.insert(
            "exclusions".into(),
            toml::Value::Array(vec![
                "invalid_client".into(),
                "client_cancelled".into(),
                "maintenance".into(),
            ]),
        );
        t.insert(
            "data_source".into(),
            "prometheus:outrigger_slo_events_total".into(),
        );
        toml::Value::Table(t)
    };
    vec![
        slo("drill-model-availability", "model_calls", "availability"),
        slo("drill-tool-success", "tool_calls", "tool_success"),
    ]
}

/// Takes `[name]` out of the table (an empty one when absent or not a table); the
/// caller puts it back changed.
fn take_section(t: &mut toml::Table, name: &str) -> toml::Table {
    match t.remove(name) {
        Some(toml::Value::Table(section)) => section,
        _ => toml::Table::new(),
    }
}

fn path_value(p: &Path) -> toml::Value {
    toml::Value::String(p.display().to_string())
}

/// The data directory's policy cache is a link to the run's shared one.
fn share_cache(link: &Path, shared: &Path) -> Result<(), Error> {
    if link.exists() {
        return Ok(());
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(shared, link).map_err(|e| Error::io("link", link, e))
    }
    #[cfg(not(unix))]
    {
        let _ = shared;
        std::fs::create_dir_all(link).map_err(|e| Error::io("create", link, e))
    }
}

/// A copy of a component with a custom section appended: the same behaviour under a
/// different content hash, hence a new policy version. Custom sections (id 0) are
/// valid anywhere in a component and carry no semantics.
pub fn tagged_component(bytes: &[u8], tag: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let low = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(low);
                return;
            }
            out.push(low | 0x80);
        }
    }
    let name = b"outrigger-drill";
    let mut payload = Vec::new();
    leb(name.len(), &mut payload);
    payload.extend_from_slice(name);
    payload.extend_from_slice(tag.as_bytes());
    let mut out = bytes.to_vec();
    out.push(0);
    leb(payload.len(), &mut out);
    out.extend_from_slice(&payload);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_literal_or_localhost() {
        for (url, want) in [
            ("http://127.0.0.1:9/v1", true),
            ("http://127.9.9.9", true),
            ("http://[::1]:80", true),
            ("http://localhost:8080", true),
            ("https://api.openai.com/v1", false),
            ("http://10.0.0.1", false),
            ("http://example.localhost.evil.com", false),
        ] {
            let uri: http::Uri = url.parse().unwrap();
            assert_eq!(is_loopback(&uri), want, "{url}");
        }
    }

    #[test]
    fn the_model_comes_from_default_exact_or_prefix() {
        let p = |s: &[&str]| s.iter().map(|x| ModelPattern::parse(x)).collect::<Vec<_>>();
        assert_eq!(choose_model(Some("d"), &p(&["*"])).as_deref(), Some("d"));
        assert_eq!(
            choose_model(None, &p(&["gpt-4o*", "o3"])).as_deref(),
            Some("o3")
        );
        assert_eq!(
            choose_model(None, &p(&["gpt-4o*"])).as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(choose_model(None, &p(&["*"])), None);
    }

    #[test]
    fn a_tagged_component_only_grows_a_custom_section() {
        let base = outrigger_builtins::RETRY;
        let v1 = tagged_component(base, "v1");
        let v2 = tagged_component(base, "v2");
        assert!(v1.starts_with(base));
        assert_ne!(v1, v2);
        let tail = &v1[base.len()..];
        assert_eq!(tail[0], 0, "a custom section id");
        assert!(tail.ends_with(b"outrigger-drillv1"));
    }
}
