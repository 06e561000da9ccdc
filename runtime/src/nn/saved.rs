//! Saved-activation containers: plain structs of storages (on the unit's device) whose byte
//! count is exactly what they hold, so the memory ledger sees the real figure.

use super::module::{Saved, SavedState};
use crate::backend::Backend;
use crate::tensor::Storage;
use crate::{Error, Result};

/// Buffers a layer keeps between forward and backward: what they weigh and how they go back
/// to the device, so a block's saved state can nest its layers' without counting by hand.
pub(crate) trait Held {
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// Hands every buffer back to `be` for reuse.
    fn hand_back(self, be: &dyn Backend);
}

impl Held for Storage {
    fn bytes(&self) -> usize {
        Storage::bytes(self) as usize
    }
    fn hand_back(self, be: &dyn Backend) {
        be.recycle(self);
    }
}

impl<T: Held> Held for Option<T> {
    fn bytes(&self) -> usize {
        self.as_ref().map_or(0, Held::bytes)
    }
    fn hand_back(self, be: &dyn Backend) {
        if let Some(h) = self {
            h.hand_back(be);
        }
    }
}

impl<T: Held> Held for Vec<T> {
    fn bytes(&self) -> usize {
        self.iter().map(Held::bytes).sum()
    }
    fn hand_back(self, be: &dyn Backend) {
        for h in self {
            h.hand_back(be);
        }
    }
}

impl<A: Held, B: Held> Held for (A, B) {
    fn bytes(&self) -> usize {
        self.0.bytes() + self.1.bytes()
    }
    fn hand_back(self, be: &dyn Backend) {
        self.0.hand_back(be);
        self.1.hand_back(be);
    }
}

/// Declares a saved-state struct of [`Held`] fields with an exact `bytes()`; it is itself
/// [`Held`], so layers' states nest in a unit's.
macro_rules! saved_struct {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        pub(crate) struct $name {
            $(pub(crate) $field: $ty,)*
        }
        impl $crate::nn::saved::Held for $name {
            fn bytes(&self) -> usize {
                0 $(+ $crate::nn::saved::Held::bytes(&self.$field))*
            }
            fn hand_back(self, _be: &dyn $crate::backend::Backend) {
                $($crate::nn::saved::Held::hand_back(self.$field, _be);)*
            }
        }
        impl $crate::nn::module::SavedState for $name {
            fn bytes(&self) -> usize {
                $crate::nn::saved::Held::bytes(self)
            }
            fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
                self
            }
        }
    };
}
pub(crate) use saved_struct;

/// Takes the unit's saved state as type `T`, or explains why backward cannot run.
pub(crate) fn take<T: SavedState>(saved: &mut Saved, unit: &str) -> Result<Box<T>> {
    let state = saved.take().ok_or_else(|| {
        Error::Invalid(format!(
            "{unit}: backward called without a training-mode forward (nothing saved)"
        ))
    })?;
    state
        .into_any()
        .downcast::<T>()
        .map_err(|_| Error::Invalid(format!("{unit}: saved state belongs to another module")))
}
