//! Host staging of views: a host routine (the CPU optimizer step of offloaded state) reading
//! or writing a view that may live in device memory gets host memory either way. Host views
//! pass through untouched; device views are downloaded, and the mutable ones uploaded again
//! by `finish`. These are the explicit copies of ZeRO-Offload's data path.

use super::{BufMut, BufRef, FlatBuf, View, ViewMut};
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

/// Runs `f` on `v`'s elements in host memory: a host view directly, a device view through an
/// explicit download (how a transport that reaches only host memory, such as MPI, reads
/// device buffers).
pub fn read_host<R>(v: View<'_>, f: impl FnOnce(BufRef<'_>) -> Result<R>) -> Result<R> {
    match v {
        View::Host(b) => f(b),
        View::Cuda(c) => f(c.to_host()?.as_ref()),
    }
}

/// Runs `f` on `v`'s elements in host memory and keeps what it wrote: a host view directly, a
/// device view through an explicit download and upload.
pub fn write_host<R>(v: ViewMut<'_>, f: impl FnOnce(BufMut<'_>) -> Result<R>) -> Result<R> {
    match v {
        ViewMut::Host(b) => f(b),
        ViewMut::Cuda(c) => {
            let mut host = c.as_view().to_host()?;
            let r = f(host.as_mut())?;
            c.upload(host.as_ref())?;
            Ok(r)
        }
    }
}
