//! [`run_and_compare`]: random inputs, a sharded CPU run, the level-1 reference, and a
//! per-output comparison.

use std::collections::BTreeMap;
use std::fmt;

use meshflow_ir::host::{InstKind, Role};
use meshflow_ir::{DType, DeviceId, HostProgram, OpKind, Program};

use super::data::{numel_of, try_collect, try_filled, DataError, SplitMix64, TensorData};
use super::ranks::{run_cpu, CpuOptions, RunError, RunInputs};
use super::reference::{evaluate_with, output_precision, ReferenceError};
use super::shard::ShardError;

/// Why a comparison could not be made.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CompareError {
    /// Generating inputs failed.
    #[error("input `{name}`: {message}")]
    Input {
        /// The input.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The sharded run failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Gathering outputs failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The reference failed.
    #[error("reference: {0}")]
    Reference(#[from] ReferenceError),
    /// An output is missing or malformed.
    #[error("output `{name}`: {message}")]
    Output {
        /// The output.
        name: String,
        /// What is wrong.
        message: String,
    },
}

/// The comparison of one output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputComparison {
    /// The output.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Relative error `||run - ref|| / ||ref||` (0 for bit-identical integers; NaN when
    /// either side has NaN or infinity).
    pub error: f64,
    /// The tolerance applied: that of the least precise type the value passed through
    /// ([`tolerance`]).
    pub tolerance: f64,
    /// True when the output is within tolerance (integers: exactly equal).
    pub passed: bool,
}

/// The result of [`run_and_compare`].
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// One entry per program output, in program order.
    pub outputs: Vec<OutputComparison>,
}

impl Comparison {
    /// True when every output passed.
    pub fn passed(&self) -> bool {
        self.outputs.iter().all(|o| o.passed)
    }
}

impl fmt::Display for Comparison {
    /// `ok y: rel err 1.2e-7 (tol 1e-5)` or `mismatch ...`, one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.passed() { "ok" } else { "mismatch" })?;
        for o in &self.outputs {
            write!(
                f,
                " {}: rel err {:.3e} (tol {:.0e}){}",
                o.name,
                o.error,
                o.tolerance,
                if o.passed { "" } else { " FAILED" }
            )?;
        }
        Ok(())
    }
}

/// The tolerances of every comparison with the reference, per element type, in one place.
///
/// An output is compared by its relative error `||run - ref|| / ||ref||` (L2 over all
/// elements) against the tolerance of the least precise type its value passed through
/// ([`output_precision`]): a `bf16` product cast to `f32` is judged as `bf16`.
///
/// | type | tolerance | why |
/// |---|---|---|
/// | `f32` | `1e-5` | the reference accumulates in `f64`, the backends in `f32` (and in their own order): sums of a few thousand products differ by ~1e-7 relative |
/// | `f16` | `1e-2` | one rounding is 2^-11 ≈ 5e-4 relative; a chain of ops rounds at every op, and a value that rounds the other way in one op shifts all that follow |
/// | `bf16` | `1e-2` | one rounding is 2^-8 ≈ 4e-3 relative (a `bf16` linear cast to `f32` differs by ~3e-3) |
/// | `i32`, `i64` | exact | integers (counts, routing) are data movement, compared bit for bit |
///
/// A kernel bug that changes results by more than the rounding of the type (a wrong index,
/// a missing term, a scale) exceeds these by orders of magnitude (see the tests that plant
/// one in the CPU backend).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::BF16 | DType::F16 => 1e-2,
        DType::I32 | DType::I64 => 0.0,
    }
}

/// `k` distinct expert ids in `0..experts` per token (`k` = the last extent of `shape`).
fn routing_ids(
    dtype: DType,
    shape: &[u64],
    experts: u64,
    seed: u64,
) -> Result<TensorData, DataError> {
    let k = shape.last().copied().unwrap_or(0).min(experts);
    let n = numel_of(shape)?;
    let tokens = n / shape.last().copied().unwrap_or(0).max(1);
    let mut rng = SplitMix64::new(seed);
    let mut ids = try_filled(0i64, n as usize)?;
    ids.clear();
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() - start < k as usize {
            let e = rng.below(experts) as i64;
            if !ids[start..].contains(&e) {
                ids.push(e);
            }
        }
    }
    TensorData::from_i64(dtype, shape, &ids)
}

/// Seeded random local inputs of a host program (for runs without a level-1 program): every
/// rank of an input's mesh gets the same tensor of the local shape; an integer input used as
/// `moe_dispatch`'s `topk_idx` gets distinct valid expert ids per token, other tensors uniform
/// values as [`TensorData::random`].
pub fn random_local_inputs(
    host: &HostProgram,
    seed: u64,
) -> Result<BTreeMap<DeviceId, BTreeMap<String, TensorData>>, CompareError> {
    let mut per_rank: BTreeMap<DeviceId, BTreeMap<String, TensorData>> = BTreeMap::new();
    let mut experts_of = BTreeMap::new();
    host.walk(&mut |inst, _| {
        if let InstKind::MoeDispatch {
            team,
            topk_idx,
            expert_x,
            ..
        } = &inst.kind
        {
            let local = host.tensors.get(*expert_x).and_then(|t| {
                let rank = t.shape.len();
                rank.checked_sub(3).map(|i| t.shape[i])
            });
            if let (Some(local), Some(size)) = (local, team.size(&host.meshes)) {
                experts_of.insert(*topk_idx, local * size as u64);
            }
        }
    });
    for (i, (id, t)) in host.tensors.iter().enumerate() {
        if t.role != Role::Input {
            continue;
        }
        let s = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let err = |e: DataError| CompareError::Input {
            name: t.name.clone(),
            message: e.to_string(),
        };
        let data = match experts_of.get(&id) {
            Some(&experts) => routing_ids(t.dtype, &t.shape, experts, s).map_err(err)?,
            None => TensorData::random(t.dtype, &t.shape, s).map_err(err)?,
        };
        let devices = host
            .meshes
            .get(t.mesh)
            .map(|m| m.mesh.devices().to_vec())
            .unwrap_or_default();
        for device in devices {
            per_rank
                .entry(device)
                .or_default()
                .insert(t.name.clone(), data.clone());
        }
    }
    Ok(per_rank)
}

/// Seeded random inputs for `program`: an integer input used as `moe_dispatch`'s `topk_idx`
/// gets `k` distinct valid expert ids per token; weights used by `moe_combine` are positive;
/// other floats are uniform in `[-1, 1)`.
pub fn random_inputs(
    program: &Program,
    seed: u64,
) -> Result<BTreeMap<String, TensorData>, CompareError> {
    let mut out = BTreeMap::new();
    for (i, t) in program.inputs().into_iter().enumerate() {
        let decl = &program.tensors[t];
        // A partial input is supplied with its reduction axes (its unreduced data).
        let shape: Vec<u64> = decl.ty.axes.iter().map(|a| a.extent).collect();
        let dtype = decl.ty.dtype;
        let s = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let err = |e: DataError| CompareError::Input {
            name: decl.name.clone(),
            message: e.to_string(),
        };
        let experts = program.ops.iter().find_map(|op| {
            (matches!(op.kind, OpKind::MoeDispatch { .. }) && op.inputs.get(1) == Some(&t)).then(
                || {
                    let ty = &program.tensors[*op.outputs.first()?].ty.value_shape();
                    ty.len().checked_sub(3).map(|nb| ty[nb])
                },
            )?
        });
        let weights = program
            .ops
            .iter()
            .any(|op| op.kind == OpKind::MoeCombine && op.inputs.get(3) == Some(&t));
        let data = if let Some(experts) = experts {
            let k = shape.last().copied().unwrap_or(0);
            if k > experts {
                return Err(CompareError::Input {
                    name: decl.name.clone(),
                    message: format!("top-{k} routing needs at least {k} experts, has {experts}"),
                });
            }
            routing_ids(dtype, &shape, experts, s).map_err(err)?
        } else if weights {
            let mut rng = SplitMix64::new(s);
            let n = numel_of(&shape).map_err(err)? as usize;
            let v = try_collect(n, |_| 0.1 + 0.9 * rng.next_f32()).map_err(err)?;
            TensorData::from_f32(dtype, &shape, &v).map_err(err)?
        } else {
            TensorData::random(dtype, &shape, s).map_err(err)?
        };
        out.insert(decl.name.clone(), data);
    }
    Ok(out)
}

/// Generates seeded inputs, runs `host` on `ranks` CPU ranks, gathers the outputs of
/// `level1`, evaluates the reference and compares every output. The kernels of
/// `options.config` serve the run's `call_kernel`s and the reference's `custom` ops alike.
pub fn run_and_compare(
    level1: &Program,
    host: &HostProgram,
    ranks: usize,
    seed: u64,
    options: &CpuOptions,
) -> Result<Comparison, CompareError> {
    let mut options = options.clone();
    options.ranks = Some(ranks);
    compare_with_reference(level1, seed, &options.config.kernels, |inputs| {
        let outcome = run_cpu(
            host,
            RunInputs::Full {
                program: level1,
                inputs,
            },
            &options,
        )?;
        Ok(outcome.gather(level1)?)
    })
}

/// What every backend's run-and-compare shares: seeded inputs for `level1`, `run` on them
/// (returning the gathered outputs), the level-1 reference (`kernels` serving its `custom`
/// ops) and the per-output comparison.
pub fn compare_with_reference<E: From<CompareError>>(
    level1: &Program,
    seed: u64,
    kernels: &crate::runtime::cpu::CpuKernels,
    run: impl FnOnce(&BTreeMap<String, TensorData>) -> Result<BTreeMap<String, TensorData>, E>,
) -> Result<Comparison, E> {
    let inputs = random_inputs(level1, seed)?;
    let got = run(&inputs)?;
    let want = evaluate_with(level1, &inputs, kernels).map_err(CompareError::from)?;
    Ok(compare_outputs(level1, &got, &want)?)
}

/// Compares gathered outputs with reference outputs, output by output.
pub fn compare_outputs(
    level1: &Program,
    got: &BTreeMap<String, TensorData>,
    want: &BTreeMap<String, TensorData>,
) -> Result<Comparison, CompareError> {
    let precision = output_precision(level1);
    let mut outputs = Vec::new();
    for &t in &level1.outputs {
        let name = level1.tensors[t].name.clone();
        let missing = |side: &str| CompareError::Output {
            name: name.clone(),
            message: format!("missing from the {side}"),
        };
        let (g, w) = (
            got.get(&name).ok_or_else(|| missing("run"))?,
            want.get(&name).ok_or_else(|| missing("reference"))?,
        );
        let error = g.rel_error(w).map_err(|e| CompareError::Output {
            name: name.clone(),
            message: e.to_string(),
        })?;
        let judged = precision.get(&name).copied().unwrap_or(w.dtype());
        let tol = tolerance(if w.dtype().is_float() {
            judged
        } else {
            w.dtype()
        });
        let passed = if w.dtype().is_float() {
            error < tol
        } else {
            g.bit_eq(w)
        };
        outputs.push(OutputComparison {
            name,
            dtype: w.dtype(),
            error,
            tolerance: tol,
            passed,
        });
    }
    Ok(Comparison { outputs })
}
