//! Returning the policy compiler's memory to the OS.
//!
//! Compiling a WebAssembly component (Cranelift, on wasmtime's rayon threads and the
//! thread that asked) allocates and frees about 14 MiB for the three built-ins.
//! mimalloc keeps freed pages for reuse and purges them only when the thread that
//! owns them allocates again, which the compiler threads may never do; a sidecar
//! that compiled at start would carry that memory for its whole life. The sidecar
//! compiles in a child process (see `policies`); when it had to compile in process
//! instead, every one of those threads is asked to purge its free pages at once.

/// Purges free pages on the calling thread and on every thread of the global rayon
/// pool (where wasmtime compiles in parallel). Costs a few milliseconds; call it
/// after a load that compiled something (it starts the rayon pool if nothing had),
/// not on the request path.
pub fn release_compiler_memory() {
    rayon::broadcast(|_| purge_this_thread());
    purge_this_thread();
}

#[expect(unsafe_code, reason = "mimalloc's collect has no safe wrapper")]
fn purge_this_thread() {
    // SAFETY: `mi_collect` only walks the calling thread's heap and the allocator's
    // shared free lists; it takes no pointers and is safe to call at any time.
    unsafe { libmimalloc_sys::mi_collect(true) };
}
