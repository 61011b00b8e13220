//! The WebAssembly policy host: the only crate that names wasmtime.
//!
//! Retry, fallback and budget decisions are made by components written against
//! `wit/policy.wit` (`outrigger:policy@0.1.0`). A [`Runtime`] compiles them — or
//! loads them from a cache keyed by content hash and the engine's compatibility
//! hash — pre-instantiates them and runs each call on a warm instance under an epoch
//! deadline and a memory cap. The [`Registry`] binds one component to each hook and
//! swaps versions atomically ([`Registry::reload`]): a new version is compiled,
//! checked against the hook's interface and smoke-tested off the request path, and
//! only then published; calls already running finish on the version they started on.
//!
//! Invariants: a policy never fails a request — a trap, an overrun deadline, a memory
//! blow-up or a decision the host refuses ([`validate`]) is contained (the previous
//! good version, else the built-in, else a hard-wired default decides; or, for a
//! fail-closed binding, the strict decision) and is logged and counted; a bad new
//! version never replaces a good one; every decision says which version made it
//! ([`outrigger_types::Decided`]); startup is a reload from the empty set. The
//! generated bindings stay private and are converted at the edge, so the rest of the
//! sidecar speaks `outrigger_types` only. Policies get no filesystem, network or
//! environment: the host imports are log, monotonic time, randomness (seedable) and
//! their own parameters.

mod bindings;
mod compiler;
mod convert;
mod registry;
mod runtime;
pub mod validate;

use std::path::PathBuf;

pub use compiler::{COMPILE_TIMEOUT, Compiler, compile_child};
pub use registry::{
    Binding, BindingReload, BindingStatus, BuiltinComponent, MAX_RETRY_DELAY_PARAM, OnError,
    Options, Registry, ReloadOutcome, ReloadReport, Source, panic_message,
};
pub use runtime::{
    Fault, Hook, Loaded, MAX_LOG_LINES_PER_CALL, MAX_POOLED_RESOURCES, Runtime, RuntimeOptions,
    STDERR_TAIL_BYTES, TICK,
};

/// The version of the WIT package this host implements.
pub const WIT_PACKAGE_VERSION: &str = "0.1.0";

/// What went wrong setting up the host or loading a component.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("invalid policy options: {0}")]
    Options(String),
    #[error("could not set up the wasm engine: {0}")]
    Engine(String),
    #[error("compiled-component cache at {path}: {message}")]
    Cache { path: PathBuf, message: String },
    #[error("reading {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("not a WebAssembly binary")]
    NotWasm,
    #[error(
        "a core WebAssembly module, not a component (build for wasm32-wasip2, or wrap it with `wasm-tools component new`)"
    )]
    NotAComponent,
    #[error("invalid component: {0}")]
    Compile(String),
    #[error("component does not link against the policy host: {0}")]
    Link(String),
    #[error("component implements {found} but not the {wanted} hook")]
    WrongWorld { wanted: Hook, found: String },
    #[error("smoke test failed: {0}")]
    SmokeTest(Fault),
    /// The load panicked (a bug in the host or the engine): nothing was published.
    #[error("{0}")]
    Panicked(String),
}
