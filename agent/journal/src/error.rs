use std::path::PathBuf;

use outrigger_types::IdempotencyKey;

use crate::record::State;

/// Everything that can go wrong in the journal. The proxy maps [`Error::Unavailable`]
/// to 503 + Retry-After (fail closed: a side effect is never executed unjournaled).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "the journal in {dir} is locked by another process (is the sidecar running?); \
         stop it or read the journal through the admin API"
    )]
    Locked { dir: PathBuf },
    #[error("no journal in {dir}: {detail}")]
    NotFound { dir: PathBuf, detail: String },
    #[error("the journal cannot write ({0}); side-effecting calls are refused until it can")]
    Unavailable(String),
    #[error("{}", corrupt_message(.dir, .detail, *.kind))]
    Corrupt {
        dir: PathBuf,
        detail: String,
        kind: Corruption,
    },
    #[error("journal storage error: {0}")]
    Storage(String),
    #[error("{what} could not be decoded: {detail}")]
    Decode { what: String, detail: String },
    #[error(
        "the ticket for {key} (attempt {attempt}) is stale: the call is now {state} at \
         attempt {current}"
    )]
    Stale {
        key: IdempotencyKey,
        attempt: u32,
        state: State,
        current: u32,
    },
    #[error("the journal has no record for key {0}")]
    UnknownKey(IdempotencyKey),
    #[error(
        "{key} is {state}; only in_doubt, reconciling and needs_operator calls can be resolved"
    )]
    NotResolvable { key: IdempotencyKey, state: State },
    #[error("invalid resolution: {0}")]
    InvalidResolution(String),
    #[error("stream {key}: {detail}")]
    Stream { key: String, detail: String },
    #[error("invalid {what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

/// What is corrupt, which decides what an operator can do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corruption {
    /// The journal's write-ahead log is damaged (a bad frame with whole frames after
    /// it): `outrigger journal` still reads it, up to the damage.
    DamagedWal,
    /// sled reports its own files corrupt: nothing can open the journal, the audit's
    /// copy included.
    Store,
}

fn corrupt_message(dir: &std::path::Path, detail: &str, kind: Corruption) -> String {
    let dir = dir.display();
    let fresh = format!(
        "move it aside with `outrigger journal quarantine --journal-dir {dir}` and restart \
         the sidecar, which starts a fresh journal (to which every call the old one knew is \
         unknown: a retry of one executes again)"
    );
    match kind {
        Corruption::DamagedWal => format!(
            "the journal in {dir} is corrupt ({detail}). Review what it holds with \
             `outrigger journal verify --journal-dir {dir}` and `outrigger journal list \
             --journal-dir {dir}` (they read it up to the damage); then {fresh}"
        ),
        Corruption::Store => format!(
            "the journal in {dir} is corrupt: its store cannot be opened ({detail}), so \
             `outrigger journal` cannot read it either. Keep the directory for analysis; \
             {fresh}"
        ),
    }
}

impl Error {
    /// The journal cannot write now (the disk or the writer failed), as opposed to a
    /// refusal about the request: callers with nothing to protect may go on without it.
    pub fn is_write_failure(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Storage(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corrupt_journal_s_message_says_what_can_read_it() {
        let corrupt = |kind| {
            Error::Corrupt {
                dir: PathBuf::from("./data/journal"),
                detail: "damage".to_owned(),
                kind,
            }
            .to_string()
        };
        let wal = corrupt(Corruption::DamagedWal);
        assert!(
            wal.contains("outrigger journal verify --journal-dir ./data/journal")
                && wal.contains("outrigger journal quarantine --journal-dir ./data/journal"),
            "{wal}"
        );
        let store = corrupt(Corruption::Store);
        assert!(
            !store.contains("journal verify")
                && !store.contains("journal list")
                && store.contains("cannot read it either")
                && store.contains("outrigger journal quarantine --journal-dir ./data/journal"),
            "{store}"
        );
    }
}
