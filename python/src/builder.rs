//! `Builder`: builds a level-1 program op by op, as the Rust `ProgramBuilder` does.
//!
//! ```python
//! b = meshflow.Builder("column_parallel_linear_ring")
//! m = b.mesh("m0", [4])
//! x = b.input("x", "bf16", [64, 32], m)
//! b.schedule(x).outer_split(0, 4).parallelize(0, "DIDx")
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use meshflow::ir::program::BuildError as RustBuildError;
use meshflow::ir::{
    DeviceMesh, EntityRef, MeshId, ParallelType, ProgramBuilder, TensorId, TensorType,
};

use crate::data::parse_dtype;
use crate::errors::{BuildError, VerifyError};
use crate::program::Program;

/// Distinguishes builders, so a handle of one cannot be used with another.
static NEXT_BUILDER: AtomicU64 = AtomicU64::new(1);

fn build_error(e: RustBuildError) -> PyErr {
    match e {
        RustBuildError::Verify(v) => {
            VerifyError::new_err(format!("the program does not verify:\n{v}"))
        }
        e => BuildError::new_err(e.to_string()),
    }
}

fn parallel_type(name: &str) -> PyResult<ParallelType> {
    name.parse().map_err(|_| {
        let names: Vec<&str> = ParallelType::ALL.iter().map(|p| p.name()).collect();
        PyValueError::new_err(format!(
            "unknown parallel type `{name}` (expected one of {})",
            names.join(", ")
        ))
    })
}

/// A tensor of a `Builder` (a handle; its name is `Builder.name_of(t)`).
#[pyclass(module = "meshflow", name = "Tensor", frozen)]
#[derive(Clone)]
pub struct Tensor {
    id: TensorId,
    builder: u64,
}

#[pymethods]
impl Tensor {
    fn __repr__(&self) -> String {
        format!("<meshflow.Tensor #{}>", self.id.index())
    }
}

/// A device mesh of a `Builder` (a handle).
#[pyclass(module = "meshflow", name = "Mesh", frozen)]
#[derive(Clone)]
pub struct Mesh {
    id: MeshId,
    builder: u64,
}

#[pymethods]
impl Mesh {
    fn __repr__(&self) -> String {
        format!("<meshflow.Mesh #{}>", self.id.index())
    }
}

/// Builds a level-1 program. Op outputs are placed on the mesh of the op's first input and
/// named `t0`, `t1`, ... unless renamed. `build()` verifies and returns the `Program`; the
/// builder stays usable.
#[pyclass(module = "meshflow", name = "Builder")]
pub struct Builder {
    inner: ProgramBuilder,
    id: u64,
}

impl Builder {
    fn tensor(&self, t: &Tensor) -> PyResult<TensorId> {
        if t.builder != self.id {
            return Err(BuildError::new_err("the tensor belongs to another builder"));
        }
        Ok(t.id)
    }

    fn mesh_id(&self, m: &Mesh) -> PyResult<MeshId> {
        if m.builder != self.id {
            return Err(BuildError::new_err("the mesh belongs to another builder"));
        }
        Ok(m.id)
    }

    fn handle(&self, id: TensorId) -> Tensor {
        Tensor {
            id,
            builder: self.id,
        }
    }

    fn unary(
        &mut self,
        x: &Tensor,
        f: impl FnOnce(&mut ProgramBuilder, TensorId) -> Result<TensorId, RustBuildError>,
    ) -> PyResult<Tensor> {
        let x = self.tensor(x)?;
        let t = f(&mut self.inner, x).map_err(build_error)?;
        Ok(self.handle(t))
    }

    fn binary(
        &mut self,
        a: &Tensor,
        b: &Tensor,
        f: impl FnOnce(&mut ProgramBuilder, TensorId, TensorId) -> Result<TensorId, RustBuildError>,
    ) -> PyResult<Tensor> {
        let (a, b) = (self.tensor(a)?, self.tensor(b)?);
        let t = f(&mut self.inner, a, b).map_err(build_error)?;
        Ok(self.handle(t))
    }
}

#[pymethods]
impl Builder {
    /// A builder for a program called `name`.
    #[new]
    fn new(name: &str) -> Builder {
        Builder {
            inner: ProgramBuilder::new(name),
            id: NEXT_BUILDER.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Declares a mesh of `shape` (an int or a list of ints) over consecutive ranks from
    /// `start`, or over the ranks `devices` (row-major).
    #[pyo3(signature = (name, shape, start = 0, devices = None))]
    fn mesh(
        &mut self,
        name: &str,
        shape: &Bound<'_, PyAny>,
        start: usize,
        devices: Option<Vec<usize>>,
    ) -> PyResult<Mesh> {
        let shape: Vec<usize> = match shape.extract::<usize>() {
            Ok(n) => vec![n],
            Err(_) => shape
                .extract()
                .map_err(|_| PyTypeError::new_err("a mesh shape is an int or a list of ints"))?,
        };
        let mesh = match devices {
            Some(d) => DeviceMesh::new(shape, d),
            None => DeviceMesh::iota(shape, start),
        }
        .map_err(|e| BuildError::new_err(e.to_string()))?;
        let id = self.inner.mesh(name, mesh).map_err(build_error)?;
        Ok(Mesh {
            id,
            builder: self.id,
        })
    }

    /// Declares a program input of element type `dtype` (`"f32"`, `"bf16"`, `"f16"`, `"i32"`,
    /// `"i64"`) and `shape` on `mesh` (unsharded until `schedule` is called on it).
    fn input(&mut self, name: &str, dtype: &str, shape: Vec<u64>, mesh: &Mesh) -> PyResult<Tensor> {
        let (dtype, mesh) = (parse_dtype(dtype)?, self.mesh_id(mesh)?);
        let t = self
            .inner
            .input(name, dtype, &shape, mesh)
            .map_err(build_error)?;
        Ok(self.handle(t))
    }

    /// Starts (or continues) the schedule of `t`: chain `outer_split`, `inner_split`, `merge`,
    /// `reorder`, `swizzle1d` and `parallelize` on the result. The tensor becomes annotated, so
    /// sharding propagation leaves it alone.
    fn schedule(slf: Bound<'_, Self>, t: &Tensor) -> PyResult<Schedule> {
        let id = slf.borrow().tensor(t)?;
        slf.borrow_mut().inner.schedule(id);
        Ok(Schedule {
            builder: slf.unbind(),
            tensor: id,
        })
    }

    /// Marks `t` as explicitly replicated on its mesh.
    fn replicate(&mut self, t: &Tensor) -> PyResult<()> {
        let t = self.tensor(t)?;
        self.inner.replicate(t);
        Ok(())
    }

    /// Moves `t` to another mesh (for mesh-to-mesh transfers).
    fn place(&mut self, t: &Tensor, mesh: &Mesh) -> PyResult<()> {
        let (t, m) = (self.tensor(t)?, self.mesh_id(mesh)?);
        self.inner.place(t, m);
        Ok(())
    }

    /// Renames `t`.
    fn rename(&mut self, t: &Tensor, name: &str) -> PyResult<()> {
        let t = self.tensor(t)?;
        self.inner.rename(t, name).map_err(build_error)
    }

    /// The name of `t`.
    fn name_of(&self, t: &Tensor) -> PyResult<String> {
        let t = self.tensor(t)?;
        Ok(self.inner.program().tensors[t].name.clone())
    }

    /// Marks `t` as a program output.
    fn output(&mut self, t: &Tensor) -> PyResult<()> {
        let t = self.tensor(t)?;
        self.inner.output(t);
        Ok(())
    }

    /// `set(x)`: a copy, or a resharding when the schedules differ.
    fn set(&mut self, x: &Tensor) -> PyResult<Tensor> {
        self.unary(x, ProgramBuilder::set)
    }

    /// `matmul(a, b)`.
    fn matmul(&mut self, a: &Tensor, b: &Tensor) -> PyResult<Tensor> {
        self.binary(a, b, ProgramBuilder::matmul)
    }

    /// `linear(x, w)` = `x @ w^T`.
    fn linear(&mut self, x: &Tensor, w: &Tensor) -> PyResult<Tensor> {
        self.binary(x, w, ProgramBuilder::linear)
    }

    /// `add(a, b)`.
    fn add(&mut self, a: &Tensor, b: &Tensor) -> PyResult<Tensor> {
        self.binary(a, b, ProgramBuilder::add)
    }

    /// `sub(a, b)`.
    fn sub(&mut self, a: &Tensor, b: &Tensor) -> PyResult<Tensor> {
        self.binary(a, b, ProgramBuilder::sub)
    }

    /// `mul(a, b)`.
    fn mul(&mut self, a: &Tensor, b: &Tensor) -> PyResult<Tensor> {
        self.binary(a, b, ProgramBuilder::mul)
    }

    /// `gelu(x)`.
    fn gelu(&mut self, x: &Tensor) -> PyResult<Tensor> {
        self.unary(x, ProgramBuilder::gelu)
    }

    /// `silu(x)`.
    fn silu(&mut self, x: &Tensor) -> PyResult<Tensor> {
        self.unary(x, ProgramBuilder::silu)
    }

    /// `sum(x, axis)`.
    fn sum(&mut self, x: &Tensor, axis: usize) -> PyResult<Tensor> {
        self.unary(x, |b, x| b.sum(x, axis))
    }

    /// `cast(x)` to `dtype`.
    fn cast(&mut self, x: &Tensor, dtype: &str) -> PyResult<Tensor> {
        let dtype = parse_dtype(dtype)?;
        self.unary(x, |b, x| b.cast(x, dtype))
    }

    /// `moe_dispatch(x, topk_idx)` to `experts` experts of `capacity` rows each; returns
    /// `(expert_x, expert_counts, routing)`.
    fn moe_dispatch(
        &mut self,
        x: &Tensor,
        topk_idx: &Tensor,
        experts: u64,
        capacity: u64,
    ) -> PyResult<(Tensor, Tensor, Tensor)> {
        let (x, k) = (self.tensor(x)?, self.tensor(topk_idx)?);
        let (a, b, c) = self
            .inner
            .moe_dispatch(x, k, experts, capacity)
            .map_err(build_error)?;
        Ok((self.handle(a), self.handle(b), self.handle(c)))
    }

    /// `grouped_matmul(expert_x, expert_counts, w)`.
    fn grouped_matmul(
        &mut self,
        expert_x: &Tensor,
        counts: &Tensor,
        w: &Tensor,
    ) -> PyResult<Tensor> {
        let (x, c, w) = (
            self.tensor(expert_x)?,
            self.tensor(counts)?,
            self.tensor(w)?,
        );
        let t = self.inner.grouped_matmul(x, c, w).map_err(build_error)?;
        Ok(self.handle(t))
    }

    /// `moe_combine(expert_y, expert_counts, routing, topk_weights)`.
    fn moe_combine(
        &mut self,
        expert_y: &Tensor,
        counts: &Tensor,
        routing: &Tensor,
        topk_weights: &Tensor,
    ) -> PyResult<Tensor> {
        let ids = [expert_y, counts, routing, topk_weights]
            .into_iter()
            .map(|t| self.tensor(t))
            .collect::<PyResult<Vec<_>>>()?;
        let t = self
            .inner
            .moe_combine(ids[0], ids[1], ids[2], ids[3])
            .map_err(build_error)?;
        Ok(self.handle(t))
    }

    /// `custom(inputs.., kernel=KERNEL, args=[ARGS])`: the embedder's own op, with output
    /// types `outputs` (`[(dtype, shape)]`); returns the outputs.
    #[pyo3(signature = (kernel, inputs, outputs, args = Vec::new()))]
    fn custom(
        &mut self,
        kernel: &str,
        inputs: Vec<PyRef<'_, Tensor>>,
        outputs: Vec<(String, Vec<u64>)>,
        args: Vec<i64>,
    ) -> PyResult<Vec<Tensor>> {
        let ins = inputs
            .iter()
            .map(|t| self.tensor(t))
            .collect::<PyResult<Vec<_>>>()?;
        let types = outputs
            .iter()
            .map(|(d, s)| Ok(TensorType::new(parse_dtype(d)?, s)))
            .collect::<PyResult<Vec<_>>>()?;
        let outs = self
            .inner
            .custom(kernel, &ins, &types, &args)
            .map_err(build_error)?;
        Ok(outs.into_iter().map(|t| self.handle(t)).collect())
    }

    /// The program built so far, as text (unverified).
    #[getter]
    fn text(&self) -> String {
        self.inner.program().to_string()
    }

    /// Verifies and returns the program (the builder can go on).
    fn build(&self) -> PyResult<Program> {
        let program = self.inner.clone().build().map_err(build_error)?;
        Ok(Program {
            program,
            ranks: None,
        })
    }
}

/// The schedule of one tensor of a `Builder`; every method appends a transform and returns the
/// schedule, so calls chain.
#[pyclass(module = "meshflow", name = "Schedule")]
pub struct Schedule {
    builder: Py<Builder>,
    tensor: TensorId,
}

impl Schedule {
    fn with(slf: PyRef<'_, Self>, f: impl FnOnce(&mut ProgramBuilder, TensorId)) -> Py<Self> {
        let py = slf.py();
        f(&mut slf.builder.borrow_mut(py).inner, slf.tensor);
        slf.into()
    }
}

#[pymethods]
impl Schedule {
    /// `outer_split(axis, parts)`: `parts` outer pieces of axis `axis`.
    fn outer_split(slf: PyRef<'_, Self>, axis: usize, parts: u64) -> Py<Self> {
        Schedule::with(slf, |b, t| {
            b.schedule(t).outer_split(axis, parts);
        })
    }

    /// `inner_split(axis, factor)`: inner pieces of `factor` elements.
    fn inner_split(slf: PyRef<'_, Self>, axis: usize, factor: u64) -> Py<Self> {
        Schedule::with(slf, |b, t| {
            b.schedule(t).inner_split(axis, factor);
        })
    }

    /// `merge(axis)`: merges axes `axis` and `axis + 1`.
    fn merge(slf: PyRef<'_, Self>, axis: usize) -> Py<Self> {
        Schedule::with(slf, |b, t| {
            b.schedule(t).merge(axis);
        })
    }

    /// `reorder(order)`.
    fn reorder(slf: PyRef<'_, Self>, order: Vec<usize>) -> Py<Self> {
        Schedule::with(slf, |b, t| {
            b.schedule(t).reorder(&order);
        })
    }

    /// `swizzle1d(axis, pt)`: step `i` of the device with index `my` on `pt` takes chunk
    /// `(i + my) % n` (a ring).
    fn swizzle1d(slf: PyRef<'_, Self>, axis: usize, pt: &str) -> PyResult<Py<Self>> {
        let pt = parallel_type(pt)?;
        Ok(Schedule::with(slf, |b, t| {
            b.schedule(t).swizzle1d(axis, pt);
        }))
    }

    /// `parallelize(axis, pt)` with `pt` one of `DIDx`, `DIDy`, `DIDz`, `Stream`, `Serial`.
    fn parallelize(slf: PyRef<'_, Self>, axis: usize, pt: &str) -> PyResult<Py<Self>> {
        let pt = parallel_type(pt)?;
        Ok(Schedule::with(slf, |b, t| {
            b.schedule(t).parallelize(axis, pt);
        }))
    }
}
