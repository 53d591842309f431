//! The filter's allocator: small blocks recycled through one free list per block size, in
//! front of the system allocator (wasi-libc's dlmalloc).
//!
//! A request makes a handful of small allocations: its context, the host's copies of `:path`
//! and of the peer's address, its key set's bytes, a 429's headers and body. dlmalloc spends
//! a couple of hundred instructions on each allocation and free; a free list a few dozen. A
//! freed block waits in its list for the next allocation of its size class, so a list holds at
//! most as many blocks as were live at once (a wasm module's memory never shrinks anyway).
//! Larger or more aligned allocations go to the system allocator as before.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;

/// Block sizes of the lists: 16, 32, ... 1024 bytes.
const CLASSES: usize = 7;
const SMALLEST: usize = 16;
const LARGEST: usize = SMALLEST << (CLASSES - 1);
/// The alignment of every pooled block (what the system allocator gives at least).
const ALIGN: usize = 8;

/// The free lists: each head is a free block, whose first word points at the next.
pub struct Pools {
    heads: UnsafeCell<[*mut u8; CLASSES]>,
}

// SAFETY: a proxy-wasm VM runs one thread (the global allocator is the pools only on wasm32
// without atomics, see lib.rs); tests use a pool of their own on one thread.
unsafe impl Sync for Pools {}

impl Pools {
    pub const fn new() -> Pools {
        Pools {
            heads: UnsafeCell::new([std::ptr::null_mut(); CLASSES]),
        }
    }
}

/// The list for a layout, if it is pooled: small enough, and aligned as every block is.
fn class(layout: Layout) -> Option<usize> {
    if layout.size() > LARGEST || layout.align() > ALIGN {
        return None;
    }
    let size = layout.size().max(SMALLEST);
    // The smallest class that holds `size`: 16 -> 0, 17..=32 -> 1, ... 513..=1024 -> 6.
    Some((usize::BITS - (size - 1).leading_zeros()) as usize - SMALLEST.trailing_zeros() as usize)
}

fn block(class: usize) -> Layout {
    // SAFETY: a power of two, at most `LARGEST`, is a valid size for alignment 8.
    unsafe { Layout::from_size_align_unchecked(SMALLEST << class, ALIGN) }
}

// SAFETY: every block handed out comes from `System` with the class's size and `ALIGN`, at
// least the layout asked; a block is in at most one list, and only while it is free.
unsafe impl GlobalAlloc for Pools {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(class) = class(layout) else {
            // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
            return unsafe { System.alloc(layout) };
        };
        // SAFETY: one thread, and no reference to the heads outlives this call.
        let heads = unsafe { &mut *self.heads.get() };
        match heads.get_mut(class) {
            Some(head) if !head.is_null() => {
                let block = *head;
                // SAFETY: a free block's first word is the next free block (or null).
                *head = unsafe { *(block as *mut *mut u8) };
                block
            }
            // SAFETY: a non-zero size and a valid alignment.
            _ => unsafe { System.alloc(block(class)) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(class) = class(layout) else {
            // SAFETY: `ptr` came from `System` with this layout (see `alloc`).
            return unsafe { System.dealloc(ptr, layout) };
        };
        // SAFETY: one thread, and no reference to the heads outlives this call.
        let heads = unsafe { &mut *self.heads.get() };
        if let Some(head) = heads.get_mut(class) {
            // SAFETY: `ptr` is a block of this class, at least 16 bytes aligned to 8, and no
            // longer in use: its first word now links it into the list.
            unsafe { *(ptr as *mut *mut u8) = *head };
            *head = ptr;
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if class(layout).is_none() {
            // SAFETY: the caller's layout, as `GlobalAlloc::alloc_zeroed` requires.
            return unsafe { System.alloc_zeroed(layout) };
        }
        // SAFETY: as `alloc`; the block holds at least `layout.size()` bytes.
        unsafe {
            let ptr = self.alloc(layout);
            if !ptr.is_null() {
                std::ptr::write_bytes(ptr, 0, layout.size());
            }
            ptr
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller promises `new_size` is valid for `layout.align()`.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (class(layout), class(new_layout)) {
            // SAFETY: `ptr` came from `System` with `layout` (see `alloc`).
            (None, None) => unsafe { System.realloc(ptr, layout, new_size) },
            // The block already holds the new size.
            (Some(old), Some(new)) if old == new => ptr,
            // SAFETY: a new block for the new layout, the bytes both hold copied, the old freed.
            _ => unsafe {
                let moved = self.alloc(new_layout);
                if !moved.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                moved
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn sizes_fall_in_the_smallest_class_that_holds_them() {
        let classes: Vec<Option<usize>> = [1, 16, 17, 32, 33, 64, 100, 256, 512, 513, 1024, 1025]
            .iter()
            .map(|&size| class(layout(size, 1)))
            .collect();
        let expected = [0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 6];
        assert_eq!(classes[..11], expected.map(Some));
        assert_eq!(classes[11], None, "larger: the system's");
        assert_eq!(class(layout(64, 16)), None, "more aligned: the system's");
    }

    #[test]
    fn a_freed_block_is_handed_out_again_and_holds_its_bytes() {
        let pools = Pools::new();
        unsafe {
            let a = pools.alloc(layout(20, 4));
            let b = pools.alloc(layout(30, 8));
            assert_ne!(a, b);
            assert_eq!(a as usize % ALIGN, 0);
            pools.dealloc(a, layout(20, 4));
            assert_eq!(
                pools.alloc(layout(32, 1)),
                a,
                "same class: the block freed last"
            );
            // Grown within its class: the same block; beyond it: moved, bytes kept.
            std::ptr::write_bytes(b, 7, 30);
            assert_eq!(pools.realloc(b, layout(30, 8), 32), b);
            let c = pools.realloc(b, layout(32, 8), 600);
            assert_ne!(c, b);
            assert_eq!(std::slice::from_raw_parts(c, 30), [7; 30]);
            let d = pools.realloc(c, layout(600, 8), 5_000);
            assert_eq!(
                std::slice::from_raw_parts(d, 30),
                [7; 30],
                "into the system's"
            );
            let e = pools.realloc(d, layout(5_000, 8), 40);
            assert_eq!(std::slice::from_raw_parts(e, 30), [7; 30], "and back");
            let zeroed = pools.alloc_zeroed(layout(40, 8));
            assert_eq!(std::slice::from_raw_parts(zeroed, 40), [0; 40]);
            for (ptr, size) in [(a, 32), (e, 40), (zeroed, 40)] {
                pools.dealloc(ptr, layout(size, 8));
            }
        }
    }
}
