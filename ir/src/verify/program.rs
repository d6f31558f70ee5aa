//! The level-1 verifier.

use std::collections::HashMap;

use super::names::{axes_word, check_names, count, name_problem};
use super::{Diagnostic, Location};
use crate::mesh::ParallelType;
use crate::program::{
    infer_output_types, Layout, LayoutError, Op, Program, TensorDecl, TensorId, TensorType,
};

struct Checker<'a> {
    p: &'a Program,
    diags: Vec<Diagnostic>,
}

/// Every error of `p`, in program order.
pub(super) fn check(p: &Program) -> Vec<Diagnostic> {
    let mut c = Checker {
        p,
        diags: Vec::new(),
    };
    c.names();
    for (id, decl) in p.tensors.iter() {
        c.tensor(id, decl);
    }
    c.ops();
    c.outputs();
    c.diags
}

impl Checker<'_> {
    fn push(&mut self, location: Location, message: String) {
        self.diags.push(Diagnostic { location, message });
    }

    fn tensor_loc(&self, t: TensorId) -> Location {
        match self.p.tensors.get(t) {
            Some(d) => Location::Tensor {
                name: d.name.clone(),
                loc: d.loc,
            },
            None => Location::Program,
        }
    }

    fn op_loc(&self, index: usize, op: &Op) -> Location {
        Location::Op {
            index,
            name: op.kind.name(),
            loc: op.loc,
        }
    }

    fn tensor_name(&self, t: TensorId) -> String {
        self.p
            .tensors
            .get(t)
            .map_or_else(|| format!("{t:?}"), |d| d.name.clone())
    }

    fn mesh_name(&self, t: &TensorDecl) -> String {
        self.p
            .meshes
            .get(t.mesh)
            .map_or_else(|| format!("{:?}", t.mesh), |m| m.name.clone())
    }

    /// `y = linear(a, w)`, for messages.
    fn op_text(&self, op: &Op) -> String {
        let names = |ts: &[TensorId]| {
            ts.iter()
                .map(|&t| self.tensor_name(t))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "`{} = {}({})`",
            names(&op.outputs),
            op.kind.name(),
            names(&op.inputs)
        )
    }

    fn names(&mut self) {
        if let Some(message) = name_problem(&self.p.name, "program") {
            self.push(Location::Program, message);
        }
        let mut entities: Vec<(&str, &str, Location)> = Vec::new();
        for m in self.p.meshes.values() {
            let location = Location::Mesh {
                name: m.name.clone(),
                loc: m.loc,
            };
            entities.push(("mesh", &m.name, location));
        }
        for t in self.p.tensors.values() {
            let location = Location::Tensor {
                name: t.name.clone(),
                loc: t.loc,
            };
            entities.push(("tensor", &t.name, location));
        }
        check_names(&entities, &mut self.diags);
    }

    fn tensor(&mut self, id: TensorId, decl: &TensorDecl) {
        let here = self.tensor_loc(id);
        let name = &decl.name;
        let Some(mesh_decl) = self.p.meshes.get(decl.mesh) else {
            self.push(
                here,
                format!(
                    "mesh handle {:?} of `{name}` is out of range (the program has {} meshes)",
                    decl.mesh,
                    self.p.meshes.len()
                ),
            );
            return;
        };
        let mesh = &mesh_decl.mesh;
        let mesh_name = &mesh_decl.name;
        // Merged extents are products of logical extents: keep the replay free of overflow.
        let total = decl
            .ty
            .axes
            .iter()
            .try_fold(1u64, |acc, a| acc.checked_mul(a.extent));
        if total.is_none() {
            self.push(
                here,
                format!("`{name}` has more than 2^64 elements; its schedule cannot be checked"),
            );
            return;
        }
        let domain = match decl.loop_domain() {
            Ok(d) => d,
            Err(e) => {
                self.push(here, format!("schedule of `{name}`: {e}"));
                return;
            }
        };
        let mut first_use: HashMap<ParallelType, usize> = HashMap::new();
        let mut missing_reported: Vec<ParallelType> = Vec::new();
        for (position, &id) in domain.loop_axes.iter().enumerate() {
            let Some(axis) = domain.ids.get(id) else {
                continue;
            };
            let pt = axis.pt;
            if pt != ParallelType::Serial {
                if let Some(&first) = first_use.get(&pt) {
                    let mesh_axis = mesh
                        .axis_of(pt)
                        .map(|a| format!(" (mesh axis {a} used twice)"))
                        .unwrap_or_default();
                    self.push(
                        here.clone(),
                        format!(
                            "parallel type {pt} is used on loop axes {first} and {position} of \
                             `{name}`{mesh_axis}"
                        ),
                    );
                } else {
                    first_use.insert(pt, position);
                }
            }
            if pt.is_device() {
                match mesh.size_of(pt) {
                    None => {
                        if !missing_reported.contains(&pt) {
                            missing_reported.push(pt);
                            self.push(
                                here.clone(),
                                format!(
                                    "{pt} used on `{name}` but mesh `{mesh_name}` has {}",
                                    axes_word(mesh.ndims())
                                ),
                            );
                        }
                    }
                    Some(size) if size as u64 != axis.extent => self.push(
                        here.clone(),
                        format!(
                            "loop axis {position} of `{name}` is parallelized {pt} with extent \
                             {}, but mesh `{mesh_name}` has {size} devices along {pt}",
                            axis.extent
                        ),
                    ),
                    Some(_) => {}
                }
            }
            if let Some(sw) = domain.swizzle_of(id) {
                if pt != ParallelType::Stream {
                    self.push(
                        here.clone(),
                        format!(
                            "loop axis {position} of `{name}` is swizzled along {sw} but is \
                             parallelized {pt}; swizzle1d needs a Stream-parallel axis"
                        ),
                    );
                }
                match mesh.size_of(sw) {
                    None => self.push(
                        here.clone(),
                        format!(
                            "swizzle1d along {sw} on `{name}` but mesh `{mesh_name}` has {}",
                            axes_word(mesh.ndims())
                        ),
                    ),
                    Some(size) if size as u64 != axis.extent => self.push(
                        here.clone(),
                        format!(
                            "swizzled loop axis {position} of `{name}` has extent {}, but the \
                             team along {sw} has {size} devices",
                            axis.extent
                        ),
                    ),
                    Some(_) => {}
                }
            }
        }
        match Layout::of(&domain, decl.ty.axes.len()) {
            Ok(_)
            | Err(LayoutError::ParallelTypeUsedTwice { .. })
            | Err(LayoutError::SwizzleNotStream { .. }) => {}
            Err(e) => self.push(here, format!("layout of `{name}`: {e}")),
        }
    }

    fn ops(&mut self) {
        let p = self.p;
        let n_tensors = p.tensors.len();
        // The op defining each tensor so far.
        let mut defined_by: HashMap<TensorId, usize> = HashMap::new();
        for (index, op) in p.ops.iter().enumerate() {
            let here = self.op_loc(index, op);
            let text = self.op_text(op);
            let mut handles_ok = true;
            for (what, list) in [("input", &op.inputs), ("output", &op.outputs)] {
                for (k, &t) in list.iter().enumerate() {
                    if !p.tensors.contains(t) {
                        handles_ok = false;
                        self.push(
                            here.clone(),
                            format!(
                                "{what} #{k} of {text} is handle {t:?}, out of range (the \
                                 program has {n_tensors} tensors)"
                            ),
                        );
                    }
                }
            }
            let (n_in, n_out) = op.kind.arity();
            let arity_ok = op.inputs.len() == n_in && op.outputs.len() == n_out;
            if !arity_ok {
                self.push(
                    here.clone(),
                    format!(
                        "`{}` takes {} and produces {}, but {text} has {} and {}",
                        op.kind.name(),
                        count(n_in, "input"),
                        count(n_out, "output"),
                        count(op.inputs.len(), "input"),
                        count(op.outputs.len(), "output")
                    ),
                );
            }
            for &t in &op.inputs {
                let Some(decl) = p.tensors.get(t) else {
                    continue;
                };
                if decl.is_input || defined_by.contains_key(&t) {
                    continue;
                }
                if let Some(later) = p.definition(t) {
                    self.push(
                        here.clone(),
                        format!(
                            "{text} reads `{}` before it is defined (by op #{later})",
                            decl.name
                        ),
                    );
                }
            }
            for &t in &op.outputs {
                let Some(decl) = p.tensors.get(t) else {
                    continue;
                };
                if decl.is_input {
                    self.push(
                        here.clone(),
                        format!(
                            "`{}` is a program input and cannot be defined by an op",
                            decl.name
                        ),
                    );
                } else if let Some(&first) = defined_by.get(&t) {
                    self.push(
                        here.clone(),
                        format!("`{}` is already defined by op #{first}", decl.name),
                    );
                } else {
                    defined_by.insert(t, index);
                }
            }
            if handles_ok {
                self.same_mesh(op, &here);
                if arity_ok {
                    self.types(op, &here, &text);
                    self.moe_pair(op, &here, &defined_by);
                }
            }
        }
        for (id, decl) in p.tensors.iter() {
            if !decl.is_input && !defined_by.contains_key(&id) {
                self.push(
                    self.tensor_loc(id),
                    format!(
                        "tensor `{}` is neither a program input nor defined by an op",
                        decl.name
                    ),
                );
            }
        }
    }

    /// The outputs of an op on one mesh. Inputs may live on other meshes: the op runs on its
    /// outputs' mesh and `decompose_reshardings` inserts the `set`s that move them there.
    fn same_mesh(&mut self, op: &Op, here: &Location) {
        let decls: Vec<&TensorDecl> = op
            .outputs
            .iter()
            .filter_map(|&t| self.p.tensors.get(t))
            .collect();
        let Some(first) = decls.first() else {
            return;
        };
        if let Some(other) = decls.iter().find(|d| d.mesh != first.mesh) {
            let message = format!(
                "`{}` mixes meshes among its outputs: `{}` is on `{}` but `{}` is on `{}` (an \
                 op runs on one mesh)",
                op.kind.name(),
                first.name,
                self.mesh_name(first),
                other.name,
                self.mesh_name(other)
            );
            self.push(here.clone(), message);
        }
    }

    /// Declared output types equal the inferred ones.
    fn types(&mut self, op: &Op, here: &Location, text: &str) {
        let ty = |t: &TensorId| self.p.tensors.get(*t).map(|d| &d.ty);
        let inputs: Option<Vec<&TensorType>> = op.inputs.iter().map(ty).collect();
        let declared: Option<Vec<&TensorType>> = op.outputs.iter().map(ty).collect();
        let (Some(inputs), Some(declared)) = (inputs, declared) else {
            return;
        };
        match infer_output_types(&op.kind, &inputs, &declared) {
            Err(e) => self.push(here.clone(), format!("{text}: {e}")),
            Ok(inferred) => {
                for ((&t, decl), want) in op.outputs.iter().zip(&declared).zip(&inferred) {
                    if *decl != want {
                        let message = format!(
                            "output `{}` is declared {decl} but `{}` produces {want}",
                            self.tensor_name(t),
                            op.kind.name()
                        );
                        self.push(here.clone(), message);
                    }
                }
            }
        }
    }

    /// A `moe_combine` whose routing comes from a `moe_dispatch` weighs each token's rows
    /// with one weight per routed expert: `topk_weights` has `topk_idx`'s shape.
    fn moe_pair(&mut self, op: &Op, here: &Location, defined_by: &HashMap<TensorId, usize>) {
        if op.kind != crate::program::OpKind::MoeCombine {
            return;
        }
        let (Some(&routing), Some(&weights)) = (op.inputs.get(2), op.inputs.get(3)) else {
            return;
        };
        let Some(dispatch) = defined_by.get(&routing).and_then(|&i| self.p.ops.get(i)) else {
            return;
        };
        if !matches!(dispatch.kind, crate::program::OpKind::MoeDispatch { .. }) {
            return;
        }
        let Some(&idx) = dispatch.inputs.get(1) else {
            return;
        };
        let shape = |t: TensorId| self.p.tensors.get(t).map(|d| d.ty.value_shape());
        let (Some(want), Some(got)) = (shape(idx), shape(weights)) else {
            return;
        };
        if want != got {
            let message = format!(
                "`moe_combine`: `{}` must have the shape of `{}` ({want:?}: one weight per token \
                 and routed expert), has {got:?}",
                self.tensor_name(weights),
                self.tensor_name(idx)
            );
            self.push(here.clone(), message);
        }
    }

    fn outputs(&mut self) {
        let mut seen: Vec<TensorId> = Vec::new();
        for (k, &t) in self.p.outputs.iter().enumerate() {
            if !self.p.tensors.contains(t) {
                self.push(
                    Location::Program,
                    format!(
                        "program output #{k} is handle {t:?}, out of range (the program has {} \
                         tensors)",
                        self.p.tensors.len()
                    ),
                );
            } else if seen.contains(&t) {
                self.push(
                    self.tensor_loc(t),
                    format!("output `{}` is listed twice", self.tensor_name(t)),
                );
            } else {
                seen.push(t);
            }
        }
    }
}
