//! Hand-written PTX kernels for the GPU tests (loaded by the driver; no compiler needed).

/// `add_one(float* x, u32 n)`: `x[i] += 1` for every `i < n` (grid-stride).
/// `spin_copy(u32* src, u32* dst, u32 n, u64 cycles)`: each thread spins for `cycles` clock
/// ticks, then copies `src` to `dst` (grid-stride): a long kernel that reads `src` late.
pub(crate) const KERNELS: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry add_one(.param .u64 p_x, .param .u32 p_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<5>;
    .reg .f32 %f<3>;
    ld.param.u64 %rd1, [p_x];
    ld.param.u32 %r1, [p_n];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    mov.u32 %r6, %nctaid.x;
    mul.lo.s32 %r7, %r6, %r3;
LOOP:
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd2, %r5, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.f32 %f1, [%rd3];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd3], %f2;
    add.s32 %r5, %r5, %r7;
    bra LOOP;
DONE:
    ret;
}

.visible .entry spin_copy(.param .u64 p_src, .param .u64 p_dst, .param .u32 p_n, .param .u64 p_cycles)
{
    .reg .pred %p<3>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<12>;
    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_dst];
    ld.param.u32 %r1, [p_n];
    ld.param.u64 %rd3, [p_cycles];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u64 %rd4, %clock64;
SPIN:
    mov.u64 %rd5, %clock64;
    sub.s64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p1, %rd6, %rd3;
    @%p1 bra SPIN;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    mov.u32 %r6, %nctaid.x;
    mul.lo.s32 %r7, %r6, %r3;
CLOOP:
    setp.ge.u32 %p2, %r5, %r1;
    @%p2 bra CDONE;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd1, %rd7;
    add.s64 %rd9, %rd2, %rd7;
    ld.global.u32 %r8, [%rd8];
    st.global.u32 [%rd9], %r8;
    add.s32 %r5, %r5, %r7;
    bra CLOOP;
CDONE:
    ret;
}
"#;
