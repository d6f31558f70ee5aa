//! Names and declarations of the host tensors the lowering creates: views and temporaries.

use meshflow_ir::host::{HostTensorId, Role};

use super::Lowering;

impl Lowering<'_> {
    /// Declares an internal tensor named after `base` (`<base>_<suffix>`, made unique) with
    /// `base`'s dtype and mesh.
    pub(crate) fn derived(
        &mut self,
        base: HostTensorId,
        suffix: &str,
        shape: Vec<u64>,
    ) -> HostTensorId {
        let b = &self.host.tensors[base];
        let (dtype, mesh) = (b.dtype, b.mesh);
        let root = b.name.clone();
        let name = self.host.fresh_tensor_name(&format!("{root}_{suffix}"));
        self.host
            .add_tensor(name, dtype, shape, mesh, Role::Internal)
    }
}
