//! Host instructions written as calls: communications (`cN = kind(in -> out, team=...)`),
//! MoE dispatch and combine, compute ops and `call_kernel`, with their attributes.

use super::cursor::{error_at, Cursor};
use super::expr::parse_parallel_type;
use super::host::{Attrs, HostParser};
use super::lexer::{Pos, Tok};
use super::moe_wire::{moe_wire, scale_value, wire_value};
use super::ParseError;
use crate::host::{CommId, CommKind, ComputeOp, HostTensorId, InstKind, ReduceOp, Team};

impl HostParser {
    /// A comma-separated list of tensor names, possibly empty; stops before `key=`.
    fn tensor_list(&mut self) -> Result<Vec<HostTensorId>, ParseError> {
        let mut out = Vec::new();
        let is_name = |c: &Cursor, n: usize| {
            matches!(c.peek_at(n).tok, Tok::Ident(_)) && !c.is_punct_at(n + 1, "=")
        };
        if !is_name(&self.cur, 0) {
            return Ok(out);
        }
        out.push(self.tensor()?);
        while self.cur.is_punct(",") && is_name(&self.cur, 1) {
            self.cur.bump();
            out.push(self.tensor()?);
        }
        Ok(out)
    }

    /// `(INS -> OUTS` then attributes and `)`; `parse_value` reads the value of each key.
    fn args(
        &mut self,
        inst: &str,
        keys: &[&str],
        parse_value: &mut dyn FnMut(&mut HostParser, &str) -> Result<(), ParseError>,
    ) -> Result<(Vec<HostTensorId>, Vec<HostTensorId>, Attrs), ParseError> {
        self.cur.expect_punct("(")?;
        let ins = self.tensor_list()?;
        self.cur.expect_punct("->")?;
        let outs = self.tensor_list()?;
        let mut items: Vec<(String, Pos)> = Vec::new();
        while self.cur.eat_punct(",") {
            let (key, pos) = self.cur.expect_ident("an attribute name")?;
            if !keys.contains(&key.as_str()) {
                let expected = if keys.is_empty() {
                    "it takes none".to_string()
                } else {
                    format!("expected {}", keys.join(", "))
                };
                return Err(error_at(
                    pos,
                    format!("unknown attribute `{key}` of `{inst}` ({expected})"),
                ));
            }
            if items.iter().any(|(k, _)| *k == key) {
                return Err(error_at(pos, format!("attribute `{key}` is given twice")));
            }
            self.cur.expect_punct("=")?;
            parse_value(self, &key)?;
            items.push((key, pos));
        }
        let close = self.cur.expect_punct(")")?;
        let attrs = Attrs {
            inst: inst.to_string(),
            close,
        };
        Ok((ins, outs, attrs))
    }

    fn exactly(
        &self,
        list: Vec<HostTensorId>,
        n: usize,
        what: &str,
        inst: &str,
        at: Pos,
    ) -> Result<Vec<HostTensorId>, ParseError> {
        if list.len() == n {
            Ok(list)
        } else {
            Err(error_at(
                at,
                format!("`{inst}` takes {n} {what}, {} given", list.len()),
            ))
        }
    }

    fn team(&mut self) -> Result<Team, ParseError> {
        let (kind, pos) = self
            .cur
            .expect_ident("a team (`slice`, `flattened`, `mesh` or `devices`)")?;
        self.cur.expect_punct("(")?;
        let team = match kind.as_str() {
            "slice" => {
                let (mesh, _) = self.meshes.expect(&mut self.cur)?;
                self.cur.expect_punct(",")?;
                let pt = parse_parallel_type(&mut self.cur)?;
                Team::Slice { mesh, pt }
            }
            "flattened" => {
                let (mesh, _) = self.meshes.expect(&mut self.cur)?;
                let mut pts = Vec::new();
                while self.cur.eat_punct(",") {
                    pts.push(parse_parallel_type(&mut self.cur)?);
                }
                Team::Flattened { mesh, pts }
            }
            "mesh" => Team::Mesh(self.meshes.expect(&mut self.cur)?.0),
            "devices" => {
                let mut devices = Vec::new();
                if !self.cur.is_punct(")") {
                    loop {
                        devices.push(self.cur.expect_usize("a device id")?.0);
                        if !self.cur.eat_punct(",") {
                            break;
                        }
                    }
                }
                Team::Devices(devices)
            }
            _ => {
                return Err(error_at(
                    pos,
                    format!("unknown team `{kind}` (expected slice, flattened, mesh or devices)"),
                ))
            }
        };
        self.cur.expect_punct(")")?;
        Ok(team)
    }

    pub(super) fn communication(
        &mut self,
        id: CommId,
        kind: CommKind,
    ) -> Result<InstKind, ParseError> {
        let (mut team, mut root, mut op) = (None, None, None);
        let pos = self.cur.pos();
        let (ins, outs, attrs) =
            self.args(kind.name(), &["team", "root", "op"], &mut |p, key| {
                match key {
                    "team" => team = Some(p.team()?),
                    "root" => root = Some(p.expr()?),
                    _ => op = Some(p.reduce_op()?),
                }
                Ok(())
            })?;
        let input = self.exactly(ins, 1, "input", kind.name(), pos)?;
        let output = self.exactly(outs, 1, "output", kind.name(), pos)?;
        Ok(InstKind::Communication {
            id,
            kind,
            team: team.ok_or_else(|| attrs.missing("team"))?,
            input: input[0],
            output: output[0],
            root,
            op,
        })
    }

    fn reduce_op(&mut self) -> Result<ReduceOp, ParseError> {
        let (name, pos) = self
            .cur
            .expect_ident("a reduction (`sum`, `max`, `min` or `avg`)")?;
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg]
            .into_iter()
            .find(|r| r.name() == name)
            .ok_or_else(|| {
                error_at(
                    pos,
                    format!("unknown reduction `{name}` (expected sum, max, min or avg)"),
                )
            })
    }

    pub(super) fn collective_permute(&mut self, id: CommId) -> Result<InstKind, ParseError> {
        let (mut team, mut send, mut recv) = (None, None, None);
        let pos = self.cur.pos();
        let inst = "collective_permute";
        let (ins, outs, attrs) = self.args(inst, &["team", "send", "recv"], &mut |p, key| {
            match key {
                "team" => team = Some(p.team()?),
                "send" => send = Some(p.expr()?),
                _ => recv = Some(p.expr()?),
            }
            Ok(())
        })?;
        let input = self.exactly(ins, 1, "input", inst, pos)?;
        let output = self.exactly(outs, 1, "output", inst, pos)?;
        Ok(InstKind::CollectivePermute {
            id,
            team: team.ok_or_else(|| attrs.missing("team"))?,
            send_peer: send.ok_or_else(|| attrs.missing("send"))?,
            recv_peer: recv.ok_or_else(|| attrs.missing("recv"))?,
            input: input[0],
            output: output[0],
        })
    }

    pub(super) fn moe(&mut self, id: CommId, dispatch: bool) -> Result<InstKind, ParseError> {
        let inst = if dispatch {
            "moe_dispatch"
        } else {
            "moe_combine"
        };
        let mut team = None;
        let (mut fp8, mut scale) = (None, None);
        let pos = self.cur.pos();
        let keys: &[&str] = if dispatch {
            &["team", "wire", "scale"]
        } else {
            &["team"]
        };
        let (ins, outs, attrs) = self.args(inst, keys, &mut |p, key| {
            match key {
                "wire" => fp8 = Some(wire_value(&mut p.cur)?),
                "scale" => scale = Some(scale_value(&mut p.cur)?),
                _ => team = Some(p.team()?),
            }
            Ok(())
        })?;
        let team = team.ok_or_else(|| attrs.missing("team"))?;
        Ok(if dispatch {
            let wire = moe_wire(fp8, scale, attrs.close)?;
            let i = self.exactly(ins, 2, "inputs", inst, pos)?;
            let o = self.exactly(outs, 3, "outputs", inst, pos)?;
            InstKind::MoeDispatch {
                id,
                team,
                x: i[0],
                topk_idx: i[1],
                expert_x: o[0],
                expert_counts: o[1],
                routing: o[2],
                wire,
            }
        } else {
            let i = self.exactly(ins, 4, "inputs", inst, pos)?;
            let o = self.exactly(outs, 1, "output", inst, pos)?;
            InstKind::MoeCombine {
                id,
                team,
                expert_y: i[0],
                expert_counts: i[1],
                routing: i[2],
                topk_weights: i[3],
                out: o[0],
            }
        })
    }

    /// `op(INS -> OUTS, ...)` and `call_kernel(...)` (also read under its earlier spelling
    /// `launch_kernel`).
    pub(super) fn call(&mut self) -> Result<InstKind, ParseError> {
        let (name, name_pos) = self.cur.expect_ident("an instruction")?;
        if name == "call_kernel" || name == "launch_kernel" {
            let (mut kernel, mut args) = (None, Vec::new());
            let (inputs, outputs, attrs) =
                self.args(&name, &["kernel", "args"], &mut |p, key| {
                    if key == "kernel" {
                        kernel = Some(p.cur.expect_str("a kernel name string")?.0);
                    } else {
                        p.cur.expect_punct("[")?;
                        if !p.cur.is_punct("]") {
                            loop {
                                args.push(p.expr()?);
                                if !p.cur.eat_punct(",") {
                                    break;
                                }
                            }
                        }
                        p.cur.expect_punct("]")?;
                    }
                    Ok(())
                })?;
            return Ok(InstKind::CallKernel {
                kernel: kernel.ok_or_else(|| attrs.missing("kernel"))?,
                inputs,
                outputs,
                args,
            });
        }
        let simple = [
            ComputeOp::Copy,
            ComputeOp::Matmul,
            ComputeOp::Linear,
            ComputeOp::LinearAccumulate,
            ComputeOp::Add,
            ComputeOp::Sub,
            ComputeOp::Mul,
            ComputeOp::Gelu,
            ComputeOp::Silu,
            ComputeOp::Cast,
            ComputeOp::GroupedMatmul,
            ComputeOp::Expand,
        ];
        let keys: &[&str] = match name.as_str() {
            "sum" | "max" | "min" | "avg" | "softmax" | "cat" => &["axis"],
            "permute" => &["perm"],
            "slice" => &["axis", "start"],
            "rms_norm" => &["axis", "eps"],
            _ if simple.iter().any(|o| o.name() == name) => &[],
            _ => {
                return Err(error_at(
                    name_pos,
                    format!(
                        "unknown instruction `{name}` (expected a compute op such as `linear`, \
                         or `call_kernel`)"
                    ),
                ))
            }
        };
        let (mut axis, mut perm, mut start, mut eps) = (None, None, None, None);
        let (inputs, outputs, attrs) = self.args(&name, keys, &mut |p, key| {
            match key {
                "axis" => axis = Some(p.cur.expect_usize("an axis")?.0),
                "start" => start = Some(p.cur.expect_int("a start index")?.0),
                "eps" => {
                    eps = Some(p.cur.expect_epsilon()?);
                }
                _ => {
                    let mut list = Vec::new();
                    p.cur.expect_punct("[")?;
                    if !p.cur.is_punct("]") {
                        loop {
                            list.push(p.cur.expect_usize("an axis")?.0);
                            if !p.cur.eat_punct(",") {
                                break;
                            }
                        }
                    }
                    p.cur.expect_punct("]")?;
                    perm = Some(list);
                }
            }
            Ok(())
        })?;
        let axis = || axis.ok_or_else(|| attrs.missing("axis"));
        let op = match name.as_str() {
            "sum" => ComputeOp::Sum { axis: axis()? },
            "max" => ComputeOp::Max { axis: axis()? },
            "min" => ComputeOp::Min { axis: axis()? },
            "avg" => ComputeOp::Avg { axis: axis()? },
            "softmax" => ComputeOp::Softmax { axis: axis()? },
            "cat" => ComputeOp::Cat {
                axis: axis()?,
                inputs: inputs.len(),
            },
            "slice" => ComputeOp::Slice {
                axis: axis()?,
                start: start.ok_or_else(|| attrs.missing("start"))?,
            },
            "rms_norm" => ComputeOp::RmsNorm {
                axis: axis()?,
                eps: eps.unwrap_or_default(),
            },
            "permute" => ComputeOp::Permute {
                perm: perm.ok_or_else(|| attrs.missing("perm"))?,
            },
            _ => simple
                .into_iter()
                .find(|o| o.name() == name)
                .ok_or_else(|| error_at(name_pos, format!("unknown instruction `{name}`")))?,
        };
        Ok(InstKind::Compute {
            op,
            inputs,
            outputs,
        })
    }
}
