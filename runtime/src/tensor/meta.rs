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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Storage, View};

    fn meta(dtype: DType, len: usize) -> Storage {
        Storage::Meta(MetaBuf::new(dtype, len))
    }

    #[test]
    fn ranges_and_made_buffers_keep_the_dtype_and_take_the_length() {
        let mut s = meta(DType::Bf16, 1000);
        assert_eq!((s.len(), s.dtype(), s.bytes()), (1000, DType::Bf16, 2000));
        let r = s.range(10..110).unwrap();
        assert!(matches!(r, View::Meta(m) if m == MetaBuf::new(DType::Bf16, 100)));
        assert!(matches!(r.host_zeros_like().unwrap(), Storage::Meta(m) if m.len == 100));
        let (a, b) = s.range_mut(0..30).unwrap().split_at(12).unwrap();
        assert_eq!((a.len(), b.len(), b.dtype()), (12, 18, DType::Bf16));
        assert!(s.range(990..1001).is_err());
        let z = s.zeros_like(DType::F32, 7).unwrap();
        assert!(matches!(z, Storage::Meta(m) if m == MetaBuf::new(DType::F32, 7)));
        let u = s.uninit_like(DType::F16, 3).unwrap();
        assert!(matches!(u, Storage::Meta(m) if m == MetaBuf::new(DType::F16, 3)));
        assert!(matches!(s.try_clone().unwrap(), Storage::Meta(m) if m.len == 1000));
        // Computing does nothing and succeeds; a span outside the buffer still fails.
        s.fill_zero().unwrap();
        assert_eq!(s.sum_squares(0..1000).unwrap(), 0.0);
        assert!(!s.has_non_finite(0..1000).unwrap());
        s.write_f32(990, &[1.0; 10]).unwrap();
        assert!(s.write_f32(995, &[1.0; 10]).is_err());
        let mut called = false;
        s.write_f32_with(0, 1000, || {
            called = true;
            vec![0.0; 1000]
        })
        .unwrap();
        assert!(!called, "a meta buffer's values are never generated");
        assert!(s.is_host_side() && s.host().is_none());
    }

    #[test]
    fn meta_and_host_operands_are_refused_together() {
        let mut m = meta(DType::F32, 8);
        let mut h = Storage::from_f32(vec![1.0; 8]);
        let mut scratch = Vec::new();
        let errs = [
            m.cast_into(&mut h).unwrap_err(),
            h.cast_into(&mut m).unwrap_err(),
            m.accumulate(0, &h, 8, &mut scratch).unwrap_err(),
            h.accumulate(0, &m, 8, &mut scratch).unwrap_err(),
        ];
        for e in errs {
            assert!(e.to_string().contains("meta"), "{e}");
        }
        // Host memory beside a size-only host buffer is a size-only device's staging: copies
        // and a downloaded gradient's addition move nothing, in either direction, and leave
        // the host values as they were; shapes are still checked.
        m.accumulate_view(0, h.view(), &mut scratch).unwrap();
        h.copy_to(0, &mut m, 0, 8).unwrap();
        m.copy_to(0, &mut h, 0, 8).unwrap();
        assert_eq!(h.to_vec_f32().unwrap(), vec![1.0; 8]);
        let mut wide = meta(DType::Bf16, 8);
        assert!(h.copy_to(0, &mut wide, 0, 8).is_err());
        let mut other = meta(DType::F32, 8);
        m.cast_into(&mut other).unwrap();
        other.accumulate(0, &m, 8, &mut scratch).unwrap();
        m.copy_to(0, &mut other, 0, 8).unwrap();
        // A copy between meta buffers still checks dtypes.
        assert!(m.copy_to(0, &mut meta(DType::Bf16, 8), 0, 8).is_err());
    }

    #[test]
    fn small_reads_give_zeros_and_big_reads_are_refused_by_name() {
        let small = meta(DType::F32, 4);
        assert_eq!(small.to_vec_f32().unwrap(), vec![0.0; 4]);
        let mut one = [7.0f32];
        small.read_f32(2, &mut one).unwrap();
        assert_eq!(one, [0.0]);
        let limit = MAX_META_READ / 4;
        let edge = meta(DType::F32, limit);
        assert_eq!(edge.to_host().unwrap().len(), limit);
        let big = meta(DType::F32, limit + 1);
        for (op, e) in [
            ("to_vec_f32", big.to_vec_f32().unwrap_err()),
            ("to_host", big.to_host().unwrap_err()),
            ("to_host", big.view().to_host().unwrap_err()),
            (
                "into_host",
                big.try_clone().unwrap().into_host().unwrap_err(),
            ),
        ] {
            assert!(e.to_string().contains(op), "{op}: {e}");
        }
        let mut dst = vec![0.0f32; limit + 1];
        let e = big.read_f32(0, &mut dst).unwrap_err();
        assert!(e.to_string().contains("read_f32"), "{e}");
        let e = crate::tensor::staging::read_host(big.view(), |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("stage"), "{e}");
    }
}
