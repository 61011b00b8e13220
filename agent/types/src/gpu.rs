//! The GPU health vocabulary the data plane and the policies see.

use serde::{Deserialize, Serialize};

/// Health of one GPU, or of the node (the worst over the watched GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuState {
    Healthy,
    /// Unknown: NVML is absent or unreadable. Ordered between healthy and degraded.
    Unknown,
    Degraded,
    Unhealthy,
}

impl GpuState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Unknown => "unknown",
            Self::Degraded => "degraded",
            Self::Unhealthy => "unhealthy",
        }
    }

    /// The OpenTelemetry `hw.state` value for this state.
    pub fn hw_state(self) -> &'static str {
        match self {
            Self::Healthy => "ok",
            Self::Unknown => "unknown",
            Self::Degraded => "degraded",
            Self::Unhealthy => "failed",
        }
    }
}

/// What the data plane needs to know about local GPUs: the node's overall state and
/// the ids of the GPUs that are unhealthy right now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSummary {
    pub state: GpuState,
    pub unhealthy: Vec<String>,
    /// Whether any GPU is being watched at all (false on a machine without NVML).
    pub present: bool,
    /// The watched GPUs' UUIDs (what spans of calls to a local model carry).
    #[serde(default)]
    pub ids: Vec<String>,
}

impl Default for GpuSummary {
    fn default() -> Self {
        Self {
            state: GpuState::Unknown,
            unhealthy: Vec::new(),
            present: false,
            ids: Vec::new(),
        }
    }
}
