//! Process probes shared by the hardening tests (Linux `/proc`): threads, file descriptors,
//! resident memory, and a lock that serializes the tests of one binary so the probes see
//! only the test that holds it.

use std::sync::{Mutex, MutexGuard};

static LOCK: Mutex<()> = Mutex::new(());

/// Serializes the tests of one test binary (a failed test poisons nothing).
pub fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A field of `/proc/self/status` in its unit (`Threads`: count; `VmRSS`, `VmHWM`: KiB).
pub fn status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Threads of this process whose name starts with `prefix` (`/proc/self/task/*/comm`, which
/// holds the first 15 bytes of the name).
pub fn threads_named(prefix: &str) -> usize {
    let prefix = &prefix[..prefix.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Threads named `prefix...` still alive after they were joined. A joined thread can stay
/// listed in `/proc/self/task` for a moment while the kernel finishes its exit, so this polls
/// for up to a second; a leaked thread stays forever.
pub fn threads_left(prefix: &str) -> usize {
    let start = std::time::Instant::now();
    loop {
        let n = threads_named(prefix);
        if n == 0 || start.elapsed() > std::time::Duration::from_secs(1) {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// CPU rank threads (`meshflow-cpu-rank-N`) still alive (see [`threads_left`]).
pub fn cpu_threads() -> usize {
    threads_left("meshflow-cpu-rank")
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Prints a `HARDENING` row that `scripts/hardening.sh` collects into the table.
pub fn row(table: &str, cells: &[String]) {
    eprintln!("HARDENING|{table}|{}", cells.join("|"));
}
