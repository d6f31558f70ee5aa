//! [`AbortWord`]: a word of pinned, device-mapped host memory that kernels waiting for peers
//! poll, and that the host raises with a plain store (no CUDA call) when a peer is known to be
//! gone, so that a waiting kernel gives up at once, even while another host thread of the
//! process is blocked in a CUDA call that waits for that kernel.

use std::sync::Arc;

use crate::device::Device;
use crate::error::Result;
use crate::pinned::PinnedBuffer;

/// A shared abort word (clones are handles to the same word). Starts lowered; once raised it
/// stays raised.
#[derive(Clone, Debug)]
pub struct AbortWord {
    word: Arc<PinnedBuffer>,
}

impl AbortWord {
    /// A lowered word that kernels of `device` can poll.
    pub fn new(device: &Device) -> Result<AbortWord> {
        Ok(AbortWord {
            word: Arc::new(PinnedBuffer::new(device, 4)?),
        })
    }

    /// Raises the word: every kernel polling it gives up its waits from now on. A host store
    /// only, safe to call from any thread at any time (e.g. a thread that just saw a peer's
    /// connection end).
    pub fn raise(&self) {
        self.word.raise(1);
    }

    /// Whether the word was raised.
    pub fn is_raised(&self) -> bool {
        self.word.value() != 0
    }

    /// The device address kernels poll (fixed for the word's life, so graphs may capture it).
    pub(crate) fn device_addr(&self) -> Result<u64> {
        self.word.device_addr()
    }
}
