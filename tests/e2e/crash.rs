//! The sidecar killed with SIGKILL at seeded points during tool calls, restarted on
//! the same data directory, and every call retried with its key: no effect is
//! duplicated, no acknowledged result is lost, and calls left in doubt are treated as
//! their tool class says (keyed: re-sent with the same key; unsafe: held).
//!
//! `OUTRIGGER_CRASH_KILLS` sets the number of kills (50 by default; `cargo xtask soak`
//! runs 1,000). The test prints its figures on one line.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use outrigger_testing::checker::{self, Outcome};
use outrigger_testing::tool::{MockTool, ToolBehaviour};
use serde_json::json;

use crate::support::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What one attempt told the client.
enum Seen {
    Acked(Bytes),
    Unknown,
    Refused,
}

async fn attempt(sidecar_url: &str, tool: &str, key: &str, delay_ms: u64) -> Seen {
    let url = format!("{sidecar_url}/tools/{tool}/op");
    let req = request(
        http::Method::POST,
        &url,
        &[
            ("content-type", "application/json"),
            ("idempotency-key", key),
            ("x-mock-tool", &format!("delay_ms={delay_ms}")),
        ],
        json!({"key": key}).to_string(),
    );
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req)).await;
    let Ok(Ok(resp)) = resp else {
        return Seen::Unknown; // connection died with the sidecar
    };
    let status = resp.status();
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        http_body_util::BodyExt::collect(resp.into_body()),
    )
    .await
    {
        Ok(Ok(b)) => b.to_bytes(),
        _ => return Seen::Unknown,
    };
    match status {
        StatusCode::OK => Seen::Acked(body),
        StatusCode::SERVICE_UNAVAILABLE => Seen::Refused,
        _ => Seen::Unknown,
    }
}

#[tokio::test]
async fn sigkill_at_seeded_points_never_duplicates_or_loses_a_side_effect() {
    let kills: u64 = std::env::var("OUTRIGGER_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let unsafe_tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    let keyed_tool = MockTool::start(ToolBehaviour {
        dedupe: true,
        ..ToolBehaviour::default()
    })
    .await
    .expect("tool");
    let config = format!(
        "[[tools]]\nname = \"unsafe\"\nkind = \"http\"\nbase_url = \"{}\"\nclass = \"unsafe\"\ntimeout = \"5s\"\n\
         [[tools]]\nname = \"keyed\"\nkind = \"http\"\nbase_url = \"{}\"\nclass = \"keyed\"\ntimeout = \"5s\"\n",
        unsafe_tool.url(),
        keyed_tool.url()
    );
    let mut sidecar = Sidecar::start(&config, &[("OUTRIGGER_LOG_LEVEL", "warn")]).await;
    let started = Instant::now();
    let mut history: HashMap<&'static str, Vec<(String, Outcome)>> = HashMap::new();
    let mut acked: HashMap<String, Bytes> = HashMap::new();
    let mut in_doubt_keyed_resent = 0u64;
    let mut held_for_operator = 0u64;
    let mut calls = 0u64;

    for round in 0..kills {
        let mut rng = Rng(0x5EED_0000 + round * 7919 + 1);
        let url = format!("http://{}", sidecar.data);
        let mut inflight = Vec::new();
        for i in 0..4u64 {
            let tool: &'static str = if i % 2 == 0 { "unsafe" } else { "keyed" };
            let key = format!("crash-{round}-{i}");
            let delay = rng.below(25);
            let url = url.clone();
            calls += 1;
            inflight.push((
                tool,
                key.clone(),
                tokio::spawn(async move { attempt(&url, tool, &key, delay).await }),
            ));
        }
        tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
        sidecar.kill();
        for (tool, key, task) in inflight {
            let seen = task.await.expect("client task");
            let outcome = match seen {
                Seen::Acked(body) => {
                    acked.insert(key.clone(), body);
                    Outcome::Ok
                }
                Seen::Unknown => Outcome::Info,
                Seen::Refused => Outcome::Fail,
            };
            history.entry(tool).or_default().push((key, outcome));
        }

        sidecar.spawn().await;
        let url = format!("http://{}", sidecar.data);
        let keys: Vec<(&'static str, String)> = (0..4u64)
            .map(|i| {
                (
                    if i % 2 == 0 { "unsafe" } else { "keyed" },
                    format!("crash-{round}-{i}"),
                )
            })
            .collect();
        for (tool, key) in keys {
            let mut outcome = Outcome::Info;
            for _ in 0..20 {
                let r = post_json(
                    &format!("{url}/tools/{tool}/op"),
                    &[("idempotency-key", &key), ("prefer", "wait=5")],
                    &json!({"key": key}),
                )
                .await;
                match r.status {
                    StatusCode::OK => {
                        if let Some(first) = acked.get(&key) {
                            assert_eq!(
                                &r.body, first,
                                "{key}: an acknowledged result changed after the restart"
                            );
                        } else if r.header("outrigger-replayed").is_some() && tool == "keyed" {
                            in_doubt_keyed_resent += 1;
                        }
                        acked.entry(key.clone()).or_insert(r.body.clone());
                        outcome = Outcome::Ok;
                        break;
                    }
                    StatusCode::CONFLICT
                        if r.json()["type"] == "urn:outrigger:problem:outcome-unknown" =>
                    {
                        assert_eq!(
                            tool,
                            "unsafe",
                            "{key}: a keyed tool must be re-sent, not held: {}",
                            r.text()
                        );
                        assert_eq!(r.json()["state"], "needs_operator");
                        held_for_operator += 1;
                        break;
                    }
                    StatusCode::CONFLICT
                    | StatusCode::BAD_GATEWAY
                    | StatusCode::SERVICE_UNAVAILABLE => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!("{key}: unexpected {other}: {}", r.text()),
                }
            }
            if tool == "keyed" {
                assert_eq!(
                    outcome,
                    Outcome::Ok,
                    "{key}: a keyed call must complete after a restart"
                );
            }
            history.entry(tool).or_default().push((key, outcome));
        }
    }

    let unsafe_verdict = checker::check(
        history.get("unsafe").map(Vec::as_slice).unwrap_or_default(),
        &unsafe_tool.effects_by_key(),
    );
    let keyed_verdict = checker::check(
        history.get("keyed").map(Vec::as_slice).unwrap_or_default(),
        &keyed_tool.effects_by_key(),
    );
    eprintln!(
        "crash figures: kills={kills} calls={calls} duplicated={} lost={} unexpected={} in_doubt_held={held_for_operator} \
         keyed_resent_or_replayed={in_doubt_keyed_resent} took={:?}",
        unsafe_verdict.duplicated.len() + keyed_verdict.duplicated.len(),
        unsafe_verdict.lost.len() + keyed_verdict.lost.len(),
        unsafe_verdict.unexpected.len() + keyed_verdict.unexpected.len(),
        started.elapsed()
    );
    assert!(unsafe_verdict.is_clean(), "unsafe tool: {unsafe_verdict:?}");
    assert!(keyed_verdict.is_clean(), "keyed tool: {keyed_verdict:?}");
    // Every acknowledged key has exactly one effect (the checker's `lost` is empty),
    // and the unsafe tool never saw a key twice.
    assert!(unsafe_tool.effects_by_key().values().all(|n| *n <= 1));
}
