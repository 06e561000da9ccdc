//! One lane moves a contiguous run of blocks between memory and a swap file: with io_uring
//! (up to `queue_depth` blocks in flight) or with blocking pread/pwrite on the calling thread.
//!
//! Blocks whose memory is 4096-aligned and whole go straight to the kernel; the rest (an
//! unaligned caller slice, the padded last block) go through the lane's bounce buffers. Every
//! block is checksummed (crc32c over the whole padded block) when written and verified when
//! read. On the first failure the lane stops submitting, drains what is in flight (the kernel
//! may still be using those buffers) and returns the error of the lowest failing block.

use std::os::fd::RawFd;
use std::path::Path;

use io_uring::{opcode, types, IoUring};

use crate::pool::{HostBuffer, ALIGN};
use crate::{Error, Result};

use super::settings::{Overlap, Submit};

/// What a part moves, with its checksums (filled on write, checked on read).
pub(super) enum Data<'a> {
    /// Memory to the file.
    Write { src: &'a [u8], crcs: &'a mut [u32] },
    /// File to memory.
    Read { dst: &'a mut [u8], crcs: &'a [u32] },
}

/// The file side of an operation, shared by its parts.
pub(super) struct Target<'a> {
    pub fd: RawFd,
    pub path: &'a Path,
    pub key: &'a str,
    pub block: usize,
    pub submit: Submit,
    pub overlap: Overlap,
}

impl Target<'_> {
    fn io_error(&self, op: &'static str, offset: u64, source: std::io::Error) -> Error {
        Error::Io {
            op,
            path: self.path.display().to_string(),
            offset,
            tensor: self.key.to_string(),
            source,
        }
    }

    fn corrupt(&self, offset: u64, reason: String) -> Error {
        Error::Corrupt {
            path: self.path.display().to_string(),
            offset,
            tensor: self.key.to_string(),
            reason,
        }
    }
}

/// An I/O lane: an optional ring and its bounce buffers (one per request it can have in
/// flight).
pub(super) struct Lane {
    pub ring: Option<IoUring>,
    pub bounce: Vec<HostBuffer>,
}

/// Where block `i`'s bytes sit in the caller's memory and whether the kernel can use them
/// directly.
fn span(len: usize, block: usize, i: usize, base: *const u8) -> (std::ops::Range<usize>, bool) {
    let start = i * block;
    let end = (start + block).min(len);
    // SAFETY: start <= len, so the pointer stays inside (or one past) the caller's slice.
    let aligned = (unsafe { base.add(start) } as usize).is_multiple_of(ALIGN);
    (start..end, aligned && end - start == block)
}

/// Per-request bookkeeping for the ring.
#[derive(Clone, Copy)]
struct Slot {
    block: usize,
    bounced: bool,
}

impl Lane {
    /// Moves the blocks of `data`, which start at file block `first`.
    pub(super) fn run(&mut self, t: &Target<'_>, first: usize, data: Data<'_>) -> Result<()> {
        if self.ring.is_some() {
            self.run_ring(t, first, data)
        } else {
            self.run_sync(t, first, data)
        }
    }

    fn run_sync(&mut self, t: &Target<'_>, first: usize, mut data: Data<'_>) -> Result<()> {
        let bs = t.block;
        let bounce = &mut self.bounce[0][..bs];
        let (len, base) = data.extent();
        for i in 0..len.div_ceil(bs) {
            let off = ((first + i) * bs) as u64;
            let (r, direct) = span(len, bs, i, base);
            match &mut data {
                Data::Write { src, crcs } => {
                    let block: &[u8] = if direct {
                        &src[r]
                    } else {
                        fill_bounce(bounce, &src[r]);
                        bounce
                    };
                    crcs[i] = crc32c::crc32c(block);
                    pwrite_all(t, block, off)?;
                }
                Data::Read { dst, crcs } => {
                    let block: &mut [u8] = if direct { &mut dst[r.clone()] } else { bounce };
                    pread_all(t, block, off)?;
                    verify(t, block, crcs[i], off)?;
                    if !direct {
                        dst[r.clone()].copy_from_slice(&bounce[..r.len()]);
                    }
                }
            }
        }
        Ok(())
    }

    fn run_ring(&mut self, t: &Target<'_>, first: usize, mut data: Data<'_>) -> Result<()> {
        let bs = t.block;
        let (len, base) = data.extent();
        let n = len.div_ceil(bs);
        let ring = self.ring.as_mut().expect("checked by run");
        let depth = self.bounce.len();
        let mut slots: Vec<Option<Slot>> = vec![None; depth];
        let (mut next, mut inflight, mut failure) = (0usize, 0usize, None::<(usize, Error)>);
        while next < n || inflight > 0 {
            while failure.is_none() && next < n && inflight < depth {
                let s = slots
                    .iter()
                    .position(Option::is_none)
                    .expect("inflight < depth");
                let (r, direct) = span(len, bs, next, base);
                let off = ((first + next) * bs) as u64;
                let bounce = self.bounce[s].as_mut_ptr();
                let entry = match &mut data {
                    Data::Write { src, crcs } => {
                        let ptr = if direct {
                            src[r].as_ptr()
                        } else {
                            // SAFETY: the slot is free, so nothing in flight uses this buffer.
                            let b = unsafe { std::slice::from_raw_parts_mut(bounce, bs) };
                            fill_bounce(b, &src[r]);
                            bounce.cast_const()
                        };
                        // SAFETY: ptr addresses `bs` readable bytes (checked by span/bounce).
                        crcs[next] = crc32c::crc32c(unsafe { std::slice::from_raw_parts(ptr, bs) });
                        opcode::Write::new(types::Fd(t.fd), ptr, bs as u32)
                            .offset(off)
                            .build()
                    }
                    Data::Read { dst, .. } => {
                        let ptr = if direct { dst[r].as_mut_ptr() } else { bounce };
                        opcode::Read::new(types::Fd(t.fd), ptr, bs as u32)
                            .offset(off)
                            .build()
                    }
                };
                slots[s] = Some(Slot {
                    block: next,
                    bounced: !direct,
                });
                // SAFETY: the buffer outlives the request: we drain every request before
                // returning, and the slot stays taken until its completion is reaped.
                unsafe { ring.submission().push(&entry.user_data(s as u64)) }
                    .expect("at most `depth` requests in a ring of `depth` entries");
                next += 1;
                inflight += 1;
                if t.submit == Submit::Single {
                    if let Err(e) = ring.submit() {
                        // Stop issuing; the wait below submits what is queued and drains it.
                        failure = Some((next - 1, t.io_error("submit", off, e)));
                    }
                }
            }
            if inflight == 0 {
                break;
            }
            let want = match t.overlap {
                Overlap::Overlapped => 1,
                Overlap::Sequential => inflight,
            };
            if let Err(e) = ring.submit_and_wait(want) {
                let again = matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                );
                if again {
                    continue;
                }
                // io_uring_enter itself failed with a non-transient error (EBADF, EFAULT:
                // a broken ring, not an I/O error); nothing more can be reaped from it.
                return Err(t.io_error("wait", ((first + next) * bs) as u64, e));
            }
            let done: Vec<(usize, i32)> = ring
                .completion()
                .map(|c| (c.user_data() as usize, c.result()))
                .collect();
            for (s, res) in done {
                let slot = slots[s].take().expect("completion for a submitted slot");
                inflight -= 1;
                // Report the lowest failing block, whatever order completions arrive in.
                if failure.as_ref().is_none_or(|(b, _)| slot.block < *b) {
                    let bounce = &self.bounce[s][..bs];
                    if let Err(e) = complete(t, first, &mut data, slot, res, bounce) {
                        failure = Some((slot.block, e));
                    }
                }
            }
        }
        failure.map_or(Ok(()), |(_, e)| Err(e))
    }
}

impl Data<'_> {
    /// Bytes this part moves.
    pub(super) fn len(&self) -> usize {
        match self {
            Data::Write { src, .. } => src.len(),
            Data::Read { dst, .. } => dst.len(),
        }
    }

    fn extent(&mut self) -> (usize, *const u8) {
        match self {
            Data::Write { src, .. } => (src.len(), src.as_ptr()),
            Data::Read { dst, .. } => (dst.len(), dst.as_ptr()),
        }
    }
}

/// Checks one completed request and, for a bounced read, copies the block out.
fn complete(
    t: &Target<'_>,
    first: usize,
    data: &mut Data<'_>,
    slot: Slot,
    res: i32,
    bounce: &[u8],
) -> Result<()> {
    let bs = t.block;
    let off = ((first + slot.block) * bs) as u64;
    let (op, is_read) = match data {
        Data::Write { .. } => ("write", false),
        Data::Read { .. } => ("read", true),
    };
    if res < 0 {
        return Err(t.io_error(op, off, std::io::Error::from_raw_os_error(-res)));
    }
    let got = res as usize;
    if got != bs {
        return Err(short(t, is_read, got, off));
    }
    if let Data::Read { dst, crcs } = data {
        let (len, base) = (dst.len(), dst.as_ptr());
        let (r, _) = span(len, bs, slot.block, base);
        if slot.bounced {
            verify(t, bounce, crcs[slot.block], off)?;
            dst[r.clone()].copy_from_slice(&bounce[..r.len()]);
        } else {
            verify(t, &dst[r], crcs[slot.block], off)?;
        }
    }
    Ok(())
}

fn short(t: &Target<'_>, is_read: bool, got: usize, off: u64) -> Error {
    let bs = t.block;
    if is_read {
        t.corrupt(
            off,
            format!("short read: {got} of {bs} bytes (file truncated?)"),
        )
    } else {
        let e = std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            format!("short write: {got} of {bs} bytes (disk full?)"),
        );
        t.io_error("write", off, e)
    }
}

fn verify(t: &Target<'_>, block: &[u8], want: u32, off: u64) -> Result<()> {
    let got = crc32c::crc32c(block);
    if got == want {
        Ok(())
    } else {
        Err(t.corrupt(
            off,
            format!("checksum mismatch: crc32c {got:#010x}, written {want:#010x}"),
        ))
    }
}

/// Copies `src` into the bounce buffer and zeroes the padding, so the checksum and the file
/// never depend on stale bytes.
fn fill_bounce(bounce: &mut [u8], src: &[u8]) {
    bounce[..src.len()].copy_from_slice(src);
    bounce[src.len()..].fill(0);
}

fn pwrite_all(t: &Target<'_>, block: &[u8], off: u64) -> Result<()> {
    loop {
        // SAFETY: block is a valid readable buffer of block.len() bytes.
        let r = unsafe { libc::pwrite(t.fd, block.as_ptr().cast(), block.len(), off as i64) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(t.io_error("write", off, e));
        }
        return if r as usize == block.len() {
            Ok(())
        } else {
            Err(short(t, false, r as usize, off))
        };
    }
}

fn pread_all(t: &Target<'_>, block: &mut [u8], off: u64) -> Result<()> {
    loop {
        // SAFETY: block is a valid writable buffer of block.len() bytes.
        let r = unsafe { libc::pread(t.fd, block.as_mut_ptr().cast(), block.len(), off as i64) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(t.io_error("read", off, e));
        }
        return if r as usize == block.len() {
            Ok(())
        } else {
            Err(short(t, true, r as usize, off))
        };
    }
}
