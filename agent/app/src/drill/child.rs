//! The sidecar under drill: this same binary, run as `outrigger serve` in a child
//! process on a derived config, so that the drill can kill it (SIGKILL, not a
//! polite shutdown) and start it again on the same journal, exactly as a node
//! failure would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::Error;

/// How long a start may take: the first start of a run compiles the policy
/// components, which on a loaded machine takes a while.
const START_DEADLINE: Duration = Duration::from_secs(90);

/// What the child is started with.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The `outrigger` executable (resolved once: a rebuild may replace the file
    /// under a running drill).
    pub exe: PathBuf,
    pub config: PathBuf,
    /// Written by the child once it serves (`{"data", "admin", "pid"}`).
    pub ready_file: PathBuf,
    /// The child's stderr (its log) is appended here.
    pub log: PathBuf,
    /// Variables set for the child on top of the drill's own environment.
    pub env: Vec<(String, String)>,
    /// Variables of the drill's environment the child must not see (they would
    /// override the derived config).
    pub env_remove: Vec<String>,
}

/// A running sidecar; killed when dropped.
pub struct Sidecar {
    launch: Launch,
    child: Option<Child>,
    pub data: SocketAddr,
    pub admin: SocketAddr,
}

impl Sidecar {
    pub async fn start(launch: Launch) -> Result<Self, Error> {
        let mut sidecar = Self {
            launch,
            child: None,
            data: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        sidecar.spawn().await?;
        Ok(sidecar)
    }

    /// (Re)starts the process on the same config and journal; returns how long it
    /// took to become ready.
    pub async fn spawn(&mut self) -> Result<Duration, Error> {
        self.kill();
        let started = Instant::now();
        let _ = std::fs::remove_file(&self.launch.ready_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.launch.log)
            .map_err(|e| Error::io("open the sidecar log", &self.launch.log, e))?;
        let mut cmd = Command::new(&self.launch.exe);
        cmd.arg("serve")
            .arg("--config")
            .arg(&self.launch.config)
            .arg("--ready-file")
            .arg(&self.launch.ready_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for name in &self.launch.env_remove {
            cmd.env_remove(name);
        }
        for (k, v) in &self.launch.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::Start(format!("cannot start `outrigger serve`: {e}")))?;
        loop {
            if let Some((data, admin)) = read_ready(&self.launch.ready_file) {
                self.data = data;
                self.admin = admin;
                self.child = Some(child);
                return Ok(started.elapsed());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(Error::Start(format!(
                    "`outrigger serve` exited during start-up ({status}); its log is {}:\n{}",
                    self.launch.log.display(),
                    tail(&self.launch.log)
                )));
            }
            if started.elapsed() > START_DEADLINE {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Start(format!(
                    "`outrigger serve` was not ready within {START_DEADLINE:?}; its log is {}",
                    self.launch.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sets (or replaces) a variable for the next start.
    pub fn set_env(&mut self, (name, value): (String, String)) {
        self.launch.env.retain(|(k, _)| *k != name);
        self.launch.env.push((name, value));
    }

    /// SIGKILL (no drain, no flush of the books), then reap.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read_ready(path: &Path) -> Option<(SocketAddr, SocketAddr)> {
    let text = std::fs::read_to_string(path).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    let data = doc["data"].as_str()?.parse().ok()?;
    let admin = doc["admin"].as_str()?.parse().ok()?;
    Some((data, admin))
}

/// The last lines of a log, for an error message.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
