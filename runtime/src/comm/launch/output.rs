//! Copies each rank's stdout and stderr to the launcher's, line by line, prefixed with
//! `[rank N]` so that interleaved output stays attributable, and keeps each rank's last
//! stderr lines for the launcher to quote when that rank fails.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::Child;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Lines of a rank's stderr kept: enough to hold a panic's message behind its backtrace.
const TAIL_LINES: usize = 64;
/// Lines quoted in the verdict: an error line, or a panic's location and message.
const QUOTED: usize = 6;

/// The last lines a rank wrote to stderr (without the prefix), filled by its pump.
pub(super) type Tail = Arc<Mutex<VecDeque<String>>>;

/// Which of the launcher's streams a pump writes to.
#[derive(Debug, Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

/// Starts one pump thread per piped stream of `child`; each returned receiver is signalled
/// when its stream ends. The tail holds the rank's last stderr lines.
pub(super) fn pump(rank: usize, child: &mut Child) -> (Vec<Receiver<()>>, Tail) {
    let tail = Tail::default();
    let mut done = Vec::new();
    if let Some(s) = child.stdout.take() {
        done.extend(spawn(rank, s, Sink::Stdout, None));
    }
    if let Some(s) = child.stderr.take() {
        done.extend(spawn(rank, s, Sink::Stderr, Some(tail.clone())));
    }
    (done, tail)
}

/// What to quote of a failed rank's stderr: from its last panic's "panicked at" line up to
/// the backtrace (`RUST_BACKTRACE` would otherwise push the message out), else its last lines.
pub(super) fn last_words(tail: &Tail) -> Vec<String> {
    let t = tail.lock().unwrap_or_else(|p| p.into_inner());
    let lines: Vec<&String> = t.iter().collect();
    let quoted = match lines.iter().rposition(|l| l.contains(" panicked at ")) {
        Some(i) => lines[i..]
            .iter()
            .take_while(|l| !l.starts_with("stack backtrace:") && !l.starts_with("note: "))
            .take(QUOTED)
            .collect::<Vec<_>>(),
        None => lines[lines.len().saturating_sub(QUOTED)..].iter().collect(),
    };
    quoted.into_iter().map(|l| l.to_string()).collect()
}

fn spawn(
    rank: usize,
    stream: impl Read + Send + 'static,
    sink: Sink,
    tail: Option<Tail>,
) -> Option<Receiver<()>> {
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name(format!("fz-launch-out-{rank}"))
        .spawn(move || {
            copy_lines(rank, stream, sink, tail.as_ref());
            let _ = tx.send(());
        })
        .ok()
        .map(|_| rx)
}

fn keep(tail: &Tail, line: &[u8]) {
    let text = String::from_utf8_lossy(line).trim_end().to_string();
    if text.is_empty() {
        return;
    }
    let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
    if t.len() == TAIL_LINES {
        t.pop_front();
    }
    t.push_back(text);
}

fn copy_lines(rank: usize, stream: impl Read, sink: Sink, tail: Option<&Tail>) {
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
        if let Some(t) = tail {
            keep(t, &line);
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
