//! Human-readable byte sizes, as PyTorch prints them (`2.00 GiB`).

use std::fmt;

/// A byte count that displays as `512 B`, `4.00 KiB`, `2.00 MiB`, `1.50 GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub u64);

/// Wraps a byte count for display.
pub fn bytes(n: impl TryInto<u64>) -> Bytes {
    Bytes(n.try_into().unwrap_or(u64::MAX))
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const K: f64 = 1024.0;
        let n = self.0 as f64;
        let s = if self.0 < 1024 {
            format!("{} B", self.0)
        } else if n < K * K {
            format!("{:.2} KiB", n / K)
        } else if n < K * K * K {
            format!("{:.2} MiB", n / (K * K))
        } else if n < K * K * K * K {
            format!("{:.2} GiB", n / (K * K * K))
        } else {
            format!("{:.2} TiB", n / (K * K * K * K))
        };
        f.pad(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn units() {
        assert_eq!(bytes(512u64).to_string(), "512 B");
        assert_eq!(bytes(4096u64).to_string(), "4.00 KiB");
        assert_eq!(bytes(3u64 << 20).to_string(), "3.00 MiB");
        assert_eq!(bytes(3u64 << 29).to_string(), "1.50 GiB");
        assert_eq!(format!("{:>10}", bytes(512u64)), "     512 B");
    }
}
