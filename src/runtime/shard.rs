//! Scatter full tensors into per-device local tensors and gather them back, by the level-1
//! tensor's [`Layout`].
//!
//! A device of the tensor's mesh holds, per logical axis, the elements whose device-parallel
//! leaves equal its team index along that leaf's parallel type
//! ([`Layout::local_to_global`]). Uneven pieces are padded to the largest piece of their level
//! (the local shape is the same on every device); padding is zero when scattering and ignored
//! when gathering. Values have only the non-reduction axes. A tensor split over
//! devices on a reduction axis holds partial sums and cannot be scattered or gathered.
//! Devices holding the same elements (replicas) must agree bit for bit when gathering.

use std::collections::BTreeMap;

use meshflow_ir::program::{Layout, LayoutError, ScheduleError};
use meshflow_ir::{DeviceId, DeviceMesh, ParallelType, Program, TensorId};

use super::data::TensorData;

/// Why a tensor could not be scattered or gathered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// The schedule does not replay.
    #[error("tensor `{tensor}`: {source}")]
    Schedule {
        /// The tensor.
        tensor: String,
        /// The schedule error.
        source: ScheduleError,
    },
    /// The schedule has no supported layout.
    #[error("tensor `{tensor}`: {source}")]
    Layout {
        /// The tensor.
        tensor: String,
        /// The layout error.
        source: LayoutError,
    },
    /// A device split does not match the mesh.
    #[error("tensor `{tensor}`: split into {parts} parts along {pt}, but its mesh {mesh} has {mesh_extent:?} devices along {pt}")]
    MeshMismatch {
        /// The tensor.
        tensor: String,
        /// The parallel type.
        pt: ParallelType,
        /// The number of parts.
        parts: u64,
        /// The mesh, printed.
        mesh: String,
        /// The mesh extent along `pt` (`None` when the mesh has no such axis).
        mesh_extent: Option<usize>,
    },
    /// The tensor holds partial sums.
    #[error("tensor `{tensor}` is split over devices ({pt}) on reduction axis {axis}: its devices hold partial sums, so it has no full value to gather or scatter")]
    PartialSums {
        /// The tensor.
        tensor: String,
        /// The reduction axis.
        axis: usize,
        /// The parallel type.
        pt: ParallelType,
    },
    /// Two replicas differ.
    #[error("tensor `{tensor}`: replicas on devices {first} and {second} differ at global index {index:?}")]
    ReplicaMismatch {
        /// The tensor.
        tensor: String,
        /// The device whose value was taken first.
        first: DeviceId,
        /// The device that disagrees.
        second: DeviceId,
        /// The first differing element.
        index: Vec<u64>,
    },
    /// A full tensor of the wrong type.
    #[error("tensor `{tensor}`: expected a full tensor {expected}, got {actual}")]
    FullType {
        /// The tensor.
        tensor: String,
        /// Expected type.
        expected: String,
        /// Actual type.
        actual: String,
    },
    /// A local tensor of the wrong type.
    #[error(
        "tensor `{tensor}` on device {device}: expected a local tensor {expected}, got {actual}"
    )]
    LocalType {
        /// The tensor.
        tensor: String,
        /// The device.
        device: DeviceId,
        /// Expected type.
        expected: String,
        /// Actual type.
        actual: String,
    },
    /// A device of the mesh supplied no local tensor.
    #[error("tensor `{tensor}`: device {device} of its mesh supplied no local tensor")]
    MissingDevice {
        /// The tensor.
        tensor: String,
        /// The device.
        device: DeviceId,
    },
}

/// How one level-1 tensor is laid out over its mesh.
#[derive(Clone, Debug)]
pub struct Sharding {
    name: String,
    dtype: meshflow_ir::DType,
    layout: Layout,
    mesh: DeviceMesh,
    /// Positions of the non-reduction axes among the logical axes.
    value_axes: Vec<usize>,
    full_shape: Vec<u64>,
}

impl Sharding {
    /// The sharding of `tensor` in `program`.
    pub fn of(program: &Program, tensor: TensorId) -> Result<Sharding, ShardError> {
        let decl = &program.tensors[tensor];
        let name = decl.name.clone();
        let domain = decl.loop_domain().map_err(|source| ShardError::Schedule {
            tensor: name.clone(),
            source,
        })?;
        let layout =
            Layout::of(&domain, decl.ty.axes.len()).map_err(|source| ShardError::Layout {
                tensor: name.clone(),
                source,
            })?;
        let mesh = program.meshes[decl.mesh].mesh.clone();
        for split in layout.device_splits() {
            let extent = mesh.size_of(split.pt);
            if extent.map(|e| e as u64) != Some(split.parts) {
                return Err(ShardError::MeshMismatch {
                    tensor: name,
                    pt: split.pt,
                    parts: split.parts,
                    mesh: mesh.to_string(),
                    mesh_extent: extent,
                });
            }
        }
        let value_axes = (0..decl.ty.axes.len())
            .filter(|&a| !decl.ty.axes[a].reduction)
            .collect();
        Ok(Sharding {
            name,
            dtype: decl.ty.dtype,
            layout,
            mesh,
            value_axes,
            full_shape: decl.ty.value_shape(),
        })
    }

    /// The devices holding the tensor.
    pub fn devices(&self) -> &[DeviceId] {
        self.mesh.devices()
    }

    /// The full (logical value) shape.
    pub fn full_shape(&self) -> &[u64] {
        &self.full_shape
    }

    /// The local value shape every device holds.
    pub fn local_shape(&self) -> Vec<u64> {
        let local = self.layout.local_shape();
        self.value_axes.iter().map(|&a| local[a]).collect()
    }

    fn check_no_partial_sums(&self) -> Result<(), ShardError> {
        match self
            .layout
            .device_splits()
            .into_iter()
            .find(|s| s.reduction)
        {
            Some(s) => Err(ShardError::PartialSums {
                tensor: self.name.clone(),
                axis: s.axis,
                pt: s.pt,
            }),
            None => Ok(()),
        }
    }

    /// For `device`, the flat global index of every local element (local row-major order);
    /// `None` for padding (a local element past the actual extent of an uneven piece).
    fn global_indices(&self, device: DeviceId) -> Vec<Option<usize>> {
        let rank = self.layout.axes.len();
        let team = |pt: ParallelType| self.mesh.team_index(device, pt).unwrap_or(0) as u64;
        let local = self.layout.local_shape();
        let gstrides = super::view::contiguous_strides(&self.full_shape);
        // Per value axis: global offset contribution of each local index.
        let tables: Vec<Vec<Option<u64>>> = self
            .value_axes
            .iter()
            .zip(&gstrides)
            .map(|(&a, &gs)| {
                (0..local[a])
                    .map(|li| {
                        let mut idx = vec![0u64; rank];
                        idx[a] = li;
                        // Axes are independent: only axis `a`'s answer matters here.
                        let one = &self.layout.axes[a];
                        let single = meshflow_ir::program::Layout {
                            axes: vec![one.clone()],
                        };
                        single.local_to_global(&[li], team).map(|g| g[0] * gs)
                    })
                    .collect()
            })
            .collect();
        let total: u64 = tables.iter().map(|t| t.len() as u64).product();
        let mut out = Vec::with_capacity(total as usize);
        if total == 0 {
            return out;
        }
        let mut digit = vec![0usize; tables.len()];
        loop {
            let flat: Option<u64> = tables.iter().zip(&digit).map(|(t, &d)| t[d]).sum();
            out.push(flat.map(|f| f as usize));
            let mut k = tables.len();
            loop {
                if k == 0 {
                    return out;
                }
                k -= 1;
                digit[k] += 1;
                if digit[k] < tables[k].len() {
                    break;
                }
                digit[k] = 0;
            }
        }
    }

    /// Cuts a full tensor into the local tensor of every device of the mesh.
    pub fn scatter(&self, full: &TensorData) -> Result<BTreeMap<DeviceId, TensorData>, ShardError> {
        self.check_no_partial_sums()?;
        if full.dtype() != self.dtype || full.shape() != self.full_shape.as_slice() {
            return Err(ShardError::FullType {
                tensor: self.name.clone(),
                expected: format!("{}{:?}", self.dtype, self.full_shape),
                actual: full.type_string(),
            });
        }
        let shape = self.local_shape();
        let mut out = BTreeMap::new();
        for &device in self.mesh.devices() {
            let idx = self.global_indices(device);
            // Padding of uneven pieces is zero.
            let valid: Vec<usize> = idx.iter().flatten().copied().collect();
            let at: Vec<usize> = idx
                .iter()
                .enumerate()
                .filter(|(_, g)| g.is_some())
                .map(|(k, _)| k)
                .collect();
            let picked = full
                .storage()
                .pick(&valid)
                .expect("global indices lie inside the full tensor");
            let mut local =
                TensorData::zeros(self.dtype, &shape).map_err(|e| ShardError::LocalType {
                    tensor: self.name.clone(),
                    device,
                    expected: format!("{}{:?}", self.dtype, shape),
                    actual: e.to_string(),
                })?;
            let ok = local.storage_mut().put(&at, &picked);
            debug_assert!(ok, "one element per valid local index");
            out.insert(device, local);
        }
        Ok(out)
    }

    /// Assembles the full tensor from the local tensors of the mesh's devices.
    pub fn gather(
        &self,
        locals: &BTreeMap<DeviceId, TensorData>,
    ) -> Result<TensorData, ShardError> {
        self.check_no_partial_sums()?;
        let shape = self.local_shape();
        let mut full =
            TensorData::zeros(self.dtype, &self.full_shape).map_err(|e| ShardError::FullType {
                tensor: self.name.clone(),
                expected: format!("{}{:?}", self.dtype, self.full_shape),
                actual: e.to_string(),
            })?;
        let mut owner: Vec<Option<DeviceId>> = vec![None; full.numel() as usize];
        for &device in self.mesh.devices() {
            let local = locals
                .get(&device)
                .ok_or_else(|| ShardError::MissingDevice {
                    tensor: self.name.clone(),
                    device,
                })?;
            if local.dtype() != self.dtype || local.shape() != shape.as_slice() {
                return Err(ShardError::LocalType {
                    tensor: self.name.clone(),
                    device,
                    expected: format!("{}{:?}", self.dtype, shape),
                    actual: local.type_string(),
                });
            }
            let idx = self.global_indices(device);
            let mut valid = Vec::with_capacity(idx.len());
            let mut picked_local = Vec::with_capacity(idx.len());
            for (li, gi) in idx.iter().enumerate() {
                let Some(gi) = *gi else { continue };
                valid.push(gi);
                picked_local.push(li);
                if let Some(first) = owner[gi] {
                    if full.storage().bits(gi) != local.storage().bits(li) {
                        return Err(ShardError::ReplicaMismatch {
                            tensor: self.name.clone(),
                            first,
                            second: device,
                            index: unravel(gi as u64, &self.full_shape),
                        });
                    }
                } else {
                    owner[gi] = Some(device);
                }
            }
            let values = local
                .storage()
                .pick(&picked_local)
                .expect("valid local indices lie inside the local tensor");
            let ok = full.storage_mut().put(&valid, &values);
            debug_assert!(ok, "local and full tensors have the same element type");
        }
        Ok(full)
    }
}

fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0u64; shape.len()];
    for k in (0..shape.len()).rev() {
        let e = shape[k].max(1);
        idx[k] = flat % e;
        flat /= e;
    }
    idx
}

/// Scatters every input of `program` (full tensors by name) into per-device inputs.
pub fn scatter_inputs(
    program: &Program,
    full: &BTreeMap<String, TensorData>,
) -> Result<BTreeMap<DeviceId, BTreeMap<String, TensorData>>, ShardError> {
    let mut per_device: BTreeMap<DeviceId, BTreeMap<String, TensorData>> = BTreeMap::new();
    for t in program.inputs() {
        let name = &program.tensors[t].name;
        let Some(data) = full.get(name) else {
            continue;
        };
        let locals = if super::shard_partial::is_partial_input(program, t) {
            super::shard_partial::scatter_partial(program, t, data)?
        } else {
            Sharding::of(program, t)?.scatter(data)?
        };
        for (device, local) in locals {
            per_device
                .entry(device)
                .or_default()
                .insert(name.clone(), local);
        }
    }
    Ok(per_device)
}

/// Gathers the level-1 tensor called `name` from per-device outputs.
pub fn gather_tensor(
    program: &Program,
    tensor: TensorId,
    per_device: &BTreeMap<DeviceId, BTreeMap<String, TensorData>>,
) -> Result<TensorData, ShardError> {
    let sharding = Sharding::of(program, tensor)?;
    let name = &program.tensors[tensor].name;
    let locals: BTreeMap<DeviceId, TensorData> = sharding
        .devices()
        .iter()
        .filter_map(|&d| Some((d, per_device.get(&d)?.get(name)?.clone())))
        .collect();
    sharding.gather(&locals)
}
