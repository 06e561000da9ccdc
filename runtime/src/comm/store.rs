//! A TCP key/value rendezvous store, the bootstrap channel of multi-process jobs (torch's
//! `TCPStore`): rank 0 serves on `MASTER_ADDR:MASTER_PORT`, every rank connects, and ranks
//! exchange small values such as the NCCL unique id with `set`, `get`, `wait` and `add`.
//!
//! Only the job's ranks may use it: every connection first proves that it holds the job's
//! secret ([`SECRET_VAR`], which `ferrozero launch` creates) in a challenge-response that
//! never sends the secret (`store/auth.rs`); rank 0's server listens on `MASTER_ADDR` only,
//! or on [`BIND_VAR`] when that is set.
//!
//! Wire format after the handshake, little-endian: a request is an opcode byte, a length-prefixed key and an
//! operand (a length-prefixed value for `set`, a timeout in ms for `wait`, an i64 for `add`,
//! the rank for `hello`); a reply is a status byte and, for found values, a length-prefixed
//! value or an i64.
//!
//! The rank that hosts the server does not leave before the others are done with it: its
//! handle, when dropped, first closes its own connection, then waits until every rank of the
//! job has connected and closed its connection (bounded by the store's timeout).

mod auth;
mod server;
mod wire;

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use auth::{JobSecret, BIND_VAR, MIN_SECRET, SECRET_VAR};
pub use server::StoreServer;
use wire::{read_u8, read_value, write_request, Request, Status};

use crate::{Error, Result};

/// A connection to a rendezvous store, and on the hosting rank the server itself.
#[derive(Debug)]
pub struct TcpStore {
    // Field order matters: the connection closes before the hosted server waits for the
    // other ranks to close theirs.
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    timeout: Duration,
    addr: SocketAddr,
    host: Option<StoreServer>,
}

/// Reads an environment variable that the launcher sets.
fn env_var(name: &str) -> Result<String> {
    std::env::var(name).map_err(|_| {
        Error::Config(format!(
            "environment variable {name} is not set (start ranks with `ferrozero launch`)"
        ))
    })
}

fn io_err(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// Resolves `host:port` to its first address.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(io_err(format!("resolving {host}:{port}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("{host}:{port} resolves to no address")))
}

impl TcpStore {
    /// Connects to the store of a launched job (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, [`SECRET_VAR`]): rank 0 hosts the server, on `MASTER_ADDR` unless
    /// [`BIND_VAR`] names another address. On rank 0, dropping the handle waits until every
    /// rank has closed its connection (at most `timeout`), so the host never leaves while
    /// another rank still reads from the store.
    pub fn from_env(timeout: Duration) -> Result<TcpStore> {
        let number = |name: &str| -> Result<usize> {
            env_var(name)?
                .parse()
                .map_err(|_| Error::Config(format!("{name} is not a number")))
        };
        let rank = number("RANK")?;
        let world = number("WORLD_SIZE")?;
        if rank >= world {
            return Err(Error::Config(format!(
                "RANK {rank} is not below WORLD_SIZE {world}"
            )));
        }
        let port: u16 = env_var("MASTER_PORT")?
            .parse()
            .map_err(|_| Error::Config("MASTER_PORT is not a port number".into()))?;
        let addr = resolve(&env_var("MASTER_ADDR")?, port)?;
        let secret = JobSecret::from_env()?;
        let host = if rank == 0 {
            let bind = match std::env::var(BIND_VAR) {
                Ok(b) => resolve(&b, port)?,
                Err(_) => addr,
            };
            Some(StoreServer::host_job(bind, world, timeout, secret.clone())?)
        } else {
            None
        };
        let mut store = match TcpStore::connect_rank(addr, timeout, rank, &secret) {
            Ok(s) => s,
            Err(e) => {
                // Nobody can have used a store its own host could not reach.
                if let Some(h) = host {
                    h.stop_now();
                }
                return Err(e);
            }
        };
        store.host = host;
        Ok(store)
    }

    /// Connects as rank `rank` of a job: the server counts the rank as present until this
    /// connection closes (see [`StoreServer::host_job`]).
    pub fn connect_rank(
        addr: SocketAddr,
        timeout: Duration,
        rank: usize,
        secret: &JobSecret,
    ) -> Result<TcpStore> {
        let store = TcpStore::connect(addr, timeout, secret)?;
        store.call(Request::Hello(rank as u64), Duration::ZERO, |_, _| Ok(()))?;
        Ok(store)
    }

    /// Whether this handle hosts the server.
    pub fn is_host(&self) -> bool {
        self.host.is_some()
    }

    /// Connects to a store at `addr`, retrying until `timeout` while the server starts, and
    /// proves `secret` to it (a store of another job refuses). Every later request fails
    /// after `timeout` too.
    pub fn connect(addr: SocketAddr, timeout: Duration, secret: &JobSecret) -> Result<TcpStore> {
        let start = Instant::now();
        let stream = loop {
            match TcpStream::connect_timeout(&addr, timeout.max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) if start.elapsed() >= timeout => {
                    return Err(io_err(format!(
                        "connecting to the rendezvous store at {addr} (gave up after {timeout:?})"
                    ))(e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream
            .set_nodelay(true)
            .map_err(io_err("configuring the store socket".into()))?;
        let reader = stream
            .try_clone()
            .map_err(io_err("cloning the store socket".into()))?;
        let (mut reader, mut writer) = (BufReader::new(reader), BufWriter::new(stream));
        // The local address is what the host's log names when it refuses this connection.
        let local = reader
            .get_ref()
            .local_addr()
            .map_err(io_err("reading the store socket's address".into()))?;
        let handshake = format!("joining the rendezvous store at {addr} from {local}");
        reader
            .get_ref()
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io_err(handshake.clone()))?;
        auth::prove(&mut reader, &mut writer, secret).map_err(io_err(handshake))?;
        Ok(TcpStore {
            conn: Mutex::new((reader, writer)),
            timeout,
            addr,
            host: None,
        })
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends `req` and reads the status byte, then `read_rest` on the same connection.
    fn call<T>(
        &self,
        req: Request<'_>,
        wait: Duration,
        read_rest: impl FnOnce(Status, &mut BufReader<TcpStream>) -> std::io::Result<T>,
    ) -> Result<T> {
        let what = format!("store {} {:?} at {}", req.name(), req.key(), self.addr);
        let mut guard = self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (reader, writer) = &mut *guard;
        // The server answers a `wait` only when the key appears or its own timer fires, so
        // the socket allows for that wait plus a margin.
        let limit = wait + self.timeout;
        reader
            .get_ref()
            .set_read_timeout(Some(limit))
            .map_err(io_err(what.clone()))?;
        let io = (|| {
            write_request(writer, &req)?;
            writer.flush()?;
            let status = Status::from_byte(read_u8(reader)?)?;
            read_rest(status, reader)
        })();
        io.map_err(io_err(what))
    }

    /// Sets `key` to `value`, waking every rank waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(Request::Set(key, value), Duration::ZERO, |_, _| Ok(()))
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.call(Request::Get(key), Duration::ZERO, |s, r| match s {
            Status::Found => read_value(r).map(Some),
            _ => Ok(None),
        })
    }

    /// Waits until `key` is set (at most the store's timeout) and returns its value.
    pub fn wait(&self, key: &str) -> Result<Vec<u8>> {
        let start = Instant::now();
        let found = self.call(
            Request::Wait(key, self.timeout),
            self.timeout,
            |s, r| match s {
                Status::Found => read_value(r).map(Some),
                _ => Ok(None),
            },
        )?;
        found.ok_or_else(|| Error::Io {
            context: format!("store wait for {key:?} at {}", self.addr),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no rank set it within {:?}", start.elapsed()),
            ),
        })
    }

    /// Adds `delta` to the integer counter `key` (created at 0) and returns the new value:
    /// the building block of barriers and rank assignment.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(Request::Add(key, delta), Duration::ZERO, |_, r| {
            wire::read_i64(r)
        })
    }
}
