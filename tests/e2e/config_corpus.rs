//! The configuration corpus (`agent/app/fuzz/corpus/config/`) through the real
//! `outrigger config check`: the binary parses every file (TOML syntax, the raw
//! config shape, validation) and must answer with exit code 0 or 2, never a crash.
//!
//! A file named `valid-…` must pass. A file named `invalid-…` starts with a
//! `# expect: <path>, <path>, …` line naming the problems it holds, and the check
//! must report each of them — all at once, each with its key path (`(syntax)` for
//! a file that is not TOML, `(file)` for one that cannot be read as text).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::outrigger_bin;

fn corpus() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/app/fuzz/corpus/config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 20,
        "only {} config corpus files",
        files.len()
    );
    files
}

/// One `  - path: message` line of the report.
#[derive(Debug)]
struct Problem {
    path: String,
    message: String,
}

impl Problem {
    /// The key path the problem names: its own, or for a type error the one the
    /// deserializer quotes (`… in `limits.max_body_bytes``).
    fn key_path(&self) -> Option<String> {
        if self.path == "(types)" {
            let start = self.message.rfind(" in `")? + " in `".len();
            let end = start + self.message[start..].find('`')?;
            return Some(self.message[start..end].to_string());
        }
        Some(self.path.clone())
    }
}

fn is_key_path(p: &str) -> bool {
    p.starts_with(|c: char| c.is_ascii_alphabetic())
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']' | '-'))
}

/// Parses `<source> has N problem(s):` and its N lines.
fn report(stderr: &str) -> Result<Vec<Problem>, String> {
    let mut lines = stderr.lines();
    let head = lines.next().ok_or("no report on stderr")?;
    let count: usize = head
        .rsplit_once(" has ")
        .and_then(|(_, rest)| rest.split_once(" problem"))
        .and_then(|(n, _)| n.parse().ok())
        .ok_or_else(|| format!("not a problem report: {head:?}"))?;
    let problems: Vec<Problem> = lines
        .map(|l| {
            let item = l
                .strip_prefix("  - ")
                .ok_or_else(|| format!("not a problem line: {l:?}"))?;
            let (path, message) = item
                .split_once(": ")
                .ok_or_else(|| format!("a problem without a path: {l:?}"))?;
            Ok(Problem {
                path: path.to_string(),
                message: message.to_string(),
            })
        })
        .collect::<Result<_, String>>()?;
    if problems.len() != count {
        return Err(format!("says {count} problems, lists {}", problems.len()));
    }
    Ok(problems)
}

/// What is wrong with the check's answer for one file, if anything.
fn judge(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_string_lossy().into_owned();
    let bytes = std::fs::read(path).ok()?;
    let out = Command::new(outrigger_bin())
        .args(["config", "check", "--config"])
        .arg(path)
        .env_clear()
        .env("CORPUS_PROVIDER_KEY", "pk-corpus")
        .output()
        .expect("outrigger runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let Some(code) = out.status.code() else {
        return Some(format!("{name}: crashed ({}): {stderr}", out.status));
    };
    if !matches!(code, 0 | 2) {
        return Some(format!("{name}: exit code {code}: {stderr}"));
    }
    if name.starts_with("valid-") {
        return (code != 0 || !stdout.contains("is valid"))
            .then(|| format!("{name}: refused (exit {code}): {stderr}"));
    }
    let expected: Vec<String> = bytes
        .split(|b| *b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .map(|l| l.trim_start_matches('\u{feff}'))
        .and_then(|l| l.strip_prefix("# expect: "))
        .map(|l| l.split(", ").map(str::to_string).collect())
        .unwrap_or_default();
    if expected.is_empty() {
        return Some(format!("{name}: an invalid- file needs a `# expect:` line"));
    }
    if code != 2 {
        return Some(format!("{name}: accepted, but it has {expected:?}"));
    }
    let problems = match report(&stderr) {
        Ok(p) => p,
        Err(e) => return Some(format!("{name}: {e}: {stderr}")),
    };
    let mut got = Vec::new();
    for p in &problems {
        match p.key_path() {
            Some(k) if is_key_path(&k) || k == "(syntax)" || k == "(file)" => got.push(k),
            _ => return Some(format!("{name}: a problem without a key path: {p:?}")),
        }
    }
    let mut want = expected;
    got.sort();
    want.sort();
    (got != want).then(|| format!("{name}: reported {got:?}, expected {want:?}:\n{stderr}"))
}

#[test]
fn config_check_survives_the_corpus_and_reports_every_problem_with_its_path() {
    let failures: Vec<String> = corpus().iter().filter_map(|p| judge(p)).collect();
    assert!(
        failures.is_empty(),
        "{} of the config corpus failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
