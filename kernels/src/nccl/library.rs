//! Finding and loading the NCCL shared library.

use std::ffi::{c_char, CStr, OsStr, OsString};
use std::fmt;
use std::sync::{Arc, Mutex};

use super::error::NcclError;
use super::sys::{ncclComm_t, ncclResult_t, NcclSys};
use crate::error::{KernelError, Result};

/// A loaded NCCL library. Load once per process with [`NcclLib::load`] and share the `Arc`.
pub struct NcclLib {
    sys: NcclSys,
    path: String,
    version_code: i32,
}

/// Functions every supported NCCL (2.18 and later) exports; checked when loading so that calls
/// through the bindings cannot hit a missing symbol.
macro_rules! required_symbols {
    ($lib:expr, $($name:ident),* $(,)?) => {{
        let mut missing = Vec::new();
        $( if $lib.$name.is_err() { missing.push(stringify!($name)); } )*
        missing
    }};
}

impl NcclLib {
    /// Environment variable naming the library file to load first.
    pub const ENV_VAR: &'static str = "MESHFLOW_NCCL_LIBRARY";

    /// The candidates tried by [`NcclLib::load`], in order, given the value of
    /// [`NcclLib::ENV_VAR`].
    pub fn candidates(env_value: Option<OsString>) -> Vec<OsString> {
        let mut v: Vec<OsString> = env_value.into_iter().filter(|p| !p.is_empty()).collect();
        v.push("libnccl.so.2".into());
        v.push("libnccl.so".into());
        v
    }

    /// Loads NCCL from the default candidates (env `MESHFLOW_NCCL_LIBRARY`, `libnccl.so.2`,
    /// `libnccl.so`). The first success is cached for the process; failures are not.
    pub fn load() -> Result<Arc<NcclLib>> {
        static LOADED: Mutex<Option<Arc<NcclLib>>> = Mutex::new(None);
        let mut slot = LOADED
            .lock()
            .map_err(|_| KernelError::InvalidArgument("NCCL loader lock poisoned".into()))?;
        if let Some(lib) = slot.as_ref() {
            return Ok(lib.clone());
        }
        let lib = Arc::new(NcclLib::load_from(NcclLib::candidates(std::env::var_os(
            NcclLib::ENV_VAR,
        )))?);
        *slot = Some(lib.clone());
        Ok(lib)
    }

    /// Loads the first candidate that opens and exports every required function.
    pub fn load_from<I, P>(candidates: I) -> Result<NcclLib>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<OsStr>,
    {
        let mut tried = Vec::new();
        for candidate in candidates {
            let shown = candidate.as_ref().to_string_lossy().into_owned();
            // SAFETY: loading NCCL runs its library constructors, which have no preconditions.
            let sys = match unsafe { NcclSys::new(candidate.as_ref()) } {
                Ok(sys) => sys,
                Err(e) => {
                    tried.push((shown, error_chain(&e)));
                    continue;
                }
            };
            let missing = required_symbols!(
                sys,
                ncclGetVersion,
                ncclGetUniqueId,
                ncclCommInitRank,
                ncclCommInitAll,
                ncclCommFinalize,
                ncclCommDestroy,
                ncclCommAbort,
                ncclCommSplit,
                ncclGetErrorString,
                ncclGetLastError,
                ncclCommGetAsyncError,
                ncclCommCount,
                ncclCommCuDevice,
                ncclCommUserRank,
                ncclReduce,
                ncclBroadcast,
                ncclAllReduce,
                ncclReduceScatter,
                ncclAllGather,
                ncclSend,
                ncclRecv,
                ncclGroupStart,
                ncclGroupEnd,
            );
            if !missing.is_empty() {
                tried.push((shown, format!("missing symbols {}", missing.join(", "))));
                continue;
            }
            let mut version_code = 0;
            // SAFETY: symbol checked above; valid out pointer.
            let r = unsafe { sys.ncclGetVersion(&mut version_code) };
            if r != ncclResult_t::ncclSuccess {
                tried.push((shown, format!("ncclGetVersion returned {}", r.0)));
                continue;
            }
            tracing::debug!(path = %shown, version_code, "loaded NCCL");
            return Ok(NcclLib {
                sys,
                path: shown,
                version_code,
            });
        }
        Err(KernelError::NcclNotFound { tried })
    }

    /// The candidate the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `NCCL_VERSION_CODE` of the loaded library (e.g. 22809 for 2.28.9).
    pub fn version_code(&self) -> i32 {
        self.version_code
    }

    /// `(major, minor, patch)` of the loaded library.
    pub fn version(&self) -> (u32, u32, u32) {
        let c = u32::try_from(self.version_code).unwrap_or(0);
        (c / 10000, (c % 10000) / 100, c % 100)
    }

    /// Whether the library has a native `ncclAlltoAll` (else all-to-all uses grouped send/recv).
    pub fn has_native_all_to_all(&self) -> bool {
        self.sys.ncclAlltoAll.is_ok()
    }

    /// Whether the library has native `ncclGather` and `ncclScatter`.
    pub fn has_native_gather_scatter(&self) -> bool {
        self.sys.ncclGather.is_ok() && self.sys.ncclScatter.is_ok()
    }

    /// The raw bindings.
    pub(crate) fn sys(&self) -> &NcclSys {
        &self.sys
    }

    /// Turns an NCCL result into this crate's error, with NCCL's texts.
    pub(crate) fn check(
        &self,
        call: &'static str,
        r: ncclResult_t,
        comm: ncclComm_t,
    ) -> Result<()> {
        if r == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        Err(KernelError::Nccl(self.error(call, r.0, comm)))
    }

    /// Builds an [`NcclError`] for `code`, reading NCCL's texts.
    pub(crate) fn error(&self, call: &'static str, code: u32, comm: ncclComm_t) -> NcclError {
        // SAFETY: both functions were checked at load; NCCL returns static or comm-owned
        // NUL-terminated strings (or null), read immediately.
        let (message, last_error) = unsafe {
            (
                c_text(self.sys.ncclGetErrorString(ncclResult_t(code))),
                c_text(self.sys.ncclGetLastError(comm)),
            )
        };
        NcclError {
            call,
            code,
            message,
            last_error,
        }
    }
}

/// An error and its sources, `: `-separated (libloading keeps the dlerror text in the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Copies a C string returned by NCCL (null gives an empty string).
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the duration of the call.
unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

impl fmt::Debug for NcclLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclLib")
            .field("path", &self.path)
            .field("version_code", &self.version_code)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::sys;
    use super::*;

    #[test]
    fn candidates_order_env_first() {
        assert_eq!(
            NcclLib::candidates(Some("/opt/nccl/libnccl.so.2".into())),
            vec![
                OsString::from("/opt/nccl/libnccl.so.2"),
                OsString::from("libnccl.so.2"),
                OsString::from("libnccl.so"),
            ]
        );
        assert_eq!(
            NcclLib::candidates(Some(OsString::new())),
            vec![OsString::from("libnccl.so.2"), OsString::from("libnccl.so")]
        );
        assert_eq!(NcclLib::candidates(None).len(), 2);
    }

    #[test]
    fn missing_library_is_an_error_listing_every_path() {
        let paths = ["/nonexistent/a/libnccl.so.2", "/nonexistent/b/libnccl.so"];
        let err = match NcclLib::load_from(paths) {
            Ok(lib) => panic!("unexpectedly loaded {lib:?}"),
            Err(e) => e,
        };
        let KernelError::NcclNotFound { tried } = &err else {
            panic!("wrong error: {err}");
        };
        assert_eq!(tried.len(), 2);
        let text = err.to_string();
        for p in paths {
            assert!(text.contains(p), "{text}");
        }
        // The loader's own reason (dlerror) is kept for each candidate.
        assert!(
            tried.iter().all(|(_, why)| why.contains("No such file")),
            "{text}"
        );
    }

    #[test]
    fn bindings_come_from_nccl_2_28_9() {
        assert_eq!(sys::NCCL_HEADER_VERSION_CODE, 22809);
        assert_eq!(std::mem::size_of::<sys::ncclUniqueId>(), 128);
    }
}
