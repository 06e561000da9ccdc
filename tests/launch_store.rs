//! `ferrozero launch` end to end over loopback: two ranks rendezvous through the TCP store
//! (the path the NCCL backend will take) and verify each other's values; a failing rank
//! stops the others well within their timeout; output is prefixed with the rank; a
//! connection without the job's secret is refused and named in rank 0's log.
//!
//! The ranks are this test binary itself, re-entered through the ignored `rank_main` test
//! with `FZ_LAUNCH_TEST_MODE` set, so no extra binary has to be built.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use ferrozero_runtime::comm::store::{JobSecret, TcpStore, SECRET_VAR};

const MODE: &str = "FZ_LAUNCH_TEST_MODE";

/// A free loopback port (bound then released; the launch binds it again right after).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn launch(nproc: usize, mode: &str) -> (Output, Duration) {
    let me = std::env::current_exe().unwrap();
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["launch", "--nproc-per-node", &nproc.to_string()])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &free_port().to_string(),
        ])
        .args(["--grace-secs", "5", "--"])
        .arg(me)
        .args([
            "--ignored",
            "--exact",
            "rank_main",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(MODE, mode)
        .output()
        .expect("ferrozero runs");
    (out, start.elapsed())
}

/// The rank program: exchanges values through the store, or fails on purpose.
#[test]
#[ignore = "entry point of the launched ranks, run by the tests below"]
fn rank_main() {
    let Ok(mode) = std::env::var(MODE) else {
        return;
    };
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    assert_eq!(std::env::var("LOCAL_RANK").unwrap(), rank.to_string());
    assert_eq!(
        std::env::var("LOCAL_WORLD_SIZE").unwrap(),
        world.to_string()
    );
    // The store's refusals go to stderr, which the launcher prefixes with the rank.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let secret = std::env::var(SECRET_VAR).expect("the launcher hands every rank the secret");
    assert_eq!(secret.len(), 64, "{secret}");
    let store = TcpStore::from_env(Duration::from_secs(60)).expect("store");
    assert_eq!(store.is_host(), rank == 0);
    store
        .set(
            &format!("value/{rank}"),
            format!("{}", rank * 1000 + 7).as_bytes(),
        )
        .unwrap();
    let seen: Vec<String> = (0..world)
        .map(|k| String::from_utf8(store.wait(&format!("value/{k}")).unwrap()).unwrap())
        .collect();
    for (k, v) in seen.iter().enumerate() {
        assert_eq!(*v, format!("{}", k * 1000 + 7), "value of rank {k}");
    }
    // A fresh line: the test harness has printed "test rank_main ... " without one.
    println!("\nstore_check ok: rank {rank} of {world} saw {seen:?}");
    if mode == "intruder" && rank == 1 {
        let other = JobSecret::new("the secret of some other job").unwrap();
        let e = TcpStore::connect(store.addr(), Duration::from_secs(30), &other)
            .expect_err("another job's secret is refused");
        println!("intruder refused: {e}");
    }
    if mode == "fail" {
        if rank == 1 {
            eprintln!("rank 1 fails on purpose");
            std::process::exit(3);
        }
        // The others hang far longer than the test allows (not on the store: its server
        // lives in rank 0, which the launcher stops too, and a SIGTERM does not wait for
        // the other ranks to leave).
        std::thread::sleep(Duration::from_secs(60));
        println!("rank {rank} was not stopped");
    }
    if mode == "panic" {
        assert_ne!(rank, 1, "rank 1 panics on purpose");
        std::thread::sleep(Duration::from_secs(60));
        println!("rank {rank} was not stopped");
    }
    // A final barrier through the store, as jobs end: rank 0 can see the count complete and
    // return while rank 1 is still polling; dropping rank 0's store then waits until rank 1
    // has closed its connection, so rank 1 never reads from a vanished host (a race seen on a loaded machine).
    store.add("done", 1).unwrap();
    while store.get("done").unwrap() != Some((world as i64).to_le_bytes().to_vec()) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn two_ranks_rendezvous_through_the_store_and_verify_values() {
    let (out, _) = launch(2, "exchange");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for r in 0..2 {
        let line = format!("[rank {r}] store_check ok: rank {r} of 2 saw [\"7\", \"1007\"]");
        assert!(stdout.contains(&line), "missing {line:?} in:\n{stdout}");
    }
}

/// A client holding another job's secret cannot join; rank 0's log names its address.
#[test]
fn a_connection_without_the_jobs_secret_is_refused_and_named_by_rank_zero() {
    let (out, _) = launch(2, "intruder");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("[rank 1] intruder refused: "))
        .unwrap_or_else(|| panic!("no refusal in:\n{stdout}"));
    assert!(line.contains("the store refused this connection"), "{line}");
    let from = line
        .split(" from ")
        .nth(1)
        .and_then(|r| r.split(": ").next())
        .unwrap_or_else(|| panic!("no local address in {line}"));
    let named = format!("refused a connection from {from}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("[rank 0]") && l.contains(&named)),
        "rank 0 does not name {from}:\n{stderr}"
    );
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let (out, elapsed) = launch(3, "fail");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("[rank 1] rank 1 fails on purpose"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "rank 1 failed (exit status: 3); stopped ranks [0, 2]\n  rank 1 said:\n    \
             rank 1 fails on purpose"
        ),
        "{stderr}"
    );
    assert!(!stdout.contains("was not stopped"), "{stdout}");
    // The survivors would hang for 60 s; SIGTERM ends them at once.
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
}

/// A rank's panic reaches the verdict: its message and where it happened, after the rank.
#[test]
fn a_panicking_rank_is_named_with_its_panic_message() {
    let (out, _) = launch(2, "panic");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(101), "{stdout}\n{stderr}");
    let verdict = stderr
        .split_once("ferrozero launch: rank 1 failed (exit status: 101); stopped ranks [0]")
        .unwrap_or_else(|| panic!("no verdict for rank 1 in:\n{stderr}"))
        .1;
    assert!(verdict.starts_with("\n  rank 1 said:\n"), "{verdict}");
    assert!(
        verdict.contains("panicked at tests/launch_store.rs:"),
        "{verdict}"
    );
    assert!(verdict.contains("rank 1 panics on purpose"), "{verdict}");
    assert!(!stdout.contains("was not stopped"), "{stdout}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ferrozero"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["launch", "--nproc-per-node", "0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nproc-per-node must be at least 1"));
    let out = run(&["launch", "--nnodes", "2", "--node-rank", "2", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank 2 is not below --nnodes 2"));
    // Every node must hand its ranks the same secret, which only the environment can give.
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["launch", "--nnodes", "2", "--", "true"])
        .env_remove(SECRET_VAR)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a job of 2 nodes needs one store secret"),
        "{stderr}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args(["launch", "--", "true"])
        .env(SECRET_VAR, "short")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{SECRET_VAR} is 5 bytes long")),
        "{stderr}"
    );
    let out = run(&["launch", "--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("starting rank 0"));
    let out = run(&["launch", "--nproc-per-node", "2", "--", "false"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn sigterm_to_the_launcher_is_forwarded_to_every_rank() {
    use std::io::{BufRead, BufReader};
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--grace-secs",
            "20",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "trap 'echo got TERM; kill $!; exit 0' TERM; echo ready; sleep 60 & wait",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Signal only once both ranks have installed their trap (they say so after it), however
    // long a loaded machine takes to start them.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    let mut ready = 0;
    while ready < 2 {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            panic!("the ranks ended before saying ready:\n{seen}");
        }
        ready += usize::from(line.trim_end().ends_with("] ready"));
        seen.push_str(&line);
    }
    let signalled = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    seen.push_str(&rest);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Both ranks ran their TERM trap (so the signal reached them, well before the 20 s grace).
    for r in 0..2 {
        assert!(
            seen.contains(&format!("[rank {r}] got TERM")),
            "{seen}\n{stderr}"
        );
    }
    assert_eq!(out.status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("interrupted by signal 15"), "{stderr}");
    assert!(signalled.elapsed() < Duration::from_secs(15));
    assert!(start.elapsed() < Duration::from_secs(60));
}

/// Each rank runs on the cores `FERROZERO_CPUS` names (its share of a NUMA node), which the
/// kernel confirms; `--no-cpu-bind` leaves the ranks unbound.
#[test]
fn ranks_are_bound_to_their_cores_unless_told_not_to() {
    let script = "echo \"cpus=${FERROZERO_CPUS:-none} \
                  $(grep Cpus_allowed_list /proc/self/status | tr -d '\\t ')\"";
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrozero"))
            .args(["launch", "--nproc-per-node", "2", "--master-port"])
            .arg(free_port().to_string())
            .args(extra)
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let bound = run(&[]);
    for r in 0..2 {
        let line = bound
            .lines()
            .find(|l| l.starts_with(&format!("[rank {r}]")))
            .unwrap_or_else(|| panic!("no output of rank {r}: {bound}"));
        let (cpus, allowed) = line
            .split_once("cpus=")
            .and_then(|(_, rest)| rest.split_once(" Cpus_allowed_list:"))
            .unwrap_or_else(|| panic!("{line}"));
        assert_ne!(cpus, "none", "{line}");
        assert_eq!(cpus, allowed.trim(), "{line}");
    }
    let unbound = run(&["--no-cpu-bind"]);
    assert_eq!(unbound.matches("cpus=none").count(), 2, "{unbound}");
}
