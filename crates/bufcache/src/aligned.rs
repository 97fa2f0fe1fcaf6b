//! Page-aligned, zero-initialised heap memory for buffer data.
//!
//! Every buffer's bytes live in one `AlignedBytes`, aligned to the cache's page size, so that
//! the same memory can be handed to an O_DIRECT device without a bounce copy. The allocation
//! is zeroed so no stale heap contents can ever reach a reader.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// An owned, aligned, fixed-length byte array.
pub struct AlignedBytes {
    pointer: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBytes owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// Allocates `length` zero bytes aligned to `alignment` (a power of two).
    ///
    /// # Panics
    /// When `length` is zero or the layout is invalid: both are programming errors, since
    /// buffer sizes are validated by the configuration.
    pub fn zeroed(length: usize, alignment: usize) -> Self {
        assert!(length > 0, "zero-length buffer");
        let layout = Layout::from_size_align(length, alignment).expect("valid buffer layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let pointer = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBytes { pointer, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: zero-length buffers are never made.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation is live, initialised and `len` bytes long.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { alloc::dealloc(self.pointer.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_aligned_and_zeroed() {
        let bytes = AlignedBytes::zeroed(8192, 4096);
        assert_eq!(bytes.as_ptr() as usize % 4096, 0);
        assert!(bytes.iter().all(|&byte| byte == 0));
        assert_eq!(bytes.len(), 8192);
    }
}
