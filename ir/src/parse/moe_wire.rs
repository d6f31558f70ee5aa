//! The `wire=` and `scale=` attributes of `moe_dispatch`, shared by the level-1 op and the
//! host instruction.

use super::cursor::{error_at, Cursor};
use super::lexer::Pos;
use super::ParseError;
use crate::moe::{Fp8Scales, MoeWire};

/// The value of `wire=`: `true` for `f8e4m3`, `false` for `native`.
pub(super) fn wire_value(cur: &mut Cursor) -> Result<bool, ParseError> {
    let (v, pos) = cur.expect_ident("a wire format (native or f8e4m3)")?;
    match v.as_str() {
        "native" => Ok(false),
        "f8e4m3" => Ok(true),
        _ => Err(error_at(
            pos,
            format!("unknown wire format `{v}` (expected native or f8e4m3)"),
        )),
    }
}

/// The value of `scale=`.
pub(super) fn scale_value(cur: &mut Cursor) -> Result<Fp8Scales, ParseError> {
    let (v, pos) = cur.expect_ident("a scale granularity")?;
    Fp8Scales::from_name(&v).ok_or_else(|| {
        error_at(
            pos,
            format!("unknown FP8 scale granularity `{v}` (expected token or block128)"),
        )
    })
}

/// The wire format given by `wire=` (`fp8`) and `scale=`; errors point at `close`.
pub(super) fn moe_wire(
    fp8: Option<bool>,
    scale: Option<Fp8Scales>,
    close: Pos,
) -> Result<MoeWire, ParseError> {
    match (fp8, scale) {
        (None | Some(false), None) => Ok(MoeWire::Native),
        (Some(true), Some(s)) => Ok(MoeWire::Fp8E4m3(s)),
        (Some(true), None) => Err(error_at(
            close,
            "`wire=f8e4m3` needs `scale=token` or `scale=block128`",
        )),
        (_, Some(_)) => Err(error_at(close, "`scale` is only for `wire=f8e4m3`")),
    }
}
