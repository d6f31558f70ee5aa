//! Typed handles and the arenas that own IR entities.
//!
//! Every IR entity (a mesh, a tensor) lives in an [`Arena`] and is referred to by a small
//! copyable handle that wraps a `u32` index. Each entity kind has its own handle type, so a
//! tensor handle can never be used to index the mesh arena.

use std::fmt;
use std::marker::PhantomData;

/// A typed index into an [`Arena`].
pub trait EntityRef: Copy + Eq + Ord + std::hash::Hash + fmt::Debug {
    /// Makes a handle from an arena index.
    fn new(index: usize) -> Self;
    /// The arena index of this handle.
    fn index(self) -> usize;
}

/// Declares a handle type that wraps a `u32` and implements [`EntityRef`].
#[macro_export]
macro_rules! entity_ref {
    ($(#[$meta:meta])* $name:ident, $prefix:literal) => {
        $(#[$meta])*
        #[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u32);

        impl $crate::entity::EntityRef for $name {
            fn new(index: usize) -> Self {
                $name(u32::try_from(index).expect("more than u32::MAX entities"))
            }
            fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl ::std::fmt::Debug for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

/// An append-only vector of entities addressed by typed handles.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Arena<K: EntityRef, V> {
    items: Vec<V>,
    _key: PhantomData<K>,
}

impl<K: EntityRef, V> Default for Arena<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

/// Collects values into an arena, their handles numbered in order from 0.
impl<K: EntityRef, V> FromIterator<V> for Arena<K, V> {
    fn from_iter<I: IntoIterator<Item = V>>(iter: I) -> Self {
        Arena {
            items: iter.into_iter().collect(),
            _key: PhantomData,
        }
    }
}

impl<K: EntityRef, V> Arena<K, V> {
    /// An empty arena.
    pub fn new() -> Self {
        Arena {
            items: Vec::new(),
            _key: PhantomData,
        }
    }

    /// Adds an entity and returns its handle.
    pub fn push(&mut self, value: V) -> K {
        let key = K::new(self.items.len());
        self.items.push(value);
        key
    }

    /// The number of entities.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when the arena holds nothing.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The entity behind `key`, or `None` if the handle is out of range.
    pub fn get(&self, key: K) -> Option<&V> {
        self.items.get(key.index())
    }

    /// The entity behind `key`, mutably, or `None` if the handle is out of range.
    pub fn get_mut(&mut self, key: K) -> Option<&mut V> {
        self.items.get_mut(key.index())
    }

    /// True when `key` refers to an entity of this arena.
    pub fn contains(&self, key: K) -> bool {
        key.index() < self.items.len()
    }

    /// Handles and entities, in insertion order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (K, &V)> + '_ {
        self.items.iter().enumerate().map(|(i, v)| (K::new(i), v))
    }

    /// Handles and entities, mutably, in insertion order.
    pub fn iter_mut(&mut self) -> impl ExactSizeIterator<Item = (K, &mut V)> + '_ {
        self.items
            .iter_mut()
            .enumerate()
            .map(|(i, v)| (K::new(i), v))
    }

    /// All handles, in insertion order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = K> + '_ {
        (0..self.items.len()).map(K::new)
    }

    /// All entities, in insertion order.
    pub fn values(&self) -> impl ExactSizeIterator<Item = &V> + '_ {
        self.items.iter()
    }

    /// The handle of the first entity `pred` accepts, in insertion order.
    pub fn find_key(&self, pred: impl FnMut(&V) -> bool) -> Option<K> {
        self.items.iter().position(pred).map(K::new)
    }

    /// The handles of the entities `pred` accepts, in insertion order.
    pub fn keys_where<'a>(
        &'a self,
        mut pred: impl FnMut(&V) -> bool + 'a,
    ) -> impl Iterator<Item = K> + 'a {
        self.iter().filter(move |(_, v)| pred(v)).map(|(k, _)| k)
    }
}

impl<K: EntityRef, V> std::ops::Index<K> for Arena<K, V> {
    type Output = V;
    /// Panics on a handle from another arena; handles are checked by the verifier first.
    fn index(&self, key: K) -> &V {
        &self.items[key.index()]
    }
}

impl<K: EntityRef, V> std::ops::IndexMut<K> for Arena<K, V> {
    fn index_mut(&mut self, key: K) -> &mut V {
        &mut self.items[key.index()]
    }
}

impl<K: EntityRef, V: fmt::Debug> fmt::Debug for Arena<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}
