//! The `record_decode` fuzz target's corpus as an ordinary test on stable: every
//! file under `fuzz/corpus/record_decode/` goes through the same checks the fuzz
//! target runs (`fuzz/checks/record.rs`), so an input that once crashed a fuzz run
//! stays fixed. Files named `valid-<type>-…` must also decode as that type, so the
//! corpus keeps exercising the success path, not only refusals.

use std::path::Path;

#[path = "../fuzz/checks/record.rs"]
mod record;

#[test]
fn record_decode_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decode");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    assert!(files.len() >= 20, "only {} corpus files", files.len());
    let mut failed = Vec::new();
    let mut valid = 0;
    for path in &files {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(path).expect("corpus file");
        if std::panic::catch_unwind(|| record::check(&bytes)).is_err() {
            failed.push(name);
            continue;
        }
        if let Some(rest) = name.strip_prefix("valid-") {
            let ty = record::TYPES
                .iter()
                .filter(|t| rest.starts_with(&format!("{t}-")))
                .max_by_key(|t| t.len())
                .unwrap_or_else(|| panic!("{name}: names no decoder"));
            if record::decodes_as(ty, &bytes) {
                valid += 1;
            } else {
                failed.push(format!("{name} (does not decode as {ty})"));
            }
        }
    }
    assert!(failed.is_empty(), "record_decode failed on {failed:?}");
    assert!(valid >= 5, "only {valid} valid-* seeds decode");
}
