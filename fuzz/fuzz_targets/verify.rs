//! Parse then verify, for both levels: the first byte picks the level (`1` level 1, anything
//! else the host IR; seeds from `*.mf` start with `1`, so the fuzzer keeps both kinds apart).
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshflow::ir::{parse_host, parse_program, verify_host, verify_program};

fuzz_target!(|data: &[u8]| {
    let Some((&level, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    if level == b'1' {
        if let Ok(program) = parse_program(text) {
            if let Err(errors) = verify_program(&program) {
                let _ = errors.to_string();
            }
        }
    } else if let Ok(host) = parse_host(text) {
        if let Err(errors) = verify_host(&host) {
            let _ = errors.to_string();
        }
    }
});
