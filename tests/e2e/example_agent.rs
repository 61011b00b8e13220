//! The crash-recovery example (`examples/agent/agent.py`, the stock OpenAI Python
//! SDK) killed mid-task and restarted from scratch: the task completes, every side
//! effect happened exactly once, and the model calls it repeated came from the
//! journal. It is killed once between calls, once while a tool call is running, and,
//! streaming its turns, once in the middle of a model stream.
//!
//! Needs the example's virtual environment (`examples/agent/setup.sh`, which
//! `./x test` runs). Without it the test says so and passes only when
//! `OUTRIGGER_REQUIRE_EXAMPLES` is unset; CI sets it.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use outrigger_testing::provider::{Behaviour, MockProvider, StreamEnd};
use outrigger_testing::tool::{MockTool, ToolBehaviour};

use crate::support::*;

/// The Python of the examples' environment (the OpenAI and Anthropic SDKs), or
/// `None` (the test skips) where `examples/agent/setup.sh` has not made it.
pub(crate) fn python() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/agent/.venv/bin/python");
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("OUTRIGGER_REQUIRE_EXAMPLES").is_none(),
        "examples/agent/.venv is missing: run examples/agent/setup.sh (./x test does)"
    );
    eprintln!("skipping the example agent: run examples/agent/setup.sh to set it up");
    None
}

/// A model acting as the agent's for `steps` tool steps, the `booking` tool (unsafe,
/// key required) answering `script` first, and a sidecar in front of both.
async fn setup(steps: usize, script: &[ToolBehaviour]) -> (MockProvider, MockTool, Sidecar) {
    let model = MockProvider::start(Behaviour {
        agent_steps: Some(steps),
        chunks: 3,
        ..Behaviour::default()
    })
    .await
    .expect("provider");
    let tool = MockTool::start(ToolBehaviour::default())
        .await
        .expect("tool");
    for b in script {
        tool.push(b.clone());
    }
    let config = format!(
        "[[providers]]\nname = \"mock\"\nkind = \"openai\"\nbase_url = \"{}\"\nmodels = [\"*\"]\n\
         [[tools]]\nname = \"booking\"\nkind = \"http\"\nbase_url = \"{}\"\nclass = \"unsafe\"\nkey_required = true\n",
        model.openai_base(),
        tool.url()
    );
    let sidecar = Sidecar::start(&config, &[]).await;
    (model, tool, sidecar)
}

/// The example agent as a command: task `task` through `sidecar`, with `env` set.
fn agent(python: &Path, sidecar: &Sidecar, task: &str, env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/agent/agent.py"))
        .env("OUTRIGGER_URL", format!("http://{}", sidecar.data))
        .env("TASK_ID", task)
        .env("PYTHONUNBUFFERED", "1")
        .envs(env.iter().map(|(k, v)| (k, v)));
    cmd
}

/// Runs `cmd` to its end (blocking this worker only): its status, stdout and stderr.
fn run(mut cmd: Command) -> (ExitStatus, String, String) {
    let out = tokio::task::block_in_place(|| cmd.output()).expect("run the agent");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The restarted agent's run: it completed, `turns` of its model turns came from
/// the journal and `calls` of its tool calls were deduplicated, each of the `steps`
/// side effects happened once, and only the turns it had not seen were generated
/// (the steps and the final answer, in both runs together).
fn assert_done_once(
    (status, out, err): (ExitStatus, String, String),
    model: &MockProvider,
    tool: &MockTool,
    steps: usize,
    turns: usize,
    calls: usize,
) {
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("done:"), "{out}");
    assert_eq!(
        out.matches("replayed from the journal").count(),
        turns,
        "{out}"
    );
    assert_eq!(out.matches("(replayed)").count(), calls, "{out}");
    let by_key = tool.effects_by_key();
    assert_eq!(tool.effects().len(), steps, "{by_key:?}");
    assert!(by_key.values().all(|n| *n == 1), "{by_key:?}");
    assert_eq!(model.generation_count(), steps as u64 + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_agent_survives_being_killed_mid_task() {
    let Some(python) = python() else { return };
    let steps = 4;
    let (model, tool, sidecar) = setup(steps, &[]).await;
    // First run: killed right after its second side effect.
    let crash = [("AGENT_CRASH_AFTER_TOOL_CALLS", "2".to_string())];
    let (status, out, err) = run(agent(&python, &sidecar, "trip-e2e", &crash));
    assert!(
        !status.success(),
        "the agent should have been killed:\n{out}\n{err}"
    );
    assert!(out.contains("crashing now"), "{out}\n{err}");
    assert_eq!(tool.effects().len(), 2);
    let generated_before_restart = model.generation_count();
    assert_eq!(generated_before_restart, 2);

    // Restarted from scratch, same task: it completes.
    // The two model turns it had already seen were served from the journal, so its
    // first two tool calls were deduplicated, and every effect happened once.
    let run_again = run(agent(&python, &sidecar, "trip-e2e", &[]));
    assert_done_once(run_again, &model, &tool, steps, 2, 2);
    let by_key = tool.effects_by_key();
    assert!(
        by_key
            .keys()
            .all(|k| k.as_deref().is_some_and(|k| k.starts_with("tc-"))),
        "{by_key:?}"
    );
}

/// Killed while its third tool call is still running at the tool: the sidecar
/// finishes that call and journals it, and the restarted agent's repeat gets its
/// result (waiting for it if need be) instead of running it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_agent_killed_during_a_tool_call_repeats_no_side_effect() {
    let Some(python) = python() else { return };
    let steps = 4;
    // Its third tool call takes 1.5 s at the tool.
    let slow = ToolBehaviour {
        delay: std::time::Duration::from_millis(1500),
        ..ToolBehaviour::default()
    };
    let script = [ToolBehaviour::default(), ToolBehaviour::default(), slow];
    let (model, tool, sidecar) = setup(steps, &script).await;
    let mut first = agent(&python, &sidecar, "trip-in-flight", &[])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the agent");
    let in_flight = eventually(std::time::Duration::from_secs(30), || tool.received() == 3).await;
    first.kill().expect("kill the agent");
    let out = first.wait_with_output().expect("the killed agent");
    let (out, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        in_flight,
        "the third tool call never reached the tool:\n{out}\n{err}"
    );
    assert_eq!(tool.effects().len(), 2, "the third call is still running");

    let run_again = run(agent(&python, &sidecar, "trip-in-flight", &[]));
    assert_done_once(run_again, &model, &tool, steps, 3, 3);
}

/// Streaming every turn, killed right after the first chunk of its third turn
/// arrived: the sidecar does not cancel that generation but reads the rest of it
/// into the journal, and the restarted agent gets its three turns replayed as
/// streams through the stock SDK, with the same tool_call_ids, so no turn is
/// generated twice and no side effect happens twice. Restarted once the stream is
/// whole in the journal, and once while it is still being generated (its repeat
/// attaches to the live stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streaming_example_agent_killed_mid_stream_generates_nothing_twice() {
    killed_mid_stream(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streaming_example_agent_restarted_during_its_left_stream_attaches_to_it() {
    killed_mid_stream(true).await;
}

async fn killed_mid_stream(restart_while_live: bool) {
    let Some(python) = python() else { return };
    let steps = 4;
    let (model, tool, sidecar) = setup(steps, &[]).await;
    // The third turn's events come 40 ms apart, or, to be still going when the
    // agent is back, 300 ms apart (about 2 s after the agent is gone).
    let paced = Behaviour {
        agent_steps: Some(steps),
        chunks: 3,
        ..Behaviour::default()
    };
    let pace = if restart_while_live { 300 } else { 40 };
    model.push(paced.clone());
    model.push(paced.clone());
    model.push(Behaviour {
        chunk_delay: std::time::Duration::from_millis(pace),
        ..paced
    });
    let streaming = ("AGENT_STREAM", "1".to_string());
    let crash = [
        streaming.clone(),
        ("AGENT_CRASH_MID_STREAM", "3".to_string()),
    ];
    let (status, out, err) = run(agent(&python, &sidecar, "trip-streamed", &crash));
    assert!(
        !status.success(),
        "the agent should have been killed:\n{out}\n{err}"
    );
    assert!(out.contains("crashing now"), "{out}\n{err}");
    assert_eq!(out.matches("step ").count(), 2, "{out}");
    assert_eq!(tool.effects().len(), 2);
    assert_eq!(model.generation_count(), 3);
    let third_end = || model.exchanges().get(2).and_then(|e| e.stream_end());
    if restart_while_live {
        assert_eq!(third_end(), None, "the third turn's stream is still going");
    } else {
        let drained = eventually(std::time::Duration::from_secs(10), || {
            third_end() == Some(StreamEnd::Completed)
        })
        .await;
        assert!(drained, "the left stream was not read to its end");
    }

    let run_again = run(agent(&python, &sidecar, "trip-streamed", &[streaming]));
    assert_done_once(run_again, &model, &tool, steps, 3, 2);
    assert!(
        model
            .exchanges()
            .iter()
            .all(|e| e.stream_end() == Some(StreamEnd::Completed)),
        "every turn the model generated was streamed whole"
    );
}
