//! The keyword options of `Program.lower`, `Program.check` and `Program.run`, as a
//! [`meshflow::Options`].

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use meshflow::passes::UnknownTransport;
use meshflow::pipeline::StreamSchedule;
use meshflow::{Decomposition, Options, Transport};

use crate::errors::error;

/// The option names, in the order the docs list them.
pub const NAMES: [&str; 14] = [
    "ranks",
    "streams",
    "schedule",
    "decompose",
    "pieces",
    "accumulate",
    "transport",
    "profile",
    "device",
    "disable_passes",
    "verify_each_pass",
    "dump_after",
    "check",
    "graph",
];

/// Builds the options from keyword arguments; `ranks` defaults to `default_ranks` (the value
/// given to `load`/`parse`), `device` to `default_device` (the GPU model a `run` on
/// `"cuda"` executes on). Unknown names are a `TypeError`, bad values a `ValueError`.
pub fn from_kwargs(
    kwargs: Option<&Bound<'_, PyDict>>,
    default_ranks: Option<usize>,
    default_device: Option<&str>,
) -> PyResult<Options> {
    let ranks = match kwargs.map(|k| k.get_item("ranks")).transpose()?.flatten() {
        Some(v) if !v.is_none() => Some(positive(&v, "ranks")?),
        _ => default_ranks,
    };
    let mut o = match ranks {
        Some(r) => Options::for_ranks(r),
        None => Options::new(),
    };
    if let Some(device) = default_device {
        o = o.device(device);
    }
    let Some(kwargs) = kwargs else {
        return Ok(o);
    };
    for (key, value) in kwargs.iter() {
        let key: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        o = match key.as_str() {
            "ranks" => o,
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
            "pieces" => {
                let map = value
                    .cast::<PyDict>()
                    .map_err(|_| PyTypeError::new_err("pieces must be a dict {tensor: int}"))?;
                for (tensor, n) in map.iter() {
                    let n: i64 = n.extract()?;
                    let n = u64::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| {
                        PyValueError::new_err(format!("pieces must be positive integers, is {n}"))
                    })?;
                    o = o.pieces(tensor.extract::<String>()?, n);
                }
                o
            }
            "accumulate" => {
                let map = value.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err("accumulate must be a dict {tensor: bool}")
                })?;
                for (tensor, on) in map.iter() {
                    let on: bool = on.extract().map_err(|_| {
                        PyTypeError::new_err("accumulate must be a dict {tensor: bool}")
                    })?;
                    o = o.accumulate(tensor.extract::<String>()?, on);
                }
                o
            }
            "transport" => {
                let name: String = value.extract()?;
                let t: Transport = name
                    .parse()
                    .map_err(|e: UnknownTransport| PyValueError::new_err(e.to_string()))?;
                o.transport(t)
            }
            "profile" => {
                let name: String = value.extract()?;
                let profile = meshflow::pipeline::load_profile(&name)
                    .map_err(|e| error(meshflow::Error::Compile(e)))?;
                o.profile(profile)
            }
            "device" => o.device(&value.extract::<String>()?),
            "disable_passes" => {
                let names: Vec<String> = value.extract()?;
                names.into_iter().fold(o, Options::disable_pass)
            }
            "verify_each_pass" => o.verify_each_pass(value.extract()?),
            "dump_after" => o.dump_after(value.extract::<String>()?),
            "check" => o.check(value.extract()?),
            "graph" => o.graph(value.extract()?),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unknown option `{other}` (options: {})",
                    NAMES.join(", ")
                )))
            }
        };
    }
    Ok(o)
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

/// The name of a stream schedule, as the options spell it.
pub fn schedule_name(s: StreamSchedule) -> &'static str {
    match s {
        StreamSchedule::Auto => "auto",
        StreamSchedule::PerIteration => "per-iteration",
        StreamSchedule::Prefetch => "prefetch",
    }
}
