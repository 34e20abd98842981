//! Which element types a buffer may be read as.

/// Types for which every bit pattern of the right size is a valid value: integers, floats and
/// arrays of them. A freshly allocated buffer holds whatever its memory held before (cached
/// memory is reused as it is), so [`Allocator::alloc`](crate::Allocator::alloc) hands out
/// buffers only of these types; [`alloc_zeros`](crate::Allocator::alloc_zeros) takes any type
/// that is valid as all zeros, and [`alloc_uninit`](crate::Allocator::alloc_uninit) any type at
/// all, as an `unsafe fn`.
///
/// (`bool` and `char` are not here: a `bool` buffer of reused memory may hold a 2, and reading it
/// back into a `Vec<bool>` would be undefined behaviour.)
///
/// # Safety
///
/// Implement it only for `Copy` types with no padding, no invalid bit patterns (no `bool`,
/// `char`, enums, references, `NonZero*`), whose every field is itself `AnyBitPattern`.
pub unsafe trait AnyBitPattern: Copy + Send + Sync + 'static {}

macro_rules! any_bit_pattern {
    ($($t:ty),*) => {
        // SAFETY: primitive integers and floats: every bit pattern is a valid value, no padding.
        $(unsafe impl AnyBitPattern for $t {})*
    };
}

any_bit_pattern!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);

// SAFETY: an array of `AnyBitPattern` elements has no padding between them and no invalid patterns.
unsafe impl<T: AnyBitPattern, const N: usize> AnyBitPattern for [T; N] {}

// SAFETY: a zero-sized type has exactly one value and no bits to get wrong.
unsafe impl AnyBitPattern for () {}
