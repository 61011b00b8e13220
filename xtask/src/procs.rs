//! Building and supervising the project's own binaries from xtask.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::process::{Pid, Signal, kill_process};

/// The repository root (xtask lives one level below it).
pub fn root() -> PathBuf {
    // `cargo run` sets CARGO_MANIFEST_DIR for the process it starts: prefer it to the
    // compile-time value, so that a binary shared through one target directory by
    // two checkouts works on the checkout it was started from.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// The target the policy components are built for.
const WASM_TARGET: &str = "wasm32-wasip2";

/// Installs the `wasm32-wasip2` standard library with rustup when the toolchain in
/// use lacks it. rustup adds the targets `rust-toolchain.toml` lists only when it
/// installs the toolchain itself, so a machine that already had this Rust version
/// would otherwise fail in the built-in policies' build script. Without rustup this
/// says nothing: that build script then names what to install.
pub fn ensure_wasm_target() -> anyhow::Result<()> {
    let listed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(root())
        .stderr(Stdio::null())
        .output();
    let Ok(listed) = listed else {
        return Ok(());
    };
    if !listed.status.success()
        || String::from_utf8_lossy(&listed.stdout)
            .lines()
            .any(|line| line.trim() == WASM_TARGET)
    {
        return Ok(());
    }
    eprintln!("the {WASM_TARGET} target is not installed; adding it with rustup");
    run(Command::new("rustup")
        .args(["target", "add", WASM_TARGET])
        .current_dir(root()))
}

/// Runs a command, echoing it, and fails if it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// The cargo target directory as cargo resolves it (`CARGO_TARGET_DIR`, a
/// `build.target-dir` in a `.cargo/config.toml`, or `target/`): what
/// `cargo metadata` reports, asked once.
pub fn target_dir() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut cmd = cargo();
        cmd.args(["metadata", "--no-deps", "--format-version", "1"]);
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot start {}: {e}", describe(&cmd)))?;
        if !out.status.success() {
            return Err(format!("{} failed ({})", describe(&cmd), out.status));
        }
        target_directory(&out.stdout).map_err(|e| format!("{}: {e}", describe(&cmd)))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// `target_directory` of `cargo metadata`'s JSON.
fn target_directory(metadata: &[u8]) -> Result<PathBuf, String> {
    let doc: serde_json::Value =
        serde_json::from_slice(metadata).map_err(|e| format!("its output is not JSON: {e}"))?;
    doc["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .ok_or_else(|| "its output names no target_directory".to_owned())
}

/// Builds the given binaries in `profile` ("debug" or "release") and returns the
/// directory they are in.
pub fn build_bins(profile: &str, packages: &[&str]) -> anyhow::Result<PathBuf> {
    let mut cmd = cargo();
    cmd.arg("build");
    if profile == "release" {
        cmd.arg("--release");
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    run(&mut cmd)?;
    Ok(target_dir()?.join(profile))
}

/// A child process killed (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    /// Starts `cmd`. On Linux the child is sent SIGTERM when the thread that started
    /// it ends (xtask killed, or panicking out of it), so nothing it started outlives
    /// it holding the ports the next run needs.
    pub fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Proc> {
        cmd.stdin(Stdio::null());
        #[cfg(target_os = "linux")]
        die_with_parent(cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Proc {
            name: name.to_string(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn terminate(&mut self, grace: Duration) {
        let _ = kill_process(Pid::from_child(&self.child), Signal::TERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("{} did not stop within {grace:?}; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `PR_SET_PDEATHSIG` (SIGTERM) in the child before it runs the program; a parent
/// that died before that is caught by the child's parent no longer being it.
#[cfg(target_os = "linux")]
#[expect(
    unsafe_code,
    reason = "pre_exec is unsafe: the hook runs between fork and exec, where only \
              async-signal-safe calls are allowed (these two are plain system calls)"
)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;

    use rustix::process::{getpid, getppid, set_parent_process_death_signal};

    let parent = getpid();
    // SAFETY: the hook only makes two system calls (prctl, getppid) and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            set_parent_process_death_signal(Some(Signal::TERM))?;
            if getppid() != Some(parent) {
                return Err(std::io::Error::other("the parent exited"));
            }
            Ok(())
        });
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate(Duration::from_secs(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parent-death signal follows the thread that started the child: when that
    /// thread ends, the child is sent SIGTERM, as it is when xtask dies.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_child_dies_with_the_thread_that_started_it() {
        use std::os::unix::process::ExitStatusExt;

        let mut proc = std::thread::spawn(|| {
            Proc::spawn("sleep", Command::new("sleep").arg("30")).expect("sleep")
        })
        .join()
        .expect("the starting thread");
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = proc.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "the child outlived its parent");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.signal(), Some(15), "{status:?}");
    }

    #[test]
    fn the_target_directory_is_the_one_cargo_metadata_names() {
        let json = br#"{"packages": [], "target_directory": "/srv/build/target", "version": 1}"#;
        assert_eq!(
            target_directory(json),
            Ok(PathBuf::from("/srv/build/target"))
        );
        assert!(target_directory(br#"{"version": 1}"#).is_err());
        assert!(target_directory(b"warning: not json").is_err());
    }
}
