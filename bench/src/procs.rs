//! Child processes the benchmark starts (simulators, Envoys, smg), with kill
//! guards: dropping a [`Managed`] stops its whole process group; Ctrl-C and
//! panics (the release profile aborts, so `Drop` never runs) kill every
//! registered group; and each child gets SIGKILL from the kernel if the bench
//! itself dies (PR_SET_PDEATHSIG).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Process-group ids of every live child, for the Ctrl-C and panic paths.
static LIVE_GROUPS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

fn register(pid: i32) {
    if let Ok(mut groups) = LIVE_GROUPS.lock() {
        groups.push(pid);
    }
}

fn unregister(pid: i32) {
    if let Ok(mut groups) = LIVE_GROUPS.lock() {
        groups.retain(|g| *g != pid);
    }
}

/// Kills every registered child group at once (Ctrl-C, panic).
pub fn kill_all_children() {
    let groups: Vec<i32> = match LIVE_GROUPS.lock() {
        Ok(mut groups) => std::mem::take(&mut *groups),
        Err(_) => return,
    };
    for group in groups {
        // SAFETY: kill(2) on a process group we created; no memory is touched.
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
    }
}

/// Installs the Ctrl-C handler and the panic hook that stop every child.
pub fn install_kill_guards() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        kill_all_children();
        default_hook(info);
    }));
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ninterrupted: stopping every process the bench started");
            kill_all_children();
            std::process::exit(130);
        }
    });
}

/// A running child in its own process group; stopped (the group) on drop.
pub struct Managed {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Managed {
    /// Starts `program args` with stdout/stderr appended to `logs/<name>.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], logs: &Path) -> Result<Managed, String> {
        let log = logs.join(format!("{name}.log"));
        let out = File::create(&log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("cannot reopen {}: {e}", log.display()))?;
        let mut command = Command::new(program);
        command.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            command.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {} ({}): {e}", name, program.display()))?;
        register(child.id() as i32);
        Ok(Managed {
            name: name.to_string(),
            child,
            log,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last lines of the child's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Waits until the log holds `lines` lines starting with `prefix`; returns them.
    pub fn wait_for_lines(
        &mut self,
        prefix: &str,
        lines: usize,
        timeout: Duration,
    ) -> Result<Vec<String>, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let found: Vec<String> = File::open(&self.log)
                .map(|f| {
                    BufReader::new(f)
                        .lines()
                        .map_while(Result::ok)
                        .filter(|l| l.starts_with(prefix))
                        .collect()
                })
                .unwrap_or_default();
            if found.len() >= lines {
                return Ok(found);
            }
            if !self.is_running() {
                return Err(format!(
                    "{} exited during start-up:\n{}",
                    self.name,
                    self.log_tail()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} not ready after {timeout:?}:\n{}",
                    self.name,
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM to the group, then SIGKILL if it has not exited within a second.
    pub fn stop(&mut self) {
        let pid = self.child.id() as i32;
        if self.is_running() {
            // SAFETY: signals to the process group this struct created.
            unsafe {
                libc::kill(-pid, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(1);
            while self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // SAFETY: as above; also reaps stragglers of the group.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
        unregister(pid);
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Ports handed out lately are not handed out again: the kernel can give
/// the port just released back to the next bind to port 0, so two asks in
/// a row (smg's `--port` and `--prometheus-port`) could get the same one
/// before either process binds it.
const RECENT_PORTS: usize = 256;

/// A port that was free a moment ago (bind to port 0 and release it) and
/// is none of the last `RECENT_PORTS` this process handed out.
pub fn free_port() -> Result<u16, String> {
    static RECENT: Mutex<std::collections::VecDeque<u16>> = Mutex::new(std::collections::VecDeque::new());
    for _ in 0..64 {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
        let port = listener
            .local_addr()
            .map(|a| a.port())
            .map_err(|e| format!("no free port: {e}"))?;
        let mut recent = RECENT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !recent.contains(&port) {
            if recent.len() == RECENT_PORTS {
                recent.pop_front();
            }
            recent.push_back(port);
            return Ok(port);
        }
    }
    Err("no free port that was not handed out lately".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_handed_out_lately_are_not_handed_out_again() {
        let ports: Vec<u16> = (0..RECENT_PORTS).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            ports.len(),
            "a port came back within {RECENT_PORTS} asks"
        );
    }
}
