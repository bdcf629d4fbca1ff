//! The public traces the bench replays: the Mooncake FAST'25 release
//! (Apache-2.0), where to fetch each file, how to check it, and where the
//! bench finds it on this machine. The files are not in the repository:
//! `scripts/fetch_traces.py` downloads them from the pinned upstream commit
//! and checks them; `--trace-dir DIR` or `DPRANK_TRACE_DIR` points at local
//! copies (default `target/traces/mooncake`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::WorkloadKind;

/// The Mooncake commit the files are pinned at.
pub const MOONCAKE_COMMIT: &str = "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb";
/// Where the bench looks when neither `--trace-dir` nor the variable is set.
pub const DEFAULT_TRACE_DIR: &str = "target/traces/mooncake";
/// Points at a directory holding the trace files.
pub const TRACE_DIR_ENV: &str = "DPRANK_TRACE_DIR";

/// One file of the release.
#[derive(Debug)]
pub struct PublicTrace {
    pub file: &'static str,
    /// How reports name it.
    pub label: &'static str,
    /// Git blob id at [`MOONCAKE_COMMIT`] (what `git hash-object` gives).
    pub git_blob: &'static str,
}

pub const MOONCAKE: [PublicTrace; 3] = [
    PublicTrace {
        file: "conversation_trace.jsonl",
        label: "Mooncake FAST'25 conversation trace (12,031 requests, one hour of Kimi chat)",
        git_blob: "5a371794b81d7fc7487ec8a02a2c631bcc7fbdf8",
    },
    PublicTrace {
        file: "synthetic_trace.jsonl",
        label: "Mooncake FAST'25 synthetic trace (3,993 requests, a published file its authors synthesised)",
        git_blob: "e4838049c0dcfc358a5f24ab08251279475cba94",
    },
    PublicTrace {
        file: "toolagent_trace.jsonl",
        label: "Mooncake FAST'25 tool-and-agent trace",
        git_blob: "b765599d1e0828b37f68d481563c385d3c11de54",
    },
];

impl PublicTrace {
    /// The file's URL at the pinned commit.
    pub fn url(&self) -> String {
        format!(
            "https://raw.githubusercontent.com/kvcache-ai/Mooncake/{MOONCAKE_COMMIT}/FAST25-release/traces/{}",
            self.file
        )
    }
}

/// Where a trace workload finds its file and how its lengths are scaled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceOptions {
    /// Directory of the Mooncake files (None: the variable, else the default).
    pub dir: Option<PathBuf>,
    /// The file of `trace-file`.
    pub file: Option<PathBuf>,
    /// Multiplies input lengths and the 512-token block size alike (so the
    /// sharing structure is kept); per simulator preset by default
    /// (`SimPreset::trace_input_scale`).
    pub input_scale: f64,
    /// Multiplies output lengths.
    pub output_scale: f64,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            dir: None,
            file: None,
            input_scale: 1.0,
            output_scale: 1.0,
        }
    }
}

impl TraceOptions {
    /// The directory the Mooncake files are read from.
    pub fn directory(&self) -> PathBuf {
        self.dir
            .clone()
            .or_else(|| std::env::var_os(TRACE_DIR_ENV).map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_TRACE_DIR))
    }

    /// The file `kind` replays, or why there is none.
    pub fn path_of(&self, kind: WorkloadKind) -> Result<PathBuf, String> {
        if kind == WorkloadKind::TraceFile {
            return self
                .file
                .clone()
                .ok_or_else(|| "trace-file needs --replay-trace FILE".to_string());
        }
        let trace = kind
            .trace_file()
            .ok_or_else(|| format!("`{}` replays no trace", kind.name()))?;
        let path = self.directory().join(trace.file);
        if path.exists() {
            Ok(path)
        } else {
            Err(missing(&path, trace))
        }
    }
}

fn missing(path: &Path, trace: &PublicTrace) -> String {
    format!(
        "{} not found: `python3 scripts/fetch_traces.py --dir {}` downloads it from {} (checked against its git blob {}), or set {TRACE_DIR_ENV} / --trace-dir to a directory holding a copy",
        path.display(),
        path.parent().map_or(".".into(), |d| d.display().to_string()),
        trace.url(),
        trace.git_blob
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_trace_workload_names_its_file_and_a_missing_one_says_how_to_get_it() {
        for kind in [
            WorkloadKind::MooncakeConversation,
            WorkloadKind::MooncakeSynthetic,
            WorkloadKind::MooncakeToolagent,
        ] {
            let trace = kind.trace_file().unwrap();
            assert!(trace.url().ends_with(trace.file) && trace.url().contains(MOONCAKE_COMMIT));
            let options = TraceOptions {
                dir: Some(PathBuf::from("/nonexistent-dir")),
                ..TraceOptions::default()
            };
            let err = options.path_of(kind).unwrap_err();
            assert!(
                err.contains("fetch_traces.py") && err.contains(TRACE_DIR_ENV),
                "{err}"
            );
        }
        assert!(WorkloadKind::NoPrefix.trace_file().is_none());
        assert!(TraceOptions::default().path_of(WorkloadKind::TraceFile).is_err());
    }
}
