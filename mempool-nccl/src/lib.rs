//! # mempool-nccl
//!
//! NCCL for [mempool]: pools backed by `ncclMemAlloc` whose segments are registered with NCCL
//! communicators (and deregistered before they are freed), so that collectives on them run
//! zero-copy and, on NVSwitch machines where NCCL chooses it, as NVLS reductions.
//!
//! ```no_run
//! use mempool::with_pool;
//! use mempool_nccl::{nccl_pool, Communicator, ReduceOp};
//!
//! let comm = Communicator::from_env()?;              // RANK/WORLD_SIZE/LOCAL_RANK, MASTER_ADDR/PORT
//! let pool = nccl_pool(comm.device())?;
//! let _registration = comm.register_pool(&pool)?;    // existing and future segments
//! let alloc = mempool::Allocator::cuda(comm.device())?;
//! let stream = alloc.current_stream();
//! let mut grads = pool.alloc::<f32>(1 << 20)?;       // or inside #[with_pool(pool)]
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream)?;
//! comm.destroy()?;                                   // the orderly end, on every rank (a drop aborts)
//! # Ok::<(), mempool_nccl::Error>(())
//! ```
//!
//! | module | what |
//! | --- | --- |
//! | [`alloc`] | [`NcclMemAllocator`], [`nccl_pool`]: `ncclMemAlloc` segments, never freed while NCCL holds them |
//! | [`types`] | [`NcclType`], [`Bf16`], [`ReduceOp`] |
//! | [`comm`] | [`Communicator`], [`Id`], collectives; how a communicator ends |
//! | [`window`] | [`Window`]: a buffer registered for symmetric collectives, borrowed while registered |
//! | [`symm`] | [`symm::SymmMemory`]: one allocation per rank mapped into every rank, signal pads, peer slices |
//! | [`register`] | [`Registration`], [`Registrar`]: segments registered as a pool grows and shrinks |
//! | [`env`](mod@env) | [`LaunchEnv`]: rank, world size and bootstrap address from torchrun, srun or mpirun |
//!
//! Dependencies point one way: `comm` and `window` use `register` (a communicator owns links to
//! its registrations and supplies their [`Registrar`]); `register` knows no communicator.
//!
//! NVLink multicast (NVLS) is never forced on: NCCL picks it where the machine and
//! `NCCL_NVLS_ENABLE` allow.

pub mod alloc;
pub mod comm;
pub mod env;
pub mod error;
mod handle;
mod ledger;
pub mod register;
pub mod symm;
pub mod types;
pub mod window;

pub use alloc::{nccl_pool, nccl_pool_with, nccl_registers_spans, nccl_version, NcclMapGuard, NcclMemAllocator};
pub use comm::{Communicator, Id};
pub use env::LaunchEnv;
pub use error::{Error, NcclCode, Result};
pub use register::{Registrar, Registration};
pub use types::{Bf16, NcclType, ReduceOp};
pub use window::Window;

/// The workspace README's examples, compiled as doctests here, where both crates are in reach.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
