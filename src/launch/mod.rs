//! `meshflow launch`: starts `nproc` copies of a command on this host as the ranks of one
//! multi-process run, with the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), streams their output line by line with
//! a `[rank r]` prefix, and if one fails, terminates the others and reports which rank failed
//! and how.
//!
//! Several hosts: run the command on each host with `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the
//! same `MASTER_ADDR`/`MASTER_PORT` (rank 0's host) set by your scheduler (or torchrun); the
//! rendezvous and NCCL then span the hosts.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What to launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Number of processes (ranks).
    pub nproc: usize,
    /// `MASTER_ADDR` given to every rank.
    pub master_addr: String,
    /// `MASTER_PORT`; `None` picks a free port.
    pub master_port: Option<u16>,
    /// The program and its arguments.
    pub command: Vec<String>,
}

/// Why a launch failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProcessLaunchError {
    /// Bad arguments.
    #[error("{0}")]
    Invalid(String),
    /// A rank could not be started.
    #[error("could not start rank {rank} (`{command}`): {message}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        command: String,
        /// The OS error.
        message: String,
    },
    /// A rank failed; the others were terminated.
    #[error("rank {rank} failed ({status}); {terminated} other rank(s) terminated")]
    Failed {
        /// The first rank seen failing.
        rank: usize,
        /// Its exit status, printed.
        status: String,
        /// How many ranks were still running and were killed.
        terminated: usize,
    },
}

/// Where the ranks' output goes (shared by the reader threads).
pub type Sink = Arc<Mutex<dyn Write + Send>>;

fn free_port() -> Result<u16, ProcessLaunchError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| ProcessLaunchError::Invalid(format!("no free port for MASTER_PORT: {e}")))
}

/// Copies `from` to `sink` line by line, each prefixed with `[rank r] `.
fn pump(rank: usize, from: impl Read, sink: Sink) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                let mut out = sink.lock().unwrap_or_else(|p| p.into_inner());
                let _ = writeln!(out, "[rank {rank}] {text}");
                let _ = out.flush();
            }
            Err(e) => {
                tracing::debug!(rank, "reading a rank's output: {e}");
                return;
            }
        }
    }
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exit status {c}"),
        None => status.to_string(),
    }
}

/// Runs the ranks to completion; `Ok` when every rank exits with status 0.
pub fn launch_processes(
    spec: &LaunchSpec,
    stdout: Sink,
    stderr: Sink,
) -> Result<(), ProcessLaunchError> {
    let Some((program, args)) = spec.command.split_first() else {
        return Err(ProcessLaunchError::Invalid(
            "no command to launch (use `-- <cmd> [args]`)".into(),
        ));
    };
    if spec.nproc == 0 {
        return Err(ProcessLaunchError::Invalid(
            "--nproc must be at least 1".into(),
        ));
    }
    let port = match spec.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let mut children: Vec<Option<Child>> = Vec::with_capacity(spec.nproc);
    let mut pumps = Vec::new();
    for rank in 0..spec.nproc {
        let spawned = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", spec.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(mut child) => {
                if let Some(o) = child.stdout.take() {
                    let sink = stdout.clone();
                    pumps.push(std::thread::spawn(move || pump(rank, o, sink)));
                }
                if let Some(e) = child.stderr.take() {
                    let sink = stderr.clone();
                    pumps.push(std::thread::spawn(move || pump(rank, e, sink)));
                }
                children.push(Some(child));
            }
            Err(e) => {
                let terminated = terminate(&mut children);
                finish_pumps(pumps);
                tracing::debug!(terminated, "a rank failed to start");
                return Err(ProcessLaunchError::Spawn {
                    rank,
                    command: program.clone(),
                    message: e.to_string(),
                });
            }
        }
    }
    let mut failure = None;
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() && failure.is_none() {
                        failure = Some((rank, describe(status)));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    *slot = None;
                    if failure.is_none() {
                        failure = Some((rank, format!("could not be waited for: {e}")));
                    }
                }
            }
        }
        if let Some((rank, status)) = failure.take() {
            let terminated = terminate(&mut children);
            finish_pumps(pumps);
            return Err(ProcessLaunchError::Failed {
                rank,
                status,
                terminated,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    finish_pumps(pumps);
    Ok(())
}

/// Every descendant of `root` (children first), from `/proc` (empty where there is none).
fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut parent_of = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parent_of.push((pid, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(pid, ppid) in &parent_of {
            if ppid == p && !out.contains(&pid) {
                out.push(pid);
                frontier.push(pid);
            }
        }
    }
    out
}

/// Sends `signal` (e.g. `-KILL`) to `pids` with the system's `kill` (best effort).
fn signal(signal: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    if let Err(e) = Command::new("kill")
        .arg(signal)
        .args(&pids)
        .stderr(Stdio::null())
        .status()
    {
        tracing::debug!("kill {signal} of a rank's processes: {e}");
    }
}

/// A rank and every process it started, frozen (`SIGSTOP`) so that none of them can start
/// another one between the listing and the kill.
fn freeze_tree(root: u32) -> Vec<u32> {
    let mut frozen = vec![root];
    signal("-STOP", &frozen);
    loop {
        let fresh: Vec<u32> = descendants(root)
            .into_iter()
            .filter(|p| !frozen.contains(p))
            .collect();
        if fresh.is_empty() {
            return frozen;
        }
        signal("-STOP", &fresh);
        frozen.extend(fresh);
    }
}

/// Kills the ranks still running and every process they started (so that a rank run through
/// a wrapper script goes too), and reaps them; returns how many ranks there were.
fn terminate(children: &mut [Option<Child>]) -> usize {
    let mut n = 0;
    for c in children.iter_mut() {
        if let Some(mut child) = c.take() {
            n += 1;
            let tree = freeze_tree(child.id());
            signal("-KILL", &tree[1..]);
            if let Err(e) = child.kill() {
                tracing::debug!("kill: {e}");
            }
            let _ = child.wait();
        }
    }
    n
}

fn finish_pumps(pumps: Vec<std::thread::JoinHandle<()>>) {
    for p in pumps {
        let _ = p.join();
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn sink() -> (Sink, Arc<Mutex<Vec<u8>>>) {
        let buf = Arc::new(Mutex::new(Vec::new()));
        struct W(Arc<Mutex<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        (Arc::new(Mutex::new(W(buf.clone()))), buf)
    }

    fn spec(n: usize, script: &str) -> LaunchSpec {
        LaunchSpec {
            nproc: n,
            master_addr: "127.0.0.1".into(),
            master_port: Some(1234),
            command: vec!["sh".into(), "-c".into(), script.into()],
        }
    }

    #[test]
    fn ranks_get_torchrun_variables_and_prefixed_output() {
        let (out, buf) = sink();
        let (err, _) = sink();
        launch_processes(
            &spec(
                3,
                "echo $RANK/$WORLD_SIZE/$LOCAL_RANK $MASTER_ADDR:$MASTER_PORT",
            ),
            out,
            err,
        )
        .unwrap();
        let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
        for r in 0..3 {
            assert!(
                text.contains(&format!("[rank {r}] {r}/3/{r} 127.0.0.1:1234")),
                "{text}"
            );
        }
    }

    #[test]
    fn a_failing_rank_terminates_the_others() {
        let (out, _) = sink();
        let (err, ebuf) = sink();
        let t0 = std::time::Instant::now();
        let e = launch_processes(
            &spec(
                3,
                "if [ $RANK = 1 ]; then echo boom >&2; exit 3; fi; sleep 30",
            ),
            out,
            err,
        )
        .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(20));
        assert_eq!(
            e,
            ProcessLaunchError::Failed {
                rank: 1,
                status: "exit status 3".into(),
                terminated: 2
            }
        );
        let text = String::from_utf8(ebuf.lock().unwrap().clone()).unwrap();
        assert!(text.contains("[rank 1] boom"), "{text}");
    }
}
