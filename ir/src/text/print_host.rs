//! Printing host programs in the canonical text format.

use std::fmt::{self, Write as _};

use crate::host::{Block, Expr, HostProgram, HostTensorId, InstKind, Role, StreamRef, Team};
use crate::moe::MoeWire;
use crate::program::MeshId;

struct Printer<'a> {
    program: &'a HostProgram,
}

impl Printer<'_> {
    fn mesh(&self, m: MeshId) -> String {
        self.program
            .meshes
            .get(m)
            .map_or_else(|| format!("{m:?}"), |d| d.name.clone())
    }

    fn tensor(&self, t: HostTensorId) -> String {
        self.program
            .tensors
            .get(t)
            .map_or_else(|| format!("{t:?}"), |d| d.name.clone())
    }

    fn expr(&self, e: &Expr) -> String {
        let name = |m: MeshId| self.mesh(m);
        e.display(&name).to_string()
    }

    fn tensors(&self, ts: &[HostTensorId]) -> String {
        ts.iter()
            .map(|&t| self.tensor(t))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn team(&self, team: &Team) -> String {
        match team {
            Team::Slice { mesh, pt } => format!("slice({}, {pt})", self.mesh(*mesh)),
            Team::Flattened { mesh, pts } => {
                let pts: String = pts.iter().map(|p| format!(", {p}")).collect();
                format!("flattened({}{pts})", self.mesh(*mesh))
            }
            Team::Mesh(mesh) => format!("mesh({})", self.mesh(*mesh)),
            Team::Devices(devices) => format!(
                "devices({})",
                devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    fn stream(&self, s: &StreamRef) -> String {
        match s {
            StreamRef::Var(v) => v.to_string(),
            StreamRef::Worker(e) => format!("worker({})", self.expr(e)),
        }
    }

    fn block(&self, f: &mut dyn fmt::Write, block: &Block, indent: usize) -> fmt::Result {
        for inst in block {
            let pad = "  ".repeat(indent);
            f.write_str(&pad)?;
            match &inst.kind {
                InstKind::Allocate { tensor } => writeln!(f, "allocate {}", self.tensor(*tensor))?,
                InstKind::Deallocate { tensor } => {
                    writeln!(f, "deallocate {}", self.tensor(*tensor))?
                }
                InstKind::ForLoop {
                    index,
                    start,
                    stop,
                    body,
                } => {
                    writeln!(
                        f,
                        "for {index} in {}..{} {{",
                        self.expr(start),
                        self.expr(stop)
                    )?;
                    self.block(f, body, indent + 1)?;
                    writeln!(f, "{pad}}}")?;
                }
                InstKind::GetCurrentStream { dst } => writeln!(f, "{dst} = get_current_stream")?,
                InstKind::SetCurrentStream { stream } => {
                    writeln!(f, "set_current_stream {}", self.stream(stream))?
                }
                InstKind::Synchronize { stream } => {
                    writeln!(f, "synchronize {}", self.stream(stream))?
                }
                InstKind::ShardByStream {
                    out,
                    input,
                    axis,
                    chunks,
                    index,
                } => writeln!(
                    f,
                    "{} = shard_by_stream({}, axis={axis}, chunks={chunks}, index={})",
                    self.tensor(*out),
                    self.tensor(*input),
                    self.expr(index)
                )?,
                InstKind::Narrow {
                    out,
                    input,
                    axis,
                    start,
                    length,
                } => writeln!(
                    f,
                    "{} = narrow({}, axis={axis}, start={}, length={})",
                    self.tensor(*out),
                    self.tensor(*input),
                    self.expr(start),
                    self.expr(length)
                )?,
                InstKind::Communication {
                    id,
                    kind,
                    team,
                    input,
                    output,
                    root,
                    op,
                } => {
                    write!(
                        f,
                        "{id} = {}({} -> {}, team={}",
                        kind.name(),
                        self.tensor(*input),
                        self.tensor(*output),
                        self.team(team)
                    )?;
                    if let Some(root) = root {
                        write!(f, ", root={}", self.expr(root))?;
                    }
                    if let Some(op) = op {
                        write!(f, ", op={}", op.name())?;
                    }
                    f.write_str(")\n")?;
                }
                InstKind::CollectivePermute {
                    id,
                    team,
                    send_peer,
                    recv_peer,
                    input,
                    output,
                } => writeln!(
                    f,
                    "{id} = collective_permute({} -> {}, team={}, send={}, recv={})",
                    self.tensor(*input),
                    self.tensor(*output),
                    self.team(team),
                    self.expr(send_peer),
                    self.expr(recv_peer)
                )?,
                InstKind::Wait { comm } => writeln!(f, "wait {comm}")?,
                InstKind::StartCoalescing => writeln!(f, "start_coalescing")?,
                InstKind::EndCoalescing { id } => writeln!(f, "{id} = end_coalescing")?,
                InstKind::MoeDispatch {
                    id,
                    team,
                    x,
                    topk_idx,
                    expert_x,
                    expert_counts,
                    routing,
                    wire,
                } => {
                    write!(
                        f,
                        "{id} = moe_dispatch({} -> {}, team={}",
                        self.tensors(&[*x, *topk_idx]),
                        self.tensors(&[*expert_x, *expert_counts, *routing]),
                        self.team(team)
                    )?;
                    if *wire != MoeWire::Native {
                        write!(f, ", {wire}")?;
                    }
                    writeln!(f, ")")?
                }
                InstKind::MoeCombine {
                    id,
                    team,
                    expert_y,
                    expert_counts,
                    routing,
                    topk_weights,
                    out,
                } => writeln!(
                    f,
                    "{id} = moe_combine({} -> {}, team={})",
                    self.tensors(&[*expert_y, *expert_counts, *routing, *topk_weights]),
                    self.tensor(*out),
                    self.team(team)
                )?,
                InstKind::Compute {
                    op,
                    inputs,
                    outputs,
                } => {
                    write!(
                        f,
                        "{}({} -> {}",
                        op.name(),
                        self.tensors(inputs),
                        self.tensors(outputs)
                    )?;
                    let attrs = op.attributes();
                    if !attrs.is_empty() {
                        write!(f, ", {attrs}")?;
                    }
                    f.write_str(")\n")?;
                }
                InstKind::CallKernel {
                    kernel,
                    inputs,
                    outputs,
                    args,
                } => {
                    write!(
                        f,
                        "call_kernel({} -> {}, kernel=\"{}\"",
                        self.tensors(inputs),
                        self.tensors(outputs),
                        kernel.escape_default()
                    )?;
                    if !args.is_empty() {
                        let args: Vec<String> = args.iter().map(|a| self.expr(a)).collect();
                        write!(f, ", args=[{}]", args.join(", "))?;
                    }
                    f.write_str(")\n")?;
                }
            }
        }
        Ok(())
    }
}

/// Writes `program` in canonical text (what [`HostProgram`]'s `Display` prints).
pub fn write_host(f: &mut dyn fmt::Write, program: &HostProgram) -> fmt::Result {
    let p = Printer { program };
    writeln!(f, "host {} {{", program.name)?;
    for decl in program.meshes.values() {
        writeln!(f, "  mesh {} = {}", decl.name, decl.mesh)?;
    }
    for t in program.tensors.values() {
        let keyword = match t.role {
            Role::Input => "in",
            Role::Output => "out",
            Role::Internal => "tensor",
        };
        let shape: Vec<String> = t.shape.iter().map(|e| e.to_string()).collect();
        writeln!(
            f,
            "  {keyword} {}: {}[{}] on {}",
            t.name,
            t.dtype,
            shape.join(", "),
            p.mesh(t.mesh)
        )?;
    }
    p.block(f, &program.body, 1)?;
    f.write_str("}\n")
}

impl fmt::Display for HostProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_host(f, self)
    }
}

/// Prints one instruction on one line (loop bodies elided as `{ ... }`), for messages.
pub fn inst_to_string(program: &HostProgram, inst: &crate::host::Inst) -> String {
    let p = Printer { program };
    let mut s = String::new();
    let one = match &inst.kind {
        InstKind::ForLoop {
            index, start, stop, ..
        } => {
            let _ = write!(
                s,
                "for {index} in {}..{} {{ ... }}",
                p.expr(start),
                p.expr(stop)
            );
            return s;
        }
        _ => vec![inst.clone()],
    };
    let _ = p.block(&mut s, &one, 0);
    s.trim_end().to_string()
}
