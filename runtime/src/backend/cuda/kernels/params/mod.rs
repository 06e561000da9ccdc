//! Each kernel's parameter list, declared once: names, C types and order, as the `extern "C"
//! __global__` signature in its `.cu` file has them. A unit test parses every signature and
//! compares it with [`TABLE`]; every launch ([`check_launch`]) compares its arguments with it;
//! the emulator tests do the same. So a parameter changed, moved or added on either side fails
//! a test naming the kernel and the parameter, instead of a kernel reading garbage.

#[cfg(test)]
pub(crate) mod parse;
mod table;
#[cfg(test)]
mod tests;

pub use table::TABLE;

/// What a pointer parameter points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// The variant's element type: `float`, `bf16_t` or `f16_t` for the `_f32`, `_bf16` and
    /// `_f16` kernels of a [`Family::per_dtype`] family.
    T,
    /// `float`.
    F32,
    /// `double`.
    F64,
    /// `int`.
    I32,
    /// `bf16_t`.
    Bf16,
    /// `f16_t`.
    F16,
    /// `OptTensor`, the optimizer kernels' descriptor ([`OptTensor`]).
    OptTensor,
    /// `unsigned char`: raw bytes (the quantizer's packed codes and scales).
    U8,
}

/// The C type of one kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CType {
    /// `const E*`: read only.
    In(Elem),
    /// `E*`: written (or read and written).
    Out(Elem),
    /// `int`.
    Int,
    /// `long long`.
    LongLong,
    /// `unsigned long long`.
    ULongLong,
    /// `float`.
    Float,
}

/// One declared parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    /// The parameter's name in the `.cu` signature.
    pub name: &'static str,
    /// Its C type.
    pub ty: CType,
}

/// The parameter list shared by one kernel or by its dtype variants.
#[derive(Debug)]
pub struct Family {
    /// The kernel's name, or the variants' common prefix (`gelu_forward`).
    pub name: &'static str,
    /// Whether the kernels are `<name>_f32`, `<name>_bf16` and `<name>_f16`, with [`Elem::T`]
    /// standing for the suffix's type; otherwise the one kernel is `<name>` itself.
    pub per_dtype: bool,
    /// The parameters, in order.
    pub params: &'static [Param],
}

/// How an argument travels in a launch's parameter buffer (what [`super::super::launch::Args`]
/// records per argument): pointers do not carry their element type there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A device address.
    Ptr,
    /// `int`.
    Int,
    /// `long long`.
    LongLong,
    /// `unsigned long long`.
    ULongLong,
    /// `float`.
    Float,
}

/// `optim.cu`'s `OptTensor` descriptor: one tensor of a multi-tensor optimizer launch (64 bytes,
/// the layout the kernels read; the optimizer launcher and the emulator tests both build it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct OptTensor {
    /// fp32 master parameters (bf16 parameters for the `*_bf16_state` kernels, whose
    /// moments are bf16 too).
    pub params: u64,
    /// Gradients, in the dtype `grad_dtype` names.
    pub grads: u64,
    /// First moment (momentum); 0 where the rule keeps none.
    pub m: u64,
    /// Second moment; 0 where the rule keeps none.
    pub v: u64,
    /// Low-precision parameter copy written after the update; 0 for none.
    pub lp: u64,
    /// Elements.
    pub n: i64,
    /// Index of this tensor's first chunk among all chunks of the launch.
    pub first_chunk: i64,
    /// How the gradients are read: 0 f32, 1 bf16, 2 f16 as stored; 3, 4, 5 f32 read as an
    /// f32, bf16, f16 accumulator holds them; 6, 7 bf16, f16 likewise
    /// ([`OptTensor::grad_read_of`]).
    pub grad_dtype: i64,
}

impl OptTensor {
    /// The `grad_dtype` code of gradients stored as `stored`, read as an accumulator of
    /// `round` (`crate::backend::GradView`); `None` for a pair no kernel reads (half-precision
    /// values standing for another dtype).
    pub fn grad_read_of(
        stored: crate::tensor::DType,
        round: Option<crate::tensor::DType>,
    ) -> Option<i64> {
        use crate::tensor::DType::{Bf16, F16, F32};
        Some(match (stored, round) {
            (d, None) => Self::grad_dtype_of(d),
            (F32, Some(F32)) => 3,
            (F32, Some(Bf16)) => 4,
            (F32, Some(F16)) => 5,
            (Bf16, Some(Bf16)) => 6,
            (F16, Some(F16)) => 7,
            _ => return None,
        })
    }

    /// The `grad_dtype` code of a gradient dtype.
    pub fn grad_dtype_of(d: crate::tensor::DType) -> i64 {
        match d {
            crate::tensor::DType::F32 => 0,
            crate::tensor::DType::Bf16 => 1,
            crate::tensor::DType::F16 => 2,
        }
    }
}

const fn p(name: &'static str, ty: CType) -> Param {
    Param { name, ty }
}

const fn per_dtype(name: &'static str, params: &'static [Param]) -> Family {
    Family {
        name,
        per_dtype: true,
        params,
    }
}

const fn single(name: &'static str, params: &'static [Param]) -> Family {
    Family {
        name,
        per_dtype: false,
        params,
    }
}

/// The element type's C name for each dtype suffix.
const SUFFIXES: [(&str, &str); 3] = [("_f32", "float"), ("_bf16", "bf16_t"), ("_f16", "f16_t")];

/// The declared parameters of `kernel`, and the C type [`Elem::T`] stands for in it (`None`
/// for a kernel that is not a dtype variant); `None` for a kernel nobody declared.
pub fn params_of(kernel: &str) -> Option<(&'static [Param], Option<&'static str>)> {
    TABLE.iter().find_map(|f| {
        if !f.per_dtype {
            return (f.name == kernel).then_some((f.params, None));
        }
        let rest = kernel.strip_prefix(f.name)?;
        SUFFIXES
            .iter()
            .find(|(s, _)| *s == rest)
            .map(|(_, t)| (f.params, Some(*t)))
    })
}

impl CType {
    /// The C spelling, with `t` for [`Elem::T`] (`const float*`, `long long`).
    pub fn c_name(self, t: Option<&str>) -> String {
        let elem = |e: Elem| match e {
            Elem::T => t.unwrap_or("T"),
            Elem::F32 => "float",
            Elem::F64 => "double",
            Elem::I32 => "int",
            Elem::Bf16 => "bf16_t",
            Elem::F16 => "f16_t",
            Elem::OptTensor => "OptTensor",
            Elem::U8 => "unsigned char",
        };
        match self {
            CType::In(e) => format!("const {}*", elem(e)),
            CType::Out(e) => format!("{}*", elem(e)),
            CType::Int => "int".into(),
            CType::LongLong => "long long".into(),
            CType::ULongLong => "unsigned long long".into(),
            CType::Float => "float".into(),
        }
    }

    /// How an argument of this type travels.
    pub fn kind(self) -> ArgKind {
        match self {
            CType::In(_) | CType::Out(_) => ArgKind::Ptr,
            CType::Int => ArgKind::Int,
            CType::LongLong => ArgKind::LongLong,
            CType::ULongLong => ArgKind::ULongLong,
            CType::Float => ArgKind::Float,
        }
    }
}

/// Checks a launch's arguments against `kernel`'s declaration; the error names the kernel and
/// the first parameter that differs (or the count).
pub fn check_launch(kernel: &str, args: &[ArgKind]) -> std::result::Result<(), String> {
    let (params, t) = params_of(kernel)
        .ok_or_else(|| format!("kernel {kernel} has no declared parameter list"))?;
    for (i, (param, arg)) in params.iter().zip(args).enumerate() {
        if param.ty.kind() != *arg {
            return Err(format!(
                "kernel {kernel}: argument {i} for parameter `{}` ({}) is passed as {arg:?}",
                param.name,
                param.ty.c_name(t)
            ));
        }
    }
    if args.len() != params.len() {
        let missing = params.get(args.len()).map_or(String::new(), |p| {
            format!(" (the first missing is `{}`)", p.name)
        });
        return Err(format!(
            "kernel {kernel} takes {} arguments, the launch passes {}{missing}",
            params.len(),
            args.len()
        ));
    }
    Ok(())
}
