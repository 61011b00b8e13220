use std::path::PathBuf;
use std::time::Duration;

use crate::Error;

/// What "durable" means for an acknowledged write (durability.md §8.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// sled's flush (`sync_file_range` on Linux): survives a killed or restarted
    /// process on the same volume, not necessarily a power cut.
    #[default]
    Process,
    /// Also `fdatasync` the db file: for journals on volumes that outlive the node.
    Node,
}

/// How a journal is opened and run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub dir: PathBuf,
    pub durability: Durability,
    /// How long a full record is kept (from its creation) before it becomes a tombstone.
    pub retention: Duration,
    /// How long a tombstone is kept before the key is forgotten.
    pub tombstone_retention: Duration,
    /// How long a model stream's events are kept (from its start).
    pub stream_retention: Duration,
    /// The most commands one group commit takes.
    pub max_batch: usize,
    /// The longest a lazy write (a stream text delta, a kv put) stays unflushed.
    /// Durable writes never wait for company: they are flushed as soon as the previous
    /// commit ends, and the ones that queued meanwhile share that flush.
    pub max_batch_delay: Duration,
    /// sled's page cache; expect the process RSS to be a few times this.
    pub cache_capacity_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("outrigger-data/journal"),
            durability: Durability::Process,
            retention: Duration::from_secs(24 * 60 * 60),
            tombstone_retention: Duration::from_secs(30 * 24 * 60 * 60),
            stream_retention: Duration::from_secs(6 * 60 * 60),
            max_batch: 512,
            max_batch_delay: Duration::from_millis(50),
            cache_capacity_bytes: 64 * 1024 * 1024,
        }
    }
}

impl Options {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            ..Self::default()
        }
    }

    /// Reports every problem at once.
    pub fn validate(&self) -> Result<(), Error> {
        let mut problems = Vec::new();
        if self.dir.as_os_str().is_empty() {
            problems.push("dir is empty".to_owned());
        }
        for (name, value) in [
            ("retention", self.retention),
            ("tombstone_retention", self.tombstone_retention),
            ("stream_retention", self.stream_retention),
        ] {
            if value.is_zero() {
                problems.push(format!("{name} must be positive"));
            }
        }
        if self.max_batch == 0 {
            problems.push("max_batch must be at least 1".to_owned());
        }
        if self.cache_capacity_bytes < 1024 * 1024 {
            problems.push("cache_capacity_bytes must be at least 1 MiB".to_owned());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid {
                what: "journal options",
                detail: problems.join("; "),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_reports_every_problem() {
        let options = Options {
            retention: Duration::ZERO,
            max_batch: 0,
            ..Options::new("j")
        };
        let Err(Error::Invalid { detail, .. }) = options.validate() else {
            panic!("invalid options were accepted");
        };
        assert!(detail.contains("retention must be positive"), "{detail}");
        assert!(detail.contains("max_batch"), "{detail}");
        assert!(Options::new("j").validate().is_ok());
    }
}
