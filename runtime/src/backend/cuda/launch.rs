//! Kernel arguments as cuLaunchKernel takes them: one pointer per parameter to a value of the
//! parameter's exact type. Values live in 8-byte slots of a buffer that outlives the launch;
//! each slot's kind is kept so the launch can be checked against the kernel's declared
//! parameters ([`super::kernels::params`]).

use std::ffi::c_void;

use super::driver::DevPtr;
use super::kernels::params::ArgKind;

/// The arguments of one launch, in parameter order.
#[derive(Debug, Default)]
pub struct Args {
    slots: Vec<u64>,
    kinds: Vec<ArgKind>,
}

impl Args {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(mut self, kind: ArgKind, bits: u64) -> Self {
        self.slots.push(bits);
        self.kinds.push(kind);
        self
    }

    /// Each argument's kind, in order.
    pub fn kinds(&self) -> &[ArgKind] {
        &self.kinds
    }

    /// A device pointer (`T*`).
    pub fn ptr(self, p: DevPtr) -> Self {
        self.push(ArgKind::Ptr, p.0)
    }

    /// A `long long` element count.
    pub fn len(self, v: usize) -> Self {
        self.push(ArgKind::LongLong, v as u64)
    }

    /// An `int`.
    pub fn i32(self, v: i32) -> Self {
        // The kernel reads 4 bytes from the slot's address: the low half on little-endian.
        self.push(ArgKind::Int, u64::from(v as u32))
    }

    /// An `unsigned long long`.
    pub fn u64(self, v: u64) -> Self {
        self.push(ArgKind::ULongLong, v)
    }

    /// A `float`.
    pub fn f32(self, v: f32) -> Self {
        self.push(ArgKind::Float, u64::from(v.to_bits()))
    }

    /// One pointer per argument, into this buffer (valid while it is neither moved nor dropped).
    pub fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_sit_at_the_start_of_their_slots() {
        let mut a = Args::new().i32(-2).f32(1.5).ptr(DevPtr(0x1000)).len(7);
        let p = a.pointers();
        // SAFETY: each pointer addresses an 8-byte slot; reading its first bytes as the
        // argument's type is what the driver does.
        unsafe {
            assert_eq!(*(p[0] as *const i32), -2);
            assert_eq!(*(p[1] as *const f32), 1.5);
            assert_eq!(*(p[2] as *const u64), 0x1000);
            assert_eq!(*(p[3] as *const i64), 7);
        }
        use ArgKind::*;
        assert_eq!(a.kinds(), [Int, Float, Ptr, LongLong]);
    }
}
