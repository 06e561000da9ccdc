//! Element encodings on disk: f32, bf16 and f16, little-endian. Widening to f32 is exact, so a
//! value written in a dtype and read back is the value that dtype holds.

use half::{bf16, f16};

use crate::tensor::DType;

/// The dtype named by a safetensors header string, if it is one that loads.
pub fn parse(name: &str) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "BF16" => Some(DType::Bf16),
        "F16" => Some(DType::F16),
        _ => None,
    }
}

/// Appends `data` encoded as `dtype` (round to nearest even for bf16 and f16) to `out`.
pub fn encode_into(data: &[f32], dtype: DType, out: &mut Vec<u8>) {
    out.reserve(data.len() * dtype.size());
    match dtype {
        DType::F32 => data.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::Bf16 => data
            .iter()
            .for_each(|&v| out.extend(bf16::from_f32(v).to_le_bytes())),
        DType::F16 => data
            .iter()
            .for_each(|&v| out.extend(f16::from_f32(v).to_le_bytes())),
    }
}

/// Appends `bytes` (whole elements of `dtype`) widened to f32 to `out`.
pub fn decode_into(bytes: &[u8], dtype: DType, out: &mut Vec<f32>) {
    match dtype {
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        DType::Bf16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
    }
}
