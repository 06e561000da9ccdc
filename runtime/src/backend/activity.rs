//! What a device did and holds, measured in its driver layer and allocator (not estimated),
//! so the emulator reports exactly what a GPU would be asked to do.

/// Counts of device operations, taken in the driver layer so the emulator counts exactly what
/// a GPU would be asked to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceActivity {
    /// Times the host waited for the device: stream and event synchronizations, synchronous
    /// copies, frees.
    pub host_syncs: u64,
    /// Kernels launched, cuBLASLt matmuls included.
    pub kernel_launches: u64,
    /// cuBLASLt matmuls.
    pub gemms: u64,
    /// Memsets.
    pub memsets: u64,
    /// Copies of any direction.
    pub copies: u64,
    /// Bytes those copies moved.
    pub copy_bytes: u64,
    /// Products whose fused cuBLASLt epilogue the library refused (no algorithm), so they ran
    /// as a plain product and separate kernels: non-zero means a slower step, not a wrong one.
    pub gemm_fallbacks: u64,
}

impl std::ops::Add for DeviceActivity {
    type Output = DeviceActivity;

    /// The activity of two spans together (sums over steps).
    fn add(self, o: DeviceActivity) -> DeviceActivity {
        DeviceActivity {
            host_syncs: self.host_syncs + o.host_syncs,
            kernel_launches: self.kernel_launches + o.kernel_launches,
            gemms: self.gemms + o.gemms,
            memsets: self.memsets + o.memsets,
            copies: self.copies + o.copies,
            copy_bytes: self.copy_bytes + o.copy_bytes,
            gemm_fallbacks: self.gemm_fallbacks + o.gemm_fallbacks,
        }
    }
}

impl std::ops::Sub for DeviceActivity {
    type Output = DeviceActivity;

    /// The activity between two readings (`later - earlier`).
    fn sub(self, earlier: DeviceActivity) -> DeviceActivity {
        DeviceActivity {
            host_syncs: self.host_syncs - earlier.host_syncs,
            kernel_launches: self.kernel_launches - earlier.kernel_launches,
            gemms: self.gemms - earlier.gemms,
            memsets: self.memsets - earlier.memsets,
            copies: self.copies - earlier.copies,
            copy_bytes: self.copy_bytes - earlier.copy_bytes,
            gemm_fallbacks: self.gemm_fallbacks - earlier.gemm_fallbacks,
        }
    }
}

/// What a device's allocator holds, measured rather than estimated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    /// Bytes handed out to live buffers.
    pub live: u64,
    /// The most `live` has been.
    pub peak: u64,
    /// Bytes held from the driver (live buffers plus the allocator's cache).
    pub reserved: u64,
    /// The cap on `live`, if one is set.
    pub limit: Option<u64>,
}
