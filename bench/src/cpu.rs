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

/// Cores this process may run on (fewer than the machine's once it pinned itself).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The machine's online cores, whatever this process is pinned to: what
/// reports name, and what `/proc/stat`'s busy share is a share of.
pub fn machine_cores() -> usize {
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(online)
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or_else(cores)
}

/// CPU seconds (user + system, every thread) process `pid` has used so far.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then(|| (utime + stime) / ticks as f64)
}

/// Pins every thread of process `pid` (0: this process) to `cpus`; threads
/// it starts later inherit the mask. False if any could not be pinned.
pub fn pin_threads(pid: u32, cpus: &[usize]) -> bool {
    let dir = if pid == 0 {
        "/proc/self/task".to_string()
    } else {
        format!("/proc/{pid}/task")
    };
    let Ok(tasks) = std::fs::read_dir(&dir) else {
        return false;
    };
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in cpus {
        unsafe { libc::CPU_SET(*cpu, &mut set) };
    }
    let mut all = true;
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: `set` outlives the call and its size is passed.
        let done = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        all &= done == 0;
    }
    all
}

#[cfg(test)]
mod core_count_tests {
    use super::*;

    #[test]
    fn the_machine_has_at_least_the_cores_this_process_may_use() {
        assert!(machine_cores() >= cores());
        assert!(cores() >= 1);
    }
}
