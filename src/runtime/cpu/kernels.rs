//! Kernels an embedder gives the CPU backend: named ones for `call_kernel`, and
//! replacements of built-in compute kernels.

use std::fmt;
use std::sync::Arc;

use crate::runtime::view::{View, ViewMut};

/// A kernel an embedder registers for `call_kernel` on the CPU backend: inputs, outputs
/// (written in place) and scalar arguments.
pub type CpuKernelFn =
    dyn Fn(&[View<'_>], &mut [ViewMut<'_>], &[i64]) -> Result<(), String> + Send + Sync;

/// Named kernels for `call_kernel`, and replacements of built-in compute kernels.
#[derive(Clone, Default)]
pub struct CpuKernels {
    pub(super) names: Vec<String>,
    pub(super) kernels: Vec<Arc<CpuKernelFn>>,
    replaced: Vec<(String, Arc<CpuKernelFn>)>,
}

impl fmt::Debug for CpuKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replaced: Vec<&str> = self.replaced.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("CpuKernels")
            .field("names", &self.names)
            .field("replaced", &replaced)
            .finish()
    }
}

impl CpuKernels {
    /// No kernels.
    pub fn new() -> CpuKernels {
        CpuKernels::default()
    }

    /// Registers (or replaces) the kernel called `name`.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        kernel: impl Fn(&[View<'_>], &mut [ViewMut<'_>], &[i64]) -> Result<(), String>
            + Send
            + Sync
            + 'static,
    ) {
        let name = name.into();
        match self.names.iter().position(|n| *n == name) {
            Some(i) => self.kernels[i] = Arc::new(kernel),
            None => {
                self.names.push(name);
                self.kernels.push(Arc::new(kernel));
            }
        }
    }
}

impl CpuKernels {
    /// Replaces the CPU backend's kernel of the built-in compute op `op` (its host IR name:
    /// `linear`, `matmul`, `add`, `gelu`, ...) with `kernel`, called with the op's inputs and
    /// its one output and no arguments. For trying another kernel against the level-1
    /// reference, which never uses it: a wrong kernel then shows up as a `mismatch`.
    pub fn replace_op(
        &mut self,
        op: impl Into<String>,
        kernel: impl Fn(&[View<'_>], &mut [ViewMut<'_>], &[i64]) -> Result<(), String>
            + Send
            + Sync
            + 'static,
    ) {
        let op = op.into();
        self.replaced.retain(|(n, _)| *n != op);
        self.replaced.push((op, Arc::new(kernel)));
    }

    /// The replacement of built-in op `op`, if any.
    pub(super) fn replacement(&self, op: &str) -> Option<Arc<CpuKernelFn>> {
        self.replaced
            .iter()
            .find(|(n, _)| n == op)
            .map(|(_, k)| k.clone())
    }

    /// The kernel registered as `name`.
    pub fn get(&self, name: &str) -> Option<&CpuKernelFn> {
        let i = self.names.iter().position(|n| n == name)?;
        self.kernels.get(i).map(|k| &**k)
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }
}
