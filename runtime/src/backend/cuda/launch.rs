//! Kernel arguments as cuLaunchKernel takes them: one pointer per parameter to a value of the
//! parameter's exact type. Values live in 8-byte slots of a buffer that outlives the launch.

use std::ffi::c_void;

use super::driver::DevPtr;

/// The arguments of one launch, in parameter order.
#[derive(Debug, Default)]
pub struct Args {
    slots: Vec<u64>,
}

impl Args {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(mut self, bits: u64) -> Self {
        self.slots.push(bits);
        self
    }

    /// A device pointer (`T*`).
    pub fn ptr(self, p: DevPtr) -> Self {
        self.push(p.0)
    }

    /// A `long long` element count.
    pub fn len(self, v: usize) -> Self {
        self.push(v as u64)
    }

    /// An `int`.
    pub fn i32(self, v: i32) -> Self {
        // The kernel reads 4 bytes from the slot's address: the low half on little-endian.
        self.push(u64::from(v as u32))
    }

    /// An `unsigned long long`.
    pub fn u64(self, v: u64) -> Self {
        self.push(v)
    }

    /// A `float`.
    pub fn f32(self, v: f32) -> Self {
        self.push(u64::from(v.to_bits()))
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
    }
}
