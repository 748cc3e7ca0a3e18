//! Allocations counted per thread, for the test and the benchmark that hold the agent's
//! hellos to allocating nothing: a binary installs [`Counting`] as its global allocator
//! (`#[global_allocator] static A: Counting = Counting;`), and [`during`] counts what a
//! closure allocates on the calling thread (other threads' allocations are not its).

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

thread_local! {
    /// Allocations (and reallocations) made by this thread so far.
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting.
pub struct Counting;

fn bump() {
    // A thread being torn down has no counter left: not counted.
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call goes to the system allocator unchanged; counting touches only a
// thread-local cell, which allocates nothing (const-initialised).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// What `f` returns, and how many allocations it made on this thread; `None` for the
/// count where [`Counting`] is not this binary's allocator (nothing would be counted).
pub fn during<T>(f: impl FnOnce() -> T) -> (T, Option<u64>) {
    let installed = {
        let before = COUNT.with(Cell::get);
        drop(std::hint::black_box(Vec::<u8>::with_capacity(8)));
        COUNT.with(Cell::get) > before
    };
    let before = COUNT.with(Cell::get);
    let out = f();
    let n = COUNT.with(Cell::get) - before;
    (out, installed.then_some(n))
}
