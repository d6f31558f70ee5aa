//! What a backend checks of a collective's buffers before it moves any bytes, read from the
//! kind's buffer contract ([`CommKind::contract`]): the team size the kind needs, the buffers
//! this member must hold, the buffers that must split into equal chunks and how the two
//! buffers' sizes relate. The CPU backend and the CUDA backend's NCCL transport both call
//! [`member_buffers`], so they accept and reject the same requests with the same messages.

use meshflow_ir::host::{BufferUse, Side, SizeViolation, Sizing};
use meshflow_ir::CommKind;

use super::backend::{BackendError, TensorView};

/// `name: message` as an invalid-request error.
pub(crate) fn invalid(name: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Invalid(format!("{name}: {message}"))
}

/// `v`, or the error that this rank takes part without the buffer `what`.
pub(crate) fn need<'a, B>(
    name: &str,
    v: Option<&'a TensorView<B>>,
    what: &str,
) -> Result<&'a TensorView<B>, BackendError> {
    v.ok_or_else(|| {
        invalid(
            name,
            format!("this rank takes part but does not hold the {what} buffer"),
        )
    })
}

/// The send and receive buffers of one member of a collective, as it touches them.
pub(crate) struct MemberViews<'a, B> {
    /// The send buffer, when this member reads one.
    pub send: Option<&'a TensorView<B>>,
    /// The receive buffer, when this member writes one.
    pub recv: Option<&'a TensorView<B>>,
}

/// Checks the buffers member `my` of a team of `d` passes to a collective of `kind` (rooted at
/// team index `root`) against the kind's contract and returns the ones it touches. Chunked
/// kinds cut the row-major elements into `d` equal contiguous chunks (NCCL's semantics),
/// whatever the shape: `[1, 12]` over 4 ranks is 4 chunks of 3 elements.
pub(crate) fn member_buffers<'a, B>(
    name: &str,
    kind: CommKind,
    (d, my, root): (usize, usize, usize),
    input: Option<&'a TensorView<B>>,
    output: Option<&'a TensorView<B>>,
) -> Result<MemberViews<'a, B>, BackendError> {
    let contract = kind.contract();
    if let Some(want) = contract.team_size.filter(|&want| want != d) {
        return Err(invalid(
            name,
            format!("needs a team of {want}, has {d} members"),
        ));
    }
    let uses = contract.member(my == root);
    let side = |side: Side, v: Option<&'a TensorView<B>>| match uses.of(side) {
        BufferUse::Required => need(name, v, side.name()).map(Some),
        BufferUse::Optional => Ok(v),
        BufferUse::Unused => Ok(None),
    };
    let send = side(Side::Send, input)?;
    let recv = side(Side::Recv, output)?;
    let numel = |v: Option<&TensorView<B>>| v.map(TensorView::numel);
    match contract.check_sizes(numel(send), numel(recv), d as u64) {
        Ok(()) => Ok(MemberViews { send, recv }),
        Err(SizeViolation::NotChunked { side, .. }) => {
            let v = match side {
                Side::Send => send,
                Side::Recv => recv,
            };
            let (shape, n) = v.map_or((&[][..], 0), |v| (&v.shape[..], v.numel()));
            Err(invalid(
                name,
                format!(
                    "the {} buffer of shape {shape:?} ({n} elements) cannot be cut into {d} \
                     equal chunks",
                    side.name()
                ),
            ))
        }
        Err(SizeViolation::Mismatch {
            sizing,
            send,
            recv,
            d,
        }) => {
            let (how, a, b) = match sizing {
                Sizing::Equal => ("send and receive sizes differ", send, recv),
                Sizing::RecvIsTeamTimesSend => {
                    ("receive = team size x send", recv, send.saturating_mul(d))
                }
                Sizing::SendIsTeamTimesRecv => {
                    ("send = team size x receive", send, recv.saturating_mul(d))
                }
            };
            Err(invalid(name, format!("{how}: {a} elements vs {b}")))
        }
    }
}
