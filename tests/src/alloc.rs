//! Allocations counted per thread, for the test and the benchmark that hold the agent's
//! hellos to allocating nothing: a binary installs [`Counting`] as its global allocator
//! (`#[global_allocator] static A: Counting = Counting;`), and [`during`] counts what a
//! closure allocates on the calling thread (other threads' allocations are not its), and
//! [`retained`] the bytes of what it allocated that are still held when it returns.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

thread_local! {
    /// Allocations (and reallocations) made by this thread so far.
    static COUNT: Cell<u64> = const { Cell::new(0) };
    /// Bytes allocated by this thread less those it freed (whoever allocated them).
    static BYTES: Cell<i64> = const { Cell::new(0) };
}

/// The system allocator, counting.
pub struct Counting;

fn bump() {
    // A thread being torn down has no counter left: not counted.
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
}

fn add_bytes(n: i64) {
    let _ = BYTES.try_with(|c| c.set(c.get() + n));
}

fn size(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

// SAFETY: every call goes to the system allocator unchanged; counting touches only a
// thread-local cell, which allocates nothing (const-initialised).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        add_bytes(size(layout.size()));
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        add_bytes(size(layout.size()));
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add_bytes(-size(layout.size()));
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        add_bytes(size(new_size) - size(layout.size()));
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

/// What `f` returns, and the bytes it allocated on this thread that are still held when
/// it returns (in what it returns, or kept elsewhere); `None` where [`Counting`] is not
/// this binary's allocator. Requested sizes: the allocator's own rounding is not in it.
pub fn retained<T>(f: impl FnOnce() -> T) -> (T, Option<i64>) {
    let (out, counted) = during(|| {
        let before = BYTES.with(Cell::get);
        let out = f();
        (out, BYTES.with(Cell::get) - before)
    });
    let (out, bytes) = out;
    (out, counted.map(|_| bytes))
}
