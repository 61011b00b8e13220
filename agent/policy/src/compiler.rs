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
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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
    /// component is compiled in process instead (with a warning). A child still
    /// running after `timeout` is killed and the load fails: the component is not
    /// handed to the compiler in this process, where nothing could stop it.
    Child {
        program: PathBuf,
        args: Vec<OsString>,
        timeout: Duration,
    },
}

/// How long a compiling child may run by default ([`Compiler::child`]): minutes
/// more than a large (Python, JS) component takes on a loaded machine.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(300);

impl Compiler {
    /// [`Compiler::Child`] with the default [`COMPILE_TIMEOUT`].
    pub fn child(program: impl Into<PathBuf>, args: Vec<OsString>) -> Self {
        Self::Child {
            program: program.into(),
            args,
            timeout: COMPILE_TIMEOUT,
        }
    }
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

/// Compiles `bytes` in a child process (see [`Compiler::Child`]), killing it if it
/// runs past `timeout`.
pub(crate) fn compile_in_child(
    program: &Path,
    args: &[OsString],
    memory_limit_bytes: usize,
    pooling: bool,
    bytes: &[u8],
    timeout: Duration,
) -> ChildOutcome {
    let spawned = Command::new(program)
        .args(args)
        .arg(memory_limit_bytes.to_string())
        .arg(if pooling { "pooled" } else { "on-demand" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(e) => {
            return ChildOutcome::Unavailable(format!("starting {}: {e}", program.display()));
        }
    };
    let output = match run_bounded(child, bytes.to_vec(), timeout) {
        Ok(Bounded::Finished(output)) => output,
        Ok(Bounded::TimedOut) => {
            // A compiler that hangs on a component would hang this process too.
            return ChildOutcome::Refused(Error::Compile(format!(
                "the compiler did not finish within its {timeout:?} limit and was killed"
            )));
        }
        Err(e) => return ChildOutcome::Unavailable(format!("waiting for the compiler: {e}")),
    };
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    match output.status.code() {
        Some(0) if output.stdin_written => ChildOutcome::Compiled(output.stdout),
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

/// What a child run under [`run_bounded`] came to.
#[derive(Debug)]
pub(crate) enum Bounded {
    Finished(Finished),
    /// It ran past the limit and was killed.
    TimedOut,
}

/// A child that exited within its limit: its status and what it wrote.
#[derive(Debug)]
pub(crate) struct Finished {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Whether all of the input reached the child's stdin.
    pub stdin_written: bool,
}

/// How often [`run_bounded`] looks whether the child exited, at most.
const POLL: Duration = Duration::from_millis(20);

/// Feeds `input` to `child`'s stdin and collects its stdout and stderr (each on a
/// thread of its own, so that no full pipe can stall the others), and waits for it
/// to exit — for at most `limit` in all, after which the child is killed and reaped.
/// A stream still open at the limit (a grandchild holding it) is abandoned to its
/// thread, which ends when the stream closes.
pub(crate) fn run_bounded(
    mut child: Child,
    input: Vec<u8>,
    limit: Duration,
) -> std::io::Result<Bounded> {
    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<Stream>();
    if let Some(mut stdin) = child.stdin.take() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let written = stdin.write_all(&input).is_ok();
            // Closing stdin tells the child its input is complete.
            drop(stdin);
            let _ = tx.send(Stream::Stdin(written));
        });
    } else {
        let _ = tx.send(Stream::Stdin(input.is_empty()));
    }
    collect(child.stdout.take(), &tx, Stream::Stdout);
    collect(child.stderr.take(), &tx, Stream::Stderr);
    drop(tx);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let elapsed = started.elapsed();
        if elapsed >= limit {
            // Exited meanwhile is fine: either way it is reaped here.
            let _ = child.kill();
            child.wait()?;
            return Ok(Bounded::TimedOut);
        }
        std::thread::sleep(POLL.min(limit - elapsed));
    };
    let (mut stdout, mut stderr, mut stdin_written) = (None, None, None);
    while stdout.is_none() || stderr.is_none() || stdin_written.is_none() {
        let left = limit.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(Stream::Stdin(written)) => stdin_written = Some(written),
            Ok(Stream::Stdout(bytes)) => stdout = Some(bytes),
            Ok(Stream::Stderr(bytes)) => stderr = Some(bytes),
            // The child exited but something it left behind still holds a pipe.
            Err(mpsc::RecvTimeoutError::Timeout) => return Ok(Bounded::TimedOut),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    Ok(Bounded::Finished(Finished {
        status,
        stdout: stdout.unwrap_or_default(),
        stderr: stderr.unwrap_or_default(),
        stdin_written: stdin_written.unwrap_or(false),
    }))
}

enum Stream {
    Stdin(bool),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
}

/// Reads `pipe` to its end on a thread of its own and sends what it read.
fn collect(
    pipe: Option<impl std::io::Read + Send + 'static>,
    tx: &mpsc::Sender<Stream>,
    wrap: fn(Vec<u8>) -> Stream,
) {
    let tx = tx.clone();
    match pipe {
        Some(mut pipe) => {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let _ = pipe.read_to_end(&mut bytes);
                let _ = tx.send(wrap(bytes));
            });
        }
        None => {
            let _ = tx.send(wrap(Vec::new()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Child {
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("sh: {e}"))
    }

    #[test]
    fn a_child_that_finishes_in_time_hands_back_what_it_wrote() {
        // More than a pipe holds, both ways: neither side may stall the other.
        let input: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let ran = run_bounded(
            sh("cat; echo done >&2"),
            input.clone(),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let Bounded::Finished(done) = ran else {
            panic!("timed out")
        };
        assert!(done.status.success());
        assert!(done.stdin_written);
        assert_eq!(done.stdout, input);
        assert_eq!(done.stderr, b"done\n");
    }

    #[test]
    fn a_child_past_its_limit_is_killed() {
        // One that reads its input and hangs, and one that never reads it (the
        // input fills the pipe, so writing it blocks until the child is killed).
        for script in ["cat >/dev/null; exec sleep 60", "exec sleep 60"] {
            let child = sh(script);
            let pid = child.id();
            let started = Instant::now();
            let ran = run_bounded(child, vec![0; 1 << 20], Duration::from_millis(300))
                .unwrap_or_else(|e| panic!("{e}"));
            let took = started.elapsed();
            assert!(matches!(ran, Bounded::TimedOut), "{script}: {ran:?}");
            assert!(took < Duration::from_secs(10), "{script}: took {took:?}");
            // Reaped: no process of that id is left (not even a zombie).
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "{script}: the child is still there"
            );
        }
    }
}
