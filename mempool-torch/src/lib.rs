//! # mempool-torch
//!
//! mempool inside PyTorch: this crate builds `libmempool_torch.so`, a library PyTorch loads as its
//! CUDA allocator through `torch.cuda.memory.CUDAPluggableAllocator`, with the two entry points
//! that interface calls for:
//!
//! ```c
//! void* mempool_malloc(ssize_t size, int device, cudaStream_t stream);
//! void  mempool_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
//! ```
//!
//! (and [`mempool_malloc_or_raise`], the same for `change_current_allocator`: out of memory
//! raises PyTorch's error there, where a null would become a tensor at address 0)
//!
//! and a few more for the Python helper (`python/mempool_torch.py`): [`mempool_empty_cache`],
//! [`mempool_memory_stats_json`], [`mempool_reset_peak_stats`], [`mempool_snapshot`]. Behind them are
//! the process-wide CUDA allocators of [`mempool`] (one per device, configured by
//! `MEMPOOL_ALLOC_CONF`): the stream PyTorch passes is made current for the call, so blocks are
//! cached per stream as PyTorch's own allocator caches them.
//!
//! ```python
//! import mempool_torch
//! mempool_torch.use_mempool()          # before the first CUDA tensor: every tensor from mempool
//! pool = mempool_torch.pool()          # or: a torch.cuda.MemPool whose segments come from mempool
//! ```
//!
//! ## What the interface does not pass through
//! PyTorch calls only `malloc` and `free` through this interface: `Tensor.record_stream` does not
//! reach the allocator. A tensor allocated on stream A, used on stream B and freed is reused on
//! stream A at once, as with PyTorch's own allocator when `record_stream` is not called: code that
//! frees tensors used on other streams must synchronize those streams first (an event, or
//! `torch.cuda.current_stream().wait_stream(side)`) before the tensor is dropped.
//!
//! ## Streams
//! A stream PyTorch passes is wrapped once and remembered (PyTorch's stream pools never destroy
//! their streams); a stream of another device or context is refused. The CUDA driver gives a
//! destroyed stream's handle to the next stream created: before destroying a stream of your own
//! (`torch.cuda.Stream()`), synchronize it and call [`mempool_forget_stream`]
//! (`mempool_torch.forget_stream(s)`), so the next stream with that handle gets blocks of its own.
//!
//! Every entry point leaves the thread's current CUDA context as it found it (PyTorch reads the
//! current device from it).
//!
//! ## Errors
//! Nothing unwinds across the C boundary. A failed allocation returns null after its report is
//! printed on stderr once; a free of a pointer this library did not give, a device without a GPU,
//! a negative size: a message on stderr, nothing freed that is not ours.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaStream};
use mempool::{Allocator, Error};

/// One line on stderr. Never `eprintln!`, which panics when stderr is gone (a full disk, a closed
/// pipe): a panic here would have nowhere safe to go.
fn say(args: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "mempool-torch: {args}");
}

/// The allocator of device `device`, created if need be (allocations), or a message.
fn allocator(device: c_int) -> Result<Allocator, String> {
    let d = usize::try_from(device).map_err(|_| format!("device index {device} is negative"))?;
    Allocator::cuda(d).map_err(|e| format!("device {device}: {e}"))
}

/// The allocator of device `device` if it exists: looking and freeing never create a context.
fn existing(device: c_int) -> Option<Allocator> {
    usize::try_from(device).ok().and_then(Allocator::cuda_if_created)
}

/// The thread's current CUDA context on entry, put back on exit: the driver calls behind the
/// allocator bind device contexts, and PyTorch reads its current device from the current
/// context.
struct KeepCurrentContext(Option<sys::CUcontext>);

impl KeepCurrentContext {
    fn save() -> KeepCurrentContext {
        static DRIVER: OnceLock<bool> = OnceLock::new();
        // SAFETY: only tries to open the driver library (once: it dlopens each time).
        if !*DRIVER.get_or_init(|| unsafe { sys::is_culib_present() }) {
            return KeepCurrentContext(None);
        }
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `c` is a valid out pointer; an uninitialized driver answers with an error.
        let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
        KeepCurrentContext((r == sys::CUresult::CUDA_SUCCESS).then_some(c))
    }
}

impl Drop for KeepCurrentContext {
    fn drop(&mut self) {
        let Some(saved) = self.0 else { return };
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `now` is a valid out pointer; `saved` was the current context on entry (or
        // null: none), which its owner keeps alive across this call.
        unsafe {
            if sys::cuCtxGetCurrent(&mut now) == sys::CUresult::CUDA_SUCCESS && now != saved {
                let _ = sys::cuCtxSetCurrent(saved);
            }
        }
    }
}

/// Bumped by [`mempool_forget_stream`]: every thread's remembered stream is stale then.
static STREAM_GEN: AtomicU64 = AtomicU64::new(0);

type Streams = Mutex<HashMap<(c_int, usize), Arc<CudaStream>>>;

fn streams() -> std::sync::MutexGuard<'static, HashMap<(c_int, usize), Arc<CudaStream>>> {
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    STREAMS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
}

/// The last stream a thread used: (device, handle, generation, wrapper).
type Remembered = (c_int, usize, u64, Arc<CudaStream>);

/// The wrapper of a stream PyTorch passed, made once per (device, handle) and kept: the wrapper's
/// identity is the stream's key in the allocator, so the same handle must give the same wrapper
/// until it is forgotten. The last one used on this thread is found without a lock. A stream of
/// another context than `device`'s primary one is refused.
fn stream_for(alloc: &Allocator, device: c_int, raw: usize) -> Result<Arc<CudaStream>, String> {
    thread_local! {
        static LAST: RefCell<Option<Remembered>> = const { RefCell::new(None) };
    }
    let gen = STREAM_GEN.load(Ordering::Acquire);
    let hit = LAST
        .try_with(|l| l.borrow().as_ref().filter(|x| x.0 == device && x.1 == raw && x.2 == gen).map(|x| x.3.clone()))
        .ok()
        .flatten();
    if let Some(s) = hit {
        return Ok(s);
    }
    // 0: the legacy default stream; 1, 2: the legacy and per-thread handles (per context).
    if raw > 2 {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: PyTorch passes a live stream handle (the entry points' contract); `c` is a valid
        // out pointer.
        let r = unsafe { sys::cuStreamGetCtx(raw as sys::CUstream, &mut c) };
        if r != sys::CUresult::CUDA_SUCCESS || c != alloc.context().cu_ctx() {
            return Err(format!(
                "stream {raw:#x} does not belong to device {device}'s primary context ({r:?}); refused"
            ));
        }
    }
    let s = streams()
        .entry((device, raw))
        .or_insert_with(|| {
            // SAFETY: `raw` is a live stream of `device`'s primary context (checked above; 0 to 2
            // are the context's own default handles), kept alive by PyTorch while the library
            // holds memory of it (the entry points' contract; `mempool_forget_stream` before a
            // stream is destroyed). The wrapper never destroys it; work ordering is PyTorch's.
            unsafe { alloc.context().wrap_borrowed_stream(raw as sys::CUstream) }
        })
        .clone();
    let _ = LAST.try_with(|l| *l.borrow_mut() = Some((device, raw, gen, s.clone())));
    Ok(s)
}

/// Runs `f` with the current context kept, turning a panic into a message: nothing unwinds
/// into C.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    let _keep = KeepCurrentContext::save();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            std::mem::forget(p);
            say(format_args!("{what} panicked: {msg}"));
            fallback
        }
    }
}

/// Why an allocation failed: out of memory, or anything else.
enum Failed {
    OutOfMemory(String),
    Other(String),
}

impl Failed {
    fn text(&self) -> &str {
        match self {
            Failed::OutOfMemory(m) | Failed::Other(m) => m,
        }
    }
}

/// `size` bytes on `device` for work on `stream` (null: the legacy default stream).
fn malloc(size: isize, device: c_int, stream: usize) -> Result<u64, Failed> {
    let size = usize::try_from(size).map_err(|_| Failed::Other(format!("mempool_malloc: negative size {size}")))?;
    if size == 0 {
        return Ok(0);
    }
    let alloc = allocator(device).map_err(Failed::Other)?;
    let s = stream_for(&alloc, device, stream).map_err(Failed::Other)?;
    let _current = alloc.set_stream(&s).map_err(|e| Failed::Other(e.to_string()))?;
    alloc.alloc_bytes(size).map_err(|e| match e {
        Error::OutOfMemory(r) => Failed::OutOfMemory(format!("out of memory on device {device}:\n{r}")),
        e => Failed::Other(format!("mempool_malloc({size}, device {device}): {e}")),
    })
}

/// PyTorch's allocation function: `size` bytes on `device`, ordered on `stream`. Null when there
/// is no memory (the report is printed on stderr first) or for 0 bytes.
///
/// # Safety
/// `stream` is null or a live CUDA stream of `device`'s primary context that stays alive while
/// the library holds memory of it (PyTorch's streams do; see [`mempool_forget_stream`]).
#[no_mangle]
pub unsafe extern "C" fn mempool_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded("mempool_malloc", std::ptr::null_mut(), || match malloc(size, device, stream as usize) {
        Ok(p) => p as *mut c_void,
        Err(f) => {
            say(format_args!("{}", f.text()));
            std::ptr::null_mut()
        }
    })
}

/// Like [`mempool_malloc`], for `use_mempool()`: a failure raises PyTorch's error instead of
/// returning null. PyTorch (2.11) does not check what its pluggable allocator returns for a
/// tensor: a null would become a tensor at address 0. So the report is thrown as a C++
/// `c10::Error` (through libc10's own `torchCheckFail`), which PyTorch turns into a Python
/// `RuntimeError`, whose message starts with `CUDA out of memory` when memory ran out; outside
/// PyTorch (no libc10 loaded) it returns null. `mempool_malloc` stays the one for
/// `torch.cuda.MemPool(...)`, whose caller handles a null (PyTorch frees its cached blocks,
/// retries, then raises `torch.OutOfMemoryError`).
///
/// # Safety
/// As [`mempool_malloc`]; and the caller is C++ code that lets a C++ exception pass (PyTorch's
/// allocator does).
#[no_mangle]
pub unsafe extern "C-unwind" fn mempool_malloc_or_raise(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let r = guarded("mempool_malloc", Err(Failed::Other("mempool_malloc panicked".into())), || {
        malloc(size, device, stream as usize)
    });
    let text = match r {
        Ok(p) => return p as *mut c_void,
        Err(Failed::OutOfMemory(m)) => format!("CUDA out of memory (mempool): {m}"),
        Err(Failed::Other(m)) => format!("mempool: {m}"),
    };
    // The current context was put back by `guarded`; every lock and guard of this library is
    // released: only this frame is left, owning `text` and its C copy. The report goes out once:
    // in the exception, or on stderr without one.
    let Some(throw) = torch_check_fail() else {
        say(format_args!("{text}"));
        return std::ptr::null_mut();
    };
    let c_text = std::ffi::CString::new(text.replace('\0', " ")).unwrap_or_default();
    drop(text);
    // SAFETY: `throw` is libc10's `c10::detail::torchCheckFail(const char*, const char*, uint32_t,
    // const char*)`, found by its mangled name in the loaded libc10; it copies its arguments into
    // a `c10::Error` and throws it. The exception unwinds through this "C-unwind" frame (Rust
    // runs its drops then: `c_text` is freed) into PyTorch's C++ caller.
    unsafe { throw(c"mempool_malloc".as_ptr(), c"mempool-torch/src/lib.rs".as_ptr(), line!(), c_text.as_ptr()) }
}

type Thrower = unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char) -> !;

/// libc10's `torchCheckFail` with C-string arguments, if libc10 is loaded in this process. Only a
/// found address is remembered (libc10 may be loaded after a first failure).
fn torch_check_fail() -> Option<Thrower> {
    extern "C" {
        fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
    }
    const RTLD_LAZY: c_int = 0x1;
    const RTLD_NOLOAD: c_int = 0x4;
    static FOUND: AtomicUsize = AtomicUsize::new(0);
    let mut f = FOUND.load(Ordering::Acquire);
    if f == 0 {
        // SAFETY: `RTLD_NOLOAD` only looks the library up among those already loaded (PyTorch
        // loads libc10.so); dlsym reads the symbol table of that handle.
        f = unsafe {
            let h = dlopen(c"libc10.so".as_ptr(), RTLD_LAZY | RTLD_NOLOAD);
            if h.is_null() {
                0
            } else {
                dlsym(h, c"_ZN3c106detail14torchCheckFailEPKcS2_jS2_".as_ptr()) as usize
            }
        };
        FOUND.store(f, Ordering::Release);
    }
    // SAFETY: a non-zero address is that function, whose C++ signature matches the pointer type
    // (two C strings, an unsigned int, a C string; it never returns, it throws).
    (f != 0).then(|| unsafe { std::mem::transmute::<usize, Thrower>(f) })
}

/// PyTorch's free function: gives back `ptr` from [`mempool_malloc`]. A pointer this library did
/// not give (or gave and took back) is reported on stderr and left alone; null is ignored. A
/// pointer of another device than `device` is found and freed there.
///
/// # Safety
/// Nothing uses the memory after this call except work already queued on the stream it was
/// allocated for (PyTorch frees a tensor's memory when its last reference goes; other streams
/// that used it must have been synchronized, see the crate docs on `record_stream`).
#[no_mangle]
pub unsafe extern "C" fn mempool_free(ptr: *mut c_void, size: isize, device: c_int, _stream: *mut c_void) {
    guarded("mempool_free", (), || {
        if ptr.is_null() {
            return;
        }
        let p = ptr as u64;
        if existing(device).is_some_and(|a| a.free_bytes(p).is_ok()) {
            return;
        }
        // Not this device's (or it has no allocator): the one that gave it, if any.
        let n = mempool::device_count().unwrap_or(0);
        for d in (0..n).filter(|&d| d as c_int != device) {
            if Allocator::cuda_if_created(d).is_some_and(|a| a.free_bytes(p).is_ok()) {
                say(format_args!("mempool_free({ptr:p}): passed device {device}, but it is device {d}'s; freed there"));
                return;
            }
        }
        say(format_args!(
            "mempool_free({ptr:p}, {size} bytes, device {device}): not a live allocation of this library; nothing was freed"
        ));
    })
}

/// Forgets the wrapper of `stream` of `device`: call it after synchronizing a stream of your own
/// and before destroying it, so a new stream that gets the same handle gets blocks of its own.
/// Blocks cached for the old stream stay with it (wholly free segments go at `empty_cache`).
#[no_mangle]
pub extern "C" fn mempool_forget_stream(device: c_int, stream: *mut c_void) {
    guarded("mempool_forget_stream", (), || {
        streams().remove(&(device, stream as usize));
        STREAM_GEN.fetch_add(1, Ordering::AcqRel);
    })
}

/// Gives every wholly free cached segment of every device that has an allocator back to the
/// driver (`torch.cuda.empty_cache()`). Returns 0, or -1 with the reason on stderr.
#[no_mangle]
pub extern "C" fn mempool_empty_cache() -> c_int {
    guarded("mempool_empty_cache", -1, || {
        // Only the devices that have an allocator (`mempool::empty_cache` makes none).
        match mempool::empty_cache() {
            Ok(()) => 0,
            Err(e) => {
                say(format_args!("empty_cache: {e}"));
                -1
            }
        }
    })
}

/// `device`'s statistics as a JSON object with PyTorch's keys (`allocated_bytes.all.current`,
/// ...; all zero for a device mempool has not used), written into `buf` (`len` bytes,
/// NUL-terminated if it fits). Returns the length the JSON needs without the NUL (call again
/// with a larger buffer if that is `>= len`), or -1 with the reason on stderr.
///
/// # Safety
/// `buf` is null (then `len` must be 0) or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mempool_memory_stats_json(device: c_int, buf: *mut c_char, len: usize) -> isize {
    guarded("mempool_memory_stats_json", -1, || {
        if device < 0 {
            say(format_args!("memory_stats: device index {device} is negative"));
            return -1;
        }
        let stats = existing(device).map(|a| a.memory_stats()).unwrap_or_default();
        let json = stats_json(&stats.as_map());
        let bytes = json.as_bytes();
        if !buf.is_null() && len > bytes.len() {
            // SAFETY: the caller promises `buf` is valid for `len` bytes, and `len` exceeds the
            // JSON's length, so the copy and the NUL after it fit.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, bytes.len());
                *buf.add(bytes.len()) = 0;
            }
        }
        bytes.len() as isize
    })
}

/// A flat JSON object of the statistics.
pub fn stats_json(map: &std::collections::BTreeMap<String, i64>) -> String {
    let body: Vec<String> =
        map.iter().map(|(k, v)| format!("\"{}\": {v}", k.replace('\\', "\\\\").replace('"', "\\\""))).collect();
    format!("{{{}}}", body.join(", "))
}

/// Resets `device`'s peak statistics (`torch.cuda.reset_peak_memory_stats`). 0, or -1.
#[no_mangle]
pub extern "C" fn mempool_reset_peak_stats(device: c_int) -> c_int {
    guarded("mempool_reset_peak_stats", -1, || {
        if device < 0 {
            say(format_args!("reset_peak_stats: device index {device} is negative"));
            return -1;
        }
        if let Some(a) = existing(device) {
            a.reset_peak_stats();
        }
        0
    })
}

/// Writes `device`'s snapshot to `path` in PyTorch's pickle format (what
/// `torch.cuda.memory._snapshot()` gives; pytorch.org/memory_viz reads it). 0, or -1 with the
/// reason on stderr.
///
/// # Safety
/// `path` is a NUL-terminated string (any bytes: a Linux path).
#[no_mangle]
pub unsafe extern "C" fn mempool_snapshot(device: c_int, path: *const c_char) -> c_int {
    guarded("mempool_snapshot", -1, || {
        if path.is_null() {
            say(format_args!("snapshot: null path"));
            return -1;
        }
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: the caller promises a NUL-terminated string.
        let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
        let p = std::path::Path::new(std::ffi::OsStr::from_bytes(bytes));
        let r = allocator(device).and_then(|a| a.snapshot().write_pickle(p).map_err(|e| e.to_string()));
        match r {
            Ok(()) => 0,
            Err(m) => {
                say(format_args!("snapshot to {}: {m}", p.display()));
                -1
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_json_is_a_flat_object() {
        let m = std::collections::BTreeMap::from([("a.b".to_string(), 3i64), ("q\"x".to_string(), -1)]);
        assert_eq!(stats_json(&m), "{\"a.b\": 3, \"q\\\"x\": -1}");
    }

    #[test]
    fn bad_input_is_refused_without_a_crash() {
        // SAFETY: null streams and pointers are allowed.
        unsafe {
            assert!(mempool_malloc(-5, 0, std::ptr::null_mut()).is_null());
            assert!(mempool_malloc(0, 0, std::ptr::null_mut()).is_null());
            // No GPU here (CI), or device 4096 on a GPU machine: null, with a message.
            assert!(mempool_malloc(1024, 4096, std::ptr::null_mut()).is_null());
            assert!(mempool_malloc(1024, -1, std::ptr::null_mut()).is_null());
            mempool_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
            mempool_free(0x1234 as *mut c_void, 16, 4096, std::ptr::null_mut());
            assert_eq!(mempool_snapshot(0, std::ptr::null()), -1);
        }
        assert_eq!(mempool_reset_peak_stats(-3), -1);
        // SAFETY: null buffer with length 0.
        assert_eq!(unsafe { mempool_memory_stats_json(-3, std::ptr::null_mut(), 0) }, -1);
    }

    /// Child of the next test: every call here reports on stderr, which the parent points at
    /// /dev/full (every write fails).
    #[test]
    #[ignore = "run by a_failing_stderr_does_not_abort_the_process"]
    fn child_reports_with_broken_stderr() {
        // SAFETY: null streams; the pointer is never dereferenced.
        unsafe {
            assert!(mempool_malloc(1024, -1, std::ptr::null_mut()).is_null());
            mempool_free(0x1234 as *mut c_void, 16, -1, std::ptr::null_mut());
            assert!(mempool_malloc(-4, 0, std::ptr::null_mut()).is_null());
        }
        println!("CHILD-SURVIVED");
    }

    /// A failed write to stderr (a full disk, a closed pipe) is not a panic across the C
    /// boundary (it aborted the process before).
    #[test]
    fn a_failing_stderr_does_not_abort_the_process() {
        let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else { return };
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::child_reports_with_broken_stderr",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .stderr(full)
            .output()
            .unwrap();
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && so.contains("CHILD-SURVIVED"), "child died: {:?}\n{so}", out.status);
    }
}
