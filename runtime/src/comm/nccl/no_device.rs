//! The event ordering of `device.rs` in a build without CUDA memory: no device view can
//! exist, so no collective runs on a device's stream.

use std::convert::Infallible;

use super::api::NcclOp;
use crate::Result;

/// A device that holds a collective's buffers (none exists in this build).
pub(super) type Dev = Infallible;

/// Every op's buffers are host memory in this build.
pub(super) fn device_of(_: &NcclOp<'_>) -> Option<Dev> {
    None
}

/// A communicator's events (none in this build).
#[derive(Default)]
pub(super) struct Marks(());

/// The end of a collective on a device's stream (none exists in this build).
pub(super) struct End(Infallible);

impl End {
    /// Unreachable: no [`End`] exists.
    pub(super) fn finished(&self) -> Result<bool> {
        match self.0 {}
    }
}

impl Marks {
    /// Unreachable: no device exists.
    pub(super) fn before(&self, dev: &Dev) -> Result<()> {
        match *dev {}
    }

    /// Unreachable: no device exists.
    pub(super) fn after(&self, dev: &Dev) -> Result<End> {
        match *dev {}
    }
}
