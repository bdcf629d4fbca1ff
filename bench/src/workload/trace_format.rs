//! The public block-hash trace format (the Mooncake traces'): one JSON
//! object per line, `timestamp` (arrival, ms), `input_length` and
//! `output_length` (tokens) and `hash_ids`, the prompt's blocks in order,
//! each id chained on the ones before it. `replay` plays such lines;
//! `synth` writes them.

use serde::Deserialize;

/// Tokens per block in the format.
pub const BLOCK_TOKENS: u32 = 512;

/// One line of a block-hash trace.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct TraceLine {
    /// Arrival, ms.
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Parses JSONL text; blank lines are skipped; `origin` names the source in
/// errors, which carry the line number.
pub fn parse(text: &str, origin: &str) -> Result<Vec<TraceLine>, String> {
    let mut out = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: TraceLine = serde_json::from_str(line)
            .map_err(|e| format!("{origin}:{}: not a block-hash trace line: {e}", number + 1))?;
        if !parsed.timestamp.is_finite() {
            return Err(format!(
                "{origin}:{}: timestamp is not a finite number",
                number + 1
            ));
        }
        out.push(parsed);
    }
    if out.is_empty() {
        return Err(format!("{origin}: no trace lines"));
    }
    Ok(out)
}
