//! Asynchronous store operations: `submit_*` hands the buffer to a background I/O thread
//! and returns a [`Pending`]; `wait` gives the buffer back with the outcome. The swap
//! pipelines build prefetch and write-behind on this.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::iobuf::{IoDst, IoSrc};
use super::Inner;
use crate::{Error, Result};

/// Background I/O threads per store: one read and one write can proceed together.
pub(super) const WORKERS: usize = 2;

type Job = Box<dyn FnOnce(&Inner) + Send>;

/// The store's background threads; joined on drop after the queue drains.
pub(super) struct Workers {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    pub(super) fn start(inner: &Arc<Inner>) -> Workers {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..WORKERS)
            .map(|i| {
                let (inner, rx) = (inner.clone(), rx.clone());
                std::thread::Builder::new()
                    .name(format!("fz-swap-{i}"))
                    .spawn(move || worker(&inner, &rx))
                    .expect("spawning an I/O thread")
            })
            .collect();
        Workers {
            jobs: Some(tx),
            threads,
        }
    }

    fn send<B: Send + 'static>(
        &self,
        job: impl FnOnce(&Inner, B) -> (B, Result<()>) + Send + 'static,
        buf: B,
    ) -> Pending<B> {
        let (tx, rx) = channel();
        let boxed: Job = Box::new(move |inner: &Inner| {
            let _ = tx.send(job(inner, buf));
        });
        if let Some(jobs) = &self.jobs {
            // A send only fails if every worker died, which `wait` reports.
            let _ = jobs.send(boxed);
        }
        Pending { rx }
    }

    pub(super) fn submit_write<B>(&self, key: &str, buf: B, len: usize) -> Pending<B>
    where
        B: IoSrc + Send + 'static,
    {
        let key = key.to_string();
        self.send(
            move |inner: &Inner, buf: B| {
                let r = inner.write_from(&key, &buf, len, "submit_write");
                (buf, r)
            },
            buf,
        )
    }

    pub(super) fn submit_read<B>(&self, key: &str, buf: B, len: usize) -> Pending<B>
    where
        B: IoDst + Send + 'static,
    {
        let key = key.to_string();
        self.send(
            move |inner: &Inner, mut buf: B| {
                let r = inner.read_into(&key, &mut buf, len, "submit_read");
                (buf, r)
            },
            buf,
        )
    }
}

fn worker(inner: &Inner, rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        match job {
            Ok(job) => job(inner),
            Err(_) => return,
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// An operation in flight; [`Pending::wait`] returns its buffer.
#[must_use = "an unwaited operation's error would be lost"]
pub struct Pending<B> {
    rx: Receiver<(B, Result<()>)>,
}

impl<B> Pending<B> {
    /// Blocks until the operation finishes; returns the buffer, or the error (the buffer is
    /// dropped, returning a pooled buffer to its pool).
    pub fn wait(self) -> Result<B> {
        self.wait_keep().map_or_else(|(_, e)| Err(e), Ok)
    }

    /// Like [`Pending::wait`], but hands the buffer back with the error too.
    pub fn wait_keep(self) -> std::result::Result<B, (Option<B>, Error)> {
        match self.rx.recv() {
            Ok((buf, Ok(()))) => Ok(buf),
            Ok((buf, Err(e))) => Err((Some(buf), e)),
            Err(_) => Err((
                None,
                Error::Resource("the store's I/O thread stopped before finishing".into()),
            )),
        }
    }
}
