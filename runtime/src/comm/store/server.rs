//! The store's server: one thread per connection over a shared map; `wait` blocks on a
//! condition variable until the key appears or the requested time passes.
//!
//! The process that hosts the server must outlive every client's use of it: a host that
//! exits while a peer is still reading leaves that peer with an `UnexpectedEof`. So a server
//! hosted for a job ([`StoreServer::host_job`]) keeps serving, when its handle is dropped,
//! until every rank of the job has connected (each names itself with a hello) and closed its
//! connection, or until the linger limit passes.
//!
//! A connection is served only after it proves the job's secret (`auth.rs`); one that does
//! not is answered with a refusal, named by its address in the log, and closed, having read
//! and written nothing.

use std::collections::{BTreeSet, HashMap};
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::auth::{admit, JobSecret, BIND_VAR};
use super::wire::{read_request, write_bytes, Incoming, Status};
use crate::{Error, Result};

/// How long a new connection has to prove the secret: a silent peer must not hold its
/// thread (and the host's exit) for the store's whole lifetime.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

struct Shared {
    addr: SocketAddr,
    secret: JobSecret,
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
    stop: AtomicBool,
    /// Who is connected: the ranks that said hello, and the connections open now.
    presence: Mutex<Presence>,
    /// Signalled whenever `presence` changes.
    presence_cv: Condvar,
}

#[derive(Default)]
struct Presence {
    ranks_seen: BTreeSet<u64>,
    open: usize,
}

/// What a hosted server waits for before it stops.
#[derive(Debug, Clone, Copy)]
struct Job {
    world_size: usize,
    linger: Duration,
}

/// A running store server; stops accepting connections when dropped (for a job's host, only
/// after every rank has left, see the module documentation).
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    job: Option<Job>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port) and serves, in background threads, the
    /// connections that prove `secret`.
    pub fn bind(addr: SocketAddr, secret: JobSecret) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|source| {
            let hint = if source.kind() == std::io::ErrorKind::AddrNotAvailable {
                format!(
                    "{} is not an address of this host; set {BIND_VAR} to one that is, or to \
                     0.0.0.0 for every interface",
                    addr.ip()
                )
            } else {
                "is another job using this port? choose another with --master-port".into()
            };
            Error::Io {
                context: format!("starting the rendezvous store on {addr} ({hint})"),
                source,
            }
        })?;
        let addr = listener.local_addr().map_err(|source| Error::Io {
            context: "reading the store's address".into(),
            source,
        })?;
        let shared = Arc::new(Shared {
            addr,
            secret,
            map: Mutex::default(),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            presence: Mutex::default(),
            presence_cv: Condvar::new(),
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("fz-store".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|source| Error::Io {
                context: "spawning the store server".into(),
                source,
            })?;
        Ok(StoreServer {
            addr,
            shared,
            job: None,
        })
    }

    /// Like [`StoreServer::bind`], for a job of `world_size` ranks: dropping the handle waits
    /// until ranks `0..world_size` have all connected and closed their connections, at most
    /// `linger` (then it warns and stops anyway).
    pub fn host_job(
        addr: SocketAddr,
        world_size: usize,
        linger: Duration,
        secret: JobSecret,
    ) -> Result<StoreServer> {
        let mut s = StoreServer::bind(addr, secret)?;
        s.job = Some(Job { world_size, linger });
        Ok(s)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops at once, without waiting for the job's ranks to leave.
    pub fn stop_now(mut self) {
        self.job = None;
    }

    /// Waits until every rank of `job` said hello and no connection is open, or `job.linger`
    /// passes; returns the ranks still missing or connected in the latter case.
    fn wait_for_goodbyes(&self, job: Job) -> Option<String> {
        let deadline = Instant::now() + job.linger;
        let mut p = self
            .shared
            .presence
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            let all_seen = (0..job.world_size as u64).all(|r| p.ranks_seen.contains(&r));
            if all_seen && p.open == 0 {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                let never: Vec<u64> = (0..job.world_size as u64)
                    .filter(|r| !p.ranks_seen.contains(r))
                    .collect();
                return Some(format!(
                    "ranks that never connected: {never:?}; connections still open: {}",
                    p.open
                ));
            }
            p = self
                .shared
                .presence_cv
                .wait_timeout(p, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(job) = self.job {
            if let Some(left) = self.wait_for_goodbyes(job) {
                tracing::warn!(
                    "rendezvous store at {}: stopping after waiting {:?} for every rank to \
                     leave ({left})",
                    self.addr,
                    job.linger
                );
            }
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let s = Arc::clone(&shared);
        // Counted before the thread starts, so a host never sees "nobody connected" between
        // a client's connect and its first request.
        let open = OpenConnection::new(Arc::clone(&shared));
        // A client that cannot get a thread is dropped; it sees a closed connection.
        let _ = std::thread::Builder::new()
            .name("fz-store-conn".into())
            .spawn(move || {
                let _open = open;
                // Errors end this connection only; the client reports them.
                let _ = serve(stream, &s);
            });
    }
}

/// One open connection in [`Presence`]; closing it (dropping this) notifies the host.
struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn new(shared: Arc<Shared>) -> Self {
        shared
            .presence
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open += 1;
        OpenConnection(shared)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        let mut p = self
            .0
            .presence
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        p.open = p.open.saturating_sub(1);
        self.0.presence_cv.notify_all();
    }
}

fn serve(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    reader.get_ref().set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let admitted = admit(&mut reader, &mut writer, &shared.secret);
    if !matches!(admitted, Ok(true)) {
        let why = match admitted {
            Err(e) => format!("it closed or stalled before proving it ({e})"),
            _ => "its proof does not match".into(),
        };
        tracing::warn!(
            "rendezvous store at {}: refused a connection from {peer}: it does not hold the \
             job's secret ({why})",
            shared.addr
        );
        return Ok(());
    }
    reader.get_ref().set_read_timeout(None)?;
    while let Some(req) = read_request(&mut reader)? {
        answer(req, shared, &mut writer)?;
        writer.flush()?;
    }
    Ok(())
}

fn answer(req: Incoming, shared: &Shared, w: &mut impl Write) -> std::io::Result<()> {
    let mut map = shared.map.lock().unwrap_or_else(PoisonError::into_inner);
    match req {
        Incoming::Set(k, v) => {
            map.insert(k, v);
            shared.cv.notify_all();
            w.write_all(&[Status::Found.byte()])
        }
        Incoming::Get(k) => found_or_missing(w, map.get(&k)),
        Incoming::Wait(k, d) => {
            let deadline = Instant::now().checked_add(d);
            while !map.contains_key(&k) {
                let left = match deadline {
                    Some(t) if Instant::now() >= t => break,
                    Some(t) => t.saturating_duration_since(Instant::now()),
                    None => std::time::Duration::from_secs(3600),
                };
                map = shared
                    .cv
                    .wait_timeout(map, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            found_or_missing(w, map.get(&k))
        }
        Incoming::Add(k, d) => {
            let old = map
                .get(&k)
                .and_then(|v| v.as_slice().try_into().ok())
                .map_or(0, i64::from_le_bytes);
            let new = old.wrapping_add(d);
            map.insert(k, new.to_le_bytes().to_vec());
            shared.cv.notify_all();
            w.write_all(&[Status::Found.byte()])?;
            w.write_all(&new.to_le_bytes())
        }
        Incoming::Hello(rank) => {
            drop(map);
            let mut p = shared
                .presence
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            p.ranks_seen.insert(rank);
            shared.presence_cv.notify_all();
            w.write_all(&[Status::Found.byte()])
        }
    }
}

fn found_or_missing(w: &mut impl Write, v: Option<&Vec<u8>>) -> std::io::Result<()> {
    match v {
        Some(v) => {
            w.write_all(&[Status::Found.byte()])?;
            write_bytes(w, v)
        }
        None => w.write_all(&[Status::Missing.byte()]),
    }
}
