//! The element types NCCL reduces, and the reductions.

use cudarc::driver::DeviceRepr;
use cudarc::nccl::sys;

/// An element type NCCL reduces: plain bits, so buffers of it can be allocated uninitialised.
pub trait NcclType: DeviceRepr + mempool::AnyBitPattern {
    /// NCCL's name for it.
    const TYPE: sys::ncclDataType_t;
}

macro_rules! nccl_type {
    ($($t:ty => $n:ident),* $(,)?) => {$(
        impl NcclType for $t {
            const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::$n;
        }
    )*};
}

nccl_type!(i8 => ncclInt8, u8 => ncclUint8, i32 => ncclInt32, u32 => ncclUint32, i64 => ncclInt64,
    u64 => ncclUint64, f32 => ncclFloat32, f64 => ncclFloat64);

/// bfloat16 as its bits (the upper half of an `f32`), so no half-precision crate is needed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds an `f32` to the nearest bfloat16 (ties to even).
    pub fn from_f32(x: f32) -> Bf16 {
        let b = x.to_bits();
        let round = 0x7fff + ((b >> 16) & 1);
        Bf16((b.wrapping_add(round) >> 16) as u16)
    }

    /// The `f32` with the same value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

// SAFETY: `Bf16` is `repr(transparent)` over `u16`: plain bits, valid for any value, with the
// layout NCCL's ncclBfloat16 expects.
unsafe impl DeviceRepr for Bf16 {}

// SAFETY: `repr(transparent)` over `u16`: every bit pattern is a bfloat16 (NaNs included).
unsafe impl mempool::AnyBitPattern for Bf16 {}

// SAFETY: all zero bits is +0.0.
unsafe impl cudarc::driver::ValidAsZeroBits for Bf16 {}

impl NcclType for Bf16 {
    const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
}

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average.
    Avg,
}

impl ReduceOp {
    pub(crate) fn raw(self) -> sys::ncclRedOp_t {
        match self {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Bf16;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).to_f32(), 1.0);
        assert_eq!(Bf16::from_f32(-3.5).to_f32(), -3.5);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 4.0 / 256.0);
    }
}
