//! Who may use a job's store: every connection first proves that it holds the job's secret.
//!
//! The handshake is a challenge-response with HMAC-SHA-256, so the secret never crosses the
//! wire and a recorded exchange is worthless for the next connection:
//!
//! 1. the server sends [`MAGIC`] and a fresh 32-byte nonce `s`;
//! 2. the client sends its own nonce `c` and `HMAC(secret, "client" || s || c)`;
//! 3. the server checks the tag in constant time; on success it answers [`ADMITTED`] and
//!    `HMAC(secret, "server" || s || c)`, which the client checks in turn (so a rank never
//!    hands its values to a listener that is not its job's store); otherwise it answers
//!    [`REFUSED`], logs the peer's address and closes the connection.

use std::io::{self, Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{Error, Result};

/// The variable that carries the job's secret to every rank (`ferrozero launch` sets it).
pub const SECRET_VAR: &str = "FERROZERO_STORE_SECRET";
/// The variable that tells rank 0's store where to listen instead of `MASTER_ADDR` (for
/// example `0.0.0.0` for every interface).
pub const BIND_VAR: &str = "FERROZERO_STORE_BIND";

/// Shortest secret accepted, in bytes: a guessable secret admits anyone.
pub const MIN_SECRET: usize = 16;

/// What the server sends first: the protocol's name and version.
pub(crate) const MAGIC: &[u8; 8] = b"FZSTORE1";
/// The server's answer to a valid proof.
pub(crate) const ADMITTED: u8 = 0xA5;
/// The server's answer to a missing or wrong proof, before it closes the connection.
pub(crate) const REFUSED: u8 = 0x5A;
const NONCE: usize = 32;
const TAG: usize = 32;

/// A job's shared secret: the key of every connection's proof. Its `Debug` form hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(String);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

impl JobSecret {
    /// A secret from its text (what [`SECRET_VAR`] holds); refused when shorter than
    /// [`MIN_SECRET`] bytes.
    pub fn new(text: impl Into<String>) -> Result<JobSecret> {
        let text = text.into();
        if text.len() < MIN_SECRET {
            return Err(Error::Config(format!(
                "{SECRET_VAR} is {} bytes long; the store's job secret needs at least \
                 {MIN_SECRET} (e.g. `openssl rand -hex 32`)",
                text.len()
            )));
        }
        Ok(JobSecret(text))
    }

    /// A fresh secret: 32 bytes from the operating system's generator, in hex.
    pub fn generate() -> Result<JobSecret> {
        let mut bytes = [0u8; 32];
        fill_random(&mut bytes)?;
        Ok(JobSecret(
            bytes.iter().map(|b| format!("{b:02x}")).collect(),
        ))
    }

    /// The secret of this process's job, from [`SECRET_VAR`].
    pub fn from_env() -> Result<JobSecret> {
        match std::env::var(SECRET_VAR) {
            Ok(v) => JobSecret::new(v),
            Err(_) => Err(Error::Config(format!(
                "environment variable {SECRET_VAR} is not set: the rendezvous store admits only \
                 ranks that hold their job's secret (start ranks with `ferrozero launch`, or \
                 export the same {SECRET_VAR} to every rank)"
            ))),
        }
    }

    /// The secret for a job that `ferrozero launch` starts on `nnodes` nodes: the one in the
    /// environment (`var`) when set, else a fresh one; a job of several nodes needs one secret
    /// on every node, which only the environment can give them all.
    pub fn for_launch(nnodes: usize, var: impl Fn(&str) -> Option<String>) -> Result<JobSecret> {
        match var(SECRET_VAR) {
            Some(v) => JobSecret::new(v),
            None if nnodes == 1 => JobSecret::generate(),
            None => Err(Error::Config(format!(
                "a job of {nnodes} nodes needs one store secret on every node: set \
                 {SECRET_VAR} before starting the launchers (e.g. `export {SECRET_VAR}=$(openssl \
                 rand -hex 32)` ahead of `srun`, which passes it to every node)"
            ))),
        }
    }

    /// The text to put in [`SECRET_VAR`].
    pub fn as_env_value(&self) -> &str {
        &self.0
    }

    fn tag(&self, role: &[u8], server: &[u8; NONCE], client: &[u8; NONCE]) -> Hmac<Sha256> {
        // HMAC takes keys of any length, so this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.0.as_bytes())
            .expect("HMAC accepts every key length");
        mac.update(role);
        mac.update(server);
        mac.update(client);
        mac
    }
}

fn fill_random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| Error::Io {
        context: "drawing random bytes for the rendezvous store".into(),
        source: io::Error::other(e.to_string()),
    })
}

fn denied(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, msg)
}

/// The server's half: `Ok(true)` when the peer proved the secret (and was told so),
/// `Ok(false)` when it did not (and was told so); `Err` when the connection broke first.
pub(crate) fn admit(r: &mut impl Read, w: &mut impl Write, secret: &JobSecret) -> io::Result<bool> {
    let mut server = [0u8; NONCE];
    fill_random(&mut server).map_err(|e| io::Error::other(e.to_string()))?;
    w.write_all(MAGIC)?;
    w.write_all(&server)?;
    w.flush()?;
    let mut client = [0u8; NONCE];
    let mut proof = [0u8; TAG];
    r.read_exact(&mut client)?;
    r.read_exact(&mut proof)?;
    // `verify_slice` compares in constant time.
    if secret
        .tag(b"client", &server, &client)
        .verify_slice(&proof)
        .is_err()
    {
        w.write_all(&[REFUSED])?;
        w.flush()?;
        return Ok(false);
    }
    w.write_all(&[ADMITTED])?;
    w.write_all(
        &secret
            .tag(b"server", &server, &client)
            .finalize()
            .into_bytes(),
    )?;
    w.flush()?;
    Ok(true)
}

/// The client's half: proves the secret, then checks the server's proof.
pub(crate) fn prove(r: &mut impl Read, w: &mut impl Write, secret: &JobSecret) -> io::Result<()> {
    let mut magic = [0u8; MAGIC.len()];
    r.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(denied(
            "the listener is not a ferrozero rendezvous store (or a different version)".into(),
        ));
    }
    let mut server = [0u8; NONCE];
    r.read_exact(&mut server)?;
    let mut client = [0u8; NONCE];
    fill_random(&mut client).map_err(|e| io::Error::other(e.to_string()))?;
    w.write_all(&client)?;
    w.write_all(
        &secret
            .tag(b"client", &server, &client)
            .finalize()
            .into_bytes(),
    )?;
    w.flush()?;
    let mut answer = [0u8; 1];
    r.read_exact(&mut answer)?;
    if answer[0] != ADMITTED {
        return Err(denied(format!(
            "the store refused this connection: {SECRET_VAR} differs from its job's secret"
        )));
    }
    let mut proof = [0u8; TAG];
    r.read_exact(&mut proof)?;
    secret
        .tag(b"server", &server, &client)
        .verify_slice(&proof)
        .map_err(|_| {
            denied(format!(
                "the store did not prove that it holds {SECRET_VAR}"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::os::unix::net::UnixStream;

    fn secret() -> JobSecret {
        JobSecret::new("a secret for the handshake's tests").unwrap()
    }

    /// Both halves over a socket pair: what the server decided, what the client saw.
    fn handshake(server_secret: JobSecret, client_secret: &JobSecret) -> (bool, io::Result<()>) {
        let (a, b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let (mut r, mut w) = (&a, &a);
            admit(&mut r, &mut w, &server_secret).unwrap()
        });
        let (mut r, mut w) = (&b, &b);
        let client = prove(&mut r, &mut w, client_secret);
        (server.join().unwrap(), client)
    }

    #[test]
    fn the_secret_opens_the_store_and_another_does_not() {
        let (admitted, client) = handshake(secret(), &secret());
        assert!(admitted);
        client.unwrap();
        let other = JobSecret::new("the secret of another job").unwrap();
        let (admitted, client) = handshake(secret(), &other);
        assert!(!admitted);
        let e = client.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains(SECRET_VAR), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        /// No answer without the secret opens the store: random bytes are refused or end
        /// the connection, and never panic.
        #[test]
        fn random_answers_are_refused(answer in proptest::collection::vec(any::<u8>(), 0..100)) {
            let mut out = Vec::new();
            match admit(&mut answer.as_slice(), &mut out, &secret()) {
                Ok(admitted) => {
                    prop_assert!(!admitted);
                    prop_assert_eq!(out.last(), Some(&REFUSED));
                }
                Err(e) => prop_assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof),
            }
        }
    }
}
