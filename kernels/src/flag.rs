//! [`DeviceFlag`]: a 32-bit word of device memory that streams raise and wait on with stream
//! memory operations (`cuStreamWriteValue32` / `cuStreamWaitValue32`), for readiness signals
//! between GPUs without events or the host.

use cudarc::driver::sys;

use crate::buffer::DeviceBuffer;
use crate::device::{drv, Device};
use crate::error::Result;
use crate::stream::Stream;

/// A counter in device memory of one GPU. A stream of this GPU, or of a GPU with peer access
/// to it, raises it ([`signal`](DeviceFlag::signal): a write ordered after the stream's
/// earlier work, with a memory fence); a stream of this GPU waits until it reaches a value
/// ([`wait`](DeviceFlag::wait)). Values grow; the wait compares cyclically
/// (`(int32_t)(flag - value) >= 0`), so a waiter must never be more than 2³¹ behind.
///
/// While a stream waits for a value that only a later host call raises, the host must not
/// call anything that may synchronize the whole context (loading a module, e.g. the first
/// launch of a kernel, `cuMemAlloc`, a device synchronize): it would wait for the blocked
/// stream and never return.
#[derive(Clone, Debug)]
pub struct DeviceFlag {
    word: DeviceBuffer,
}

impl DeviceFlag {
    /// A flag on `device`, starting at 0 (blocks until the word is zeroed).
    pub fn new(device: &Device) -> Result<DeviceFlag> {
        let word = DeviceBuffer::alloc(device, 4)?;
        let s = Stream::new(device)?;
        word.zero(&s)?;
        s.synchronize()?;
        Ok(DeviceFlag { word })
    }

    /// A flag at the 4-byte, 4-aligned view `word` (e.g. a word of a peer's memory mapped
    /// over CUDA IPC, which this process then raises, or a word of its own that peers raise).
    /// The word's value is left as it is.
    pub fn at(word: DeviceBuffer) -> Result<DeviceFlag> {
        if word.len() != 4 || !word.is_aligned(4) {
            return Err(crate::error::KernelError::InvalidArgument(format!(
                "a device flag needs a 4-byte aligned word, not {} bytes",
                word.len()
            )));
        }
        Ok(DeviceFlag { word })
    }

    /// The GPU whose memory holds the flag.
    pub fn device(&self) -> &Device {
        self.word.device()
    }

    /// Enqueues on `stream` (of this GPU or a peer with access enabled) a write of `value`.
    pub fn signal(&self, stream: &Stream, value: u32) -> Result<()> {
        let s = stream.bind_raw()?;
        // SAFETY: the word is a live 4-byte allocation reachable from the stream's context
        // (the same device, or peer access was enabled by the caller, else the driver errs).
        drv("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(
                s,
                self.word.addr(),
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
            .result()
        })
    }

    /// Makes `stream` (of this GPU) wait until the flag is at least `value`.
    pub fn wait(&self, stream: &Stream, value: u32) -> Result<()> {
        stream.expect_device(self.word.device(), "a device flag wait")?;
        let s = stream.bind_raw()?;
        // SAFETY: the word is a live allocation of the stream's device.
        drv("cuStreamWaitValue32", unsafe {
            sys::cuStreamWaitValue32_v2(
                s,
                self.word.addr(),
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
            .result()
        })
    }
}
