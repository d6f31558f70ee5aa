//! [`WireChoice`] and [`connect_wire`]: which wire the host proxy of a rank writes over.
//!
//! `tcp` works everywhere. `ibverbs` needs the `rdma` feature and an RDMA device; without
//! either it is an error saying which is missing. `auto` takes ibverbs only when every rank of
//! the run can (each rank publishes whether it can through the setup store and reads the
//! others', so all ranks agree), else TCP, and says why.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Layout, ProxyError, SetupStore, TcpWire, Topology, Wire};

/// Which wire the host proxy uses.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum WireChoice {
    /// TCP sockets (works everywhere; the default).
    #[default]
    Tcp,
    /// ibverbs RC queue pairs (feature `rdma` and an RDMA device on every rank).
    Ibverbs,
    /// ibverbs when every rank of the run can use it, else TCP.
    Auto,
}

impl WireChoice {
    /// The name used in options and reports (`tcp`, `ibverbs`, `auto`).
    pub fn name(self) -> &'static str {
        match self {
            WireChoice::Tcp => "tcp",
            WireChoice::Ibverbs => "ibverbs",
            WireChoice::Auto => "auto",
        }
    }
}

impl fmt::Display for WireChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WireChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<WireChoice, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(WireChoice::Tcp),
            "ibverbs" | "rdma" => Ok(WireChoice::Ibverbs),
            "auto" => Ok(WireChoice::Auto),
            _ => Err(format!(
                "unknown wire `{}` (expected tcp, ibverbs or auto)",
                s.chars().take(40).collect::<String>()
            )),
        }
    }
}

/// A connected wire and why it was chosen.
#[derive(Debug, Clone)]
pub struct ChosenWire {
    /// The wire.
    pub wire: Arc<dyn Wire>,
    /// Why this wire (`requested`, or what `auto` found).
    pub reason: String,
}

/// Whether this process can use the ibverbs wire: `Err` says why not.
pub fn ibverbs_available() -> Result<(), String> {
    #[cfg(feature = "rdma")]
    {
        super::device_names().map(drop).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err("this meshflow was built without the `rdma` feature".into())
    }
}

#[cfg(feature = "rdma")]
fn ibverbs(
    layout: &Layout,
    store: &dyn SetupStore,
    namespace: &str,
    timeout: Duration,
) -> Result<Arc<dyn Wire>, ProxyError> {
    Ok(Arc::new(super::IbvWire::connect(
        layout, store, namespace, timeout,
    )?))
}

#[cfg(not(feature = "rdma"))]
fn ibverbs(
    _layout: &Layout,
    _store: &dyn SetupStore,
    _namespace: &str,
    _timeout: Duration,
) -> Result<Arc<dyn Wire>, ProxyError> {
    Err(ProxyError::NoDevice(
        "the ibverbs wire needs the `rdma` feature (cargo build --features rdma)".into(),
    ))
}

/// Connects rank `layout.me` of `topology` to its peers over the wire `choice` asks for (TCP
/// listening on `host`; ibverbs on the device of `MESHFLOW_IB_DEVICE` or the first one), within
/// `timeout`. Every rank with a peer on another node must call this with the same `choice`.
pub fn connect_wire(
    choice: WireChoice,
    topology: &Topology,
    layout: &Layout,
    host: &str,
    store: &dyn SetupStore,
    namespace: &str,
    timeout: Duration,
) -> Result<ChosenWire, ProxyError> {
    let tcp = |reason: String| -> Result<ChosenWire, ProxyError> {
        let wire = TcpWire::connect(layout, host, store, namespace, timeout)?;
        Ok(ChosenWire {
            wire: Arc::new(wire),
            reason,
        })
    };
    match choice {
        WireChoice::Tcp => tcp("requested".into()),
        WireChoice::Ibverbs => match ibverbs(layout, store, namespace, timeout) {
            Ok(wire) => Ok(ChosenWire {
                wire,
                reason: "requested".into(),
            }),
            Err(ProxyError::NoDevice(why)) => Err(ProxyError::NoDevice(format!(
                "the ibverbs wire was requested but cannot be used on rank {}: {why} (use the \
                 tcp or auto wire)",
                layout.me
            ))),
            Err(e) => Err(e),
        },
        WireChoice::Auto => {
            let deadline = Instant::now() + timeout;
            let mine = ibverbs_available();
            let verdict = match &mine {
                Ok(()) => "yes".to_string(),
                Err(why) => format!("no: {why}"),
            };
            store.publish(
                &format!("{namespace}/wire/{}", layout.me),
                verdict.as_bytes(),
            )?;
            let mut missing = None;
            for r in (0..topology.world()).filter(|&r| !topology.remote_peers(r).is_empty()) {
                let left = deadline.saturating_duration_since(Instant::now());
                let v = store.fetch(&format!("{namespace}/wire/{r}"), left)?;
                let v = String::from_utf8_lossy(&v).into_owned();
                if let Some(why) = v.strip_prefix("no: ") {
                    missing = Some(format!("rank {r} cannot use ibverbs ({why})"));
                    break;
                }
            }
            match missing {
                Some(why) => {
                    tracing::info!(rank = layout.me, "host proxy wire: tcp ({why})");
                    tcp(format!("auto: {why}"))
                }
                None => {
                    tracing::info!(
                        rank = layout.me,
                        "host proxy wire: ibverbs (every rank has an RDMA device)"
                    );
                    let left = deadline.saturating_duration_since(Instant::now());
                    let wire = ibverbs(layout, store, namespace, left)?;
                    Ok(ChosenWire {
                        wire,
                        reason: "auto: every rank has an RDMA device".into(),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::{MemoryStore, Proxy};

    #[test]
    fn choices_parse_and_print() {
        for c in [WireChoice::Tcp, WireChoice::Ibverbs, WireChoice::Auto] {
            assert_eq!(c.name().parse::<WireChoice>(), Ok(c));
        }
        assert!("udp"
            .parse::<WireChoice>()
            .unwrap_err()
            .contains("unknown wire `udp`"));
    }

    /// Without an RDMA device (here, CI) `ibverbs` is a clear error and `auto` falls back to
    /// TCP saying why; where a device exists the test says so and checks `auto` took it.
    #[test]
    fn ibverbs_without_a_device_fails_clearly_and_auto_takes_tcp() {
        let t = Topology::contiguous(2, 1).unwrap();
        let connect = |choice: WireChoice, ns: &'static str| {
            let store = Arc::new(MemoryStore::new());
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..2)
                    .map(|r| {
                        let (t, store) = (&t, store.clone());
                        s.spawn(move || {
                            let layout = Layout::new(t, r, 1 << 16).unwrap();
                            connect_wire(
                                choice,
                                t,
                                &layout,
                                "127.0.0.1",
                                &*store,
                                ns,
                                Duration::from_secs(10),
                            )
                            .map(|w| (layout, w))
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        };
        match ibverbs_available() {
            Err(why) => {
                eprintln!("no ibverbs here: {why}");
                for r in connect(WireChoice::Ibverbs, "ib") {
                    let e = r.unwrap_err();
                    assert!(matches!(e, ProxyError::NoDevice(_)), "{e:?}");
                    assert!(e.to_string().contains("ibverbs wire was requested"), "{e}");
                }
                let mut proxies = Vec::new();
                for r in connect(WireChoice::Auto, "auto") {
                    let (layout, chosen) = r.unwrap();
                    assert_eq!(chosen.wire.name(), "tcp");
                    assert!(
                        chosen.reason.contains("cannot use ibverbs"),
                        "{}",
                        chosen.reason
                    );
                    proxies.push(Proxy::start(layout, chosen.wire).unwrap());
                }
                let d = Duration::from_secs(10);
                proxies[0].send(1, (3, 1), b"auto", d).unwrap();
                assert_eq!(proxies[1].recv(0, (3, 1), d).unwrap(), b"auto");
            }
            Ok(()) => {
                eprintln!("an RDMA device is present: the no-device path is not exercised");
                for r in connect(WireChoice::Auto, "auto") {
                    assert_eq!(r.unwrap().1.wire.name(), "ibverbs");
                }
            }
        }
    }
}
