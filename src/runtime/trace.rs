//! Chrome/Perfetto traces of a run: one `"X"` (complete) event per executed instruction, with
//! `pid` = rank, `tid` = stream, `name` = instruction kind and the instruction text in `args`
//! (with, for a communication on GPUs, the transport that executed it).
//! Open the JSON in `chrome://tracing` or <https://ui.perfetto.dev>.

use std::fmt::Write as _;

use meshflow_ir::DeviceId;
use meshflow_passes::Transport;

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

impl Trace {
    /// The trace as Chrome trace-event JSON.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"traceEvents\":[");
        for (i, e) in self.events.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
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
}
