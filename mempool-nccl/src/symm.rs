//! Symmetric memory (PyTorch's `SymmetricMemory`): one allocation per rank of a communicator,
//! each mapped into every rank's address space, so that kernels and copy engines move data peer
//! to peer and ranks synchronise through signal pads, with no collective library in the way.
//!
//! ```no_run
//! use mempool_nccl::{symm::symm_empty, Communicator};
//! let comms = Communicator::all_local(&[0, 1])?;
//! std::thread::scope(|s| {
//!     for comm in &comms {
//!         s.spawn(move || -> mempool_nccl::Result<()> {
//!             let stream = comm.context().new_stream().map_err(mempool_nccl::Error::cuda)?;
//!             let symm = symm_empty::<f32>(comm, 1 << 20, &stream)?; // collective
//!             let peer = (comm.rank() + 1) % comm.world_size();
//!             symm.put_signal(peer, 0, &stream)?;                     // "my data is ready"
//!             symm.wait_signal(peer, 0, &stream)?;                    // "so is theirs"
//!             let _theirs = symm.peer(peer, &stream)?;                // a cudarc slice of their memory
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok::<(), mempool_nccl::Error>(())
//! ```
//!
//! **Allocation and rendezvous.** [`symm_empty`] is collective: every rank makes one physical
//! allocation on its device (`cuMemCreate`: the data, then a signal pad of
//! `2 world_size × (CHANNELS + 192) + 64` 32-bit words: the channels' and the kernels' signals, counted as sent, then as
//! taken, and the pushing one-shot's count of calls per block;
//! then, for data of at most [`PUSH_MAX`] bytes, the one-shot's receive slots: `2 world_size`
//! times the data's size),
//! the ranks exchange (process, size, handle, device) and check that every rank asked for the
//! same size before anyone maps anything (all fail together, with the sizes in the error); then
//! each rank maps every rank's allocation into its own address range, readable and writable by
//! its own device (`cuMemMap`, `cuMemSetAccess`), zeroes its own pad (and empties its receive
//! slots), and a second exchange
//! tells everyone that every rank is mapped, after which each rank lets go of its handle (the
//! mappings keep the memory). How the ranks exchange depends on the communicator:
//! - made by [`Communicator::all_local`] (every rank a thread of this process): through the
//!   communicator's all-gather, handles shared as they are;
//! - made with an id ([`Communicator::new`], [`Communicator::from_env`]), ranks in any processes
//!   of this machine: allocations exportable as POSIX file descriptors; each rank listens on an
//!   abstract Unix socket named by the id, the count of symmetric allocations on the
//!   communicator and its rank, connects to every other rank's, and sends its figures with its
//!   descriptor attached (`SCM_RIGHTS`); peers import it (`cuMemImportFromShareableHandle`).
//!   Every wait ends at [`SymmOptions::timeout`] with an error naming the ranks not heard from;
//!   a rank that leaves (its process exits) is named at once. Nothing stays allocated, mapped
//!   or open after an error.
//!
//! **Lifetime.** Each rank's [`SymmMemory`] owns its mappings only: dropping it waits for its
//! device's work and unmaps them; another rank's memory stays alive as long as any rank maps it,
//! so ranks may drop in any order.
//!
//! **Synchronisation.** Signals are counted in the pads: [`put_signal`](SymmMemory::put_signal)
//! adds one to the destination's count for (this rank, channel), ordered after the stream's
//! earlier work; [`wait_signal`](SymmMemory::wait_signal) makes the stream wait until the
//! source has sent a signal this rank has not taken, and takes it (this rank keeps the count of
//! those it took), so no signal is lost or merged however many come first, and every count is
//! balanced again after every protocol; [`barrier`](SymmMemory::barrier) signals every peer and
//! waits for every peer. Each is one small kernel launch on the stream. A peer that never
//! signals leaves the stream waiting; [`barrier_timeout`](SymmMemory::barrier_timeout) and
//! [`wait_signal_timeout`](SymmMemory::wait_signal_timeout) end the wait and name the ranks.
//!
//! **NCCL on the same memory.** [`register_window`](SymmMemory::register_window) registers each
//! rank's allocation as an NCCL window (`ncclCommWindowRegister`, symmetric), so NCCL's
//! collectives and this allocation's kernels work on one buffer; allocations are made
//! exportable as POSIX descriptors where the device allows, which NCCL needs to share them.
//!
//! **Multicast stays off**: nothing here creates a multicast object.

use std::io::ErrorKind;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::comm::Communicator;
use crate::error::{Error, Result};

/// Signal words per peer in each pad (the channels of `put_signal` / `wait_signal`).
pub const CHANNELS: usize = 16;

/// Signal words per rank in each pad for the kernels' own barriers (three sets of one word per
/// block: the one-shot uses the first two, the two-shot all three), after the `CHANNELS` words.
const KERNEL_SLOTS: usize = 3 * KERNEL_BLOCKS;
/// The kernels' most blocks (each block signals and waits for the same block of every peer).
const KERNEL_BLOCKS: usize = 64;

/// Data of at most this many bytes gets receive slots, and its one-shot pushes instead of
/// reading the peers (`one_shot_push_f32`): no barrier, about 1 µs less per call on 2x H100
/// (the probe `mempool-bench/harness/symm_probe.cu`: 3.0 against 4.2 µs at 4 KiB, 3.9 against
/// 5.0 at 256 KiB, GPU time alone; at 1 MiB reading is the faster, 7.1 against 7.4).
pub const PUSH_MAX: usize = 256 << 10;

/// The mark of an empty receive word: every byte this (so every bit set, a NaN of `f32` that
/// the push kernel never sends: it sends the canonical NaN `0x7fc00000` in its place).
const EMPTY_BYTE: u8 = 0xff;

/// Bytes of the receive slots for `data_bytes` of data among `world` ranks: two sets (calls
/// alternate) of one slot per rank, or none above [`PUSH_MAX`].
fn receive_bytes(data_bytes: usize, world: usize) -> usize {
    if data_bytes > PUSH_MAX {
        return 0;
    }
    data_bytes.saturating_mul(2).saturating_mul(world)
}

/// Bytes of the signal pad of `world` ranks: the signal words, then the push kernel's count of
/// calls per block (`KERNEL_BLOCKS` words).
fn pad_bytes(world: usize) -> usize {
    calls_offset(world) + KERNEL_BLOCKS * 4
}

/// Where in the pad the push kernel's counts of calls per block start (bytes).
fn calls_offset(world: usize) -> usize {
    world * (2 * (CHANNELS + KERNEL_SLOTS)) * 4
}

/// The kernels' barriers count their signals, as `signal_sync` does: thread `t` of block `b`
/// adds 1 (a system-scope reduction) to word `base + rank*192 + set*64 + b` of rank `t`'s pad,
/// then waits, with acquire semantics, until word `base + t*192 + set*64 + b` of its own pad
/// differs from its count of those taken (the word `world*192` after it), and counts one more.
/// Nothing is ever cleared, so no clear can race a peer's next signal.
///
/// `one_shot_sync_f32(const u64* ptrs, const u64* pads, u32 world, u32 rank, u32 base,
/// float* out, u64 n)`: a barrier inside the kernel (set 0), then `out[i]` = the sum over ranks of
/// their data (grid-stride, loads that skip L1: the first `4 * n4` elements four at a time,
/// 16-byte loads of two ranks in flight, then the rest one at a time; ranks added in order, so
/// the sums are those of the scalar loop), then a barrier on set 1, so no rank writes its data
/// again before every rank read it.
///
/// `one_shot_push_f32(const u64* ptrs, u32 world, u32 rank, u64 recv, u64 slot, float* out,
/// u64 n, u64 nv, u32 aligned)`, the one-shot of data of at most [`PUSH_MAX`] bytes, with no
/// barrier: the data is its own signal. Each rank's mapping holds, after the pad, two receive
/// sets of `world` slots of `slot` bytes (`set` bytes a set; the first at `recv`), every word
/// empty ([`EMPTY_BYTE`]) at the start; calls alternate between the sets: block `b` reads its
/// count of calls (word `b` at `calls`, in this rank's pad, zero at the start), uses set
/// `count & 1`, and when every thread of the block is done (`bar.sync`) thread 0 adds one. The
/// count lives on the device, so calls queued from several threads onto one stream, and calls
/// replayed from a CUDA graph, alternate as they run. Thread `i` (grid-stride
/// over the `nv` 16-byte vectors of the data) loads vector `i` of its own data, replaces a word
/// with every bit set by the canonical NaN (so no value sent is the empty mark; the sum is NaN
/// either way), stores it (volatile) into slot `rank` of every peer's set, then for each rank in
/// order takes that rank's vector: its own, or the one in its own slot for that rank, loaded
/// (volatile) until none of its four words is empty, then emptied again; and writes the sums
/// (16 bytes at a time where `aligned` and all four are below `n`, else one at a time).
/// Why two sets suffice: a peer writes into this rank's set of call `c` again only in its own
/// call `c + 2`, so after its call `c + 1` ended, which needed this rank's data of call `c + 1`,
/// which this rank sends only after its own call `c` ended (stream order), after it took every
/// vector of call `c` and emptied its slot. So nothing is overwritten before it is taken, and
/// nothing is emptied after the next value came. This needs each rank's calls to run one after
/// the other (one stream, or streams ordered by events), as every rank's calls of a collective
/// must. Four-byte words are written whole, so a vector seen half-written has an empty word and
/// is loaded again.
///
/// `two_shot_sync_f32(const u64* ptrs, const u64* pads, u32 world, u32 rank, u32 base, u64 v,
/// u64 cv, u64 tail)`, in place over `4v + tail` floats per rank: a barrier on set 0;
/// rank `r` sums (ranks in order) the 16-byte vectors `[r*cv, min((r+1)*cv, v))` of every
/// rank's data into its own data, and the last rank the `tail` floats after `4v` one at a
/// time; a barrier on set 1 whose signal is a release reduction (the sums written by this
/// kernel become visible to the peers that acquire it); each rank copies every other rank's
/// chunk (and the last rank's tail) into its own data; a barrier on set 2.
///
/// `signal_sync(const u64* pads, u32 world, u32 rank, u32 channel, u32 peer, u32 mode,
/// u64 timeout_ns, u32* status)`, one block; thread `t` serves peer `t` (every peer but this
/// rank with `peer == u32::MAX`, else only `peer`). Signals are counted: with `mode & 1` the
/// thread adds 1 to word `rank*16 + channel` of rank `t`'s pad (a reduction at system scope,
/// which does not wait for an answer); with `mode & 2` it waits until word `t*16 + channel` of
/// its own pad differs from its count of signals taken (word `(world + t)*16 + channel`, only
/// this rank's), then counts one more taken (a compare-and-swap: of two waits of this rank on
/// one channel, on two streams at once, one signal lets one through). So a signal is never lost or merged, however many
/// come before their waits, and a wait that gave up leaves nothing out of step. `put_signal` is
/// mode 1, `wait_signal` 2, `barrier` 3. With `timeout_ns > 0`, a wait that sees no new signal
/// for that long (`%globaltimer`) sets `status[t]` to 1 and ends.
///
/// The signals are relaxed (system scope), with no fence before them: the first says
/// "my data is ready", and that data was written by work that completed before this kernel
/// began (stream order: the copy or kernel that wrote it is done, its writes in this device's
/// memory, where peers read them); the second says "I have read your data", after a `bar.sync`
/// that every load of the block precedes with its value in hand. A release fence at system
/// scope before each signal cost about 3.5 µs per call on 2x H100 (8.0 -> 4.7 µs at 4 KiB).
const KERNELS_PTX: &str = "
.version 7.0
.target sm_70
.address_size 64

.visible .entry one_shot_sync_f32(.param .u64 p_ptrs, .param .u64 p_pads, .param .u32 p_world, .param .u32 p_rank,
    .param .u32 p_base, .param .u64 p_out, .param .u64 p_n, .param .u64 p_n4)
{
    .reg .pred %p<6>;
    .reg .b32 %r<24>;
    .reg .b64 %rd<40>;
    .reg .f32 %f<16>;
    ld.param.u64 %rd1, [p_ptrs];
    ld.param.u64 %rd2, [p_pads];
    ld.param.u32 %r1, [p_world];
    ld.param.u32 %r2, [p_rank];
    ld.param.u32 %r3, [p_base];
    ld.param.u64 %rd3, [p_out];
    ld.param.u64 %rd4, [p_n];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r8, 1;
    mov.u32 %r12, 0;
    setp.ge.u32 %p1, %r4, %r1;
    setp.eq.u32 %p2, %r4, %r2;
    or.pred %p3, %p1, %p2;
    @%p3 bra B1DONE;
    mul.wide.u32 %rd5, %r4, 8;
    add.u64 %rd6, %rd2, %rd5;
    ld.global.u64 %rd7, [%rd6];
    mad.lo.u32 %r6, %r2, 192, %r3;
    add.u32 %r7, %r6, %r5;
    mul.wide.u32 %rd8, %r7, 4;
    add.u64 %rd9, %rd7, %rd8;
    red.relaxed.sys.global.add.u32 [%rd9], %r8;
    mul.wide.u32 %rd10, %r2, 8;
    add.u64 %rd11, %rd2, %rd10;
    ld.global.u64 %rd12, [%rd11];
    mad.lo.u32 %r9, %r4, 192, %r3;
    add.u32 %r10, %r9, %r5;
    mul.wide.u32 %rd13, %r10, 4;
    add.u64 %rd14, %rd12, %rd13;
    mul.wide.u32 %rd39, %r1, 768;
    add.u64 %rd38, %rd14, %rd39;
    ld.global.u32 %r21, [%rd38];
SPIN1:
    ld.acquire.sys.global.u32 %r11, [%rd14];
    setp.eq.u32 %p4, %r11, %r21;
    @%p4 bra SPIN1;
    add.u32 %r21, %r21, 1;
    st.global.u32 [%rd38], %r21;
B1DONE:
    bar.sync 0;
    mov.u32 %r13, %ntid.x;
    mad.lo.u32 %r14, %r5, %r13, %r4;
    mov.u32 %r15, %nctaid.x;
    mul.lo.u32 %r16, %r15, %r13;
    cvt.u64.u32 %rd15, %r14;
    cvt.u64.u32 %rd16, %r16;
    mov.u64 %rd36, %rd15;
    ld.param.u64 %rd30, [p_n4];
VOUTER:
    setp.ge.u64 %p5, %rd15, %rd30;
    @%p5 bra VDONE;
    shl.b64 %rd17, %rd15, 4;
    mov.f32 %f1, 0f00000000;
    mov.f32 %f2, 0f00000000;
    mov.f32 %f3, 0f00000000;
    mov.f32 %f4, 0f00000000;
    mov.u32 %r17, 0;
VINNER:
    add.u32 %r20, %r17, 1;
    setp.ge.u32 %p1, %r20, %r1;
    @%p1 bra VSINGLE;
    mul.wide.u32 %rd18, %r17, 8;
    add.u64 %rd19, %rd1, %rd18;
    ld.global.u64 %rd20, [%rd19];
    ld.global.u64 %rd21, [%rd19+8];
    add.u64 %rd22, %rd20, %rd17;
    add.u64 %rd23, %rd21, %rd17;
    ld.global.cg.v4.f32 {%f5, %f6, %f7, %f8}, [%rd22];
    ld.global.cg.v4.f32 {%f9, %f10, %f11, %f12}, [%rd23];
    add.f32 %f1, %f1, %f5;
    add.f32 %f2, %f2, %f6;
    add.f32 %f3, %f3, %f7;
    add.f32 %f4, %f4, %f8;
    add.f32 %f1, %f1, %f9;
    add.f32 %f2, %f2, %f10;
    add.f32 %f3, %f3, %f11;
    add.f32 %f4, %f4, %f12;
    add.u32 %r17, %r17, 2;
    bra VINNER;
VSINGLE:
    setp.ge.u32 %p1, %r17, %r1;
    @%p1 bra VSTORE;
    mul.wide.u32 %rd18, %r17, 8;
    add.u64 %rd19, %rd1, %rd18;
    ld.global.u64 %rd20, [%rd19];
    add.u64 %rd22, %rd20, %rd17;
    ld.global.cg.v4.f32 {%f5, %f6, %f7, %f8}, [%rd22];
    add.f32 %f1, %f1, %f5;
    add.f32 %f2, %f2, %f6;
    add.f32 %f3, %f3, %f7;
    add.f32 %f4, %f4, %f8;
VSTORE:
    add.u64 %rd24, %rd3, %rd17;
    st.global.v4.f32 [%rd24], {%f1, %f2, %f3, %f4};
    add.u64 %rd15, %rd15, %rd16;
    bra VOUTER;
VDONE:
    shl.b64 %rd37, %rd30, 2;
    add.u64 %rd15, %rd36, %rd37;
OUTER:
    setp.ge.u64 %p5, %rd15, %rd4;
    @%p5 bra CDONE;
    shl.b64 %rd17, %rd15, 2;
    mov.f32 %f1, 0f00000000;
    mov.u32 %r17, 0;
INNER:
    setp.ge.u32 %p1, %r17, %r1;
    @%p1 bra STORE;
    mul.wide.u32 %rd18, %r17, 8;
    add.u64 %rd19, %rd1, %rd18;
    ld.global.u64 %rd20, [%rd19];
    add.u64 %rd21, %rd20, %rd17;
    ld.global.cg.f32 %f2, [%rd21];
    add.f32 %f1, %f1, %f2;
    add.u32 %r17, %r17, 1;
    bra INNER;
STORE:
    add.u64 %rd22, %rd3, %rd17;
    st.global.f32 [%rd22], %f1;
    add.u64 %rd15, %rd15, %rd16;
    bra OUTER;
CDONE:
    bar.sync 0;
    @%p3 bra B2DONE;
    add.u32 %r18, %r7, 64;
    mul.wide.u32 %rd8, %r18, 4;
    add.u64 %rd9, %rd7, %rd8;
    red.relaxed.sys.global.add.u32 [%rd9], %r8;
    add.u32 %r19, %r10, 64;
    mul.wide.u32 %rd13, %r19, 4;
    add.u64 %rd14, %rd12, %rd13;
    mul.wide.u32 %rd39, %r1, 768;
    add.u64 %rd38, %rd14, %rd39;
    ld.global.u32 %r21, [%rd38];
SPIN2:
    ld.acquire.sys.global.u32 %r11, [%rd14];
    setp.eq.u32 %p4, %r11, %r21;
    @%p4 bra SPIN2;
    add.u32 %r21, %r21, 1;
    st.global.u32 [%rd38], %r21;
B2DONE:
    ret;
}

.visible .entry two_shot_sync_f32(.param .u64 p_ptrs, .param .u64 p_pads, .param .u32 p_world, .param .u32 p_rank,
    .param .u32 p_base, .param .u64 p_v, .param .u64 p_cv, .param .u64 p_tail)
{
    .reg .pred %p<8>;
    .reg .b32 %r<24>;
    .reg .b64 %rd<40>;
    .reg .f32 %f<12>;
    ld.param.u64 %rd1, [p_ptrs];
    ld.param.u64 %rd2, [p_pads];
    ld.param.u32 %r1, [p_world];
    ld.param.u32 %r2, [p_rank];
    ld.param.u32 %r3, [p_base];
    ld.param.u64 %rd3, [p_v];
    ld.param.u64 %rd4, [p_cv];
    ld.param.u64 %rd5, [p_tail];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r8, 1;
    mov.u32 %r12, 0;
    setp.ge.u32 %p1, %r4, %r1;
    setp.eq.u32 %p2, %r4, %r2;
    or.pred %p3, %p1, %p2;
    @%p3 bra TA_DONE;
    mul.wide.u32 %rd6, %r4, 8;
    add.u64 %rd6, %rd2, %rd6;
    ld.global.u64 %rd7, [%rd6];
    mad.lo.u32 %r6, %r2, 192, %r3;
    add.u32 %r7, %r6, %r5;
    mul.wide.u32 %rd8, %r7, 4;
    add.u64 %rd9, %rd7, %rd8;
    mul.wide.u32 %rd10, %r2, 8;
    add.u64 %rd10, %rd2, %rd10;
    ld.global.u64 %rd12, [%rd10];
    mad.lo.u32 %r9, %r4, 192, %r3;
    add.u32 %r10, %r9, %r5;
    mul.wide.u32 %rd13, %r10, 4;
    add.u64 %rd14, %rd12, %rd13;
    red.relaxed.sys.global.add.u32 [%rd9], %r8;
    mul.wide.u32 %rd39, %r1, 768;
    add.u64 %rd38, %rd14, %rd39;
    ld.global.u32 %r21, [%rd38];
TA_SPIN:
    ld.acquire.sys.global.u32 %r11, [%rd14];
    setp.eq.u32 %p4, %r11, %r21;
    @%p4 bra TA_SPIN;
    add.u32 %r21, %r21, 1;
    st.global.u32 [%rd38], %r21;
TA_DONE:
    bar.sync 0;
    mov.u32 %r13, %ntid.x;
    mad.lo.u32 %r14, %r5, %r13, %r4;
    mov.u32 %r15, %nctaid.x;
    mul.lo.u32 %r16, %r15, %r13;
    cvt.u64.u32 %rd15, %r14;
    cvt.u64.u32 %rd16, %r16;
    cvt.u64.u32 %rd17, %r2;
    mul.lo.u64 %rd18, %rd17, %rd4;
    add.u64 %rd19, %rd18, %rd4;
    min.u64 %rd19, %rd19, %rd3;
    mul.wide.u32 %rd20, %r2, 8;
    add.u64 %rd20, %rd1, %rd20;
    ld.global.u64 %rd21, [%rd20];
    add.u64 %rd22, %rd18, %rd15;
P1:
    setp.ge.u64 %p5, %rd22, %rd19;
    @%p5 bra P1_DONE;
    shl.b64 %rd23, %rd22, 4;
    mov.f32 %f1, 0f00000000;
    mov.f32 %f2, 0f00000000;
    mov.f32 %f3, 0f00000000;
    mov.f32 %f4, 0f00000000;
    mov.u32 %r17, 0;
P1_RANK:
    setp.ge.u32 %p6, %r17, %r1;
    @%p6 bra P1_STORE;
    mul.wide.u32 %rd24, %r17, 8;
    add.u64 %rd24, %rd1, %rd24;
    ld.global.u64 %rd25, [%rd24];
    add.u64 %rd25, %rd25, %rd23;
    ld.global.cg.v4.f32 {%f5, %f6, %f7, %f8}, [%rd25];
    add.f32 %f1, %f1, %f5;
    add.f32 %f2, %f2, %f6;
    add.f32 %f3, %f3, %f7;
    add.f32 %f4, %f4, %f8;
    add.u32 %r17, %r17, 1;
    bra P1_RANK;
P1_STORE:
    add.u64 %rd26, %rd21, %rd23;
    st.global.v4.f32 [%rd26], {%f1, %f2, %f3, %f4};
    add.u64 %rd22, %rd22, %rd16;
    bra P1;
P1_DONE:
    add.u32 %r18, %r2, 1;
    setp.ne.u32 %p5, %r18, %r1;
    setp.ge.u64 %p6, %rd15, %rd5;
    or.pred %p5, %p5, %p6;
    @%p5 bra P1_TAIL_DONE;
    shl.b64 %rd27, %rd3, 2;
    add.u64 %rd27, %rd27, %rd15;
    shl.b64 %rd27, %rd27, 2;
    mov.f32 %f1, 0f00000000;
    mov.u32 %r17, 0;
P1_TAIL_RANK:
    setp.ge.u32 %p6, %r17, %r1;
    @%p6 bra P1_TAIL_STORE;
    mul.wide.u32 %rd24, %r17, 8;
    add.u64 %rd24, %rd1, %rd24;
    ld.global.u64 %rd25, [%rd24];
    add.u64 %rd25, %rd25, %rd27;
    ld.global.cg.f32 %f5, [%rd25];
    add.f32 %f1, %f1, %f5;
    add.u32 %r17, %r17, 1;
    bra P1_TAIL_RANK;
P1_TAIL_STORE:
    add.u64 %rd26, %rd21, %rd27;
    st.global.f32 [%rd26], %f1;
P1_TAIL_DONE:
    bar.sync 0;
    @%p3 bra TB_DONE;
    add.u32 %r19, %r7, 64;
    mul.wide.u32 %rd8, %r19, 4;
    add.u64 %rd28, %rd7, %rd8;
    red.release.sys.global.add.u32 [%rd28], %r8;
    add.u32 %r20, %r10, 64;
    mul.wide.u32 %rd13, %r20, 4;
    add.u64 %rd29, %rd12, %rd13;
    mul.wide.u32 %rd39, %r1, 768;
    add.u64 %rd38, %rd29, %rd39;
    ld.global.u32 %r21, [%rd38];
TB_SPIN:
    ld.acquire.sys.global.u32 %r11, [%rd29];
    setp.eq.u32 %p4, %r11, %r21;
    @%p4 bra TB_SPIN;
    add.u32 %r21, %r21, 1;
    st.global.u32 [%rd38], %r21;
TB_DONE:
    bar.sync 0;
    mov.u32 %r17, 0;
P2_Q:
    setp.ge.u32 %p6, %r17, %r1;
    @%p6 bra P2_DONE;
    setp.eq.u32 %p7, %r17, %r2;
    @%p7 bra P2_NEXT;
    cvt.u64.u32 %rd30, %r17;
    mul.lo.u64 %rd31, %rd30, %rd4;
    add.u64 %rd32, %rd31, %rd4;
    min.u64 %rd32, %rd32, %rd3;
    mul.wide.u32 %rd24, %r17, 8;
    add.u64 %rd24, %rd1, %rd24;
    ld.global.u64 %rd33, [%rd24];
    add.u64 %rd22, %rd31, %rd15;
P2_V:
    setp.ge.u64 %p5, %rd22, %rd32;
    @%p5 bra P2_TAIL;
    shl.b64 %rd23, %rd22, 4;
    add.u64 %rd25, %rd33, %rd23;
    ld.global.cg.v4.f32 {%f5, %f6, %f7, %f8}, [%rd25];
    add.u64 %rd26, %rd21, %rd23;
    st.global.v4.f32 [%rd26], {%f5, %f6, %f7, %f8};
    add.u64 %rd22, %rd22, %rd16;
    bra P2_V;
P2_TAIL:
    add.u32 %r18, %r17, 1;
    setp.ne.u32 %p5, %r18, %r1;
    setp.ge.u64 %p4, %rd15, %rd5;
    or.pred %p5, %p5, %p4;
    @%p5 bra P2_NEXT;
    shl.b64 %rd27, %rd3, 2;
    add.u64 %rd27, %rd27, %rd15;
    shl.b64 %rd27, %rd27, 2;
    add.u64 %rd25, %rd33, %rd27;
    ld.global.cg.f32 %f5, [%rd25];
    add.u64 %rd26, %rd21, %rd27;
    st.global.f32 [%rd26], %f5;
P2_NEXT:
    add.u32 %r17, %r17, 1;
    bra P2_Q;
P2_DONE:
    bar.sync 0;
    @%p3 bra TC_DONE;
    add.u32 %r19, %r7, 128;
    mul.wide.u32 %rd8, %r19, 4;
    add.u64 %rd28, %rd7, %rd8;
    red.relaxed.sys.global.add.u32 [%rd28], %r8;
    add.u32 %r20, %r10, 128;
    mul.wide.u32 %rd13, %r20, 4;
    add.u64 %rd29, %rd12, %rd13;
    mul.wide.u32 %rd39, %r1, 768;
    add.u64 %rd38, %rd29, %rd39;
    ld.global.u32 %r21, [%rd38];
TC_SPIN:
    ld.acquire.sys.global.u32 %r11, [%rd29];
    setp.eq.u32 %p4, %r11, %r21;
    @%p4 bra TC_SPIN;
    add.u32 %r21, %r21, 1;
    st.global.u32 [%rd38], %r21;
TC_DONE:
    ret;
}

.visible .entry one_shot_push_f32(.param .u64 p_ptrs, .param .u32 p_world, .param .u32 p_rank,
    .param .u64 p_recv, .param .u64 p_slot, .param .u64 p_out, .param .u64 p_n, .param .u64 p_nv, .param .u32 p_aligned,
    .param .u64 p_set, .param .u64 p_calls)
{
    .reg .pred %p<8>;
    .reg .b32 %r<24>;
    .reg .b64 %rd<28>;
    .reg .f32 %f<10>;
    ld.param.u64 %rd1, [p_ptrs];
    ld.param.u32 %r1, [p_world];
    ld.param.u32 %r2, [p_rank];
    ld.param.u64 %rd2, [p_recv];
    ld.param.u64 %rd3, [p_slot];
    ld.param.u64 %rd4, [p_out];
    ld.param.u64 %rd5, [p_n];
    ld.param.u64 %rd6, [p_nv];
    ld.param.u32 %r3, [p_aligned];
    ld.param.u64 %rd24, [p_calls];
    ld.param.u64 %rd25, [p_set];
    cvta.to.global.u64 %rd24, %rd24;
    mov.u32 %r5, %ctaid.x;
    mul.wide.u32 %rd26, %r5, 4;
    add.u64 %rd24, %rd24, %rd26;
    ld.volatile.global.u32 %r23, [%rd24];
    and.b32 %r20, %r23, 1;
    cvt.u64.u32 %rd26, %r20;
    mad.lo.u64 %rd2, %rd26, %rd25, %rd2;
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd4, %rd4;
    mul.wide.u32 %rd7, %r2, 8;
    add.u64 %rd7, %rd1, %rd7;
    ld.global.u64 %rd8, [%rd7];
    cvt.u64.u32 %rd9, %r2;
    mad.lo.u64 %rd9, %rd9, %rd3, %rd2;
    add.u64 %rd10, %rd8, %rd2;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r6, %ntid.x;
    mov.u32 %r7, %nctaid.x;
    mad.lo.u32 %r8, %r5, %r6, %r4;
    mul.lo.u32 %r9, %r7, %r6;
    cvt.u64.u32 %rd11, %r8;
    cvt.u64.u32 %rd12, %r9;
    ld.param.u64 %rd27, [p_out];
    setp.ne.u64 %p7, %rd27, 0;
    setp.ne.u32 %p6, %r3, 0;
    mov.u32 %r21, 0xFFFFFFFF;
    mov.u32 %r22, 0x7FC00000;
PV:
    setp.ge.u64 %p1, %rd11, %rd6;
    @%p1 bra PDONE;
    shl.b64 %rd13, %rd11, 4;
    add.u64 %rd14, %rd8, %rd13;
    ld.global.v4.u32 {%r10, %r11, %r12, %r13}, [%rd14];
    setp.eq.u32 %p2, %r10, %r21;
    selp.b32 %r10, %r22, %r10, %p2;
    setp.eq.u32 %p2, %r11, %r21;
    selp.b32 %r11, %r22, %r11, %p2;
    setp.eq.u32 %p2, %r12, %r21;
    selp.b32 %r12, %r22, %r12, %p2;
    setp.eq.u32 %p2, %r13, %r21;
    selp.b32 %r13, %r22, %r13, %p2;
    mov.u32 %r14, 0;
PPUSH:
    setp.ge.u32 %p2, %r14, %r1;
    @%p2 bra PPUSHED;
    setp.eq.u32 %p3, %r14, %r2;
    @%p3 bra PPUSH_NEXT;
    mul.wide.u32 %rd15, %r14, 8;
    add.u64 %rd15, %rd1, %rd15;
    ld.global.u64 %rd16, [%rd15];
    add.u64 %rd16, %rd16, %rd9;
    add.u64 %rd16, %rd16, %rd13;
    st.volatile.global.v4.u32 [%rd16], {%r10, %r11, %r12, %r13};
PPUSH_NEXT:
    add.u32 %r14, %r14, 1;
    bra PPUSH;
PPUSHED:
    mov.f32 %f1, 0f00000000;
    mov.f32 %f2, 0f00000000;
    mov.f32 %f3, 0f00000000;
    mov.f32 %f4, 0f00000000;
    mov.u32 %r14, 0;
PSUM:
    setp.ge.u32 %p2, %r14, %r1;
    @%p2 bra PSUMMED;
    setp.eq.u32 %p3, %r14, %r2;
    @%p3 bra PSUM_OWN;
    cvt.u64.u32 %rd17, %r14;
    mad.lo.u64 %rd17, %rd17, %rd3, %rd10;
    add.u64 %rd17, %rd17, %rd13;
PSPIN:
    ld.volatile.global.v4.u32 {%r15, %r16, %r17, %r18}, [%rd17];
    max.u32 %r19, %r15, %r16;
    max.u32 %r20, %r17, %r18;
    max.u32 %r19, %r19, %r20;
    setp.eq.u32 %p4, %r19, %r21;
    @%p4 bra PSPIN;
    st.volatile.global.v4.u32 [%rd17], {%r21, %r21, %r21, %r21};
    bra PSUM_ADD;
PSUM_OWN:
    mov.u32 %r15, %r10;
    mov.u32 %r16, %r11;
    mov.u32 %r17, %r12;
    mov.u32 %r18, %r13;
PSUM_ADD:
    mov.b32 %f5, %r15;
    mov.b32 %f6, %r16;
    mov.b32 %f7, %r17;
    mov.b32 %f8, %r18;
    add.f32 %f1, %f1, %f5;
    add.f32 %f2, %f2, %f6;
    add.f32 %f3, %f3, %f7;
    add.f32 %f4, %f4, %f8;
    add.u32 %r14, %r14, 1;
    bra PSUM;
PSUMMED:
    @!%p7 bra PNEXT;
    shl.b64 %rd18, %rd11, 2;
    add.u64 %rd19, %rd18, 4;
    setp.le.u64 %p5, %rd19, %rd5;
    and.pred %p5, %p5, %p6;
    add.u64 %rd20, %rd4, %rd13;
    @!%p5 bra PSCALAR;
    st.global.v4.f32 [%rd20], {%f1, %f2, %f3, %f4};
    bra PNEXT;
PSCALAR:
    setp.lt.u64 %p5, %rd18, %rd5;
    @%p5 st.global.f32 [%rd20], %f1;
    add.u64 %rd21, %rd18, 1;
    setp.lt.u64 %p5, %rd21, %rd5;
    @%p5 st.global.f32 [%rd20+4], %f2;
    add.u64 %rd21, %rd18, 2;
    setp.lt.u64 %p5, %rd21, %rd5;
    @%p5 st.global.f32 [%rd20+8], %f3;
    add.u64 %rd21, %rd18, 3;
    setp.lt.u64 %p5, %rd21, %rd5;
    @%p5 st.global.f32 [%rd20+12], %f4;
PNEXT:
    add.u64 %rd11, %rd11, %rd12;
    bra PV;
PDONE:
    bar.sync 0;
    setp.ne.u32 %p1, %r4, 0;
    @%p1 bra PRET;
    add.u32 %r23, %r23, 1;
    st.volatile.global.u32 [%rd24], %r23;
PRET:
    ret;
}

.visible .entry signal_sync(.param .u64 p_pads, .param .u32 p_world, .param .u32 p_rank, .param .u32 p_channel,
    .param .u32 p_peer, .param .u32 p_mode, .param .u64 p_timeout, .param .u64 p_status)
{
    .reg .pred %p<8>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<16>;
    ld.param.u64 %rd1, [p_pads];
    ld.param.u32 %r1, [p_world];
    ld.param.u32 %r2, [p_rank];
    ld.param.u32 %r3, [p_channel];
    ld.param.u32 %r10, [p_peer];
    ld.param.u32 %r11, [p_mode];
    ld.param.u64 %rd8, [p_timeout];
    ld.param.u64 %rd9, [p_status];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r4, %tid.x;
    setp.ge.u32 %p1, %r4, %r1;
    setp.eq.u32 %p2, %r4, %r2;
    or.pred %p3, %p1, %p2;
    setp.ne.u32 %p4, %r10, 0xFFFFFFFF;
    setp.ne.u32 %p5, %r4, %r10;
    and.pred %p5, %p4, %p5;
    or.pred %p3, %p3, %p5;
    @%p3 bra SIG_DONE;
    mov.u32 %r8, 1;
    and.b32 %r12, %r11, 1;
    setp.eq.u32 %p6, %r12, 0;
    @%p6 bra SIG_WAIT;
    mul.wide.u32 %rd2, %r4, 8;
    add.u64 %rd2, %rd1, %rd2;
    ld.global.u64 %rd3, [%rd2];
    mad.lo.u32 %r5, %r2, 16, %r3;
    mul.wide.u32 %rd4, %r5, 4;
    add.u64 %rd4, %rd3, %rd4;
    red.relaxed.sys.global.add.u32 [%rd4], %r8;
SIG_WAIT:
    and.b32 %r12, %r11, 2;
    setp.eq.u32 %p6, %r12, 0;
    @%p6 bra SIG_DONE;
    mul.wide.u32 %rd5, %r2, 8;
    add.u64 %rd5, %rd1, %rd5;
    ld.global.u64 %rd6, [%rd5];
    mad.lo.u32 %r6, %r4, 16, %r3;
    mul.wide.u32 %rd7, %r6, 4;
    add.u64 %rd7, %rd6, %rd7;
    add.u32 %r9, %r1, %r4;
    mad.lo.u32 %r9, %r9, 16, %r3;
    mul.wide.u32 %rd13, %r9, 4;
    add.u64 %rd13, %rd6, %rd13;
    ld.relaxed.gpu.global.u32 %r13, [%rd13];
    mov.u64 %rd10, %globaltimer;
SIG_SPIN:
    ld.acquire.sys.global.u32 %r7, [%rd7];
    setp.ne.u32 %p1, %r7, %r13;
    @%p1 bra SIG_SEEN;
    setp.eq.u64 %p2, %rd8, 0;
    @%p2 bra SIG_SPIN;
    mov.u64 %rd11, %globaltimer;
    sub.u64 %rd11, %rd11, %rd10;
    setp.lt.u64 %p2, %rd11, %rd8;
    @%p2 bra SIG_SPIN;
    cvta.to.global.u64 %rd9, %rd9;
    mul.wide.u32 %rd12, %r4, 4;
    add.u64 %rd12, %rd9, %rd12;
    st.global.u32 [%rd12], %r8;
    bra SIG_DONE;
SIG_SEEN:
    add.u32 %r14, %r13, 1;
    atom.relaxed.gpu.global.cas.b32 %r15, [%rd13], %r13, %r14;
    setp.eq.u32 %p1, %r15, %r13;
    @%p1 bra SIG_DONE;
    mov.u32 %r13, %r15;
    bra SIG_SPIN;
SIG_DONE:
    ret;
}
\0";

/// The kernels (one-shot, two-shot) and the device arrays of every rank's data and pad
/// addresses, made at first use.
struct Kernels {
    module: usize,
    one_shot: usize,
    push: usize,
    two_shot: usize,
    signal: usize,
    ptrs: mempool::Buffer<u64>,
    pads: mempool::Buffer<u64>,
}

fn cuda(op: &'static str, r: CUresult) -> Result<()> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(Error::Symmetric(format!("{op}: {r:?}"))),
    }
}

/// One rank's view of a symmetric allocation (see the [module](self)).
pub struct SymmMemory<T> {
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    len: usize,
    /// Bytes of data (rounded up to 128), then the pad, then `recv`.
    data_bytes: usize,
    /// Bytes of the one-shot's receive slots (`2 world` slots of `data_bytes`) after the pad,
    /// or 0: data larger than [`PUSH_MAX`], which the one-shot reads from the peers.
    recv: usize,
    /// Bytes mapped per rank (a multiple of the granularity).
    bytes: usize,
    /// Where each rank's allocation is mapped in this process, for this rank's device.
    bases: Vec<u64>,
    kernels: std::sync::OnceLock<Kernels>,
    /// Per channel, the ranks a timed-out barrier gave up on (its signals sent): the next
    /// barrier on the channel waits for them only.
    unfinished: std::sync::Mutex<Vec<Vec<usize>>>,
    _elem: PhantomData<T>,
}

impl<T> std::fmt::Debug for SymmMemory<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmMemory")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("len", &self.len)
            .field("bases", &self.bases)
            .finish()
    }
}

// SAFETY: the value holds device addresses and a context, usable from any thread; no `T` lives
// in it (the memory is device memory, reached through the driver).
unsafe impl<T> Send for SymmMemory<T> {}
// SAFETY: `&SymmMemory` only reads its fields and queues stream work.
unsafe impl<T> Sync for SymmMemory<T> {}

fn prop(device: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all zeros is its "nothing requested" value.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location =
        mempool::backend::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device as i32);
    p
}

/// Maps `handle` (`bytes`) into a fresh range, readable and writable by `device`.
fn map(handle: sys::CUmemGenericAllocationHandle, bytes: usize, device: usize) -> Result<u64> {
    let mut va = 0;
    // SAFETY: out-parameter; a fresh range of `bytes` (a multiple of the granularity).
    cuda("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut va, bytes, 0, 0, 0) })?;
    // SAFETY: the range just reserved and a live handle of exactly `bytes`.
    if let Err(e) = cuda("cuMemMap", unsafe { sys::cuMemMap(va, bytes, 0, handle, 0) }) {
        // SAFETY: the reservation made above, empty, given back once.
        let _ = unsafe { sys::cuMemAddressFree(va, bytes) };
        return Err(e);
    }
    // SAFETY: a plain C struct of integers; all zeros is valid.
    let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    d.location =
        mempool::backend::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device as i32);
    d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: the range just mapped whole; one valid descriptor.
    if let Err(e) = cuda("cuMemSetAccess", unsafe { sys::cuMemSetAccess(va, bytes, &d, 1) }) {
        // SAFETY: the mapping and reservation made above, undone once.
        unsafe {
            let _ = sys::cuMemUnmap(va, bytes);
            let _ = sys::cuMemAddressFree(va, bytes);
        }
        return Err(e);
    }
    Ok(va)
}

/// Unmaps and frees the ranges of `bases`.
fn unmap_all(bases: &[u64], bytes: usize) {
    for &va in bases {
        // SAFETY: a range `map` made, mapped whole, undone once.
        unsafe {
            let _ = sys::cuMemUnmap(va, bytes);
            let _ = sys::cuMemAddressFree(va, bytes);
        }
    }
}

/// Gathers `mine` (the same number of words on every rank) from every rank, in rank order.
fn gather(comm: &Communicator, mine: &[u64], stream: &Arc<CudaStream>) -> Result<Vec<u64>> {
    let alloc = mempool::Allocator::cuda(comm.device())?;
    let mut send = alloc.alloc::<u64>(mine.len())?;
    stream.memcpy_htod(mine, &mut send).map_err(Error::cuda)?;
    let mut all = alloc.alloc::<u64>(mine.len() * comm.world_size())?;
    comm.all_gather(&send, &mut all, stream)?;
    stream.clone_dtoh(&all).map_err(Error::cuda)
}

/// Whether every rank of `comm` can share symmetric memory with this one: the same machine (its
/// boot) and the same network namespace (where the rendezvous sockets are). Collective (an
/// all-gather on `stream`); every rank gets the same answer. Launchers that span several
/// machines (torchrun, srun, mpirun across nodes) make communicators for which it is false:
/// [`symm_empty`] there would wait for the other machines' ranks until its timeout.
pub fn same_machine(comm: &Communicator, stream: &Arc<CudaStream>) -> Result<bool> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").map(|l| l.display().to_string()).unwrap_or_default();
    let key = format!("{}|{netns}", read("/proc/sys/kernel/random/boot_id").trim());
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let all = gather(comm, &[hash], stream)?;
    Ok(all.iter().all(|&h| h == hash))
}

/// Options of [`symm_empty_with`].
#[derive(Debug, Clone)]
pub struct SymmOptions {
    timeout: Duration,
}

impl Default for SymmOptions {
    fn default() -> SymmOptions {
        SymmOptions { timeout: Duration::from_secs(120) }
    }
}

impl SymmOptions {
    /// The defaults: a rendezvous between processes waits at most 120 s for every rank.
    pub fn new() -> SymmOptions {
        SymmOptions::default()
    }

    /// How long a rendezvous between processes waits for the other ranks before it fails,
    /// naming the ranks it did not hear from.
    pub fn timeout(mut self, timeout: Duration) -> SymmOptions {
        self.timeout = timeout;
        self
    }
}

/// [`symm_empty_with`] with the default options.
pub fn symm_empty<T: mempool::AnyBitPattern>(
    comm: &Communicator,
    len: usize,
    stream: &Arc<CudaStream>,
) -> Result<SymmMemory<T>> {
    symm_empty_with(comm, len, stream, &SymmOptions::default())
}

/// Allocates `len` elements of `T` on every rank of `comm` and maps them all everywhere
/// (collective: every rank calls it, with the same `len`, on a stream of its device). See the
/// [module](self). Errors, on every rank alike: ranks asking for different sizes, a device that
/// cannot map a peer's memory; between processes, a rank not heard from within
/// `options`' timeout (named), or one that left.
pub fn symm_empty_with<T: mempool::AnyBitPattern>(
    comm: &Communicator,
    len: usize,
    stream: &Arc<CudaStream>,
    options: &SymmOptions,
) -> Result<SymmMemory<T>> {
    // First: every rank counts this allocation, whatever happens next, so the names of later
    // rendezvous stay in step.
    let key = comm.next_rendezvous();
    let (rank, world, device) = (comm.rank(), comm.world_size(), comm.device());
    let ctx = comm.context().clone();
    // A size this rank cannot have still takes part in the exchange (as a rank that could not
    // allocate), so every rank fails together rather than wait for it.
    let pad = pad_bytes(world);
    let sized = (|| -> std::result::Result<(usize, usize, usize, usize), String> {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let requested = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| format!("{len} elements of {} bytes overflow", std::mem::size_of::<T>()))?;
        let mut gran = 0usize;
        let p = prop(device);
        // SAFETY: out-parameter and a valid property struct.
        cuda("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })
        .map_err(|e| e.to_string())?;
        let data_bytes = requested.checked_next_multiple_of(128);
        // Receive slots only where there is a one-shot: `SymmMemory<f32>`.
        let pushes = std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
        let recv = data_bytes.filter(|_| pushes).map_or(0, |d| receive_bytes(d, world));
        let bytes = data_bytes
            .and_then(|d| d.checked_add(pad))
            .and_then(|b| b.checked_add(recv))
            .and_then(|b| b.checked_next_multiple_of(gran.max(1)));
        match (data_bytes, bytes) {
            (Some(d), Some(b)) => Ok((requested, d, recv, b)),
            _ => Err(format!("{requested} bytes and the signal pad overflow")),
        }
    })();
    let (requested, data_bytes, recv, bytes) = match &sized {
        Ok(v) => *v,
        Err(_) => (usize::MAX, 0, 0, 0),
    };
    let layout = Layout { rank, world, device, requested, bytes, data_bytes, pad, recv, local: sized.err() };
    let bases = match key {
        None => rendezvous_in_process(comm, &layout, stream)?,
        Some(key) => rendezvous_across_processes(key, &layout, stream, options.timeout)?,
    };
    Ok(SymmMemory {
        ctx,
        rank,
        world,
        len,
        data_bytes,
        recv,
        bytes,
        bases,
        kernels: std::sync::OnceLock::new(),
        unfinished: std::sync::Mutex::new(vec![Vec::new(); CHANNELS]),
        _elem: PhantomData,
    })
}

/// What every rank allocates: `bytes` (data, then the pad), on `device`, for `requested`
/// bytes of data; or why this rank cannot (`local`: it takes part in the exchange all the same,
/// as a rank that could not allocate).
struct Layout {
    rank: usize,
    world: usize,
    device: usize,
    requested: usize,
    bytes: usize,
    data_bytes: usize,
    pad: usize,
    /// Bytes of the one-shot's receive slots after the pad (0 where it reads the peers).
    recv: usize,
    local: Option<String>,
}

/// A physical allocation's handle, released when dropped (its mappings keep the memory).
struct Handle(sys::CUmemGenericAllocationHandle);

impl Drop for Handle {
    fn drop(&mut self) {
        if self.0 != 0 {
            // SAFETY: a handle this value owns (made or imported here), released once.
            let _ = unsafe { sys::cuMemRelease(self.0) };
        }
    }
}

/// Ranges `map` made, unmapped when dropped unless taken.
struct Mapped {
    bases: Vec<u64>,
    bytes: usize,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        unmap_all(&self.bases, self.bytes);
    }
}

/// Zeroes this rank's own pad (`layout.pad` bytes after the data at `base`), fills its receive
/// slots after it with the empty mark ([`EMPTY_BYTE`]), and waits for both.
fn zero_own_pad(base: u64, layout: &Layout, stream: &Arc<CudaStream>) -> Result<()> {
    let pad = base + layout.data_bytes as u64;
    // SAFETY: our own pad, inside the range mapped for this device; the stream is this device's.
    let r = unsafe { sys::cuMemsetD8Async(pad, 0, layout.pad, stream.cu_stream()) };
    let mut queued = cuda("cuMemsetD8Async", r);
    if queued.is_ok() && layout.recv > 0 {
        // SAFETY: our own receive slots, after the pad, inside the same mapping.
        let r = unsafe { sys::cuMemsetD8Async(pad + layout.pad as u64, EMPTY_BYTE, layout.recv, stream.cu_stream()) };
        queued = cuda("cuMemsetD8Async", r);
    }
    // Waited for even after an error: the caller unmaps the range then.
    let done = stream.synchronize().map_err(Error::cuda);
    queued.and(done)
}

/// Every rank in this process (`Communicator::all_local`): handles are shared as they are,
/// through the communicator's all-gather.
fn rendezvous_in_process(comm: &Communicator, l: &Layout, stream: &Arc<CudaStream>) -> Result<Vec<u64>> {
    let (rank, world, bytes) = (l.rank, l.world, l.bytes);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // Exportable where the device allows (NCCL's window registration shares the allocation
    // with the peers through a descriptor); otherwise a plain one.
    let mut p = prop(l.device);
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let made = match &l.local {
        Some(why) => Err(Error::Symmetric(format!("rank {rank}: {why}"))),
        // SAFETY: out-parameter; a valid property struct for this device.
        None => cuda("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, bytes, &p, 0) }).or_else(|_| {
            let p = prop(l.device);
            // SAFETY: as above, with no handle type asked for.
            cuda("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, bytes, &p, 0) })
        }),
    };
    let own = Handle(if made.is_ok() { handle } else { 0 });
    // Every rank learns every rank's (process, bytes asked for, handle, device, made, bytes
    // allocated) before anyone maps.
    let mine = [
        u64::from(std::process::id()),
        l.requested as u64,
        own.0,
        l.device as u64,
        u64::from(made.is_ok()),
        bytes as u64,
    ];
    let all = gather(comm, &mine, stream)?;
    let field = |r: usize, k: usize| all[6 * r + k];
    let failure = if let Some(r) = (0..world).find(|&r| field(r, 4) == 0) {
        Some(format!("rank {r} could not allocate its memory"))
    } else if (0..world).any(|r| field(r, 0) != field(0, 0)) {
        Some("the ranks of a communicator made by all_local are in several processes".into())
    } else {
        same_sizes((0..world).map(|r| (field(r, 1), field(r, 5))))
    };
    if let Some(why) = failure {
        made?;
        return Err(Error::Symmetric(why));
    }
    let mut mapped = Mapped { bases: Vec::with_capacity(world), bytes };
    let mut failed = None;
    for r in 0..world {
        match map(field(r, 2), bytes, l.device) {
            Ok(va) => mapped.bases.push(va),
            Err(e) => {
                failed = Some(format!("rank {rank} could not map rank {r}'s memory: {e}"));
                break;
            }
        }
    }
    if failed.is_none() {
        // Zero our own pad before anyone signals into it.
        if let Err(e) = zero_own_pad(mapped.bases[rank], l, stream) {
            failed = Some(e.to_string());
        }
    }
    // Everyone mapped (or someone failed) before any handle goes: the second exchange.
    let ok = gather(comm, &[u64::from(failed.is_none())], stream);
    let everyone = ok.as_ref().map(|v| v.iter().position(|&x| x == 0));
    match (failed, everyone) {
        (None, Ok(None)) => Ok(std::mem::take(&mut mapped.bases)),
        (why, other) => Err(Error::Symmetric(why.unwrap_or_else(|| match other {
            Ok(Some(r)) => format!("rank {r} could not map the ranks' memory"),
            Ok(None) => unreachable!("handled above"),
            Err(e) => e.to_string(),
        }))),
    }
}

/// Why ranks with these (bytes asked for, bytes allocated) cannot share an allocation, if they
/// cannot: every rank must ask for the same bytes (and so put its pad at the same offset), and
/// allocate the same (devices of one granularity).
fn same_sizes(sizes: impl Iterator<Item = (u64, u64)>) -> Option<String> {
    let sizes: Vec<(u64, u64)> = sizes.collect();
    if sizes.iter().any(|s| s.0 != sizes[0].0) {
        let asked: Vec<u64> = sizes.iter().map(|s| s.0).collect();
        return Some(format!("every rank must ask for the same size; the ranks ask for {asked:?} bytes"));
    }
    if sizes.iter().any(|s| s.1 != sizes[0].1) {
        let made: Vec<u64> = sizes.iter().map(|s| s.1).collect();
        return Some(format!("the ranks' allocations differ ({made:?} bytes): devices of different granularity"));
    }
    None
}

/// The first word of every rendezvous message, then its round.
/// Its version: `02` since the one-shot pushes into receive slots (an older build lays the
/// allocation out otherwise and runs another one-shot: its ranks must not pair with these).
const MAGIC: u64 = u64::from_le_bytes(*b"mpsymm02");

/// A rendezvous message: words.
fn message(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The words of a message of round `round` with `n` words after the round, or why not.
fn words(data: &[u8], round: u64, n: usize) -> std::result::Result<Vec<u64>, String> {
    let w: Vec<u64> = data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    if data.len() != 8 * (n + 2) || w[0] != MAGIC || w[1] != round {
        return Err(format!("a message that is not round {round} of a symmetric-memory rendezvous"));
    }
    Ok(w[2..].to_vec())
}

/// What a peer said in the first round.
struct Peer {
    pid: u64,
    bytes: u64,
    requested: u64,
    made: bool,
    handle: u64,
    fd: Option<OwnedFd>,
    /// The connection it sends on.
    conn: UnixStream,
}

/// Ranks created with an id (`Communicator::new`, `from_env`), in any processes of this
/// machine: each rank listens on an abstract Unix socket named by the communicator's id, the
/// count of symmetric allocations and its rank; connects to every other rank's and sends (its
/// rank, process, size, device, whether it allocated, its handle) with the allocation's file
/// descriptor attached (`SCM_RIGHTS`); hears every other rank the same way; checks; maps every
/// allocation (imported from its descriptor, or by handle within this process); zeroes its
/// pad; then a second round says who mapped, before anyone lets go of a handle. Each wait ends
/// at `timeout`, naming the ranks not heard from; a rank that leaves is named at once.
fn rendezvous_across_processes(
    (id, seq): (u64, u64),
    l: &Layout,
    stream: &Arc<CudaStream>,
    timeout: Duration,
) -> Result<Vec<u64>> {
    let (rank, world, bytes) = (l.rank, l.world, l.bytes);
    let deadline = Instant::now() + timeout;
    let fail = |m: String| Error::Symmetric(format!("rank {rank}: {m}"));
    let name = |r: usize| format!("mempool-symm-{id:016x}-{seq}-{r}");
    let addr = |r: usize| {
        SocketAddr::from_abstract_name(name(r).as_bytes()).map_err(|e| fail(format!("socket name {}: {e}", name(r))))
    };
    let left = |what: &str| {
        let now = Instant::now();
        if now >= deadline {
            Err(fail(format!("{what} within {timeout:?}")))
        } else {
            Ok((deadline - now).max(Duration::from_millis(1)))
        }
    };
    // Our allocation, exportable as a file descriptor.
    let mut p = prop(l.device);
    p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut raw = 0;
    let made = match &l.local {
        Some(why) => Err(Error::Symmetric(why.clone())),
        // SAFETY: out-parameter; a valid property struct for this device.
        None => cuda("cuMemCreate", unsafe { sys::cuMemCreate(&mut raw, bytes, &p, 0) }),
    };
    let own = Handle(if made.is_ok() { raw } else { 0 });
    let fd = made.and_then(|()| {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: out-parameter of the handle type asked for; a live handle made with it.
        cuda("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                own.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just opened `fd` for us; owned once, here.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    });
    let pid = u64::from(std::process::id());
    let listener = UnixListener::bind_addr(&addr(rank)?)
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .map_err(|e| fail(format!("could not open its rendezvous socket {}: {e}", name(rank))))?;
    // Round 1, out: to every other rank, as soon as it listens.
    let first = message(&[
        MAGIC,
        1,
        rank as u64,
        pid,
        bytes as u64,
        l.device as u64,
        u64::from(fd.is_ok()),
        own.0,
        l.requested as u64,
    ]);
    let mut out: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
    for q in (0..world).filter(|&q| q != rank) {
        let conn = loop {
            match UnixStream::connect_addr(&addr(q)?) {
                Ok(c) => break c,
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => {
                    left(&format!(
                        "rank {q} never opened its rendezvous socket (not started, gone, or not on this machine)"
                    ))?;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(fail(format!("connecting to rank {q}: {e}"))),
            }
        };
        let fds: Vec<BorrowedFd<'_>> = fd.as_ref().ok().map(|f| f.as_fd()).into_iter().collect();
        mempool::ipc::send_message(&conn, &first, &fds)
            .map_err(|e| fail(format!("rank {q} left the rendezvous: {e}")))?;
        out[q] = Some(conn);
    }
    // Round 1, in: every other rank.
    let mut peers: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
    let mut heard = 0;
    while heard < world - 1 {
        let conn = match listener.accept() {
            // Only this user's processes: any local process can reach an abstract socket, and
            // one of another user's is not a rank (it is hung up on, and the wait goes on).
            Ok((c, _))
                if mempool::ipc::peer_credentials(&c).is_ok_and(|(_, uid)| uid == mempool::ipc::effective_uid()) =>
            {
                c
            }
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let silent: Vec<usize> = (0..world).filter(|&q| q != rank && peers[q].is_none()).collect();
                left(&format!("heard nothing from rank(s) {silent:?}"))?;
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(fail(format!("accepting a peer: {e}"))),
        };
        let wait = left("a peer connected but sent nothing")?;
        let got = conn
            .set_nonblocking(false)
            .and_then(|()| conn.set_read_timeout(Some(wait)))
            .and_then(|()| mempool::ipc::receive_message(&conn, 128))
            .map_err(|e| fail(format!("reading a peer's first message: {e}")))?;
        let (data, fds) = got;
        let w = words(&data, 1, 7).map_err(fail)?;
        let q = w[0] as usize;
        if q >= world || q == rank || peers[q].is_some() {
            return Err(fail(format!("a first message from rank {q}, which is not a peer still to hear from")));
        }
        // The process that connected is the one the message names.
        match mempool::ipc::peer_credentials(&conn) {
            Ok((p, _)) if u64::from(p) == w[1] => {}
            _ => return Err(fail(format!("rank {q}'s first message names a process other than the one that sent it"))),
        }
        let fd = fds.into_iter().next();
        peers[q] = Some(Peer { pid: w[1], bytes: w[2], made: w[4] != 0, handle: w[5], requested: w[6], fd, conn });
        heard += 1;
    }
    // Every rank has every rank's figures: every rank reaches the same verdict.
    let figure = |q: usize, f: &dyn Fn(&Peer) -> u64, mine: u64| peers[q].as_ref().map_or(mine, f);
    if let Some(q) = (0..world).find(|&q| figure(q, &|p| u64::from(p.made), u64::from(fd.is_ok())) == 0) {
        return Err(match (&fd, q == rank) {
            (Err(e), true) => fail(format!("could not allocate its memory: {e}")),
            _ => fail(format!("rank {q} could not allocate its memory")),
        });
    }
    let sizes =
        (0..world).map(|q| (figure(q, &|p| p.requested, l.requested as u64), figure(q, &|p| p.bytes, bytes as u64)));
    if let Some(why) = same_sizes(sizes) {
        return Err(Error::Symmetric(why));
    }
    let mut mapped = Mapped { bases: Vec::with_capacity(world), bytes };
    let mut failed = None;
    for (q, peer) in peers.iter().enumerate() {
        let va = match peer {
            None => map(own.0, bytes, l.device),
            // A handle of this process is valid here as it is.
            Some(peer) if peer.pid == pid => map(peer.handle, bytes, l.device),
            Some(peer) => import(peer.fd.as_ref()).and_then(|h| map(h.0, bytes, l.device)),
        };
        match va {
            Ok(va) => mapped.bases.push(va),
            Err(e) => {
                failed = Some(format!("could not map rank {q}'s memory: {e}"));
                break;
            }
        }
    }
    if failed.is_none() {
        if let Err(e) = zero_own_pad(mapped.bases[rank], l, stream) {
            failed = Some(e.to_string());
        }
    }
    // Round 2: who mapped. Nobody lets go of its handle (or descriptor) before everyone has.
    let second = message(&[MAGIC, 2, u64::from(failed.is_none())]);
    for q in (0..world).filter(|&q| q != rank) {
        let conn = out[q].as_ref().expect("connected in round 1");
        mempool::ipc::send_message(conn, &second, &[])
            .map_err(|e| fail(format!("rank {q} left the rendezvous: {e}")))?;
    }
    let mut not_mapped = None;
    for q in (0..world).filter(|&q| q != rank) {
        let conn = &peers[q].as_ref().expect("heard in round 1").conn;
        let wait = left(&format!("rank {q} did not say whether it mapped"))?;
        let data = conn
            .set_read_timeout(Some(wait))
            .and_then(|()| mempool::ipc::receive_message(conn, 64))
            .map(|(data, _)| data)
            .map_err(|e| match e.kind() {
                ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                    fail(format!("rank {q} did not say whether it mapped within {timeout:?}"))
                }
                _ => fail(format!("rank {q} left the rendezvous before its second message: {e}")),
            })?;
        if words(&data, 2, 1).map_err(fail)?[0] == 0 && not_mapped.is_none() {
            not_mapped = Some(q);
        }
    }
    match (failed, not_mapped) {
        (None, None) => Ok(std::mem::take(&mut mapped.bases)),
        (Some(why), _) => Err(fail(why)),
        (None, Some(q)) => Err(fail(format!("rank {q} could not map the ranks' memory"))),
    }
}

/// A peer's allocation, from the file descriptor it sent.
fn import(fd: Option<&OwnedFd>) -> Result<Handle> {
    let fd = fd.ok_or_else(|| Error::Symmetric("its first message came without a file descriptor".into()))?;
    let mut h = 0;
    // SAFETY: out-parameter; a descriptor `cuMemExportToShareableHandle` made (passed as the
    // integer the driver takes for this handle type), open for the call.
    cuda("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut h,
            fd.as_raw_fd() as isize as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(Handle(h))
}

impl<T> SymmMemory<T> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Elements per rank.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every rank's data, as addresses this rank's device reads and writes (for kernels).
    pub fn buffer_ptrs(&self) -> Vec<u64> {
        self.bases.clone()
    }

    /// Every rank's signal pad: `world_size × CHANNELS` 32-bit words counting the signals rank
    /// `r` sent its owner on channel `c` (word `r * CHANNELS + c`), then as many counting those
    /// the owner took (word `(world_size + r) * CHANNELS + c`): equal when every signal was
    /// taken. The kernels' own words follow.
    pub fn signal_pad_ptrs(&self) -> Vec<u64> {
        self.bases.iter().map(|b| b + self.data_bytes as u64).collect()
    }

    fn check(&self, rank: usize, channel: usize, stream: &CudaStream) -> Result<()> {
        if rank >= self.world {
            return Err(Error::InvalidRank { rank, world_size: self.world });
        }
        if channel >= CHANNELS {
            return Err(Error::Symmetric(format!("channel {channel} out of range (0..{CHANNELS})")));
        }
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::WrongDevice {
                what: "a symmetric-memory signal",
                expected: self.ctx.ordinal(),
                found: stream.context().ordinal(),
            });
        }
        Ok(())
    }

    /// Queues on `stream`: after its earlier work, one more signal to rank `dst` on `channel`
    /// (counted in `dst`'s pad: signals are never merged). One kernel launch.
    pub fn put_signal(&self, dst: usize, channel: usize, stream: &Arc<CudaStream>) -> Result<()> {
        self.check(dst, channel, stream)?;
        self.not_self(dst)?;
        self.sync_kernel(channel, Some(dst), 1, 0, 0, stream)
    }

    /// Queues on `stream`: wait until rank `src` sent a signal on `channel` that this rank has
    /// not taken yet, and take it. One kernel launch.
    pub fn wait_signal(&self, src: usize, channel: usize, stream: &Arc<CudaStream>) -> Result<()> {
        self.check(src, channel, stream)?;
        self.not_self(src)?;
        self.sync_kernel(channel, Some(src), 2, 0, 0, stream)
    }

    fn not_self(&self, peer: usize) -> Result<()> {
        if peer == self.rank {
            return Err(Error::Symmetric(format!("rank {peer} signals itself")));
        }
        Ok(())
    }

    /// The device address of an array of [`world_size`](Self::world_size) `u64`: every rank's
    /// data as this rank's device addresses it ([`buffer_ptrs`](Self::buffer_ptrs)), for a
    /// kernel of the caller's. Made on `stream` at first use (with the built-in kernels), then
    /// kept, unchanged, as long as `self`.
    pub fn buffer_ptrs_dev(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        self.check(self.rank, 0, stream)?;
        Ok(self.kernels(stream)?.ptrs.device_ptr_raw())
    }

    /// As [`buffer_ptrs_dev`](Self::buffer_ptrs_dev), for every rank's signal pad
    /// ([`signal_pad_ptrs`](Self::signal_pad_ptrs)).
    pub fn signal_pad_ptrs_dev(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        self.check(self.rank, 0, stream)?;
        Ok(self.kernels(stream)?.pads.device_ptr_raw())
    }

    /// Queues on `stream`: signal every other rank on `channel`, then wait for every other rank
    /// (collective). One kernel launch (the protocol of [`put_signal`](Self::put_signal) and
    /// [`wait_signal`](Self::wait_signal), signals written by one thread per peer): after it,
    /// every rank's work queued before its barrier is done, its writes visible to every rank.
    /// After a [`barrier_timeout`](Self::barrier_timeout) on `channel` that gave up on some
    /// ranks, it finishes that barrier instead (it waits for those ranks, signalling no one
    /// again: this rank's signals went out already).
    pub fn barrier(&self, channel: usize, stream: &Arc<CudaStream>) -> Result<()> {
        self.check(self.rank, channel, stream)?;
        let late = std::mem::take(&mut self.unfinished.lock().unwrap_or_else(|p| p.into_inner())[channel]);
        if late.is_empty() {
            return self.sync_kernel(channel, None, 3, 0, 0, stream);
        }
        late.iter().try_for_each(|&r| self.sync_kernel(channel, Some(r), 2, 0, 0, stream))
    }

    /// [`barrier`](Self::barrier), waiting at most `timeout` for each rank, and for the barrier
    /// itself: this call returns once the stream's work up to the barrier is done. Errors name
    /// the ranks that did not arrive in time; this rank's signals went out, so the barrier is
    /// left unfinished, and the next `barrier` or `barrier_timeout` on the channel finishes it
    /// (waiting for those ranks only) rather than begin another.
    pub fn barrier_timeout(&self, channel: usize, timeout: Duration, stream: &Arc<CudaStream>) -> Result<()> {
        self.check(self.rank, channel, stream)?;
        let mut unfinished = self.unfinished.lock().unwrap_or_else(|p| p.into_inner());
        let late = if unfinished[channel].is_empty() {
            self.timed(channel, None, 3, timeout, stream)?
        } else {
            let mut still = Vec::new();
            for &r in &unfinished[channel] {
                still.extend(self.timed(channel, Some(r), 2, timeout, stream)?);
            }
            still
        };
        let err = (!late.is_empty()).then(|| {
            Error::Symmetric(format!(
                "rank {}: rank(s) {late:?} did not reach the barrier on channel {channel} within {timeout:?} (the \
                 next barrier on the channel finishes this one)",
                self.rank
            ))
        });
        unfinished[channel] = late;
        err.map_or(Ok(()), Err)
    }

    /// [`wait_signal`](Self::wait_signal), waiting at most `timeout`; returns once the stream's
    /// work up to the wait is done. Error: rank `src` did not signal in time (if it signals
    /// later, the next wait on the channel takes that signal).
    pub fn wait_signal_timeout(
        &self,
        src: usize,
        channel: usize,
        timeout: Duration,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check(src, channel, stream)?;
        self.not_self(src)?;
        if self.timed(channel, Some(src), 2, timeout, stream)?.is_empty() {
            return Ok(());
        }
        Err(Error::Symmetric(format!(
            "rank {}: rank(s) [{src}] did not signal on channel {channel} within {timeout:?}",
            self.rank
        )))
    }

    /// Runs the signal kernel with `timeout` and waits for it: the ranks it gave up on.
    fn timed(
        &self,
        channel: usize,
        peer: Option<usize>,
        mode: u32,
        timeout: Duration,
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<usize>> {
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1);
        let status = stream.alloc_zeros::<u32>(self.world).map_err(Error::cuda)?;
        {
            let (ptr, _sync) = status.device_ptr(stream);
            self.sync_kernel(channel, peer, mode, ns, ptr, stream)?;
        }
        Ok(stream
            .clone_dtoh(&status)
            .map_err(Error::cuda)?
            .iter()
            .enumerate()
            .filter(|(_, &v)| v != 0)
            .map(|(r, _)| r)
            .collect())
    }

    /// Launches the signal kernel: for every peer (`peer: None`) or one, signal (`mode & 1`)
    /// and wait (`mode & 2`), with a timeout (0: none) reported in `status` (a device array of
    /// `world` u32, or 0).
    fn sync_kernel(
        &self,
        channel: usize,
        peer: Option<usize>,
        mode: u32,
        timeout_ns: u64,
        status: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        if self.world > 1024 {
            return Err(Error::Symmetric("the signal kernel serves at most 1,024 ranks".into()));
        }
        let k = self.kernels(stream)?;
        let (mut p_pads, mut p_world, mut p_rank, mut p_channel) =
            (k.pads.device_ptr_raw(), self.world as u32, self.rank as u32, channel as u32);
        let (mut p_peer, mut p_mode, mut p_timeout, mut p_status) =
            (peer.map_or(u32::MAX, |s| s as u32), mode, timeout_ns, status);
        let mut params: [*mut std::ffi::c_void; 8] = [
            (&mut p_pads as *mut u64).cast(),
            (&mut p_world as *mut u32).cast(),
            (&mut p_rank as *mut u32).cast(),
            (&mut p_channel as *mut u32).cast(),
            (&mut p_peer as *mut u32).cast(),
            (&mut p_mode as *mut u32).cast(),
            (&mut p_timeout as *mut u64).cast(),
            (&mut p_status as *mut u64).cast(),
        ];
        // SAFETY: signal_sync takes (const u64* pads, u32 world, u32 rank, u32 channel, u32 peer,
        // u32 mode, u64 timeout_ns, u32* status), the eight parameters above: `pads` holds every
        // rank's pad address (mapped for this device), each with the words `r*CHANNELS +
        // channel` (`channel < CHANNELS`, checked by the callers) it uses; `peer` is a rank other
        // than this one, or u32::MAX; `status` is 0 with no timeout, else `world` u32 of this
        // device alive until the kernel is done (the callers read it back, which waits for it);
        // one block of at least `world` threads.
        unsafe { self.launch(k.signal, 1, (self.world as u32).next_multiple_of(32), stream, &mut params) }
    }

    fn kernels(&self, stream: &Arc<CudaStream>) -> Result<&Kernels> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        self.ctx.bind_to_thread().map_err(Error::cuda)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: out-parameter; a NUL-terminated PTX text.
        cuda("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, KERNELS_PTX.as_ptr().cast()) })?;
        let unload = |e| {
            // SAFETY: the module loaded above, unused, unloaded once.
            let _ = unsafe { sys::cuModuleUnload(module) };
            e
        };
        let func = |name: &std::ffi::CStr| {
            let mut func: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: out-parameter, the module just loaded, a NUL-terminated name.
            cuda("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut func, module, name.as_ptr()) })
                .map(|()| func as usize)
        };
        let one_shot = func(c"one_shot_sync_f32").map_err(unload)?;
        let push = func(c"one_shot_push_f32").map_err(unload)?;
        let two_shot = func(c"two_shot_sync_f32").map_err(unload)?;
        let signal = func(c"signal_sync").map_err(unload)?;
        let alloc = mempool::Allocator::cuda(self.ctx.ordinal()).map_err(|e| unload(e.into()))?;
        let mut ptrs = alloc.alloc::<u64>(self.world).map_err(|e| unload(e.into()))?;
        stream.memcpy_htod(&self.bases, &mut ptrs).map_err(|e| unload(Error::cuda(e)))?;
        let mut pads = alloc.alloc::<u64>(self.world).map_err(|e| unload(e.into()))?;
        stream.memcpy_htod(&self.signal_pad_ptrs(), &mut pads).map_err(|e| unload(Error::cuda(e)))?;
        stream.synchronize().map_err(|e| unload(Error::cuda(e)))?;
        let made = Kernels { module: module as usize, one_shot, push, two_shot, signal, ptrs, pads };
        if let Err(lost) = self.kernels.set(made) {
            // Another thread made them meanwhile: these go.
            // SAFETY: the module this call loaded, never launched from, unloaded once.
            let _ = unsafe { sys::cuModuleUnload(lost.module as sys::CUmodule) };
        }
        Ok(self.kernels.get().expect("set above"))
    }

    /// Launches `func` on `stream` with `params` (pointers to its parameters, in order).
    ///
    /// # Safety
    /// `func` is one of `self`'s kernels, `params` its parameters (each pointer to a value of
    /// the parameter's type, alive for the call), whose addresses the kernel may use as it does.
    unsafe fn launch(
        &self,
        func: usize,
        blocks: u32,
        threads: u32,
        stream: &CudaStream,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        self.ctx.bind_to_thread().map_err(Error::cuda)?;
        // SAFETY: passed on from the caller; a live stream of this context.
        cuda("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                func as sys::CUfunction,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream.cu_stream(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Threads per block of the kernels: at least one per rank (their barriers).
    fn threads(&self) -> u32 {
        512u32.max((self.world as u32).next_multiple_of(32))
    }

    /// This rank's receive slots of the one-shot (address, bytes; 0 bytes above [`PUSH_MAX`],
    /// and for types other than `f32`): every byte of them is 0xff when every rank's one-shot
    /// calls are done (a peer one call ahead may already have pushed into them). For tests.
    #[doc(hidden)]
    pub fn receive_slots(&self) -> (u64, usize) {
        (self.bases[self.rank] + (self.data_bytes + pad_bytes(self.world)) as u64, self.recv)
    }

    /// Rank `rank`'s data as a cudarc slice on `stream` (copies use the copy engines). Ordering
    /// with the owner's writes is the program's (signals, barriers).
    pub fn peer<'a>(&'a self, rank: usize, stream: &Arc<CudaStream>) -> Result<PeerSlice<'a, T>> {
        self.check(rank, 0, stream)?;
        Ok(PeerSlice { ptr: self.bases[rank], len: self.len, stream: stream.clone(), _owner: PhantomData })
    }
}

impl SymmMemory<f32> {
    /// A two-shot all-reduce (sum) of every rank's data, in place (collective: every rank calls
    /// it, each on a stream of its device; afterwards every rank's data holds the sums). One
    /// kernel launch: a barrier (every rank's data written by its stream's earlier work); each
    /// rank sums its own chunk of the elements (a `1/world_size` share) over every rank's data
    /// and writes the sums into its own data; a barrier (with release and acquire semantics:
    /// those sums are visible to every rank); each rank copies every other rank's chunk of sums
    /// into its own data; a barrier (no rank writes again before everyone read its chunk). It
    /// moves `2 (n−1)/n` of the data over the links, as a ring does, where the one-shot moves
    /// `n−1` times it: the larger sizes' choice. Sums are added in rank order, so every rank
    /// gets the same bits.
    pub fn two_shot_all_reduce_in_place(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.check(self.rank, 0, stream)?;
        if self.world > 1024 {
            return Err(Error::Symmetric("the two-shot kernel serves at most 1,024 ranks".into()));
        }
        let k = self.kernels(stream)?;
        let v = self.len as u64 / 4;
        let cv = v.div_ceil(self.world as u64);
        let threads = self.threads();
        let blocks = ((cv as usize).div_ceil(threads as usize) as u32).clamp(1, KERNEL_BLOCKS as u32);
        let (mut p_ptrs, mut p_pads, mut p_world, mut p_rank, mut p_base, mut p_v, mut p_cv, mut p_tail) = (
            k.ptrs.device_ptr_raw(),
            k.pads.device_ptr_raw(),
            self.world as u32,
            self.rank as u32,
            (2 * self.world * CHANNELS) as u32,
            v,
            cv,
            self.len as u64 % 4,
        );
        let mut params: [*mut std::ffi::c_void; 8] = [
            (&mut p_ptrs as *mut u64).cast(),
            (&mut p_pads as *mut u64).cast(),
            (&mut p_world as *mut u32).cast(),
            (&mut p_rank as *mut u32).cast(),
            (&mut p_base as *mut u32).cast(),
            (&mut p_v as *mut u64).cast(),
            (&mut p_cv as *mut u64).cast(),
            (&mut p_tail as *mut u64).cast(),
        ];
        // SAFETY: two_shot_sync_f32 takes (const u64* ptrs, const u64* pads, u32 world, u32 rank,
        // u32 base, u64 v, u64 cv, u64 tail), the eight parameters above: `ptrs` holds `world`
        // addresses, each the start of a mapping (16-byte aligned) of `len = 4v + tail` floats
        // this device may read and write (the peer mappings, alive with `self`; every rank
        // writes only its own data, and reads another rank's chunk only between the barriers
        // that order it); `pads` each rank's pad, with the words `base + r*KERNEL_SLOTS + b +
        // {0, 64, 128}` (and their counts taken, `world*KERNEL_SLOTS` after) the kernel uses
        // for `b < blocks <= KERNEL_BLOCKS`; `tail < 4`;
        // `threads >= world`.
        unsafe { self.launch(k.two_shot, blocks, threads, stream, &mut params) }
    }

    /// A one-shot all-reduce (sum) of every rank's data into `out` on this rank (collective:
    /// every rank calls it, each on a stream of its device, the calls of one allocation in the
    /// same order on every rank): one kernel launch, which takes each rank's data as its
    /// stream's earlier work left it, sums every rank's in rank order (so every rank gets the
    /// same bits) and writes the sums; when the call's work is done, this rank may write its data
    /// again. Two ways, by size:
    /// - data of at most [`PUSH_MAX`] bytes: each rank pushes its data into receive slots of
    ///   every peer (memory of the allocation, after the pad) and waits for the peers' there,
    ///   with no barrier (the data is its own signal, as in TensorRT-LLM's "Lamport" kernels); a
    ///   NaN input with every bit set is read as the canonical NaN (its sum is NaN either way);
    /// - larger: a barrier, every rank reads every rank's data through the peer mappings, a
    ///   barrier again (no rank writes its data before everyone read it), as PyTorch's one-shot
    ///   does; the barriers are inside the kernel (signal words of their own in the pads).
    ///
    /// It is not a barrier: when this rank's call is done, a peer may still be summing (its
    /// `out` not written yet). A rank's calls must run one after the other (one stream, or
    /// streams ordered by events; from several threads onto one stream, or replayed from a CUDA
    /// graph, is fine), as for any collective: calls of one rank running at once on two
    /// streams pair wrongly with the peers' and may wait forever.
    ///
    /// `out` must hold at least [`len`](Self::len) elements, on this rank's device, outside this
    /// rank's own symmetric memory (the other ranks may read it meanwhile). Its length is its
    /// `DeviceSlice::len`, trusted as cudarc's own copies and this crate's collectives trust it
    /// (a type of yours that implements the trait must report its memory truly). An `out` refused for
    /// any of these still takes part (its data sent, the barriers or slots kept in step), so the
    /// other ranks get their sums, and this rank gets the error. (A call refused before that, a
    /// stream of another device, leaves the other ranks waiting in their kernels, as a
    /// collective any rank leaves does.)
    pub fn one_shot_all_reduce<O>(&self, out: &mut O, stream: &Arc<CudaStream>) -> Result<()>
    where
        O: DevicePtrMut<f32> + DeviceSlice<f32>,
    {
        self.check(self.rank, 0, stream)?;
        if self.world > 1024 {
            return Err(Error::Symmetric("the one-shot kernel serves at most 1,024 ranks".into()));
        }
        let k = self.kernels(stream)?;
        self.ctx.bind_to_thread().map_err(Error::cuda)?;
        let len = out.len();
        // An `out` of another context is refused before cudarc is asked for its address (which
        // would order it with this stream through events of two contexts, an error cudarc then
        // keeps in this context).
        let theirs = out.stream().context();
        let foreign = (theirs.cu_ctx() != self.ctx.cu_ctx()).then(|| Error::WrongDevice {
            what: "one_shot_all_reduce's output",
            expected: self.ctx.ordinal(),
            found: theirs.ordinal(),
        });
        let (out_ptr, _sync) = match foreign {
            Some(_) => (0, None),
            None => {
                let (p, sync) = out.device_ptr_mut(stream);
                (p, Some(sync))
            }
        };
        // An `out` this rank refuses still takes part in the kernel's barriers (the other ranks
        // wait in them for every rank): the kernel runs with nothing to write, then the error.
        let refused = foreign.or_else(|| self.out_refused(out_ptr, len));
        let (p_out, n) = if refused.is_some() { (0, 0) } else { (out_ptr, self.len as u64) };
        if self.recv > 0 {
            self.launch_push(k, p_out, n, stream)?;
            return refused.map_or(Ok(()), Err);
        }
        // Written once by a copy that completed (`kernels` synchronises it): raw addresses, no
        // ordering with their own stream needed.
        let (ptrs, pads) = (k.ptrs.device_ptr_raw(), k.pads.device_ptr_raw());
        // Four elements at a time where every address is 16-byte aligned (the ranks' data
        // always is: each starts a mapping), the rest one at a time.
        let n4 = if p_out % 16 == 0 { n / 4 } else { 0 };
        let (mut p_ptrs, mut p_pads, mut p_world, mut p_rank, mut p_base, mut p_out, mut p_n, mut p_n4) =
            (ptrs, pads, self.world as u32, self.rank as u32, (2 * self.world * CHANNELS) as u32, p_out, n, n4);
        let mut params: [*mut std::ffi::c_void; 8] = [
            (&mut p_ptrs as *mut u64).cast(),
            (&mut p_pads as *mut u64).cast(),
            (&mut p_world as *mut u32).cast(),
            (&mut p_rank as *mut u32).cast(),
            (&mut p_base as *mut u32).cast(),
            (&mut p_out as *mut u64).cast(),
            (&mut p_n as *mut u64).cast(),
            (&mut p_n4 as *mut u64).cast(),
        ];
        let threads = self.threads();
        // From the length alone: the barriers pair block `b` of every rank, so every rank
        // launches the same grid whatever its `out` (aligned or not, refused or not).
        let blocks = (self.len.div_ceil(4).div_ceil(threads as usize) as u32).clamp(1, KERNEL_BLOCKS as u32);
        // SAFETY: one_shot_sync_f32 takes (const u64* ptrs, const u64* pads, u32 world, u32 rank,
        // u32 base, float* out, u64 n, u64 n4), the eight parameters above: `ptrs` holds `world`
        // addresses, each the start of a mapping (so 16-byte aligned) of `len` floats this
        // device may read (the peer mappings, alive with `self`), and `pads` each rank's pad,
        // whose words `base + r*KERNEL_SLOTS + b + {0, 64}` (and their counts taken,
        // `world*KERNEL_SLOTS` after) the kernel uses exist for `b < blocks <= KERNEL_BLOCKS`;
        // with `n > 0`, `out` holds at least `n` floats of this device, none of this rank's
        // symmetric memory (checked by `out_refused`; borrowed until `_sync` goes, after the
        // launch), 16-byte aligned when `n4 > 0`, and `4 * n4 <= n`; with `n == 0` it is not
        // touched; `threads >= world`.
        unsafe { self.launch(k.one_shot, blocks, threads, stream, &mut params) }?;
        refused.map_or(Ok(()), Err)
    }

    /// The one-shot of data with receive slots: pushes this rank's data into its slot of every
    /// peer's receive set for this call's parity, waits for every peer's in its own, sums, and
    /// writes `n` sums to `out` (none with `n == 0`: a refused `out`, which still pushes and
    /// takes, so the other ranks get their sums and the slots stay in step).
    fn launch_push(&self, k: &Kernels, out: u64, n: u64, stream: &Arc<CudaStream>) -> Result<()> {
        let slot = self.data_bytes as u64;
        let recv = (self.data_bytes + pad_bytes(self.world)) as u64;
        let calls = self.bases[self.rank] + (self.data_bytes + calls_offset(self.world)) as u64;
        let (mut p_ptrs, mut p_world, mut p_rank, mut p_recv, mut p_slot, mut p_out, mut p_n, mut p_nv, mut p_aligned) = (
            k.ptrs.device_ptr_raw(),
            self.world as u32,
            self.rank as u32,
            recv,
            slot,
            out,
            n,
            self.len.div_ceil(4) as u64,
            u32::from(out % 16 == 0),
        );
        let (mut p_set, mut p_calls) = (self.world as u64 * slot, calls);
        let mut params: [*mut std::ffi::c_void; 11] = [
            (&mut p_ptrs as *mut u64).cast(),
            (&mut p_world as *mut u32).cast(),
            (&mut p_rank as *mut u32).cast(),
            (&mut p_recv as *mut u64).cast(),
            (&mut p_slot as *mut u64).cast(),
            (&mut p_out as *mut u64).cast(),
            (&mut p_n as *mut u64).cast(),
            (&mut p_nv as *mut u64).cast(),
            (&mut p_aligned as *mut u32).cast(),
            (&mut p_set as *mut u64).cast(),
            (&mut p_calls as *mut u64).cast(),
        ];
        let threads = self.threads();
        let blocks = (self.len.div_ceil(4).div_ceil(threads as usize) as u32).clamp(1, KERNEL_BLOCKS as u32);
        // SAFETY: one_shot_push_f32 takes (const u64* ptrs, u32 world, u32 rank, u64 recv, u64
        // slot, float* out, u64 n, u64 nv, u32 aligned, u64 set, u32* calls), the eleven
        // parameters above: `ptrs` holds `world` addresses, each the start of a mapping of
        // `data_bytes + pad + 2 set` bytes this device may read and write (the peer mappings,
        // alive with `self`); the kernel reads `16 nv <= data_bytes` bytes of this rank's data,
        // and writes and reads the `16 nv` bytes at `recv + (c & 1) set + r slot` (`slot =
        // data_bytes`, `set = world slot`) of every mapping, words no other kernel of this crate
        // touches and that hold the empty mark again when every rank's calls are done; `calls`
        // is this rank's `KERNEL_BLOCKS` counts in its own pad (`c` is block `b`'s, `b < blocks
        // <= KERNEL_BLOCKS`), which only this kernel uses; with `out != 0`, `out` holds at
        // least `n` floats of this device, none of this rank's symmetric memory (checked by
        // `out_refused`, borrowed by the caller until after the launch), written 16 bytes at a
        // time only where `aligned` says it is 16-byte aligned; every rank launches the same
        // grid (from the length alone).
        unsafe { self.launch(k.push, blocks, threads, stream, &mut params) }
    }

    /// Why the one-shot cannot write its sums to `len` floats at `out`, if it cannot: too short,
    /// memory of another device (a peer's buffer, or its data through `peer`), memory the driver
    /// does not know, or this rank's own symmetric memory (which the other ranks read
    /// meanwhile).
    fn out_refused(&self, out: u64, len: usize) -> Option<Error> {
        if len < self.len {
            return Some(Error::BufferTooShort { what: "one_shot_all_reduce", needed: self.len, len });
        }
        let mut ordinal: i32 = -1;
        // SAFETY: out-parameter of the attribute's type (an int); any address may be asked about.
        let asked = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                out,
            )
        };
        match usize::try_from(ordinal) {
            Ok(d) if asked == CUresult::CUDA_SUCCESS && d == self.ctx.ordinal() => {}
            Ok(found) if asked == CUresult::CUDA_SUCCESS => {
                return Some(Error::WrongDevice {
                    what: "one_shot_all_reduce's output",
                    expected: self.ctx.ordinal(),
                    found,
                })
            }
            _ => {
                return Some(Error::Symmetric(format!(
                    "one_shot_all_reduce's output ({out:#x}) is not memory the driver knows ({asked:?})"
                )))
            }
        }
        let own = self.bases[self.rank];
        let end = out.saturating_add((self.len * 4) as u64);
        if out < own + self.bytes as u64 && own < end {
            return Some(Error::Symmetric(
                "one_shot_all_reduce's output lies in this rank's own symmetric memory, which the other ranks \
                 read meanwhile"
                    .into(),
            ));
        }
        None
    }
}

impl<T> Drop for SymmMemory<T> {
    fn drop(&mut self) {
        // This device's work on the mappings is done before they go (other ranks' mappings, and
        // so the memory, stay as long as they do).
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            unmap_all(&self.bases, self.bytes);
            if let Some(k) = self.kernels.take() {
                // SAFETY: the module `kernels` loaded, its launches done (synchronised above).
                let _ = unsafe { sys::cuModuleUnload(k.module as sys::CUmodule) };
            }
        }
    }
}

impl<T> SymmMemory<T> {
    /// Registers this rank's allocation (its data and pad: the whole mapping, one physical
    /// allocation) as an NCCL window for symmetric collectives (`ncclCommWindowRegister` with
    /// `NCCL_WIN_COLL_SYMMETRIC`, NCCL 2.27 or newer), so NCCL's collectives run on the same
    /// memory as this allocation's kernels: pass [`peer`](Self::peer)`(rank)` to them.
    /// Collective: every rank calls it with the communicator the allocation was made with and a
    /// stream of its device; the checks (NCCL's version, the communicator's rank, world and
    /// device) are gathered from every rank before any calls NCCL, so all fail together. The
    /// window borrows the allocation mutably, which therefore outlives the registration and is
    /// used only through the window meanwhile (it dereferences to the allocation): when the
    /// window goes, nothing else can be queuing work on the memory.
    ///
    /// ```compile_fail,E0502
    /// # fn f(comm: &mempool_nccl::Communicator, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> mempool_nccl::Result<()> {
    /// let mut symm = mempool_nccl::symm::symm_empty::<f32>(comm, 1024, stream)?;
    /// let window = symm.register_window(comm, stream)?;
    /// symm.barrier(0, stream)?; // error[E0502]: the window borrows `symm` mutably
    /// window.deregister()?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// (Through the window instead, it compiles:)
    ///
    /// ```no_run
    /// # fn f(comm: &mempool_nccl::Communicator, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> mempool_nccl::Result<()> {
    /// let mut symm = mempool_nccl::symm::symm_empty::<f32>(comm, 1024, stream)?;
    /// let window = symm.register_window(comm, stream)?;
    /// window.barrier(0, stream)?;
    /// comm.all_reduce_in_place(&mut window.peer(comm.rank(), stream)?, mempool_nccl::ReduceOp::Sum, stream)?;
    /// window.deregister()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_window<'a>(
        &'a mut self,
        comm: &Communicator,
        stream: &Arc<CudaStream>,
    ) -> Result<SymmWindow<'a, T>> {
        let local = match crate::alloc::nccl_version() {
            Ok(v) if v < (2, 27, 0) => Err(format!("needs NCCL 2.27 or newer; this is {}.{}.{}", v.0, v.1, v.2)),
            Ok(_) if (comm.rank(), comm.world_size(), comm.device()) != (self.rank, self.world, self.ctx.ordinal()) => {
                Err(format!(
                    "the communicator (rank {} of {} on device {}) is not the allocation's (rank {} of {} on device {})",
                    comm.rank(),
                    comm.world_size(),
                    comm.device(),
                    self.rank,
                    self.world,
                    self.ctx.ordinal()
                ))
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        let all = gather(comm, &[u64::from(local.is_ok()), self.bytes as u64], stream)?;
        if let Err(why) = local {
            return Err(Error::Window(format!("rank {}: {why}", self.rank)));
        }
        if let Some(r) = (0..comm.world_size()).find(|&r| all[2 * r] == 0) {
            return Err(Error::Window(format!("rank {r} cannot register its symmetric memory as a window")));
        }
        if (0..comm.world_size()).any(|r| all[2 * r + 1] != self.bytes as u64) {
            return Err(Error::Window("the ranks' symmetric allocations differ in size".into()));
        }
        let handle = comm.handle().clone();
        let win = {
            let guard = handle.lock();
            match guard.as_ref() {
                // SAFETY: `bases[rank]..+bytes` is this rank's own mapping of its physical
                // allocation, for this device, alive as long as `self`, which the window
                // borrows: it is deregistered (or the communicator gone) before the mapping goes.
                Some(ops) => unsafe { ops.window_register(self.bases[self.rank], self.bytes) },
                None => Err(Error::Closed),
            }
        }?;
        Ok(SymmWindow { symm: self, comm: handle, win: Some(win) })
    }
}

/// A rank's symmetric allocation registered as an NCCL window
/// ([`SymmMemory::register_window`]). [`deregister`](Self::deregister) waits for the device's
/// work, then deregisters (local to each rank); dropping it does the same, except that it
/// leaves the window registered (NCCL lets it go with the communicator) when the communicator
/// reports an error or is closed, rather than wait for a collective that cannot end.
pub struct SymmWindow<'a, T> {
    symm: &'a mut SymmMemory<T>,
    comm: Arc<crate::handle::CommHandle>,
    /// `None` once deregistered.
    win: Option<usize>,
}

impl<T> std::fmt::Debug for SymmWindow<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmWindow").field("rank", &self.symm.rank).field("registered", &self.win.is_some()).finish()
    }
}

impl<T> SymmWindow<'_, T> {
    /// Waits for this device's work, then deregisters the window.
    pub fn deregister(mut self) -> Result<()> {
        self.close(false)
    }

    fn close(&mut self, careful: bool) -> Result<()> {
        let Some(win) = self.win.take() else { return Ok(()) };
        {
            let guard = self.comm.lock();
            match guard.as_ref() {
                // Closed: NCCL let the window go with the communicator.
                None => return Ok(()),
                // Broken (a rank gone): left registered rather than wait for work that may
                // never end; NCCL lets it go when the communicator is aborted.
                Some(ops) if careful && ops.async_error().is_err() => return Ok(()),
                Some(_) => {}
            }
        }
        // The device's work first, outside the communicator's lock (another thread may need it
        // to queue its part of a collective that work waits for).
        self.symm.ctx.bind_to_thread().map_err(Error::cuda)?;
        self.symm.ctx.synchronize().map_err(Error::cuda)?;
        let guard = self.comm.lock();
        let Some(ops) = guard.as_ref() else { return Ok(()) };
        // SAFETY: `win` came from `window_register` on this communicator and is deregistered once
        // (taken out above); every operation queued on this device so far is done, and none
        // can be queued on the memory meanwhile: the window holds the only borrow of the
        // allocation, and `self` is being closed (by value, or in `Drop`).
        unsafe { ops.window_deregister(win) }
    }
}

impl<T> std::ops::Deref for SymmWindow<'_, T> {
    type Target = SymmMemory<T>;
    fn deref(&self) -> &SymmMemory<T> {
        self.symm
    }
}

impl<T> Drop for SymmWindow<'_, T> {
    fn drop(&mut self) {
        let _ = self.close(true);
    }
}

/// A rank's data seen from this rank ([`SymmMemory::peer`]), on a stream of this rank's device.
pub struct PeerSlice<'a, T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _owner: PhantomData<&'a SymmMemory<T>>,
}

impl<T> std::fmt::Debug for PeerSlice<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSlice").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

impl<T> PeerSlice<'_, T> {
    fn order<'b>(&'b self, stream: &'b CudaStream) -> SyncOnDrop<'b> {
        if stream.cu_stream() == self.stream.cu_stream() && stream.context() == self.stream.context() {
            return SyncOnDrop::Sync(None);
        }
        if stream.join(&self.stream).is_err() {
            let _ = self.stream.synchronize();
        }
        SyncOnDrop::Sync(Some(stream))
    }
}

impl<T> DeviceSlice<T> for PeerSlice<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for PeerSlice<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.order(stream))
    }
}

impl<T> DevicePtrMut<T> for PeerSlice<'_, T> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.order(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's pad offsets are the constants the host sizes the pads with.
    #[test]
    fn the_kernel_uses_the_pad_layout_of_the_host() {
        assert!(KERNELS_PTX.contains(&format!("mad.lo.u32 %r6, %r2, {KERNEL_SLOTS}, %r3;")));
        assert!(KERNELS_PTX.contains(&format!("mad.lo.u32 %r9, %r4, {KERNEL_SLOTS}, %r3;")));
        assert!(KERNELS_PTX.contains(&format!("add.u32 %r18, %r7, {KERNEL_BLOCKS};")));
        assert!(KERNELS_PTX.contains(&format!("add.u32 %r19, %r10, {KERNEL_BLOCKS};")));
        assert!(KERNELS_PTX.contains(&format!("mad.lo.u32 %r5, %r2, {CHANNELS}, %r3;")));
        assert!(KERNELS_PTX.contains(&format!("mad.lo.u32 %r6, %r4, {CHANNELS}, %r3;")));
        assert_eq!(KERNELS_PTX.matches(&format!(", {KERNEL_SLOTS}, %r3;")).count(), 4, "both kernels' pads");
        assert_eq!(KERNELS_PTX.matches(&format!(", {}, %r3;", 3 * KERNEL_BLOCKS)).count(), 4);
        assert!(KERNELS_PTX.contains(&format!("add.u32 %r19, %r7, {KERNEL_BLOCKS};")));
        assert!(KERNELS_PTX.contains(&format!("add.u32 %r19, %r7, {};", 2 * KERNEL_BLOCKS)));
        // The counts taken sit `world * KERNEL_SLOTS` words after the signals.
        assert_eq!(KERNELS_PTX.matches(&format!("mul.wide.u32 %rd39, %r1, {};", 4 * KERNEL_SLOTS)).count(), 5);
        // Signals are relaxed but the two-shot's middle one, which publishes its sums; none
        // is a store (nothing is cleared: signals are counted).
        assert_eq!(KERNELS_PTX.matches("red.release").count(), 1, "one release signal");
        assert_eq!(KERNELS_PTX.matches("red.relaxed").count(), 5);
        assert!(!KERNELS_PTX.contains("st.relaxed.sys") && !KERNELS_PTX.contains("st.release"));
    }

    /// The push kernel's empty mark is the host's fill byte in every byte of a word, the value
    /// it sends in place of that mark is not the mark, and it writes the mark back after each
    /// take: two volatile vector stores (the push, the emptying) and one volatile load loop.
    #[test]
    fn the_push_kernel_uses_the_hosts_empty_mark() {
        let push =
            &KERNELS_PTX[KERNELS_PTX.find("one_shot_push_f32").unwrap()..KERNELS_PTX.find("signal_sync").unwrap()];
        let mark = u32::from_ne_bytes([EMPTY_BYTE; 4]);
        assert!(push.contains(&format!("mov.u32 %r21, 0x{mark:08X};")));
        assert!(push.contains("mov.u32 %r22, 0x7FC00000;") && 0x7FC0_0000 != mark);
        assert!(f32::from_bits(0x7FC0_0000).is_nan() && f32::from_bits(mark).is_nan());
        assert_eq!(push.matches("st.volatile.global.v4.u32").count(), 2);
        assert!(push.contains("st.volatile.global.v4.u32 [%rd17], {%r21, %r21, %r21, %r21};"));
        assert_eq!(push.matches("ld.volatile.global.v4.u32").count(), 1);
        assert!(!push.contains("red."), "no signal");
        assert_eq!(push.matches("bar.sync").count(), 1, "only before the block's count of calls moves");
        // The count of calls per block: read at the start, one more at the end, in the pad.
        assert!(push.contains("ld.volatile.global.u32 %r23, [%rd24];"));
        assert!(push.contains("st.volatile.global.u32 [%rd24], %r23;"));
    }

    /// Receive slots: two sets of one slot per rank up to `PUSH_MAX` bytes of data, none above;
    /// sizes that would overflow give none rather than wrap.
    #[test]
    fn receive_slots_are_two_sets_up_to_push_max() {
        assert_eq!(receive_bytes(128, 2), 512);
        assert_eq!(receive_bytes(PUSH_MAX, 8), 16 * PUSH_MAX);
        assert_eq!(receive_bytes(PUSH_MAX + 128, 2), 0);
        assert_eq!(receive_bytes(usize::MAX, 2), 0);
        assert_eq!(pad_bytes(2), 2 * 2 * (CHANNELS + KERNEL_SLOTS) * 4 + KERNEL_BLOCKS * 4);
        assert_eq!(calls_offset(3), 3 * 2 * (CHANNELS + KERNEL_SLOTS) * 4);
        // The receive slots after the pad (and after data rounded to 128) stay 16-byte aligned.
        assert!((1..=1024).all(|w| pad_bytes(w) % 16 == 0));
    }
}
