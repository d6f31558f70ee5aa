//! The level-1 parser: `program NAME { ... }`.
//!
//! Statements (one per line by convention; newlines are not significant):
//! `param NAME = EXPR`, `mesh NAME = MESH`, `input|tensor NAME: DTYPE[AXES] on MESH {SCHEDULE}`,
//! `OUT, ... = OP(IN, ..., key=EXPR)` and `output NAME, ...`. Numbers are integer expressions
//! over earlier parameters, evaluated as they are parsed.

use super::cursor::{error_at, Cursor, NameTable};
use super::expr::{eval, param_note, parse_expr, parse_parallel_type, PExpr, ParamValues};
use super::lexer::{Pos, Tok};
use super::mesh::parse_mesh;
use super::moe_wire::{moe_wire, scale_value, wire_value};
use super::{Params, ParseError};
use crate::dtype::DType;
use crate::moe::Fp8Scales;
use crate::program::{
    Axis, CustomOp, Epsilon, MeshDecl, MeshId, Op, OpKind, Program, TensorDecl, TensorId,
    TensorType, Transform,
};
use crate::span::SourceLoc;

struct ProgramParser<'a> {
    cur: Cursor,
    overrides: &'a Params,
    params: ParamValues,
    param_pos: NameTable<()>,
    meshes: NameTable<MeshId>,
    tensors: NameTable<TensorId>,
    program: Program,
}

fn loc(pos: Pos) -> SourceLoc {
    SourceLoc::at(pos.line, pos.col)
}

/// Parses a level-1 program with parameter overrides.
pub(crate) fn parse(text: &str, overrides: &Params) -> Result<Program, ParseError> {
    let mut p = ProgramParser {
        cur: Cursor::new(text),
        overrides,
        params: Vec::new(),
        param_pos: NameTable::new("parameter"),
        meshes: NameTable::new("mesh"),
        tensors: NameTable::new("tensor"),
        program: Program::default(),
    };
    let header = p.cur.expect_word("program")?;
    p.program.name = p.cur.expect_ident("a program name")?.0;
    p.cur.expect_punct("{")?;
    while !p.cur.is_punct("}") {
        p.statement()?;
    }
    p.cur.bump();
    p.cur.expect_eof()?;
    if let Some(unknown) = overrides
        .keys()
        .find(|k| !p.params.iter().any(|(n, _)| n == *k))
    {
        let declared: Vec<&str> = p.params.iter().map(|(n, _)| n.as_str()).collect();
        let list = if declared.is_empty() {
            "it declares no parameters".to_string()
        } else {
            format!("declared: {}", declared.join(", "))
        };
        return Err(error_at(
            header,
            format!(
                "parameter `{}` is not declared in program `{}` ({list})",
                crate::text::clip(unknown),
                p.program.name
            ),
        ));
    }
    Ok(p.program)
}

impl ProgramParser<'_> {
    fn statement(&mut self) -> Result<(), ParseError> {
        let c = &self.cur;
        if c.is_keyword("param") {
            self.param()
        } else if c.is_keyword("mesh") {
            self.mesh()
        } else if c.is_keyword("input") || c.is_keyword("tensor") {
            self.tensor()
        } else if c.is_keyword("output") {
            self.output()
        } else if matches!(c.peek().tok, Tok::Ident(_)) {
            self.op()
        } else {
            Err(c.unexpected(
                "a statement (`param`, `mesh`, `input`, `tensor`, an op or `output`) or `}`",
            ))
        }
    }

    fn param(&mut self) -> Result<(), ParseError> {
        self.cur.bump();
        let (name, pos) = self.cur.expect_ident("a parameter name")?;
        self.param_pos.check_new(&name, pos)?;
        self.cur.expect_punct("=")?;
        let e = parse_expr(&mut self.cur)?;
        let value = match self.overrides.get(&name) {
            Some(&v) => i128::from(v),
            None => eval(&e, &self.params)?,
        };
        self.param_pos.insert(&name, (), pos);
        self.params.push((name, value));
        Ok(())
    }

    fn mesh(&mut self) -> Result<(), ParseError> {
        let start = self.cur.bump().pos;
        let (name, pos) = self.cur.expect_ident("a mesh name")?;
        self.meshes.check_new(&name, pos)?;
        self.cur.expect_punct("=")?;
        let mesh = parse_mesh(&mut self.cur, &name, &self.params)?;
        let id = self.program.meshes.push(MeshDecl {
            name: name.clone(),
            mesh,
            loc: loc(start),
        });
        self.meshes.insert(&name, id, pos);
        Ok(())
    }

    /// Evaluates `e` and checks it is at least `min`; `what` names the number in messages.
    fn number(&self, e: &PExpr, min: i128, what: &str) -> Result<u64, ParseError> {
        let v = eval(e, &self.params)?;
        if v < min {
            let bound = if min == 1 { "positive" } else { "non-negative" };
            return Err(error_at(
                e.start(),
                format!(
                    "{what} must be {bound}, got {v}{}",
                    param_note(e, &self.params)
                ),
            ));
        }
        u64::try_from(v).map_err(|_| {
            error_at(
                e.start(),
                format!("{what} is too large{}", param_note(e, &self.params)),
            )
        })
    }

    fn usize_number(&mut self, what: &str) -> Result<usize, ParseError> {
        let e = parse_expr(&mut self.cur)?;
        let v = self.number(&e, 0, what)?;
        usize::try_from(v).map_err(|_| error_at(e.start(), format!("{what} is too large")))
    }

    fn tensor(&mut self) -> Result<(), ParseError> {
        let start = self.cur.bump();
        let is_input = matches!(&start.tok, Tok::Ident(k) if k == "input");
        let (name, pos) = self.cur.expect_ident("a tensor name")?;
        self.tensors.check_new(&name, pos)?;
        self.cur.expect_punct(":")?;
        let (dtype_name, dtype_pos) = self.cur.expect_ident("a dtype")?;
        let dtype: DType = dtype_name
            .parse()
            .map_err(|e: crate::dtype::UnknownDType| error_at(dtype_pos, e.to_string()))?;
        self.cur.expect_punct("[")?;
        let mut axes = Vec::new();
        if !self.cur.is_punct("]") {
            loop {
                axes.push(self.axis(&name, axes.len())?);
                if !self.cur.eat_punct(",") {
                    break;
                }
            }
        }
        self.cur.expect_punct("]")?;
        self.cur.expect_word("on")?;
        let (mesh, _) = self.meshes.expect(&mut self.cur)?;
        let schedule = if self.cur.is_punct("{") {
            Some(self.schedule()?)
        } else {
            None
        };
        let id = self.program.tensors.push(TensorDecl {
            name: name.clone(),
            ty: TensorType { dtype, axes },
            mesh,
            schedule,
            is_input,
            loc: loc(start.pos),
        });
        self.tensors.insert(&name, id, pos);
        Ok(())
    }

    /// One axis: `EXPR`, `rN` or `r(EXPR)`.
    fn axis(&mut self, tensor: &str, index: usize) -> Result<Axis, ParseError> {
        let what = format!("the extent of axis {index} of `{tensor}`");
        if let Some(word) = self.cur.ident() {
            if word == "r" && self.cur.is_punct_at(1, "(") {
                self.cur.bump();
                self.cur.bump();
                let e = parse_expr(&mut self.cur)?;
                self.cur.expect_punct(")")?;
                return Ok(Axis::reduce(self.number(&e, 1, &what)?));
            }
            if let Some(digits) = word.strip_prefix('r') {
                if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                    let pos = self.cur.pos();
                    let v: u64 = digits
                        .parse()
                        .map_err(|_| error_at(pos, format!("{what} is too large")))?;
                    if v == 0 {
                        return Err(error_at(pos, format!("{what} must be positive, got 0")));
                    }
                    self.cur.bump();
                    return Ok(Axis::reduce(v));
                }
            }
        }
        let e = parse_expr(&mut self.cur)?;
        Ok(Axis::iter(self.number(&e, 1, &what)?))
    }

    fn schedule(&mut self) -> Result<Vec<Transform>, ParseError> {
        self.cur.expect_punct("{")?;
        let mut out = Vec::new();
        if !self.cur.is_punct("}") {
            loop {
                out.push(self.transform()?);
                if !self.cur.eat_punct(",") {
                    break;
                }
            }
        }
        self.cur.expect_punct("}")?;
        Ok(out)
    }

    fn transform(&mut self) -> Result<Transform, ParseError> {
        let (name, pos) = self.cur.expect_ident("a transform")?;
        self.cur.expect_punct("(")?;
        let t = match name.as_str() {
            "outer_split" | "inner_split" => {
                let axis = self.usize_number("a loop axis")?;
                self.cur.expect_punct(",")?;
                let e = parse_expr(&mut self.cur)?;
                let by = self.number(&e, 0, "a split factor")?;
                if name == "outer_split" {
                    Transform::OuterSplit { axis, parts: by }
                } else {
                    Transform::InnerSplit { axis, factor: by }
                }
            }
            "merge" => Transform::Merge {
                axis: self.usize_number("a loop axis")?,
            },
            "reorder" => {
                let mut order = Vec::new();
                if !self.cur.is_punct(")") {
                    loop {
                        order.push(self.usize_number("a loop axis")?);
                        if !self.cur.eat_punct(",") {
                            break;
                        }
                    }
                }
                Transform::Reorder { order }
            }
            "swizzle1d" | "parallelize" => {
                let axis = self.usize_number("a loop axis")?;
                self.cur.expect_punct(",")?;
                let pt = parse_parallel_type(&mut self.cur)?;
                if name == "swizzle1d" {
                    Transform::Swizzle1d { axis, pt }
                } else {
                    Transform::Parallelize { axis, pt }
                }
            }
            _ => {
                return Err(error_at(
                    pos,
                    format!(
                        "unknown transform `{name}` (expected outer_split, inner_split, merge, \
                         reorder, swizzle1d or parallelize)"
                    ),
                ))
            }
        };
        self.cur.expect_punct(")")?;
        Ok(t)
    }

    fn op(&mut self) -> Result<(), ParseError> {
        let start = self.cur.pos();
        let mut outputs = Vec::new();
        loop {
            outputs.push(self.tensors.expect(&mut self.cur)?.0);
            if !self.cur.eat_punct(",") {
                break;
            }
        }
        self.cur.expect_punct("=")?;
        let (name, name_pos) = self.cur.expect_ident("an op name")?;
        // Reject unknown ops at their name, before their arguments.
        op_kind(&name, name_pos, None, name_pos)?;
        self.cur.expect_punct("(")?;
        let mut inputs = Vec::new();
        let mut attrs = OpAttrs::default();
        if !self.cur.is_punct(")") {
            loop {
                if matches!(self.cur.peek().tok, Tok::Ident(_)) && self.cur.is_punct_at(1, "=") {
                    let (key, key_pos) = self.cur.expect_ident("an attribute")?;
                    self.cur.bump();
                    self.attribute(&name, &key, key_pos, &mut attrs)?;
                } else {
                    if attrs.any() {
                        return Err(self.cur.unexpected("`)` (attributes come last)"));
                    }
                    inputs.push(self.tensors.expect(&mut self.cur)?.0);
                }
                if !self.cur.eat_punct(",") {
                    break;
                }
            }
        }
        let close = self.cur.expect_punct(")")?;
        let mut kind = op_kind(&name, name_pos, Some(attrs), close)?;
        match &mut kind {
            OpKind::Custom(c) => {
                c.inputs = inputs.len();
                c.outputs = outputs.len();
            }
            OpKind::Cat { inputs: n, .. } => *n = inputs.len(),
            _ => {}
        }
        self.program.ops.push(Op {
            kind,
            inputs,
            outputs,
            loc: loc(start),
        });
        Ok(())
    }

    /// One `key=value` attribute of op `op` (see [`op_keys`]).
    fn attribute(
        &mut self,
        op: &str,
        key: &str,
        key_pos: Pos,
        attrs: &mut OpAttrs,
    ) -> Result<(), ParseError> {
        let keys = op_keys(op);
        if !keys.contains(&key) {
            let message = if keys.is_empty() {
                format!("`{op}` takes no attribute `{key}`")
            } else {
                let list: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
                format!(
                    "unknown attribute `{key}` of `{op}` (expected {})",
                    list.join(" or ")
                )
            };
            return Err(error_at(key_pos, message));
        }
        let twice = || error_at(key_pos, format!("`{key}` is given twice"));
        match key {
            "axis" => {
                if attrs.axis.is_some() {
                    return Err(twice());
                }
                attrs.axis = Some(self.usize_number("an axis")?);
            }
            "start" | "end" | "index" => {
                let slot = match key {
                    "start" => &mut attrs.start,
                    "end" => &mut attrs.end,
                    _ => &mut attrs.index,
                };
                if slot.is_some() {
                    return Err(twice());
                }
                let e = parse_expr(&mut self.cur)?;
                *slot = Some(self.number(&e, 0, &format!("`{key}`"))?);
            }
            "perm" => {
                if attrs.perm.is_some() {
                    return Err(twice());
                }
                let mut perm = Vec::new();
                self.cur.expect_punct("[")?;
                if !self.cur.is_punct("]") {
                    loop {
                        perm.push(self.usize_number("an axis")?);
                        if !self.cur.eat_punct(",") {
                            break;
                        }
                    }
                }
                self.cur.expect_punct("]")?;
                attrs.perm = Some(perm);
            }
            "eps" => {
                if attrs.eps.is_some() {
                    return Err(twice());
                }
                attrs.eps = Some(self.cur.expect_epsilon()?);
            }
            "wire" => {
                if attrs.wire.is_some() {
                    return Err(twice());
                }
                attrs.wire = Some(wire_value(&mut self.cur)?);
            }
            "scale" => {
                if attrs.scale.is_some() {
                    return Err(twice());
                }
                attrs.scale = Some(scale_value(&mut self.cur)?);
            }
            "kernel" => {
                if attrs.kernel.is_some() {
                    return Err(twice());
                }
                attrs.kernel = Some(self.cur.expect_str("a kernel name string")?.0);
            }
            _ => {
                if attrs.args.is_some() {
                    return Err(twice());
                }
                let mut args = Vec::new();
                self.cur.expect_punct("[")?;
                if !self.cur.is_punct("]") {
                    loop {
                        let e = parse_expr(&mut self.cur)?;
                        let v = eval(&e, &self.params)?;
                        let v = i64::try_from(v).map_err(|_| {
                            error_at(e.start(), "a kernel argument must fit in 64 bits")
                        })?;
                        args.push(v);
                        if !self.cur.eat_punct(",") {
                            break;
                        }
                    }
                }
                self.cur.expect_punct("]")?;
                attrs.args = Some(args);
            }
        }
        Ok(())
    }

    fn output(&mut self) -> Result<(), ParseError> {
        self.cur.bump();
        loop {
            let (t, _) = self.tensors.expect(&mut self.cur)?;
            self.program.outputs.push(t);
            if !self.cur.eat_punct(",") {
                break;
            }
        }
        Ok(())
    }
}

/// The attribute keys op `op` takes.
fn op_keys(op: &str) -> &'static [&'static str] {
    match op {
        "sum" | "max" | "min" | "avg" | "softmax" | "squeeze" | "unsqueeze" | "cat" => &["axis"],
        "permute" => &["perm"],
        "slice" => &["axis", "start", "end"],
        "select" => &["axis", "index"],
        "rms_norm" => &["axis", "eps"],
        "custom" => &["kernel", "args"],
        "moe_dispatch" => &["wire", "scale"],
        _ => &[],
    }
}

/// The attributes written after an op's inputs.
#[derive(Default)]
struct OpAttrs {
    axis: Option<usize>,
    perm: Option<Vec<usize>>,
    start: Option<u64>,
    end: Option<u64>,
    index: Option<u64>,
    eps: Option<Epsilon>,
    kernel: Option<String>,
    args: Option<Vec<i64>>,
    /// `wire=`: `Some(true)` for `f8e4m3`, `Some(false)` for `native`.
    wire: Option<bool>,
    scale: Option<Fp8Scales>,
}

impl OpAttrs {
    fn any(&self) -> bool {
        self.axis.is_some()
            || self.perm.is_some()
            || self.start.is_some()
            || self.end.is_some()
            || self.index.is_some()
            || self.eps.is_some()
            || self.kernel.is_some()
            || self.args.is_some()
            || self.wire.is_some()
            || self.scale.is_some()
    }
}

/// The op called `name` with its attributes; `None` checks the name alone (required
/// attributes are not known yet).
fn op_kind(name: &str, pos: Pos, attrs: Option<OpAttrs>, close: Pos) -> Result<OpKind, ParseError> {
    let early = attrs.is_none();
    let attrs = attrs.unwrap_or_default();
    let need = |v: Option<u64>, key: &str| -> Result<u64, ParseError> {
        match v {
            Some(v) => Ok(v),
            None if early => Ok(0),
            None => Err(error_at(close, format!("`{name}` needs `{key}=`"))),
        }
    };
    let axis = || -> Result<usize, ParseError> {
        match attrs.axis {
            Some(a) => Ok(a),
            None if early => Ok(0),
            None => Err(error_at(close, format!("`{name}` needs `axis=`"))),
        }
    };
    let kind = match name {
        "set" => OpKind::Set,
        "matmul" => OpKind::Matmul,
        "linear" => OpKind::Linear,
        "add" => OpKind::Add,
        "sub" => OpKind::Sub,
        "mul" => OpKind::Mul,
        "gelu" => OpKind::Gelu,
        "silu" => OpKind::Silu,
        "sum" => OpKind::Sum { axis: axis()? },
        "max" => OpKind::Max { axis: axis()? },
        "min" => OpKind::Min { axis: axis()? },
        "avg" => OpKind::Avg { axis: axis()? },
        "cast" => OpKind::Cast,
        "reshape" => OpKind::Reshape,
        "view" => OpKind::View,
        "permute" => match attrs.perm {
            Some(perm) => OpKind::Permute { perm },
            None if early => OpKind::Permute { perm: Vec::new() },
            None => return Err(error_at(close, "`permute` needs `perm=[..]`")),
        },
        "expand" => OpKind::Expand,
        "squeeze" => OpKind::Squeeze { axis: axis()? },
        "unsqueeze" => OpKind::Unsqueeze { axis: axis()? },
        "slice" => OpKind::Slice {
            axis: axis()?,
            start: need(attrs.start, "start")?,
            end: need(attrs.end, "end")?,
        },
        "select" => OpKind::Select {
            axis: axis()?,
            index: need(attrs.index, "index")?,
        },
        "cat" => OpKind::Cat {
            axis: axis()?,
            inputs: 0,
        },
        "softmax" => OpKind::Softmax { axis: axis()? },
        "rms_norm" => OpKind::RmsNorm {
            axis: axis()?,
            eps: attrs.eps.unwrap_or_default(),
        },
        "moe_dispatch" => OpKind::MoeDispatch {
            wire: moe_wire(attrs.wire, attrs.scale, close)?,
        },
        "grouped_matmul" => OpKind::GroupedMatmul,
        "moe_combine" => OpKind::MoeCombine,
        "custom" => match attrs.kernel {
            Some(kernel) => OpKind::Custom(CustomOp {
                kernel,
                args: attrs.args.unwrap_or_default(),
                inputs: 0,
                outputs: 0,
            }),
            None if early => OpKind::Custom(CustomOp {
                kernel: String::new(),
                args: Vec::new(),
                inputs: 0,
                outputs: 0,
            }),
            None => {
                return Err(error_at(
                    close,
                    "`custom` needs `kernel=\"NAME\"` (the registered kernel)",
                ))
            }
        },
        _ => {
            return Err(error_at(
                pos,
                format!(
                    "unknown op `{name}` (expected set, matmul, linear, add, sub, mul, gelu, \
                     silu, sum, max, min, avg, cast, reshape, view, permute, expand, squeeze, \
                     unsqueeze, slice, select, cat, softmax, rms_norm, moe_dispatch, \
                     grouped_matmul, moe_combine or custom)"
                ),
            ))
        }
    };
    Ok(kind)
}
