//! What a cuBLASLt matmul's descriptors and algorithm depend on ([`PlanKey`]), and the bounded
//! per-device cache the real driver keeps them in ([`PlanCache`]), so a training step creates
//! no layout or matmul descriptor and runs no heuristic once its shapes have been seen.
//!
//! Pure Rust: no cuBLASLt here, so the key and the cache are tested without a GPU; the real
//! driver (`cublaslt.rs`) stores its descriptors and algorithm as the cached value. The
//! emulator has nothing to cache.

use std::collections::HashMap;

use super::{Batch, Epilogue, Gemm, Op};
use crate::backend::cuda::driver::DevPtr;
use crate::tensor::DType;
use crate::Result;

/// Plans one device keeps before it drops the least recently used: far more than the distinct
/// products of a model (a GPT-2 or Llama step has a few dozen).
pub(crate) const PLAN_CAPACITY: usize = 1024;

/// Everything that defines a matmul's layouts, its descriptor and the heuristic's choice:
/// transposes, shape, every leading dimension, the three dtypes, batch count and strides, the
/// epilogue and its auxiliary leading dimension, the operands' alignments (the heuristic may
/// pick kernels that need more) and the workspace it may use. Not the addresses themselves
/// nor alpha and beta, which are set per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    ops: (Op, Op),
    mnk: (u64, u64, u64),
    lds: (u64, u64, u64),
    types: (DType, DType, DType),
    batch: Option<Batch>,
    epilogue: &'static str,
    aux_ld: u64,
    /// A, B, C (and D, which is C), the bias, the auxiliary buffer (0: none).
    align: [u32; 5],
    workspace: u64,
}

/// The largest power of two (up to 256) dividing an address: what cuBLASLt's heuristic may
/// assume about it (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, whose default, 256, would let
/// it pick kernels that fail on a less aligned view).
pub(crate) fn alignment(p: u64) -> u32 {
    1 << p.trailing_zeros().min(8)
}

/// The epilogue's bias (or bias-gradient) pointer and its auxiliary buffer with its leading
/// dimension: the per-call addresses a cached descriptor is pointed at.
pub(crate) fn epilogue_operands(e: &Epilogue) -> (Option<DevPtr>, Option<(DevPtr, u64)>) {
    match *e {
        Epilogue::None => (None, None),
        Epilogue::Bias { bias } => (Some(bias), None),
        Epilogue::GeluAuxBias { bias, aux, aux_ld } => (Some(bias), Some((aux, aux_ld))),
        Epilogue::BiasGradA { bias_grad } | Epilogue::BiasGradB { bias_grad } => {
            (Some(bias_grad), None)
        }
        Epilogue::DGeluBiasGrad {
            aux,
            aux_ld,
            bias_grad,
        } => (Some(bias_grad), Some((aux, aux_ld))),
    }
}

impl PlanKey {
    /// The key of `g` run with a workspace of `workspace` bytes.
    pub(crate) fn of(g: &Gemm, workspace: u64) -> Self {
        let (bias, aux) = epilogue_operands(&g.epilogue);
        PlanKey {
            ops: (g.transa, g.transb),
            mnk: (g.m, g.n, g.k),
            lds: (g.lda, g.ldb, g.ldc),
            types: (g.a_type, g.b_type, g.c_type),
            batch: g.batch,
            epilogue: g.epilogue.cublas_name(),
            aux_ld: aux.map_or(0, |(_, ld)| ld),
            align: [
                alignment(g.a.0),
                alignment(g.b.0),
                // D (when written out of place) shares C's layout; the heuristic may assume
                // only the lower of their alignments.
                alignment(g.c.0).min(alignment(g.d.unwrap_or(g.c).0)),
                bias.map_or(0, |p| alignment(p.0)),
                aux.map_or(0, |(p, _)| alignment(p.0)),
            ],
            workspace,
        }
    }

    /// The minimum alignments of A, B and C (C's the lower of C's and D's) the heuristic may
    /// assume.
    pub(crate) fn operand_alignments(&self) -> [u32; 3] {
        [self.align[0], self.align[1], self.align[2]]
    }
}

/// Values by [`PlanKey`], at most `capacity` of them; the least recently used goes first (its
/// value is dropped, which for the real driver destroys its descriptors).
#[derive(Debug)]
pub(crate) struct PlanCache<V> {
    plans: HashMap<PlanKey, (V, u64)>,
    capacity: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

impl<V> PlanCache<V> {
    /// An empty cache of at most `capacity` plans (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        PlanCache {
            plans: HashMap::new(),
            capacity: capacity.max(1),
            clock: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// The plan for `key`, made by `make` on a miss (an error leaves the cache unchanged).
    pub(crate) fn get_or_make(
        &mut self,
        key: PlanKey,
        make: impl FnOnce(&PlanKey) -> Result<V>,
    ) -> Result<&mut V> {
        self.clock += 1;
        let now = self.clock;
        if self.plans.contains_key(&key) {
            self.hits += 1;
        } else {
            let v = make(&key)?;
            self.misses += 1;
            if self.plans.len() >= self.capacity {
                self.evict();
            }
            self.plans.insert(key, (v, now));
        }
        let slot = self.plans.get_mut(&key).expect("present or just inserted");
        slot.1 = now;
        Ok(&mut slot.0)
    }

    fn evict(&mut self) {
        let oldest = self
            .plans
            .iter()
            .min_by_key(|(_, (_, t))| *t)
            .map(|(k, _)| *k);
        if let Some(k) = oldest {
            self.plans.remove(&k);
        }
    }

    /// Plans held.
    pub(crate) fn len(&self) -> usize {
        self.plans.len()
    }

    /// Lookups answered from the cache, and plans made.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A linear layer's product as the backend issues it: Y[4, 8] = X[4, 16] · W[8, 16]^T.
    fn gemm() -> Gemm {
        Gemm {
            transa: Op::T,
            transb: Op::N,
            m: 8,
            n: 4,
            k: 16,
            a: DevPtr(0x10000),
            lda: 16,
            a_type: DType::Bf16,
            b: DevPtr(0x20000),
            ldb: 16,
            b_type: DType::Bf16,
            c: DevPtr(0x30000),
            ldc: 8,
            c_type: DType::Bf16,
            d: None,
            alpha: 1.0,
            beta: 0.0,
            batch: None,
            epilogue: Epilogue::Bias {
                bias: DevPtr(0x40000),
            },
        }
    }

    const WS: u64 = 32 << 20;

    #[test]
    fn addresses_and_scalars_are_not_in_the_key_but_their_alignments_are() {
        let g = gemm();
        let k = PlanKey::of(&g, WS);
        let moved = Gemm {
            a: DevPtr(0x50000),
            c: DevPtr(0x70000),
            alpha: 0.5,
            beta: 1.0,
            epilogue: Epilogue::Bias {
                bias: DevPtr(0x80000),
            },
            ..g
        };
        assert_eq!(PlanKey::of(&moved, WS), k);
        let out_of_place = Gemm {
            d: Some(DevPtr(0x90000)),
            ..g
        };
        assert_eq!(PlanKey::of(&out_of_place, WS), k);
        for misaligned in [
            Gemm {
                d: Some(DevPtr(0x90002)),
                ..g
            },
            Gemm {
                a: DevPtr(0x10002),
                ..g
            },
            Gemm {
                b: DevPtr(0x20010),
                ..g
            },
            Gemm {
                c: DevPtr(0x30080),
                ..g
            },
            Gemm {
                epilogue: Epilogue::Bias {
                    bias: DevPtr(0x40004),
                },
                ..g
            },
        ] {
            assert_ne!(PlanKey::of(&misaligned, WS), k, "{misaligned:?}");
        }
        assert_eq!(PlanKey::of(&g, WS).operand_alignments(), [256, 256, 256]);
        assert_eq!(alignment(0x30080), 128);
    }

    #[test]
    fn every_dimension_dtype_epilogue_and_the_workspace_are_in_the_key() {
        let g = gemm();
        let k = PlanKey::of(&g, WS);
        let batch = Batch {
            count: 2,
            stride_a: 128,
            stride_b: 64,
            stride_c: 32,
        };
        let variants = [
            Gemm { transa: Op::N, ..g },
            Gemm { transb: Op::T, ..g },
            Gemm { m: 9, ..g },
            Gemm { n: 5, ..g },
            Gemm { k: 17, ..g },
            Gemm { lda: 24, ..g },
            Gemm { ldb: 24, ..g },
            Gemm { ldc: 16, ..g },
            Gemm {
                a_type: DType::F32,
                ..g
            },
            Gemm {
                b_type: DType::F32,
                ..g
            },
            Gemm {
                c_type: DType::F32,
                ..g
            },
            Gemm {
                batch: Some(batch),
                ..g
            },
            Gemm {
                epilogue: Epilogue::None,
                ..g
            },
            Gemm {
                epilogue: Epilogue::BiasGradB {
                    bias_grad: DevPtr(0x40000),
                },
                ..g
            },
            Gemm {
                epilogue: Epilogue::GeluAuxBias {
                    bias: DevPtr(0x40000),
                    aux: DevPtr(0x50000),
                    aux_ld: 8,
                },
                ..g
            },
        ];
        let mut keys = vec![k];
        for v in &variants {
            let vk = PlanKey::of(v, WS);
            assert!(
                !keys.contains(&vk),
                "{v:?} shares a key with an earlier variant"
            );
            keys.push(vk);
        }
        let strided = |stride_c| Gemm {
            batch: Some(Batch { stride_c, ..batch }),
            ..g
        };
        assert_ne!(PlanKey::of(&strided(32), WS), PlanKey::of(&strided(48), WS));
        let gelu = |aux_ld| Gemm {
            epilogue: Epilogue::GeluAuxBias {
                bias: DevPtr(0x40000),
                aux: DevPtr(0x50000),
                aux_ld,
            },
            ..g
        };
        assert_ne!(PlanKey::of(&gelu(8), WS), PlanKey::of(&gelu(16), WS));
        assert_ne!(PlanKey::of(&g, WS), PlanKey::of(&g, WS / 2));
    }

    #[test]
    fn the_cache_makes_each_plan_once_and_drops_the_least_recently_used() {
        let g = gemm();
        let key = |m| PlanKey::of(&Gemm { m, ..g }, WS);
        let mut c = PlanCache::new(2);
        let mut made = Vec::new();
        let mut get = |c: &mut PlanCache<u64>, m: u64| {
            *c.get_or_make(key(m), |_| {
                made.push(m);
                Ok(m * 10)
            })
            .unwrap()
        };
        assert_eq!(get(&mut c, 1), 10);
        assert_eq!(get(&mut c, 2), 20);
        assert_eq!(get(&mut c, 1), 10);
        // Full: 2 is the least recently used.
        assert_eq!(get(&mut c, 3), 30);
        assert_eq!(c.len(), 2);
        assert_eq!(get(&mut c, 1), 10);
        assert_eq!(get(&mut c, 2), 20);
        assert_eq!(made, vec![1, 2, 3, 2]);
        assert_eq!(c.counts(), (2, 4));
    }

    #[test]
    fn a_failed_make_caches_nothing() {
        let g = gemm();
        let mut c: PlanCache<u32> = PlanCache::new(4);
        let k = PlanKey::of(&g, WS);
        let err = c
            .get_or_make(k, |_| {
                Err(crate::Error::Invalid("heuristic found nothing".into()))
            })
            .unwrap_err();
        assert!(err.to_string().contains("heuristic found nothing"), "{err}");
        assert_eq!((c.len(), c.counts()), (0, (0, 0)));
        assert_eq!(*c.get_or_make(k, |_| Ok(7)).unwrap(), 7);
        assert_eq!(c.counts(), (0, 1));
    }
}
