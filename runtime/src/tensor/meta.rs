//! Size-only elements: a dtype and a length and no bytes, the storage of the "meta" world in
//! which the real engine runs a step to measure what it holds (its ledger counts buffers by
//! their sizes) without computing or allocating model-sized memory, as torchtitan's
//! FakeTensorMode does. Operations that make a buffer make a meta buffer of the same dtype and
//! length; operations that compute do nothing; reads into host memory give zeros, up to
//! [`MAX_META_READ`] bytes, so a size-only run can never quietly materialise a model.

use super::{DType, FlatBuf};
use crate::{Error, Result};

/// Elements that have a dtype and a length and no values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaBuf {
    /// Element type.
    pub dtype: DType,
    /// Element count.
    pub len: usize,
}

/// The most bytes a read of meta elements into host memory may produce (it gives zeros).
/// Losses, scalars and small status reads pass; a read of a model-sized buffer is an error,
/// because a size-only run that needs one would be pricing memory it does not hold.
pub const MAX_META_READ: usize = 1 << 20;

impl MetaBuf {
    /// `len` elements of `dtype`.
    pub fn new(dtype: DType, len: usize) -> Self {
        Self { dtype, len }
    }

    /// Bytes the elements would hold.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The same dtype, `len` elements: a range or a sibling buffer.
    pub fn with_len(self, len: usize) -> Self {
        Self { len, ..self }
    }

    /// Checks that reading these elements into host memory for `op` stays small.
    pub fn check_read(&self, op: &str) -> Result<()> {
        check_read_bytes(op, self.bytes())
    }

    /// Zeros in host memory standing for the values, for a small read ([`MetaBuf::check_read`]).
    pub fn host_zeros(&self, op: &str) -> Result<FlatBuf> {
        self.check_read(op)?;
        Ok(FlatBuf::zeros(self.dtype, self.len))
    }
}

/// Refuses a read of `bytes` meta bytes into host memory above [`MAX_META_READ`].
pub fn check_read_bytes(op: &str, bytes: usize) -> Result<()> {
    if bytes <= MAX_META_READ {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "{op}: reading {bytes} bytes of meta (size-only) elements into host memory; a size-only \
         run reads at most {MAX_META_READ} bytes at once (it has no values to read)"
    )))
}

/// The error of an operation handed meta elements beside real ones.
pub fn mixed_meta(op: &str) -> Error {
    Error::Invalid(format!(
        "{op}: meta (size-only) elements mixed with real ones (a size-only run holds no values)"
    ))
}
