//! The table of live device allocations both drivers keep, so that both reject an
//! out-of-range, freed or foreign pointer the same way, with an [`Error::Device`] naming the
//! CUDA call, before anything touches memory (on a GPU such a pointer would otherwise surface
//! later as a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`, or not at all).

use std::collections::{BTreeMap, VecDeque};

use super::DevPtr;
use crate::{Error, Result};

/// How many freed ranges are remembered, to say "freed" rather than "unknown".
const FREED_MEMORY: usize = 4096;

/// Live allocations (start to length) and recently freed ones.
#[derive(Debug, Default)]
pub(crate) struct AllocTable {
    live: BTreeMap<u64, u64>,
    freed: BTreeMap<u64, u64>,
    freed_order: VecDeque<u64>,
    allocated: u64,
    peak: u64,
}

impl AllocTable {
    /// Bytes live.
    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    /// The most bytes live at once.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Every live allocation (start, length).
    pub fn live(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.live.iter().map(|(&s, &l)| (s, l))
    }

    /// Records a new allocation.
    pub fn insert(&mut self, start: u64, len: u64) {
        // The address may be recycled from a freed allocation: forget that one.
        let stale: Vec<u64> = self
            .freed
            .range(..start + len)
            .filter(|(&s, &l)| s + l > start)
            .map(|(&s, _)| s)
            .collect();
        for s in stale {
            self.freed.remove(&s);
            self.freed_order.retain(|&x| x != s);
        }
        self.live.insert(start, len);
        self.allocated += len;
        self.peak = self.peak.max(self.allocated);
    }

    /// Removes the allocation starting at `p` and returns its length; `p` must be the start of
    /// a live allocation.
    pub fn remove(&mut self, p: DevPtr) -> Result<u64> {
        let Some(len) = self.live.remove(&p.0) else {
            let why = match self.check("cuMemFree", "pointer", p, 1) {
                Ok(()) => "it points inside a live allocation, not to its start".to_string(),
                Err(Error::Device { detail, .. }) => detail,
                Err(e) => e.to_string(),
            };
            return Err(Error::Device {
                op: "cuMemFree".into(),
                detail: format!("CUDA_ERROR_INVALID_VALUE: cannot free {p}: {why}"),
            });
        };
        self.allocated -= len;
        self.freed.insert(p.0, len);
        self.freed_order.push_back(p.0);
        while self.freed_order.len() > FREED_MEMORY {
            if let Some(old) = self.freed_order.pop_front() {
                self.freed.remove(&old);
            }
        }
        Ok(len)
    }

    /// Checks that `[p, p + bytes)` lies inside one live allocation; `op` names the CUDA call
    /// the error reports, `what` the operand. Zero bytes always pass.
    pub fn check(&self, op: &str, what: &str, p: DevPtr, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let end = p.0.checked_add(bytes);
        if let Some((&start, &len)) = self.live.range(..=p.0).next_back() {
            if p.0 < start + len {
                if end.is_some_and(|e| e <= start + len) {
                    return Ok(());
                }
                return Err(Error::Device {
                    op: op.into(),
                    detail: format!(
                        "CUDA_ERROR_INVALID_VALUE: {what} [{p}, +{bytes}) runs {} bytes past the \
                         end of the {len}-byte allocation at {start:#x} (offset {})",
                        (p.0 - start).saturating_add(bytes) - len,
                        p.0 - start
                    ),
                });
            }
        }
        let why = match self.freed.range(..=p.0).next_back() {
            Some((&start, &len)) if p.0 < start + len => {
                format!("the {len}-byte allocation at {start:#x} that held it was freed")
            }
            _ if p.is_null() => "it is the null pointer".to_string(),
            _ => "no allocation of this device contains it".to_string(),
        };
        Err(Error::Device {
            op: op.into(),
            detail: format!("CUDA_ERROR_INVALID_VALUE: {what} [{p}, +{bytes}): {why}"),
        })
    }

    /// Checks a device-to-device copy: both ranges live and not overlapping (undefined on a
    /// GPU).
    pub fn check_copy(&self, src: DevPtr, dst: DevPtr, bytes: u64) -> Result<()> {
        self.check("cuMemcpyDtoDAsync", "source", src, bytes)?;
        self.check("cuMemcpyDtoDAsync", "destination", dst, bytes)?;
        if bytes > 0 && src.0 < dst.0 + bytes && dst.0 < src.0 + bytes {
            return Err(Error::Device {
                op: "cuMemcpyDtoDAsync".into(),
                detail: format!(
                    "CUDA_ERROR_INVALID_VALUE: source [{src}, +{bytes}) and destination \
                     [{dst}, +{bytes}) overlap (undefined on a GPU)"
                ),
            });
        }
        Ok(())
    }
}
