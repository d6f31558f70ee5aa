//! The proxy protocol over the TCP wire, ranks as threads of this process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

const T: Duration = Duration::from_secs(20);

/// Starts one proxy per rank of `topology` (ranks with no proxy peer get none).
fn start(topology: &Topology, ring: usize) -> Vec<Option<Proxy>> {
    let store = Arc::new(MemoryStore::new());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..topology.world())
            .map(|r| {
                let store = store.clone();
                s.spawn(move || {
                    let layout = Layout::new(topology, r, ring).unwrap();
                    if layout.peers.is_empty() {
                        return None;
                    }
                    let wire = TcpWire::connect(&layout, "127.0.0.1", &*store, "test", T).unwrap();
                    Some(Proxy::start(layout, Arc::new(wire)).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn messages_of_any_size_arrive_whole_and_in_any_receive_order() {
    let t = Topology::contiguous(2, 1).unwrap();
    let p = start(&t, 4096);
    let (a, b) = (p[0].as_ref().unwrap(), p[1].as_ref().unwrap());
    // Larger than the ring: many chunks, the ring is reused through credits.
    let big = bytes(100_000, 1);
    let small = bytes(3, 2);
    a.send(1, (1, 1), &big, T).unwrap();
    a.send(1, (1, 2), &small, T).unwrap();
    a.send(1, (1, 3), &[], T).unwrap();
    b.send(0, (9, 9), &small, T).unwrap();
    assert_eq!(b.recv(0, (1, 2), T).unwrap(), small);
    assert_eq!(b.recv(0, (1, 3), T).unwrap(), Vec::<u8>::new());
    assert_eq!(b.recv(0, (1, 1), T).unwrap(), big);
    assert_eq!(a.recv(1, (9, 9), T).unwrap(), small);
    let (sa, sb) = (a.stats(), b.stats());
    let max = Layout::new(&t, 0, 4096).unwrap().max_chunk_data();
    let chunks = 100_000usize.div_ceil(max) as u64 + 2;
    assert_eq!(sa.chunk_writes, chunks);
    assert_eq!(sb.chunk_immediates, chunks);
    assert_eq!(sb.messages_received, 3);
    assert!(sb.credit_writes > 0, "the receiver returned ring space");
    assert_eq!(sa.bytes_written, 100_003);
}

#[test]
fn four_ranks_on_two_nodes_exchange_all_to_all_concurrently() {
    let t = Topology::contiguous(4, 2).unwrap();
    let p = start(&t, 1 << 14);
    std::thread::scope(|s| {
        for (r, proxy) in p.iter().enumerate() {
            let (t, proxy) = (&t, proxy.as_ref().unwrap());
            s.spawn(move || {
                let peers = t.remote_peers(r);
                for round in 0..20u64 {
                    for &q in &peers {
                        let msg = bytes(1000 * (round as usize + 1), (r * 10 + q) as u8);
                        proxy.send(q, (round, 0), &msg, T).unwrap();
                    }
                    for &q in &peers {
                        let got = proxy.recv(q, (round, 0), T).unwrap();
                        assert_eq!(got, bytes(1000 * (round as usize + 1), (q * 10 + r) as u8));
                    }
                }
            });
        }
    });
}

#[test]
fn uneven_nodes_return_credits_to_the_right_words() {
    // Rank 2 alone on node 1 has two peers; ranks 0 and 1 have one each.
    let t = Topology::contiguous(3, 2).unwrap();
    let p = start(&t, 1024);
    let msg = bytes(10_000, 5);
    for r in [0, 1] {
        p[r].as_ref()
            .unwrap()
            .send(2, (r as u64, 0), &msg, T)
            .unwrap();
        p[2].as_ref()
            .unwrap()
            .send(r, (9, r as u64), &msg, T)
            .unwrap();
    }
    for r in [0, 1] {
        assert_eq!(
            p[2].as_ref().unwrap().recv(r, (r as u64, 0), T).unwrap(),
            msg
        );
        assert_eq!(
            p[r].as_ref().unwrap().recv(2, (9, r as u64), T).unwrap(),
            msg
        );
    }
}

#[test]
fn a_lost_peer_fails_waiting_receivers_at_once_naming_it() {
    let t = Topology::contiguous(3, 1).unwrap();
    let mut p = start(&t, 4096);
    let dead = p[2].take();
    drop(dead);
    let a = p[0].as_ref().unwrap();
    let start = Instant::now();
    // Waits for rank 1 (alive), but rank 2's loss ends the run.
    let e = a.recv(1, (1, 1), Duration::from_secs(30)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(e, ProxyError::PeerLost { peer: 2, .. }), "{e:?}");
    assert!(e.to_string().contains("lost rank 2"), "{e}");
    assert!(a.send(1, (1, 2), b"x", T).is_err());
}

#[test]
fn a_failure_notice_aborts_the_peers() {
    let t = Topology::contiguous(2, 1).unwrap();
    let p = start(&t, 4096);
    let (a, b) = (p[0].as_ref().unwrap(), p[1].as_ref().unwrap());
    a.notify_failure(0, "rank 0 hit an error");
    let e = b.recv(0, (1, 1), T).unwrap_err();
    assert_eq!(
        e,
        ProxyError::Aborted {
            rank: 0,
            reason: "rank 0 hit an error".into()
        }
    );
    assert!(matches!(
        a.recv(1, (1, 1), T),
        Err(ProxyError::Aborted { rank: 0, .. })
    ));
}

#[test]
fn a_missing_message_times_out_naming_the_peer_and_bad_peers_are_rejected() {
    let t = Topology::contiguous(4, 2).unwrap();
    let p = start(&t, 4096);
    let a = p[0].as_ref().unwrap();
    let e = a.recv(3, (5, 5), Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, ProxyError::Timeout { peer: 3, .. }), "{e:?}");
    // Rank 1 shares rank 0's node: not a proxy peer.
    let e = a.send(1, (1, 1), b"x", T).unwrap_err();
    assert!(e.to_string().contains("not a proxy peer"), "{e}");
    assert!(a.send(2, layout::ABORT_TAG, b"x", T).is_err());
    a.flush(T).unwrap();
}

#[test]
fn a_frame_outside_the_receive_region_is_a_protocol_failure() {
    use std::io::{Read, Write};
    let t = Topology::contiguous(2, 1).unwrap();
    let store = Arc::new(MemoryStore::new());
    // Rank 1 is a real proxy; rank 0 is a hand-written peer that breaks the protocol.
    let layout = Layout::new(&t, 1, 4096).unwrap();
    let region = layout.region_len() as u64;
    let ring = layout.ring as u64;
    let real = std::thread::spawn({
        let store = store.clone();
        move || {
            let wire = TcpWire::connect(&layout, "127.0.0.1", &*store, "bad", T).unwrap();
            Proxy::start(layout, Arc::new(wire)).unwrap()
        }
    });
    let addr = store.fetch("bad/tcp/1", T).unwrap();
    let mut s = std::net::TcpStream::connect(String::from_utf8(addr).unwrap()).unwrap();
    let mut hello = 0x4D46_5443u32.to_le_bytes().to_vec();
    hello.extend_from_slice(&0u64.to_le_bytes());
    hello.extend_from_slice(&ring.to_le_bytes());
    s.write_all(&hello).unwrap();
    let mut reply = [0u8; 20];
    s.read_exact(&mut reply).unwrap();
    let proxy = real.join().unwrap();
    // A write of 8 bytes at the very end of the region: past it.
    let mut frame = vec![1u8];
    frame.extend_from_slice(&(region - 4).to_le_bytes());
    frame.extend_from_slice(&8u64.to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&[0u8; 8]);
    s.write_all(&frame).unwrap();
    let e = proxy.recv(0, (1, 1), T).unwrap_err();
    assert!(matches!(e, ProxyError::PeerLost { peer: 0, .. }), "{e:?}");
    assert!(e.to_string().contains("protocol error"), "{e}");
}
