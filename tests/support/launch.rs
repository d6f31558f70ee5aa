//! Runs an ignored test of the current test binary as the ranks of a multi-process run,
//! through the launcher behind `meshflow launch` (the torchrun variables, a fresh port).

use std::io::Write;
use std::sync::{Arc, Mutex};

use meshflow::launch::{launch_processes, LaunchSpec, Sink};

/// An output sink the test reads back.
#[derive(Clone, Default)]
pub struct Buf(pub Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs this test binary's ignored test `test` (its full path, e.g. `ipc::child`) as ranks
/// `0..nproc`; returns whether every rank passed, and their output (`[rank r]` prefixed).
pub fn launch_test_children(test: &str, nproc: usize) -> (Result<(), String>, String) {
    let exe = std::env::current_exe().unwrap().display().to_string();
    let spec = LaunchSpec {
        nproc,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        command: vec![
            exe,
            "--ignored".into(),
            "--exact".into(),
            test.into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
    };
    let (out, err) = (Buf::default(), Buf::default());
    let out_sink: Sink = Arc::new(Mutex::new(out.clone()));
    let err_sink: Sink = Arc::new(Mutex::new(err.clone()));
    let r = launch_processes(&spec, out_sink, err_sink).map_err(|e| e.to_string());
    let text = String::from_utf8_lossy(&out.0.lock().unwrap()).into_owned()
        + &String::from_utf8_lossy(&err.0.lock().unwrap());
    eprintln!("{text}");
    (r, text)
}
