//! How a unit of work counts against the error budget: good, bad with exactly one
//! cause, or excluded (counted, but outside the denominator).

use serde::{Deserialize, Serialize};

/// The single cause a bad event is charged to. The precedence when several apply is
/// the declaration order (hardware first), and it lives in one classifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    Hardware,
    Release,
    Capacity,
    Network,
    UpstreamModel,
    Unknown,
}

impl Cause {
    pub const ALL: [Cause; 6] = [
        Cause::Hardware,
        Cause::Release,
        Cause::Capacity,
        Cause::Network,
        Cause::UpstreamModel,
        Cause::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hardware => "hardware",
            Self::Release => "release",
            Self::Capacity => "capacity",
            Self::Network => "network",
            Self::UpstreamModel => "upstream_model",
            Self::Unknown => "unknown",
        }
    }
}

/// Why an event is left out of the error budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// The agent sent something invalid (400/404/413/422, context overflow).
    InvalidClient,
    /// The agent went away before the work finished.
    ClientCancelled,
    /// The work happened inside a declared maintenance window.
    Maintenance,
    /// Drill or probe traffic, marked as such by its sender.
    Synthetic,
}

impl Exclusion {
    pub const ALL: [Exclusion; 4] = [
        Exclusion::InvalidClient,
        Exclusion::ClientCancelled,
        Exclusion::Maintenance,
        Exclusion::Synthetic,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidClient => "invalid_client",
            Self::ClientCancelled => "client_cancelled",
            Self::Maintenance => "maintenance",
            Self::Synthetic => "synthetic",
        }
    }
}

/// The SLO outcome of one unit of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "why", rename_all = "snake_case")]
pub enum Outcome {
    Good,
    Bad(Cause),
    Excluded(Exclusion),
}
