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
//! A stream PyTorch passes is wrapped once and remembered for the life of the process (PyTorch's
//! stream pools never destroy their streams). A stream created with `torch.cuda.Stream()` and then
//! destroyed must not have blocks cached for it when its handle is reused by a new stream: call
//! [`mempool_empty_cache`] (`mempool_torch.empty_cache()`) after dropping such a stream.
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
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaStream};
use mempool::{Allocator, Error};

/// The allocator of device `device`, or a message for stderr.
fn allocator(device: c_int) -> Result<Allocator, String> {
    let d = usize::try_from(device).map_err(|_| format!("device index {device} is negative"))?;
    Allocator::cuda(d).map_err(|e| format!("device {device}: {e}"))
}

/// The wrapper of a stream PyTorch passed, made once per (device, handle) and kept: the wrapper's
/// identity is the stream's key in the allocator, so the same handle must always give the same
/// wrapper. The last one used on this thread is found without a lock.
fn stream_for(alloc: &Allocator, device: c_int, raw: usize) -> Arc<CudaStream> {
    thread_local! {
        static LAST: RefCell<Option<(c_int, usize, Arc<CudaStream>)>> = const { RefCell::new(None) };
    }
    let hit = LAST.with(|l| l.borrow().as_ref().filter(|x| x.0 == device && x.1 == raw).map(|x| x.2.clone()));
    if let Some(s) = hit {
        return s;
    }
    type Streams = Mutex<HashMap<(c_int, usize), Arc<CudaStream>>>;
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    let s = {
        let mut m = STREAMS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        m.entry((device, raw))
            .or_insert_with(|| {
                // SAFETY: PyTorch passes a live stream of `device`'s primary context (the one
                // cudarc's context for that device retains), and keeps its streams for the life
                // of the process (see the crate docs for streams users destroy). The wrapper
                // never destroys it; work ordering is PyTorch's, as the interface defines.
                unsafe { alloc.context().wrap_borrowed_stream(raw as sys::CUstream) }
            })
            .clone()
    };
    let _ = LAST.try_with(|l| *l.borrow_mut() = Some((device, raw, s.clone())));
    s
}

/// Runs `f`, turning a panic into a message: nothing unwinds into C.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            std::mem::forget(p);
            eprintln!("mempool-torch: {what} panicked: {msg}");
            fallback
        }
    }
}

/// `size` bytes on `device` for work on `stream` (null: the legacy default stream), or 0 with the
/// reason.
fn malloc(size: isize, device: c_int, stream: usize) -> Result<u64, String> {
    let size = usize::try_from(size).map_err(|_| format!("mempool_malloc: negative size {size}"))?;
    if size == 0 {
        return Ok(0);
    }
    let alloc = allocator(device)?;
    let s = stream_for(&alloc, device, stream);
    let _current = alloc.set_stream(&s).map_err(|e| e.to_string())?;
    alloc.alloc_bytes(size).map_err(|e| match e {
        Error::OutOfMemory(r) => format!("out of memory on device {device}:\n{r}"),
        e => format!("mempool_malloc({size}, device {device}): {e}"),
    })
}

/// PyTorch's allocation function: `size` bytes on `device`, ordered on `stream`. Null when there
/// is no memory (the report is printed on stderr first) or for 0 bytes.
///
/// # Safety
/// `stream` is null or a live CUDA stream of `device`'s primary context that stays alive while
/// the library holds memory of it (PyTorch's streams do).
#[no_mangle]
pub unsafe extern "C" fn mempool_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded("mempool_malloc", std::ptr::null_mut(), || match malloc(size, device, stream as usize) {
        Ok(p) => p as *mut c_void,
        Err(m) => {
            eprintln!("mempool-torch: {m}");
            std::ptr::null_mut()
        }
    })
}

/// Like [`mempool_malloc`], for `use_mempool()`: out of memory raises PyTorch's error instead of
/// returning null. PyTorch (2.11) does not check what its pluggable allocator returns for a tensor:
/// a null would become a tensor at address 0. So the report is thrown as a C++ `c10::Error`
/// (through libc10's own `torchCheckFail`), which PyTorch turns into a Python `RuntimeError`
/// whose message starts with `CUDA out of memory`; outside PyTorch (no libc10 loaded) it returns
/// null. `mempool_malloc` stays the one for `torch.cuda.MemPool(...)`, whose caller handles a null
/// (PyTorch frees its cached blocks, retries, then raises `torch.OutOfMemoryError`).
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
    let r =
        guarded("mempool_malloc", Err("mempool_malloc panicked".to_string()), || malloc(size, device, stream as usize));
    let msg = match r {
        Ok(p) => return p as *mut c_void,
        Err(m) => m,
    };
    // Every lock and guard of this library is released here: only this frame is left, and it
    // owns nothing but `msg`, whose C copy the thrower gets. The report goes out once: in the
    // exception, or on stderr without one.
    let Some(throw) = torch_check_fail() else {
        // Not `eprintln!`, which panics when stderr is gone: this frame is outside `guarded`.
        let _ = writeln!(std::io::stderr(), "mempool-torch: {msg}");
        return std::ptr::null_mut();
    };
    let text =
        std::ffi::CString::new(format!("CUDA out of memory (mempool): {msg}").replace('\0', " ")).unwrap_or_default();
    drop(msg);
    // SAFETY: `throw` is libc10's `c10::detail::torchCheckFail(const char*, const char*, uint32_t,
    // const char*)`, found by its mangled name in the loaded libc10; it copies its arguments into
    // a `c10::Error` and throws it. The exception unwinds through this frame (declared
    // "C-unwind", holding only `text`, which is leaked rather than dropped by the unwind: a small
    // leak per out-of-memory error) into PyTorch's C++ caller.
    unsafe {
        let t = std::mem::ManuallyDrop::new(text);
        throw(c"mempool_malloc".as_ptr(), c"mempool-torch/src/lib.rs".as_ptr(), line!(), t.as_ptr())
    }
}

/// libc10's `torchCheckFail` with C-string arguments, if libc10 is loaded in this process.
fn torch_check_fail() -> Option<unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char) -> !> {
    extern "C" {
        fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
    }
    const RTLD_LAZY: c_int = 0x1;
    const RTLD_NOLOAD: c_int = 0x4;
    static FOUND: OnceLock<usize> = OnceLock::new();
    let f = *FOUND.get_or_init(|| {
        // SAFETY: `RTLD_NOLOAD` only looks the library up among those already loaded (PyTorch
        // loads libc10.so); dlsym reads the symbol table of that handle.
        unsafe {
            let h = dlopen(c"libc10.so".as_ptr(), RTLD_LAZY | RTLD_NOLOAD);
            if h.is_null() {
                return 0;
            }
            dlsym(h, c"_ZN3c106detail14torchCheckFailEPKcS2_jS2_".as_ptr()) as usize
        }
    });
    // SAFETY: a non-zero address is that function, whose C++ signature matches the pointer type
    // (two C strings, an unsigned int, a C string; it never returns, it throws).
    (f != 0).then(|| unsafe { std::mem::transmute::<usize, unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char) -> !>(f) })
}

/// PyTorch's free function: gives back `ptr` from [`mempool_malloc`]. A pointer this library did
/// not give (or gave and took back) is reported on stderr and left alone; null is ignored.
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
        let r = allocator(device).and_then(|a| a.free_bytes(ptr as u64).map_err(|e| e.to_string()));
        if let Err(m) = r {
            eprintln!("mempool-torch: mempool_free({ptr:p}, {size} bytes, device {device}): {m}; nothing was freed");
        }
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
                eprintln!("mempool-torch: empty_cache: {e}");
                -1
            }
        }
    })
}

/// `device`'s statistics as a JSON object with PyTorch's keys (`allocated_bytes.all.current`,
/// ...), written into `buf` (`len` bytes, NUL-terminated if it fits). Returns the length the JSON
/// needs without the NUL (call again with a larger buffer if that is `>= len`), or -1 with the
/// reason on stderr.
///
/// # Safety
/// `buf` is null (then `len` must be 0) or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mempool_memory_stats_json(device: c_int, buf: *mut c_char, len: usize) -> isize {
    guarded("mempool_memory_stats_json", -1, || {
        let a = match allocator(device) {
            Ok(a) => a,
            Err(m) => {
                eprintln!("mempool-torch: memory_stats: {m}");
                return -1;
            }
        };
        let json = stats_json(&a.memory_stats().as_map());
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
    guarded("mempool_reset_peak_stats", -1, || match allocator(device) {
        Ok(a) => {
            a.reset_peak_stats();
            0
        }
        Err(m) => {
            eprintln!("mempool-torch: reset_peak_stats: {m}");
            -1
        }
    })
}

/// Writes `device`'s snapshot to `path` in PyTorch's pickle format (what
/// `torch.cuda.memory._snapshot()` gives; pytorch.org/memory_viz reads it). 0, or -1 with the
/// reason on stderr.
///
/// # Safety
/// `path` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mempool_snapshot(device: c_int, path: *const c_char) -> c_int {
    guarded("mempool_snapshot", -1, || {
        if path.is_null() {
            eprintln!("mempool-torch: snapshot: null path");
            return -1;
        }
        // SAFETY: the caller promises a NUL-terminated string.
        let p = unsafe { CStr::from_ptr(path) }.to_string_lossy().into_owned();
        let r = allocator(device).and_then(|a| a.snapshot().write_pickle(&p).map_err(|e| e.to_string()));
        match r {
            Ok(()) => 0,
            Err(m) => {
                eprintln!("mempool-torch: snapshot to {p}: {m}");
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
}
