//! Copy-engine bandwidth and per-step latency between GPUs 0 and 1, both directions at once
//! (each GPU sends `MiB` and receives `MiB`), like nvbandwidth's bidirectional memcpy cases:
//!
//! - `pull` / `push`: each GPU's own streams copy from the peer into its memory / from its memory
//!   into the peer's, split into `k` equal pieces on `k` streams, steps back to back; `mixed`:
//!   half the pieces pulled by the receiver, half pushed by the sender; `one way`: only GPU 0's
//!   copy (the link's other direction idle);
//! - `stepped`: a barrier between the GPUs before every step (the peer's step before must be
//!   done), through cross-GPU events or through [`DeviceFlag`]s (stream memory operations), the
//!   way a collective permute's readiness signal works;
//! - the same barriers around a 4 KiB copy: the latency of one step.
//!
//! ```text
//! cargo run --release -p meshflow-kernels --features cuda --example peer_bandwidth -- [MiB ...]
//! ```
//! (default sizes: 64 256). Needs 2 GPUs with peer access.

// The table on stdout is what this example is for.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::time::Instant;

use meshflow_kernels::{Device, DeviceBuffer, DeviceFlag, Event, Stream};

const MAX_PIECES: usize = 8;

#[derive(Copy, Clone, Debug, PartialEq)]
enum Dir {
    Pull,
    Push,
    /// Even pieces pulled by the receiver, odd ones pushed by the sender.
    Mixed,
}

#[derive(Copy, Clone, Debug, PartialEq)]
enum Barrier {
    None,
    Events,
    Flags,
}

struct Gpu {
    dev: Device,
    main: Stream,
    copy: Vec<Stream>,
    src: DeviceBuffer,
    dst: DeviceBuffer,
    flag: DeviceFlag,
}

struct Pair {
    gpus: [Gpu; 2],
    /// Steps with a flags barrier so far (the value the next one waits for).
    flag_steps: u32,
}

impl Pair {
    fn new(bytes: usize) -> Result<Pair, Box<dyn Error>> {
        let devs = [Device::new(0)?, Device::new(1)?];
        if !devs[0].can_access_peer(&devs[1])? || !devs[1].can_access_peer(&devs[0])? {
            return Err("GPUs 0 and 1 have no peer access".into());
        }
        devs[0].enable_peer_access(&devs[1])?;
        devs[1].enable_peer_access(&devs[0])?;
        let gpu = |dev: &Device| -> Result<Gpu, Box<dyn Error>> {
            let main = Stream::new(dev)?;
            let src = DeviceBuffer::alloc(dev, bytes)?;
            src.memset(&main, 7)?;
            let dst = DeviceBuffer::alloc(dev, bytes)?;
            dst.zero(&main)?;
            main.synchronize()?;
            Ok(Gpu {
                dev: dev.clone(),
                main,
                copy: (0..MAX_PIECES)
                    .map(|_| Stream::new(dev))
                    .collect::<Result<_, _>>()?,
                src,
                dst,
                flag: DeviceFlag::new(dev)?,
            })
        };
        Ok(Pair {
            gpus: [gpu(&devs[0])?, gpu(&devs[1])?],
            flag_steps: 0,
        })
    }

    fn sync(&self) -> Result<(), Box<dyn Error>> {
        for g in &self.gpus {
            g.dev.synchronize()?;
        }
        Ok(())
    }

    /// Enqueues one step on both GPUs; returns the done events (for an events barrier).
    fn step(
        &mut self,
        bytes: usize,
        dir: Dir,
        pieces: usize,
        barrier: Barrier,
        before: &[Option<Event>; 2],
        one_way: bool,
    ) -> Result<[Option<Event>; 2], Box<dyn Error>> {
        let mut done = [None, None];
        let n = self.flag_steps;
        let parties = if one_way { 1 } else { 2 };
        for (me, slot) in done.iter_mut().enumerate().take(parties) {
            let peer = 1 - me;
            let (g, p) = (&self.gpus[me], &self.gpus[peer]);
            match barrier {
                Barrier::None => {}
                Barrier::Events => {
                    if let Some(e) = &before[peer] {
                        g.main.wait(e)?;
                    }
                }
                Barrier::Flags => g.flag.wait(&g.main, n)?,
            }
            let start = g.main.record_event()?;
            for j in 0..pieces {
                let s = &g.copy[j];
                if barrier != Barrier::None || j > 0 {
                    s.wait(&start)?;
                }
                let pull = dir == Dir::Pull || (dir == Dir::Mixed && j % 2 == 0);
                let (dst, src) = match pull {
                    true => (g.dst.view(0, bytes)?, p.src.view(0, bytes)?),
                    false => (p.dst.view(0, bytes)?, g.src.view(0, bytes)?),
                };
                dst.chunk(j, pieces)?
                    .copy_from_peer(s, &src.chunk(j, pieces)?)?;
            }
            for s in &g.copy[..pieces] {
                g.main.join(s)?;
            }
            match barrier {
                Barrier::None => {}
                Barrier::Events => *slot = Some(g.main.record_event()?),
                Barrier::Flags => p.flag.signal(&g.main, n + 1)?,
            }
        }
        if barrier == Barrier::Flags {
            self.flag_steps += 1;
        }
        Ok(done)
    }

    /// Mean µs per step over `steps` steps after 3 warm-up steps.
    fn time(
        &mut self,
        bytes: usize,
        dir: Dir,
        pieces: usize,
        barrier: Barrier,
        steps: usize,
        one_way: bool,
    ) -> Result<f64, Box<dyn Error>> {
        let mut before = [None, None];
        for _ in 0..3 {
            before = self.step(bytes, dir, pieces, barrier, &before, one_way)?;
        }
        self.sync()?;
        let t0 = Instant::now();
        for _ in 0..steps {
            before = self.step(bytes, dir, pieces, barrier, &before, one_way)?;
        }
        self.sync()?;
        Ok(t0.elapsed().as_secs_f64() * 1e6 / steps as f64)
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>())
        .collect::<Result<_, _>>()?;
    if sizes.is_empty() {
        sizes = vec![64, 256];
    }
    if Device::count()? < 2 {
        return Err("peer_bandwidth needs 2 GPUs".into());
    }
    let biggest = sizes.iter().copied().max().unwrap_or(0) << 20;
    let mut pair = Pair::new(biggest.max(4096 * MAX_PIECES))?;
    println!(
        "GPUs 0 and 1: {}; both directions at once; GB/s = bytes per direction / time",
        pair.gpus[0].dev.name()
    );
    println!("| MiB | direction | pieces | barrier | µs per step | GB/s |");
    println!("|---:|---|---:|---|---:|---:|");
    for &mib in &sizes {
        let bytes = mib << 20;
        let mut cases = Vec::new();
        for dir in [Dir::Pull, Dir::Push] {
            let us = pair.time(bytes, dir, 1, Barrier::None, 20, true)?;
            println!(
                "| {mib} | {dir:?}, one way | 1 | None | {us:.1} | {:.1} |",
                bytes as f64 / us / 1e3
            );
        }
        for pieces in [2, 4] {
            cases.push((Dir::Mixed, pieces, Barrier::None));
            cases.push((Dir::Mixed, pieces, Barrier::Events));
        }
        for dir in [Dir::Pull, Dir::Push] {
            for pieces in [1, 2, 4, 8] {
                cases.push((dir, pieces, Barrier::None));
            }
            for pieces in [1, 2, 4] {
                cases.push((dir, pieces, Barrier::Events));
                cases.push((dir, pieces, Barrier::Flags));
            }
        }
        for (dir, pieces, barrier) in cases {
            let us = pair.time(bytes, dir, pieces, barrier, 20, false)?;
            println!(
                "| {mib} | {dir:?} | {pieces} | {barrier:?} | {us:.1} | {:.1} |",
                bytes as f64 / us / 1e3
            );
        }
    }
    for barrier in [Barrier::None, Barrier::Events, Barrier::Flags] {
        for dir in [Dir::Pull, Dir::Push] {
            let us = pair.time(4096, dir, 1, barrier, 200, false)?;
            println!("| 4 KiB | {dir:?} | 1 | {barrier:?} | {us:.1} | |");
        }
    }
    Ok(())
}
