//! NVRTC compilation of one compile unit ([`Unit`]: a source, or one typed kernel of it) for one
//! device architecture, through the optional on-disk cache ([`cache`](super::cache)).

use std::ffi::{c_char, c_int, CString};

use cudarc::nvrtc::{result as nvrtc, sys as nsys};

use super::cache;
use super::units::Unit;
use crate::error::{KernelError, Result};
use crate::probe;

/// A compiled module image for `cuModuleLoadData`.
#[derive(Debug, Clone)]
pub(crate) enum Image {
    /// Native code for the device's exact architecture.
    Cubin(Vec<u8>),
    /// PTX (NUL-terminated), JIT-compiled by the driver; used when NVRTC does not know the arch.
    Ptx(Vec<u8>),
}

impl Image {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Image::Cubin(b) | Image::Ptx(b) => b,
        }
    }
}

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// `sm_90` (CUBIN) or `compute_90` (PTX).
    pub(crate) arch: String,
    pub(crate) cubin: bool,
}

/// Picks the target for compute capability `cc` among the archs this NVRTC supports: the exact
/// `sm_XY` when supported (CUBIN), else PTX for the newest supported arch below it.
pub(crate) fn pick_target(cc: (u32, u32), supported: &[u32]) -> Result<Target> {
    let want = cc.0 * 10 + cc.1;
    if supported.contains(&want) {
        return Ok(Target {
            arch: format!("sm_{want}"),
            cubin: true,
        });
    }
    match supported.iter().copied().filter(|a| *a <= want).max() {
        Some(a) => Ok(Target {
            arch: format!("compute_{a}"),
            cubin: false,
        }),
        None => Err(KernelError::Unsupported(format!(
            "compute capability {}.{} is older than every architecture this NVRTC supports \
             ({supported:?})",
            cc.0, cc.1
        ))),
    }
}

/// The NVRTC options of a compile for `arch` (`sm_90` or `compute_90`); part of the cache key.
pub(crate) fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
    ]
}

fn supported_archs() -> Result<Vec<u32>> {
    let mut n: c_int = 0;
    // SAFETY: valid out pointer.
    nvrtc_ok("nvrtcGetNumSupportedArchs", unsafe {
        nsys::nvrtcGetNumSupportedArchs(&mut n)
    })?;
    let mut archs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    // SAFETY: `archs` has room for `n` entries, as NVRTC just told us.
    nvrtc_ok("nvrtcGetSupportedArchs", unsafe {
        nsys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
    })?;
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out pointers.
    nvrtc_ok("nvrtcVersion", unsafe {
        nsys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

fn nvrtc_ok(call: &'static str, r: nsys::nvrtcResult) -> Result<()> {
    r.result().map_err(|e| KernelError::Nvrtc {
        unit: call.to_owned(),
        arch: String::new(),
        code: format!("{:?}", e.0),
        log: String::new(),
    })
}

/// Compiles `unit` for compute capability `cc`, through the disk cache unless `fresh`.
/// Returns the image and whether it came from the disk cache.
pub(crate) fn compile(unit: &Unit, cc: (u32, u32), fresh: bool) -> Result<(Image, bool)> {
    probe::nvrtc()?;
    probe::no_panic("nvrtc", || compile_inner(unit, cc, fresh))?
}

fn compile_inner(unit: &Unit, cc: (u32, u32), fresh: bool) -> Result<(Image, bool)> {
    let archs = supported_archs()?;
    let target = pick_target(cc, &archs)?;
    let text = unit.text();
    let options = nvrtc_options(&target.arch);
    let version = nvrtc_version()?;
    cache::sweep_once(&archs, version);
    let path = cache::path(unit, cache::key(&text, &options, version), target.cubin);
    if !fresh {
        if let Some(image) = path.as_ref().and_then(|p| cache::read(p, target.cubin)) {
            tracing::debug!(%unit, arch = %target.arch, "kernel cache hit");
            return Ok((image, true));
        }
    }
    let started = std::time::Instant::now();
    let mut image = run_nvrtc(unit, &text, &target, &options)?;
    if let Image::Cubin(bytes) = &image {
        if bytes.is_empty() {
            // Should not happen for a supported sm_XY; fall back to PTX for the same arch.
            let ptx_target = Target {
                arch: target.arch.replace("sm_", "compute_"),
                cubin: false,
            };
            let ptx_opts = nvrtc_options(&ptx_target.arch);
            image = run_nvrtc(unit, &text, &ptx_target, &ptx_opts)?;
        }
    }
    if let Some(p) = &path {
        cache::write(p, &image);
    }
    tracing::debug!(
        %unit,
        arch = %target.arch,
        bytes = image.bytes().len(),
        seconds = started.elapsed().as_secs_f64(),
        "compiled kernels"
    );
    Ok((image, false))
}

/// Frees an NVRTC program on every exit path.
struct Program(nsys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        if let Err(e) = unsafe { nvrtc::destroy_program(self.0) } {
            tracing::warn!("nvrtcDestroyProgram failed: {e}");
        }
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn run_nvrtc(unit: &Unit, text: &str, target: &Target, options: &[String]) -> Result<Image> {
    let err = |code: String, log: String| KernelError::Nvrtc {
        unit: unit.to_string(),
        arch: target.arch.clone(),
        code,
        log,
    };
    let src = CString::new(text).map_err(|_| err("NUL in source".into(), String::new()))?;
    let name = CString::new(unit.source().file_name())
        .map_err(|_| err("NUL in name".into(), String::new()))?;
    let prog = Program(
        nvrtc::create_program(&src, Some(&name))
            .map_err(|e| err(format!("{:?}", e.0), String::new()))?,
    );
    // SAFETY: `prog` is a live program; the options are plain strings without NULs.
    let compiled = unsafe { nvrtc::compile_program(prog.0, options) };
    // SAFETY: live program.
    let log = unsafe { nvrtc::get_program_log(prog.0) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(err(format!("{:?}", e.0), log));
    }
    if !log.trim().is_empty() {
        tracing::debug!(%unit, "NVRTC log:\n{log}");
    }
    if target.cubin {
        let mut size = 0usize;
        // SAFETY: live, successfully compiled program; valid out pointer.
        let r = unsafe { nsys::nvrtcGetCUBINSize(prog.0, &mut size) };
        r.result()
            .map_err(|e| err(format!("nvrtcGetCUBINSize: {:?}", e.0), log.clone()))?;
        let mut bytes = vec![0u8; size];
        if size > 0 {
            // SAFETY: `bytes` has exactly the size NVRTC reported.
            let r = unsafe { nsys::nvrtcGetCUBIN(prog.0, bytes.as_mut_ptr().cast::<c_char>()) };
            r.result()
                .map_err(|e| err(format!("nvrtcGetCUBIN: {:?}", e.0), log.clone()))?;
        }
        Ok(Image::Cubin(bytes))
    } else {
        // SAFETY: live, successfully compiled program.
        let ptx = unsafe { nvrtc::get_ptx(prog.0) }
            .map_err(|e| err(format!("nvrtcGetPTX: {:?}", e.0), log))?;
        let mut bytes: Vec<u8> = ptx.iter().map(|c| *c as u8).collect();
        if bytes.last() != Some(&0) {
            bytes.push(0);
        }
        Ok(Image::Ptx(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_arch_gives_cubin() {
        let archs = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(
            pick_target((9, 0), &archs).ok(),
            Some(Target {
                arch: "sm_90".into(),
                cubin: true
            })
        );
    }

    #[test]
    fn unknown_newer_arch_falls_back_to_ptx() {
        let archs = [75, 80, 90];
        assert_eq!(
            pick_target((10, 0), &archs).ok(),
            Some(Target {
                arch: "compute_90".into(),
                cubin: false
            })
        );
        assert!(pick_target((7, 0), &archs).is_err());
    }
}
