//! The host parser: `host NAME { ... }`.
//!
//! Declarations (`mesh`, `in`, `out`, `tensor`) may appear anywhere at the top level before
//! the names they declare are used; instructions follow the syntax `print_host.rs` prints.
//! Loop, stream and communication variables (`iN`, `sN`, `cN`) are not checked here: the
//! verifier reports them with their context.

use super::cursor::{error_at, Cursor, NameTable, MAX_DEPTH};
use super::expr::{parse_expr, to_host_expr};
use super::lexer::{Pos, Tok};
use super::mesh::parse_mesh;
use super::ParseError;
use crate::dtype::DType;
use crate::host::{
    Block, CommId, CommKind, Expr, HostProgram, HostTensor, HostTensorId, Inst, InstKind, LoopVar,
    Role, StreamRef, StreamVar,
};
use crate::program::{MeshDecl, MeshId};
use crate::span::SourceLoc;

pub(super) struct HostParser {
    pub cur: Cursor,
    pub meshes: NameTable<MeshId>,
    pub tensors: NameTable<HostTensorId>,
    pub program: HostProgram,
}

fn loc(pos: Pos) -> SourceLoc {
    SourceLoc::at(pos.line, pos.col)
}

/// Parses a host program.
pub(crate) fn parse(text: &str) -> Result<HostProgram, ParseError> {
    let mut p = HostParser {
        cur: Cursor::new(text),
        meshes: NameTable::new("mesh"),
        tensors: NameTable::new("tensor"),
        program: HostProgram::default(),
    };
    p.cur.expect_word("host")?;
    p.program.name = p.cur.expect_ident("a program name")?.0;
    p.cur.expect_punct("{")?;
    p.program.body = p.block(0)?;
    p.cur.expect_eof()?;
    Ok(p.program)
}

/// Attributes `key=value` after the tensor lists of an instruction, in any order.
pub(super) struct Attrs {
    pub inst: String,
    pub close: Pos,
}

impl Attrs {
    pub fn missing(&self, key: &str) -> ParseError {
        error_at(self.close, format!("`{}` needs `{key}=`", self.inst))
    }
}

impl HostParser {
    /// Parses statements until the closing `}` (consumed).
    fn block(&mut self, depth: usize) -> Result<Block, ParseError> {
        let mut block = Vec::new();
        loop {
            if self.cur.eat_punct("}") {
                return Ok(block);
            }
            let c = &self.cur;
            let is_decl = ["mesh", "in", "out", "tensor"]
                .iter()
                .any(|k| c.is_keyword(k));
            if is_decl {
                if depth > 0 {
                    return Err(error_at(
                        c.pos(),
                        "declarations are only allowed at the top level, not inside a loop",
                    ));
                }
                self.declaration()?;
            } else {
                let inst = self.instruction(depth)?;
                block.push(inst);
            }
        }
    }

    fn declaration(&mut self) -> Result<(), ParseError> {
        let start = self.cur.bump();
        let keyword = match &start.tok {
            Tok::Ident(k) => k.clone(),
            _ => String::new(),
        };
        if keyword == "mesh" {
            let (name, pos) = self.cur.expect_ident("a mesh name")?;
            self.meshes.check_new(&name, pos)?;
            self.cur.expect_punct("=")?;
            let mesh = parse_mesh(&mut self.cur, &name, &Vec::new())?;
            let id = self.program.meshes.push(MeshDecl {
                name: name.clone(),
                mesh,
                loc: loc(start.pos),
            });
            self.meshes.insert(&name, id, pos);
            return Ok(());
        }
        let role = match keyword.as_str() {
            "in" => Role::Input,
            "out" => Role::Output,
            _ => Role::Internal,
        };
        let (name, pos) = self.cur.expect_ident("a tensor name")?;
        self.tensors.check_new(&name, pos)?;
        self.cur.expect_punct(":")?;
        let (dtype_name, dtype_pos) = self.cur.expect_ident("a dtype")?;
        let dtype: DType = dtype_name
            .parse()
            .map_err(|e: crate::dtype::UnknownDType| error_at(dtype_pos, e.to_string()))?;
        self.cur.expect_punct("[")?;
        let mut shape = Vec::new();
        if !self.cur.is_punct("]") {
            loop {
                shape.push(self.cur.expect_int("an extent")?.0);
                if !self.cur.eat_punct(",") {
                    break;
                }
            }
        }
        self.cur.expect_punct("]")?;
        self.cur.expect_word("on")?;
        let (mesh, _) = self.meshes.expect(&mut self.cur)?;
        let id = self.program.tensors.push(HostTensor {
            name: name.clone(),
            dtype,
            shape,
            mesh,
            role,
            loc: loc(start.pos),
        });
        self.tensors.insert(&name, id, pos);
        Ok(())
    }

    pub fn expr(&mut self) -> Result<Expr, ParseError> {
        let e = parse_expr(&mut self.cur)?;
        to_host_expr(&e, &self.meshes)
    }

    pub fn tensor(&mut self) -> Result<HostTensorId, ParseError> {
        Ok(self.tensors.expect(&mut self.cur)?.0)
    }

    fn instruction(&mut self, depth: usize) -> Result<Inst, ParseError> {
        let start = self.cur.pos();
        let c = &self.cur;
        let kind = if c.is_keyword("allocate") {
            self.cur.bump();
            InstKind::Allocate {
                tensor: self.tensor()?,
            }
        } else if c.is_keyword("deallocate") {
            self.cur.bump();
            InstKind::Deallocate {
                tensor: self.tensor()?,
            }
        } else if c.is_keyword("for") {
            self.for_loop(depth)?
        } else if c.is_keyword("set_current_stream") {
            self.cur.bump();
            InstKind::SetCurrentStream {
                stream: self.stream()?,
            }
        } else if c.is_keyword("synchronize") {
            self.cur.bump();
            InstKind::Synchronize {
                stream: self.stream()?,
            }
        } else if c.is_keyword("wait") {
            self.cur.bump();
            let (n, _) = self
                .cur
                .expect_numbered('c', "a communication label such as `c0`")?;
            InstKind::Wait { comm: CommId(n) }
        } else if c.is_keyword("start_coalescing") {
            self.cur.bump();
            InstKind::StartCoalescing
        } else if matches!(c.peek().tok, Tok::Ident(_)) && c.is_punct_at(1, "=") {
            self.assignment()?
        } else if matches!(c.peek().tok, Tok::Ident(_)) && c.is_punct_at(1, "(") {
            self.call()?
        } else {
            return Err(c.unexpected("an instruction or `}`"));
        };
        Ok(Inst {
            kind,
            loc: loc(start),
        })
    }

    fn for_loop(&mut self, depth: usize) -> Result<InstKind, ParseError> {
        let pos = self.cur.bump().pos;
        if depth + 1 >= MAX_DEPTH {
            return Err(error_at(
                pos,
                format!("loops are nested too deeply (more than {MAX_DEPTH} levels)"),
            ));
        }
        let (n, _) = self
            .cur
            .expect_numbered('i', "a loop variable such as `i0`")?;
        self.cur.expect_word("in")?;
        let start = self.expr()?;
        self.cur.expect_punct("..")?;
        let stop = self.expr()?;
        self.cur.expect_punct("{")?;
        let body = self.block(depth + 1)?;
        Ok(InstKind::ForLoop {
            index: LoopVar(n),
            start,
            stop,
            body,
        })
    }

    fn stream(&mut self) -> Result<StreamRef, ParseError> {
        if self.cur.is_word("worker") && self.cur.is_punct_at(1, "(") {
            self.cur.bump();
            self.cur.bump();
            let e = self.expr()?;
            self.cur.expect_punct(")")?;
            return Ok(StreamRef::Worker(e));
        }
        let (n, _) = self
            .cur
            .expect_numbered('s', "a stream (`sN` or `worker(...)`)")?;
        Ok(StreamRef::Var(StreamVar(n)))
    }

    /// `X = ...`: streams, views, communications and group ends.
    fn assignment(&mut self) -> Result<InstKind, ParseError> {
        let lhs = self.cur.peek().clone();
        let lhs_name = match &lhs.tok {
            Tok::Ident(s) => s.clone(),
            _ => String::new(),
        };
        self.cur.bump();
        self.cur.bump();
        let (rhs, rhs_pos) = self.cur.expect_ident("an instruction")?;
        let comm_id = |what: &str| -> Result<CommId, ParseError> {
            match super::cursor::numbered(&lhs_name, 'c') {
                Some(Ok(n)) => Ok(CommId(n)),
                _ => Err(error_at(
                    lhs.pos,
                    format!(
                        "`{what}` defines a communication label such as `c0`, not `{lhs_name}`"
                    ),
                )),
            }
        };
        match rhs.as_str() {
            "get_current_stream" => match super::cursor::numbered(&lhs_name, 's') {
                Some(Ok(n)) => Ok(InstKind::GetCurrentStream { dst: StreamVar(n) }),
                _ => Err(error_at(
                    lhs.pos,
                    format!(
                        "`get_current_stream` defines a stream variable such as `s0`, not \
                         `{lhs_name}`"
                    ),
                )),
            },
            "end_coalescing" => Ok(InstKind::EndCoalescing {
                id: comm_id("end_coalescing")?,
            }),
            "shard_by_stream" => {
                let out = self.tensors.get(&lhs_name, lhs.pos)?;
                self.shard_by_stream(out)
            }
            "narrow" => {
                let out = self.tensors.get(&lhs_name, lhs.pos)?;
                self.narrow(out)
            }
            "collective_permute" => {
                let id = comm_id(&rhs)?;
                self.collective_permute(id)
            }
            "moe_dispatch" | "moe_combine" => {
                let id = comm_id(&rhs)?;
                self.moe(id, rhs == "moe_dispatch")
            }
            _ => match CommKind::ALL.into_iter().find(|k| k.name() == rhs) {
                Some(kind) => {
                    let id = comm_id(&rhs)?;
                    self.communication(id, kind)
                }
                None => Err(error_at(
                    rhs_pos,
                    format!(
                        "unknown instruction `{rhs}` (expected get_current_stream, \
                         end_coalescing, shard_by_stream, narrow, a collective, \
                         collective_permute, moe_dispatch or moe_combine)"
                    ),
                )),
            },
        }
    }

    fn shard_by_stream(&mut self, out: HostTensorId) -> Result<InstKind, ParseError> {
        self.cur.expect_punct("(")?;
        let input = self.tensor()?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("axis")?;
        self.cur.expect_punct("=")?;
        let (axis, _) = self.cur.expect_usize("an axis")?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("chunks")?;
        self.cur.expect_punct("=")?;
        let (chunks, _) = self.cur.expect_int("a chunk count")?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("index")?;
        self.cur.expect_punct("=")?;
        let index = self.expr()?;
        self.cur.expect_punct(")")?;
        Ok(InstKind::ShardByStream {
            out,
            input,
            axis,
            chunks,
            index,
        })
    }

    fn narrow(&mut self, out: HostTensorId) -> Result<InstKind, ParseError> {
        self.cur.expect_punct("(")?;
        let input = self.tensor()?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("axis")?;
        self.cur.expect_punct("=")?;
        let (axis, _) = self.cur.expect_usize("an axis")?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("start")?;
        self.cur.expect_punct("=")?;
        let start = self.expr()?;
        self.cur.expect_punct(",")?;
        self.cur.expect_word("length")?;
        self.cur.expect_punct("=")?;
        let length = self.expr()?;
        self.cur.expect_punct(")")?;
        Ok(InstKind::Narrow {
            out,
            input,
            axis,
            start,
            length,
        })
    }
}
