//! Streaming NVMe-resident state into a shard file: tensors whose bytes are read from the
//! swap store only when the writer reaches them, so saving a run whose optimizer state and
//! parameters live on NVMe holds one group's state in memory, not the whole rank's.
//!
//! The safetensors writer asks for a tensor's bytes once, in file order (by dtype, then by
//! name: a group's three f32 tensors are adjacent), and cannot take an error back, so a failed
//! read is recorded here, zeros stand in, and the save fails before anything is published.

use std::cell::RefCell;
use std::rc::Rc;

use super::meta::TensorKind;
use crate::engine::group::Group;
use crate::engine::nvme::NvmeOffload;
use crate::engine::param_swap::{ParamSwap, ShardBytes};
use crate::engine::swap::nvme_shard_copy;
use crate::{Error, Result};

/// (master, m, v) over a group's owned range.
type State = (Vec<f32>, Vec<f32>, Vec<f32>);

/// What one save reads from NVMe: the last group's state, and the first error.
#[derive(Default)]
pub struct Streamer {
    cached: RefCell<Option<(usize, Rc<State>)>>,
    fault: RefCell<Option<Error>>,
}

impl Streamer {
    /// The first read error, if any (the save must then fail).
    pub fn take_fault(&self) -> Option<Error> {
        self.fault.borrow_mut().take()
    }

    /// Runs a read; on an error records it and returns `len` zero bytes.
    fn guarded(&self, len: usize, read: impl FnOnce() -> Result<Vec<u8>>) -> Vec<u8> {
        match read() {
            Ok(b) if b.len() == len => b,
            Ok(b) => {
                self.record(Error::Invalid(format!(
                    "checkpoint stream: {} bytes read where {len} were expected",
                    b.len()
                )));
                vec![0; len]
            }
            Err(e) => {
                self.record(e);
                vec![0; len]
            }
        }
    }

    fn record(&self, e: Error) {
        self.fault.borrow_mut().get_or_insert(e);
    }

    /// Group `gi`'s optimizer state, read once per group.
    fn state(&self, gi: usize, g: &Group, nvme: &NvmeOffload) -> Result<Rc<State>> {
        if let Some((i, s)) = &*self.cached.borrow() {
            if *i == gi {
                return Ok(s.clone());
            }
        }
        // Drop the previous group's state before reading the next.
        self.cached.borrow_mut().take();
        let state = g
            .nvme_adam
            .as_ref()
            .ok_or_else(|| Error::Invalid(format!("group {gi} has no NVMe optimizer state")))?;
        let len = g.owned.len();
        let (mut master, mut m, mut v) = (vec![0.0; len], vec![0.0; len], vec![0.0; len]);
        state.read_state(&nvme.store, &nvme.pool, &mut master, &mut m, &mut v)?;
        let s = Rc::new((master, m, v));
        *self.cached.borrow_mut() = Some((gi, s.clone()));
        Ok(s)
    }

    /// The bytes of one optimizer-state tensor of group `gi` over `local` (owned-relative).
    pub fn state_bytes(
        &self,
        gi: usize,
        g: &Group,
        nvme: &NvmeOffload,
        kind: TensorKind,
        local: std::ops::Range<usize>,
    ) -> Vec<u8> {
        self.guarded(local.len() * 4, || {
            let s = self.state(gi, g, nvme)?;
            let v = match kind {
                TensorKind::Master => &s.0,
                TensorKind::M => &s.1,
                _ => &s.2,
            };
            Ok(bytemuck::cast_slice(&v[local]).to_vec())
        })
    }

    /// The bytes of group `g`'s NVMe parameter shard.
    pub fn shard_bytes(&self, g: &Group, swap: &ParamSwap, len: usize) -> Vec<u8> {
        self.guarded(len, || match nvme_shard_copy(g, Some(swap))? {
            Some(b) => Ok(ShardBytes(b).as_ref().to_vec()),
            None => Err(Error::Invalid("parameter shard is not on NVMe".into())),
        })
    }
}
