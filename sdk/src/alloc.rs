//! An optional global allocator for policies: small blocks are recycled through
//! free lists instead of going to the C allocator on every call.
//!
//! A decision allocates and frees a handful of small blocks: the host places every
//! string and list of the input in the guest (through `cabi_realloc`), the bindings
//! free them when the hook returns, and the answer is freed after the host has read
//! it. With the standard allocator each of those is a call into wasi-libc's
//! dlmalloc, about a fifth of a Rust built-in's decision. [`SmallBlockCache`] keeps
//! freed blocks of up to [`LARGEST`] bytes in per-size free lists (a bounded number
//! of each) and hands them out again; everything else, and every block it does not
//! keep, goes to the standard allocator.
//!
//! It is correct whoever allocated a block: a freed block is filed by the size the
//! C allocator says it really has (`malloc_usable_size`), never by the size the
//! caller claims, so a block is only ever reused for a request that fits in it.
//! (talc, which relies on the size a `free` passes, traps in the built-ins'
//! bindings; a free that passes another size than was allocated is the likely
//! cause.)
//!
//! Install it in a policy crate (single-threaded WebAssembly only; the type is not
//! `Sync` elsewhere):
//!
//! ```ignore
//! #[cfg(target_family = "wasm")]
//! #[global_allocator]
//! static ALLOCATOR: outrigger_policy_sdk::alloc::SmallBlockCache =
//!     outrigger_policy_sdk::alloc::SmallBlockCache::new();
//! ```
#![expect(
    unsafe_code,
    reason = "a global allocator is unsafe by definition; the invariants are stated at each block"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// Block sizes with a free list, smallest first.
const CLASSES: [usize; 5] = [8, 16, 32, 64, 128];
/// The largest block kept; larger ones always go to the standard allocator.
pub const LARGEST: usize = 128;
/// The largest alignment served from the lists (the C allocator aligns every block
/// to at least this).
const ALIGN: usize = 8;
/// Blocks kept per size, at most; more are freed.
const KEEP: u16 = 64;

/// The free lists: a block's first word points at the next block of its list.
struct Lists {
    heads: [*mut u8; CLASSES.len()],
    counts: [u16; CLASSES.len()],
}

/// A global allocator that recycles small blocks; see the [module](self) docs.
pub struct SmallBlockCache {
    lists: UnsafeCell<Lists>,
}

// SAFETY: a policy component is single-threaded WebAssembly (no `atomics`): there is
// never a second thread to race on the lists. Elsewhere the type is not `Sync`, so it
// cannot be installed as a global allocator by mistake.
#[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
unsafe impl Sync for SmallBlockCache {}

impl Default for SmallBlockCache {
    fn default() -> Self {
        Self::new()
    }
}

impl SmallBlockCache {
    /// An allocator with empty lists.
    pub const fn new() -> Self {
        Self {
            lists: UnsafeCell::new(Lists {
                heads: [ptr::null_mut(); CLASSES.len()],
                counts: [0; CLASSES.len()],
            }),
        }
    }

    /// The list a request of `layout` is served from, if any: the smallest size
    /// that holds it.
    fn class_for(layout: Layout) -> Option<usize> {
        if layout.align() > ALIGN {
            return None;
        }
        CLASSES.iter().position(|&size| layout.size() <= size)
    }

    /// The list a freed block of `usable` bytes goes to: the largest size it holds.
    fn class_of(usable: usize) -> Option<usize> {
        CLASSES.iter().rposition(|&size| usable >= size)
    }
}

unsafe extern "C" {
    /// The C allocator's size of a block it allocated (glibc and wasi-libc both
    /// provide it).
    fn malloc_usable_size(ptr: *mut u8) -> usize;
}

// SAFETY: every block handed out comes from `System` (directly, or recycled after
// `System` allocated it and it was freed), is at least as large as asked for (a
// recycled block was filed by its real size, which is at least its list's size, which
// is at least the request) and aligned to `ALIGN` (the C allocator's minimum), which
// is all the lists serve.
unsafe impl GlobalAlloc for SmallBlockCache {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(class) = Self::class_for(layout) else {
            // SAFETY: forwarded as is.
            return unsafe { System.alloc(layout) };
        };
        // SAFETY: single-threaded (see `Sync`), and no allocation happens while the
        // reference lives.
        let lists = unsafe { &mut *self.lists.get() };
        let head = lists.heads[class];
        if head.is_null() {
            // Allocate the whole class size, so the block can serve any request of
            // this class when it comes back.
            // SAFETY: the size is non-zero and the alignment a power of two.
            return unsafe {
                System.alloc(Layout::from_size_align_unchecked(CLASSES[class], ALIGN))
            };
        }
        // SAFETY: `head` is a block on the list; its first word is the next one.
        lists.heads[class] = unsafe { head.cast::<*mut u8>().read() };
        lists.counts[class] -= 1;
        head
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() <= LARGEST && layout.align() <= ALIGN {
            // SAFETY: `ptr` was allocated by the C allocator (through `System`, or
            // by C code) and is still live.
            let usable = unsafe { malloc_usable_size(ptr) };
            // SAFETY: single-threaded (see `Sync`).
            let lists = unsafe { &mut *self.lists.get() };
            if let Some(class) = Self::class_of(usable)
                && lists.counts[class] < KEEP
            {
                // SAFETY: the block is at least one pointer wide (the smallest
                // size is 8 bytes) and aligned for it; it is ours now.
                unsafe { ptr.cast::<*mut u8>().write(lists.heads[class]) };
                lists.heads[class] = ptr;
                lists.counts[class] += 1;
                return;
            }
        }
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() > LARGEST && new_size > LARGEST {
            // Neither end is a listed size: let the C allocator resize in place.
            // SAFETY: forwarded as is.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // SAFETY: the caller's guarantees for `realloc` are those of `alloc` and
        // `dealloc` for the two blocks.
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random allocations, frees and reallocations of small and large blocks, each
    /// filled with its own byte: a block handed out twice, or too small, shows up as
    /// a wrong byte.
    #[test]
    fn recycled_blocks_are_big_enough_and_never_shared() {
        let cache = SmallBlockCache::new();
        let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for step in 0..20_000u32 {
            let r = next();
            let fill = (step % 251) as u8;
            if live.len() < 200 && r % 3 != 0 {
                let size = match r % 10 {
                    0 => 1 + (r >> 8) as usize % 600,
                    _ => 1 + (r >> 8) as usize % 130,
                };
                let align = [1, 2, 4, 8, 16][(r >> 20) as usize % 5];
                let layout = Layout::from_size_align(size, align).unwrap();
                let p = unsafe { cache.alloc(layout) };
                assert!(!p.is_null());
                assert_eq!(p as usize % align, 0, "alignment {align}");
                unsafe { ptr::write_bytes(p, fill, size) };
                live.push((p, layout, fill));
            } else if !live.is_empty() {
                let i = (r >> 8) as usize % live.len();
                let (p, layout, old) = live.swap_remove(i);
                let bytes = unsafe { std::slice::from_raw_parts(p, layout.size()) };
                assert!(bytes.iter().all(|&b| b == old), "block corrupted");
                if r % 5 == 0 {
                    let new_size = 1 + (r >> 24) as usize % 300;
                    let q = unsafe { cache.realloc(p, layout, new_size) };
                    let kept = layout.size().min(new_size);
                    let moved = unsafe { std::slice::from_raw_parts(q, kept) };
                    assert!(moved.iter().all(|&b| b == old), "realloc lost bytes");
                    unsafe { ptr::write_bytes(q, fill, new_size) };
                    let new_layout = Layout::from_size_align(new_size, layout.align()).unwrap();
                    live.push((q, new_layout, fill));
                } else {
                    unsafe { cache.dealloc(p, layout) };
                }
            }
        }
        for (p, layout, _) in live {
            unsafe { cache.dealloc(p, layout) };
        }
    }

    #[test]
    fn a_block_freed_with_a_smaller_size_is_filed_by_its_real_size() {
        let cache = SmallBlockCache::new();
        let big = Layout::from_size_align(100, 1).unwrap();
        let p = unsafe { cache.alloc(big) };
        // Freed claiming 10 bytes: still filed where a 100-byte request finds it.
        unsafe { cache.dealloc(p, Layout::from_size_align(10, 1).unwrap()) };
        let q = unsafe { cache.alloc(big) };
        assert_eq!(p, q);
        unsafe { ptr::write_bytes(q, 7, 100) };
        unsafe { cache.dealloc(q, big) };
    }
}
