//! A host computation that reads a gradient range as f32 and writes a low-precision parameter
//! range in place: the NVMe optimizer step, whose tile driver (the offload crate's) computes
//! on host slices. The storage decides how its values reach the host: host memory lends
//! them, a device's gradient is read down; size-only storage has no values, so the
//! computation is its checks alone and is never called.

use std::ops::Range;

use ferrozero_offload::optim::LowPrecision;

use super::meta::mixed_meta;
use super::storage::check_span;
use super::{spare, FlatBuf, Storage};
use crate::{Error, Result};

const OP: &str = "host update";

impl Storage {
    /// Runs `f` on `self[grads]` read as host f32 and on `lp[params]`, the bf16 or f16
    /// parameters it writes in place (host memory). Both ranges have one length. Size-only
    /// storage (both operands) is checked and `f` is not called: there is nothing to compute.
    pub fn with_host_update(
        &self,
        grads: Range<usize>,
        (lp, params): (&mut Storage, Range<usize>),
        f: impl FnOnce(&[f32], LowPrecision<'_>) -> Result<()>,
    ) -> Result<()> {
        if grads.len() != params.len() {
            return Err(Error::Shape {
                op: OP,
                expected: format!("{} parameters, one per gradient", grads.len()),
                got: format!("{}", params.len()),
            });
        }
        check_span(OP, grads.start, grads.len(), self.len())?;
        check_span(OP, params.start, params.len(), lp.len())?;
        let out = match lp {
            Storage::Meta(_) => {
                return match self {
                    Storage::Meta(_) => Ok(()),
                    _ => Err(mixed_meta(OP)),
                }
            }
            Storage::Cuda(_) => {
                return Err(Error::Invalid(format!(
                    "{OP}: the parameters it writes must be in host memory"
                )))
            }
            Storage::Host(FlatBuf::Bf16(v)) => LowPrecision::Bf16(&mut v[params]),
            Storage::Host(FlatBuf::F16(v)) => LowPrecision::F16(&mut v[params]),
            Storage::Host(FlatBuf::F32(_)) => {
                return Err(Error::Invalid(format!(
                    "{OP}: the parameters it writes must be bf16 or f16, not f32"
                )))
            }
        };
        if let Storage::Meta(_) = self {
            return Err(mixed_meta(OP));
        }
        let mut buf = spare::take_f32(grads.len());
        let r = self
            .read_f32(grads.start, &mut buf)
            .and_then(|()| f(&buf, out));
        spare::give_f32(buf);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::meta::MetaBuf;
    use crate::tensor::DType;
    use half::bf16;

    #[test]
    fn host_storage_lends_its_values_and_keeps_what_f_writes() {
        let g = Storage::from_f32(vec![1.0, 2.0, 3.0, 4.0]);
        let mut lp = Storage::Host(FlatBuf::zeros(DType::Bf16, 5));
        g.with_host_update(1..3, (&mut lp, 2..4), |gr, out| {
            assert_eq!(gr, &[2.0, 3.0]);
            let LowPrecision::Bf16(b) = out else {
                panic!("bf16 parameters")
            };
            b.copy_from_slice(&[bf16::from_f32(gr[0]), bf16::from_f32(gr[1])]);
            Ok(())
        })
        .unwrap();
        assert_eq!(lp.to_vec_f32().unwrap(), vec![0.0, 0.0, 2.0, 3.0, 0.0]);
    }

    #[test]
    fn size_only_storage_is_checked_and_never_computed() {
        let n = 1 << 30;
        let g = Storage::Meta(MetaBuf::new(DType::F32, n));
        let mut lp = Storage::Meta(MetaBuf::new(DType::Bf16, n));
        g.with_host_update(0..n, (&mut lp, 0..n), |_, _| panic!("called"))
            .unwrap();
        let e = g
            .with_host_update(0..n, (&mut lp, 1..n + 1), |_, _| Ok(()))
            .unwrap_err();
        assert!(e.to_string().contains("offset 1"), "{e}");
        let e = g
            .with_host_update(0..2, (&mut lp, 0..3), |_, _| Ok(()))
            .unwrap_err();
        assert!(e.to_string().contains("host update"), "{e}");
        let mut host = Storage::Host(FlatBuf::zeros(DType::Bf16, 4));
        let e = g
            .with_host_update(0..4, (&mut host, 0..4), |_, _| Ok(()))
            .unwrap_err();
        assert!(e.to_string().contains("meta"), "{e}");
        let real = Storage::from_f32(vec![0.0; 4]);
        let mut small = Storage::Meta(MetaBuf::new(DType::Bf16, 4));
        assert!(real
            .with_host_update(0..4, (&mut small, 0..4), |_, _| Ok(()))
            .is_err());
        let mut f32s = Storage::from_f32(vec![0.0; 4]);
        let e = real
            .with_host_update(0..4, (&mut f32s, 0..4), |_, _| Ok(()))
            .unwrap_err();
        assert!(e.to_string().contains("bf16 or f16"), "{e}");
    }
}
