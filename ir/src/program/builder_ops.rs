//! Builder methods of the shape ops, the reductions `max`/`min`/`avg` and the row-wise ops.
//!
//! ```
//! use meshflow_ir::{DType, DeviceMesh, ParallelType::*, ProgramBuilder};
//!
//! // Attention heads: [B, S, H] -> [B, S, nh, hd] -> [B, nh, S, hd].
//! let mut b = ProgramBuilder::new("heads");
//! let m = b.mesh("m", DeviceMesh::iota(vec![2], 0).unwrap()).unwrap();
//! let x = b.input("x", DType::F32, &[2, 8, 32], m).unwrap();
//! b.schedule(x).outer_split(2, 2).parallelize(2, DIDx);
//! let q = b.reshape(x, &[2, 8, 4, 8]).unwrap();
//! let q = b.transpose(q, 1, 2).unwrap();
//! let p = b.softmax(q, 3).unwrap();
//! b.output(p);
//! let program = b.build().unwrap();
//! assert_eq!(program.ops.len(), 3);
//! ```

use super::{BuildError, Epsilon, InferError, OpKind, ProgramBuilder, TensorRef, TensorType};

impl ProgramBuilder {
    fn one(
        &mut self,
        kind: OpKind,
        inputs: &[TensorRef],
        declared: &[TensorType],
    ) -> Result<TensorRef, BuildError> {
        let name = kind.name();
        self.op(kind, inputs, declared)?
            .into_iter()
            .next()
            .ok_or_else(|| {
                BuildError::Infer(InferError {
                    op: name,
                    message: "produced no output".into(),
                })
            })
    }

    fn shaped(
        &mut self,
        kind: OpKind,
        x: TensorRef,
        shape: &[u64],
    ) -> Result<TensorRef, BuildError> {
        let dtype = self.program().tensors.get(x).map(|d| d.ty.dtype);
        let dtype = dtype.ok_or(BuildError::UnknownTensor(x))?;
        self.one(kind, &[x], &[TensorType::new(dtype, shape)])
    }

    /// `reshape(x)` to `shape` (replicates an input mesh axis first where its split does not
    /// carry over).
    pub fn reshape(&mut self, x: TensorRef, shape: &[u64]) -> Result<TensorRef, BuildError> {
        self.shaped(OpKind::Reshape, x, shape)
    }

    /// `view(x)` to `shape` (lowering refuses where the input's splits do not carry over).
    pub fn view(&mut self, x: TensorRef, shape: &[u64]) -> Result<TensorRef, BuildError> {
        self.shaped(OpKind::View, x, shape)
    }

    /// `permute(x, perm=[..])`: output axis `k` is input axis `perm[k]`.
    pub fn permute(&mut self, x: TensorRef, perm: &[usize]) -> Result<TensorRef, BuildError> {
        self.one(
            OpKind::Permute {
                perm: perm.to_vec(),
            },
            &[x],
            &[],
        )
    }

    /// Swaps axes `a` and `b` (a `permute`).
    pub fn transpose(&mut self, x: TensorRef, a: usize, b: usize) -> Result<TensorRef, BuildError> {
        let rank = self
            .program()
            .tensors
            .get(x)
            .ok_or(BuildError::UnknownTensor(x))?
            .ty
            .value_shape()
            .len();
        let mut perm: Vec<usize> = (0..rank).collect();
        if a < rank && b < rank {
            perm.swap(a, b);
        } else {
            perm.push(a.max(b));
        }
        self.permute(x, &perm)
    }

    /// `expand(x)` to `shape` (torch `expand`).
    pub fn expand(&mut self, x: TensorRef, shape: &[u64]) -> Result<TensorRef, BuildError> {
        self.shaped(OpKind::Expand, x, shape)
    }

    /// `squeeze(x, axis=a)`.
    pub fn squeeze(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Squeeze { axis }, &[x], &[])
    }

    /// `unsqueeze(x, axis=a)`.
    pub fn unsqueeze(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Unsqueeze { axis }, &[x], &[])
    }

    /// `slice(x, axis=a, start=s, end=e)`.
    pub fn slice(
        &mut self,
        x: TensorRef,
        axis: usize,
        start: u64,
        end: u64,
    ) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Slice { axis, start, end }, &[x], &[])
    }

    /// `select(x, axis=a, index=i)`.
    pub fn select(
        &mut self,
        x: TensorRef,
        axis: usize,
        index: u64,
    ) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Select { axis, index }, &[x], &[])
    }

    /// `cat(xs.., axis=a)`.
    pub fn cat(&mut self, xs: &[TensorRef], axis: usize) -> Result<TensorRef, BuildError> {
        self.one(
            OpKind::Cat {
                axis,
                inputs: xs.len(),
            },
            xs,
            &[],
        )
    }

    /// `max(x, axis=a)`.
    pub fn max(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Max { axis }, &[x], &[])
    }

    /// `min(x, axis=a)`.
    pub fn min(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Min { axis }, &[x], &[])
    }

    /// `avg(x, axis=a)`.
    pub fn avg(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Avg { axis }, &[x], &[])
    }

    /// `softmax(x, axis=a)`.
    pub fn softmax(&mut self, x: TensorRef, axis: usize) -> Result<TensorRef, BuildError> {
        self.one(OpKind::Softmax { axis }, &[x], &[])
    }

    /// `rms_norm(x, w, axis=a, eps=e)`; `eps` must be positive and finite.
    pub fn rms_norm(
        &mut self,
        x: TensorRef,
        w: TensorRef,
        axis: usize,
        eps: f32,
    ) -> Result<TensorRef, BuildError> {
        let eps = Epsilon::new(eps).ok_or_else(|| {
            BuildError::Infer(InferError {
                op: "rms_norm",
                message: format!("eps must be positive and finite, not {eps}"),
            })
        })?;
        self.one(OpKind::RmsNorm { axis, eps }, &[x, w], &[])
    }
}
