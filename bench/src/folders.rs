//! The headline's folders (`make bench`): the question each answers and the
//! README that opens it (question, command, commit, date, machine).

use std::path::Path;

use crate::provenance::Provenance;

/// The folders and their questions.
pub const QUESTIONS: [(&str, &str); 6] = [
    ("capacity", "What offered rate can the fleet sustain per workload and KV size (the clairvoyant chooser's TTFT p90 within the SLO over 10 minutes)?"),
    ("capacity-check", "Is that capacity real (85%: TTFT p90 within the SLO) and a limit (110%: TTFT grows)?"),
    ("virtual", "How do dprank, dprank on loads alone, in-server, round robin, the clairvoyant chooser and the model of smg compare across workloads, public traces, loads and KV sizes (virtual time, judging seeds)?"),
    ("harness", "With real Envoy and real smg (default and best setting), what do three cells at 85% show?"),
    ("agreement", "Does virtual time agree with the harness on TTFT p90 for dprank and in-server?"),
    ("smg-sweep", "Which smg setting is best per workload (tuning seeds)?"),
];

fn question(folder: &str) -> &'static str {
    QUESTIONS.iter().find(|(f, _)| *f == folder).map_or("", |q| q.1)
}

/// Writes `dir/README.md`: the question, the command, commit, date, machine.
pub fn folder_readme(
    dir: &Path,
    folder: &str,
    provenance: &Provenance,
    contents: &str,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let text = format!(
        "# {folder}\n\n- question: {}\n- command: `{}`\n- commit: {}\n- date: {}\n- machine: {}\n\n{contents}\n",
        question(folder),
        provenance.command,
        provenance.commit,
        provenance.date,
        provenance.machine
    );
    std::fs::write(dir.join("README.md"), text)
        .map_err(|e| format!("cannot write {}/README.md: {e}", dir.display()))
}
