//! Where components are compiled: on the process's own threads, or in a child process
//! that hands back the compiled artifact.
//!
//! Compiling with Cranelift touches megabytes of compiler code and heap that a
//! long-running sidecar never needs again: after compiling the three built-ins, an
//! idle sidecar held about 10 MiB more than one that loaded them from the cache (see
//! docs/benchmarks.md). A child process takes that memory with it when it exits, and
//! a component that makes the compiler crash ends the child, not the sidecar. The
//! child runs [`compile_child`] (the binary exposes it as a hidden subcommand): the
//! component's bytes on stdin, the artifact of `Engine::precompile_component` on
//! stdout, built with the parent's engine configuration; the parent loads it like a
//! cached artifact, and wasmtime refuses one whose configuration does not match.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use wasmtime::Engine;

use crate::Error;

/// How a [`crate::Runtime`] compiles a component it has no cached artifact for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Compiler {
    /// On this process's threads.
    #[default]
    InProcess,
    /// In a child process: `program args… <memory-limit-bytes> <pooled|on-demand>`,
    /// which must call [`compile_child`] with the last two arguments. If the child
    /// cannot be started, or hands back an artifact this engine refuses, the
    /// component is compiled in process instead (with a warning).
    Child {
        program: PathBuf,
        args: Vec<OsString>,
    },
}

/// The child's exit status when the component itself was refused by the compiler
/// (the message is on stderr); any other failure is the child's own.
const REFUSED: i32 = 3;

/// The exit status of a Rust process that panicked.
const PANICKED: i32 = 101;

/// The body of the compiling child: reads a component from stdin, compiles it for an
/// engine configured like the parent's (`args`: the memory limit in bytes and
/// `pooled` or `on-demand`), and writes the artifact to stdout. Returns the process's
/// exit status: 0, [`REFUSED`] for a component the compiler rejects, 2 for bad
/// arguments, 1 for anything else; messages go to stderr.
pub fn compile_child(args: &[OsString]) -> i32 {
    let [limit, allocation] = args else {
        eprintln!("expected two arguments: <memory-limit-bytes> <pooled|on-demand>");
        return 2;
    };
    let Some(memory_limit_bytes) = limit.to_str().and_then(|s| s.parse::<usize>().ok()) else {
        eprintln!("the memory limit must be a number of bytes, not {limit:?}");
        return 2;
    };
    let pooling = match allocation.to_str() {
        Some("pooled") => true,
        Some("on-demand") => false,
        _ => {
            eprintln!("the allocation must be `pooled` or `on-demand`, not {allocation:?}");
            return 2;
        }
    };
    let mut bytes = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_to_end(&mut bytes) {
        eprintln!("reading the component from stdin: {e}");
        return 1;
    }
    let engine = match Engine::new(&crate::runtime::config(memory_limit_bytes, pooling)) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("setting up the engine: {e:#}");
            return 1;
        }
    };
    let artifact = match engine.precompile_component(&bytes) {
        Ok(artifact) => artifact,
        Err(e) => {
            eprintln!("{e:#}");
            return REFUSED;
        }
    };
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(&artifact).and_then(|()| out.flush()) {
        eprintln!("writing the compiled component to stdout: {e}");
        return 1;
    }
    0
}

/// What compiling in a child came to.
pub(crate) enum ChildOutcome {
    /// The compiled artifact.
    Compiled(Vec<u8>),
    /// The compiler refused the component (or died on it): this is the load's error.
    Refused(Error),
    /// The child could not do the work; compile in process instead.
    Unavailable(String),
}

/// Compiles `bytes` in a child process (see [`Compiler::Child`]).
pub(crate) fn compile_in_child(
    program: &Path,
    args: &[OsString],
    memory_limit_bytes: usize,
    pooling: bool,
    bytes: &[u8],
) -> ChildOutcome {
    let spawned = Command::new(program)
        .args(args)
        .arg(memory_limit_bytes.to_string())
        .arg(if pooling { "pooled" } else { "on-demand" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            return ChildOutcome::Unavailable(format!("starting {}: {e}", program.display()));
        }
    };
    // The child reads all of its input before it writes anything, so writing it
    // whole first cannot deadlock on a full pipe.
    let written = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(bytes))
        .unwrap_or(Ok(()));
    let output = match child.wait_with_output() {
        Ok(output) => output,
        Err(e) => return ChildOutcome::Unavailable(format!("waiting for the compiler: {e}")),
    };
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    match output.status.code() {
        Some(0) if written.is_ok() => ChildOutcome::Compiled(output.stdout),
        Some(REFUSED) => ChildOutcome::Refused(Error::Compile(stderr)),
        // A panic in the compiler (Rust's exit status for one): like a crash, it is
        // the component's doing, and must not be repeated inside the sidecar.
        Some(PANICKED) => ChildOutcome::Refused(Error::Compile(format!(
            "the compiler panicked on this component: {stderr}"
        ))),
        Some(code) => ChildOutcome::Unavailable(format!(
            "the compiler exited with status {code}{}",
            if stderr.is_empty() {
                String::new()
            } else {
                format!(": {stderr}")
            }
        )),
        // Killed by a signal: a component that crashes the compiler must not be
        // handed to the compiler in this process.
        None => ChildOutcome::Refused(Error::Compile(format!(
            "the compiler process died on this component ({})",
            output.status
        ))),
    }
}
