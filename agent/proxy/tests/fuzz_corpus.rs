//! The fuzz targets' corpora as ordinary tests on stable: every file under
//! `fuzz/corpus/<target>/` goes through the same checks the cargo-fuzz target runs
//! (`fuzz/checks/`), so an input that once crashed a fuzz run stays fixed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

#[path = "../fuzz/checks/mcp.rs"]
mod mcp;
#[path = "../fuzz/checks/sse.rs"]
mod sse;

/// Every file of a target's corpus, sorted by name.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 20,
        "{target}: only {} corpus files",
        files.len()
    );
    files
}

fn name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[test]
fn sse_framer_corpus() {
    let mut failed = Vec::new();
    for (path, bytes) in corpus("sse_framer") {
        if std::panic::catch_unwind(|| sse::check(&bytes)).is_err() {
            failed.push(name(&path));
        }
    }
    assert!(failed.is_empty(), "sse_framer failed on {failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_response_corpus() {
    let harness = Arc::new(mcp::Harness::start().await);
    let mut failed = Vec::new();
    for (path, bytes) in corpus("mcp_response") {
        let h = harness.clone();
        if tokio::spawn(async move { h.check(&bytes).await })
            .await
            .is_err()
        {
            failed.push(name(&path));
        }
    }
    assert!(failed.is_empty(), "mcp_response failed on {failed:?}");
}
