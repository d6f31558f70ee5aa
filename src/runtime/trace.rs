//! Chrome/Perfetto traces of a run: one `"X"` (complete) event per executed instruction, with
//! `pid` = rank, `tid` = stream, `name` = instruction kind and the instruction text in `args`
//! (with, for a communication on GPUs, the transport that executed it, and for an MoE step
//! which instruction carried the top-k weights), and metadata events
//! naming every process (`rank R`) and thread (`main`, `worker W`, `copy`) so viewers show
//! those names. Open the JSON in `chrome://tracing` or <https://ui.perfetto.dev>.

use std::fmt::Write as _;

use meshflow_ir::DeviceId;
use meshflow_passes::Transport;

use super::backend::MoeWeightsAt;

/// One executed instruction.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// The rank.
    pub rank: DeviceId,
    /// The stream index (0 = main, `1 + w` = worker `w`).
    pub stream: usize,
    /// The instruction kind.
    pub name: &'static str,
    /// The instruction text.
    pub text: String,
    /// Values of the enclosing loop variables.
    pub iteration: Vec<i64>,
    /// Start, in microseconds since the run started.
    pub start_us: f64,
    /// Duration in microseconds (host time spent issuing/executing the instruction).
    pub dur_us: f64,
    /// For a communication on a backend with transports: the transport that executed it
    /// (written to `args.transport`).
    pub transport: Option<Transport>,
    /// For an MoE dispatch or combine: which of the two handed the top-k weights to the
    /// transport (written to `args.topk_weights_with`: `dispatch` or `combine`).
    pub moe_weights: Option<MoeWeightsAt>,
}

/// The events of every rank of a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// The events, ordered by rank then start time.
    pub events: Vec<TraceEvent>,
}

fn escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// The name of stream `stream` (0 = main, `1 + w` = worker `w`); with the size of the worker
/// pool, streams above it are the CUDA backend's copy stream.
pub fn stream_name(stream: usize, pool: Option<usize>) -> String {
    match (stream, pool) {
        (0, _) => "main".to_string(),
        (s, Some(p)) if s > p => "copy".to_string(),
        (s, _) => format!("worker {}", s - 1),
    }
}

impl Trace {
    /// The trace as Chrome trace-event JSON (every stream above main named a worker).
    pub fn to_json(&self) -> String {
        self.to_json_with_pool(None)
    }

    /// The trace as Chrome trace-event JSON; `pool` is the size of the worker-stream pool
    /// (streams above it are named `copy`, see [`stream_name`]).
    pub fn to_json_with_pool(&self, pool: Option<usize>) -> String {
        let mut out = String::from("{\"traceEvents\":[");
        let mut first = true;
        let mut sep = |out: &mut String| {
            if !std::mem::take(&mut first) {
                out.push(',');
            }
        };
        let mut ranks: Vec<DeviceId> = self.events.iter().map(|e| e.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        for &rank in &ranks {
            sep(&mut out);
            let _ = write!(
                out,
                "\n{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}},\
                 \n{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{rank},\"args\":{{\"sort_index\":{rank}}}}}"
            );
            let mut streams: Vec<usize> = self
                .events
                .iter()
                .filter(|e| e.rank == rank)
                .map(|e| e.stream)
                .collect();
            streams.sort_unstable();
            streams.dedup();
            for stream in streams {
                let _ = write!(
                    out,
                    ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{stream},\"args\":{{\"name\":\"{}\"}}}},\
                     \n{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{rank},\"tid\":{stream},\"args\":{{\"sort_index\":{stream}}}}}",
                    stream_name(stream, pool)
                );
            }
        }
        for e in &self.events {
            sep(&mut out);
            out.push_str("\n{\"ph\":\"X\",\"name\":\"");
            escape(e.name, &mut out);
            let _ = write!(
                out,
                "\",\"pid\":{},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"inst\":\"",
                e.rank, e.stream, e.start_us, e.dur_us
            );
            escape(&e.text, &mut out);
            out.push_str("\",\"iteration\":\"");
            let it: Vec<String> = e.iteration.iter().map(i64::to_string).collect();
            escape(&it.join(","), &mut out);
            if let Some(t) = e.transport {
                let _ = write!(out, "\",\"transport\":\"{}", t.name());
            }
            if let Some(w) = e.moe_weights {
                let _ = write!(out, "\",\"topk_weights_with\":\"{}", w.name());
            }
            out.push_str("\"}}");
        }
        out.push_str("\n],\"displayTimeUnit\":\"ns\"}\n");
        out
    }

    /// Writes the JSON to `path`.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rank: DeviceId, stream: usize) -> TraceEvent {
        TraceEvent {
            rank,
            stream,
            name: "linear",
            text: "linear(x, w -> \"y\")".into(),
            iteration: vec![1],
            start_us: 1.0,
            dur_us: 2.0,
            transport: None,
            moe_weights: None,
        }
    }

    #[test]
    fn processes_and_threads_are_named_by_rank_and_stream() {
        let trace = Trace {
            events: vec![ev(0, 0), ev(0, 2), ev(1, 1), ev(1, 3)],
        };
        let json = trace.to_json_with_pool(Some(2));
        for want in [
            r#"{"ph":"M","name":"process_name","pid":0,"args":{"name":"rank 0"}}"#,
            r#"{"ph":"M","name":"process_name","pid":1,"args":{"name":"rank 1"}}"#,
            r#"{"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"main"}}"#,
            r#"{"ph":"M","name":"thread_name","pid":0,"tid":2,"args":{"name":"worker 1"}}"#,
            r#"{"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"worker 0"}}"#,
            r#"{"ph":"M","name":"thread_name","pid":1,"tid":3,"args":{"name":"copy"}}"#,
        ] {
            assert!(json.contains(want), "{want} missing from {json}");
        }
        assert_eq!(json.matches("\"ph\":\"X\"").count(), 4);
        assert!(json.contains(r#""args":{"inst":"linear(x, w -> \"y\")","iteration":"1"}"#));
        assert_eq!(
            Trace::default().to_json(),
            "{\"traceEvents\":[\n],\"displayTimeUnit\":\"ns\"}\n"
        );
    }

    #[test]
    fn a_communication_names_its_transport_in_the_args() {
        let event = |transport| TraceEvent {
            rank: 1,
            stream: 2,
            name: "collective_permute",
            text: "c0 = collective_permute(a -> b, ...)".into(),
            iteration: vec![3],
            start_us: 1.0,
            dur_us: 2.0,
            transport,
            moe_weights: None,
        };
        let json = Trace {
            events: vec![event(Some(Transport::CopyEngine)), event(None)],
        }
        .to_json();
        assert_eq!(
            json.matches("\"transport\":\"copy-engine\"").count(),
            1,
            "{json}"
        );
        assert_eq!(json.matches("\"transport\"").count(), 1, "{json}");
        assert!(json.contains("\"iteration\":\"3\",\"transport\""), "{json}");
    }

    #[test]
    fn an_moe_step_names_the_instruction_that_carried_the_weights() {
        let mut e = ev(0, 1);
        e.name = "moe_dispatch";
        e.transport = Some(Transport::Nvlink);
        e.moe_weights = Some(MoeWeightsAt::Dispatch);
        let json = Trace { events: vec![e] }.to_json();
        assert!(
            json.contains("\"transport\":\"nvlink\",\"topk_weights_with\":\"dispatch\"}"),
            "{json}"
        );
    }
}
