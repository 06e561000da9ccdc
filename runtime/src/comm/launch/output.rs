//! Copies each rank's stdout and stderr to the launcher's, line by line, prefixed with
//! `[rank N]` so that interleaved output stays attributable.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Child;
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// Which of the launcher's streams a pump writes to.
#[derive(Debug, Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

/// Starts one pump thread per piped stream of `child`; each returned receiver is signalled
/// when its stream ends.
pub(super) fn pump(rank: usize, child: &mut Child) -> Vec<Receiver<()>> {
    let mut done = Vec::new();
    if let Some(s) = child.stdout.take() {
        done.extend(spawn(rank, s, Sink::Stdout));
    }
    if let Some(s) = child.stderr.take() {
        done.extend(spawn(rank, s, Sink::Stderr));
    }
    done
}

fn spawn(rank: usize, stream: impl Read + Send + 'static, sink: Sink) -> Option<Receiver<()>> {
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name(format!("fz-launch-out-{rank}"))
        .spawn(move || {
            copy_lines(rank, stream, sink);
            let _ = tx.send(());
        })
        .ok()
        .map(|_| rx)
}

fn copy_lines(rank: usize, stream: impl Read, sink: Sink) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    let prefix = format!("[rank {rank}] ");
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        // One write per line under the stream's lock, so lines of different ranks never mix.
        let ok = match sink {
            Sink::Stdout => write_line(&mut std::io::stdout().lock(), &prefix, &line),
            Sink::Stderr => write_line(&mut std::io::stderr().lock(), &prefix, &line),
        };
        if !ok {
            return;
        }
    }
}

fn write_line(w: &mut impl Write, prefix: &str, line: &[u8]) -> bool {
    w.write_all(prefix.as_bytes())
        .and_then(|()| w.write_all(line))
        .and_then(|()| w.flush())
        .is_ok()
}

/// Waits for the pumps to finish copying, at most `limit` in all: a rank's child process
/// that inherited the pipe could keep it open forever.
pub(super) fn drain(pumps: Vec<Receiver<()>>, limit: Duration) {
    let deadline = Instant::now() + limit;
    for p in pumps {
        let _ = p.recv_timeout(deadline.saturating_duration_since(Instant::now()));
    }
}
