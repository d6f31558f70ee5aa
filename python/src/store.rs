//! Where the ranks of a job in separate processes meet: to agree on the machine profile before
//! lowering (`Program.lower_for_rank`, any build), to create their NCCL communicators and
//! exchange MoE handles (feature `cuda`): a torch `Store` (the `torch.distributed` default store, or the store torchrun's
//! agent serves on `MASTER_ADDR:MASTER_PORT`) behind meshflow's `Rendezvous` trait, or
//! meshflow's own TCP store from the launcher's variables.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use meshflow::runtime::rendezvous::{
    LocalRendezvous, Rendezvous, RendezvousError, TcpRendezvous, TorchrunEnv,
};

use crate::errors::DeviceError;

/// A torch `Store` (anything with `set`, `get`, `check` and `add`) as a [`Rendezvous`]. Waits
/// poll the store with short calls, so that an abort (a key every rank checks) ends them.
///
/// Each one (an executor, a MoE layer) has its own abort key, numbered in the order this
/// process makes them (the same on every rank): a failed executor aborts the waits of its own
/// job, not those of the executors made after it.
#[derive(Debug)]
pub struct StoreRendezvous {
    store: Py<PyAny>,
    namespace: String,
    abort_key: String,
}

impl StoreRendezvous {
    fn call<T>(
        &self,
        what: &str,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T, RendezvousError> {
        Python::attach(|py| f(self.store.bind(py))).map_err(|e| RendezvousError::Io {
            address: self.namespace.clone(),
            message: format!("{what}: {e}"),
        })
    }

    fn exists(&self, key: &str) -> Result<bool, RendezvousError> {
        self.call("check", |s| {
            let keys = PyList::new(s.py(), [key])?;
            s.call_method1("check", (keys,))?.extract()
        })
    }

    fn aborted(&self) -> Result<(), RendezvousError> {
        if !self.exists(&self.abort_key)? {
            return Ok(());
        }
        let reason = self.call("get", |s| {
            let v = s.call_method1("get", (self.abort_key.as_str(),))?;
            Ok(String::from_utf8_lossy(v.cast::<PyBytes>()?.as_bytes()).into_owned())
        })?;
        Err(RendezvousError::Aborted(reason))
    }

    /// Polls `ready` until it holds, an abort is seen, or `timeout` passes.
    fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> Result<bool, RendezvousError>,
    ) -> Result<(), RendezvousError> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            if ready()? {
                return Ok(());
            }
            self.aborted()?;
            if start.elapsed() >= timeout {
                return Err(RendezvousError::Timeout {
                    what: what.to_string(),
                    waited: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Rendezvous for StoreRendezvous {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        self.call("set", |s| {
            s.call_method1("set", (key, PyBytes::new(s.py(), value)))
                .map(drop)
        })
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.wait_until(key, timeout, || self.exists(key))?;
        self.call("get", |s| {
            let v = s.call_method1("get", (key,))?;
            Ok(v.cast::<PyBytes>()?.as_bytes().to_vec())
        })
    }

    fn barrier(
        &self,
        name: &str,
        parties: usize,
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        let counter = format!("{name}/arrived");
        self.call("add", |s| {
            s.call_method1("add", (counter.as_str(), 1)).map(drop)
        })?;
        self.wait_until(&format!("barrier {name}"), timeout, || {
            let n: i64 = self.call("add", |s| {
                s.call_method1("add", (counter.as_str(), 0))?.extract()
            })?;
            Ok(usize::try_from(n).is_ok_and(|n| n >= parties))
        })
    }

    fn abort(&self, reason: &str) {
        if let Err(e) = self.publish(&self.abort_key, reason.as_bytes()) {
            tracing::warn!("could not leave the abort reason in the store: {e}");
        }
    }
}

/// The rendezvous of a job of `world_size` ranks: `store` is a torch `Store`, `"env"`
/// (meshflow's TCP store on `MASTER_ADDR:MASTER_PORT`, served by rank 0; one connection per
/// process, kept) or `"local"` (every rank in this process). `namespace` names the job (communicators are cached per namespace).
pub fn rendezvous(
    store: &Bound<'_, PyAny>,
    namespace: &str,
    timeout: Duration,
) -> PyResult<Arc<dyn Rendezvous>> {
    let rdv_error = |e: RendezvousError| DeviceError::new_err(e.to_string());
    match store.extract::<String>() {
        Ok(kind) => match kind.as_str() {
            "env" => {
                let env = TorchrunEnv::from_env().map_err(rdv_error)?.ok_or_else(|| {
                    PyValueError::new_err(
                        "store=\"env\" needs the launcher's RANK, WORLD_SIZE, MASTER_ADDR and \
                             MASTER_PORT",
                    )
                })?;
                tcp(&env, timeout).map_err(rdv_error)
            }
            "local" => Ok(local(namespace)),
            other => Err(PyValueError::new_err(format!(
                "unknown store `{other}` (a torch Store, \"env\" or \"local\")"
            ))),
        },
        Err(_) => {
            static MADE: AtomicU64 = AtomicU64::new(0);
            let n = MADE.fetch_add(1, Ordering::Relaxed);
            Ok(Arc::new(StoreRendezvous {
                store: store.clone().unbind(),
                namespace: namespace.to_string(),
                abort_key: format!("abort/{namespace}/{n}"),
            }))
        }
    }
}

/// The connection of this process to meshflow's TCP store of the job `env` describes, made on
/// first use and kept for the life of the process: rank 0 serves the store as long as its
/// connection lives, so the lowering's profile agreement and the executors made after it meet
/// through one store (a second server on the same port could not start).
fn tcp(env: &TorchrunEnv, timeout: Duration) -> Result<Arc<dyn Rendezvous>, RendezvousError> {
    type Stores = HashMap<(String, u16, usize), Arc<TcpRendezvous>>;
    static TCP: OnceLock<Mutex<Stores>> = OnceLock::new();
    let mut map = TCP
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = (env.master_addr.clone(), env.master_port, env.rank);
    if let Some(store) = map.get(&key) {
        return Ok(store.clone());
    }
    let store = Arc::new(TcpRendezvous::connect(env, timeout)?);
    map.insert(key, store.clone());
    Ok(store)
}

/// The in-process rendezvous of `namespace`, shared by every rank of this process that names it.
fn local(namespace: &str) -> Arc<dyn Rendezvous> {
    static LOCAL: OnceLock<Mutex<HashMap<String, Arc<LocalRendezvous>>>> = OnceLock::new();
    let mut map = LOCAL
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    map.entry(namespace.to_string())
        .or_insert_with(|| Arc::new(LocalRendezvous::new(namespace)))
        .clone()
}
