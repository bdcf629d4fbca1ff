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

/// CPU seconds (user + system, every thread, reaped children included)
/// used so far by every live process of process group `pgid`.
pub fn group_cpu_seconds(pgid: u32) -> Option<f64> {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks <= 0 {
        return None;
    }
    let mut total = 0u64;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) != Some(pgid) {
            continue;
        }
        found = true;
        total += (11..=14)
            .filter_map(|i| fields.get(i)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    found.then(|| total as f64 / ticks as f64)
}

/// Where a run's CPU went: cores used on average over the run by the load
/// generator (this process), the gateways and the simulator, and by the
/// whole machine (everything, other users included).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuUse {
    pub load_generator: f64,
    pub gateways: f64,
    pub simulator: f64,
    pub machine: f64,
    pub cores: usize,
    /// Why the run measured the machine rather than the router, if it did
    /// ([`cpu_bound`]).
    pub bound: Option<String>,
}

/// Share of the cores at or above which a run counts as CPU-bound.
pub const BOUND_SHARE: f64 = 0.85;

/// Whether a run was CPU-bound: the machine's cores were busy at least
/// [`BOUND_SHARE`] of the run on average (then every process, gateway
/// included, waited for a core and latencies include that wait), or the
/// gateways or the load generator alone used that share of the cores
/// (they were saturated whatever else ran). Averages over a run hide short
/// saturations, so the threshold is below 1.
pub fn cpu_bound(use_: &CpuUse) -> Option<String> {
    let cores = use_.cores.max(1) as f64;
    let limit = BOUND_SHARE * cores;
    let mut why = Vec::new();
    if use_.machine >= limit {
        why.push(format!(
            "the machine's cores were {:.0}% busy",
            use_.machine / cores * 100.0
        ));
    }
    for (what, used) in [
        ("the gateways", use_.gateways),
        ("the load generator", use_.load_generator),
    ] {
        if used >= limit {
            why.push(format!("{what} used {used:.2} of {cores} cores"));
        }
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// Measures [`CpuUse`] between `start` and `finish`.
pub struct CpuMeter {
    wall: std::time::Instant,
    machine: CpuTimes,
    own: f64,
    gateways: Vec<u32>,
    gateways_start: f64,
    simulators: Vec<u32>,
    simulators_start: f64,
}

fn groups_cpu(groups: &[u32]) -> f64 {
    groups.iter().filter_map(|g| group_cpu_seconds(*g)).sum()
}

impl CpuMeter {
    /// Starts measuring; `gateways` and `simulators` are process-group ids
    /// (each child runs in its own group).
    pub fn start(gateways: Vec<u32>, simulators: Vec<u32>) -> CpuMeter {
        CpuMeter {
            wall: std::time::Instant::now(),
            machine: CpuTimes::now(),
            own: process_cpu_seconds(std::process::id()).unwrap_or(0.0),
            gateways_start: groups_cpu(&gateways),
            gateways,
            simulators_start: groups_cpu(&simulators),
            simulators,
        }
    }

    pub fn finish(&self) -> CpuUse {
        let wall = self.wall.elapsed().as_secs_f64().max(1e-9);
        let cores = machine_cores();
        let own = process_cpu_seconds(std::process::id()).unwrap_or(self.own);
        let busy = CpuTimes::now().busy_since(&self.machine).unwrap_or(f64::NAN);
        let mut use_ = CpuUse {
            load_generator: (own - self.own).max(0.0) / wall,
            gateways: (groups_cpu(&self.gateways) - self.gateways_start).max(0.0) / wall,
            simulator: (groups_cpu(&self.simulators) - self.simulators_start).max(0.0) / wall,
            machine: busy * cores as f64,
            cores,
            bound: None,
        };
        use_.bound = cpu_bound(&use_);
        use_
    }
}

#[cfg(test)]
mod core_count_tests {
    use super::*;

    #[test]
    fn a_busy_group_is_measured_and_saturation_is_flagged() {
        // This process leads no group of its own in a test run, but its
        // group is some process's: the sum is at least this process's use.
        let pgid = unsafe { libc::getpgrp() } as u32;
        let t0 = group_cpu_seconds(pgid).unwrap();
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(200) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        assert!(x != 7);
        assert!(group_cpu_seconds(pgid).unwrap() - t0 >= 0.05);
        assert_eq!(group_cpu_seconds(u32::MAX), None);
        let quiet = CpuUse {
            load_generator: 0.3,
            gateways: 0.4,
            simulator: 0.2,
            machine: 1.0,
            cores: 2,
            bound: None,
        };
        assert_eq!(cpu_bound(&quiet), None);
        let busy = CpuUse {
            machine: 1.9,
            gateways: 1.8,
            ..quiet
        };
        let why = cpu_bound(&busy).unwrap();
        assert!(
            why.contains("95% busy") && why.contains("gateways used 1.80"),
            "{why}"
        );
    }

    #[test]
    fn the_machine_has_at_least_the_cores_this_process_may_use() {
        assert!(machine_cores() >= cores());
        assert!(cores() >= 1);
    }
}
