//! The store's server: one thread per connection over a shared map; `wait` blocks on a
//! condition variable until the key appears or the requested time passes.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use super::wire::{read_request, write_bytes, Incoming, Status};
use crate::{Error, Result};

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
    stop: AtomicBool,
}

/// A running store server; stops accepting connections when dropped.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port) and serves in background threads.
    pub fn bind(addr: SocketAddr) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|source| Error::Io {
            context: format!("starting the rendezvous store on {addr}"),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| Error::Io {
            context: "reading the store's address".into(),
            source,
        })?;
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("fz-store".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|source| Error::Io {
                context: "spawning the store server".into(),
                source,
            })?;
        Ok(StoreServer { addr, shared })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
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
        // A client that cannot get a thread is dropped; it sees a closed connection.
        let _ = std::thread::Builder::new()
            .name("fz-store-conn".into())
            .spawn(move || {
                // Errors end this connection only; the client reports them.
                let _ = serve(stream, &s);
            });
    }
}

fn serve(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
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
