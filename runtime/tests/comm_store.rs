//! The TCP rendezvous store over loopback: set/get/wait/add between concurrent clients,
//! timeouts that are errors rather than hangs, and refusal of oversized requests. Who may
//! use a store (the job's secret, the bind address) is in `comm_store_auth.rs`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferrozero_runtime::comm::store::{JobSecret, StoreServer, TcpStore};

fn secret() -> JobSecret {
    JobSecret::new("this test job's store secret").unwrap()
}

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret()).expect("loopback bind")
}

fn connect(addr: SocketAddr, timeout: Duration) -> ferrozero_runtime::Result<TcpStore> {
    TcpStore::connect(addr, timeout, &secret())
}

fn connect_rank(addr: SocketAddr, rank: usize) -> TcpStore {
    TcpStore::connect_rank(addr, Duration::from_secs(10), rank, &secret()).unwrap()
}

#[test]
fn ranks_exchange_values_through_wait_and_set() {
    let srv = server();
    let addr = srv.addr();
    let n = 4;
    let seen: Vec<Vec<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let st = connect(addr, Duration::from_secs(10)).unwrap();
                    // Stagger so that some ranks wait before the key exists.
                    std::thread::sleep(Duration::from_millis(20 * r as u64));
                    st.set(&format!("rank{r}"), format!("hello from {r}").as_bytes())
                        .unwrap();
                    (0..n)
                        .map(|k| String::from_utf8(st.wait(&format!("rank{k}")).unwrap()).unwrap())
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<String> = (0..n).map(|k| format!("hello from {k}")).collect();
    assert!(seen.iter().all(|v| *v == want), "{seen:?}");
}

#[test]
fn get_add_and_overwrite() {
    let srv = server();
    let st = connect(srv.addr(), Duration::from_secs(5)).unwrap();
    assert_eq!(st.get("absent").unwrap(), None);
    st.set("k", b"v1").unwrap();
    st.set("k", b"").unwrap();
    assert_eq!(st.get("k").unwrap(), Some(Vec::new()));
    let other = connect(srv.addr(), Duration::from_secs(5)).unwrap();
    assert_eq!(st.add("count", 2).unwrap(), 2);
    assert_eq!(other.add("count", 5).unwrap(), 7);
    assert_eq!(other.add("count", -7).unwrap(), 0);
}

#[test]
fn wait_for_a_key_nobody_sets_times_out() {
    let srv = server();
    let st = connect(srv.addr(), Duration::from_millis(300)).unwrap();
    let t = Instant::now();
    let e = st.wait("never").expect_err("nobody sets it");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.contains("never") && msg.contains("no rank set it"),
        "{msg}"
    );
}

#[test]
fn connecting_to_a_missing_server_fails_after_the_timeout() {
    // Bind and drop to get a loopback port with (most likely) no listener.
    let addr: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let t = Instant::now();
    let e = connect(addr, Duration::from_millis(300)).expect_err("nobody listens");
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains("rendezvous store"), "{e}");
}

#[test]
fn oversized_keys_are_refused_client_side_and_the_connection_stays_usable() {
    let srv = server();
    let st = connect(srv.addr(), Duration::from_secs(5)).unwrap();
    let long = "k".repeat(5000);
    assert!(st.set(&long, b"x").is_err());
    st.set("ok", b"1").unwrap();
    assert_eq!(st.get("ok").unwrap(), Some(b"1".to_vec()));
}

#[test]
fn a_garbage_client_does_not_take_the_server_down() {
    use std::io::Write;
    let srv = server();
    let mut raw = std::net::TcpStream::connect(srv.addr()).unwrap();
    // Opcode 0 with a key length of 2^60: the server must refuse, not allocate.
    raw.write_all(&[0]).unwrap();
    raw.write_all(&(1u64 << 60).to_le_bytes()).unwrap();
    drop(raw);
    let st = connect(srv.addr(), Duration::from_secs(5)).unwrap();
    st.set("still", b"alive").unwrap();
    assert_eq!(st.wait("still").unwrap(), b"alive");
}

/// A race seen on a loaded machine: the hosting rank finishes first. Its handle must keep
/// serving until the other rank has closed its connection, so that rank's last reads still
/// succeed.
#[test]
fn the_host_outlives_every_rank_that_still_uses_the_store() {
    let srv = StoreServer::host_job(
        "127.0.0.1:0".parse().unwrap(),
        2,
        Duration::from_secs(30),
        secret(),
    )
    .expect("loopback bind");
    let addr = srv.addr();
    let host = connect_rank(addr, 0);
    let peer = connect_rank(addr, 1);
    host.set("done", b"1").unwrap();
    drop(host);
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(srv);
        tx.send(Instant::now()).unwrap();
    });
    // The peer keeps reading well after the host has "left".
    let reading = Instant::now();
    while reading.elapsed() < Duration::from_millis(300) {
        assert_eq!(peer.get("done").unwrap(), Some(b"1".to_vec()));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        rx.try_recv().is_err(),
        "the server stopped while rank 1 was connected"
    );
    let closed = Instant::now();
    drop(peer);
    let stopped = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("server stops");
    assert!(stopped >= closed);
    dropper.join().unwrap();
}

#[test]
fn a_host_whose_peers_never_come_stops_after_its_linger_limit() {
    let srv = StoreServer::host_job(
        "127.0.0.1:0".parse().unwrap(),
        3,
        Duration::from_millis(300),
        secret(),
    )
    .expect("loopback bind");
    let st = connect_rank(srv.addr(), 0);
    st.set("k", b"v").unwrap();
    drop(st);
    let t = Instant::now();
    drop(srv);
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn from_env_refuses_a_rank_outside_the_world() {
    // The variables are read by this process only; no other test of this binary reads them.
    std::env::set_var("RANK", "2");
    std::env::set_var("WORLD_SIZE", "2");
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    std::env::set_var("MASTER_PORT", "1");
    let e = TcpStore::from_env(Duration::from_millis(100)).expect_err("rank 2 of 2");
    assert!(
        e.to_string().contains("RANK 2 is not below WORLD_SIZE 2"),
        "{e}"
    );
}
