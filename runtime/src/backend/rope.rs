//! Rotary embedding frequencies: the base θ and Hugging Face's frequency scalings.
//!
//! Every backend builds its cos/sin table from [`Rope::angles`], one function in f64 rounded
//! to f32 once, so the CPU and every device rotate by the same bits whatever the scaling.

/// How the rotary frequencies are rescaled (Hugging Face's `rope_scaling` /
/// `rope_parameters`, the types whose attention scaling is 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `rope_type = "default"`: `θ^(-2i/d)` unchanged.
    None,
    /// `rope_type = "linear"`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// Divisor of every frequency.
        factor: f32,
    },
    /// `rope_type = "llama3"`: low frequencies divided by `factor`, high ones kept, the band
    /// between interpolated smoothly (Llama 3.1/3.2).
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// The context length the model was pretrained with.
        original_max_position_embeddings: usize,
    },
}

/// A rotary embedding's frequencies: base `theta` and a scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The base (`rope_theta`).
    pub theta: f32,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

impl Rope {
    /// Unscaled frequencies with base `theta`.
    pub fn plain(theta: f32) -> Self {
        Self {
            theta,
            scaling: RopeScaling::None,
        }
    }

    /// The `head_dim / 2` inverse frequencies, in f64, as Hugging Face's
    /// `ROPE_INIT_FUNCTIONS` define them.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f64> {
        let base = self.theta as f64;
        let plain = (0..head_dim / 2).map(move |i| base.powf(-((2 * i) as f64) / head_dim as f64));
        match self.scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / factor as f64).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, lo, hi) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                );
                let old = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                plain
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// The `[seq][head_dim / 2]` (cos, sin) table for `+θ`: angles in f64, each rounded to
    /// f32 once. The one table every backend rotates by.
    pub fn angles(&self, seq: usize, head_dim: usize) -> Vec<(f32, f32)> {
        let inv = self.inv_freq(head_dim);
        (0..seq)
            .flat_map(|pos| {
                inv.iter().map(move |f| {
                    let a = pos as f64 * f;
                    (a.cos() as f32, a.sin() as f32)
                })
            })
            .collect()
    }

    /// The parameters as bits, for caching a device's uploaded table by them.
    pub fn key(&self) -> [u32; 6] {
        let b = f32::to_bits;
        match self.scaling {
            RopeScaling::None => [b(self.theta), 0, 0, 0, 0, 0],
            RopeScaling::Linear { factor } => [b(self.theta), 1, b(factor), 0, 0, 0],
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => [
                b(self.theta),
                2,
                b(factor),
                b(low_freq_factor),
                b(high_freq_factor),
                old as u32,
            ],
        }
    }

    /// Checks the values are usable: a positive finite base and factors, `high > low`.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let pos = |v: f32| v.is_finite() && v > 0.0;
        if !pos(self.theta) {
            return Err(format!("rope_theta {} must be positive", self.theta));
        }
        match self.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } if pos(factor) => Ok(()),
            RopeScaling::Linear { factor } => Err(format!("factor {factor} must be positive")),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: lo,
                high_freq_factor: hi,
                original_max_position_embeddings: old,
            } => {
                if !(pos(factor) && pos(lo) && pos(hi) && hi > lo && old > 0) {
                    return Err(format!(
                        "llama3 scaling needs positive factor ({factor}), low_freq_factor ({lo}) \
                         < high_freq_factor ({hi}) and original_max_position_embeddings ({old})"
                    ));
                }
                Ok(())
            }
        }
    }
}
