//! [`supervise`]: runs the node processes of a multi-process run to the end, never hanging.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use meshflow_ir::DeviceId;

/// A node process to start.
#[derive(Debug)]
pub struct NodeCommand {
    /// The node.
    pub node: usize,
    /// Its ranks.
    pub ranks: Vec<DeviceId>,
    /// The command (stdout and stderr are captured).
    pub command: Command,
}

/// How a node process ended.
#[derive(Debug)]
pub struct NodeExit {
    /// The node.
    pub node: usize,
    /// Its ranks.
    pub ranks: Vec<DeviceId>,
    /// Its exit status (`None`: it could not be started or waited for).
    pub status: Option<ExitStatus>,
    /// True when the supervisor killed it (it outlived the deadline or the grace period).
    pub killed: bool,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl NodeExit {
    /// True when it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// `exited with status 86`, `was killed by signal 9`, `was killed by the supervisor`.
    pub fn describe(&self) -> String {
        if self.killed {
            return "did not finish in time and was killed by the launcher".into();
        }
        let Some(status) = self.status else {
            return "could not be started".into();
        };
        if let Some(code) = status.code() {
            return format!("exited with status {code}");
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(sig) = status.signal() {
                return format!("was killed by signal {sig}");
            }
        }
        format!("ended with {status}")
    }
}

struct Running {
    node: usize,
    ranks: Vec<DeviceId>,
    child: Option<Child>,
    status: Option<ExitStatus>,
    killed: bool,
    readers: [Option<JoinHandle<String>>; 2],
}

fn capture(r: Option<impl Read + Send + 'static>) -> Option<JoinHandle<String>> {
    let mut r = r?;
    std::thread::Builder::new()
        .name("meshflow-node-output".into())
        .spawn(move || {
            let mut bytes = Vec::new();
            let _ = r.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .ok()
}

/// Starts every node process and waits for all of them. When one fails, the others get
/// `grace` to fail on their own (they lose its links at once) before they are killed; nothing
/// outlives `deadline`. Only the processes started here are killed.
pub fn supervise(commands: Vec<NodeCommand>, deadline: Duration, grace: Duration) -> Vec<NodeExit> {
    let start = Instant::now();
    let mut running: Vec<Running> = commands
        .into_iter()
        .map(|mut c| {
            let spawned = c
                .command
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn();
            match spawned {
                Ok(mut child) => {
                    let readers = [capture(child.stdout.take()), capture(child.stderr.take())];
                    Running {
                        node: c.node,
                        ranks: c.ranks,
                        child: Some(child),
                        status: None,
                        killed: false,
                        readers,
                    }
                }
                Err(e) => {
                    tracing::error!(node = c.node, "cannot start the node process: {e}");
                    Running {
                        node: c.node,
                        ranks: c.ranks,
                        child: None,
                        status: None,
                        killed: false,
                        readers: [None, None],
                    }
                }
            }
        })
        .collect();
    let mut first_failure: Option<Instant> =
        running.iter().any(|r| r.child.is_none()).then(Instant::now);
    loop {
        let mut alive = 0;
        for r in &mut running {
            let Some(child) = r.child.as_mut() else {
                continue;
            };
            if r.status.is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(s)) => {
                    r.status = Some(s);
                    if !s.success() && first_failure.is_none() {
                        first_failure = Some(Instant::now());
                    }
                }
                Ok(None) => alive += 1,
                Err(e) => {
                    tracing::error!(node = r.node, "cannot wait for the node process: {e}");
                    r.child = None;
                }
            }
        }
        if alive == 0 {
            break;
        }
        let out_of_time =
            start.elapsed() >= deadline || first_failure.is_some_and(|t| t.elapsed() >= grace);
        if out_of_time {
            for r in &mut running {
                if let (Some(child), None) = (r.child.as_mut(), r.status) {
                    let _ = child.kill();
                    r.status = child.wait().ok();
                    r.killed = true;
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    running
        .into_iter()
        .map(|r| {
            let [stdout, stderr] = r
                .readers
                .map(|h| h.and_then(|h| h.join().ok()).unwrap_or_default());
            NodeExit {
                node: r.node,
                ranks: r.ranks,
                status: r.status,
                killed: r.killed,
                stdout,
                stderr,
            }
        })
        .collect()
}
