//! A builder for level-1 programs.
//!
//! ```
//! use meshflow_ir::{DType, DeviceMesh, ParallelType::*, ProgramBuilder};
//!
//! let d = 4;
//! let mut b = ProgramBuilder::new("column_parallel_linear_ring");
//! let m = b.mesh("m0", DeviceMesh::iota(vec![d], 0).unwrap()).unwrap();
//! let x = b.input("x", DType::BF16, &[64, 32], m).unwrap();
//! let w = b.input("w", DType::BF16, &[48, 32], m).unwrap();
//! b.schedule(x).outer_split(0, d as u64).parallelize(0, DIDx);
//! b.schedule(w).outer_split(0, d as u64).parallelize(0, DIDx);
//! let ag = b.set(x).unwrap();
//! b.schedule(ag).outer_split(0, d as u64).swizzle1d(0, DIDx).parallelize(0, Stream);
//! let y = b.linear(ag, w).unwrap();
//! b.output(y);
//! let program = b.build().unwrap();
//! assert_eq!(program.ops.len(), 2);
//! ```

use super::{
    infer_output_types, InferError, MeshDecl, MeshId, Op, OpKind, Program, TensorDecl, TensorId,
    TensorType, Transform,
};
use crate::dtype::DType;
use crate::mesh::{DeviceMesh, ParallelType};
use crate::moe::MoeWire;
use crate::span::SourceLoc;
use crate::verify::{verify_program, VerifyErrors};

/// A tensor being built (a copyable handle).
pub type TensorRef = TensorId;

/// Why a builder call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BuildError {
    /// A name is used twice.
    #[error("the name `{0}` is already used")]
    DuplicateName(String),
    /// An op's inputs do not fit together.
    #[error(transparent)]
    Infer(#[from] InferError),
    /// The finished program does not verify.
    #[error("the program does not verify:\n{0}")]
    Verify(#[from] VerifyErrors),
    /// An input is placed on a mesh other than the one its op runs on.
    #[error("unknown tensor handle {0:?}")]
    UnknownTensor(TensorId),
}

/// Builds a [`Program`] op by op. Op outputs are placed on the mesh of the op's first input and
/// named `t0`, `t1`, ... unless renamed.
#[derive(Debug, Clone)]
pub struct ProgramBuilder {
    program: Program,
    next_auto: usize,
}

/// Appends transforms to one tensor's schedule (see [`ProgramBuilder::schedule`]).
pub struct Scheduler<'a> {
    transforms: &'a mut Vec<Transform>,
}

impl Scheduler<'_> {
    /// `outer_split(axis, parts)`.
    pub fn outer_split(self, axis: usize, parts: u64) -> Self {
        self.transforms.push(Transform::OuterSplit { axis, parts });
        self
    }

    /// `inner_split(axis, factor)`.
    pub fn inner_split(self, axis: usize, factor: u64) -> Self {
        self.transforms.push(Transform::InnerSplit { axis, factor });
        self
    }

    /// `merge(axis)`.
    pub fn merge(self, axis: usize) -> Self {
        self.transforms.push(Transform::Merge { axis });
        self
    }

    /// `reorder(order...)`.
    pub fn reorder(self, order: &[usize]) -> Self {
        self.transforms.push(Transform::Reorder {
            order: order.to_vec(),
        });
        self
    }

    /// `swizzle1d(axis, pt)`.
    pub fn swizzle1d(self, axis: usize, pt: ParallelType) -> Self {
        self.transforms.push(Transform::Swizzle1d { axis, pt });
        self
    }

    /// `parallelize(axis, pt)`.
    pub fn parallelize(self, axis: usize, pt: ParallelType) -> Self {
        self.transforms.push(Transform::Parallelize { axis, pt });
        self
    }
}

impl ProgramBuilder {
    /// A builder for a program called `name`.
    pub fn new(name: impl Into<String>) -> ProgramBuilder {
        ProgramBuilder {
            program: Program::new(name),
            next_auto: 0,
        }
    }

    fn check_name(&self, name: &str) -> Result<(), BuildError> {
        let taken = self.program.tensor_by_name(name).is_some()
            || self.program.mesh_by_name(name).is_some();
        if taken {
            Err(BuildError::DuplicateName(name.to_string()))
        } else {
            Ok(())
        }
    }

    fn decl(&self, t: TensorId) -> Result<&TensorDecl, BuildError> {
        self.program
            .tensors
            .get(t)
            .ok_or(BuildError::UnknownTensor(t))
    }

    /// Declares a mesh.
    pub fn mesh(&mut self, name: &str, mesh: DeviceMesh) -> Result<MeshId, BuildError> {
        self.check_name(name)?;
        Ok(self.program.meshes.push(MeshDecl {
            name: name.to_string(),
            mesh,
            loc: SourceLoc::NONE,
        }))
    }

    /// Declares a program input of shape `shape` on `mesh` (not annotated until
    /// [`ProgramBuilder::schedule`] is called on it).
    pub fn input(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        mesh: MeshId,
    ) -> Result<TensorRef, BuildError> {
        self.check_name(name)?;
        Ok(self.program.tensors.push(TensorDecl {
            name: name.to_string(),
            ty: TensorType::new(dtype, shape),
            mesh,
            schedule: None,
            is_input: true,
            loc: SourceLoc::NONE,
        }))
    }

    /// Starts (or continues) the schedule of `t`; the tensor becomes annotated, so sharding
    /// propagation leaves it alone.
    pub fn schedule(&mut self, t: TensorRef) -> Scheduler<'_> {
        let decl = &mut self.program.tensors[t];
        Scheduler {
            transforms: decl.schedule.get_or_insert_with(Vec::new),
        }
    }

    /// Marks `t` as explicitly replicated on its mesh (an empty, annotated schedule).
    pub fn replicate(&mut self, t: TensorRef) {
        self.program.tensors[t].schedule = Some(Vec::new());
    }

    /// Moves `t` to another mesh (for mesh-to-mesh transfers).
    pub fn place(&mut self, t: TensorRef, mesh: MeshId) {
        self.program.tensors[t].mesh = mesh;
    }

    /// Renames a tensor.
    pub fn rename(&mut self, t: TensorRef, name: &str) -> Result<(), BuildError> {
        self.check_name(name)?;
        self.program.tensors[t].name = name.to_string();
        Ok(())
    }

    /// Marks `t` as a program output.
    pub fn output(&mut self, t: TensorRef) {
        if !self.program.outputs.contains(&t) {
            self.program.outputs.push(t);
        }
    }

    /// Appends an op whose output types are inferred (`declared` supplies what cannot be).
    pub fn op(
        &mut self,
        kind: OpKind,
        inputs: &[TensorRef],
        declared: &[TensorType],
    ) -> Result<Vec<TensorRef>, BuildError> {
        let types: Vec<&TensorType> = inputs
            .iter()
            .map(|&t| self.decl(t).map(|d| &d.ty))
            .collect::<Result<_, _>>()?;
        let declared_refs: Vec<&TensorType> = declared.iter().collect();
        let outs = infer_output_types(&kind, &types, &declared_refs)?;
        let mesh = match inputs.first() {
            Some(&t) => self.decl(t)?.mesh,
            None => MeshId::new_first(),
        };
        let mut ids = Vec::with_capacity(outs.len());
        for ty in outs {
            let name = loop {
                let n = format!("t{}", self.next_auto);
                self.next_auto += 1;
                if self.check_name(&n).is_ok() {
                    break n;
                }
            };
            ids.push(self.program.tensors.push(TensorDecl {
                name,
                ty,
                mesh,
                schedule: None,
                is_input: false,
                loc: SourceLoc::NONE,
            }));
        }
        self.program.ops.push(Op {
            kind,
            inputs: inputs.to_vec(),
            outputs: ids.clone(),
            loc: SourceLoc::NONE,
        });
        Ok(ids)
    }

    fn single(&mut self, kind: OpKind, inputs: &[TensorRef]) -> Result<TensorRef, BuildError> {
        Ok(self.op(kind, inputs, &[])?[0])
    }

    /// `set(x)`: a copy, or a resharding when the schedules differ.
    pub fn set(&mut self, x: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Set, &[x])
    }

    /// `matmul(a, b)`.
    pub fn matmul(&mut self, a: TensorRef, b: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Matmul, &[a, b])
    }

    /// `linear(x, w)` = `x @ w^T`.
    pub fn linear(&mut self, x: TensorRef, w: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Linear, &[x, w])
    }

    /// `add(a, b)`.
    pub fn add(&mut self, a: TensorRef, b: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Add, &[a, b])
    }

    /// `sub(a, b)`.
    pub fn sub(&mut self, a: TensorRef, b: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Sub, &[a, b])
    }

    /// `mul(a, b)`.
    pub fn mul(&mut self, a: TensorRef, b: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Mul, &[a, b])
    }

    /// `gelu(x)`.
    pub fn gelu(&mut self, x: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Gelu, &[x])
    }

    /// `silu(x)`.
    pub fn silu(&mut self, x: TensorRef) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Silu, &[x])
    }

    /// `sum(x, axis)`.
    pub fn sum(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.single(OpKind::Sum { axis }, &[x])
    }

    /// `cast(x)` to `dtype`.
    pub fn cast(&mut self, x: TensorRef, dtype: DType) -> Result<TensorRef, BuildError> {
        let shape = self.decl(x)?.ty.value_shape();
        Ok(self.op(OpKind::Cast, &[x], &[TensorType::new(dtype, &shape)])?[0])
    }

    /// `moe_dispatch(x, topk_idx)` to `experts` experts of capacity `capacity` rows each.
    /// Returns `(expert_x, expert_counts, routing)`.
    pub fn moe_dispatch(
        &mut self,
        x: TensorRef,
        topk_idx: TensorRef,
        experts: u64,
        capacity: u64,
    ) -> Result<(TensorRef, TensorRef, TensorRef), BuildError> {
        self.moe_dispatch_with(x, topk_idx, experts, capacity, MoeWire::Native)
    }

    /// [`moe_dispatch`](Self::moe_dispatch) with travelling tokens encoded as `wire` (e.g.
    /// FP8, see [`crate::moe`]).
    pub fn moe_dispatch_with(
        &mut self,
        x: TensorRef,
        topk_idx: TensorRef,
        experts: u64,
        capacity: u64,
        wire: MoeWire,
    ) -> Result<(TensorRef, TensorRef, TensorRef), BuildError> {
        let xt = &self.decl(x)?.ty;
        let xs = xt.value_shape();
        let mut ex = xs[..xs.len().saturating_sub(2)].to_vec();
        ex.extend([experts, capacity, xs.last().copied().unwrap_or(0)]);
        let declared = [
            TensorType::new(xt.dtype, &ex),
            TensorType::new(DType::I32, &[]),
            TensorType::new(DType::I32, &[]),
        ];
        let outs = self.op(OpKind::MoeDispatch { wire }, &[x, topk_idx], &declared)?;
        Ok((outs[0], outs[1], outs[2]))
    }

    /// `grouped_matmul(expert_x, expert_counts, w)`.
    pub fn grouped_matmul(
        &mut self,
        expert_x: TensorRef,
        counts: TensorRef,
        w: TensorRef,
    ) -> Result<TensorRef, BuildError> {
        self.single(OpKind::GroupedMatmul, &[expert_x, counts, w])
    }

    /// `moe_combine(expert_y, expert_counts, routing, topk_weights)`.
    pub fn moe_combine(
        &mut self,
        expert_y: TensorRef,
        counts: TensorRef,
        routing: TensorRef,
        topk_weights: TensorRef,
    ) -> Result<TensorRef, BuildError> {
        self.single(
            OpKind::MoeCombine,
            &[expert_y, counts, routing, topk_weights],
        )
    }

    /// `custom(inputs.., kernel=KERNEL, args=[ARGS])`: an embedder's own op with the declared
    /// output types (see [`CustomOp`](super::CustomOp) for the contract). Outputs are placed on
    /// the mesh of the first input.
    pub fn custom(
        &mut self,
        kernel: &str,
        inputs: &[TensorRef],
        outputs: &[TensorType],
        args: &[i64],
    ) -> Result<Vec<TensorRef>, BuildError> {
        let kind = OpKind::Custom(super::CustomOp {
            kernel: kernel.to_string(),
            args: args.to_vec(),
            inputs: inputs.len(),
            outputs: outputs.len(),
        });
        self.op(kind, inputs, outputs)
    }

    /// The program built so far, unverified.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Verifies and returns the program.
    pub fn build(self) -> Result<Program, BuildError> {
        verify_program(&self.program)?;
        Ok(self.program)
    }
}

impl MeshId {
    fn new_first() -> MeshId {
        <MeshId as crate::entity::EntityRef>::new(0)
    }
}
