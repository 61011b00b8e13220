//! The generated host bindings for `wit/policy.wit`. Private to this crate: the rest
//! of the sidecar speaks `outrigger_types`, and `convert` maps between the two.

wasmtime::component::bindgen!({
    world: "policy",
    path: "../../wit",
    // What the host passes into a hook borrows from `outrigger_types`: no string
    // is copied on the host side of a decision.
    ownership: Borrowing { duplicate_if_necessary: false },
});

pub use exports::outrigger::policy::{budget, fallback, retry};
pub use outrigger::policy::{host, types};
