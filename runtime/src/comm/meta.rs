//! `MetaComm`: one simulated rank of a size-only run. It answers as rank `rank` of `world`
//! over the transport it stands for, and its collectives check lengths as the real ones do
//! (a reduce-scatter's output is its input over the world, an all-gather's the reverse, an
//! all-to-all's equal blocks) and move nothing. No other rank exists, so a split cannot learn
//! its group from its peers' colours: the engine's two kinds of split, contiguous blocks and
//! strided groups, are [`Communicator::split_blocks`] and [`Communicator::split_strided`],
//! computed here exactly; a general [`Communicator::split`] is refused.

use super::{BufMut, BufRef, CommBackend, Communicator, ReduceOp};
use crate::tensor::{View, ViewMut};
use crate::{Error, Result};

/// One simulated rank (see the module's documentation).
#[derive(Debug, Clone, Copy)]
pub struct MetaComm {
    rank: usize,
    world: usize,
    backend: CommBackend,
}

impl MetaComm {
    /// Rank `rank` of `world` ranks over `backend` (what the config's `comms.backend` names,
    /// so the engine's check of the transport passes).
    pub fn new(rank: usize, world: usize, backend: CommBackend) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::Invalid(format!(
                "meta communicator: rank {rank} is not a rank of a world of {world}"
            )));
        }
        Ok(Self {
            rank,
            world,
            backend,
        })
    }

    fn check(&self, op: &'static str, (input, output): (usize, usize), want: usize) -> Result<()> {
        let _ = input;
        if output == want {
            return Ok(());
        }
        Err(Error::Shape {
            op,
            expected: format!("{want} output elements at world size {}", self.world),
            got: format!("{output} for an input of {input}"),
        })
    }

    fn reduce_scatter_lens(&self, input: usize, output: usize) -> Result<()> {
        if input % self.world != 0 {
            return self.check("reduce_scatter", (input, output), usize::MAX);
        }
        self.check("reduce_scatter", (input, output), input / self.world)
    }

    fn all_gather_lens(&self, input: usize, output: usize) -> Result<()> {
        self.check("all_gather", (input, output), input * self.world)
    }

    fn all_to_all_lens(&self, input: usize, output: usize) -> Result<()> {
        if input % self.world != 0 {
            return self.check("all_to_all", (input, output), usize::MAX);
        }
        self.check("all_to_all", (input, output), input)
    }

    fn group(&self, rank: usize, world: usize) -> Box<dyn Communicator> {
        Box::new(MetaComm {
            rank,
            world,
            backend: self.backend,
        })
    }

    fn check_groups(&self, g: usize) -> Result<()> {
        if g == 0 || self.world % g != 0 {
            return Err(Error::Invalid(format!(
                "meta communicator: groups of {g} ranks do not split a world of {}",
                self.world
            )));
        }
        Ok(())
    }
}

impl Communicator for MetaComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> CommBackend {
        self.backend
    }
    fn all_reduce(&self, _buf: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        self.reduce_scatter_lens(input.len(), output.len())
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.all_gather_lens(input.len(), output.len())
    }
    fn broadcast(&self, _buf: BufMut<'_>, root: usize) -> Result<()> {
        self.check_root(root)
    }
    fn all_to_all(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.all_to_all_lens(input.len(), output.len())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn all_reduce_view(&self, _buf: ViewMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_view(&self, input: View<'_>, output: ViewMut<'_>, _: ReduceOp) -> Result<()> {
        self.reduce_scatter_lens(input.len(), output.len())
    }
    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.all_gather_lens(input.len(), output.len())
    }
    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.all_to_all_lens(input.len(), output.len())
    }
    fn broadcast_view(&self, _buf: ViewMut<'_>, root: usize) -> Result<()> {
        self.check_root(root)
    }
    fn duplicate(&self) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(*self))
    }
    /// Refused: one simulated rank cannot tell which ranks share its colour.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>> {
        Err(Error::Invalid(format!(
            "meta communicator: split(color {color}, key {key}) needs every rank's colour, and a \
             simulated rank has no peers; use split_blocks or split_strided"
        )))
    }
    fn split_blocks(&self, g: usize) -> Result<Box<dyn Communicator>> {
        self.check_groups(g)?;
        Ok(self.group(self.rank % g, g))
    }
    fn split_strided(&self, g: usize) -> Result<Box<dyn Communicator>> {
        self.check_groups(g)?;
        Ok(self.group(self.rank / g, self.world / g))
    }
}

impl MetaComm {
    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.world {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "broadcast root {root} is not a rank of {}",
            self.world
        )))
    }
}
