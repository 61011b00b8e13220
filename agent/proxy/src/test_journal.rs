//! A journal for unit tests: in a fresh temporary directory, its writer running,
//! removed on drop.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use outrigger_journal::{Journal, Options};

pub(crate) struct TempJournal {
    pub journal: Journal,
    writer: tokio::task::JoinHandle<()>,
    dir: PathBuf,
}

impl TempJournal {
    /// Opens one; call it inside a Tokio runtime (the writer is spawned on it).
    pub fn open() -> Result<Self, outrigger_journal::Error> {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "outrigger-proxy-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let (journal, writer, _) = Journal::open(Options::new(dir.join("journal")))?;
        let writer = tokio::spawn(writer.run());
        Ok(Self {
            journal,
            writer,
            dir,
        })
    }
}

impl Drop for TempJournal {
    fn drop(&mut self) {
        self.writer.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
