//! The io_uring side of a lane: up to `queue_depth` block requests in flight, refilled as
//! they complete, with the checksum work done while the kernel is busy.
//!
//! Each turn queues a request into every free slot and hands the batch to the kernel first;
//! only then does it checksum: for writes the blocks just submitted (the kernel only reads
//! them, so hashing alongside the transfer is safe), for reads the blocks that completed in
//! the previous turn. So neither a write's CRC nor a read's verification ever stands between
//! a completion and the request that replaces it: the disk keeps its queue full while the CPU
//! works, which matters most at high queue depths on a busy machine.

use io_uring::{opcode, types, IoUring};

use crate::pool::HostBuffer;
use crate::{Error, Result};

use super::lane::{complete, crc, fill_bounce, span, verify, Data, Target};
use super::settings::{Overlap, Submit};

/// Per-request bookkeeping: the block a slot carries and whether it uses the slot's bounce
/// buffer.
#[derive(Clone, Copy)]
pub(super) struct Slot {
    pub block: usize,
    pub bounced: bool,
}

/// The state of one lane operation.
struct Flight {
    /// Which block each ring slot carries (its bounce buffer has the same index).
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    /// Next block to issue, and how many the part has.
    next: usize,
    blocks: usize,
    /// Checksum work due: (slot, block) of writes just submitted or reads just completed.
    due: Vec<(usize, Slot)>,
    /// The lowest failing block and its error; once set, nothing new is issued.
    failure: Option<(usize, Error)>,
}

/// Moves the blocks of `data` (file block `first` onwards) through `ring`, one bounce buffer
/// per slot; returns only once nothing is in flight.
pub(super) fn run(
    ring: &mut IoUring,
    bounce: &mut [HostBuffer],
    t: &Target<'_>,
    first: usize,
    mut data: Data<'_>,
) -> Result<()> {
    let depth = bounce.len();
    let mut f = Flight {
        slots: vec![None; depth],
        free: (0..depth).rev().collect(),
        next: 0,
        blocks: data.len().div_ceil(t.block),
        due: Vec::with_capacity(depth),
        failure: None,
    };
    loop {
        f.issue(ring, bounce, t, first, &mut data);
        if f.free.len() == depth {
            break;
        }
        if !f.due.is_empty() && t.submit == Submit::Batched {
            // Queue the new requests before hashing, so the disk is not idle meanwhile. A
            // failure here resurfaces from the wait below, which submits them again.
            let _ = ring.submit();
        }
        f.checksums(bounce, t, first, &mut data);
        if let Err(e) = f.wait(ring, t) {
            // io_uring_enter itself failed (EBADF, EFAULT: a broken ring, not an I/O
            // error); nothing more can be reaped from it.
            return Err(t.io_error("wait", ((first + f.next) * t.block) as u64, e));
        }
        f.reap(ring, bounce, t, first, &mut data);
    }
    f.checksums(bounce, t, first, &mut data);
    f.failure.map_or(Ok(()), |(_, e)| Err(e))
}

impl Flight {
    /// Whether an outcome for `block` still matters: only the lowest failure is reported.
    fn matters(&self, block: usize) -> bool {
        self.failure.as_ref().is_none_or(|(b, _)| block < *b)
    }

    fn fail(&mut self, block: usize, e: Error) {
        if self.matters(block) {
            self.failure = Some((block, e));
        }
    }

    /// Queues a request into every free slot (the bounce copy for partial or unaligned
    /// blocks is the only CPU work here).
    fn issue(
        &mut self,
        ring: &mut IoUring,
        bounce: &mut [HostBuffer],
        t: &Target<'_>,
        first: usize,
        data: &mut Data<'_>,
    ) {
        let bs = t.block;
        let (len, base) = data.extent();
        while self.failure.is_none() && self.next < self.blocks {
            let Some(s) = self.free.pop() else { break };
            let block = self.next;
            let (r, direct) = span(len, bs, block, base);
            let off = ((first + block) * bs) as u64;
            let entry = match data {
                Data::Write { src, .. } => {
                    let ptr = if direct {
                        src[r].as_ptr()
                    } else {
                        let b = &mut bounce[s][..bs];
                        fill_bounce(b, &src[r]);
                        b.as_ptr()
                    };
                    opcode::Write::new(types::Fd(t.fd), ptr, bs as u32)
                        .offset(off)
                        .build()
                }
                Data::Read { dst, .. } => {
                    let ptr = if direct {
                        dst[r].as_mut_ptr()
                    } else {
                        bounce[s].as_mut_ptr()
                    };
                    opcode::Read::new(types::Fd(t.fd), ptr, bs as u32)
                        .offset(off)
                        .build()
                }
            };
            let slot = Slot {
                block,
                bounced: !direct,
            };
            self.slots[s] = Some(slot);
            if matches!(data, Data::Write { .. }) {
                self.due.push((s, slot));
            }
            // SAFETY: the buffer outlives the request: `run` drains every request before
            // returning, and the slot (with its bounce buffer) stays taken until its
            // completion is reaped.
            unsafe { ring.submission().push(&entry.user_data(s as u64)) }
                .expect("at most `depth` requests in a ring of `depth` entries");
            self.next += 1;
            if t.submit == Submit::Single {
                if let Err(e) = ring.submit() {
                    // Stop issuing; the wait submits what is queued and drains it.
                    self.fail(block, t.io_error("submit", off, e));
                }
            }
        }
    }

    /// Hashes the writes just submitted and verifies the reads just completed.
    fn checksums(
        &mut self,
        bounce: &[HostBuffer],
        t: &Target<'_>,
        first: usize,
        data: &mut Data<'_>,
    ) {
        let bs = t.block;
        let (len, base) = data.extent();
        for (s, slot) in std::mem::take(&mut self.due) {
            let (r, _) = span(len, bs, slot.block, base);
            match data {
                Data::Write { src, crcs } => {
                    // A bounced block's slot is not reused before its completion is reaped,
                    // which happens after this call.
                    let bytes = if slot.bounced {
                        &bounce[s][..bs]
                    } else {
                        &src[r]
                    };
                    crcs[slot.block] = crc(bytes);
                }
                Data::Read { dst, crcs } => {
                    if self.matters(slot.block) {
                        let off = ((first + slot.block) * bs) as u64;
                        if let Err(e) = verify(t, &dst[r], crcs[slot.block], off) {
                            self.fail(slot.block, e);
                        }
                    }
                }
            }
        }
    }

    /// Submits what is queued and waits for one completion (overlapped) or for all in flight
    /// (sequential); an interrupted wait returns to the loop, which reaps what there is.
    fn wait(&self, ring: &mut IoUring, t: &Target<'_>) -> std::io::Result<()> {
        let inflight = self.slots.len() - self.free.len();
        let want = match t.overlap {
            Overlap::Overlapped => 1,
            Overlap::Sequential => inflight,
        };
        match ring.submit_and_wait(want) {
            Err(e)
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// Takes every completion: frees its slot, checks its result, copies a bounced read out
    /// (before the slot can be reused) and leaves direct reads' verification for the next
    /// turn's checksum pass.
    fn reap(
        &mut self,
        ring: &mut IoUring,
        bounce: &[HostBuffer],
        t: &Target<'_>,
        first: usize,
        data: &mut Data<'_>,
    ) {
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (s, res) in done {
            let slot = self.slots[s]
                .take()
                .expect("completion for a submitted slot");
            self.free.push(s);
            if !self.matters(slot.block) {
                continue;
            }
            match complete(t, first, data, slot, res, &bounce[s][..t.block]) {
                Err(e) => self.fail(slot.block, e),
                Ok(()) if matches!(data, Data::Read { .. }) && !slot.bounced => {
                    self.due.push((s, slot));
                }
                Ok(()) => {}
            }
        }
    }
}
