//! Helpers to build host programs for the cross-rank check tests.

use meshflow::ir::host::{CommId, ComputeOp, Expr, HostProgram, Inst, InstKind, LoopVar, Team};
use meshflow::ir::{
    CommKind, DType, DeviceId, DeviceMesh, HostTensorId, MeshId, ParallelType, ReduceOp, Role,
};

/// `my(mesh, DIDx)`.
pub fn my(mesh: MeshId) -> Expr {
    Expr::my(mesh, ParallelType::DIDx)
}

/// `my(mesh, pt)`.
pub fn my_pt(mesh: MeshId, pt: ParallelType) -> Expr {
    Expr::my(mesh, pt)
}

/// A constant.
pub fn c(v: i64) -> Expr {
    Expr::c(v)
}

/// Loop variable `i{n}`.
pub fn i(n: u32) -> Expr {
    Expr::var(LoopVar(n))
}

/// `slice(mesh, DIDx)`.
pub fn slice(mesh: MeshId) -> Team {
    Team::Slice {
        mesh,
        pt: ParallelType::DIDx,
    }
}

/// A host program under construction.
pub struct Builder {
    pub p: HostProgram,
}

impl Builder {
    pub fn new(name: &str) -> Builder {
        Builder {
            p: HostProgram::new(name),
        }
    }

    /// A 1-D mesh of `devices`.
    pub fn mesh(&mut self, name: &str, devices: Vec<DeviceId>) -> MeshId {
        let mesh = DeviceMesh::new(vec![devices.len()], devices).expect("valid test mesh");
        self.p.add_mesh(name, mesh)
    }

    /// An N-d mesh of devices `0..`.
    pub fn mesh_nd(&mut self, name: &str, shape: Vec<usize>) -> MeshId {
        let mesh = DeviceMesh::iota(shape, 0).expect("valid test mesh");
        self.p.add_mesh(name, mesh)
    }

    pub fn tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: Vec<u64>,
        mesh: MeshId,
    ) -> HostTensorId {
        self.p.add_tensor(name, dtype, shape, mesh, Role::Internal)
    }

    pub fn push(&mut self, inst: Inst) {
        self.p.body.push(inst);
    }

    pub fn finish(self) -> HostProgram {
        self.p
    }
}

pub fn comm(
    id: u32,
    kind: CommKind,
    team: Team,
    input: HostTensorId,
    output: HostTensorId,
    root: Option<Expr>,
) -> Inst {
    let op = kind.is_reduction().then_some(ReduceOp::Sum);
    Inst::new(InstKind::Communication {
        id: CommId(id),
        kind,
        team,
        input,
        output,
        root,
        op,
    })
}

pub fn permute(
    id: u32,
    team: Team,
    send: Expr,
    recv: Expr,
    input: HostTensorId,
    output: HostTensorId,
) -> Inst {
    Inst::new(InstKind::CollectivePermute {
        id: CommId(id),
        team,
        send_peer: send,
        recv_peer: recv,
        input,
        output,
    })
}

pub fn for_loop(var: u32, start: Expr, stop: Expr, body: Vec<Inst>) -> Inst {
    Inst::new(InstKind::ForLoop {
        index: LoopVar(var),
        start,
        stop,
        body,
    })
}

pub fn wait(id: u32) -> Inst {
    Inst::new(InstKind::Wait { comm: CommId(id) })
}

pub fn shard(out: HostTensorId, input: HostTensorId, chunks: u64, index: Expr) -> Inst {
    Inst::new(InstKind::ShardByStream {
        out,
        input,
        axis: 0,
        chunks,
        index,
    })
}

pub fn start_group() -> Inst {
    Inst::new(InstKind::StartCoalescing)
}

pub fn end_group(id: u32) -> Inst {
    Inst::new(InstKind::EndCoalescing { id: CommId(id) })
}

pub fn compute(op: ComputeOp, inputs: Vec<HostTensorId>, outputs: Vec<HostTensorId>) -> Inst {
    Inst::new(InstKind::Compute {
        op,
        inputs,
        outputs,
    })
}
