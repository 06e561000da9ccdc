//! Host staging of views: a host routine (the CPU optimizer step of offloaded state) reading
//! or writing a view that may live in device memory gets host memory either way. Host views
//! pass through untouched; device views are downloaded, and the mutable ones uploaded again
//! by `finish`. These are the explicit copies of ZeRO-Offload's data path.

use super::{FlatBuf, View, ViewMut};
use crate::Result;

/// A read-only view in host memory: the original, or a downloaded copy.
pub enum Staged<'a> {
    /// Already host memory.
    Direct(View<'a>),
    /// A host copy of device memory.
    Copied(FlatBuf),
}

impl<'a> Staged<'a> {
    /// Stages `v` (downloads it when it is in device memory).
    pub fn new(v: View<'a>) -> Result<Self> {
        Ok(match v {
            View::Host(_) => Staged::Direct(v),
            View::Cuda(c) => Staged::Copied(c.to_host()?),
        })
    }

    /// The host view.
    pub fn view(&self) -> View<'_> {
        match self {
            Staged::Direct(v) => *v,
            Staged::Copied(b) => View::Host(b.as_ref()),
        }
    }
}

/// A mutable view in host memory: the original, or a copy written back by [`StagedMut::finish`].
pub enum StagedMut<'a> {
    /// Already host memory.
    Direct(ViewMut<'a>),
    /// A host copy of device memory, and where it goes back.
    Copied {
        /// The host copy.
        host: FlatBuf,
        /// The device view it came from.
        dst: ViewMut<'a>,
    },
}

impl<'a> StagedMut<'a> {
    /// Stages `v` (downloads it when it is in device memory).
    pub fn new(v: ViewMut<'a>) -> Result<Self> {
        Ok(match v {
            ViewMut::Host(_) => StagedMut::Direct(v),
            ViewMut::Cuda(c) => StagedMut::Copied {
                host: c.as_view().to_host()?,
                dst: ViewMut::Cuda(c),
            },
        })
    }

    /// The host view.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        match self {
            StagedMut::Direct(v) => v.reborrow(),
            StagedMut::Copied { host, .. } => ViewMut::Host(host.as_mut()),
        }
    }

    /// Writes a copy back to the device memory it came from.
    pub fn finish(self) -> Result<()> {
        match self {
            StagedMut::Direct(_) => Ok(()),
            StagedMut::Copied { host, dst } => match dst {
                ViewMut::Cuda(c) => c.upload(host.as_ref()),
                ViewMut::Host(_) => Ok(()),
            },
        }
    }
}
