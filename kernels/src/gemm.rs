//! Row-major GEMMs through cuBLAS (`cublasGemmEx` / `cublasGemmStridedBatchedEx`), f32 accumulation.

use std::ffi::{c_int, c_longlong, c_void};

use cudarc::cublas::{result as blas, sys as bsys};

use crate::buffer::DeviceBuffer;
use crate::dtype::DType;
use crate::error::{KernelError, Result};
use crate::probe;
use crate::stream::Stream;

/// A cuBLAS handle bound to one stream; owned by that [`Stream`].
pub(crate) struct BlasHandle(bsys::cublasHandle_t);
// SAFETY: the handle is only used under the owning stream's mutex.
unsafe impl Send for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate and used by nobody else now.
        if let Err(e) = unsafe { blas::destroy_handle(self.0) } {
            tracing::warn!("cublasDestroy failed: {e}");
        }
    }
}

/// Layout of the B operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmLayout {
    /// `C[M,N] = A[M,K] @ B[K,N]`.
    Nn,
    /// `C[M,N] = A[M,K] @ B[N,K]^T` (the "linear" form: B holds weights as `[out, in]`).
    Nt,
}

/// One (optionally batched) GEMM on row-major operands: `C = alpha * A @ op(B) + beta * C`, with
/// f32 accumulation. Build with [`Gemm::new`] / [`Gemm::linear`], adjust fields, then
/// [`run`](Gemm::run).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemm {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Element type of A and B (`F32`, `BF16` or `F16`).
    pub dtype: DType,
    /// Element type of C (`dtype` or `F32`).
    pub out_dtype: DType,
    /// Layout of B.
    pub layout: GemmLayout,
    /// Number of independent GEMMs (1 = not batched).
    pub batch: usize,
    /// Element strides between consecutive batch entries of A, B and C (defaults: packed).
    pub batch_strides: [usize; 3],
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the previous C (0 = overwrite).
    pub beta: f32,
    /// For f32 inputs, allow TF32 tensor cores (faster, ~10-bit mantissa products).
    pub allow_tf32: bool,
}

impl Gemm {
    /// `C[M,N] = A[M,K] @ B[K,N]` with packed operands, C of the same dtype.
    pub fn new(m: usize, n: usize, k: usize, dtype: DType) -> Gemm {
        Gemm {
            m,
            n,
            k,
            dtype,
            out_dtype: dtype,
            layout: GemmLayout::Nn,
            batch: 1,
            batch_strides: [m * k, k * n, m * n],
            alpha: 1.0,
            beta: 0.0,
            allow_tf32: false,
        }
    }

    /// `C[M,N] = A[M,K] @ B[N,K]^T` (linear layer with `[out, in]` weights).
    pub fn linear(m: usize, n: usize, k: usize, dtype: DType) -> Gemm {
        Gemm {
            layout: GemmLayout::Nt,
            ..Gemm::new(m, n, k, dtype)
        }
    }

    /// The same GEMM repeated over `batch` packed operand sets (`[batch, M, K]` etc.).
    pub fn batched(self, batch: usize) -> Gemm {
        let strides = [self.m * self.k, self.k * self.n, self.m * self.n];
        Gemm {
            batch,
            batch_strides: strides,
            ..self
        }
    }

    /// Floating-point operations (2·M·N·K per batch entry).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    fn check(&self, a: &DeviceBuffer, b: &DeviceBuffer, c: &DeviceBuffer) -> Result<()> {
        let io_ok = matches!(
            (self.dtype, self.out_dtype),
            (DType::F32, DType::F32)
                | (DType::BF16, DType::BF16 | DType::F32)
                | (DType::F16, DType::F16 | DType::F32)
        );
        if !io_ok {
            return Err(KernelError::Unsupported(format!(
                "GEMM with {} inputs and {} output",
                self.dtype, self.out_dtype
            )));
        }
        let need = |rows: usize, cols: usize, stride: usize, dtype: DType| -> Option<usize> {
            let one = rows.checked_mul(cols)?;
            let last = self.batch.checked_sub(1)?.checked_mul(stride)?;
            last.checked_add(one)?.checked_mul(dtype.size_bytes())
        };
        let [sa, sb, sc] = self.batch_strides;
        let checks = [
            ("A", a, need(self.m, self.k, sa, self.dtype)),
            ("B", b, need(self.k, self.n, sb, self.dtype)),
            ("C", c, need(self.m, self.n, sc, self.out_dtype)),
        ];
        for (name, buf, bytes) in checks {
            let bytes = bytes.ok_or_else(|| {
                KernelError::InvalidArgument(format!("GEMM operand {name} size overflows"))
            })?;
            if buf.len() < bytes {
                return Err(KernelError::InvalidArgument(format!(
                    "GEMM {}x{}x{} (batch {}): operand {name} needs {bytes} bytes, buffer has {}",
                    self.m,
                    self.n,
                    self.k,
                    self.batch,
                    buf.len()
                )));
            }
        }
        Ok(())
    }

    /// Enqueues the GEMM on `stream`; all buffers must be on the stream's device.
    pub fn run(
        &self,
        stream: &Stream,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        c: &DeviceBuffer,
    ) -> Result<()> {
        for (name, buf) in [("A", a), ("B", b), ("C", c)] {
            stream.expect_device(buf.device(), &format!("GEMM operand {name}"))?;
        }
        if self.batch == 0 || self.m == 0 || self.n == 0 {
            return Ok(());
        }
        self.check(a, b, c)?;
        let int = |v: usize, what: &str| {
            c_int::try_from(v).map_err(|_| {
                KernelError::Unsupported(format!("GEMM {what} = {v} does not fit cuBLAS's int"))
            })
        };
        let long = |v: usize| c_longlong::try_from(v).unwrap_or(c_longlong::MAX);
        let (m, n, k) = (int(self.m, "M")?, int(self.n, "N")?, int(self.k, "K")?);
        let batch = int(self.batch, "batch")?;
        let in_type = cuda_data_type(self.dtype)?;
        let out_type = cuda_data_type(self.out_dtype)?;
        let compute = if self.dtype == DType::F32 && self.allow_tf32 {
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        // Row-major C[M,N] is column-major C^T[N,M] = op(B)^T[N,K] @ A^T[K,M]: cuBLAS computes
        // with (m, n) = (N, M), first operand B, second operand A.
        let (op_b, ldb) = match self.layout {
            GemmLayout::Nn => (bsys::cublasOperation_t::CUBLAS_OP_N, n.max(1)),
            GemmLayout::Nt => (bsys::cublasOperation_t::CUBLAS_OP_T, k.max(1)),
        };
        let op_a = bsys::cublasOperation_t::CUBLAS_OP_N;
        let (lda, ldc) = (k.max(1), n.max(1));
        let alpha = self.alpha;
        let beta = self.beta;
        let [sa, sb, sc] = self.batch_strides;
        with_handle(stream, |h| {
            let alpha_p = (&alpha as *const f32).cast::<c_void>();
            let beta_p = (&beta as *const f32).cast::<c_void>();
            let algo = bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
            let (pa, pb, pc) = (
                a.addr() as *const c_void,
                b.addr() as *const c_void,
                c.addr() as *mut c_void,
            );
            if self.batch == 1 {
                // SAFETY: operand extents were checked against the buffers; the handle is bound to
                // the stream of the current context; alpha/beta outlive the call (host scalars).
                unsafe {
                    blas::gemm_ex(
                        h, op_b, op_a, n, m, k, alpha_p, pb, in_type, ldb, pa, in_type, lda,
                        beta_p, pc, out_type, ldc, compute, algo,
                    )
                }
                .map_err(|source| KernelError::Cublas {
                    call: "cublasGemmEx",
                    source,
                })
            } else {
                // SAFETY: as above, with every batch entry's extent checked.
                unsafe {
                    blas::gemm_strided_batched_ex(
                        h,
                        op_b,
                        op_a,
                        n,
                        m,
                        k,
                        alpha_p,
                        pb,
                        in_type,
                        ldb,
                        long(sb),
                        pa,
                        in_type,
                        lda,
                        long(sa),
                        beta_p,
                        pc,
                        out_type,
                        ldc,
                        long(sc),
                        batch,
                        compute,
                        algo,
                    )
                }
                .map_err(|source| KernelError::Cublas {
                    call: "cublasGemmStridedBatchedEx",
                    source,
                })
            }
        })
    }
}

/// cuBLAS data type of a GEMM operand.
pub(crate) fn cuda_data_type(d: DType) -> Result<bsys::cudaDataType> {
    match d {
        DType::F32 => Ok(bsys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Ok(bsys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(bsys::cudaDataType::CUDA_R_16F),
        other => Err(KernelError::Unsupported(format!("GEMM on {other}"))),
    }
}

/// Runs `f` with the stream's cuBLAS handle (created on first use, bound to the stream).
fn with_handle<T>(stream: &Stream, f: impl FnOnce(bsys::cublasHandle_t) -> Result<T>) -> Result<T> {
    probe::cublas()?;
    let raw_stream = stream.bind_raw()?;
    let mut slot = stream
        .inner
        .blas
        .lock()
        .map_err(|_| KernelError::InvalidArgument("cuBLAS handle lock poisoned".into()))?;
    if slot.is_none() {
        let h = probe::no_panic("cublas", blas::create_handle)?.map_err(|source| {
            KernelError::Cublas {
                call: "cublasCreate",
                source,
            }
        })?;
        let handle = BlasHandle(h);
        // SAFETY: fresh handle; the stream is live and owned by the same Stream as the handle.
        unsafe { blas::set_stream(handle.0, raw_stream as bsys::cudaStream_t) }.map_err(
            |source| KernelError::Cublas {
                call: "cublasSetStream",
                source,
            },
        )?;
        *slot = Some(handle);
    }
    match slot.as_ref() {
        Some(h) => f(h.0),
        None => Err(KernelError::InvalidArgument("cuBLAS handle missing".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_data_types() {
        assert_eq!(
            cuda_data_type(DType::F32).ok(),
            Some(bsys::cudaDataType::CUDA_R_32F)
        );
        assert_eq!(
            cuda_data_type(DType::BF16).ok(),
            Some(bsys::cudaDataType::CUDA_R_16BF)
        );
        assert_eq!(
            cuda_data_type(DType::F16).ok(),
            Some(bsys::cudaDataType::CUDA_R_16F)
        );
        assert!(cuda_data_type(DType::I32).is_err());
    }

    #[test]
    fn batched_strides_are_packed() {
        let g = Gemm::linear(2, 3, 4, DType::BF16).batched(5);
        assert_eq!(g.batch_strides, [8, 12, 6]);
        assert_eq!(g.layout, GemmLayout::Nt);
        assert_eq!(g.flops(), 2.0 * 2.0 * 3.0 * 4.0 * 5.0);
    }
}
