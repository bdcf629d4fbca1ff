//! Where a record comes from: the command, the commit, the date and the
//! machine. Every run record carries it, and a report refuses (or, asked
//! to, loudly flags) a table whose runs come from more than one commit or
//! machine.

use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// The command line as typed.
    pub command: String,
    /// `git rev-parse --short=12 HEAD`, `-dirty` when tracked files outside
    /// `bench-results/` differ (what the bench writes itself does not count:
    /// a suite's second run would otherwise be marked by its first).
    pub commit: String,
    /// UTC, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// CPU model, cores, kernel ([`machine`]).
    pub machine: String,
}

/// The commit of the repository at `root` (`unknown` outside git).
pub fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(head) => {
            let dirty = git(&[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)bench-results",
            ])
            .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".into(),
    }
}

/// Machine description for result files: CPU model, cores, kernel.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {} cores, Linux {}",
        crate::cpu::machine_cores(),
        kernel.trim()
    )
}

/// Now, in Unix seconds.
pub fn unix_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// UTC date and time now, `YYYY-MM-DD HH:MM UTC`.
pub fn now_utc() -> String {
    let secs = unix_s() as u64;
    let days = secs / 86_400;
    let (h, m) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{d:02} {h:02}:{m:02} UTC")
}

impl Provenance {
    /// Now, on this machine, at the commit of `root`.
    pub fn current(root: &Path, command: &str) -> Provenance {
        Provenance {
            command: command.to_string(),
            commit: commit(root),
            date: now_utc(),
            machine: machine(),
        }
    }

    /// The machine without its kernel (what decides speed).
    pub fn cpu(&self) -> &str {
        self.machine.split(", Linux").next().unwrap_or(&self.machine)
    }
}

/// The commits and machines of `records`' provenances (None: a record
/// made before records carried one), each listed once.
pub fn distinct<'a>(all: impl Iterator<Item = Option<&'a Provenance>>) -> (Vec<String>, Vec<String>) {
    let (mut commits, mut machines) = (Vec::new(), Vec::new());
    for p in all {
        let (c, m) = match p {
            Some(p) => (p.commit.clone(), p.cpu().to_string()),
            None => ("unrecorded".to_string(), "unrecorded".to_string()),
        };
        if !commits.contains(&c) {
            commits.push(c);
        }
        if !machines.contains(&m) {
            machines.push(m);
        }
    }
    (commits, machines)
}

/// Why a table mixing `records` must not stand as one comparison, if it
/// mixes commits or machines.
pub fn mixed<'a>(all: impl Iterator<Item = Option<&'a Provenance>>) -> Option<String> {
    let (commits, machines) = distinct(all);
    let mut why = Vec::new();
    if commits.len() > 1 {
        why.push(format!("commits {}", commits.join(", ")));
    }
    if machines.len() > 1 {
        why.push(format!("machines {}", machines.join(" / ")));
    }
    (!why.is_empty()).then(|| format!("runs from several {}", why.join(" and ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(commit: &str, machine: &str) -> Provenance {
        Provenance {
            commit: commit.into(),
            machine: format!("{machine}, Linux 6.1"),
            ..Provenance::default()
        }
    }

    #[test]
    fn mixing_commits_or_machines_is_named() {
        let (a, b, c) = (
            p("abc", "EPYC, 2 cores"),
            p("abc", "EPYC, 2 cores"),
            p("def", "Xeon, 2 cores"),
        );
        assert_eq!(mixed([Some(&a), Some(&b)].into_iter()), None);
        let why = mixed([Some(&a), Some(&c)].into_iter()).unwrap();
        assert!(
            why.contains("abc, def") && why.contains("EPYC, 2 cores / Xeon, 2 cores"),
            "{why}"
        );
        assert!(mixed([Some(&a), None].into_iter())
            .unwrap()
            .contains("unrecorded"));
        // The kernel does not count as another machine.
        let d = Provenance {
            machine: "EPYC, 2 cores, Linux 6.9".into(),
            ..a.clone()
        };
        assert_eq!(mixed([Some(&a), Some(&d)].into_iter()), None);
    }

    #[test]
    fn results_the_bench_wrote_do_not_mark_the_commit_dirty() {
        let dir = std::env::temp_dir().join(format!("dprank-provenance-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bench-results")).unwrap();
        let git = |args: &[&str]| {
            let ok = Command::new("git")
                .arg("-C")
                .arg(&dir)
                .args(["-c", "user.name=t", "-c", "user.email=t@t"])
                .args(args)
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(ok, "git {args:?}");
        };
        std::fs::write(dir.join("bench-results/runs.jsonl"), "{}\n").unwrap();
        std::fs::write(dir.join("code.rs"), "fn main() {}\n").unwrap();
        git(&["init", "-q"]);
        git(&["add", "."]);
        git(&["commit", "-qm", "first"]);
        let clean = commit(&dir);
        assert!(!clean.ends_with("-dirty"), "{clean}");
        std::fs::write(dir.join("bench-results/runs.jsonl"), "{}\n{}\n").unwrap();
        assert_eq!(commit(&dir), clean, "a result written by the bench");
        std::fs::write(dir.join("code.rs"), "fn main() { }\n").unwrap();
        assert_eq!(commit(&dir), format!("{clean}-dirty"), "a change to the code");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn this_repository_has_a_commit() {
        let here = commit(Path::new(env!("CARGO_MANIFEST_DIR")));
        assert!(here.len() >= 12 || here == "unknown", "{here}");
    }
}
