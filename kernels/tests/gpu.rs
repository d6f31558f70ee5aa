//! GPU tests: run on a machine with CUDA devices (and NCCL for the multi-GPU tests). Without a
//! device each test prints `skipped: no CUDA device (<reason>)` to stderr and returns.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use half::{bf16, f16};
use meshflow_kernels::nccl::{self, Comm, NcclLib};
use meshflow_kernels::{
    BinaryOp, DType, Device, DeviceBuffer, DeviceFlag, Element, Event, Gemm, KernelError, ReduceOp,
    Stream, StridedLayout, UnaryOp,
};

/// Opens `n` devices, or prints why the test is skipped and returns `None`.
fn devices(n: usize) -> Option<Vec<Device>> {
    match Device::count() {
        Err(KernelError::NoDevice(why)) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
        Ok(c) if c < n => {
            eprintln!("skipped: no CUDA device (this test needs {n} devices, {c} visible)");
            None
        }
        Ok(_) => Some(
            (0..n)
                .map(|i| Device::new(i).expect("open device"))
                .collect(),
        ),
    }
}

/// Deterministic pseudo-random values in [-2, 2).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Host values of a float dtype, stored as that dtype, and read back as f32.
trait HostFloat: Element + Default + PartialEq + std::fmt::Debug {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl HostFloat for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}
impl HostFloat for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl HostFloat for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

fn upload<T: HostFloat>(stream: &Stream, v: &[f32]) -> DeviceBuffer {
    let host: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
    DeviceBuffer::from_slice(stream, &host).unwrap()
}

fn download<T: HostFloat>(stream: &Stream, b: &DeviceBuffer) -> Vec<f32> {
    b.to_vec::<T>(stream)
        .unwrap()
        .into_iter()
        .map(T::to_f32)
        .collect()
}

/// Poisoned (NaN) output buffer of `n` elements.
fn poisoned(stream: &Stream, dtype: DType, n: usize) -> DeviceBuffer {
    let b = DeviceBuffer::alloc_elems(stream.device(), dtype, n).unwrap();
    stream.device().kernels().poison(stream, dtype, &b).unwrap();
    b
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= abs + rel * w.abs();
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (1e-5, 1e-6),
        DType::BF16 => (1.6e-2, 1e-3),
        _ => (2e-3, 1e-4),
    }
}

#[test]
fn device_errors_are_values() {
    let Some(_devs) = devices(1) else { return };
    let count = Device::count().unwrap();
    match Device::new(count + 3) {
        Err(KernelError::NoDevice(msg)) => assert!(msg.contains("visible"), "{msg}"),
        other => panic!("expected NoDevice, got {other:?}"),
    }
}

#[test]
fn buffers_round_trip() {
    let Some(devs) = devices(1) else { return };
    let dev = &devs[0];
    let stream = Stream::new(dev).unwrap();
    let data: Vec<i64> = (0..1000).map(|i| i * 3 - 7).collect();
    let a = DeviceBuffer::from_slice(&stream, &data).unwrap();
    assert_eq!(a.to_vec::<i64>(&stream).unwrap(), data);

    // Views: copy the second half of `a` onto the first quarter..half of `b`.
    let b = DeviceBuffer::alloc(dev, a.len()).unwrap();
    b.zero(&stream).unwrap();
    let half = a.chunk(1, 2).unwrap();
    b.view(2000, 4000)
        .unwrap()
        .copy_from(&stream, &half)
        .unwrap();
    let got = b.to_vec::<i64>(&stream).unwrap();
    assert!(got[..250].iter().all(|v| *v == 0));
    assert_eq!(&got[250..750], &data[500..]);
    assert!(got[750..].iter().all(|v| *v == 0));
    assert!(a.view(1, a.len()).is_err());
    assert!(half.overlaps(&a) && !half.overlaps(&a.chunk(0, 2).unwrap()));

    // Stream-ordered allocation, memset, bf16 upload.
    let c = DeviceBuffer::alloc_async(&stream, 64).unwrap();
    c.memset(&stream, 0xAB).unwrap();
    assert!(c.to_vec::<u8>(&stream).unwrap().iter().all(|b| *b == 0xAB));
    let h: Vec<bf16> = random(32, 1).into_iter().map(bf16::from_f32).collect();
    let d = DeviceBuffer::from_slice(&stream, &h).unwrap();
    assert_eq!(d.to_vec::<bf16>(&stream).unwrap(), h);
    let empty = DeviceBuffer::alloc(dev, 0).unwrap();
    assert!(empty.to_vec::<f32>(&stream).unwrap().is_empty());
    assert!(a.upload(&stream, &data[..10]).is_err());
}

#[test]
fn events_order_streams_and_time() {
    let Some(devs) = devices(1) else { return };
    let dev = &devs[0];
    let (s1, s2) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
    let n = 1 << 22;
    let src = DeviceBuffer::alloc_elems(dev, DType::F32, n).unwrap();
    let dst = poisoned(&s2, DType::F32, n);
    s2.synchronize().unwrap();
    let start = Event::timing(dev).unwrap();
    let end = Event::timing(dev).unwrap();
    start.record(&s1).unwrap();
    dev.kernels().fill(&s1, DType::F32, &src, 1.5).unwrap();
    end.record(&s1).unwrap();
    s2.wait(&end).unwrap();
    dst.copy_from(&s2, &src).unwrap();
    let got = dst.to_vec::<f32>(&s2).unwrap();
    assert!(got.iter().all(|v| *v == 1.5));
    end.synchronize().unwrap();
    assert!(end.is_complete().unwrap());
    let ms = Event::elapsed_ms(&start, &end).unwrap();
    assert!(ms >= 0.0, "{ms}");
    let plain = Event::new(dev).unwrap();
    assert!(Event::elapsed_ms(&plain, &end).is_err());
}

/// Raises a flag past every wait when dropped, so that a failing test cannot leave a stream
/// blocked forever (dropping it would then hang).
struct ReleaseOnDrop<'a>(&'a DeviceFlag, &'a Stream);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.signal(self.1, 1 << 30);
        let _ = self.1.synchronize();
    }
}

#[test]
fn device_flags_hold_and_release_streams() {
    let Some(devs) = devices(1) else { return };
    let dev = &devs[0];
    let (waiter, other) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
    let flag = DeviceFlag::new(dev).unwrap();
    let n = 1 << 16;
    let buf = DeviceBuffer::alloc_elems(dev, DType::F32, n).unwrap();
    // Load the fill kernel now: loading a module while a stream waits on a flag that only a
    // later call raises may synchronize the context and never return.
    dev.kernels().fill(&other, DType::F32, &buf, 0.0).unwrap();
    other.synchronize().unwrap();
    let _release = ReleaseOnDrop(&flag, &other);
    // The waiter's fill must not run before the flag reaches 2.
    flag.wait(&waiter, 2).unwrap();
    dev.kernels().fill(&waiter, DType::F32, &buf, 4.0).unwrap();
    let done = waiter.record_event().unwrap();
    flag.signal(&other, 1).unwrap();
    other.synchronize().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!done.is_complete().unwrap(), "the wait for 2 passed at 1");
    assert!(buf.to_vec::<f32>(&other).unwrap().iter().all(|v| *v == 0.0));
    flag.signal(&other, 2).unwrap();
    done.synchronize().unwrap();
    assert!(buf.to_vec::<f32>(&other).unwrap().iter().all(|v| *v == 4.0));
    // A waiter behind the flag passes at once.
    flag.wait(&waiter, 1).unwrap();
    waiter.synchronize().unwrap();
    // A wait on a stream of another device is refused.
    let Some(two) = devices(2) else { return };
    assert!(flag.wait(&Stream::new(&two[1]).unwrap(), 1).is_err());
}

#[test]
fn device_flags_signal_across_devices() {
    let Some(devs) = devices(2) else { return };
    if !devs[1].can_access_peer(&devs[0]).unwrap() {
        eprintln!("skipped: devices 0 and 1 have no peer access");
        return;
    }
    devs[1].enable_peer_access(&devs[0]).unwrap();
    devs[0].enable_peer_access(&devs[1]).unwrap();
    let (s0, s1) = (
        Stream::new(&devs[0]).unwrap(),
        Stream::new(&devs[1]).unwrap(),
    );
    let flag = DeviceFlag::new(&devs[0]).unwrap();
    let v = random(1 << 20, 5);
    let src = DeviceBuffer::from_slice(&s1, &v).unwrap();
    let landing = DeviceBuffer::alloc(&devs[0], src.len()).unwrap();
    let out = DeviceBuffer::alloc(&devs[0], src.len()).unwrap();
    // Device 0 copies `landing` once device 1's stream has pushed into it and raised the flag.
    let _release = ReleaseOnDrop(&flag, &s1);
    flag.wait(&s0, 1).unwrap();
    out.copy_from(&s0, &landing).unwrap();
    landing.copy_from_peer(&s1, &src).unwrap();
    flag.signal(&s1, 1).unwrap();
    assert_eq!(out.to_vec::<f32>(&s0).unwrap(), v);
}

#[test]
fn every_kernel_source_compiles() {
    let Some(devs) = devices(1) else { return };
    devs[0].kernels().load_all().unwrap();
}

fn check_elementwise<T: HostFloat>(stream: &Stream, dtype: DType) {
    let k = stream.device().kernels();
    let (rel, abs) = tolerance(dtype);
    // 1003 elements: vectorized body plus a scalar tail. The offset views are misaligned and
    // take the scalar path only.
    for (n, offset) in [(1003usize, 0usize), (517, 1)] {
        let a32 = random(n + offset, 11);
        let b32 = random(n + offset, 12);
        let a_full = upload::<T>(stream, &a32);
        let b_full = upload::<T>(stream, &b32);
        let esz = dtype.size_bytes();
        let a = a_full.view(offset * esz, n * esz).unwrap();
        let b = b_full.view(offset * esz, n * esz).unwrap();
        let ar: Vec<f32> = a32[offset..]
            .iter()
            .map(|x| T::from_f32(*x).to_f32())
            .collect();
        let br: Vec<f32> = b32[offset..]
            .iter()
            .map(|x| T::from_f32(*x).to_f32())
            .collect();
        for op in BinaryOp::ALL {
            let out = poisoned(stream, dtype, n);
            k.binary(stream, op, dtype, &a, &b, &out).unwrap();
            let want: Vec<f32> = ar
                .iter()
                .zip(&br)
                .map(|(x, y)| {
                    let v = match op {
                        BinaryOp::Add => x + y,
                        BinaryOp::Sub => x - y,
                        BinaryOp::Mul => x * y,
                    };
                    T::from_f32(v).to_f32()
                })
                .collect();
            // add/sub/mul are exact in f32 and then rounded once: bit-exact.
            assert_eq!(download::<T>(stream, &out), want, "{op:?} {dtype} n={n}");
        }
        for op in UnaryOp::ALL {
            let out = poisoned(stream, dtype, n);
            k.unary(stream, op, dtype, &a, &out).unwrap();
            let want: Vec<f32> = ar
                .iter()
                .map(|x| {
                    let v = match op {
                        UnaryOp::GeluTanh => {
                            0.5 * x
                                * (1.0
                                    + ((2.0 / std::f32::consts::PI).sqrt()
                                        * (x + 0.044715 * x * x * x))
                                        .tanh())
                        }
                        UnaryOp::Silu => x / (1.0 + (-x).exp()),
                    };
                    T::from_f32(v).to_f32()
                })
                .collect();
            assert_close(
                &format!("{op:?} {dtype}"),
                &download::<T>(stream, &out),
                &want,
                rel,
                abs,
            );
        }
    }
}

#[test]
fn elementwise_kernels_match_cpu() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    check_elementwise::<f32>(&stream, DType::F32);
    check_elementwise::<bf16>(&stream, DType::BF16);
    check_elementwise::<f16>(&stream, DType::F16);
    // In place: a = a + a.
    let a = upload::<f32>(&stream, &[1.0, 2.0, 3.0]);
    devs[0]
        .kernels()
        .binary(&stream, BinaryOp::Add, DType::F32, &a, &a, &a)
        .unwrap();
    assert_eq!(download::<f32>(&stream, &a), vec![2.0, 4.0, 6.0]);
    let i = DeviceBuffer::alloc_elems(&devs[0], DType::I32, 3).unwrap();
    assert!(matches!(
        devs[0]
            .kernels()
            .binary(&stream, BinaryOp::Add, DType::I32, &i, &i, &i),
        Err(KernelError::Unsupported(_))
    ));
}

#[test]
fn casts_match_cpu() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    let k = devs[0].kernels();
    let mut v = random(777, 5);
    v.extend([
        0.0,
        -0.0,
        1e-8,
        65504.0,
        70000.0,
        f32::INFINITY,
        f32::NAN,
        3.0e38,
    ]);
    let n = v.len();
    let bits = |dtype: DType, b: &DeviceBuffer| -> Vec<u32> {
        match dtype {
            DType::F32 => b
                .to_vec::<f32>(&stream)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            DType::BF16 => b
                .to_vec::<bf16>(&stream)
                .unwrap()
                .iter()
                .map(|x| u32::from(x.to_bits()))
                .collect(),
            _ => b
                .to_vec::<f16>(&stream)
                .unwrap()
                .iter()
                .map(|x| u32::from(x.to_bits()))
                .collect(),
        }
    };
    let host_bits = |dtype: DType, x: f32| -> u32 {
        match dtype {
            DType::F32 => x.to_bits(),
            DType::BF16 => u32::from(bf16::from_f32(x).to_bits()),
            _ => u32::from(f16::from_f32(x).to_bits()),
        }
    };
    let floats = [DType::F32, DType::BF16, DType::F16];
    for src in floats {
        let src_buf = match src {
            DType::F32 => upload::<f32>(&stream, &v),
            DType::BF16 => upload::<bf16>(&stream, &v),
            _ => upload::<f16>(&stream, &v),
        };
        let src_vals: Vec<f32> = match src {
            DType::F32 => download::<f32>(&stream, &src_buf),
            DType::BF16 => download::<bf16>(&stream, &src_buf),
            _ => download::<f16>(&stream, &src_buf),
        };
        for dst in floats {
            let out = poisoned(&stream, dst, n);
            k.cast(&stream, &src_buf, src, &out, dst).unwrap();
            let want: Vec<u32> = src_vals.iter().map(|x| host_bits(dst, *x)).collect();
            let got = bits(dst, &out);
            for i in 0..n {
                let is_nan = src_vals[i].is_nan();
                assert!(
                    got[i] == want[i] || is_nan,
                    "cast {src}->{dst} of {}: got {:#x}, want {:#x}",
                    src_vals[i],
                    got[i],
                    want[i]
                );
            }
        }
    }
    let ints: Vec<i64> = vec![0, 1, -1, i64::from(i32::MAX), i64::from(i32::MIN), 1 << 40];
    let i64_buf = DeviceBuffer::from_slice(&stream, &ints).unwrap();
    let i32_buf = DeviceBuffer::alloc_elems(&devs[0], DType::I32, ints.len()).unwrap();
    k.cast(&stream, &i64_buf, DType::I64, &i32_buf, DType::I32)
        .unwrap();
    let narrow = i32_buf.to_vec::<i32>(&stream).unwrap();
    assert_eq!(narrow, ints.iter().map(|x| *x as i32).collect::<Vec<_>>());
    let back = DeviceBuffer::alloc_elems(&devs[0], DType::I64, ints.len()).unwrap();
    k.cast(&stream, &i32_buf, DType::I32, &back, DType::I64)
        .unwrap();
    assert_eq!(
        back.to_vec::<i64>(&stream).unwrap(),
        narrow.iter().map(|x| i64::from(*x)).collect::<Vec<_>>()
    );
}

/// CPU strided gather: element at row-major index of `shape` read through `layout`.
fn cpu_gather<T: Copy>(src: &[T], layout: &StridedLayout) -> Vec<T> {
    let n = layout.numel();
    (0..n)
        .map(|mut i| {
            let mut off = layout.offset;
            for d in (0..layout.shape.len()).rev() {
                off += (i % layout.shape[d]) * layout.strides[d];
                i /= layout.shape[d];
            }
            src[off]
        })
        .collect()
}

#[test]
fn strided_copy_and_permute_match_cpu() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    let k = devs[0].kernels();
    let shape = [2usize, 3, 4, 5];
    let perm = [3usize, 1, 0, 2];
    let n: usize = shape.iter().product();
    let view = StridedLayout::contiguous(&shape).permuted(&perm).unwrap();

    let v64: Vec<i64> = (0..n as i64).map(|i| i * 31 - 5).collect();
    let src = DeviceBuffer::from_slice(&stream, &v64).unwrap();
    let dst = poisoned(&stream, DType::I64, n);
    k.permute(&stream, DType::I64, &src, &shape, &perm, &dst)
        .unwrap();
    assert_eq!(dst.to_vec::<i64>(&stream).unwrap(), cpu_gather(&v64, &view));

    let vb: Vec<bf16> = random(n, 9).into_iter().map(bf16::from_f32).collect();
    let src = DeviceBuffer::from_slice(&stream, &vb).unwrap();
    let dst = poisoned(&stream, DType::BF16, n);
    k.permute(&stream, DType::BF16, &src, &shape, &perm, &dst)
        .unwrap();
    assert_eq!(dst.to_vec::<bf16>(&stream).unwrap(), cpu_gather(&vb, &view));

    // A column slice of a [6, 10] f32 matrix (cols 3..7), with an offset, materialized.
    let m: Vec<f32> = random(60, 10);
    let src = DeviceBuffer::from_slice(&stream, &m).unwrap();
    let slice = StridedLayout {
        shape: vec![6, 4],
        strides: vec![10, 1],
        offset: 3,
    };
    let dst = poisoned(&stream, DType::F32, 24);
    k.strided_copy(
        &stream,
        DType::F32,
        &src,
        &slice,
        &dst,
        &StridedLayout::contiguous(&[6, 4]),
    )
    .unwrap();
    assert_eq!(dst.to_vec::<f32>(&stream).unwrap(), cpu_gather(&m, &slice));
    // Out of bounds is refused before launch.
    let too_far = StridedLayout {
        shape: vec![6, 4],
        strides: vec![10, 1],
        offset: 7,
    };
    assert!(k
        .strided_copy(
            &stream,
            DType::F32,
            &src,
            &too_far,
            &dst,
            &StridedLayout::contiguous(&[6, 4])
        )
        .is_err());
    // u8 (1-byte) elements.
    let bytes: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
    let src = DeviceBuffer::from_slice(&stream, &bytes).unwrap();
    let dst = poisoned(&stream, DType::U8, n);
    k.permute(&stream, DType::U8, &src, &shape, &perm, &dst)
        .unwrap();
    assert_eq!(
        dst.to_vec::<u8>(&stream).unwrap(),
        cpu_gather(&bytes, &view)
    );
}

fn cpu_sum(v: &[f32], shape: &[usize], axis: usize) -> Vec<f32> {
    let outer: usize = shape[..axis].iter().product();
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = vec![0.0f64; outer * inner];
    for o in 0..outer {
        for k in 0..len {
            for j in 0..inner {
                out[o * inner + j] += f64::from(v[(o * len + k) * inner + j]);
            }
        }
    }
    out.into_iter().map(|x| x as f32).collect()
}

fn check_sum<T: HostFloat, O: HostFloat>(stream: &Stream, dtype: DType, out_dtype: DType) {
    let k = stream.device().kernels();
    for (shape, axis) in [
        (vec![4usize, 37, 9], 0usize),
        (vec![4, 37, 9], 1),
        (vec![4, 37, 9], 2),
        (vec![3, 5000], 1),
    ] {
        let n: usize = shape.iter().product();
        let v = random(n, 21);
        let src = upload::<T>(stream, &v);
        let vr: Vec<f32> = v.iter().map(|x| T::from_f32(*x).to_f32()).collect();
        let want: Vec<f32> = cpu_sum(&vr, &shape, axis)
            .into_iter()
            .map(|x| O::from_f32(x).to_f32())
            .collect();
        let dst = poisoned(stream, out_dtype, n / shape[axis]);
        k.sum_axis(stream, dtype, &src, &shape, axis, &dst, out_dtype)
            .unwrap();
        let (rel, _) = tolerance(out_dtype);
        // Sums of up to 5000 terms of size ~1: allow accumulation-order error.
        let abs = if out_dtype == DType::F32 { 2e-3 } else { 0.1 };
        assert_close(
            &format!("sum {dtype}->{out_dtype} {shape:?} axis {axis}"),
            &download::<O>(stream, &dst),
            &want,
            rel,
            abs,
        );
    }
}

#[test]
fn sum_axis_matches_cpu() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    check_sum::<f32, f32>(&stream, DType::F32, DType::F32);
    check_sum::<bf16, bf16>(&stream, DType::BF16, DType::BF16);
    check_sum::<bf16, f32>(&stream, DType::BF16, DType::F32);
    check_sum::<f16, f16>(&stream, DType::F16, DType::F16);
    check_sum::<f16, f32>(&stream, DType::F16, DType::F32);
}

#[test]
fn fill_writes_values() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    let k = devs[0].kernels();
    let b = DeviceBuffer::alloc_elems(&devs[0], DType::I32, 1001).unwrap();
    k.fill(&stream, DType::I32, &b, -7.0).unwrap();
    assert!(b.to_vec::<i32>(&stream).unwrap().iter().all(|v| *v == -7));
    k.fill(&stream, DType::BF16, &b, 0.5).unwrap();
    assert!(b
        .to_vec::<bf16>(&stream)
        .unwrap()
        .iter()
        .all(|v| v.to_f32() == 0.5));
    k.poison(&stream, DType::F32, &b).unwrap();
    assert!(b.to_vec::<f32>(&stream).unwrap().iter().all(|v| v.is_nan()));
    let l = DeviceBuffer::alloc_elems(&devs[0], DType::I64, 5).unwrap();
    k.fill(&stream, DType::I64, &l, 1e15).unwrap();
    assert_eq!(
        l.to_vec::<i64>(&stream).unwrap(),
        vec![1_000_000_000_000_000; 5]
    );
}

/// CPU GEMM in f64: C[b] = A[b] @ op(B[b]).
fn cpu_gemm(a: &[f32], b: &[f32], g: &Gemm) -> Vec<f32> {
    let (m, n, k) = (g.m, g.n, g.k);
    let mut c = vec![0.0f32; g.batch * m * n];
    for bi in 0..g.batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for p in 0..k {
                    let av = a[bi * m * k + i * k + p];
                    let bv = match g.layout {
                        meshflow_kernels::GemmLayout::Nn => b[bi * k * n + p * n + j],
                        meshflow_kernels::GemmLayout::Nt => b[bi * n * k + j * k + p],
                    };
                    acc += f64::from(av) * f64::from(bv);
                }
                c[bi * m * n + i * n + j] = acc as f32;
            }
        }
    }
    c
}

fn check_gemm<T: HostFloat, O: HostFloat>(stream: &Stream, g: &Gemm, tol: f32) {
    let a32 = random(g.batch * g.m * g.k, 31);
    let b32 = random(g.batch * g.k * g.n, 32);
    let a = upload::<T>(stream, &a32);
    let b = upload::<T>(stream, &b32);
    let ar: Vec<f32> = a32.iter().map(|x| T::from_f32(*x).to_f32()).collect();
    let br: Vec<f32> = b32.iter().map(|x| T::from_f32(*x).to_f32()).collect();
    let c = poisoned(stream, g.out_dtype, g.batch * g.m * g.n);
    g.run(stream, &a, &b, &c).unwrap();
    let got = download::<O>(stream, &c);
    let want = cpu_gemm(&ar, &br, g);
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = got
        .iter()
        .zip(&want)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err.is_finite() && err <= tol * scale,
        "{g:?}: max error {err}, scale {scale}"
    );
}

#[test]
fn gemm_matches_cpu() {
    let Some(devs) = devices(1) else { return };
    let stream = Stream::new(&devs[0]).unwrap();
    let (m, n, k) = (67, 45, 129);
    for g in [
        Gemm::new(m, n, k, DType::F32),
        Gemm::linear(m, n, k, DType::F32),
        Gemm::linear(m, n, k, DType::F32).batched(3),
    ] {
        check_gemm::<f32, f32>(&stream, &g, 1e-4);
    }
    for g in [
        Gemm::new(m, n, k, DType::BF16),
        Gemm::linear(m, n, k, DType::BF16),
        Gemm::new(m, n, k, DType::BF16).batched(4),
    ] {
        check_gemm::<bf16, bf16>(&stream, &g, 1e-2);
    }
    let g = Gemm {
        out_dtype: DType::F32,
        ..Gemm::linear(m, n, k, DType::BF16)
    };
    check_gemm::<bf16, f32>(&stream, &g, 1e-4);
    check_gemm::<f16, f16>(&stream, &Gemm::linear(m, n, k, DType::F16), 2e-3);
    // Accumulate: beta = 1 adds onto C.
    let a = upload::<f32>(&stream, &[1.0; 4]);
    let c = upload::<f32>(&stream, &[10.0; 4]);
    Gemm {
        beta: 1.0,
        ..Gemm::new(2, 2, 2, DType::F32)
    }
    .run(&stream, &a, &a, &c)
    .unwrap();
    assert_eq!(download::<f32>(&stream, &c), vec![12.0; 4]);
    // Undersized operand is refused.
    assert!(Gemm::new(4, 4, 4, DType::F32)
        .run(&stream, &a, &a, &c)
        .is_err());
}

fn load_nccl() -> std::sync::Arc<NcclLib> {
    NcclLib::load().unwrap_or_else(|e| panic!("devices are present but NCCL is not: {e}"))
}

#[test]
fn peer_copy_between_devices() {
    let Some(devs) = devices(2) else { return };
    let s0 = Stream::new(&devs[0]).unwrap();
    let s1 = Stream::new(&devs[1]).unwrap();
    let v: Vec<f32> = random(4096, 3);
    let a = DeviceBuffer::from_slice(&s0, &v).unwrap();
    let b = DeviceBuffer::alloc(&devs[1], a.len()).unwrap();
    if devs[0].can_access_peer(&devs[1]).unwrap() {
        devs[1].enable_peer_access(&devs[0]).unwrap();
        devs[1].enable_peer_access(&devs[0]).unwrap();
    }
    b.copy_from(&s1, &a).unwrap();
    assert_eq!(b.to_vec::<f32>(&s1).unwrap(), v);
}

#[test]
fn nccl_two_devices_one_process() {
    let Some(devs) = devices(2) else { return };
    let lib = load_nccl();
    eprintln!("NCCL {:?} from {}", lib.version(), lib.path());
    let comms = Comm::init_all(&lib, &devs).unwrap();
    assert_eq!(
        (comms[0].rank(), comms[1].rank(), comms[0].size()),
        (0, 1, 2)
    );
    let streams: Vec<Stream> = devs.iter().map(|d| Stream::new(d).unwrap()).collect();
    let n = 1 << 16;
    let inputs: Vec<Vec<f32>> = (0..2).map(|r| random(n, 100 + r as u64)).collect();
    let send: Vec<DeviceBuffer> = (0..2)
        .map(|r| DeviceBuffer::from_slice(&streams[r], &inputs[r]).unwrap())
        .collect();
    let run = |f: &dyn Fn(usize) -> meshflow_kernels::Result<()>| {
        nccl::group(&lib, || (0..2).try_for_each(f)).unwrap();
        streams.iter().for_each(|s| s.synchronize().unwrap());
    };
    let out = |r: usize, elems: usize| poisoned(&streams[r], DType::F32, elems);

    // all_reduce (sum).
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    run(&|r| comms[r].all_reduce(&send[r], &recv[r], DType::F32, ReduceOp::Sum, &streams[r]));
    let want: Vec<f32> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(a, b)| a + b)
        .collect();
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            want,
            "all_reduce rank {r}"
        );
    }

    // all_gather.
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, 2 * n)).collect();
    run(&|r| comms[r].all_gather(&send[r], &recv[r], DType::F32, &streams[r]));
    let want: Vec<f32> = inputs.concat();
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            want,
            "all_gather rank {r}"
        );
    }

    // reduce_scatter (max).
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n / 2)).collect();
    run(&|r| comms[r].reduce_scatter(&send[r], &recv[r], DType::F32, ReduceOp::Max, &streams[r]));
    let full: Vec<f32> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(a, b)| a.max(*b))
        .collect();
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            full[r * n / 2..(r + 1) * n / 2],
            "reduce_scatter rank {r}"
        );
    }

    // broadcast from rank 1.
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    run(&|r| comms[r].broadcast(&send[r], &recv[r], DType::F32, 1, &streams[r]));
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            inputs[1],
            "broadcast rank {r}"
        );
    }

    // send/recv ring: rank r sends to r+1, receives from r-1.
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    run(&|r| {
        comms[r].send(&send[r], DType::F32, (r + 1) % 2, &streams[r])?;
        comms[r].recv(&recv[r], DType::F32, (r + 1) % 2, &streams[r])
    });
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            inputs[(r + 1) % 2],
            "ring rank {r}"
        );
    }

    // all_to_all: chunk j of rank r lands in chunk r of rank j.
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    run(&|r| comms[r].all_to_all(&send[r], &recv[r], DType::F32, &streams[r]));
    let h = n / 2;
    for r in 0..2 {
        let want: Vec<f32> = (0..2)
            .flat_map(|src| inputs[src][r * h..(r + 1) * h].to_vec())
            .collect();
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            want,
            "all_to_all rank {r}"
        );
    }

    // gather to rank 0 and scatter from rank 0.
    let g0 = out(0, 2 * n);
    run(&|r| {
        comms[r].gather(
            &send[r],
            (r == 0).then_some(&g0),
            DType::F32,
            0,
            &streams[r],
        )
    });
    assert_eq!(
        g0.to_vec::<f32>(&streams[0]).unwrap(),
        inputs.concat(),
        "gather"
    );
    let recv: Vec<DeviceBuffer> = (0..2).map(|r| out(r, h)).collect();
    run(&|r| {
        comms[r].scatter(
            (r == 0).then_some(&send[0]),
            &recv[r],
            DType::F32,
            0,
            &streams[r],
        )
    });
    for r in 0..2 {
        assert_eq!(
            recv[r].to_vec::<f32>(&streams[r]).unwrap(),
            inputs[0][r * h..(r + 1) * h],
            "scatter rank {r}"
        );
    }

    // bf16 all_reduce.
    let hb: Vec<Vec<bf16>> = inputs
        .iter()
        .map(|v| v.iter().map(|x| bf16::from_f32(*x)).collect())
        .collect();
    let sb: Vec<DeviceBuffer> = (0..2)
        .map(|r| DeviceBuffer::from_slice(&streams[r], &hb[r]).unwrap())
        .collect();
    run(&|r| comms[r].all_reduce(&sb[r], &sb[r], DType::BF16, ReduceOp::Sum, &streams[r]));
    let want: Vec<bf16> = hb[0]
        .iter()
        .zip(&hb[1])
        .map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32()))
        .collect();
    assert_eq!(
        sb[0].to_vec::<bf16>(&streams[0]).unwrap(),
        want,
        "bf16 all_reduce"
    );

    // Two communicators in one group: split copies of the world, then an all_reduce on both
    // the world and the split communicators inside one group.
    let split = nccl::split_all(&comms, &[(Some(0), 0), (Some(0), 1)]).unwrap();
    let split: Vec<Comm> = split
        .into_iter()
        .map(|c| c.expect("both ranks joined color 0"))
        .collect();
    assert_eq!(
        (split[0].rank(), split[1].rank(), split[1].size()),
        (0, 1, 2)
    );
    let a: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    let b: Vec<DeviceBuffer> = (0..2).map(|r| out(r, n)).collect();
    run(&|r| {
        comms[r].all_reduce(&send[r], &a[r], DType::F32, ReduceOp::Sum, &streams[r])?;
        split[r].all_reduce(&send[r], &b[r], DType::F32, ReduceOp::Min, &streams[r])
    });
    let sum: Vec<f32> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(x, y)| x + y)
        .collect();
    let min: Vec<f32> = inputs[0]
        .iter()
        .zip(&inputs[1])
        .map(|(x, y)| x.min(*y))
        .collect();
    for r in 0..2 {
        assert_eq!(
            a[r].to_vec::<f32>(&streams[r]).unwrap(),
            sum,
            "grouped world rank {r}"
        );
        assert_eq!(
            b[r].to_vec::<f32>(&streams[r]).unwrap(),
            min,
            "grouped split rank {r}"
        );
    }
    for c in comms.iter().chain(&split) {
        c.check_async_error().unwrap();
    }
    nccl::teardown(split).unwrap();
    nccl::teardown(comms).unwrap();
}

#[test]
fn nccl_unique_id_and_errors() {
    let Some(_devs) = devices(1) else { return };
    let lib = load_nccl();
    let id = nccl::UniqueId::new(&lib).unwrap();
    assert_eq!(nccl::UniqueId::from_bytes(id.to_bytes()), id);
    assert!(lib.has_native_all_to_all());
}
