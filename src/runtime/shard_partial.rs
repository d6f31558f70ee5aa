//! Scattering a partial program input: an input with reduction axes is supplied as its full
//! unreduced data (every logical axis, reduction axes included); its value is the sum over
//! the reduction axes. Each device receives the sum over its own chunk of every reduction
//! axis, so the devices of a team hold partial sums of the value (a device split of a
//! reduction axis), and replicated axes hold the same data on every device.

use std::collections::BTreeMap;

use meshflow_ir::program::Layout;
use meshflow_ir::{DeviceId, ParallelType, Program, TensorId};

use super::data::TensorData;
use super::shard::ShardError;

fn unravel(mut flat: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for k in (0..shape.len()).rev() {
        idx[k] = flat % shape[k].max(1);
        flat /= shape[k].max(1);
    }
    idx
}

fn ravel(idx: &[u64], shape: &[u64]) -> usize {
    idx.iter()
        .zip(shape)
        .fold(0u64, |acc, (&i, &n)| acc * n + i) as usize
}

/// True when `t` is a program input with reduction axes.
pub fn is_partial_input(program: &Program, t: TensorId) -> bool {
    program
        .tensors
        .get(t)
        .is_some_and(|d| d.is_input && d.ty.axes.iter().any(|a| a.reduction))
}

/// The local value of partial input `t` on every device of its mesh (see the module docs).
pub fn scatter_partial(
    program: &Program,
    t: TensorId,
    full: &TensorData,
) -> Result<BTreeMap<DeviceId, TensorData>, ShardError> {
    let decl = &program.tensors[t];
    let name = decl.name.clone();
    let full_shape: Vec<u64> = decl.ty.axes.iter().map(|a| a.extent).collect();
    if full.dtype() != decl.ty.dtype || full.shape() != full_shape.as_slice() {
        return Err(ShardError::FullType {
            tensor: name,
            expected: format!("{}{full_shape:?} (reduction axes included)", decl.ty.dtype),
            actual: full.type_string(),
        });
    }
    let domain = decl.loop_domain().map_err(|source| ShardError::Schedule {
        tensor: name.clone(),
        source,
    })?;
    let layout = Layout::of(&domain, full_shape.len()).map_err(|source| ShardError::Layout {
        tensor: name.clone(),
        source,
    })?;
    let mesh = &program.meshes[decl.mesh].mesh;
    let local = layout.local_shape();
    let value_axes: Vec<usize> = (0..full_shape.len())
        .filter(|&a| !decl.ty.axes[a].reduction)
        .collect();
    let local_value: Vec<u64> = value_axes.iter().map(|&a| local[a]).collect();
    let n_local: u64 = local.iter().product();
    let mut out = BTreeMap::new();
    for &device in mesh.devices() {
        let team = |pt: ParallelType| mesh.team_index(device, pt).unwrap_or(0) as u64;
        let mut sums = vec![0f64; local_value.iter().product::<u64>() as usize];
        for j in 0..n_local {
            let li = unravel(j, &local);
            // Padding of an uneven piece holds zeros.
            let v = match layout.local_to_global(&li, team) {
                Some(gi) => full
                    .storage()
                    .get_f32(ravel(&gi, &full_shape))
                    .unwrap_or(f32::NAN),
                None => 0.0,
            };
            let lv: Vec<u64> = value_axes.iter().map(|&a| li[a]).collect();
            sums[ravel(&lv, &local_value)] += f64::from(v);
        }
        let values: Vec<f32> = sums.iter().map(|&s| s as f32).collect();
        let data = if decl.ty.dtype.is_float() {
            TensorData::from_f32(decl.ty.dtype, &local_value, &values)
        } else {
            let ints: Vec<i64> = sums.iter().map(|&s| s as i64).collect();
            TensorData::from_i64(decl.ty.dtype, &local_value, &ints)
        };
        let data = data.map_err(|e| ShardError::FullType {
            tensor: name.clone(),
            expected: format!("{:?} local elements", local_value),
            actual: e.to_string(),
        })?;
        out.insert(device, data);
    }
    Ok(out)
}
