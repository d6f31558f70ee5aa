//! [`HostRegion`]: a fixed block of host memory a wire registers for one-sided writes.
//!
//! The block never moves or grows after creation, so a NIC can register it (the ibverbs wire
//! does: pinned host staging when GPUDirect RDMA is not in use). Rust code reads and writes it
//! through short critical sections; a wire writes into it on behalf of a remote peer.

use std::sync::{Mutex, MutexGuard};

use super::ProxyError;

/// A registered (or registrable) block of host memory of fixed size.
#[derive(Debug)]
pub struct HostRegion {
    bytes: Mutex<Box<[u8]>>,
    len: usize,
}

impl HostRegion {
    /// A zeroed region of `len` bytes.
    pub fn new(len: usize) -> HostRegion {
        HostRegion {
            bytes: Mutex::new(vec![0u8; len].into_boxed_slice()),
            len,
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn lock(&self) -> MutexGuard<'_, Box<[u8]>> {
        // No code panics while holding the lock (only bounds-checked copies run under it).
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn range(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>, ProxyError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(offset..end),
            _ => Err(ProxyError::InvalidArgument(format!(
                "bytes {offset}..{offset}+{len} are outside the region of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `bytes` into the region at `offset`.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), ProxyError> {
        let r = self.range(offset, bytes.len())?;
        self.lock()[r].copy_from_slice(bytes);
        Ok(())
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), ProxyError> {
        let r = self.range(offset, out.len())?;
        out.copy_from_slice(&self.lock()[r]);
        Ok(())
    }

    /// Appends `len` bytes at `offset` to `out`.
    pub fn read_into(
        &self,
        offset: usize,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), ProxyError> {
        let r = self.range(offset, len)?;
        out.extend_from_slice(&self.lock()[r]);
        Ok(())
    }

    /// The base address of the block, for NIC registration (valid while `self` lives: the block
    /// never moves).
    #[cfg(feature = "rdma")]
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.lock().as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_was_written_and_rejects_out_of_range_access() {
        let r = HostRegion::new(16);
        r.write(4, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 5];
        r.read(3, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0]);
        let e = r.write(15, &[1, 2]).unwrap_err();
        assert!(
            e.to_string().contains("outside the region of 16 bytes"),
            "{e}"
        );
        assert!(r.read(usize::MAX, &mut out).is_err());
    }
}
