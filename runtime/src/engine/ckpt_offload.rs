//! Where a checkpointed unit's input waits for backward (`activation_checkpointing`), and its
//! trips when that is host memory (`cpu_checkpointing`,
//! [`rules::ckpt_location`](super::rules::ckpt_location)):
//!
//! 1. [`Checkpoints::leave`], after the unit's forward: an event on the compute stream,
//!    the device-to-host stream waiting for it, the input downloaded on that stream into
//!    page-locked staging memory; its device buffer is released marked as used by that stream,
//!    so the allocator reuses the block only after the copy (the host never waits).
//! 2. [`Checkpoints::ahead`], when the backward of the unit after it starts: a device
//!    buffer, the host-to-device stream ordered after the compute stream's work so far, the
//!    input uploaded on it (one unit ahead, as parameters go up in `param_upload.rs`).
//! 3. [`Checkpoints::take`], at the recompute: the compute stream waits for that upload's
//!    event; the host never does. The staging buffer goes back to the pool once its copy
//!    has completed (polled; waited for only when the engine drops).
//!
//! A host view needs no copy: on the CPU the input already is in host memory, kept as it is,
//! so no bit moves. On a device the bytes make a round trip unchanged, so recompute reads
//! the bits a checkpoint kept on the device would give.
//!
//! The ledger counts the same on every device (the CPU rehearses a GPU's budget): the input in
//! host memory from its forward to its recompute, and on the device from its upload ahead to
//! its recompute; the estimate reads both from a size-only run of this code.

use super::ledger::{Category, Ledger, Location};
use crate::backend::{Backend, Stream};
use crate::tensor::in_flight::HostCopy;
use crate::tensor::{DType, Tensor};
use crate::Result;

/// A checkpointed unit's input between its forward and its recompute.
#[derive(Debug)]
pub(super) enum Checkpoint {
    /// Where the unit computed on it (the device, or host memory on the CPU).
    Kept(Tensor),
    /// In page-locked host memory (on its way down until the copy's event).
    Down {
        shape: Vec<usize>,
        dtype: DType,
        copy: HostCopy,
    },
    /// Counted on the device again: uploaded from `copy` (whose event the compute stream
    /// waits for at the recompute), or never moved (`None`, host memory).
    Up {
        input: Tensor,
        copy: Option<HostCopy>,
    },
}

/// The checkpoints of one engine, by unit, and staging copies still in flight.
#[derive(Debug, Default)]
pub(super) struct Checkpoints {
    inputs: Vec<Option<Checkpoint>>,
    /// Uploads whose device buffers are in use; their host memory returns when they finish.
    spent: Vec<HostCopy>,
}

impl Checkpoints {
    /// No checkpoint for any of `units` units.
    pub(super) fn new(units: usize) -> Self {
        Checkpoints {
            inputs: (0..units).map(|_| None).collect(),
            spent: Vec::new(),
        }
    }

    /// Gives back the staging memory of uploads that completed, without waiting.
    fn prune(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.spent.len() {
            if self.spent[i].poll()? {
                drop(self.spent.swap_remove(i));
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Keeps `input`, unit `unit`'s input, for its recompute in backward, where
    /// `loc` says (counted there by the ledger).
    pub(super) fn leave(
        &mut self,
        (unit, input): (usize, Tensor),
        loc: Location,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<()> {
        ledger.alloc(loc, Category::Activations, input.bytes() as u64);
        let kept = match loc {
            Location::Host => download(input, be)?,
            _ => Checkpoint::Kept(input),
        };
        self.prune()?;
        self.inputs[unit] = Some(kept);
        Ok(())
    }

    /// Starts bringing unit `unit`'s checkpoint back to the device, when it waits in host
    /// memory (counted on the device from now).
    pub(super) fn ahead(
        &mut self,
        unit: usize,
        loc: Location,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<()> {
        let Some(Checkpoint::Down { .. }) = &self.inputs[unit] else {
            if loc == Location::Host {
                self.count_ahead(unit, ledger);
            }
            return Ok(());
        };
        let Some(Checkpoint::Down {
            shape,
            dtype,
            mut copy,
        }) = self.inputs[unit].take()
        else {
            unreachable!("matched above");
        };
        let mut storage = be.buffer_uninit(dtype, copy.len())?;
        // The new block may have been the compute stream's until now.
        let ready = be.record(Stream::Compute)?;
        be.wait_event(Stream::HostToDevice, &ready)?;
        copy.upload_async(storage.view_mut(), Stream::HostToDevice)?;
        ledger.alloc(Location::Device, Category::Activations, storage.bytes());
        self.inputs[unit] = Some(Checkpoint::Up {
            input: Tensor { shape, storage },
            copy: Some(copy),
        });
        Ok(())
    }

    /// The ledger's side of [`Checkpoints::ahead`] for a checkpoint that did not move
    /// (host memory already): the same count as on a device, once.
    fn count_ahead(&mut self, unit: usize, ledger: &mut Ledger) {
        let slot = &mut self.inputs[unit];
        if let Some(Checkpoint::Kept(t)) = slot.take_if(|c| matches!(c, Checkpoint::Kept(_))) {
            let bytes = t.bytes() as u64;
            ledger.alloc(Location::Device, Category::Activations, bytes);
            self.inputs[unit] = Some(Checkpoint::Up {
                input: t,
                copy: None,
            });
        }
    }

    /// Unit `unit`'s checkpointed input for its recompute, on the compute device with the
    /// compute stream ordered after its upload; `None` when the unit kept none.
    pub(super) fn take(
        &mut self,
        unit: usize,
        loc: Location,
        be: &dyn Backend,
        ledger: &mut Ledger,
    ) -> Result<Option<Tensor>> {
        self.ahead(unit, loc, be, ledger)?;
        let input = match self.inputs[unit].take() {
            None => return Ok(None),
            Some(Checkpoint::Kept(t)) => t,
            Some(Checkpoint::Down { .. }) => unreachable!("brought back above"),
            Some(Checkpoint::Up { input, copy }) => {
                if let Some(e) = copy.as_ref().and_then(HostCopy::event) {
                    be.wait_event(Stream::Compute, e)?;
                }
                self.spent.extend(copy);
                ledger.free(
                    Location::Device,
                    Category::Activations,
                    input.bytes() as u64,
                );
                input
            }
        };
        ledger.free(loc, Category::Activations, input.bytes() as u64);
        Ok(Some(input))
    }
}

/// Downloads a checkpoint to host memory on the device-to-host stream, after the compute
/// stream's work so far.
fn download(mut input: Tensor, be: &dyn Backend) -> Result<Checkpoint> {
    let ready = be.record(Stream::Compute)?;
    be.wait_event(Stream::DeviceToHost, &ready)?;
    let dtype = input.storage.dtype();
    let Some(copy) = input.storage.view().download_async(Stream::DeviceToHost)? else {
        // Host memory already: nothing moves.
        return Ok(Checkpoint::Kept(input));
    };
    // The block is reused only after the copy reading it (the allocator's stream order).
    input.storage.record_stream(Stream::DeviceToHost);
    be.recycle(input.storage);
    Ok(Checkpoint::Down {
        shape: input.shape,
        dtype,
        copy,
    })
}
