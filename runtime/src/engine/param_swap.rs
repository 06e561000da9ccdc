//! Stage-3 parameter offload to NVMe (ZeRO-Infinity's `offload_param.device = "nvme"`): each
//! partitioned group's parameter shard lives in the rank's swap directory between uses.
//!
//! A shard is swapped in before its group is all-gathered (read ahead of use when the engine
//! prefetches) and dropped right after the gather: parameters only change at the optimizer
//! step, so the file stays authoritative and dropping costs no write. The step writes the
//! updated shard back behind the next group's update. At most `buffer_count` shards are in
//! memory or in flight at once, each at most `buffer_size` elements (DeepSpeed's swapper
//! refuses larger parameters the same way), and their buffers are recycled, not reallocated.
//! Reading ahead also stops at `max_in_cpu` elements held.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ferrozero_config::resolved::ResolvedConfig;
use ferrozero_offload::store::{IoDst, IoSrc, NvmeStore, Pending};

use super::nvme::aio_settings;
use crate::backend::Backend;
use crate::tensor::{DType, FlatBuf, Storage};
use crate::{Error, Result};

/// A shard's bytes as the store reads and writes them.
pub struct ShardBytes(pub FlatBuf);

impl AsRef<[u8]> for ShardBytes {
    fn as_ref(&self) -> &[u8] {
        flat_bytes(&self.0)
    }
}

impl AsMut<[u8]> for ShardBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        flat_bytes_mut(&mut self.0)
    }
}

fn flat_bytes(b: &FlatBuf) -> &[u8] {
    match b {
        FlatBuf::F32(v) => bytemuck::cast_slice(v),
        FlatBuf::Bf16(v) => bytemuck::cast_slice(v),
        FlatBuf::F16(v) => bytemuck::cast_slice(v),
    }
}

fn flat_bytes_mut(b: &mut FlatBuf) -> &mut [u8] {
    match b {
        FlatBuf::F32(v) => bytemuck::cast_slice_mut(v),
        FlatBuf::Bf16(v) => bytemuck::cast_slice_mut(v),
        FlatBuf::F16(v) => bytemuck::cast_slice_mut(v),
    }
}

/// A swapped shard's buffer as the store reads and writes it: the bytes of host memory, or
/// none for size-only storage (which only the size-only device's store accepts).
pub struct SwapBuf(pub Storage);

impl IoSrc for SwapBuf {
    fn io_bytes(&self) -> Option<&[u8]> {
        self.0.host().map(flat_bytes)
    }
}

impl IoDst for SwapBuf {
    fn io_bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.0.host_mut().map(flat_bytes_mut)
    }
}

/// The rank's parameter swap store and its recycled shard buffers.
pub struct ParamSwap {
    /// The rank's own parameter swap directory.
    pub store: NvmeStore,
    /// Shards that may be in memory or in flight at once (`offload_param.buffer_count`).
    pub buffer_count: usize,
    /// Largest shard in elements (`offload_param.buffer_size`).
    pub buffer_size: usize,
    /// Elements that shards read ahead of use may bring the host copy to
    /// (`offload_param.max_in_cpu`); a shard needed now is always brought in.
    pub max_in_cpu: usize,
    spare: HashMap<(DType, usize), Vec<Storage>>,
    /// The compute device, whose host memory the shard buffers are.
    be: Arc<dyn Backend>,
}

impl ParamSwap {
    /// Opens `dir/params/rank{rank}` for a config whose parameters go to NVMe, the store and
    /// the shard buffers as the compute device `be` provides them.
    pub fn open(
        cfg: &ResolvedConfig,
        be: Arc<dyn Backend>,
        dir: &Path,
        rank: usize,
    ) -> Result<Self> {
        let off = &cfg.zero.offload_param;
        let store = be.nvme_store(
            &dir.join("params").join(format!("rank{rank}")),
            &aio_settings(&cfg.aio),
        )?;
        Ok(Self {
            store,
            buffer_count: off.buffer_count.max(2),
            buffer_size: off.buffer_size,
            max_in_cpu: off.max_in_cpu,
            spare: HashMap::new(),
            be,
        })
    }

    /// Refuses a shard larger than one swap buffer, naming the group and the fix.
    pub fn check_fits(&self, group: usize, elems: usize) -> Result<()> {
        if elems > self.buffer_size {
            return Err(Error::Config(format!(
                "zero_optimization.offload_param.buffer_size = {} elements is smaller than the parameter \
                 shard of group {group} ({elems} elements); raise buffer_size to at least {elems}",
                self.buffer_size
            )));
        }
        Ok(())
    }

    /// A buffer for a shard, recycled when one of that shape was returned. Contents are
    /// unspecified: callers read into it or overwrite it entirely.
    pub fn buffer(&mut self, dtype: DType, len: usize) -> Result<Storage> {
        match self.spare.get_mut(&(dtype, len)).and_then(Vec::pop) {
            Some(b) => Ok(b),
            None => self.be.host_zeros(dtype, len),
        }
    }

    /// Returns a buffer for reuse; the spares never exceed `buffer_count`.
    pub fn recycle(&mut self, b: Storage) {
        let held: usize = self.spare.values().map(Vec::len).sum();
        if held < self.buffer_count {
            self.spare.entry((b.dtype(), b.len())).or_default().push(b);
        }
    }
}

/// Where a swapped shard's bytes are right now.
enum SlotState {
    /// Only in the swap file.
    Out,
    /// A read is in flight.
    Reading(Pending<SwapBuf>),
    /// In memory (and, except between an update and its write, also in the file). Always
    /// host memory: the swap files are read and written from it.
    In(Storage),
    /// An updated shard is being written; it is in memory until the write completes.
    Writing(Pending<SwapBuf>),
}

/// One group's NVMe-resident parameter shard.
pub struct SwapSlot {
    /// The store key.
    pub key: String,
    /// Storage dtype.
    pub dtype: DType,
    /// Elements.
    pub len: usize,
    state: SlotState,
}

impl std::fmt::Debug for SwapSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            SlotState::Out => "out",
            SlotState::Reading(_) => "reading",
            SlotState::In(_) => "in",
            SlotState::Writing(_) => "writing",
        };
        f.debug_struct("SwapSlot")
            .field("key", &self.key)
            .field("len", &self.len)
            .field("state", &state)
            .finish()
    }
}

impl SwapSlot {
    /// Writes the initial shard and leaves it swapped out.
    pub fn create(swap: &mut ParamSwap, key: String, shard: Storage) -> Result<Self> {
        let mut slot = SwapSlot {
            key,
            dtype: shard.dtype(),
            len: shard.len(),
            state: SlotState::Out,
        };
        slot.write_sync(swap, shard)?;
        Ok(slot)
    }

    /// Bytes of the shard.
    pub fn bytes(&self) -> u64 {
        (self.len * self.dtype.size()) as u64
    }

    /// The shard, when it is in memory.
    pub fn resident(&self) -> Option<&Storage> {
        match &self.state {
            SlotState::In(b) => Some(b),
            _ => None,
        }
    }

    /// Mutable values, when the shard is in memory.
    pub fn resident_mut(&mut self) -> Option<&mut Storage> {
        match &mut self.state {
            SlotState::In(b) => Some(b),
            _ => None,
        }
    }

    /// A copy of the current values (for checkpoints and `parameters()`), from memory when
    /// the shard is in, otherwise read from the file. The shard's state does not change.
    pub fn read_copy(&self, store: &NvmeStore) -> Result<FlatBuf> {
        match &self.state {
            SlotState::In(b) => b.to_host(),
            SlotState::Writing(_) => Err(Error::Invalid(format!(
                "parameter shard {} read while its update is being written",
                self.key
            ))),
            _ => {
                let mut b = ShardBytes(FlatBuf::zeros(self.dtype, self.len));
                store.read(&self.key, b.as_mut())?;
                Ok(b.0)
            }
        }
    }

    /// Whether the shard occupies a buffer (in memory, or a read or write in flight).
    pub fn holds_buffer(&self) -> bool {
        !matches!(self.state, SlotState::Out)
    }

    /// Starts reading the shard ahead of use; no-op unless it is swapped out. A read ahead
    /// that gets no buffer is not started: the shard's use asks again and reports it.
    pub fn start_read(&mut self, swap: &mut ParamSwap) {
        if let SlotState::Out = self.state {
            let Ok(buf) = swap.buffer(self.dtype, self.len) else {
                return;
            };
            let n = self.bytes() as usize;
            let read = swap.store.submit_read(&self.key, SwapBuf(buf), n);
            self.state = SlotState::Reading(read);
        }
    }

    fn take(&mut self) -> SlotState {
        std::mem::replace(&mut self.state, SlotState::Out)
    }

    /// Brings the shard into memory (waiting for a read or write in flight) and returns it.
    /// On an error the shard stays swapped out and the file keeps its last good bytes.
    pub fn swap_in(&mut self, swap: &mut ParamSwap) -> Result<&mut Storage> {
        self.finish_write(swap)?;
        let buf = match self.take() {
            SlotState::In(b) => b,
            SlotState::Reading(p) => p.wait()?.0,
            _ => {
                let mut b = SwapBuf(swap.buffer(self.dtype, self.len)?);
                let n = self.bytes() as usize;
                if let Err(e) = swap.store.read_into(&self.key, &mut b, n) {
                    swap.recycle(b.0);
                    return Err(e.into());
                }
                b.0
            }
        };
        self.state = SlotState::In(buf);
        match &mut self.state {
            SlotState::In(b) => Ok(b),
            _ => unreachable!("set just above"),
        }
    }

    /// A buffer to overwrite entirely (the optimizer writes every element of the shard), so
    /// nothing is read from the file.
    pub fn overwrite(&mut self, swap: &mut ParamSwap) -> Result<&mut Storage> {
        self.finish_write(swap)?;
        if let SlotState::Out = self.state {
            self.state = SlotState::In(swap.buffer(self.dtype, self.len)?);
        }
        self.swap_in(swap)
    }

    /// Drops the in-memory copy (the file holds the same bytes); the buffer is recycled.
    pub fn release(&mut self, swap: &mut ParamSwap) {
        match self.take() {
            SlotState::In(b) => swap.recycle(b),
            other => self.state = other,
        }
    }

    /// Starts writing the in-memory (updated) shard back; it leaves memory when done.
    pub fn start_write(&mut self, swap: &mut ParamSwap) -> Result<()> {
        match self.take() {
            SlotState::In(b) => {
                let n = self.bytes() as usize;
                let p = swap.store.submit_write(&self.key, SwapBuf(b), n);
                self.state = SlotState::Writing(p);
            }
            other => self.state = other,
        }
        Ok(())
    }

    /// Waits for a write in flight; the shard is then swapped out. An error means the file
    /// does not hold the update: the run must stop (its checkpoints are untouched).
    pub fn finish_write(&mut self, swap: &mut ParamSwap) -> Result<()> {
        match self.take() {
            SlotState::Writing(p) => swap.recycle(p.wait()?.0),
            other => self.state = other,
        }
        Ok(())
    }

    /// Finishes whatever is in flight and swaps the shard out, so the file alone holds it.
    pub fn settle(&mut self, swap: &mut ParamSwap) -> Result<()> {
        self.finish_write(swap)?;
        match self.take() {
            SlotState::Reading(p) => swap.recycle(p.wait()?.0),
            SlotState::In(b) => swap.recycle(b),
            other => self.state = other,
        }
        Ok(())
    }

    /// Replaces the stored shard with `shard` (checkpoint load, `set_parameters`).
    pub fn write_sync(&mut self, swap: &mut ParamSwap, shard: Storage) -> Result<()> {
        self.settle(swap)?;
        if shard.len() != self.len || shard.dtype() != self.dtype {
            return Err(Error::Invalid(format!(
                "parameter shard {}: {} {:?} elements given, {} {:?} stored",
                self.key,
                shard.len(),
                shard.dtype(),
                self.len,
                self.dtype
            )));
        }
        let b = SwapBuf(shard);
        let written = swap.store.write_from(&self.key, &b, self.bytes() as usize);
        swap.recycle(b.0);
        Ok(written?)
    }
}
