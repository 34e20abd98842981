//! Allocator settings: `MEMPOOL_ALLOC_CONF` and the same through a builder.
//!
//! The keys and their meaning follow `PYTORCH_CUDA_ALLOC_CONF`:
//!
//! | key | value | effect |
//! | --- | --- | --- |
//! | `max_split_size_mb` | integer > 20 | blocks this large or larger are never split, and serve only requests within 20 MiB of their size |
//! | `garbage_collection_threshold` | 0.0 < t < 1.0 | when reserved memory passes `t` × the memory-fraction limit, fully free cached segments are given back, oldest first, before new memory is asked for |
//! | `roundup_power2_divisions` | a power of two, or `[256:1,512:2,>:4]` (MiB interval starts, `>` for the rest) | sizes are rounded up to the next of `divisions` steps between two powers of two |
//! | `expandable_segments` | `True` or `False` (default) | the default pools map memory on demand into one reserved address range per (stream, pool kind) instead of allocating segments: a block can grow into the pages after it, so memory fragments far less; needs a device with virtual memory management (CUDA, sim) |
//! | `pinned_use_cuda_host_register` | `True` or `False` (default) | pinned allocators (`Allocator::pinned`) take page-aligned host memory and register it (`cuMemHostRegister`) instead of `cuMemHostAlloc`, faulting its pages in first on `pinned_num_register_threads` threads |
//! | `pinned_num_register_threads` | a power of two from 1 (default) to 128 | the threads that fault a new pinned segment's pages in |
//! | `pinned_round_power2` | `True` or `False` (default) | pinned allocators round every size up to a power of two, as PyTorch's host allocator always does (fewer distinct sizes to cache; up to twice the bytes for a size just above a power of two) |
//! | `pinned_reserve_segment_size_mb` | integer MiB: 0 (default: off), or 1 to 1048575 and below `max_split_size_mb` | pinned allocators allocate one segment of this size when they are made and keep it until they are dropped (`empty_cache`, garbage collection and the out-of-memory ladder leave it alone): the small requests (rounded size ≤ 1 MiB) made on the default stream are carved from it before any new segment is made; larger requests, and requests on other streams, get segments of their own as before (a segment serves one stream) |
//! | `pinned_use_background_threads` | `True` or `False` (default) | pinned allocators file freed blocks whose events completed from a background thread of their own (polling, with short sleeps) instead of at the next allocation, which then queries no event; the thread runs no user code, so what its filing queues (trace hook events, segment frees of `no_cache` or released pools) goes out with the next call on the allocator; the thread stops when the allocator is dropped |
//! | `backend` | `native` (default) or `cudaMallocAsync` | `cudaMallocAsync`: the default pools of CUDA allocators take every buffer straight from a stream-ordered driver pool (`cuMemAllocFromPoolAsync`) and give it straight back at its free, with no caching layer, as PyTorch's backend of that name (not with `expandable_segments`) |
//! | `thread_cache` | `True` (default) or `False` | mempool's own: each thread keeps the blocks it freed last and reuses them for requests of the same size on the same stream without a lock; `False` gives every block to the shared best-fit sets, exactly as PyTorch places them |
//!
//! The `pinned_*` keys are the pinned allocators' ([`Allocator::pinned`](crate::Allocator::pinned),
//! and simulated devices made with [`SimDevice::pinned`](crate::sim::SimDevice::pinned)): an
//! allocator of device memory accepts them and ignores them, and its
//! [`config`](crate::Allocator::config) reports them off, so one `MEMPOOL_ALLOC_CONF` serves both
//! kinds of allocator.
//!
//! ```
//! let c = mempool::Config::parse("max_split_size_mb:256,garbage_collection_threshold:0.8,roundup_power2_divisions:4")?;
//! assert_eq!(c.max_split_size, 256 << 20);
//! let same = mempool::Config::builder()
//!     .max_split_size_mb(256)
//!     .garbage_collection_threshold(0.8)
//!     .roundup_power2_divisions(4)
//!     .build()?;
//! assert_eq!(c, same);
//! # Ok::<(), mempool::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::rules::{divisions_index, LARGE_BUFFER, POWER2_INTERVALS};

/// The environment variable read by the process-wide CUDA allocators.
pub const ENV_VAR: &str = "MEMPOOL_ALLOC_CONF";

const KEYS: &str = "max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions, expandable_segments, thread_cache, pinned_use_cuda_host_register, pinned_num_register_threads, pinned_round_power2, pinned_reserve_segment_size_mb, pinned_use_background_threads, backend";
const MIB: usize = 1 << 20;
/// The most round-up divisions per power of two (steps of 1 KiB at 1 MiB).
const MAX_DIVISIONS: usize = 1 << 10;

/// Allocator settings. `Config::default()` is PyTorch's default behaviour.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Blocks of this size or larger are never split (bytes; `usize::MAX`: no limit).
    pub max_split_size: usize,
    /// Fraction of the memory limit above which cached segments are collected (0: off).
    pub garbage_collection_threshold: f64,
    /// Round-up divisions per power-of-two interval, starting at 1 MiB (0 or 1: plain 512 B rounding).
    pub roundup_power2_divisions: [usize; POWER2_INTERVALS],
    /// Fraction of the device's total memory this allocator may reserve (1.0: all of it).
    pub memory_fraction: f64,
    /// Per-thread caches of recently freed blocks (see the module's table).
    pub thread_cache: bool,
    /// The default pools map memory on demand into reserved address ranges (see the module's
    /// table).
    pub expandable_segments: bool,
    /// Pinned allocators register page-aligned host memory instead of allocating it pinned.
    pub pinned_use_cuda_host_register: bool,
    /// The threads that fault a new registered segment's pages in.
    pub pinned_num_register_threads: usize,
    /// Pinned allocators round every size up to a power of two (PyTorch's host allocator's
    /// rule); device allocators ignore it.
    pub pinned_round_power2: bool,
    /// Pinned allocators allocate one segment of this many bytes at creation and keep it until
    /// they are dropped; small requests on the default stream are carved from it (0: none; see
    /// the module's table). Device allocators ignore it.
    pub pinned_reserve_segment_size: usize,
    /// Pinned allocators file completed cross-stream frees from a background thread instead of
    /// at the next allocation (see the module's table). Device allocators ignore it.
    pub pinned_use_background_threads: bool,
    /// `backend:cudaMallocAsync`: the default pools pass every buffer to a stream-ordered driver
    /// pool with no caching (see the module's table).
    pub malloc_async: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_split_size: usize::MAX,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; POWER2_INTERVALS],
            memory_fraction: 1.0,
            thread_cache: true,
            expandable_segments: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_round_power2: false,
            pinned_reserve_segment_size: 0,
            pinned_use_background_threads: false,
            malloc_async: false,
        }
    }
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder { config: Config::default(), error: None }
    }

    /// Reads [`ENV_VAR`]; unset or empty gives the defaults.
    pub fn from_env() -> Result<Config> {
        match std::env::var(ENV_VAR) {
            Ok(s) => Config::parse(&s).map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("{ENV_VAR}: {m}")),
                other => other,
            }),
            Err(_) => Ok(Config::default()),
        }
    }

    /// Parses `key:value,key:value`. An unknown key or a bad value is an error naming the key and
    /// the valid keys or values.
    pub fn parse(s: &str) -> Result<Config> {
        let mut b = Config::builder();
        for item in split_top_level(s) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("`{item}` is not `key:value`; valid keys: {KEYS}")))?;
            let (key, value) = (key.trim(), value.trim());
            b = match key {
                "max_split_size_mb" => b.max_split_size_mb(parse_num(key, value, "an integer number of MiB above 20")?),
                "garbage_collection_threshold" => {
                    b.garbage_collection_threshold(parse_num(key, value, "a number between 0.0 and 1.0")?)
                }
                "roundup_power2_divisions" => {
                    if value.starts_with('[') {
                        b.roundup_power2_divisions_per_interval(parse_intervals(value)?)
                    } else {
                        b.roundup_power2_divisions(parse_num(key, value, "a power of two, or [256:1,512:2,>:4]")?)
                    }
                }
                "thread_cache" => b.thread_cache(parse_bool(key, value)?),
                "pinned_use_cuda_host_register" => b.pinned_use_cuda_host_register(parse_bool(key, value)?),
                "pinned_round_power2" => b.pinned_round_power2(parse_bool(key, value)?),
                "pinned_use_background_threads" => b.pinned_use_background_threads(parse_bool(key, value)?),
                "pinned_reserve_segment_size_mb" => b.pinned_reserve_segment_size_mb(parse_num(
                    key,
                    value,
                    "an integer number of MiB (0: no reserve segment)",
                )?),
                "backend" => match value {
                    "native" => b.malloc_async(false),
                    "cudaMallocAsync" => b.malloc_async(true),
                    other => {
                        return Err(Error::Config(format!(
                            "backend:{other}: valid values are `native` and `cudaMallocAsync`"
                        )))
                    }
                },
                "pinned_num_register_threads" => {
                    b.pinned_num_register_threads(parse_num(key, value, "a power of two from 1 to 128")?)
                }
                "expandable_segments" => b.expandable_segments(parse_bool(key, value)?),
                other => {
                    return Err(Error::Config(format!("unknown key `{other}`; valid keys: {KEYS}")));
                }
            };
        }
        b.build()
    }

    /// The divisions that apply to a request of `size` bytes.
    pub(crate) fn divisions_for(&self, size: usize) -> usize {
        self.roundup_power2_divisions[divisions_index(size)]
    }

    /// The block size a request of `size` bytes gets (`None`: too large): the next power of
    /// two under `pinned_round_power2` (for the pinned allocators that keep it), else the
    /// caching rules with `roundup_power2_divisions`.
    #[inline]
    pub(crate) fn round(&self, size: usize) -> Option<usize> {
        if self.pinned_round_power2 {
            let r = size.checked_next_power_of_two()?.max(crate::rules::MIN_BLOCK_SIZE);
            return (r <= crate::rules::MAX_BLOCK).then_some(r);
        }
        crate::rules::round_size(size, self.divisions_for(size))
    }
}

/// Builds a [`Config`], checking every value at [`build`](ConfigBuilder::build).
#[derive(Debug, Clone)]
#[must_use]
pub struct ConfigBuilder {
    config: Config,
    error: Option<Error>,
}

impl ConfigBuilder {
    fn fail(mut self, msg: String) -> Self {
        self.error.get_or_insert(Error::Config(msg));
        self
    }

    /// Blocks of `mb` MiB or more are never split. Must be above 20.
    pub fn max_split_size_mb(mut self, mb: usize) -> Self {
        if mb <= LARGE_BUFFER / MIB {
            return self.fail(format!("max_split_size_mb must be above {} (got {mb})", LARGE_BUFFER / MIB));
        }
        self.config.max_split_size = mb.saturating_mul(MIB);
        self
    }

    /// Collect cached segments once reserved memory passes this fraction of the limit.
    pub fn garbage_collection_threshold(mut self, t: f64) -> Self {
        if !(t > 0.0 && t < 1.0) {
            return self.fail(format!("garbage_collection_threshold must be between 0.0 and 1.0, exclusive (got {t})"));
        }
        self.config.garbage_collection_threshold = t;
        self
    }

    /// The same number of round-up divisions for every size.
    pub fn roundup_power2_divisions(self, divisions: usize) -> Self {
        self.roundup_power2_divisions_per_interval(vec![(None, divisions)])
    }

    /// Divisions per interval: `(Some(start_mib), d)` sets the power-of-two interval starting at
    /// `start_mib` MiB and the ones after it up to the next entry; `(None, d)` (PyTorch's `>`) sets
    /// every interval no entry covers: those below the first entry, and those after the last
    /// entry's own interval.
    pub fn roundup_power2_divisions_per_interval(mut self, entries: Vec<(Option<usize>, usize)>) -> Self {
        let mut explicit = Vec::new();
        let mut rest = None;
        for (start, d) in entries {
            if d > 1 && !d.is_power_of_two() {
                return self.fail(format!("roundup_power2_divisions must be a power of two (got {d})"));
            }
            if d > MAX_DIVISIONS {
                return self.fail(format!(
                    "roundup_power2_divisions must be at most {MAX_DIVISIONS} (got {d}): finer steps than \
                     1/{MAX_DIVISIONS} of a power of two round nothing"
                ));
            }
            match start {
                Some(mb) if !mb.is_power_of_two() => {
                    return self.fail(format!(
                        "roundup_power2_divisions interval start must be a power of two in MiB (got {mb})"
                    ));
                }
                Some(mb) => explicit.push(((mb.trailing_zeros() as usize).min(POWER2_INTERVALS - 1), d)),
                None => rest = Some(d),
            }
        }
        explicit.sort_unstable();
        let last = explicit.last().map(|e| e.0);
        for (i, slot) in self.config.roundup_power2_divisions.iter_mut().enumerate() {
            *slot = match explicit.iter().rev().find(|e| e.0 <= i) {
                Some(&(start, d)) if Some(start) != last || i == start || rest.is_none() => d,
                _ => rest.unwrap_or(0),
            };
        }
        self
    }

    /// Per-thread caches of recently freed blocks (default: on).
    pub fn thread_cache(mut self, on: bool) -> Self {
        self.config.thread_cache = on;
        self
    }

    /// Pinned allocators register page-aligned host memory (`cuMemHostRegister`) instead of
    /// allocating it pinned (default: off).
    pub fn pinned_use_cuda_host_register(mut self, on: bool) -> Self {
        self.config.pinned_use_cuda_host_register = on;
        self
    }

    /// Pinned allocators round every size up to a power of two (default: off).
    pub fn pinned_round_power2(mut self, on: bool) -> Self {
        self.config.pinned_round_power2 = on;
        self
    }

    /// Pinned allocators allocate one segment of `mb` MiB when they are made, kept until they are
    /// dropped, and carve the small requests of the default stream from it (0, the default: no
    /// reserve). At most 1 TiB, and below `max_split_size_mb` when that is set (a block that
    /// large is never split).
    pub fn pinned_reserve_segment_size_mb(mut self, mb: usize) -> Self {
        match mb.checked_mul(MIB).filter(|&b| b <= crate::rules::MAX_BLOCK) {
            Some(bytes) => self.config.pinned_reserve_segment_size = bytes,
            None => {
                return self.fail(format!(
                    "pinned_reserve_segment_size_mb must be at most {} (a segment is at most 1 TiB less 512 bytes; got {mb})",
                    crate::rules::MAX_BLOCK / MIB
                ))
            }
        }
        self
    }

    /// Pinned allocators file completed cross-stream frees from a background thread of their
    /// own instead of at the next allocation (default: off).
    pub fn pinned_use_background_threads(mut self, on: bool) -> Self {
        self.config.pinned_use_background_threads = on;
        self
    }

    /// The threads that fault a new registered segment's pages in (a power of two, 1 to 128).
    pub fn pinned_num_register_threads(mut self, n: usize) -> Self {
        if !n.is_power_of_two() || n > 128 {
            return self.fail(format!("pinned_num_register_threads must be a power of two from 1 to 128 (got {n})"));
        }
        self.config.pinned_num_register_threads = n;
        self
    }

    /// `backend:cudaMallocAsync` (true) or `backend:native` (false, the default).
    pub fn malloc_async(mut self, on: bool) -> Self {
        self.config.malloc_async = on;
        self
    }

    /// Expandable segments for the default pools (default: off).
    pub fn expandable_segments(mut self, on: bool) -> Self {
        self.config.expandable_segments = on;
        self
    }

    /// The fraction of the device's total memory the allocator may reserve.
    pub fn memory_fraction(mut self, f: f64) -> Self {
        if !(f > 0.0 && f <= 1.0) {
            return self.fail(format!("memory_fraction must be in (0.0, 1.0] (got {f})"));
        }
        self.config.memory_fraction = f;
        self
    }

    /// The checked config, or the first error met.
    pub fn build(self) -> Result<Config> {
        match self.error {
            Some(e) => Err(e),
            None if self.config.malloc_async && self.config.expandable_segments => Err(Error::Config(
                "backend:cudaMallocAsync takes every buffer from the driver's pool: it cannot be combined with expandable_segments:True".into(),
            )),
            None if self.config.pinned_reserve_segment_size != 0
                && self.config.pinned_reserve_segment_size >= self.config.max_split_size =>
            {
                Err(Error::Config(format!(
                    "pinned_reserve_segment_size_mb ({} MiB) must be below max_split_size_mb ({} MiB): a block that large is never split, so the reserve could serve nothing",
                    self.config.pinned_reserve_segment_size / MIB,
                    self.config.max_split_size / MIB
                )))
            }
            None => Ok(self.config),
        }
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(Error::Config(format!("{key}: expected True or False, got `{value}`"))),
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str, expected: &str) -> Result<T> {
    value.parse().map_err(|_| Error::Config(format!("bad value `{value}` for `{key}`: expected {expected}")))
}

/// Splits on commas that are not inside `[...]`.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_intervals(value: &str) -> Result<Vec<(Option<usize>, usize)>> {
    let key = "roundup_power2_divisions";
    let inner = value
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .ok_or_else(|| Error::Config(format!("bad value `{value}` for `{key}`: unbalanced brackets")))?;
    inner
        .split(',')
        .map(|entry| {
            let (start, d) = entry.split_once(':').ok_or_else(|| {
                Error::Config(format!(
                    "bad value `{value}` for `{key}`: `{entry}` is not `<MiB>:<divisions>` or `>:<divisions>`"
                ))
            })?;
            let d = parse_num(key, d.trim(), "a power of two")?;
            let start = match start.trim() {
                ">" => None,
                mb => Some(parse_num(key, mb, "an interval start in MiB, or `>`")?),
            };
            Ok((start, d))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_round_power2_rounds_to_the_next_power_of_two() {
        let c = Config::parse("pinned_round_power2:True").unwrap();
        assert!(c.pinned_round_power2);
        assert_eq!(
            (c.round(3000), c.round(4096), c.round(4097), c.round(1)),
            (Some(4096), Some(4096), Some(8192), Some(512))
        );
        assert_eq!(c.round(usize::MAX / 2 + 2), None, "past the largest block");
        let plain = Config::default();
        assert_eq!(plain.round(3000), Some(3072), "512-byte steps without it");
        assert!(Config::parse("pinned_round_power2:maybe").is_err());
    }

    #[test]
    fn backend_values() {
        assert!(Config::parse("backend:cudaMallocAsync").unwrap().malloc_async);
        assert!(!Config::parse("backend:native").unwrap().malloc_async);
        let e = Config::parse("backend:cuda").unwrap_err();
        assert!(e.to_string().contains("native") && e.to_string().contains("cudaMallocAsync"), "{e}");
        assert!(Config::parse("backend:cudaMallocAsync,expandable_segments:True").is_err());
    }

    #[test]
    fn parses_all_keys() {
        let c = Config::parse("max_split_size_mb:256, garbage_collection_threshold:0.8,roundup_power2_divisions:4")
            .unwrap();
        assert_eq!(c.max_split_size, 256 << 20);
        assert_eq!(c.garbage_collection_threshold, 0.8);
        assert_eq!(c.roundup_power2_divisions, [4; POWER2_INTERVALS]);
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn interval_form() {
        let c = Config::parse("roundup_power2_divisions:[1:2,256:8,>:1]").unwrap();
        assert_eq!(c.divisions_for(512), 2); // below 1 MiB: first interval
        assert_eq!(c.divisions_for(3 << 20), 2);
        assert_eq!(c.divisions_for(300 << 20), 8);
        assert_eq!(c.divisions_for(1 << 40), 1); // after the last entry's interval: `>`
        let c = Config::parse("roundup_power2_divisions:[256:4,>:2]").unwrap();
        assert_eq!(c.divisions_for(1 << 20), 2);
        assert_eq!(c.divisions_for(256 << 20), 4);
    }

    #[test]
    fn errors_name_the_key_and_valid_ones() {
        let e = Config::parse("max_split_mb:256").unwrap_err().to_string();
        assert!(e.contains("unknown key `max_split_mb`"), "{e}");
        assert!(e.contains("max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions"), "{e}");
        let e = Config::parse("max_split_size_mb:lots").unwrap_err().to_string();
        assert!(e.contains("`lots`") && e.contains("max_split_size_mb"), "{e}");
        let e = Config::parse("max_split_size_mb:16").unwrap_err().to_string();
        assert!(e.contains("above 20"), "{e}");
        let e = Config::parse("garbage_collection_threshold:1.5").unwrap_err().to_string();
        assert!(e.contains("garbage_collection_threshold"), "{e}");
        let e = Config::parse("roundup_power2_divisions:3").unwrap_err().to_string();
        assert!(e.contains("power of two"), "{e}");
        let e = Config::parse("roundup_power2_divisions:[1:2").unwrap_err().to_string();
        assert!(e.contains("roundup_power2_divisions"), "{e}");
        // A huge power of two used to parse, then overflow every allocation.
        let e = Config::parse("roundup_power2_divisions:4611686018427387904").unwrap_err().to_string();
        assert!(e.contains("at most 1024"), "{e}");
        let e = Config::parse("roundup_power2_divisions:[1:2048,>:2]").unwrap_err().to_string();
        assert!(e.contains("at most 1024"), "{e}");
        let e = Config::parse("max_split_size_mb").unwrap_err().to_string();
        assert!(e.contains("key:value"), "{e}");
    }
}
