//! `MetaComm`: one simulated rank of a size-only run. It answers as rank `rank` of `world`
//! over the transport it stands for, and its collectives check lengths as the real ones do
//! (a reduce-scatter's output is its input over the world, an all-gather's the reverse, an
//! all-to-all's equal blocks) and move nothing. No other rank exists, so a split cannot learn
//! its group from its peers' colours: the engine's two kinds of split, contiguous blocks and
//! strided groups, are [`Communicator::split_blocks`] and [`Communicator::split_strided`],
//! computed here exactly; a general [`Communicator::split`] is refused.

use super::local::desc::OpKind;
use super::{CommBackend, Communicator, ReduceOp};
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

    /// The lengths a collective's buffers must have, as every transport checks them
    /// (`local::desc::OpKind::output_len`).
    fn lens(&self, op: OpKind, input: usize, output: usize) -> Result<()> {
        let want = op.output_len(input, self.world);
        if want == Some(output) {
            return Ok(());
        }
        Err(Error::Shape {
            op: op.name(),
            expected: match want {
                Some(n) => format!("{n} output elements at world size {}", self.world),
                None => format!("an input divisible by world size {}", self.world),
            },
            got: format!("{output} for an input of {input}"),
        })
    }

    fn group(&self, rank: usize, world: usize) -> Box<dyn Communicator> {
        Box::new(MetaComm {
            rank,
            world,
            backend: self.backend,
        })
    }

    fn check_groups(&self, g: usize) -> Result<()> {
        if g == 0 || !self.world.is_multiple_of(g) {
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
    crate::comm::host_by_views!(all_to_all);
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn all_reduce_view(&self, _buf: ViewMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_view(&self, input: View<'_>, output: ViewMut<'_>, _: ReduceOp) -> Result<()> {
        self.lens(OpKind::ReduceScatter, input.len(), output.len())
    }
    fn all_gather_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.lens(OpKind::AllGather, input.len(), output.len())
    }
    fn all_to_all_view(&self, input: View<'_>, output: ViewMut<'_>) -> Result<()> {
        self.lens(OpKind::AllToAll, input.len(), output.len())
    }
    fn broadcast_view(&self, _buf: ViewMut<'_>, root: usize) -> Result<()> {
        if root < self.world {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "broadcast root {root} is not a rank of {}",
            self.world
        )))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::run_ranks;
    use crate::tensor::{DType, FlatBuf};
    use std::time::Duration;

    fn v(len: usize) -> crate::tensor::Storage {
        crate::tensor::Storage::Meta(crate::tensor::meta::MetaBuf::new(DType::F32, len))
    }

    #[test]
    fn collectives_check_lengths_as_the_real_ones_and_move_nothing() {
        let c = MetaComm::new(1, 4, CommBackend::Local).unwrap();
        let (a, mut b) = (v(16), v(4));
        c.reduce_scatter_view(a.view(), b.view_mut(), ReduceOp::Sum)
            .unwrap();
        assert!(c
            .reduce_scatter_view(b.view(), v(1).view_mut(), ReduceOp::Sum)
            .is_ok());
        assert!(c
            .reduce_scatter_view(a.view(), v(5).view_mut(), ReduceOp::Sum)
            .is_err());
        assert!(c
            .reduce_scatter_view(v(15).view(), v(3).view_mut(), ReduceOp::Sum)
            .is_err());
        c.all_gather_view(v(4).view(), v(16).view_mut()).unwrap();
        assert!(c.all_gather_view(v(4).view(), v(12).view_mut()).is_err());
        c.all_to_all_view(v(8).view(), v(8).view_mut()).unwrap();
        assert!(c.all_to_all_view(v(6).view(), v(6).view_mut()).is_err());
        assert!(c.all_to_all_view(v(8).view(), v(4).view_mut()).is_err());
        assert!(c.broadcast_view(v(3).view_mut(), 4).is_err());
        // Host buffers: checked alike, and left as they were.
        let mut out = FlatBuf::F32(vec![5.0; 2]);
        c.all_gather(FlatBuf::zeros(DType::F32, 1).as_ref(), out.as_mut())
            .unwrap_err();
        c.reduce_scatter(
            FlatBuf::F32(vec![1.0; 8]).as_ref(),
            out.as_mut(),
            ReduceOp::Sum,
        )
        .unwrap();
        assert_eq!(out, FlatBuf::F32(vec![5.0; 2]));
        assert!(MetaComm::new(4, 4, CommBackend::Local).is_err());
    }

    /// The groups the local communicator's `split` forms, rank by rank, are the meta
    /// communicator's `split_blocks` and `split_strided`.
    #[test]
    fn block_and_strided_splits_are_the_real_splits() {
        for (world, g) in [(4, 2), (6, 3), (6, 2), (8, 4), (4, 1), (4, 4)] {
            let real = run_ranks(world, Duration::from_secs(30), |comm| {
                let b = comm.split_blocks(g)?;
                let s = comm.split_strided(g)?;
                Ok([(b.rank(), b.world_size()), (s.rank(), s.world_size())])
            })
            .unwrap();
            for (r, want) in real.iter().enumerate() {
                let m = MetaComm::new(r, world, CommBackend::Local).unwrap();
                let b = m.split_blocks(g).unwrap();
                let s = m.split_strided(g).unwrap();
                let got = [(b.rank(), b.world_size()), (s.rank(), s.world_size())];
                assert_eq!(&got, want, "world {world}, groups of {g}, rank {r}");
                assert_eq!(b.backend(), CommBackend::Local);
            }
        }
        let m = MetaComm::new(0, 6, CommBackend::Local).unwrap();
        assert!(m.split_blocks(4).is_err());
        let e = m.split(0, 0).err().unwrap();
        assert!(e.to_string().contains("split_blocks"), "{e}");
    }
}
