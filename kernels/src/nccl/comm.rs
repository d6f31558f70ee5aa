//! NCCL communicators: unique ids, creation, split, groups, error state and teardown
//! (the operations are in `collectives.rs`).

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;

use super::library::NcclLib;
use super::sys::{self, ncclComm_t, ncclResult_t};
use crate::device::Device;
use crate::error::{KernelError, Result};

/// The 128-byte NCCL unique id that ranks share (over any rendezvous) to form a communicator.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; UniqueId::LEN]);

impl UniqueId {
    /// Size in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const LEN: usize = 128;

    /// A fresh id (`ncclGetUniqueId`); one rank creates it and sends it to the others.
    pub fn new(lib: &NcclLib) -> Result<UniqueId> {
        let mut raw = sys::ncclUniqueId {
            internal: [0; UniqueId::LEN],
        };
        // SAFETY: symbol checked at load; valid out pointer.
        let r = unsafe { lib.sys().ncclGetUniqueId(&mut raw) };
        lib.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; UniqueId::LEN] {
        self.0
    }

    /// An id received from the rank that created it.
    pub fn from_bytes(bytes: [u8; UniqueId::LEN]) -> UniqueId {
        UniqueId(bytes)
    }

    /// An id from a byte slice, which must be exactly [`UniqueId::LEN`] bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<UniqueId> {
        <[u8; UniqueId::LEN]>::try_from(bytes)
            .map(UniqueId)
            .map_err(|_| {
                KernelError::InvalidArgument(format!(
                    "an NCCL unique id has {} bytes, got {}",
                    UniqueId::LEN,
                    bytes.len()
                ))
            })
    }

    fn to_sys(self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// Starts an NCCL group: operations up to [`group_end`] are batched (needed when one thread
/// drives several communicators, and for send/recv pairs).
pub fn group_start(lib: &NcclLib) -> Result<()> {
    // SAFETY: symbol checked at load.
    let r = unsafe { lib.sys().ncclGroupStart() };
    lib.check("ncclGroupStart", r, std::ptr::null_mut())
}

/// Ends an NCCL group and launches its operations.
pub fn group_end(lib: &NcclLib) -> Result<()> {
    // SAFETY: symbol checked at load.
    let r = unsafe { lib.sys().ncclGroupEnd() };
    lib.check("ncclGroupEnd", r, std::ptr::null_mut())
}

/// Runs `f` inside one NCCL group. The group is ended even when `f` fails (NCCL must not be left
/// inside a group); `f`'s error wins.
pub fn group<T>(lib: &NcclLib, f: impl FnOnce() -> Result<T>) -> Result<T> {
    group_start(lib)?;
    let out = f();
    let end = group_end(lib);
    let value = out?;
    end?;
    Ok(value)
}

/// One NCCL communicator: this process's rank in it, on one device.
///
/// Not `Sync`: NCCL communicators must not be used from two threads at once. Dropping an owned
/// communicator aborts it (never hangs); use [`teardown`] or [`Comm::destroy`] for an orderly end.
pub struct Comm {
    pub(super) lib: Arc<NcclLib>,
    pub(super) raw: ncclComm_t,
    pub(super) device: Device,
    pub(super) rank: usize,
    pub(super) size: usize,
    borrowed: bool,
    closed: bool,
}

// SAFETY: an NCCL communicator may be moved to and used from another thread (one at a time).
unsafe impl Send for Comm {}

pub(super) fn c_int_of(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| KernelError::InvalidArgument(format!("{what} {v} does not fit int")))
}

impl Comm {
    fn wrap(lib: &Arc<NcclLib>, raw: ncclComm_t, device: &Device, borrowed: bool) -> Result<Comm> {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: `raw` is a live communicator; symbols checked at load; valid out pointers.
        let r = unsafe { lib.sys().ncclCommUserRank(raw, &mut rank) };
        lib.check("ncclCommUserRank", r, raw)?;
        // SAFETY: as above.
        let r = unsafe { lib.sys().ncclCommCount(raw, &mut size) };
        lib.check("ncclCommCount", r, raw)?;
        Ok(Comm {
            lib: lib.clone(),
            raw,
            device: device.clone(),
            rank: usize::try_from(rank).unwrap_or(0),
            size: usize::try_from(size).unwrap_or(0),
            borrowed,
            closed: false,
        })
    }

    /// Joins communicator `id` as `rank` of `nranks` on `device` (`ncclCommInitRank`; blocks
    /// until every rank has joined). Call it outside any NCCL group (one rank per thread or
    /// process); one thread driving several GPUs uses [`Comm::init_all`].
    pub fn init_rank(
        lib: &Arc<NcclLib>,
        device: &Device,
        nranks: usize,
        id: &UniqueId,
        rank: usize,
    ) -> Result<Comm> {
        if rank >= nranks {
            return Err(KernelError::InvalidArgument(format!(
                "rank {rank} of {nranks} ranks"
            )));
        }
        device.bind()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: symbol checked at load; the device's context is current, as NCCL expects.
        let r = unsafe {
            lib.sys().ncclCommInitRank(
                &mut raw,
                c_int_of(nranks, "nranks")?,
                id.to_sys(),
                c_int_of(rank, "rank")?,
            )
        };
        lib.check("ncclCommInitRank", r, raw)?;
        Comm::wrap(lib, raw, device, false)
    }

    /// One communicator over `devices` (all in this process; rank `i` on `devices[i]`) with
    /// `ncclCommInitAll`.
    pub fn init_all(lib: &Arc<NcclLib>, devices: &[Device]) -> Result<Vec<Comm>> {
        let ordinals: Vec<c_int> = devices
            .iter()
            .map(|d| c_int_of(d.ordinal(), "device ordinal"))
            .collect::<Result<_>>()?;
        let mut sorted = ordinals.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ordinals.len() || devices.is_empty() {
            return Err(KernelError::InvalidArgument(format!(
                "ncclCommInitAll needs distinct devices, got ordinals {ordinals:?}"
            )));
        }
        let mut raws: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has one slot per device; the ordinal list outlives the call.
        let r = unsafe {
            lib.sys().ncclCommInitAll(
                raws.as_mut_ptr(),
                c_int_of(devices.len(), "ndev")?,
                ordinals.as_ptr(),
            )
        };
        lib.check("ncclCommInitAll", r, std::ptr::null_mut())?;
        raws.into_iter()
            .zip(devices)
            .map(|(raw, d)| Comm::wrap(lib, raw, d, false))
            .collect()
    }

    /// Wraps a communicator created by the caller (e.g. PyTorch). meshflow never finalizes,
    /// destroys or aborts a borrowed communicator.
    ///
    /// # Safety
    /// `raw` must be a live communicator of `lib`, on `device`, that outlives the returned
    /// `Comm` and is not used concurrently by others while meshflow uses it.
    pub unsafe fn from_raw_borrowed(
        lib: &Arc<NcclLib>,
        raw: ncclComm_t,
        device: &Device,
    ) -> Result<Comm> {
        let mut cu_device = 0;
        let r = lib.sys().ncclCommCuDevice(raw, &mut cu_device);
        lib.check("ncclCommCuDevice", r, raw)?;
        if usize::try_from(cu_device).ok() != Some(device.ordinal()) {
            return Err(KernelError::InvalidArgument(format!(
                "communicator is on device {cu_device}, not {}",
                device.ordinal()
            )));
        }
        Comm::wrap(lib, raw, device, true)
    }

    /// The raw `ncclComm_t`, for embedders that call NCCL themselves. It stays owned by this
    /// `Comm` (unless borrowed) and is invalid once the `Comm` is destroyed, aborted or dropped.
    pub fn as_raw(&self) -> ncclComm_t {
        self.raw
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device of this rank.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The NCCL library.
    pub fn lib(&self) -> &Arc<NcclLib> {
        &self.lib
    }

    /// Whether the communicator belongs to the caller (see [`Comm::from_raw_borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// Splits into sub-communicators (`ncclCommSplit`, collective over this communicator): ranks
    /// with the same `color` form one, ordered by `key`; `None` opts out (returns `None`).
    ///
    /// Call it outside any NCCL group. For one process with one thread driving every rank, use
    /// [`split_all`], which groups the splits correctly.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm>> {
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: outside a group the call completes before returning, so `raw` outlives it.
        unsafe { self.split_into(color, key, &mut raw)? };
        self.wrap_split(raw)
    }

    /// Issues `ncclCommSplit` with `slot` as the output.
    ///
    /// # Safety
    /// Inside a group NCCL writes `*slot` only at `ncclGroupEnd`: `slot` must stay valid (not
    /// moved or freed) until the group has ended.
    unsafe fn split_into(&self, color: Option<u32>, key: i32, slot: *mut ncclComm_t) -> Result<()> {
        let color = match color {
            Some(c) => c_int::try_from(c)
                .map_err(|_| KernelError::InvalidArgument(format!("split color {c}")))?,
            None => sys::NCCL_SPLIT_NOCOLOR,
        };
        self.device.bind()?;
        // SAFETY: live communicator; `slot` valid per this function's contract; null config
        // means "inherit".
        let r = unsafe {
            self.lib
                .sys()
                .ncclCommSplit(self.raw, color, key, slot, std::ptr::null_mut())
        };
        self.lib.check("ncclCommSplit", r, self.raw)
    }

    fn wrap_split(&self, raw: ncclComm_t) -> Result<Option<Comm>> {
        if raw.is_null() {
            return Ok(None);
        }
        Comm::wrap(&self.lib, raw, &self.device, false).map(Some)
    }

    /// The communicator's asynchronous error state (`ncclCommGetAsyncError`): `Ok` while healthy
    /// or still in progress.
    pub fn check_async_error(&self) -> Result<()> {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: live communicator; valid out pointer.
        let r = unsafe { self.lib.sys().ncclCommGetAsyncError(self.raw, &mut state) };
        self.lib.check("ncclCommGetAsyncError", r, self.raw)?;
        if state == ncclResult_t::ncclSuccess || state == ncclResult_t::ncclInProgress {
            Ok(())
        } else {
            Err(KernelError::Nccl(self.lib.error(
                "asynchronous NCCL operation",
                state.0,
                self.raw,
            )))
        }
    }

    fn refuse_borrowed(&self, what: &str) -> Result<()> {
        if self.borrowed {
            Err(KernelError::InvalidArgument(format!(
                "{what} of a borrowed communicator: it belongs to the caller"
            )))
        } else {
            Ok(())
        }
    }

    /// Orderly end of this one communicator: `ncclCommFinalize`, then `ncclCommDestroy`. Every
    /// rank must call it. One thread holding several communicators uses [`teardown`] instead.
    pub fn destroy(self) -> Result<()> {
        self.refuse_borrowed("destroy")?;
        teardown(vec![self])
    }

    /// Aborts the communicator (`ncclCommAbort`): cancels pending operations, never hangs.
    pub fn abort(mut self) -> Result<()> {
        self.refuse_borrowed("abort")?;
        self.closed = true;
        self.device.bind()?;
        // SAFETY: owned, live communicator, not used after this.
        let r = unsafe { self.lib.sys().ncclCommAbort(self.raw) };
        self.lib.check("ncclCommAbort", r, std::ptr::null_mut())
    }
}

/// Splits several communicators of one process at once (one thread driving every rank, e.g.
/// after [`Comm::init_all`]): `ncclCommSplit` for each inside one group, `(color, key)` per
/// communicator as in [`Comm::split`].
pub fn split_all(comms: &[Comm], colors_keys: &[(Option<u32>, i32)]) -> Result<Vec<Option<Comm>>> {
    if comms.len() != colors_keys.len() {
        return Err(KernelError::InvalidArgument(format!(
            "split_all: {} communicators, {} (color, key) pairs",
            comms.len(),
            colors_keys.len()
        )));
    }
    let Some(lib) = comms.first().map(|c| c.lib.clone()) else {
        return Ok(Vec::new());
    };
    // NCCL fills the new handles at ncclGroupEnd, so the slots must outlive the whole group.
    let mut slots: Vec<ncclComm_t> = vec![std::ptr::null_mut(); comms.len()];
    let slot_ptrs: Vec<*mut ncclComm_t> = slots.iter_mut().map(|s| s as *mut ncclComm_t).collect();
    group(&lib, || {
        for ((c, (color, key)), slot) in comms.iter().zip(colors_keys).zip(&slot_ptrs) {
            // SAFETY: `slots` is neither moved nor dropped until after the group has ended.
            unsafe { c.split_into(*color, *key, *slot)? };
        }
        Ok(())
    })?;
    comms
        .iter()
        .zip(slots)
        .map(|(c, raw)| c.wrap_split(raw))
        .collect()
}

/// Orderly teardown of owned communicators (e.g. all of one `init_all`): finalizes them all
/// inside one group, then destroys each. Borrowed communicators are skipped (left to their
/// owner). On error the remaining communicators are aborted when dropped.
pub fn teardown(comms: Vec<Comm>) -> Result<()> {
    let mut owned: Vec<Comm> = comms.into_iter().filter(|c| !c.borrowed).collect();
    let Some(lib) = owned.first().map(|c| c.lib.clone()) else {
        return Ok(());
    };
    group(&lib, || {
        for c in &owned {
            c.device.bind()?;
            // SAFETY: owned, live communicator.
            let r = unsafe { c.lib.sys().ncclCommFinalize(c.raw) };
            c.lib.check("ncclCommFinalize", r, c.raw)?;
        }
        Ok(())
    })?;
    for c in &mut owned {
        c.device.bind()?;
        c.closed = true;
        // SAFETY: finalized, owned communicator, never used again (closed).
        let r = unsafe { c.lib.sys().ncclCommDestroy(c.raw) };
        c.lib.check("ncclCommDestroy", r, std::ptr::null_mut())?;
    }
    Ok(())
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.borrowed || self.closed {
            return;
        }
        let _ = self.device.bind();
        // SAFETY: owned, live communicator, never used again.
        let r = unsafe { self.lib.sys().ncclCommAbort(self.raw) };
        if r != ncclResult_t::ncclSuccess {
            tracing::warn!(rank = self.rank, "ncclCommAbort on drop returned {}", r.0);
        }
    }
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device.ordinal())
            .field("borrowed", &self.borrowed)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_bytes() {
        let mut bytes = [0u8; UniqueId::LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let id = UniqueId::from_bytes(bytes);
        assert_eq!(id.to_bytes(), bytes);
        assert_eq!(UniqueId::from_slice(&bytes).ok(), Some(id));
        assert_eq!(id.to_sys().internal[1] as u8, 7);
        assert!(UniqueId::from_slice(&bytes[..100]).is_err());
        assert_eq!(format!("{id:?}"), "UniqueId(00070e151c232a31..)");
    }
}
