//! Where each allocation came from: call stacks recorded with the history, as PyTorch's
//! `_record_memory_history(stacks=...)` records them.
//!
//! Recording is cheap: the stack is unwound to raw return addresses (no symbols) and interned,
//! so an allocation made again from the same place costs one hash lookup more, and the entry
//! carries a 4-byte [`StackId`]. Symbols are resolved only when someone looks (a snapshot's
//! pickle, an out-of-memory report), and each address once.
//!
//! Stacks are recorded while history or a hook is on ([`record_history`](crate::record_history),
//! [`trace::attach`](crate::trace::attach)) and [`record_stacks`](crate::record_stacks) says so; the allocation path
//! then goes through the shared state (no thread cache), as it does for every traced event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{LazyLock, Mutex};

/// Which stacks to record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StackMode {
    /// None (the default).
    #[default]
    None,
    /// The allocation site only: the innermost frame outside mempool and the standard library.
    Sites,
    /// The whole stack from the allocation site outwards.
    Full,
}

/// A recorded stack (0: none).
pub type StackId = u32;

/// One resolved frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function (demangled, without its hash).
    pub name: String,
    /// The source file, or empty when unknown.
    pub filename: String,
    /// The line, or 0 when unknown.
    pub line: u32,
}

static MODE: AtomicU8 = AtomicU8::new(0);
/// Bumped each time recording starts: a block's stack counts only if it was recorded in the
/// current epoch (a block handed out while recording was off keeps an older occupant's).
static EPOCH: AtomicU32 = AtomicU32::new(0);

struct Table {
    /// Stack `i` (1-based ids) as return addresses, innermost first.
    stacks: Vec<Box<[usize]>>,
    /// Interning: a stack recorded again (in any epoch) gets its id back, so memory grows with
    /// the distinct stacks, not with how often recording is turned on.
    index: HashMap<Box<[usize]>, StackId>,
    /// Resolved frames per address (inlined functions give several).
    resolved: HashMap<usize, Vec<Frame>>,
}

static TABLE: LazyLock<Mutex<Table>> =
    LazyLock::new(|| Mutex::new(Table { stacks: Vec::new(), index: HashMap::new(), resolved: HashMap::new() }));

fn table() -> std::sync::MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sets the mode ([`crate::record_stacks`]); `Some(on)` when recording turned on or off.
pub(crate) fn set_mode(mode: StackMode) -> Option<bool> {
    let on = mode != StackMode::None;
    if on {
        // Before the mode: an allocation that sees recording on sees the new epoch.
        let was = MODE.load(Ordering::Acquire);
        if was == 0 {
            EPOCH.fetch_add(1, Ordering::AcqRel);
        }
    }
    let was = MODE.swap(mode as u8, Ordering::AcqRel);
    (on != (was != 0)).then_some(on)
}

/// The current recording epoch (see [`current`]).
#[inline]
pub(crate) fn epoch() -> u32 {
    EPOCH.load(Ordering::Acquire)
}

/// The mode now.
pub fn stack_mode() -> StackMode {
    match MODE.load(Ordering::Relaxed) {
        1 => StackMode::Sites,
        2 => StackMode::Full,
        _ => StackMode::None,
    }
}

#[inline]
pub(crate) fn on() -> bool {
    MODE.load(Ordering::Relaxed) != 0
}

/// Unwinds the calling thread's stack and interns it (0 when recording is off).
#[cold]
pub(crate) fn capture() -> StackId {
    if !on() {
        return 0;
    }
    let mut ips: Vec<usize> = Vec::with_capacity(48);
    let mut each = |f: &backtrace::Frame| {
        ips.push(f.ip() as usize);
        ips.len() < 96
    };
    // `backtrace::trace` takes the crate's global lock, which symbol resolution holds while it
    // loads debug information (hundreds of milliseconds the first time): allocations on other
    // threads would wait behind a snapshot or an out-of-memory report. On Linux the unwinder
    // (`_Unwind_Backtrace` over `dl_iterate_phdr`) is thread-safe and the walk touches none of
    // the resolver's state, so no lock is needed; elsewhere the lock is kept.
    #[cfg(target_os = "linux")]
    // SAFETY: the unsynchronised walk is sound where the platform's unwinder is thread-safe,
    // which glibc's and libgcc's are; the callback only reads the frame's address.
    unsafe {
        backtrace::trace_unsynchronized(&mut each)
    };
    #[cfg(not(target_os = "linux"))]
    backtrace::trace(&mut each);
    let ips = ips.into_boxed_slice();
    let mut t = table();
    if let Some(id) = t.index.get(&ips) {
        return *id;
    }
    t.stacks.push(ips.clone());
    let id = t.stacks.len() as StackId;
    t.index.insert(ips, id);
    id
}

/// Whether a block's stack `id`, recorded in `epoch`, is its present allocation's: recording is
/// on and has not been turned off and on since (a block handed out while it was off keeps an
/// older occupant's stack).
pub(crate) fn current(id: StackId, epoch: u32) -> bool {
    id != 0 && on() && epoch == self::epoch()
}

/// Frames of mempool itself, the unwinder and the standard library at the top of a stack.
fn machinery(name: &str) -> bool {
    let n = name.trim_start_matches('<');
    ["mempool::", "backtrace::", "std::", "core::", "alloc::", "scopeguard::", "__rust"]
        .iter()
        .any(|p| n.starts_with(p))
        || n.is_empty()
}

/// The frames of stack `id` as the mode says (sites: one frame), innermost first, from the
/// allocation site outwards (mempool's own frames left out).
pub fn frames(id: StackId) -> Vec<Frame> {
    frames_as(id, stack_mode())
}

pub(crate) fn frames_as(id: StackId, mode: StackMode) -> Vec<Frame> {
    let ips = {
        let t = table();
        match id.checked_sub(1).and_then(|i| t.stacks.get(i as usize)) {
            Some(s) => s.clone(),
            None => return Vec::new(),
        }
    };
    let mut out = Vec::new();
    for ip in ips.iter() {
        let known = table().resolved.get(ip).cloned();
        let fs = match known {
            Some(f) => f,
            None => {
                let mut fs = Vec::new();
                // Return addresses point after the call: look up the call itself.
                backtrace::resolve(ip.saturating_sub(1) as *mut std::ffi::c_void, |s| {
                    fs.push(Frame {
                        name: s.name().map_or_else(|| format!("{ip:#x}"), |n| format!("{n:#}")),
                        filename: s.filename().map_or_else(String::new, |p| p.display().to_string()),
                        line: s.lineno().unwrap_or(0),
                    });
                });
                if fs.is_empty() {
                    fs.push(Frame { name: format!("{ip:#x}"), filename: String::new(), line: 0 });
                }
                table().resolved.insert(*ip, fs.clone());
                fs
            }
        };
        out.extend(fs);
    }
    // From the first frame that is not the allocator's (or the unwinder's) own.
    let start = out.iter().position(|f| !machinery(&f.name)).unwrap_or(out.len());
    out.drain(..start);
    if mode == StackMode::Sites {
        out.truncate(1);
    }
    out
}

/// The allocation site of stack `id`: its innermost frame outside mempool and the standard
/// library, as `function (file:line)`.
pub fn site(id: StackId) -> Option<String> {
    frames_as(id, StackMode::Sites).into_iter().next().map(|f| {
        if f.line > 0 && !f.filename.is_empty() {
            format!("{} ({}:{})", f.name, f.filename, f.line)
        } else {
            f.name
        }
    })
}
