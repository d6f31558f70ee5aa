//! Mesh literals: nested lists `[[0, 1], [2, 3]]` and `iota(E1, ..., start=E)`.

use std::collections::HashMap;

use super::cursor::{error_at, Cursor, MAX_DEPTH};
use super::expr::{eval, param_note, parse_expr, PExpr, ParamValues};
use super::lexer::Pos;
use super::ParseError;
use crate::mesh::{DeviceId, DeviceMesh};

/// The most devices a mesh written in text may hold.
pub(crate) const MAX_MESH_DEVICES: u128 = 1 << 20;

/// Parses the mesh value of `mesh NAME = ...` (the cursor is after `=`).
pub(crate) fn parse_mesh(
    cur: &mut Cursor,
    name: &str,
    params: &ParamValues,
) -> Result<DeviceMesh, ParseError> {
    let start = cur.pos();
    if cur.is_word("iota") && cur.is_punct_at(1, "(") {
        return parse_iota(cur, name, params);
    }
    if !cur.is_punct("[") {
        return Err(cur.unexpected("a mesh (`[...]` or `iota(...)`)"));
    }
    let mut devices = Vec::new();
    let shape = parse_list(cur, name, params, &mut devices, 0)?;
    if shape.contains(&0) {
        return Err(error_at(start, format!("mesh `{name}` has no devices")));
    }
    let mut seen: HashMap<DeviceId, Pos> = HashMap::with_capacity(devices.len());
    for &(d, pos) in &devices {
        if let Some(first) = seen.insert(d, pos) {
            return Err(error_at(
                pos,
                format!(
                    "device {d} appears more than once in mesh `{name}` (first at {}:{})",
                    first.line, first.col
                ),
            ));
        }
    }
    let ids = devices.into_iter().map(|(d, _)| d).collect();
    DeviceMesh::new(shape, ids).map_err(|e| error_at(start, format!("mesh `{name}`: {e}")))
}

/// One `[...]` level; pushes leaf devices and returns the shape of this level.
fn parse_list(
    cur: &mut Cursor,
    name: &str,
    params: &ParamValues,
    devices: &mut Vec<(DeviceId, Pos)>,
    depth: usize,
) -> Result<Vec<usize>, ParseError> {
    let open = cur.expect_punct("[")?;
    if depth >= MAX_DEPTH {
        return Err(error_at(
            open,
            format!("mesh `{name}` is nested too deeply (more than {MAX_DEPTH} levels)"),
        ));
    }
    if cur.eat_punct("]") {
        return Ok(vec![0]);
    }
    if cur.is_punct("[") {
        let mut inner: Option<Vec<usize>> = None;
        let mut rows = 0usize;
        loop {
            let row_pos = cur.pos();
            let shape = parse_list(cur, name, params, devices, depth + 1)?;
            match &inner {
                Some(first) if *first != shape => {
                    return Err(error_at(
                        row_pos,
                        format!(
                            "mesh `{name}` is not rectangular: this row has shape {shape:?}, \
                             the first has {first:?}"
                        ),
                    ));
                }
                Some(_) => {}
                None => inner = Some(shape),
            }
            rows += 1;
            if !cur.eat_punct(",") {
                break;
            }
        }
        cur.expect_punct("]")?;
        let mut shape = vec![rows];
        shape.extend(inner.unwrap_or_default());
        return Ok(shape);
    }
    let mut count = 0usize;
    loop {
        let e = parse_expr(cur)?;
        devices.push((device_id(&e, name, params)?, e.start()));
        if devices.len() as u128 > MAX_MESH_DEVICES {
            return Err(error_at(
                e.start(),
                format!("mesh `{name}` has more than {MAX_MESH_DEVICES} devices"),
            ));
        }
        count += 1;
        if !cur.eat_punct(",") {
            break;
        }
    }
    cur.expect_punct("]")?;
    Ok(vec![count])
}

fn device_id(e: &PExpr, name: &str, params: &ParamValues) -> Result<DeviceId, ParseError> {
    let v = eval(e, params)?;
    DeviceId::try_from(v).map_err(|_| {
        error_at(
            e.start(),
            format!(
                "mesh `{name}`: device id {v} is not valid{}",
                param_note(e, params)
            ),
        )
    })
}

/// `iota(E1, ..., start=E)`; the cursor is on `iota`.
fn parse_iota(
    cur: &mut Cursor,
    name: &str,
    params: &ParamValues,
) -> Result<DeviceMesh, ParseError> {
    let iota_pos = cur.bump().pos;
    cur.expect_punct("(")?;
    let mut dims: Vec<(i128, PExpr)> = Vec::new();
    let mut start: Option<(i128, PExpr)> = None;
    loop {
        if cur.is_word("start") && cur.is_punct_at(1, "=") {
            let key = cur.bump().pos;
            cur.bump();
            if start.is_some() {
                return Err(error_at(key, "`start` is given twice"));
            }
            let e = parse_expr(cur)?;
            start = Some((eval(&e, params)?, e));
        } else {
            if start.is_some() {
                return Err(cur.unexpected("`)` (`start=` comes last)"));
            }
            let e = parse_expr(cur)?;
            dims.push((eval(&e, params)?, e));
        }
        if !cur.eat_punct(",") {
            break;
        }
    }
    cur.expect_punct(")")?;
    if dims.is_empty() {
        return Err(error_at(iota_pos, "`iota` needs at least one extent"));
    }
    let printed: Vec<String> = dims.iter().map(|(v, _)| v.to_string()).collect();
    let printed = printed.join(", ");
    let mut shape = Vec::with_capacity(dims.len());
    let mut count: u128 = 1;
    for (v, e) in &dims {
        let note = param_note(e, params);
        if *v <= 0 {
            let what = if *v == 0 {
                "has no devices".to_string()
            } else {
                format!("has a negative extent {v}")
            };
            return Err(error_at(
                e.start(),
                format!("mesh `{name}`: iota({printed}) {what}{note}"),
            ));
        }
        count = count.saturating_mul(v.unsigned_abs());
        if count > MAX_MESH_DEVICES {
            return Err(error_at(
                e.start(),
                format!(
                    "mesh `{name}`: iota({printed}) has more than {MAX_MESH_DEVICES} devices{note}"
                ),
            ));
        }
        shape.push(usize::try_from(*v).unwrap_or(usize::MAX));
    }
    let first = match &start {
        None => 0,
        Some((v, e)) => usize::try_from(*v)
            .ok()
            .filter(|s| (*s as u128).saturating_add(count) <= u128::from(u64::MAX))
            .ok_or_else(|| {
                error_at(
                    e.start(),
                    format!(
                        "mesh `{name}`: iota start {v} is not a valid device id{}",
                        param_note(e, params)
                    ),
                )
            })?,
    };
    DeviceMesh::iota(shape, first).map_err(|e| error_at(iota_pos, format!("mesh `{name}`: {e}")))
}
