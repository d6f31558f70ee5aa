//! An SVG timeline of a [`Trace`]: one row per rank and stream, time on the x axis, one box
//! per event coloured by what it is (compute, communication, copy, wait), so that a person
//! can see which transfers run under which GEMMs. Bookkeeping instructions (allocations,
//! views, stream switches, loops) are left out.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::trace::{Trace, TraceEvent};

/// What a box of the timeline shows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// A compute op or kernel.
    Compute,
    /// A communication.
    Comm,
    /// A copy.
    Copy,
    /// A wait or synchronization.
    Wait,
}

impl EventKind {
    /// The kind of an event by its instruction name; `None` for bookkeeping.
    pub fn of(name: &str) -> Option<EventKind> {
        match name {
            "allocate" | "deallocate" | "shard_by_stream" | "get_current_stream"
            | "set_current_stream" | "for" | "start_coalescing" => None,
            "wait" | "synchronize" => Some(EventKind::Wait),
            "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast" | "gather" | "scatter"
            | "reduce" | "send_recv" | "all_to_all" | "collective_permute" | "moe_dispatch"
            | "moe_combine" | "coalesced" | "end_coalescing" => Some(EventKind::Comm),
            n if n.contains("copy") => Some(EventKind::Copy),
            _ => Some(EventKind::Compute),
        }
    }

    fn colour(self) -> &'static str {
        match self {
            EventKind::Compute => "#4c78a8",
            EventKind::Comm => "#f58518",
            EventKind::Copy => "#54a24b",
            EventKind::Wait => "#b0b0b0",
        }
    }

    fn label(self) -> &'static str {
        match self {
            EventKind::Compute => "compute",
            EventKind::Comm => "communication",
            EventKind::Copy => "copy",
            EventKind::Wait => "wait",
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const LABEL_W: f64 = 150.0;
const PLOT_W: f64 = 1200.0;
const ROW_H: f64 = 24.0;
const TOP: f64 = 40.0;

impl Trace {
    /// The trace as an SVG timeline. `pool` is the size of the worker-stream pool: streams
    /// above it are labelled `copy` (the CUDA backend's copy stream); `None` labels every
    /// stream above 0 a worker.
    pub fn to_svg(&self, title: &str, pool: Option<usize>) -> String {
        let shown: Vec<(&TraceEvent, EventKind)> = self
            .events
            .iter()
            .filter_map(|e| EventKind::of(e.name).map(|k| (e, k)))
            .collect();
        let rows: Vec<(usize, usize)> = shown
            .iter()
            .map(|(e, _)| (e.rank, e.stream))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let t0 = shown
            .iter()
            .map(|(e, _)| e.start_us)
            .fold(f64::INFINITY, f64::min);
        let t1 = shown
            .iter()
            .map(|(e, _)| e.start_us + e.dur_us)
            .fold(f64::NEG_INFINITY, f64::max);
        let (t0, span) = if t0.is_finite() && t1 > t0 {
            (t0, t1 - t0)
        } else {
            (0.0, 1.0)
        };
        let height = TOP + ROW_H * rows.len() as f64 + 60.0;
        let width = LABEL_W + PLOT_W + 20.0;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"8\" y=\"18\" font-size=\"14\">{}</text>\n",
            esc(title)
        );
        let x_of = |t: f64| LABEL_W + (t - t0) / span * PLOT_W;
        for (i, (rank, stream)) in rows.iter().enumerate() {
            let y = TOP + ROW_H * i as f64;
            let name = super::trace::stream_name(*stream, pool);
            let fill = if i % 2 == 0 { "#f4f4f4" } else { "#ffffff" };
            let _ = writeln!(
                s,
                "<rect x=\"0\" y=\"{y:.1}\" width=\"{width:.0}\" height=\"{ROW_H:.0}\" fill=\"{fill}\"/>\n<text x=\"8\" y=\"{:.1}\">rank {rank} · {name}</text>",
                y + ROW_H * 0.65
            );
        }
        for (e, kind) in &shown {
            let Some(row) = rows.iter().position(|r| *r == (e.rank, e.stream)) else {
                continue;
            };
            let y = TOP + ROW_H * row as f64 + 3.0;
            let x = x_of(e.start_us);
            let w = (e.dur_us / span * PLOT_W).max(1.0);
            let it: Vec<String> = e.iteration.iter().map(i64::to_string).collect();
            let _ = writeln!(
                s,
                "<rect x=\"{x:.2}\" y=\"{y:.1}\" width=\"{w:.2}\" height=\"{:.0}\" fill=\"{}\" stroke=\"#333\" stroke-width=\"0.3\"><title>{} [{}] {:.1} µs + {:.1} µs: {}</title></rect>",
                ROW_H - 6.0,
                kind.colour(),
                esc(e.name),
                it.join(","),
                e.start_us,
                e.dur_us,
                esc(&e.text)
            );
        }
        let axis_y = TOP + ROW_H * rows.len() as f64 + 14.0;
        for k in 0..=10 {
            let t = t0 + span * f64::from(k) / 10.0;
            let x = x_of(t);
            let _ = writeln!(
                s,
                "<line x1=\"{x:.1}\" y1=\"{TOP:.0}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#ccc\" stroke-width=\"0.5\"/>\n<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{t:.0} µs</text>",
                axis_y - 10.0,
                axis_y
            );
        }
        let mut lx = LABEL_W;
        for kind in [
            EventKind::Compute,
            EventKind::Comm,
            EventKind::Copy,
            EventKind::Wait,
        ] {
            let _ = writeln!(
                s,
                "<rect x=\"{lx:.0}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.0}\" y=\"{:.1}\">{}</text>",
                axis_y + 14.0,
                kind.colour(),
                lx + 16.0,
                axis_y + 24.0,
                kind.label()
            );
            lx += 120.0;
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rank: usize, stream: usize, name: &'static str, start: f64, dur: f64) -> TraceEvent {
        TraceEvent {
            rank,
            stream,
            name,
            text: format!("{name} <x>"),
            iteration: vec![1],
            start_us: start,
            dur_us: dur,
            transport: None,
            moe_weights: None,
        }
    }

    #[test]
    fn one_row_per_rank_and_stream_and_boxes_by_kind() {
        let t = Trace {
            events: vec![
                ev(0, 1, "linear", 0.0, 50.0),
                ev(0, 2, "collective_permute", 10.0, 30.0),
                ev(1, 1, "wait", 5.0, 1.0),
                ev(1, 3, "collective_permute", 0.0, 100.0),
                ev(1, 1, "allocate", 0.0, 1.0),
            ],
        };
        let svg = t.to_svg("ring", Some(2));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        for label in [
            "rank 0 · worker 0",
            "rank 0 · worker 1",
            "rank 1 · worker 0",
            "rank 1 · copy",
        ] {
            assert!(svg.contains(label), "{label}\n{svg}");
        }
        assert_eq!(svg.matches("<title>").count(), 4, "allocate is left out");
        assert!(svg.contains("fill=\"#4c78a8\" stroke"));
        assert!(svg.contains("fill=\"#f58518\" stroke"));
        assert!(svg.contains("&lt;x&gt;"));
        assert_eq!(EventKind::of("strided_copy"), Some(EventKind::Copy));
        assert_eq!(EventKind::of("synchronize"), Some(EventKind::Wait));
        assert_eq!(EventKind::of("shard_by_stream"), None);
        // An empty trace still renders.
        assert!(Trace::default().to_svg("empty", None).contains("</svg>"));
    }
}
