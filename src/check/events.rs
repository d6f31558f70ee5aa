//! The per-rank communication events an instantiated host program issues.

use std::collections::HashMap;
use std::fmt;

use meshflow_ir::{CommKind, DType, DeviceId, HostTensorId, LoopVar, SourceLoc};

/// What a communication event does.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A collective of [`CommKind`] (`send_recv` is point-to-point, the others are team
    /// collectives).
    Collective(CommKind),
    /// One member's part of a collective permute.
    CollectivePermute,
    /// One member's part of a MoE dispatch.
    MoeDispatch,
    /// One member's part of a MoE combine.
    MoeCombine,
}

impl EventKind {
    /// The instruction name (`all_gather`, `collective_permute`, ...).
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Collective(kind) => kind.name(),
            EventKind::CollectivePermute => "collective_permute",
            EventKind::MoeDispatch => "moe_dispatch",
            EventKind::MoeCombine => "moe_combine",
        }
    }

    /// True for events every team member must issue in the same order (everything but
    /// `send_recv`, which is matched pairwise).
    pub fn is_team_collective(self) -> bool {
        self != EventKind::Collective(CommKind::SendRecv)
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A buffer a rank sends from or receives into.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// The host tensor.
    pub tensor: HostTensorId,
    /// Its element type.
    pub dtype: DType,
    /// Its local element count.
    pub numel: u64,
}

impl Buffer {
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.numel.saturating_mul(self.dtype.size_bytes() as u64)
    }
}

/// Which elements of which buffer a communication operand is: a tensor, or a chunk of a
/// chunk of it (`shard_by_stream` and `narrow` views, as evaluated on the rank).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    /// The tensor the views are cut from.
    pub base: HostTensorId,
    /// The cuts, outermost first.
    pub cuts: Vec<Cut>,
}

/// One cut of a [`Slice`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Cut {
    /// Chunk `index` of `chunks` equal chunks along `axis` (`shard_by_stream`).
    Chunk {
        /// The axis.
        axis: usize,
        /// How many chunks.
        chunks: u64,
        /// Which chunk.
        index: i64,
    },
    /// Elements `[start, start + length)` along `axis` (`narrow`).
    Narrow {
        /// The axis.
        axis: usize,
        /// The first element.
        start: i64,
        /// How many elements.
        length: i64,
    },
}

impl Slice {
    /// The whole of `tensor`.
    pub fn whole(tensor: HostTensorId) -> Slice {
        Slice {
            base: tensor,
            cuts: Vec::new(),
        }
    }
}

/// The values of the enclosing loop variables, outermost first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Iteration(pub Vec<(LoopVar, i64)>);

impl fmt::Display for Iteration {
    /// Prints ` at i0=2, i1=0`, or nothing outside loops (so it can follow an instruction).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, (var, value)) in self.0.iter().enumerate() {
            let sep = if k == 0 { " at " } else { ", " };
            write!(f, "{sep}{var}={value}")?;
        }
        Ok(())
    }
}

/// A communication instruction of the program, as printed in messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstInfo {
    /// One-line text (`meshflow_ir::text::inst_to_string`).
    pub text: String,
    /// Where it was written.
    pub loc: SourceLoc,
}

impl fmt::Display for InstInfo {
    /// Prints `` `text` `` followed by ` (line N)` when the location is known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`", self.text)?;
        if let Some(span) = self.loc.span() {
            write!(f, " (line {})", span.line)?;
        }
        Ok(())
    }
}

/// A team as the list of its device ids, in team order, interned in [`Instances::teams`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TeamId(pub usize);

/// One communication as issued by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommEvent {
    /// What it does.
    pub kind: EventKind,
    /// The team, as resolved from this rank.
    pub team: TeamId,
    /// The root as a team index, as evaluated on this rank (rooted kinds).
    pub root_index: Option<i64>,
    /// The root as a device id (when the index is in range).
    pub root: Option<DeviceId>,
    /// The device this rank sends to (collective permute, `send_recv` root).
    pub send_peer: Option<DeviceId>,
    /// The device this rank receives from (collective permute, `send_recv` non-root).
    pub recv_peer: Option<DeviceId>,
    /// The buffer sent from, when this rank holds it.
    pub send: Option<Buffer>,
    /// The buffer received into, when this rank holds it.
    pub recv: Option<Buffer>,
    /// What `send` is a view of, when known.
    pub send_slice: Option<Slice>,
    /// What `recv` is a view of, when known.
    pub recv_slice: Option<Slice>,
    /// The element count that must agree across the team (the NCCL count: one member's
    /// chunk, or the message size), when it could be derived from the rank's buffers.
    pub count: Option<u64>,
    /// The element type that must agree across the team.
    pub dtype: Option<DType>,
    /// The loop iteration it was issued in.
    pub iteration: Iteration,
    /// Index into [`Instances::insts`].
    pub inst: usize,
    /// The coalescing group (numbered per rank) it belongs to, if any.
    pub group: Option<u32>,
}

/// The program instantiated on every rank.
#[derive(Clone, Debug, Default)]
pub struct Instances {
    /// The number of ranks.
    pub world_size: usize,
    /// Per rank, the communication events in issue order.
    pub events: Vec<Vec<CommEvent>>,
    /// The communication instructions, in program order.
    pub insts: Vec<InstInfo>,
    /// The interned teams (device ids in team order).
    pub teams: Vec<Vec<DeviceId>>,
    team_ids: HashMap<Vec<DeviceId>, TeamId>,
    /// The program's tensor names, by tensor index.
    pub tensor_names: Vec<String>,
}

impl Instances {
    /// An empty instantiation for `world_size` ranks.
    pub(crate) fn new(world_size: usize, insts: Vec<InstInfo>) -> Instances {
        Instances {
            world_size,
            events: vec![Vec::new(); world_size],
            insts,
            ..Instances::default()
        }
    }

    /// Interns a team.
    pub(crate) fn intern_team(&mut self, members: Vec<DeviceId>) -> TeamId {
        if let Some(&id) = self.team_ids.get(&members) {
            return id;
        }
        let id = TeamId(self.teams.len());
        self.teams.push(members.clone());
        self.team_ids.insert(members, id);
        id
    }

    /// The members of a team.
    pub fn team(&self, team: TeamId) -> &[DeviceId] {
        self.teams.get(team.0).map_or(&[], Vec::as_slice)
    }

    /// How a slice is printed: `` `y` `` or `` `y` chunk 1/2 on axis 0 ``.
    pub fn slice_text(&self, slice: &Slice) -> String {
        use meshflow_ir::EntityRef;
        let name = self
            .tensor_names
            .get(slice.base.index())
            .map_or("?", String::as_str);
        let mut out = format!("`{name}`");
        for cut in &slice.cuts {
            match cut {
                Cut::Chunk {
                    axis,
                    chunks,
                    index,
                } => out.push_str(&format!(" chunk {index}/{chunks} on axis {axis}")),
                Cut::Narrow {
                    axis,
                    start,
                    length,
                } => out.push_str(&format!(
                    " elements [{start}, {start} + {length}) on axis {axis}"
                )),
            }
        }
        out
    }

    /// The instruction of an event.
    pub fn inst(&self, event: &CommEvent) -> &InstInfo {
        static UNKNOWN: InstInfo = InstInfo {
            text: String::new(),
            loc: SourceLoc::NONE,
        };
        self.insts.get(event.inst).unwrap_or(&UNKNOWN)
    }
}
