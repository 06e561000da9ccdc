//! One lane moves a contiguous run of blocks between memory and a swap file: with io_uring
//! (up to `queue_depth` blocks in flight, see `ring`) or with blocking pread/pwrite on the
//! calling thread.
//!
//! Blocks whose memory is 4096-aligned and whole go straight to the kernel; the rest (an
//! unaligned caller slice, the padded last block) go through the lane's bounce buffers. Every
//! block is checksummed (crc32c over the whole padded block) when written and verified when
//! read. On the first failure the lane stops submitting, drains what is in flight (the kernel
//! may still be using those buffers) and returns the error of the lowest failing block.

use std::os::fd::RawFd;
use std::path::Path;

use io_uring::IoUring;

use crate::pool::{HostBuffer, ALIGN};
use crate::{Error, Result};

use super::ring::{self, Slot};
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
    pub(super) fn io_error(&self, op: &'static str, offset: u64, source: std::io::Error) -> Error {
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
pub(super) fn span(
    len: usize,
    block: usize,
    i: usize,
    base: *const u8,
) -> (std::ops::Range<usize>, bool) {
    let start = i * block;
    let end = (start + block).min(len);
    // SAFETY: start <= len, so the pointer stays inside (or one past) the caller's slice.
    let aligned = (unsafe { base.add(start) } as usize).is_multiple_of(ALIGN);
    (start..end, aligned && end - start == block)
}

impl Lane {
    /// Moves the blocks of `data`, which start at file block `first`.
    pub(super) fn run(&mut self, t: &Target<'_>, first: usize, data: Data<'_>) -> Result<()> {
        match self.ring.as_mut() {
            Some(ring) => ring::run(ring, &mut self.bounce, t, first, data),
            None => self.run_sync(t, first, data),
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
                    crcs[i] = crc(block);
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
}

impl Data<'_> {
    /// Bytes this part moves.
    pub(super) fn len(&self) -> usize {
        match self {
            Data::Write { src, .. } => src.len(),
            Data::Read { dst, .. } => dst.len(),
        }
    }

    pub(super) fn extent(&mut self) -> (usize, *const u8) {
        match self {
            Data::Write { src, .. } => (src.len(), src.as_ptr()),
            Data::Read { dst, .. } => (dst.len(), dst.as_ptr()),
        }
    }
}

/// Checks one completed request's result and, for a bounced read, verifies and copies the
/// block out of its bounce buffer; a direct read's verification is the caller's to schedule.
pub(super) fn complete(
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
    if let (Data::Read { dst, crcs }, true) = (data, slot.bounced) {
        let (r, _) = span(dst.len(), bs, slot.block, dst.as_ptr());
        verify(t, bounce, crcs[slot.block], off)?;
        dst[r.clone()].copy_from_slice(&bounce[..r.len()]);
    }
    Ok(())
}

/// The per-block checksum: crc32c of the whole (padded) block.
pub(super) fn crc(block: &[u8]) -> u32 {
    crc32c::crc32c(block)
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

pub(super) fn verify(t: &Target<'_>, block: &[u8], want: u32, off: u64) -> Result<()> {
    let got = crc(block);
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
pub(super) fn fill_bounce(bounce: &mut [u8], src: &[u8]) {
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
