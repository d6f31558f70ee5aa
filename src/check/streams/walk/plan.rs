//! Deciding how to fold one loop on one rank (see the parent module's docs on folding).

use std::collections::{HashMap, HashSet};

use meshflow_ir::{EntityRef, Expr, HostTensorId, LoopVar, Role};

use super::super::fold::{lcm, Window};
use super::super::prog::{Item, Sel};
use super::{narrow, shard, whole, Seen, Shifts, View, Walker, MAX_PERIOD, MAX_REACH};
use crate::ordering::Span;
use crate::runtime::backend::PreorderIndex;

impl Walker<'_, '_, '_> {
    /// Decides whether to fold a loop on this rank, and how: its period, the streams it can
    /// use, and how each access translates from one period to the next (found by evaluating
    /// the first two periods). `None`: unroll it.
    pub(super) fn plan_fold(
        &mut self,
        var: LoopVar,
        start: i64,
        stop: i64,
        body: &[Item<'_>],
        moduli: &[&Expr],
    ) -> Option<(Window, Shifts)> {
        let values: Option<Vec<i64>> = moduli.iter().map(|m| self.quiet_eval(m)).collect();
        let p = i64::try_from(lcm(values?, MAX_PERIOD)?).ok()?;
        let mut views = self.views.clone();
        let mut workers: HashSet<i64> = HashSet::new();
        let mut seen: Vec<Seen> = Vec::new();
        for v in start..start + 2 * p {
            *self.loops.get_mut(var.0 as usize)? = Some(v);
            seen.push(self.dry(body, &mut views, &mut workers));
        }
        *self.loops.get_mut(var.0 as usize)? = None;
        // How each access moves from iteration v to v + p: along one axis, by a fixed step.
        let mut shifts: Shifts = HashMap::new();
        let mut per_buffer: HashMap<usize, Vec<(usize, i64, Vec<Span>)>> = HashMap::new();
        for r in 0..p as usize {
            let (now, later) = (&seen[r], &seen[r + p as usize]);
            if now.len() != later.len() {
                return None;
            }
            for (key, (buffer, spans)) in now {
                let (b2, s2) = later.get(key)?;
                if b2 != buffer || s2.len() != spans.len() {
                    return None;
                }
                let diff = |x: u64, y: u64| i64::try_from(i128::from(y) - i128::from(x)).ok();
                let moved: Vec<(usize, Option<i64>)> = spans
                    .iter()
                    .zip(s2)
                    .enumerate()
                    .filter(|(_, (a, b))| a != b)
                    .map(|(k, (a, b))| (k, diff(a.lo, b.lo)))
                    .collect();
                let shift = match moved.as_slice() {
                    [] => (0, 0),
                    [(axis, Some(step))] => {
                        let (a, b) = (&spans[*axis], &s2[*axis]);
                        if diff(a.hi, b.hi) != Some(*step) {
                            return None;
                        }
                        (*axis, *step)
                    }
                    _ => return None,
                };
                match shifts.get(key) {
                    Some(&s) if s != shift => return None,
                    _ => {}
                }
                if shift.1 != 0 {
                    shifts.insert(*key, shift);
                }
                per_buffer
                    .entry(*buffer)
                    .or_default()
                    .push((shift.0, shift.1, spans.clone()));
            }
        }
        // A buffer whose chunks translate: every access to it translates the same way, or
        // covers the whole axis (else two iterations a period apart would not look alike).
        let mut reach = 0i64;
        for (buffer, accesses) in &per_buffer {
            let Some(&(axis, step, _)) = accesses.iter().find(|a| a.1 != 0) else {
                continue;
            };
            let extent = self.buffer_shape(*buffer, &views)?.get(axis).copied()?;
            let mut lo = u64::MAX;
            let (mut hi, mut len) = (0u64, 0u64);
            for (a, s, spans) in accesses {
                let span = spans.get(axis)?;
                let whole = span.lo == 0 && span.hi == extent;
                if (*s != 0 && (*a, *s) != (axis, step)) || (*s == 0 && !whole) {
                    return None;
                }
                lo = lo.min(span.lo);
                hi = hi.max(span.lo);
                len = len.max(span.hi - span.lo);
            }
            let span = (hi - lo).saturating_add(len.saturating_mul(2));
            let steps = i64::try_from(span / step.unsigned_abs())
                .ok()?
                .checked_add(2)?;
            reach = reach.max(steps.checked_mul(p)?);
        }
        if reach > MAX_REACH {
            return None;
        }
        let streams = (self.streams.len() + workers.len()) as i64;
        let window = Window::plan(start, stop, p, streams, reach)?;
        Some((window, shifts))
    }

    fn buffer_shape(&self, buffer: usize, views: &[Option<View>]) -> Option<Vec<u64>> {
        if let Some(b) = self.bufs.get(buffer) {
            return Some(b.shape.clone());
        }
        // A buffer allocated inside the loop (numbered past the real ones by `dry`).
        let t = buffer.checked_sub(self.bufs.len())?;
        let _ = views;
        self.prog
            .host
            .tensors
            .get(HostTensorId::new(t))
            .map(|t| t.shape.clone())
    }

    /// One iteration of a loop body, evaluated for its views and accesses only.
    fn dry(
        &self,
        body: &[Item<'_>],
        views: &mut [Option<View>],
        workers: &mut HashSet<i64>,
    ) -> Seen {
        let mut out = HashMap::new();
        let mut access =
            |ord: PreorderIndex, ts: &mut dyn Iterator<Item = &usize>, views: &[Option<View>]| {
                for (k, &t) in ts.enumerate() {
                    if let Some(Some(v)) = views.get(t) {
                        out.insert((ord, k as u8), (v.buffer, v.spans.clone()));
                    }
                }
            };
        for item in body {
            match item {
                Item::Alloc { tensor } => {
                    if let Some(t) = self.prog.host.tensors.get(HostTensorId::new(*tensor)) {
                        if self.held(*tensor) && t.role == Role::Internal {
                            views[*tensor] = Some(View {
                                buffer: self.bufs.len() + tensor,
                                spans: whole(&t.shape),
                            });
                        }
                    }
                }
                Item::Dealloc { tensor } => views[*tensor] = None,
                Item::SetStream {
                    stream: Sel::Worker(e),
                    ..
                }
                | Item::Sync {
                    stream: Sel::Worker(e),
                    ..
                } => {
                    if let Some(w) = self.quiet_eval(e) {
                        workers.insert(w);
                    }
                }
                Item::Shard {
                    out: o,
                    input,
                    axis,
                    chunks,
                    index,
                    ..
                } => {
                    if !(self.held(*o) && self.held(*input)) {
                        continue;
                    }
                    let view = self.quiet_eval(index).and_then(|i| {
                        let parent = views.get(*input)?.as_ref()?;
                        shard(parent, *axis, *chunks, i)
                    });
                    views[*o] = view;
                }
                Item::Narrow {
                    out: o,
                    input,
                    axis,
                    start,
                    length,
                    ..
                } => {
                    if !(self.held(*o) && self.held(*input)) {
                        continue;
                    }
                    let s = self.quiet_eval(start).zip(self.quiet_eval(length));
                    let view = s.and_then(|(s, l)| {
                        let parent = views.get(*input)?.as_ref()?;
                        narrow(parent, *axis, s, l)
                    });
                    views[*o] = view;
                }
                Item::Comm {
                    ord,
                    team,
                    collective,
                    reads,
                    writes,
                    strict,
                    ..
                } => {
                    let (reads, writes) = self.roles(*collective, team, reads, writes);
                    let all_held = reads.iter().chain(writes).all(|&t| self.held(t));
                    if self.in_team(team) && (all_held || !*strict) {
                        access(*ord, &mut reads.iter().chain(writes), views);
                    }
                }
                Item::Compute { ord, reads, writes }
                    if reads.iter().chain(writes).all(|&t| self.held(t)) =>
                {
                    access(*ord, &mut reads.iter().chain(writes), views);
                }
                _ => {}
            }
        }
        out
    }
}
