//! The verification passes at both ends of the pipeline (they cannot be disabled; verification
//! *between* passes is what `PassOptions::verify` turns on and off).

use meshflow_ir::{verify_host, verify_program, HostProgram, Program};

use crate::error::PassError;
use crate::manager::{HostPass, ProgramPass};
use crate::options::PassContext;

/// Verifies the input program.
pub struct VerifyProgram;

impl ProgramPass for VerifyProgram {
    fn name(&self) -> &'static str {
        "verify_program"
    }

    fn required(&self) -> Option<&'static str> {
        Some("the passes assume a valid level-1 program")
    }

    fn run(&self, program: &mut Program, _cx: &mut PassContext) -> Result<(), PassError> {
        verify_program(program).map_err(|errors| PassError::Verify {
            pass: "(input)".into(),
            errors,
        })
    }
}

/// Verifies the final host program.
pub struct VerifyHost;

impl HostPass for VerifyHost {
    fn name(&self) -> &'static str {
        "verify_host"
    }

    fn required(&self) -> Option<&'static str> {
        Some("the runtime assumes a valid host program")
    }

    fn run(&self, host: &mut HostProgram, _cx: &mut PassContext) -> Result<(), PassError> {
        verify_host(host).map_err(|errors| PassError::Verify {
            pass: "(output)".into(),
            errors,
        })
    }
}
