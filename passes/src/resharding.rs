//! Resharding detection: does a consumer need data its producer's device does not hold?
//!
//! For each value axis, a tensor's [`Layout`](meshflow_ir::program::Layout) cuts the axis into
//! a chain of leaves. The piece a device holds (or a stream iteration visits) along the axis
//! is determined level by level by the digits of its device and Stream leaves: the digit of a
//! device leaf is `my(pt)` and that of a Stream leaf is the loop index `i`, or
//! `(i + my(pt)) % extent` when swizzled (`swizzle1d`). Producer and consumer are compared
//! digit by digit (leaves at the same level of the chain, which holds for uneven pieces too),
//! with the egg-backed [`Simplifier`] proving the digits equal under the facts
//! `0 <= my(pt) < team size` and `0 <= i < chunks`.
//!
//! - **Device types.** For each `pt`, the producer's and the consumer's `pt` leaves must give
//!   equal digits on every axis, and they must agree on holding partial sums (a device split on
//!   a reduction axis). Otherwise `pt` is resharded.
//! - **Stream.** When the consumer has a Stream split, iteration `i` needs one chunk. The
//!   producer's device holds it when its device leaves (and its Stream leaf, if it carries the
//!   *same* Stream split, i.e. it is produced in the same loop iteration) give the same digits
//!   as the consumer's leaves at the producer's granularity. A producer with no device or
//!   Stream leaf on the axis holds every chunk. So a `set` between tensors with the same Stream
//!   split and swizzle is not a resharding, while DID on the producer and a (swizzled) Stream
//!   split on the consumer over the same axis is, on both the device type and Stream.
//! - **Meshes.** Different meshes always reshard (every device type, data must move).

use std::collections::BTreeMap;

use meshflow_ir::{DeviceMesh, EntityRef, Expr, LoopVar, MeshId, ParallelType};

use crate::analysis::Sharding;
use crate::index::{loop_fact, my_fact, Facts, Simplifier};

/// How a producer's placement differs from what a consumer needs.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Resharding {
    /// The two tensors live on different meshes.
    pub mesh_changed: bool,
    /// Device parallel types whose held indices (or partial-sum state) differ.
    pub device: Vec<ParallelType>,
    /// Some Stream iteration of the consumer needs a chunk the producer's device lacks.
    pub stream: bool,
}

impl Resharding {
    /// True when data must move between devices.
    pub fn is_resharding(&self) -> bool {
        self.mesh_changed || !self.device.is_empty() || self.stream
    }
}

const LOOP: LoopVar = LoopVar(0);

fn mesh0() -> MeshId {
    MeshId::new(0)
}

/// The level of leaf `k` of an axis as a key that orders like a stride (larger = coarser)
/// and compares across layouts: the leaves of an axis form a chain of splits (see
/// [`crate::analysis::sharding`]), so a level is identified by its position from the
/// outermost, whatever the extents (uneven pieces pad differently per layout).
fn level_key(k: usize) -> u64 {
    u64::MAX - k as u64
}

/// The level of every leaf of `axis`: its position among the leaves before it that cut
/// something (a split into one part is no level: a team of one device).
fn levels(axis: &meshflow_ir::program::AxisLayout) -> Vec<usize> {
    let mut n = 0;
    axis.leaves
        .iter()
        .map(|l| {
            let k = n;
            if l.extent > 1 {
                n += 1;
            }
            k
        })
        .collect()
}

/// The digits of value axis `v` of `sh`, keyed by level, for the leaves `keep` selects.
fn digits(
    sh: &Sharding,
    v: usize,
    keep: &dyn Fn(u64, &meshflow_ir::program::Leaf) -> bool,
) -> BTreeMap<u64, Expr> {
    let mut out = BTreeMap::new();
    let Some(axis) = sh.value_axes.get(v).and_then(|&a| sh.layout.axes.get(a)) else {
        return out;
    };
    for (leaf, k) in axis.leaves.iter().zip(levels(axis)) {
        if leaf.extent <= 1 || !keep(level_key(k), leaf) {
            continue;
        }
        let digit = match leaf.pt {
            pt if pt.is_device() => Expr::my(mesh0(), pt),
            ParallelType::Stream => match leaf.swizzle {
                Some(sw) => Expr::var(LOOP)
                    .add(Expr::my(mesh0(), sw))
                    .rem(Expr::c(leaf.extent as i64)),
                None => Expr::var(LOOP),
            },
            _ => continue,
        };
        out.insert(level_key(k), digit);
    }
    out
}

fn same_digits(s: &mut Simplifier, a: &BTreeMap<u64, Expr>, b: &BTreeMap<u64, Expr>) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|((sa, ea), (sb, eb))| sa == sb && s.prove_equal(ea, eb))
}

/// Compares producer `p` (on `p_mesh`) with consumer `c` (on `c_mesh`); both describe the same
/// logical value (the same value axes).
pub fn analyze(p: &Sharding, p_mesh: &DeviceMesh, c: &Sharding, c_mesh: &DeviceMesh) -> Resharding {
    let mut out = Resharding {
        mesh_changed: p.mesh != c.mesh && p_mesh != c_mesh,
        ..Resharding::default()
    };
    let mut facts = Facts::new();
    for pt in ParallelType::DEVICE {
        if let Some(size) = p_mesh.size_of(pt) {
            my_fact(&mut facts, mesh0(), pt, size);
        }
    }
    if let Some(s) = c.stream() {
        loop_fact(&mut facts, LOOP, 0, s.chunks as i64);
    }
    let mut simp = Simplifier::new(facts);
    let rank = p.value_axes.len().min(c.value_axes.len());
    for pt in ParallelType::DEVICE {
        // A team of one device holds everything its parallel type could split: a split or a
        // partial sum over it changes nothing.
        if !out.mesh_changed && p_mesh.size_of(pt) == Some(1) && c_mesh.size_of(pt) == Some(1) {
            continue;
        }
        let partial = |sh: &Sharding| {
            sh.split(pt)
                .filter(|_| sh.is_partial_on(pt))
                .map(|s| s.axis)
        };
        let mut changed = partial(p).is_some() != partial(c).is_some()
            || (out.mesh_changed && (p.split(pt).is_some() || c.split(pt).is_some()));
        for v in 0..rank {
            if changed {
                break;
            }
            let keep = |_: u64, l: &meshflow_ir::program::Leaf| l.pt == pt;
            changed = !same_digits(&mut simp, &digits(p, v, &keep), &digits(c, v, &keep));
        }
        if changed {
            out.device.push(pt);
        }
    }
    if let Some(cs) = c.stream() {
        if let Some(v) = c.value_index(cs.axis) {
            let same_loop = p.stream().is_some_and(|ps| {
                p.value_index(ps.axis) == Some(v)
                    && ps.chunks == cs.chunks
                    && ps.swizzle == cs.swizzle
            });
            let keep_p = |_: u64, l: &meshflow_ir::program::Leaf| {
                l.pt.is_device() || (same_loop && l.pt == ParallelType::Stream)
            };
            let held = digits(p, v, &keep_p);
            if let Some(&grain) = held.keys().next() {
                let keep_c = |key: u64, l: &meshflow_ir::program::Leaf| {
                    (l.pt.is_device() || l.pt == ParallelType::Stream) && key >= grain
                };
                out.stream = !same_digits(&mut simp, &held, &digits(c, v, &keep_c));
            }
        }
    }
    out
}
