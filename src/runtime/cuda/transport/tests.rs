//! Each transport alone, on 2 GPUs: two ranks (one thread each) build a device core and one
//! transport object, post communications to it directly (no program, no selection) and
//! check the bytes that arrived. Without 2 GPUs every test prints why it skipped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use meshflow_ir::{CommKind, DType, EntityRef, MoeWire, ReduceOp};
use meshflow_kernels::proxy::{Topology, WireChoice};
use meshflow_kernels::{Device, Event};

use super::object::{CommTransport, PostCx, Posted};
use super::{copy_engine, moe_nccl, moe_nvlink, nccl, proxy, HubLink, PeerHub, PeerLink};
use crate::runtime::backend::{
    CommLabel, CommRequest, InstCtx, PreorderIndex, TeamId, TeamInfo, TensorView,
};
use crate::runtime::cuda::config::{CopyStream, CudaConfig, DeferPulls};
use crate::runtime::cuda::core::{CudaComm, DeviceCore};
use crate::runtime::cuda::deferred::Finish;
use crate::runtime::cuda::memory::CudaBuffer;
use crate::runtime::cuda::teams::Communicators;
use crate::runtime::data::TensorData;
use crate::runtime::multinode::{connect_proxies, NodeSpec, DEFAULT_RING};
use crate::runtime::rendezvous::{LocalRendezvous, Rendezvous};

type TV = TensorView<CudaBuffer>;

const CTX: InstCtx<'static> = InstCtx {
    preorder: PreorderIndex(0),
    iteration: &[],
};

/// True (after printing why) when this machine has fewer than 2 GPUs.
fn skip(test: &str) -> bool {
    match Device::count() {
        Ok(n) if n >= 2 => false,
        Ok(n) => {
            eprintln!("skipped: {test} needs 2 GPUs, this machine has {n}");
            true
        }
        Err(e) => {
            eprintln!("skipped: {test} needs 2 GPUs: {e}");
            true
        }
    }
}

/// One rank of the pair: its core, its communicator of the pair, the pair as a team, and its
/// deferred communications (waited for by [`Rank::read`]).
struct Rank {
    core: DeviceCore,
    comms: Communicators,
    team: TeamInfo,
    deferred: Vec<CudaComm>,
}

impl Rank {
    fn new(r: usize, rdv: &Arc<dyn Rendezvous>) -> Rank {
        let config = CudaConfig {
            timeout: Duration::from_secs(60),
            ..CudaConfig::default()
        };
        let device = Device::new(r).expect("GPU");
        let core =
            DeviceCore::new(r, device, None, &config, Some(rdv.clone()), None).expect("core");
        let team = TeamInfo {
            id: TeamId::new(0),
            members: vec![0, 1],
            my_index: r,
        };
        let mut comms = Communicators::default();
        comms
            .prepare(&core, &std::iter::once(team.clone()).collect())
            .expect("communicator");
        Rank {
            core,
            comms,
            team,
            deferred: Vec::new(),
        }
    }

    fn tensor(&mut self, data: &TensorData) -> TV {
        let n = data.shape().iter().product::<u64>() as usize;
        let buffer = self.core.memory.allocate(data.dtype(), n).expect("alloc");
        self.core.upload(buffer, data).expect("upload");
        TensorView {
            tensor: meshflow_ir::HostTensorId::new(0),
            buffer,
            dtype: data.dtype(),
            offset: 0,
            strides: crate::runtime::view::contiguous_strides(data.shape()),
            shape: data.shape().to_vec(),
        }
    }

    fn zeros(&mut self, dtype: DType, shape: &[u64]) -> TV {
        let n = shape.iter().product::<u64>() as usize;
        self.tensor(&TensorData::from_f32(dtype, shape, &vec![0.0; n]).expect("zeros"))
    }

    /// This rank's [`values`] as an f32 `[n]` tensor, and a zeroed f32 `[n]` output.
    fn values_and_zeros(&mut self, n: usize) -> (TV, TV) {
        let shape = [n as u64];
        let mine = TensorData::from_f32(DType::F32, &shape, &values(self.team.my_index, n));
        (
            self.tensor(&mine.expect("values")),
            self.zeros(DType::F32, &shape),
        )
    }

    /// Posts `request`; returns whether it was deferred.
    fn post(&mut self, t: &mut dyn CommTransport, request: &CommRequest<'_, CudaBuffer>) -> bool {
        let mut cx = PostCx {
            core: &mut self.core,
            comms: &self.comms,
        };
        let posted = t.post(&mut cx, request, CTX).expect("post");
        self.core.retire_scratch().expect("retire");
        match posted {
            Posted::Events(events) => {
                let waits: Vec<Event> = events;
                for e in &waits {
                    self.core.streams[0].wait(e).expect("wait");
                }
                false
            }
            Posted::Deferred(comm) => {
                self.deferred.push(comm);
                true
            }
            Posted::OnStream(_) => false,
        }
    }

    /// Waits for everything (deferred pulls, the peers' reads of this rank's sends too, as the
    /// end of a run does), then reads `v`.
    fn read(&mut self, v: &TV) -> Vec<f32> {
        self.core
            .finish_deferred(Finish::All)
            .expect("deferred pulls");
        for comm in std::mem::take(&mut self.deferred) {
            let events = comm.events.borrow();
            for e in events
                .as_ref()
                .expect("a finished deferred pull has its events")
            {
                self.core.streams[0].wait(e).expect("wait");
            }
        }
        self.core.settle_peer_reads(None).expect("completions");
        let main = self.core.streams[0].clone();
        for s in self.core.all_streams().skip(1) {
            main.join(s).expect("join");
        }
        main.synchronize().expect("sync");
        self.core
            .download(v)
            .expect("download")
            .storage()
            .to_f32_vec()
    }
}

/// Runs `f` on ranks 0 and 1 (one thread each) and returns their results.
fn pair<T: Send>(name: &str, f: impl Fn(&mut Rank) -> T + Sync) -> [T; 2] {
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new(format!("transport-{name}")));
    let results: Vec<T> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (rdv, f) = (&rdv, &f);
                s.spawn(move || f(&mut Rank::new(r, rdv)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let [a, b]: [T; 2] = results.try_into().unwrap_or_else(|_| unreachable!());
    [a, b]
}

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i) as f32).collect()
}

fn permute<'a>(team: &'a TeamInfo, input: &'a TV, output: &'a TV) -> CommRequest<'a, CudaBuffer> {
    permute_labelled(0, team, input, output)
}

/// A permute of communication `label` to the other rank of the pair.
fn permute_labelled<'a>(
    label: usize,
    team: &'a TeamInfo,
    input: &'a TV,
    output: &'a TV,
) -> CommRequest<'a, CudaBuffer> {
    let other = 1 - team.my_index;
    CommRequest::Permute {
        label: CommLabel::new(label),
        team,
        send_peer: other,
        recv_peer: other,
        input,
        output,
    }
}

/// A collective `kind` of the pair from `input` to `output` (summing where it reduces).
fn collective<'a>(
    label: usize,
    kind: CommKind,
    team: &'a TeamInfo,
    input: &'a TV,
    output: &'a TV,
    root: Option<usize>,
) -> CommRequest<'a, CudaBuffer> {
    CommRequest::Collective {
        label: CommLabel::new(label),
        kind,
        team,
        input: Some(input),
        output: Some(output),
        root,
        op: ReduceOp::Sum,
    }
}

/// Each rank sends its values to the other through `t`; returns what each received.
fn exchange(
    name: &str,
    make: impl Fn(&mut Rank) -> Box<dyn CommTransport> + Sync,
) -> [Vec<f32>; 2] {
    pair(name, |r| {
        let mut t = make(r);
        let (i, o) = r.values_and_zeros(64);
        let team = r.team.clone();
        r.post(t.as_mut(), &permute(&team, &i, &o));
        r.read(&o)
    })
}

#[test]
fn nccl_transport_alone_moves_a_permute_and_an_all_reduce() {
    if skip("nccl_transport_alone_moves_a_permute_and_an_all_reduce") {
        return;
    }
    let got = exchange("nccl-permute", |_| Box::new(nccl::NcclTransport));
    assert_eq!(got, [values(1, 64), values(0, 64)]);
    let sums = pair("nccl-all-reduce", |r| {
        let (i, o) = r.values_and_zeros(16);
        let team = r.team.clone();
        let req = collective(1, CommKind::AllReduce, &team, &i, &o, None);
        r.post(&mut nccl::NcclTransport, &req);
        r.read(&o)
    });
    let want: Vec<f32> = (0..16).map(|i| (2 * i + 1000) as f32).collect();
    assert_eq!(sums, [want.clone(), want]);
}

/// The hub of the pair, or `None` (after printing why) without peer access.
fn hub_with_peers(test: &str) -> Option<Arc<PeerHub>> {
    let hub = PeerHub::new();
    let devices: Vec<Device> = (0..2).map(|i| Device::new(i).expect("GPU")).collect();
    for (r, d) in devices.iter().enumerate() {
        hub.register(r, d);
    }
    let (ok, _) = hub
        .peer_access(&[0, 1], Duration::from_secs(5), &|| None)
        .expect("peer access");
    if !ok {
        eprintln!("skipped: {test} needs peer access between GPUs 0 and 1");
        return None;
    }
    Some(hub)
}

/// The hub of the pair, or `None` (after printing why) without 2 GPUs with peer access.
fn two_gpus_with_peers(test: &str) -> Option<Arc<PeerHub>> {
    if skip(test) {
        return None;
    }
    hub_with_peers(test)
}

/// How a copy engine of the tests runs its pulls: the copy stream, and when pulls whose
/// offers have not arrived are deferred.
type Setting = (CopyStream, DeferPulls);

/// The settings that every copy-engine test runs in (the policy that defers only before the
/// first compute has its own test).
const SETTINGS: [Setting; 4] = [
    (CopyStream::Current, DeferPulls::Never),
    (CopyStream::Dedicated, DeferPulls::Never),
    (CopyStream::Current, DeferPulls::Always),
    (CopyStream::Dedicated, DeferPulls::Always),
];

/// Runs `f` on the pair once per setting of `settings`, each rank with a copy engine prepared
/// for the pair, and hands each setting's results to `check`. Nothing runs (after printing
/// why) without 2 GPUs with peer access.
fn with_copy_engines<T: Send>(
    test: &str,
    name: &str,
    settings: &[Setting],
    f: impl Fn(&mut Rank, &mut copy_engine::CopyEngine) -> T + Sync,
    check: impl Fn(Setting, [T; 2]),
) {
    let Some(hub) = two_gpus_with_peers(test) else {
        return;
    };
    for &(stream, defer) in settings {
        let link: Arc<dyn PeerLink> = Arc::new(HubLink::new(hub.clone()));
        let got = pair(name, |r| {
            let mut ce = copy_engine::CopyEngine::new(link.clone(), stream, defer);
            ce.prepare_team(&r.core, &r.team).expect("peer access");
            f(r, &mut ce)
        });
        check((stream, defer), got);
    }
}

#[test]
fn copy_engine_transport_alone_moves_permutes_broadcasts_and_reduce_scatters() {
    with_copy_engines(
        "copy_engine_transport_alone_moves_permutes_broadcasts_and_reduce_scatters",
        "ce",
        &SETTINGS,
        |r, ce| {
            let team = r.team.clone();
            let (i, o) = r.values_and_zeros(32);
            r.post(ce, &permute(&team, &i, &o));
            let b = r.zeros(DType::F32, &[32]);
            r.post(
                ce,
                &collective(1, CommKind::Broadcast, &team, &i, &b, Some(1)),
            );
            let rs_out = r.zeros(DType::F32, &[16]);
            let rs = collective(2, CommKind::ReduceScatter, &team, &i, &rs_out, None);
            r.post(ce, &rs);
            (r.read(&o), r.read(&b), r.read(&rs_out))
        },
        |stream, got| {
            for (me, (permuted, broadcast, reduced)) in got.into_iter().enumerate() {
                assert_eq!(permuted, values(1 - me, 32), "{stream:?}");
                assert_eq!(broadcast, values(1, 32), "{stream:?}");
                let want: Vec<f32> = (0..16).map(|i| (2 * (16 * me + i) + 1000) as f32).collect();
                assert_eq!(reduced, want, "{stream:?}");
            }
        },
    );
}

#[test]
fn a_permute_sent_in_place_collects_its_completion_when_its_buffer_is_written() {
    with_copy_engines(
        "a_permute_sent_in_place_collects_its_completion_when_its_buffer_is_written",
        "ce-deferred",
        &SETTINGS,
        |r, ce| {
            let team = r.team.clone();
            let (i, o) = r.values_and_zeros(4096);
            let fresh = TensorData::from_f32(DType::F32, &[4096], &vec![-1.0; 4096]).unwrap();
            let fresh = r.tensor(&fresh);
            r.post(ce, &permute(&team, &i, &o));
            // The post returned without the receiver's report; the first write of the sent
            // buffer collects it and waits for the read on the device.
            let deferred = r.core.uncollected.len();
            r.core.before_writes(&[&o]).expect("unrelated write");
            let after_unrelated = r.core.uncollected.len();
            r.core
                .before_writes(&[&i])
                .expect("write of the sent buffer");
            let after_write = (r.core.uncollected.len(), r.core.pending_reads.len());
            r.core
                .local_copy("overwrite", &fresh, &i)
                .expect("overwrite");
            (
                deferred,
                after_unrelated,
                after_write,
                r.read(&o),
                r.read(&i),
            )
        },
        |stream, got| {
            for (me, (deferred, after_unrelated, after_write, received, sent)) in
                got.into_iter().enumerate()
            {
                assert_eq!(deferred, 1, "{stream:?}: rank {me}");
                assert_eq!(after_unrelated, 1, "{stream:?}: rank {me}");
                assert_eq!(after_write, (0, 1), "{stream:?}: rank {me}");
                assert_eq!(received, values(1 - me, 4096), "{stream:?}: rank {me}");
                assert_eq!(sent, vec![-1.0; 4096], "{stream:?}: rank {me}");
            }
        },
    );
}

#[test]
fn a_pull_posted_before_its_offer_is_deferred_and_enqueued_once_the_offer_is_found() {
    let steps = std::sync::Barrier::new(2);
    let deferring: Vec<Setting> = SETTINGS
        .iter()
        .copied()
        .filter(|s| s.1 == DeferPulls::Always)
        .collect();
    with_copy_engines(
        "a_pull_posted_before_its_offer_is_deferred_and_enqueued_once_the_offer_is_found",
        "ce-defer-pulls",
        &deferring,
        |r, ce| {
            let team = r.team.clone();
            let (i, a) = r.values_and_zeros(1024);
            let b = r.zeros(DType::F32, &[1024]);
            let second = permute_labelled(1, &team, &i, &b);
            // Rank 0 posts each permute before rank 1 has offered: the host does not wait.
            let mut seen = Vec::new();
            if team.my_index == 0 {
                seen.push(r.post(ce, &permute(&team, &i, &a)));
                seen.push(r.core.deferred.len() == 1);
                steps.wait();
                steps.wait();
                // Rank 1 has posted the first: this post finds its offer and enqueues it,
                // then defers the second.
                seen.push(r.post(ce, &second));
                let first_done = r.deferred[0].events.borrow().is_some();
                seen.push(first_done && r.core.deferred.len() == 1);
                steps.wait();
            } else {
                steps.wait();
                seen.push(r.post(ce, &permute(&team, &i, &a)));
                steps.wait();
                steps.wait();
                seen.push(r.post(ce, &second));
            }
            (seen, r.read(&a), r.read(&b))
        },
        |setting, got| {
            let [(seen0, a0, b0), (seen1, a1, b1)] = got;
            assert_eq!(
                seen0,
                [true, true, true, true],
                "{setting:?}: rank 0 deferred"
            );
            assert_eq!(
                seen1,
                [false, false],
                "{setting:?}: rank 1 found the offers"
            );
            assert_eq!((a0, b0), (values(1, 1024), values(1, 1024)), "{setting:?}");
            assert_eq!((a1, b1), (values(0, 1024), values(0, 1024)), "{setting:?}");
        },
    );
}

#[test]
fn before_the_first_compute_a_pull_is_deferred_after_it_the_host_waits() {
    let steps = std::sync::Barrier::new(2);
    let settings = [
        (CopyStream::Current, DeferPulls::BeforeCompute),
        (CopyStream::Dedicated, DeferPulls::BeforeCompute),
    ];
    with_copy_engines(
        "before_the_first_compute_a_pull_is_deferred_after_it_the_host_waits",
        "ce-defer-before-compute",
        &settings,
        |r, ce| {
            let team = r.team.clone();
            let (i, a) = r.values_and_zeros(1024);
            let b = r.zeros(DType::F32, &[1024]);
            let second = permute_labelled(1, &team, &i, &b);
            r.core.step_started().expect("run start");
            let mut seen = Vec::new();
            if team.my_index == 0 {
                // No compute launched yet: the pull without its offer is deferred.
                seen.push(r.post(ce, &permute(&team, &i, &a)));
                r.core.run_host.computing();
                steps.wait();
                // A compute was launched: this post waits for rank 1's offers (the deferred
                // pull first) instead of deferring.
                seen.push(r.post(ce, &second));
            } else {
                steps.wait();
                std::thread::sleep(Duration::from_millis(20));
                seen.push(r.post(ce, &permute(&team, &i, &a)));
                seen.push(r.post(ce, &second));
            }
            (seen, r.read(&a), r.read(&b))
        },
        |setting, got| {
            let [(seen0, a0, b0), (seen1, a1, b1)] = got;
            assert_eq!(seen0, [true, false], "{setting:?}: rank 0");
            assert_eq!(
                seen1,
                [false, false],
                "{setting:?}: rank 1 found the offers"
            );
            assert_eq!((a0, b0), (values(1, 1024), values(1, 1024)), "{setting:?}");
            assert_eq!((a1, b1), (values(0, 1024), values(0, 1024)), "{setting:?}");
        },
    );
}

#[test]
fn host_proxy_transport_alone_moves_a_permute_between_nodes() {
    if skip("host_proxy_transport_alone_moves_a_permute_between_nodes") {
        return;
    }
    let topology = Topology::contiguous(2, 1).expect("two nodes");
    let rdv: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new("transport-proxy-setup"));
    let spec = NodeSpec {
        node: 0,
        topology: topology.clone(),
        host: "127.0.0.1".into(),
        ring: DEFAULT_RING,
        setup_timeout: Duration::from_secs(30),
        wire: WireChoice::Tcp,
    };
    let proxies = connect_proxies(&spec, &[0, 1], &rdv).expect("proxies");
    let proxies: BTreeMap<usize, _> = proxies
        .proxies
        .into_iter()
        .map(|(r, p)| (r, Arc::new(p)))
        .collect();
    let got = exchange("proxy", |r| {
        let access = proxy::ProxyAccess {
            proxy: proxies[&r.team.my_index].clone(),
            topology: topology.clone(),
        };
        Box::new(proxy::HostProxy::new(access))
    });
    assert_eq!(got, [values(1, 64), values(0, 64)]);
}

/// When the top-k weights go to the transport in one step of [`moe_round_trip`].
#[derive(Copy, Clone, Debug)]
enum Weights {
    /// With the dispatch, as f32.
    Early,
    /// With the dispatch, as bf16 (cast on the way).
    EarlyBf16,
    /// With the combine.
    Late,
    /// With the dispatch, but the combine names another view: an error.
    Mismatched,
}

/// Steps of a dispatch, the identity as the experts, and a combine, the weights given as
/// `steps` say: each rank's output is `x[t] · Σ_k w` every step (bit-identical whichever
/// instruction carried the weights). A [`Weights::Mismatched`] step must fail at its combine
/// with an error naming `topk_weights`, and ends the steps.
fn moe_round_trip(
    name: &str,
    steps: &[Weights],
    make: impl Fn(&mut Rank) -> Box<dyn CommTransport> + Sync,
) {
    let (t, h, k, l, c) = (4u64, 8u64, 2u64, 2u64, 8u64);
    let e = 2 * l;
    let got = pair(name, |r| {
        let mut moe = make(r);
        let me = r.team.my_index;
        let team = r.team.clone();
        let x = TensorData::from_f32(DType::F32, &[t, h], &values(me, (t * h) as usize)).unwrap();
        let ids: Vec<i64> = (0..t)
            .flat_map(|tok| [tok % e, (tok + 1 + me as u64) % e])
            .map(|v| v as i64)
            .collect();
        let idx = TensorData::from_i64(DType::I32, &[t, k], &ids).unwrap();
        let w: Vec<f32> = (0..t).flat_map(|_| [0.5, 0.25]).collect();
        let w16 = TensorData::from_f32(DType::BF16, &[t, k], &w).unwrap();
        let w = TensorData::from_f32(DType::F32, &[t, k], &w).unwrap();
        let (x, idx) = (r.tensor(&x), r.tensor(&idx));
        let (w, w16, w_other) = (r.tensor(&w), r.tensor(&w16), r.tensor(&w));
        let ex = r.zeros(DType::F32, &[l, c, h]);
        let counts = r.tensor(&TensorData::from_i64(DType::I32, &[l], &[0; 2]).unwrap());
        let routing = r.tensor(&TensorData::from_i64(DType::I32, &[l, c, 2], &[0; 32]).unwrap());
        let mut outs = Vec::new();
        let mut rows = 0.0f32;
        for (step, how) in steps.iter().enumerate() {
            let out = r.zeros(DType::F32, &[t, h]);
            let (sent, named) = match how {
                Weights::Early => (Some(&w), &w),
                Weights::EarlyBf16 => (Some(&w16), &w16),
                Weights::Late => (None, &w),
                Weights::Mismatched => (Some(&w), &w_other),
            };
            let d = CommRequest::MoeDispatch {
                label: CommLabel::new(0),
                team: &team,
                x: &x,
                topk_idx: &idx,
                expert_x: &ex,
                expert_counts: &counts,
                routing: &routing,
                wire: MoeWire::Native,
                topk_weights: sent,
            };
            r.post(moe.as_mut(), &d);
            let cb = CommRequest::MoeCombine {
                label: CommLabel::new(1),
                team: &team,
                expert_y: &ex,
                expert_counts: &counts,
                routing: &routing,
                topk_weights: named,
                out: &out,
            };
            if let Weights::Mismatched = how {
                let mut cx = PostCx {
                    core: &mut r.core,
                    comms: &r.comms,
                };
                let err = match moe.post(&mut cx, &cb, CTX) {
                    Ok(_) => panic!("step {step}: a combine naming other weights was accepted"),
                    Err(e) => e.to_string(),
                };
                assert!(
                    err.contains("topk_weights") && err.contains("moe_dispatch carried"),
                    "step {step}: {err}"
                );
                // The combine failed before the engine saw it, on both ranks: let the
                // dispatch finish, then drop the engines unhealthy, as after any failed run.
                r.read(&counts);
                moe.release(false);
                return (rows, outs);
            }
            r.post(moe.as_mut(), &cb);
            rows += r.read(&counts).iter().sum::<f32>();
            outs.push(r.read(&out));
        }
        moe.check_status(&r.core).expect("clean MoE status");
        moe.release(true);
        (rows, outs)
    });
    let full = steps
        .iter()
        .filter(|w| !matches!(w, Weights::Mismatched))
        .count();
    let rows: f32 = got.iter().map(|g| g.0).sum();
    assert_eq!(
        rows,
        (full as u64 * 2 * t * k) as f32,
        "every (token, k) reached its expert in every step"
    );
    for (me, (_, outs)) in got.into_iter().enumerate() {
        let want: Vec<f32> = values(me, (t * h) as usize)
            .iter()
            .map(|v| v * 0.75)
            .collect();
        assert_eq!(outs.len(), full, "rank {me}");
        for (step, out) in outs.iter().enumerate() {
            assert_eq!(out, &want, "rank {me}, step {step} ({:?})", steps[step]);
        }
    }
}

/// Weights with the dispatch, with the combine, cast from bf16, and back: the engines switch
/// between the two protocols from one step to the next.
const MIXED: [Weights; 5] = [
    Weights::Late,
    Weights::Early,
    Weights::EarlyBf16,
    Weights::Late,
    Weights::Early,
];

#[test]
fn moe_over_nccl_alone_round_trips_tokens() {
    if skip("moe_over_nccl_alone_round_trips_tokens") {
        return;
    }
    moe_round_trip("moe-nccl", &MIXED, |_| {
        Box::new(moe_nccl::moe_over_nccl(None))
    });
}

#[test]
fn moe_over_nvlink_alone_round_trips_tokens() {
    let Some(hub) = two_gpus_with_peers("moe_over_nvlink_alone_round_trips_tokens") else {
        return;
    };
    let link: Arc<dyn PeerLink> = Arc::new(HubLink::new(hub));
    moe_round_trip("moe-nvlink", &MIXED, |_| {
        Box::new(moe_nvlink::moe_over_nvlink(link.clone()))
    });
}

#[test]
fn moe_combine_naming_other_weights_than_its_dispatch_sent_is_an_error() {
    let test = "moe_combine_naming_other_weights_than_its_dispatch_sent_is_an_error";
    if skip(test) {
        return;
    }
    moe_round_trip(
        "moe-nccl-mismatch",
        &[Weights::Early, Weights::Mismatched],
        |_| Box::new(moe_nccl::moe_over_nccl(None)),
    );
}
