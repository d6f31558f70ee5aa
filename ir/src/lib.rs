//! # meshflow-ir: sharded tensor programs and the host IR
//!
//! meshflow has two IR levels. A **level-1 [`Program`]** is a sharded tensor program: logical
//! tensors placed on device meshes, with schedules that say how each tensor is split across
//! devices and into stream chunks. Passes (crate `meshflow-passes`) lower it to a **level-2
//! [`HostProgram`]**: one rank-agnostic program of allocations, stream loops, communications,
//! waits and local compute that every rank executes. Both levels have a text format that
//! parses back ([`parse_program`], [`parse_host`]; `Display` prints) and a verifier that
//! reports every error with its location ([`verify_program`], [`verify_host`]).
//!
//! ## Meshes and teams
//!
//! A [`DeviceMesh`] is an N-dimensional array of unique device ids (ranks). The device
//! parallel types name mesh axes **from the end**: `DIDx` is the last axis, `DIDy` the one
//! before, `DIDz` the one before that. The **team** of a device along a parallel type `pt` is
//! the slice of the mesh through the device along `pt`'s axis; the device's **team index**
//! (`my(mesh, pt)` in the host IR) is its coordinate on that axis. Roots and peers of
//! communications are always team indices, never global ranks. In `[[0, 1, 2], [3, 4, 5]]`,
//! device 4 has team `[3, 4, 5]` (index 1) along `DIDx` and team `[1, 4]` (index 1) along
//! `DIDy`.
//!
//! A **flattened** team spans several mesh axes (DTensor's flattened sub-mesh): the devices
//! that differ from a device only in the given parallel types, in row-major order of those
//! axes. In `iota(2, 2, 2)` device 5 (coordinates `(1, 0, 1)`) has the flattened team
//! `[4, 5, 6, 7]` (index 1) over `DIDy, DIDx` and `[0, 1, 4, 5]` (index 3) over `DIDz, DIDx`.
//! One collective over it does what consecutive collectives over each axis would (an
//! all-reduce of partial sums over both axes, an all-gather of a chain `[DIDy, DIDx]`).
//!
//! ## Tensors, schedules and splits
//!
//! A tensor has a logical type (dtype and axes; an axis marked `r` is a reduction axis of the
//! op that produces it) and lives on one mesh. Its **schedule** is a list of transforms on its
//! loop domain (see [`program::schedule`]): `outer_split(a, p)` turns axis `a` of extent `E`
//! into `[p, E/p]`, `inner_split(a, f)` into `[E/f, f]`, `merge(a)` joins `a` and `a+1`,
//! `reorder(...)` permutes, `parallelize(a, pt)` marks an axis `DIDx/DIDy/DIDz/Stream/Serial`
//! and `swizzle1d(a, pt)` swizzles a Stream axis. A tensor with no schedule is *unannotated*
//! (sharding propagation fills it in); an explicit empty schedule `{}` means replicated on
//! the mesh and is never changed.
//!
//! - **Device splits.** A loop axis parallelized `DIDx` with extent `p` (equal to the mesh
//!   extent along `DIDx`) means device `j` of each `DIDx` team holds chunk `j` of the `p`
//!   chunks of that logical axis. Devices of a team hold disjoint chunks; devices that differ
//!   only along other mesh axes hold the same data (replication). A device split on a
//!   **reduction** axis means each device holds a *partial sum* over its chunk.
//! - **Several splits of one axis.** One logical axis may be split several times, each piece
//!   on its own parallel type, as a *chain*: every split cuts the inner piece of the previous
//!   one, and a device's piece is found level by level. On a mesh `iota(dy, dx)`,
//!   `{outer_split(0, dy), parallelize(0, DIDy), outer_split(1, dx), parallelize(1, DIDx)}`
//!   gives device `(y, x)` block `y * dx + x` of the rows (DTensor's `[Shard(0), Shard(0)]`);
//!   the other order, DIDx outer, is FSDP2 + TP's `[_StridedShard(0, dx), Shard(0)]`; a
//!   `Stream` split outside a device split (`[Stream, DIDx]`) splits every stream chunk over
//!   the devices (collective-based pipelining).
//! - **Uneven splits.** An `outer_split` need not divide: pieces follow the chunk rule
//!   (`torch.chunk`, DTensor's `Shard`): `ceil(E/p)` elements each, trailing pieces shorter or
//!   empty (10 rows over 4 devices: `3, 3, 3, 1`), applied level by level to the actual
//!   extent of each piece (18 rows over `iota(4, 2)` with `[DIDy, DIDx]`:
//!   `3, 2, 3, 2, 3, 2, 2, 1`). Every device's buffer has the same, *padded* local shape (the
//!   largest piece); its piece is a prefix of it (see the host IR's `narrow`). An
//!   `inner_split` must divide.
//! - **Stream splits.** A loop axis parallelized `Stream` with extent `s` is a **host for-loop
//!   over `s` chunks** of that axis: iteration `i` computes (or communicates) chunk `i` only.
//!   Consecutive ops that share the same Stream split run in one loop, so communication of
//!   chunk `i+1` can overlap computation of chunk `i`. The whole tensor is still allocated;
//!   a stream split changes execution order, not placement.
//! - **swizzle1d(a, pt).** On a Stream axis of extent `d` (the team size along `pt`), loop
//!   iteration `i` on the device with team index `my` visits chunk `(i + my) % d` instead of
//!   chunk `i`. Applied to an all-gather decomposed over a Stream axis (producer split on
//!   `pt`, consumer Stream-split on the same axis), it turns `d` broadcasts into a **ring of
//!   collective permutes**: at step `i` the device receives chunk `(i + my) % d` from team index
//!   `(i + my) % d` and sends its own chunk to team index `(d + my - i) % d`; step 0 is a local
//!   copy, so there are `d - 1` transfers. Without the swizzle the same pattern is a **stream
//!   broadcast** whose root at step `i` is team index `i`.
//!
//! The meaning of a level-1 program is the unsharded computation: every op is defined on
//! logical tensors. An embedder's own op, `custom(inputs.., kernel="NAME", args=[..])`, is
//! computed by the kernel it registers with the backend and lowers to `call_kernel` (see
//! [`CustomOp`] for its contract). A `set` whose input and output are sharded differently is a
//! **resharding**, lowered to a communication. `moe_dispatch` / `moe_combine` route tokens to
//! experts and back over an expert-parallel team; the [`moe`] module states their semantics
//! bit for bit (one travelling row per token and destination member, the summation order of
//! the combine, FP8 dispatch).
//!
//! ## Ops
//!
//! `set` (copy or resharding), `matmul` (torch.matmul batch broadcasting), `linear`, `add`,
//! `sub`, `mul`, `gelu`, `silu`, `cast`; the reductions `sum`, `max`, `min` and `avg`
//! (`y = max(x, axis=1)`: the output keeps the axis as a reduction axis); the row-wise
//! `softmax(x, axis=a)` and `rms_norm(x, w, axis=a, eps=1e-6)`; the shape ops `reshape(x)` and
//! `view(x)` (to the declared output shape), `permute(x, perm=[0, 2, 1, 3])`, `expand(x)` (to the
//! declared shape, torch `expand`), `squeeze(x, axis=a)`, `unsqueeze(x, axis=a)`,
//! `slice(x, axis=a, start=s, end=e)`, `select(x, axis=a, index=i)` and `cat(x, y, .., axis=a)`;
//! MoE `moe_dispatch` (`wire=f8e4m3, scale=token|block128` for FP8 transfer), `grouped_matmul`,
//! `moe_combine`; and `custom`. See [`OpKind`].
//!
//! An op runs on the mesh of its outputs. Its inputs may live on other meshes or be sharded
//! otherwise: the passes insert the resharding `set`s, and compute an op where its inputs already
//! are when that moves less data (`z = add(x, y)` of two shards into a replicated `z` adds the
//! shards and gathers `z` once).
//!
//! ## Shape ops and sharding
//!
//! A device split of an input axis carries over to an output axis when a split of one **is** the
//! same split of the other, so the op stays local: `permute` renumbers, `squeeze`, `unsqueeze`
//! and `select` shift the other axes, `expand` keeps its non-broadcast axes (a broadcast axis may
//! be split on the output: each device fills its chunk with the repeated input), `slice` and `cat` keep every axis
//! but the sliced or concatenated one, and `reshape`/`view` keep the split of the **first** axis of
//! each reshape group (see [`program::view_groups`]) when the group's first output axis divides
//! by the number of parts. The attention head split `[B, S, H] -> [B, S, nh, hd]` with `H` split
//! over `d` devices stays local, split on `nh`, when `d` divides `nh`. Any other split of an input
//! must be replicated first: `reshape` all-gathers that mesh axis, `view` is refused. The
//! normalized axis of `softmax` and `rms_norm` and a sliced or concatenated axis are never
//! split while the op computes; an output declared split there is computed unsplit and sliced
//! after.
//!
//! ## Partial results
//!
//! A device split of a **reduction** axis holds partial results, reduced across the devices of
//! that parallel type: partial sums for `sum`, `matmul`, `linear` and `grouped_matmul`, partial
//! maxima, minima or means for `max`, `min` and `avg`. A program input may be declared partial
//! (`input x: f32[8, r4] on m {outer_split(1, 4), parallelize(1, DIDx)}`): its data is supplied
//! with the reduction axes, and its value is the sum over them. A `set` whose output keeps the
//! input's reduction axes keeps the partial results (Partial to Partial is free, `[P, S0]` to
//! `[P, S1]` is one all-to-all on the other mesh axis); a `set` into value axes reduces them
//! (all-reduce, reduce-scatter or reduce with the partial kind's operator). A `set` never creates
//! partial results (Replicate to Partial is refused, as in DTensor). `add`/`sub` of two
//! partial-sum tensors and `mul` of partial sums by a value may keep them partial (declare the
//! output with the reduction axes; the passes also do it on their own when it saves a
//! reduction). Any other op reads the reduced value: its partial inputs are reduced first.
//!
//! ## The host IR
//!
//! A host program declares meshes and tensors with **local** (per-device) shapes and has a
//! structured body: [`InstKind::ForLoop`] nests blocks; everything else is a straight-line
//! instruction. One program serves every rank: scalar [`Expr`]essions (constants, loop
//! indices, `my(mesh, pt)`, `rank`, `+ - * / %` with Euclidean `/` and `%`, `min(a, b)`,
//! `max(a, b)`) are pure and evaluated per rank and per iteration. A tensor exists only on the devices of its mesh; an
//! instruction whose tensors a rank does not hold is skipped on that rank, and a
//! communication involves exactly the ranks of its team.
//!
//! **Streams.** Every rank has a *current stream*, initially its main stream. Compute ops run
//! on the current stream in program order. `get_current_stream` saves it, `set_current_stream`
//! switches to a saved stream or to `worker(e)`, a stream from a bounded pool (index taken
//! modulo the pool size), and `synchronize s` makes the current stream wait for everything
//! enqueued on `s` so far.
//!
//! **Communications and waits.** A communication (collective, collective permute, MoE
//! dispatch or combine) is *posted* on the current stream: it starts after the work already
//! enqueued there. Its completion is ordered before later work **only** by `wait c`, which makes
//! the current stream wait for the latest instance of communication `c`. Reading a
//! communication's output, or overwriting its input, before a `wait` is a race. Communications
//! between `start_coalescing` and `end_coalescing` are issued as one group; waiting on the group
//! label waits for all of them.
//!
//! **Buffers and views.** `allocate t` creates `t`'s buffer (contents undefined);
//! `deallocate t` releases it after the work already enqueued on it. `v =
//! shard_by_stream(t, axis=a, chunks=s, index=e)` makes `v` a view of chunk `e` of `t` along
//! `a` (`s` equal chunks); `v = narrow(t, axis=a, start=e1, length=e2)` a view of elements
//! `[e1, e1 + e2)` along `a`, both evaluated per rank and iteration: the valid part of a padded
//! buffer (`min(3, 10 - 3 * my(m, DIDx))` rows of an uneven shard) or a member's slot of a
//! padded collective buffer. A `narrow` view's declared extent along `a` is its capacity (the
//! longest piece); its actual extent is the length on that rank. Writes through a view land in
//! `t`. Collectives move whole padded buffers (NCCL has no v-collectives); compute ops read
//! and write `narrow` views, so kernels see only valid elements and padding is never data.
//!
//! ## Text format
//!
//! ```text
//! program column_parallel_linear_ring {
//!   mesh m0 = [0, 1, 2, 3]
//!   input x: bf16[64, 32] on m0 {outer_split(0, 4), parallelize(0, DIDx)}
//!   input w: bf16[48, 32] on m0 {outer_split(0, 4), parallelize(0, DIDx)}
//!   tensor ag: bf16[64, 32] on m0 {outer_split(0, 4), swizzle1d(0, DIDx), parallelize(0, Stream)}
//!   tensor y: bf16[64, 48, r32] on m0
//!   ag = set(x)
//!   y = linear(ag, w)
//!   output y
//! }
//! ```
//!
//! Level-1 text may also declare integer parameters and use integer expressions wherever a
//! number goes (`param d = 4`, `bf16[16 * d, 32]`, `outer_split(0, d)`, `mesh m0 = iota(d)`,
//! `iota(dp, tp)`, `iota(d, start=d)`); they are evaluated when the text is parsed, and
//! [`parse_program_with`] overrides their defaults. Comments start with `#`.
//!
//! ```text
//! host column_parallel_linear_ring {
//!   mesh m0 = [0, 1, 2, 3]
//!   in x: bf16[16, 32] on m0
//!   out y: bf16[64, 12] on m0
//!   tensor ag_chunk: bf16[16, 32] on m0
//!   s0 = get_current_stream
//!   for i0 in 0..4 {
//!     set_current_stream worker(i0)
//!     synchronize s0
//!     ag_chunk = shard_by_stream(ag, axis=0, chunks=4, index=(i0 + my(m0, DIDx)) % 4)
//!     c0 = collective_permute(x -> ag_chunk, team=slice(m0, DIDx), send=(4 + my(m0, DIDx) - i0) % 4, recv=(i0 + my(m0, DIDx)) % 4)
//!     wait c0
//!     linear(ag_chunk, w -> y_chunk)
//!   }
//! }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod dtype;
pub mod entity;
pub mod host;
pub mod mesh;
pub mod moe;
pub mod parse;
pub mod program;
pub mod span;
pub mod text;
pub mod verify;

pub use dtype::DType;
pub use entity::{Arena, EntityRef};
pub use host::{
    Block, BufferContract, BufferUse, CommId, CommKind, ComputeOp, Expr, HostProgram, HostTensor,
    HostTensorId, Inst, InstKind, LoopVar, ReduceOp, Role, StreamRef, StreamVar, Team,
};
pub use mesh::{DeviceId, DeviceMesh, MeshError, ParallelType};
pub use moe::{Fp8Scales, MoeWire};
pub use parse::{parse_host, parse_program, parse_program_with, Params, ParseError};
pub use program::{
    Axis, CustomOp, Epsilon, MeshDecl, MeshId, Op, OpKind, Program, ProgramBuilder, TensorDecl,
    TensorId, TensorType, Transform,
};
pub use span::{SourceLoc, Span};
pub use verify::{verify_host, verify_program, Diagnostic, Location, VerifyErrors};
