use std::fmt;

/// One thing wrong with an `[[slos]]` entry, with its key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SloProblem {
    /// e.g. `slos[1].target`.
    pub path: String,
    pub message: String,
}

impl fmt::Display for SloProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Everything that can go wrong in telemetry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("a global tracing subscriber is already installed; call telemetry::init once, first")]
    AlreadyInitialised,
    #[error("log filter {filter:?} is not valid: {detail}")]
    LogFilter { filter: String, detail: String },
    #[error("span export: {0}")]
    Export(String),
    #[error(
        "the SLO configuration has {} problem(s): {}",
        .0.len(),
        .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    SloConfig(Vec<SloProblem>),
    #[error("SLO state store: {0}")]
    Store(String),
}
