//! Happens-before between the operations of one rank, shared by the CPU backend's dynamic
//! race checker ([`crate::runtime::cpu`]) and the static stream-order check
//! ([`crate::check`]).
//!
//! - [`clock`]: vector clocks over a rank's streams and communication labels ([`Clocks`]).
//! - [`region`]: the elements of a buffer an access touches ([`Region`], [`Span`]).
//! - [`shadow`]: per buffer, the accesses later ones must be checked against ([`Shadow`]),
//!   pruned as happens-before edges supersede them, so checking costs time linear in the
//!   accesses.

pub mod clock;
pub mod region;
pub mod shadow;

pub use clock::{join_into, ordered, Clocks, Timeline};
pub use region::{Region, Span};
pub use shadow::{Access, Entry, Scope, Shadow};

use meshflow_ir::CommKind;

/// Which of its buffers one member of a collective touches: `(reads the send buffer,
/// writes the receive buffer)`, as the kind's buffer contract says
/// ([`CommKind::contract`]): every member of the symmetric kinds does both; a rooted
/// kind's root does both (its own chunk or copy), the other members only their side.
pub fn collective_accesses(kind: CommKind, is_root: bool) -> (bool, bool) {
    let uses = kind.contract().member(is_root);
    (uses.send.touched(), uses.recv.touched())
}
