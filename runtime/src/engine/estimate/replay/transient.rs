//! Buffers that live only during one call, replayed where the device's own count sees them
//! ([`MemoryModel::counts_transients`]: a caching allocator's live bytes): the batch's ids,
//! the tensors between units and their gradients, each unit's working buffers
//! ([`crate::nn::Module::transient_bytes`]) and the loss kept until the step. The engine's
//! ledger counts none of them, so on the CPU (whose figure is that ledger) nothing here runs.
//!
//! A unit's working buffers are priced as a spike: allocated and freed at once at the moment
//! the unit runs, on top of what is alive then, which is where they raise the peak.

use super::Replay;
use crate::engine::build::reduce_dtype;
use crate::engine::ledger::{Category, Location};
use crate::engine::stage::Extent;
use crate::tensor::DType;

const AT: (Location, Category) = (Location::Device, Category::Activations);

impl Replay<'_> {
    fn alloc_act(&mut self, b: u64) {
        self.ledger.alloc(AT.0, AT.1, b);
    }

    fn free_act(&mut self, b: u64) {
        self.ledger.free(AT.0, AT.1, b);
    }

    /// A peak candidate: `b` bytes alive for a moment beside everything alive now.
    fn spike(&mut self, b: u64) {
        self.alloc_act(b);
        self.free_act(b);
    }

    /// `BatchIds::new`: tokens and targets (4-byte ids), alive until backward ends.
    fn ids_bytes(&self, mb: usize, seq: usize) -> u64 {
        2 * self.mem.bytes(DType::F32, mb * seq) as u64
    }

    pub(super) fn begin_forward_transients(&mut self, mb: usize, seq: usize) {
        if self.mem.counts_transients {
            self.alloc_act(self.ids_bytes(mb, seq));
        }
    }

    /// A unit's forward (or backward's recompute) with its parameters gathered: its saved
    /// state, working buffers and output exist together.
    pub(super) fn unit_forward_transients(&mut self, unit: usize, mb: usize, seq: usize) {
        if !self.mem.counts_transients {
            return;
        }
        let m = &self.model.units[unit].module;
        let b = m.saved_bytes(mb, seq, &self.mem)
            + m.transient_bytes(mb, seq, &self.mem).forward
            + m.output_bytes(mb, seq, &self.mem);
        self.spike(b as u64);
    }

    /// After a unit's forward: its output is the next unit's input; its own input is
    /// recycled (or, under checkpointing, kept: priced as the checkpoint).
    pub(super) fn pass_boundary(&mut self, unit: usize, mb: usize, seq: usize) {
        if !self.mem.counts_transients {
            return;
        }
        let out = self.model.units[unit]
            .module
            .output_bytes(mb, seq, &self.mem) as u64;
        self.alloc_act(out);
        let input = std::mem::replace(&mut self.boundary, out);
        self.free_act(input);
    }

    /// A unit's backward (every unit but the fused last one): its working buffers and the
    /// input gradient it returns, beside its saved state and the gradient it receives; then
    /// the returned gradient replaces the received one.
    pub(super) fn unit_backward_transients(&mut self, unit: usize, mb: usize, seq: usize) {
        if !self.mem.counts_transients {
            return;
        }
        let m = &self.model.units[unit].module;
        let work = m.transient_bytes(mb, seq, &self.mem).backward as u64;
        let dx = self.input_bytes(unit, mb, seq);
        self.spike(work + dx);
        self.alloc_act(dx);
        let received = std::mem::replace(&mut self.boundary, dx);
        self.free_act(received);
    }

    /// The last unit's forward and backward at once: its working buffers beside its output
    /// (the loss, kept until the step) and the input gradient it returns, which backward
    /// starts from; its input is recycled.
    pub(super) fn fused_transients(&mut self, unit: usize, mb: usize, seq: usize) {
        if !self.mem.counts_transients {
            return;
        }
        let m = &self.model.units[unit].module;
        let out = m.output_bytes(mb, seq, &self.mem) as u64;
        let work = m.forward_backward_bytes(mb, seq, &self.mem) as u64;
        let dx = self.input_bytes(unit, mb, seq);
        self.spike(work + out + dx);
        self.alloc_act(out);
        self.loss = out;
        self.alloc_act(dx);
        let input = std::mem::replace(&mut self.boundary, dx);
        self.free_act(input);
    }

    /// Backward's end: the first unit's (empty) input gradient and the batch's ids go; the
    /// loss stays, and goes at the step.
    pub(super) fn end_backward_transients(&mut self, mb: usize, seq: usize) {
        if !self.mem.counts_transients {
            return;
        }
        let dx = std::mem::take(&mut self.boundary);
        self.free_act(dx);
        self.free_act(self.ids_bytes(mb, seq));
    }

    /// `stage::reduce_output`: a sharded reduction's output shard in the wire dtype, alive
    /// with its input until the reduction is accumulated.
    pub(super) fn reduce_output_bytes(&self, g: usize) -> u64 {
        let layout = &self.groups[g].grads;
        let sharded = self.stage.grads() == Extent::Shard && layout.world_size > 1;
        if !(self.mem.counts_transients && sharded) {
            return 0;
        }
        (layout.shard_len * reduce_dtype(self.cfg).size()) as u64
    }

    /// `take_micro` then the cast to the wire dtype: the ledger lets the f32 micro-gradient
    /// go first; the device holds both while the cast runs.
    pub(super) fn free_micro_for_wire(&mut self, padded: usize, buf: u64) {
        let micro = (padded * 4) as u64;
        let (loc, cat) = (Location::Device, Category::CommBuffers);
        if self.mem.counts_transients {
            self.ledger.alloc(loc, cat, buf);
            self.ledger.free(loc, cat, micro);
        } else {
            self.ledger.free(loc, cat, micro);
            self.ledger.alloc(loc, cat, buf);
        }
    }

    /// The step reads the kept loss and lets it go.
    pub(super) fn step_transients(&mut self) {
        if !self.mem.counts_transients {
            return;
        }
        let loss = std::mem::take(&mut self.loss);
        self.free_act(loss);
    }
}
