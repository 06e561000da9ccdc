//! The store's wire format: requests, replies and their size limits.

use std::io::{self, Read, Write};
use std::time::Duration;

/// Longest key accepted, in bytes.
pub(crate) const MAX_KEY: usize = 4096;
/// Largest value accepted, in bytes: bootstrap data is small, and a garbage length must not
/// make the server allocate gigabytes.
pub(crate) const MAX_VALUE: usize = 64 << 20;

/// A request.
#[derive(Debug)]
pub(crate) enum Request<'a> {
    /// Store a value.
    Set(&'a str, &'a [u8]),
    /// Fetch a value if present.
    Get(&'a str),
    /// Fetch a value, waiting up to the duration for it.
    Wait(&'a str, Duration),
    /// Add to a counter.
    Add(&'a str, i64),
    /// Names the rank on this connection, so that the host knows when every rank has left.
    Hello(u64),
}

impl Request<'_> {
    /// The request's name in errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Request::Set(..) => "set",
            Request::Get(..) => "get",
            Request::Wait(..) => "wait",
            Request::Add(..) => "add",
            Request::Hello(..) => "hello",
        }
    }
    /// The key.
    pub(crate) fn key(&self) -> &str {
        match self {
            Request::Set(k, _) | Request::Get(k) | Request::Wait(k, _) | Request::Add(k, _) => k,
            Request::Hello(_) => "",
        }
    }
}

/// Reply status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Done; a value or counter follows where the request asks for one.
    Found,
    /// The key is not set (get) or was not set in time (wait).
    Missing,
}

impl Status {
    pub(crate) fn byte(self) -> u8 {
        match self {
            Status::Found => 0,
            Status::Missing => 1,
        }
    }
    pub(crate) fn from_byte(b: u8) -> io::Result<Self> {
        match b {
            0 => Ok(Status::Found),
            1 => Ok(Status::Missing),
            _ => Err(invalid(format!("unknown reply status {b}"))),
        }
    }
}

pub(crate) fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub(crate) fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    read_u64(r).map(|v| v as i64)
}

/// Reads a length-prefixed byte string of at most `max` bytes.
fn read_bytes(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let len = read_u64(r)?;
    if len > max as u64 {
        return Err(invalid(format!(
            "length {len} exceeds the limit of {max} bytes"
        )));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

pub(crate) fn read_value(r: &mut impl Read) -> io::Result<Vec<u8>> {
    read_bytes(r, MAX_VALUE)
}

pub(crate) fn write_bytes(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    w.write_all(&(b.len() as u64).to_le_bytes())?;
    w.write_all(b)
}

/// Writes `req`; refuses keys and values over the limits before sending anything.
pub(crate) fn write_request(w: &mut impl Write, req: &Request<'_>) -> io::Result<()> {
    if req.key().len() > MAX_KEY {
        return Err(invalid(format!("key longer than {MAX_KEY} bytes")));
    }
    match req {
        Request::Set(k, v) => {
            if v.len() > MAX_VALUE {
                return Err(invalid(format!("value larger than {MAX_VALUE} bytes")));
            }
            w.write_all(&[0])?;
            write_bytes(w, k.as_bytes())?;
            write_bytes(w, v)
        }
        Request::Get(k) => {
            w.write_all(&[1])?;
            write_bytes(w, k.as_bytes())
        }
        Request::Wait(k, d) => {
            w.write_all(&[2])?;
            write_bytes(w, k.as_bytes())?;
            w.write_all(&(d.as_millis().min(u64::MAX as u128) as u64).to_le_bytes())
        }
        Request::Add(k, d) => {
            w.write_all(&[3])?;
            write_bytes(w, k.as_bytes())?;
            w.write_all(&d.to_le_bytes())
        }
        Request::Hello(rank) => {
            w.write_all(&[4])?;
            write_bytes(w, b"")?;
            w.write_all(&rank.to_le_bytes())
        }
    }
}

/// A request as the server reads it (owned).
#[derive(Debug)]
pub(crate) enum Incoming {
    Set(String, Vec<u8>),
    Get(String),
    Wait(String, Duration),
    Add(String, i64),
    Hello(u64),
}

/// Reads one request; `Ok(None)` at a clean end of stream.
pub(crate) fn read_request(r: &mut impl Read) -> io::Result<Option<Incoming>> {
    let mut op = [0u8; 1];
    if r.read(&mut op)? == 0 {
        return Ok(None);
    }
    let key = String::from_utf8(read_bytes(r, MAX_KEY)?)
        .map_err(|_| invalid("key is not UTF-8".into()))?;
    Ok(Some(match op[0] {
        0 => Incoming::Set(key, read_value(r)?),
        1 => Incoming::Get(key),
        2 => Incoming::Wait(key, Duration::from_millis(read_u64(r)?)),
        3 => Incoming::Add(key, read_i64(r)?),
        4 => Incoming::Hello(read_u64(r)?),
        b => return Err(invalid(format!("unknown request opcode {b}"))),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn request() -> impl Strategy<Value = (u8, String, Vec<u8>, u64)> {
        (
            0u8..5,
            "\\PC{0,40}",
            proptest::collection::vec(any::<u8>(), 0..200),
            any::<u64>(),
        )
    }

    proptest! {
        // Bounded for CI: a few thousand streams, well under a second.
        #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any bytes on the server's side of the wire give requests, a clean end or an
        /// error; never a panic, never an allocation past the limits.
        #[test]
        fn any_bytes_parse_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut r = bytes.as_slice();
            for _ in 0..bytes.len() + 1 {
                match read_request(&mut r) {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// What a client writes, the server reads back unchanged.
        #[test]
        fn requests_round_trip((op, key, value, n) in request()) {
            let req = match op {
                0 => Request::Set(&key, &value),
                1 => Request::Get(&key),
                2 => Request::Wait(&key, Duration::from_millis(n)),
                3 => Request::Add(&key, n as i64),
                _ => Request::Hello(n),
            };
            let mut buf = Vec::new();
            write_request(&mut buf, &req).unwrap();
            let mut r = buf.as_slice();
            let got = read_request(&mut r).unwrap().unwrap();
            prop_assert!(r.is_empty());
            let same = match (got, &req) {
                (Incoming::Set(k, v), Request::Set(..)) => k == key && v == value,
                (Incoming::Get(k), Request::Get(_)) => k == key,
                (Incoming::Wait(k, d), Request::Wait(..)) => k == key && d.as_millis() == n as u128,
                (Incoming::Add(k, d), Request::Add(..)) => k == key && d == n as i64,
                (Incoming::Hello(r), Request::Hello(_)) => r == n,
                _ => false,
            };
            prop_assert!(same, "{req:?}");
        }
    }
}
