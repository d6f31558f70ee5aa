//! Buffer lifetimes along program order: `allocate`, `deallocate` and every use of a tensor.

use super::host::{Alloc, HostChecker};
use super::Location;
use crate::host::{HostTensorId, Role};

impl HostChecker<'_> {
    pub(super) fn allocate(&mut self, t: HostTensorId, depth: usize, here: &Location) {
        let name = self.name(t);
        let role = self.p.tensors.get(t).map(|d| d.role);
        if role == Some(Role::Input) {
            self.push(
                here,
                format!("cannot allocate input `{name}`: inputs are bound by the caller"),
            );
            return;
        }
        if self.views.contains(&t) {
            self.push(
                here,
                format!("cannot allocate view `{name}`: it is defined by `shard_by_stream`"),
            );
            return;
        }
        if let Some(Alloc::Live { location, .. }) = self.alloc.get(&t) {
            let at = location
                .loc()
                .span()
                .map(|s| format!(" (first allocated at {s})"))
                .unwrap_or_default();
            self.push(
                here,
                format!("`{name}` is allocated twice without a deallocate{at}"),
            );
            return;
        }
        self.alloc.insert(
            t,
            Alloc::Live {
                depth,
                location: here.clone(),
            },
        );
    }

    pub(super) fn deallocate(&mut self, t: HostTensorId, depth: usize, here: &Location) {
        let name = self.name(t);
        let role = self.p.tensors.get(t).map(|d| d.role);
        if role == Some(Role::Input) {
            self.push(
                here,
                format!("cannot deallocate input `{name}`: inputs are owned by the caller"),
            );
            return;
        }
        if self.views.contains(&t) {
            self.push(
                here,
                format!("cannot deallocate view `{name}`: it is not a buffer"),
            );
            return;
        }
        match self.alloc.get(&t) {
            Some(Alloc::Live { depth: d, .. }) => {
                if *d < depth {
                    self.push(
                        here,
                        format!(
                            "`{name}` is deallocated inside a loop but allocated outside it \
                             (the next iteration would use or free it again)"
                        ),
                    );
                }
                self.alloc.insert(t, Alloc::Freed);
            }
            Some(Alloc::Freed) => {
                self.push(here, format!("`{name}` is deallocated twice"));
            }
            None => {
                self.push(
                    here,
                    format!("deallocate of `{name}`, which is not allocated"),
                );
            }
        }
    }

    /// Checks that `t` may be used (`verb` is "read", "written" or "viewed") at `here`.
    pub(super) fn use_tensor(&mut self, t: HostTensorId, verb: &str, text: &str, here: &Location) {
        let Some(decl) = self.p.tensors.get(t) else {
            return;
        };
        let name = &decl.name;
        if self.views.contains(&t) {
            if !self.live_views.contains_key(&t) {
                let message = if self.seen_views.contains(&t) {
                    format!(
                        "view `{name}` is {verb} by `{text}` outside the block of its \
                         `shard_by_stream`"
                    )
                } else {
                    format!("view `{name}` is {verb} by `{text}` before its `shard_by_stream`")
                };
                self.push(here, message);
            }
            return;
        }
        match decl.role {
            Role::Input => return,
            Role::Output if !self.allocated_somewhere.contains(&t) => return,
            _ => {}
        }
        let problem = match self.alloc.get(&t) {
            Some(Alloc::Live { .. }) => return,
            Some(Alloc::Freed) => "after it is deallocated",
            None => "before it is allocated",
        };
        self.push(
            here,
            format!("tensor `{name}` is {verb} by `{text}` {problem}"),
        );
    }
}
