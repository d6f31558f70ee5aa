//! The keyword options of `Program.lower`, `Program.check` and `Program.run`, as a
//! [`meshflow::Options`].

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::pipeline::StreamSchedule;
use meshflow::{Decomposition, Options, Transport};

use crate::errors::error;

/// The option names, in the order the docs list them.
pub const NAMES: [&str; 10] = [
    "ranks",
    "streams",
    "schedule",
    "decompose",
    "transport",
    "profile",
    "disable_passes",
    "verify_each_pass",
    "dump_after",
    "check",
];

/// Builds the options from keyword arguments; `ranks` defaults to `default_ranks` (the value
/// given to `load`/`parse`). Unknown names are a `TypeError`, bad values a `ValueError`.
pub fn from_kwargs(
    kwargs: Option<&Bound<'_, PyDict>>,
    default_ranks: Option<usize>,
) -> PyResult<Options> {
    let mut ranks = default_ranks;
    let mut o = Options::new();
    let Some(kwargs) = kwargs else {
        return Ok(with_ranks(o, ranks));
    };
    for (key, value) in kwargs.iter() {
        let key: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        o = match key.as_str() {
            "ranks" => {
                ranks = Some(positive(&value, "ranks")?);
                o
            }
            "streams" => o.streams(positive(&value, "streams")?),
            "schedule" => o.stream_schedule(schedule(&value.extract::<String>()?)?),
            "decompose" => {
                let map = value.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err("decompose must be a dict {tensor: variant}")
                })?;
                for (tensor, how) in map.iter() {
                    let how: String = how.extract()?;
                    let how: Decomposition =
                        how.parse().map_err(|e: meshflow::passes::PassError| {
                            PyValueError::new_err(e.to_string())
                        })?;
                    o = o.decomposition(tensor.extract::<String>()?, how);
                }
                o
            }
            "transport" => o.transport(transport(&value.extract::<String>()?)?),
            "profile" => {
                let name: String = value.extract()?;
                let profile = meshflow::pipeline::load_profile(&name)
                    .map_err(|e| error(meshflow::Error::Compile(e)))?;
                o.profile(profile)
            }
            "disable_passes" => {
                let names: Vec<String> = value.extract()?;
                names.into_iter().fold(o, Options::disable_pass)
            }
            "verify_each_pass" => o.verify_each_pass(value.extract()?),
            "dump_after" => o.dump_after(value.extract::<String>()?),
            "check" => o.check(value.extract()?),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unknown option `{other}` (options: {})",
                    NAMES.join(", ")
                )))
            }
        };
    }
    Ok(with_ranks(o, ranks))
}

/// Moves the settings of `o` onto options for `ranks` ranks.
fn with_ranks(o: Options, ranks: Option<usize>) -> Options {
    match ranks {
        None => o,
        Some(r) => {
            let mut out = Options::for_ranks(r).check(o.checks());
            *out.compile_options_mut() = o.compile_options().clone();
            out
        }
    }
}

fn positive(value: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let v: i64 = value.extract()?;
    usize::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| PyValueError::new_err(format!("{what} must be a positive integer, is {v}")))
}

fn schedule(name: &str) -> PyResult<StreamSchedule> {
    match name {
        "auto" => Ok(StreamSchedule::Auto),
        "per-iteration" | "per_iteration" => Ok(StreamSchedule::PerIteration),
        "prefetch" => Ok(StreamSchedule::Prefetch),
        _ => Err(PyValueError::new_err(format!(
            "unknown schedule `{name}` (expected auto, per-iteration or prefetch)"
        ))),
    }
}

fn transport(name: &str) -> PyResult<Transport> {
    match name {
        "nccl" => Ok(Transport::Nccl),
        "copy-engine" | "copy_engine" => Ok(Transport::CopyEngine),
        _ => Err(PyValueError::new_err(format!(
            "unknown transport `{name}` (expected nccl or copy-engine)"
        ))),
    }
}

/// The name of a stream schedule, as the options spell it.
pub fn schedule_name(s: StreamSchedule) -> &'static str {
    match s {
        StreamSchedule::Auto => "auto",
        StreamSchedule::PerIteration => "per-iteration",
        StreamSchedule::Prefetch => "prefetch",
    }
}

/// The name of a transport, as the options spell it.
pub fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Nccl => "nccl",
        Transport::CopyEngine => "copy-engine",
    }
}
