//! Printing level-1 programs in the canonical text format.

use std::fmt;

use crate::program::{MeshId, Program, TensorId};

/// Writes `program` in canonical text (what [`Program`]'s `Display` prints).
pub fn write_program(f: &mut dyn fmt::Write, program: &Program) -> fmt::Result {
    writeln!(f, "program {} {{", program.name)?;
    let mesh_name = |m: MeshId| {
        program
            .meshes
            .get(m)
            .map_or_else(|| format!("{m:?}"), |d| d.name.clone())
    };
    let tensor_name = |t: TensorId| {
        program
            .tensors
            .get(t)
            .map_or_else(|| format!("{t:?}"), |d| d.name.clone())
    };
    for decl in program.meshes.values() {
        writeln!(f, "  mesh {} = {}", decl.name, decl.mesh)?;
    }
    for decl in program.tensors.values() {
        let keyword = if decl.is_input { "input" } else { "tensor" };
        write!(
            f,
            "  {keyword} {}: {} on {}",
            decl.name,
            decl.ty,
            mesh_name(decl.mesh)
        )?;
        if let Some(schedule) = &decl.schedule {
            f.write_str(" {")?;
            for (i, t) in schedule.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{t}")?;
            }
            f.write_str("}")?;
        }
        f.write_char('\n')?;
    }
    for op in &program.ops {
        f.write_str("  ")?;
        for (i, &o) in op.outputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(&tensor_name(o))?;
        }
        write!(f, " = {}(", op.kind.name())?;
        for (i, &t) in op.inputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(&tensor_name(t))?;
        }
        let attrs = op.kind.attributes();
        if !attrs.is_empty() {
            if !op.inputs.is_empty() {
                f.write_str(", ")?;
            }
            f.write_str(&attrs)?;
        }
        f.write_str(")\n")?;
    }
    if !program.outputs.is_empty() {
        f.write_str("  output ")?;
        for (i, &o) in program.outputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(&tensor_name(o))?;
        }
        f.write_char('\n')?;
    }
    f.write_str("}\n")
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_program(f, self)
    }
}
