//! What the operator watches while a drill runs: `/readyz` and `/metrics`, polled on
//! a short period so that detection times are measured (not guessed), and the
//! Prometheus exposition read back into numbers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::http::Admin;

/// How often the watcher samples readiness and metrics.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// A Prometheus / OpenMetrics text exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    samples: Vec<Sample>,
}

#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Exposition {
    pub fn parse(text: &str) -> Self {
        Self {
            samples: text
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .filter_map(parse_line)
                .collect(),
        }
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = f64> + 'a {
        self.samples
            .iter()
            .filter(move |s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
            })
            .map(|s| s.value)
    }

    /// The sum of the samples of `name` carrying every label of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).sum()
    }

    /// The largest such sample, if there is one.
    pub fn max(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, labels).reduce(f64::max)
    }
}

/// `name{k="v",…} value [timestamp] [# exemplar]`.
fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => (&line[..i], &line[i..]),
        None => return None,
    };
    let (labels, rest) = if let Some(body) = rest.strip_prefix('{') {
        let (labels, used) = parse_labels(body)?;
        (labels, &body[used..])
    } else {
        (Vec::new(), rest)
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Labels up to the closing `}`; returns them and the bytes consumed (the `}`
/// included). Values are quoted with `\\`, `\"` and `\n` escapes.
fn parse_labels(body: &str) -> Option<(Vec<(String, String)>, usize)> {
    let mut labels = Vec::new();
    let bytes = body.as_bytes();
    let mut i = 0;
    loop {
        while i < bytes.len() && matches!(bytes[i], b',' | b' ') {
            i += 1;
        }
        if i >= bytes.len() {
            return None;
        }
        if bytes[i] == b'}' {
            return Some((labels, i + 1));
        }
        let eq = body[i..].find('=')? + i;
        let key = body[i..eq].trim().to_owned();
        if bytes.get(eq + 1) != Some(&b'"') {
            return None;
        }
        let mut value = String::new();
        let mut j = eq + 2;
        loop {
            let c = body[j..].chars().next()?;
            match c {
                '\\' => {
                    let next = body[j + 1..].chars().next()?;
                    value.push(if next == 'n' { '\n' } else { next });
                    j += 1 + next.len_utf8();
                }
                '"' => {
                    j += 1;
                    break;
                }
                c => {
                    value.push(c);
                    j += c.len_utf8();
                }
            }
        }
        labels.push((key, value));
        i = j;
    }
}

/// One look at the sidecar.
#[derive(Debug, Clone)]
pub struct Look {
    /// Milliseconds since the scenario's t0.
    pub at_ms: u64,
    /// `None`: the admin plane did not answer (the process is gone).
    pub ready: Option<bool>,
    pub reasons: Vec<String>,
    pub metrics: Option<Arc<Exposition>>,
}

/// Samples `/readyz` and `/metrics` in the background until dropped.
pub struct Watcher {
    looks: Arc<Mutex<Vec<Look>>>,
    task: JoinHandle<()>,
}

impl Watcher {
    pub fn start(admin: Admin, t0: Instant) -> Self {
        let looks = Arc::new(Mutex::new(Vec::new()));
        let sink = looks.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let look = look(&admin, t0).await;
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(look);
            }
        });
        Self { looks, task }
    }

    pub fn looks(&self) -> Vec<Look> {
        self.looks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The first look at or after `from_ms` that satisfies `check`.
    pub fn first_after(&self, from_ms: u64, check: impl Fn(&Look) -> bool) -> Option<u64> {
        self.looks()
            .into_iter()
            .filter(|l| l.at_ms >= from_ms)
            .find(|l| check(l))
            .map(|l| l.at_ms)
    }

    /// Waits (bounded) until a look after `from_ms` satisfies `check`.
    pub async fn wait_for(
        &self,
        from_ms: u64,
        within: Duration,
        check: impl Fn(&Look) -> bool,
    ) -> Option<u64> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(at) = self.first_after(from_ms, &check) {
                return Some(at);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(SAMPLE_EVERY / 2).await;
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn look(admin: &Admin, t0: Instant) -> Look {
    let (ready, metrics) = tokio::join!(admin.get("/readyz"), admin.get("/metrics"));
    let at_ms = ms(t0.elapsed());
    let (ready, reasons) = match ready {
        Ok(r) => {
            let doc = r.json();
            let reasons = doc["reasons"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (Some(r.status.is_success()), reasons)
        }
        Err(_) => (None, Vec::new()),
    };
    let metrics = metrics
        .ok()
        .filter(|r| r.status.is_success())
        .map(|r| Arc::new(Exposition::parse(&r.text())));
    Look {
        at_ms,
        ready,
        reasons,
        metrics,
    }
}

/// Scrapes `/metrics` once.
pub async fn scrape(admin: &Admin) -> Result<Exposition, String> {
    let reply = admin
        .get("/metrics")
        .await
        .map_err(|e| format!("GET /metrics: {e}"))?;
    if !reply.status.is_success() {
        return Err(format!("GET /metrics answered {}", reply.status));
    }
    Ok(Exposition::parse(&reply.text()))
}

pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One SLO's counts as `GET /v1/slo` reports them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SloCounts {
    pub target: f64,
    pub good: u64,
    pub bad_by_cause: BTreeMap<String, u64>,
}

impl SloCounts {
    pub fn bad(&self) -> u64 {
        self.bad_by_cause.values().sum()
    }
}

/// Every SLO's counts, by name.
pub async fn slo_counts(admin: &Admin) -> Result<BTreeMap<String, SloCounts>, String> {
    let doc = admin.get_json("/v1/slo").await?;
    let mut out = BTreeMap::new();
    for slo in doc["slos"].as_array().into_iter().flatten() {
        let Some(name) = slo["name"].as_str() else {
            continue;
        };
        let bad_by_cause = slo["bad_by_cause"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_u64().filter(|n| *n > 0).map(|n| (k.clone(), n)))
                    .collect()
            })
            .unwrap_or_default();
        out.insert(
            name.to_owned(),
            SloCounts {
                target: slo["target"].as_f64().unwrap_or(0.0),
                good: slo["good"].as_u64().unwrap_or(0),
                bad_by_cause,
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expositions_parse_with_labels_escapes_and_exemplars() {
        let text = "# HELP x y\n# TYPE outrigger_retries counter\n\
            outrigger_retries_total{target=\"mock\",reason=\"rate_limited\"} 3\n\
            outrigger_retries_total{target=\"other\",reason=\"server_error\"} 2 # {trace_id=\"ab\"} 1.0\n\
            outrigger_faults_active 1\n\
            weird{v=\"a\\\"b,}\"} 7\n\
            # EOF\n";
        let e = Exposition::parse(text);
        assert_eq!(e.sum("outrigger_retries_total", &[]), 5.0);
        assert_eq!(e.sum("outrigger_retries_total", &[("target", "mock")]), 3.0);
        assert_eq!(e.max("outrigger_faults_active", &[]), Some(1.0));
        assert_eq!(e.sum("weird", &[("v", "a\"b,}")]), 7.0);
        assert_eq!(e.max("absent", &[]), None);
    }
}
