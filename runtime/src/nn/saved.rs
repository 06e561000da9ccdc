//! Saved-activation containers: plain structs of storages (on the unit's device) whose byte
//! count is exactly what they hold, so the memory ledger sees the real figure.

use super::module::{Saved, SavedState};
use crate::{Error, Result};

/// Declares a saved-state struct of [`crate::tensor::Storage`] fields with an exact `bytes()`.
macro_rules! saved_struct {
    ($(#[$m:meta])* $name:ident { $($field:ident),* $(,)? }) => {
        $(#[$m])*
        pub(crate) struct $name {
            $(pub(crate) $field: $crate::tensor::Storage,)*
        }
        impl $name {
            /// Hands every buffer back to `be` for reuse (at the end of backward).
            #[allow(dead_code)] // states without buffers never call it
            pub(crate) fn recycle(self, _be: &dyn $crate::backend::Backend) {
                $(_be.recycle(self.$field);)*
            }
        }
        impl $crate::nn::module::SavedState for $name {
            fn bytes(&self) -> usize {
                0 $(+ self.$field.bytes() as usize)*
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
