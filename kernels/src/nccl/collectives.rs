//! Collectives and point-to-point operations of a [`Comm`], each enqueued on a [`Stream`].
//!
//! Element counts come from the buffer lengths and are checked before NCCL is called. One
//! thread driving several communicators issues these between [`super::group_start`] and
//! [`super::group_end`] (or inside [`super::group`]).

use std::ffi::{c_int, c_void};

use super::comm::{c_int_of, group, Comm};
use super::sys;
use super::types::{nccl_data_type, nccl_red_op};
use crate::buffer::DeviceBuffer;
use crate::dtype::{DType, ReduceOp};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

impl Comm {
    /// Checks the stream and buffers belong to this rank's device; returns the raw stream.
    fn prepare(&self, stream: &Stream, bufs: &[&DeviceBuffer]) -> Result<sys::cudaStream_t> {
        stream.expect_device(&self.device, "an NCCL operation")?;
        for b in bufs {
            self.device.expect_same(b.device(), "an NCCL buffer")?;
        }
        Ok(stream.bind_raw()? as sys::cudaStream_t)
    }

    fn expect_elems(buf: &DeviceBuffer, dtype: DType, want: usize, what: &str) -> Result<()> {
        let got = buf.elems(dtype)?;
        if got == want {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument(format!(
                "{what}: buffer holds {got} {dtype} elements, {want} expected"
            )))
        }
    }

    fn root_ok(&self, root: usize) -> Result<c_int> {
        if root < self.size {
            c_int_of(root, "root")
        } else {
            Err(KernelError::InvalidArgument(format!(
                "root {root} of {} ranks",
                self.size
            )))
        }
    }

    fn peer_ok(&self, peer: usize) -> Result<c_int> {
        if peer < self.size {
            c_int_of(peer, "peer")
        } else {
            Err(KernelError::InvalidArgument(format!(
                "peer {peer} of {} ranks",
                self.size
            )))
        }
    }

    /// `recv = op over ranks of send` (`recv` may be `send` for in place).
    pub fn all_reduce(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let count = send.elems(dtype)?;
        Comm::expect_elems(recv, dtype, count, "all_reduce recv")?;
        let s = self.prepare(stream, &[send, recv])?;
        // SAFETY: both buffers hold `count` elements on this rank's device (checked).
        let r = unsafe {
            self.lib.sys().ncclAllReduce(
                addr(send),
                addr_mut(recv),
                count,
                nccl_data_type(dtype),
                nccl_red_op(op),
                self.raw,
                s,
            )
        };
        self.lib.check("ncclAllReduce", r, self.raw)
    }

    /// `recv = concat over ranks of send` (`recv` is `size` times `send`).
    pub fn all_gather(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        stream: &Stream,
    ) -> Result<()> {
        let count = send.elems(dtype)?;
        Comm::expect_elems(recv, dtype, count * self.size, "all_gather recv")?;
        let s = self.prepare(stream, &[send, recv])?;
        // SAFETY: extents checked: send has `count`, recv `count * size` elements.
        let r = unsafe {
            self.lib.sys().ncclAllGather(
                addr(send),
                addr_mut(recv),
                count,
                nccl_data_type(dtype),
                self.raw,
                s,
            )
        };
        self.lib.check("ncclAllGather", r, self.raw)
    }

    /// `recv = chunk rank of (op over ranks of send)` (`send` is `size` times `recv`).
    pub fn reduce_scatter(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let count = recv.elems(dtype)?;
        Comm::expect_elems(send, dtype, count * self.size, "reduce_scatter send")?;
        let s = self.prepare(stream, &[send, recv])?;
        // SAFETY: extents checked.
        let r = unsafe {
            self.lib.sys().ncclReduceScatter(
                addr(send),
                addr_mut(recv),
                count,
                nccl_data_type(dtype),
                nccl_red_op(op),
                self.raw,
                s,
            )
        };
        self.lib.check("ncclReduceScatter", r, self.raw)
    }

    /// Copies `send` of `root` into `recv` of every rank (`send` is read on the root only; both
    /// have the same length).
    pub fn broadcast(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = recv.elems(dtype)?;
        Comm::expect_elems(send, dtype, count, "broadcast send")?;
        let root = self.root_ok(root)?;
        let s = self.prepare(stream, &[send, recv])?;
        // SAFETY: extents checked.
        let r = unsafe {
            self.lib.sys().ncclBroadcast(
                addr(send),
                addr_mut(recv),
                count,
                nccl_data_type(dtype),
                root,
                self.raw,
                s,
            )
        };
        self.lib.check("ncclBroadcast", r, self.raw)
    }

    /// `recv (on root) = op over ranks of send`; `recv` is needed on the root only.
    pub fn reduce(
        &self,
        send: &DeviceBuffer,
        recv: Option<&DeviceBuffer>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = send.elems(dtype)?;
        let root_c = self.root_ok(root)?;
        let recv_ptr = self.root_buffer(recv, root, dtype, count, "reduce recv")?;
        let bufs: Vec<&DeviceBuffer> = std::iter::once(send).chain(recv).collect();
        let s = self.prepare(stream, &bufs)?;
        // SAFETY: extents checked; recv may be null off the root, where NCCL ignores it.
        let r = unsafe {
            self.lib.sys().ncclReduce(
                addr(send),
                recv_ptr,
                count,
                nccl_data_type(dtype),
                nccl_red_op(op),
                root_c,
                self.raw,
                s,
            )
        };
        self.lib.check("ncclReduce", r, self.raw)
    }

    /// The device address of a buffer only the root needs, checked to hold `count` elements.
    fn root_buffer(
        &self,
        buf: Option<&DeviceBuffer>,
        root: usize,
        dtype: DType,
        count: usize,
        what: &str,
    ) -> Result<*mut c_void> {
        match buf {
            Some(b) => {
                Comm::expect_elems(b, dtype, count, what)?;
                Ok(addr_mut(b))
            }
            None if self.rank == root => Err(KernelError::InvalidArgument(format!(
                "{what}: the root needs a buffer"
            ))),
            None => Ok(std::ptr::null_mut()),
        }
    }

    /// Sends `buf` to `peer` (pair with the peer's [`Comm::recv`], inside a group when the ranks
    /// also receive).
    pub fn send(
        &self,
        buf: &DeviceBuffer,
        dtype: DType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = buf.elems(dtype)?;
        let peer = self.peer_ok(peer)?;
        let s = self.prepare(stream, &[buf])?;
        // SAFETY: buffer extent is `count` elements.
        let r = unsafe {
            self.lib
                .sys()
                .ncclSend(addr(buf), count, nccl_data_type(dtype), peer, self.raw, s)
        };
        self.lib.check("ncclSend", r, self.raw)
    }

    /// Receives into `buf` from `peer`.
    pub fn recv(
        &self,
        buf: &DeviceBuffer,
        dtype: DType,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = buf.elems(dtype)?;
        let peer = self.peer_ok(peer)?;
        let s = self.prepare(stream, &[buf])?;
        // SAFETY: buffer extent is `count` elements.
        let r = unsafe {
            self.lib.sys().ncclRecv(
                addr_mut(buf),
                count,
                nccl_data_type(dtype),
                peer,
                self.raw,
                s,
            )
        };
        self.lib.check("ncclRecv", r, self.raw)
    }

    /// Issues `native` when the library has that entry point (`present`), else `p2p`, the same
    /// operation as grouped send/recv: the one place where a missing NCCL entry point falls
    /// back (all-to-all, gather and scatter; `name` is the NCCL call, for errors).
    fn native_or_p2p(
        &self,
        name: &'static str,
        present: bool,
        native: impl FnOnce() -> sys::ncclResult_t,
        p2p: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if present {
            let r = native();
            self.lib.check(name, r, self.raw)
        } else {
            p2p()
        }
    }

    /// Checks an all-to-all's buffers; returns the elements per rank.
    fn all_to_all_count(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
    ) -> Result<usize> {
        let total = send.elems(dtype)?;
        Comm::expect_elems(recv, dtype, total, "all_to_all recv")?;
        if total % self.size != 0 {
            return Err(KernelError::InvalidArgument(format!(
                "all_to_all of {total} elements over {} ranks",
                self.size
            )));
        }
        Ok(total / self.size)
    }

    /// Chunk `j` of `send` goes to rank `j`, landing in chunk `rank` of its `recv` (both split
    /// into `size` equal chunks). Native `ncclAlltoAll` when the library has it, else grouped
    /// send/recv.
    pub fn all_to_all(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        stream: &Stream,
    ) -> Result<()> {
        let count = self.all_to_all_count(send, recv, dtype)?;
        let s = self.prepare(stream, &[send, recv])?;
        self.native_or_p2p(
            "ncclAlltoAll",
            self.lib.has_native_all_to_all(),
            // SAFETY: symbol present (checked by `native_or_p2p`'s caller); extents
            // `count * size` on both sides (checked).
            || unsafe {
                self.lib.sys().ncclAlltoAll(
                    addr(send),
                    addr_mut(recv),
                    count,
                    nccl_data_type(dtype),
                    self.raw,
                    s,
                )
            },
            || self.all_to_all_grouped(send, recv, dtype, count, stream),
        )
    }

    /// [`Comm::all_to_all`] as grouped send/recv, whatever the library offers.
    pub fn all_to_all_p2p(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        stream: &Stream,
    ) -> Result<()> {
        let count = self.all_to_all_count(send, recv, dtype)?;
        self.all_to_all_grouped(send, recv, dtype, count, stream)
    }

    fn all_to_all_grouped(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        dtype: DType,
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = count * dtype.size_bytes();
        group(&self.lib, || {
            for peer in 0..self.size {
                self.send(&send.view(peer * bytes, bytes)?, dtype, peer, stream)?;
                self.recv(&recv.view(peer * bytes, bytes)?, dtype, peer, stream)?;
            }
            Ok(())
        })
    }

    /// `recv (on root)` = concat over ranks of `send`; `recv` is needed on the root only.
    /// Native `ncclGather` when the library has it, else grouped send/recv.
    pub fn gather(
        &self,
        send: &DeviceBuffer,
        recv: Option<&DeviceBuffer>,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = send.elems(dtype)?;
        let root_c = self.root_ok(root)?;
        let recv_ptr = self.root_buffer(recv, root, dtype, count * self.size, "gather recv")?;
        let bufs: Vec<&DeviceBuffer> = std::iter::once(send).chain(recv).collect();
        let s = self.prepare(stream, &bufs)?;
        self.native_or_p2p(
            "ncclGather",
            self.lib.has_native_gather_scatter(),
            // SAFETY: symbol present; extents checked; recv null off the root.
            || unsafe {
                self.lib.sys().ncclGather(
                    addr(send),
                    recv_ptr,
                    count,
                    nccl_data_type(dtype),
                    root_c,
                    self.raw,
                    s,
                )
            },
            || self.gather_grouped(send, recv, dtype, root, stream),
        )
    }

    /// [`Comm::gather`] as grouped send/recv, whatever the library offers.
    pub fn gather_p2p(
        &self,
        send: &DeviceBuffer,
        recv: Option<&DeviceBuffer>,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = send.elems(dtype)?;
        self.root_ok(root)?;
        self.root_buffer(recv, root, dtype, count * self.size, "gather recv")?;
        self.gather_grouped(send, recv, dtype, root, stream)
    }

    fn gather_grouped(
        &self,
        send: &DeviceBuffer,
        recv: Option<&DeviceBuffer>,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = send.len();
        group(&self.lib, || {
            self.send(send, dtype, root, stream)?;
            if let (Some(r), true) = (recv, self.rank == root) {
                for peer in 0..self.size {
                    self.recv(&r.view(peer * bytes, bytes)?, dtype, peer, stream)?;
                }
            }
            Ok(())
        })
    }

    /// Chunk `j` of `send` (on root) goes to `recv` of rank `j`; `send` is needed on the root
    /// only. Native `ncclScatter` when the library has it, else grouped send/recv.
    pub fn scatter(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &DeviceBuffer,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = recv.elems(dtype)?;
        let root_c = self.root_ok(root)?;
        let send_ptr = self.root_buffer(send, root, dtype, count * self.size, "scatter send")?;
        let bufs: Vec<&DeviceBuffer> = std::iter::once(recv).chain(send).collect();
        let s = self.prepare(stream, &bufs)?;
        self.native_or_p2p(
            "ncclScatter",
            self.lib.has_native_gather_scatter(),
            // SAFETY: symbol present; extents checked; send null off the root.
            || unsafe {
                self.lib.sys().ncclScatter(
                    send_ptr,
                    addr_mut(recv),
                    count,
                    nccl_data_type(dtype),
                    root_c,
                    self.raw,
                    s,
                )
            },
            || self.scatter_grouped(send, recv, dtype, root, stream),
        )
    }

    /// [`Comm::scatter`] as grouped send/recv, whatever the library offers.
    pub fn scatter_p2p(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &DeviceBuffer,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let count = recv.elems(dtype)?;
        self.root_ok(root)?;
        self.root_buffer(send, root, dtype, count * self.size, "scatter send")?;
        self.scatter_grouped(send, recv, dtype, root, stream)
    }

    fn scatter_grouped(
        &self,
        send: Option<&DeviceBuffer>,
        recv: &DeviceBuffer,
        dtype: DType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = recv.len();
        group(&self.lib, || {
            if let (Some(sb), true) = (send, self.rank == root) {
                for peer in 0..self.size {
                    self.send(&sb.view(peer * bytes, bytes)?, dtype, peer, stream)?;
                }
            }
            self.recv(recv, dtype, root, stream)
        })
    }
}

fn addr(b: &DeviceBuffer) -> *const c_void {
    b.addr() as *const c_void
}

fn addr_mut(b: &DeviceBuffer) -> *mut c_void {
    b.addr() as *mut c_void
}
