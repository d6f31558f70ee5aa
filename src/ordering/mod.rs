//! Happens-before between the operations of one rank, shared by the CPU backend's dynamic
//! race checker ([`crate::runtime::sim`]) and the static stream-order check
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
