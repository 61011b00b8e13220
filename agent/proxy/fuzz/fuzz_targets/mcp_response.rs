//! Arbitrary MCP server answers (JSON or SSE) through the real data plane and
//! journal: the agent gets its JSON-RPC outcome or the bytes unchanged, and a replay
//! is the same answer. The checks live in `checks/mcp.rs`, shared with the corpus
//! regression test.
#![no_main]

use std::sync::OnceLock;

#[path = "../checks/mcp.rs"]
mod mcp;

struct Fixture {
    runtime: tokio::runtime::Runtime,
    harness: mcp::Harness,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let harness = runtime.block_on(mcp::Harness::start());
        Fixture { runtime, harness }
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let f = fixture();
    f.runtime.block_on(f.harness.check(data));
});
