//! How busy the machine's cores were, from /proc/stat jiffies.

/// Aggregate CPU counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTimes {
    busy: u64,
    total: u64,
}

impl CpuTimes {
    pub fn now() -> CpuTimes {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
            return CpuTimes::default();
        };
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        let total: u64 = fields.iter().take(8).sum();
        // idle + iowait are not busy.
        let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
        CpuTimes {
            busy: total.saturating_sub(idle),
            total,
        }
    }

    /// Fraction of all cores busy between `earlier` and `self` (None if unknown).
    pub fn busy_since(&self, earlier: &CpuTimes) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        (total > 0).then(|| self.busy.saturating_sub(earlier.busy) as f64 / total as f64)
    }
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
