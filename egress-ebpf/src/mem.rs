//! Zeroing without `memset`. LLVM turns the zeroing of a larger struct (`mem::zeroed`,
//! runs of zero stores) into a call to compiler-builtins' `memset`, which on BPF is a
//! byte-at-a-time loop: about a hundred instructions for a 64-byte `bpf_fib_lookup`, on
//! every packet. Volatile stores of the widest word the type's alignment allows cannot be
//! merged back into such a call.

use core::{
    mem::{MaybeUninit, align_of, size_of},
    ptr::write_volatile,
};

/// Zero `x` in place, word by word. (Zeroing a temporary and moving it lets LLVM forward
/// the zeros and bring the `memset` back, hence no `zeroed() -> T`.)
///
/// # Safety
/// All-zero bytes must be a valid `T` (as for `core::mem::zeroed`).
#[inline(always)]
pub unsafe fn zero<T>(x: &mut T) {
    // SAFETY: `x` is valid for writes of a whole `T`; the caller vouches for zero.
    unsafe { zero_raw((x as *mut T).cast::<u8>(), size_of::<T>(), align_of::<T>()) }
}

/// Zero `slot` in place and hand it out initialised.
///
/// # Safety
/// All-zero bytes must be a valid `T`.
#[inline(always)]
pub unsafe fn zeroed_in<T>(slot: &mut MaybeUninit<T>) -> &mut T {
    // SAFETY: the slot is valid for writes of a `T`; after the stores every byte is zero,
    // which the caller vouches is a valid `T`.
    unsafe {
        zero_raw(
            slot.as_mut_ptr().cast::<u8>(),
            size_of::<T>(),
            align_of::<T>(),
        );
        slot.assume_init_mut()
    }
}

/// # Safety
/// `p` is valid for writes of `size` bytes and aligned to `align`.
#[inline(always)]
unsafe fn zero_raw(p: *mut u8, size: usize, align: usize) {
    // SAFETY: every store is inside the `size` bytes at `p`, aligned for its width (the
    // width divides the alignment and the size); together they cover all of them.
    unsafe {
        if align >= 8 && size.is_multiple_of(8) {
            for i in 0..size / 8 {
                write_volatile(p.cast::<u64>().add(i), 0);
            }
        } else if align >= 4 && size.is_multiple_of(4) {
            for i in 0..size / 4 {
                write_volatile(p.cast::<u32>().add(i), 0);
            }
        } else if align >= 2 && size.is_multiple_of(2) {
            for i in 0..size / 2 {
                write_volatile(p.cast::<u16>().add(i), 0);
            }
        } else {
            for i in 0..size {
                write_volatile(p.add(i), 0);
            }
        }
    }
}
