//! Level-1 parser: any text either parses or returns a `ParseError`; parsed programs print and
//! parse back to the same program.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshflow::ir::parse_program;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(program) = parse_program(text) {
        let printed = program.to_string();
        let again = parse_program(&printed)
            .unwrap_or_else(|e| panic!("printed program does not parse back: {e}\n{printed}"));
        assert_eq!(again.to_string(), printed, "print/parse is not a fixpoint");
    }
});
