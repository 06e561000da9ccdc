//! Who may use a rendezvous store: only connections that prove the job's secret read or
//! write a key; any other is refused and named by its address in the host's log; rank 0's
//! store listens on `MASTER_ADDR` only unless `FERROZERO_STORE_BIND` says otherwise.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore, BIND_VAR, SECRET_VAR};

const SECRET: &str = "the job's own store secret";

fn secret() -> JobSecret {
    JobSecret::new(SECRET).unwrap()
}

/// What the store's threads log, captured for the whole test binary.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOG.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log so far (the capturing subscriber is installed on first use).
fn log() -> String {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let sub = tracing_subscriber::fmt()
            .with_writer(|| Capture)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(sub).unwrap();
    });
    String::from_utf8_lossy(&LOG.lock().unwrap()).into_owned()
}

/// Waits (briefly) until the log names `who`: the server logs on its connection's thread.
fn logged_refusal(who: SocketAddr) -> String {
    let line = format!("refused a connection from {who}");
    for _ in 0..200 {
        let l = log();
        if l.contains(&line) {
            return l;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the log does not name {who}:\n{}", log());
}

fn job_store() -> (StoreServer, TcpStore) {
    log();
    let srv = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).unwrap();
    let st = TcpStore::connect(srv.addr(), Duration::from_secs(10), &secret()).unwrap();
    st.set("nccl_id", b"the job's unique id").unwrap();
    (srv, st)
}

/// A client that speaks the store's requests but holds no secret: whatever it sends, it gets
/// the challenge, one refusal byte and the end of the stream, and changes nothing.
#[test]
fn a_client_without_the_secret_can_neither_read_nor_write_and_is_named() {
    let (srv, st) = job_store();
    let mut raw = TcpStream::connect(srv.addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let me = raw.local_addr().unwrap();
    // A `set` of the id, then a `get` of it, in the store's request format.
    let mut req = vec![0u8];
    req.extend_from_slice(&7u64.to_le_bytes());
    req.extend_from_slice(b"nccl_id");
    req.extend_from_slice(&4u64.to_le_bytes());
    req.extend_from_slice(b"evil");
    req.push(1);
    req.extend_from_slice(&7u64.to_le_bytes());
    req.extend_from_slice(b"nccl_id");
    req.resize(64, 0);
    raw.write_all(&req).unwrap();
    let mut got = Vec::new();
    raw.read_to_end(&mut got).unwrap();
    assert_eq!(&got[..8], b"FZSTORE1", "{got:?}");
    assert_eq!(
        got.len(),
        8 + 32 + 1,
        "only the challenge and a refusal: {got:?}"
    );
    assert_ne!(got[40], 0xA5, "admitted");
    assert_eq!(
        st.get("nccl_id").unwrap().as_deref(),
        Some(&b"the job's unique id"[..])
    );
    logged_refusal(me);

    // One that sends a short request and stops writing is refused as soon as it does.
    let mut raw = TcpStream::connect(srv.addr()).unwrap();
    let me = raw.local_addr().unwrap();
    raw.write_all(&[1, 7, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    raw.write_all(b"nccl_id").unwrap();
    raw.shutdown(std::net::Shutdown::Write).unwrap();
    let mut got = Vec::new();
    raw.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), 8 + 32, "nothing past the challenge: {got:?}");
    let l = logged_refusal(me);
    assert!(l.contains("closed or stalled before proving it"), "{l}");
}

#[test]
fn a_client_with_another_secret_is_refused_and_named() {
    let (srv, st) = job_store();
    let other = JobSecret::new("another job's store secret").unwrap();
    let e = TcpStore::connect(srv.addr(), Duration::from_secs(10), &other)
        .expect_err("wrong secret")
        .to_string();
    assert!(
        e.contains("the store refused this connection") && e.contains(SECRET_VAR),
        "{e}"
    );
    // The error says which local address the host's log names.
    let from = e
        .split(" from ")
        .nth(1)
        .and_then(|r| {
            r.split(':')
                .take(2)
                .collect::<Vec<_>>()
                .join(":")
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no local address in {e:?}"));
    logged_refusal(from);
    assert_eq!(st.get("evil").unwrap(), None);
    // The store still serves its own job.
    let again = TcpStore::connect(srv.addr(), Duration::from_secs(10), &secret()).unwrap();
    assert_eq!(
        again.get("nccl_id").unwrap().as_deref(),
        Some(&b"the job's unique id"[..])
    );
}

/// A rank refuses a listener that cannot prove the secret, before sending it anything but
/// its own challenge answer (which is worthless for another connection).
#[test]
fn a_rank_refuses_a_listener_that_is_not_its_store() {
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap();
    let impostor = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        s.write_all(b"FZSTORE1").unwrap();
        s.write_all(&[7u8; 32]).unwrap();
        let mut answer = [0u8; 64];
        s.read_exact(&mut answer).unwrap();
        // Admits it, with a tag it cannot have computed.
        s.write_all(&[0xA5]).unwrap();
        s.write_all(&[0u8; 32]).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let e = TcpStore::connect(addr, Duration::from_secs(10), &secret())
        .expect_err("impostor")
        .to_string();
    assert!(e.contains("did not prove that it holds"), "{e}");
    assert!(
        impostor.join().unwrap().is_empty(),
        "a request reached the impostor"
    );
}

#[test]
fn secrets_are_long_enough_and_a_launch_gets_one() {
    let e = JobSecret::new("short").expect_err("5 bytes").to_string();
    assert!(e.contains(SECRET_VAR) && e.contains("at least 16"), "{e}");
    assert!(!format!("{:?}", secret()).contains(SECRET));
    let given = |v: &'static str| move |n: &str| (n == SECRET_VAR).then(|| v.to_string());
    let s = JobSecret::for_launch(4, given(SECRET)).unwrap();
    assert_eq!(s.as_env_value(), SECRET);
    let a = JobSecret::for_launch(1, |_| None).unwrap();
    let b = JobSecret::for_launch(1, |_| None).unwrap();
    assert_eq!(a.as_env_value().len(), 64);
    assert!(a.as_env_value().bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b, "every launch draws its own");
    let e = JobSecret::for_launch(2, |_| None)
        .expect_err("two nodes")
        .to_string();
    assert!(e.contains("2 nodes") && e.contains(SECRET_VAR), "{e}");
}

/// The only test of this binary that sets the rendezvous variables (tests run in threads).
#[test]
fn rank_zero_listens_on_the_master_address_unless_told_otherwise() {
    let host_of = |bind: Option<&str>| {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        for (k, v) in [
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ] {
            std::env::set_var(k, v);
        }
        std::env::set_var("MASTER_PORT", port.to_string());
        std::env::set_var(SECRET_VAR, SECRET);
        match bind {
            Some(b) => std::env::set_var(BIND_VAR, b),
            None => std::env::remove_var(BIND_VAR),
        }
        let st = TcpStore::from_env(Duration::from_secs(5)).unwrap();
        st.set("k", b"v").unwrap();
        (st, SocketAddr::from(([127, 0, 0, 2], port)))
    };
    let (st, elsewhere) = host_of(None);
    let e = TcpStore::connect(elsewhere, Duration::from_millis(300), &secret())
        .expect_err("bound to 127.0.0.1 only");
    assert!(
        e.to_string().contains("connecting to the rendezvous store"),
        "{e}"
    );
    drop(st);
    let (st, elsewhere) = host_of(Some("0.0.0.0"));
    let other = TcpStore::connect(elsewhere, Duration::from_secs(5), &secret()).unwrap();
    assert_eq!(other.get("k").unwrap(), Some(b"v".to_vec()));
    drop(other);
    drop(st);
    std::env::remove_var(SECRET_VAR);
    let e = TcpStore::from_env(Duration::from_secs(1)).expect_err("no secret");
    assert!(
        e.to_string().contains(&format!("{SECRET_VAR} is not set")),
        "{e}"
    );
}
