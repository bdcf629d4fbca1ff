//! Parsing of the workers' load reports (`/v1/loads` and `/get_load`) into
//! tokens per rank. Unknown keys are ignored; a rank whose figures are missing
//! or unusable is reported as unknown rather than guessed.

use crate::config::MAX_DP_SIZE;
use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// Tokens per rank, indexed by `dp_rank`; `None` = the report said nothing usable.
pub type RankTokens = Vec<Option<u64>>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    NotJson(String),
    NoRanks,
    RankOutOfRange(u64),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotJson(e) => write!(f, "load report is not a known JSON shape: {e}"),
            LoadError::NoRanks => write!(f, "load report lists no ranks"),
            LoadError::RankOutOfRange(r) => {
                write!(f, "load report names dp_rank {r} (limit {MAX_DP_SIZE})")
            }
        }
    }
}

#[derive(Deserialize)]
struct RankEntry {
    #[serde(default)]
    dp_rank: Option<Value>,
    #[serde(default)]
    num_total_tokens: Option<Value>,
    #[serde(default)]
    num_tokens: Option<Value>,
    #[serde(default)]
    num_used_tokens: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Report {
    /// `/v1/loads`: `{"loads":[...], ...}`
    V1 { loads: Vec<RankEntry> },
    /// `/get_load`: one object per rank.
    Array(Vec<RankEntry>),
    /// `/get_load` on builds that return a single object.
    Single(RankEntry),
}

/// A non-negative token count; finite floats are rounded to the nearest integer.
fn token_count(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && *f <= u64::MAX as f64)
                .map(|f| f.round() as u64)
        }),
        _ => None,
    }
}

impl RankEntry {
    fn looks_like_rank(&self) -> bool {
        self.dp_rank.is_some()
            || self.num_total_tokens.is_some()
            || self.num_tokens.is_some()
            || self.num_used_tokens.is_some()
    }

    /// Preference order (docs/protocol.md): total (used + pending), then the
    /// legacy `num_tokens`, then used KV only.
    fn tokens(&self) -> Option<u64> {
        [&self.num_total_tokens, &self.num_tokens, &self.num_used_tokens]
            .into_iter()
            .flatten()
            .find_map(token_count)
    }
}

pub fn parse_load_report(body: &[u8]) -> Result<RankTokens, LoadError> {
    let report: Report = serde_json::from_slice(body).map_err(|e| LoadError::NotJson(e.to_string()))?;
    let entries = match report {
        Report::V1 { loads } => loads,
        Report::Array(entries) => entries,
        Report::Single(entry) if entry.looks_like_rank() => vec![entry],
        Report::Single(_) => {
            return Err(LoadError::NotJson(
                "an object with neither `loads` nor rank fields".into(),
            ))
        }
    };
    if entries.is_empty() {
        return Err(LoadError::NoRanks);
    }
    let mut ranks: RankTokens = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let rank = match &entry.dp_rank {
            None => index as u64,
            Some(v) => match v.as_u64() {
                Some(r) => r,
                None => continue,
            },
        };
        if rank >= u64::from(MAX_DP_SIZE) {
            return Err(LoadError::RankOutOfRange(rank));
        }
        let rank = rank as usize;
        if ranks.len() <= rank {
            ranks.resize(rank + 1, None);
        }
        if let Some(slot) = ranks.get_mut(rank) {
            *slot = entry.tokens();
        }
    }
    if ranks.is_empty() {
        return Err(LoadError::NoRanks);
    }
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_load_array_with_extra_keys() {
        let body = br#"[{"dp_rank":0,"num_reqs":3,"num_waiting_reqs":1,"num_tokens":5120,"ts_tic":1.5,"rid":null},
                        {"dp_rank":1,"num_reqs":0,"num_waiting_reqs":0,"num_tokens":0,"http_worker_ipc":"x"}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(5120), Some(0)]);
    }

    #[test]
    fn get_load_single_object() {
        assert_eq!(
            parse_load_report(br#"{"dp_rank":0,"num_tokens":7}"#).unwrap(),
            vec![Some(7)]
        );
    }

    #[test]
    fn v1_loads_prefers_total_then_used() {
        let body = br#"{"timestamp":"t","version":"v","dp_rank_count":2,
            "loads":[{"dp_rank":0,"num_used_tokens":4096,"num_total_tokens":5000,"max_total_num_tokens":200000},
                     {"dp_rank":1,"num_used_tokens":100,"token_usage":0.0}],
            "aggregate":{"total":1}}"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(5000), Some(100)]);
    }

    #[test]
    fn ranks_out_of_order_and_gaps() {
        let body = br#"[{"dp_rank":2,"num_tokens":9},{"dp_rank":0,"num_tokens":1}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(1), None, Some(9)]);
    }

    #[test]
    fn missing_dp_rank_uses_position() {
        assert_eq!(
            parse_load_report(br#"[{"num_tokens":3},{"num_tokens":4}]"#).unwrap(),
            vec![Some(3), Some(4)]
        );
    }

    #[test]
    fn unusable_token_fields_make_the_rank_unknown() {
        let body = br#"[{"dp_rank":0,"num_tokens":-5},{"dp_rank":1,"num_tokens":"12"},{"dp_rank":2},
                        {"dp_rank":3,"num_tokens":12.0}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![None, None, None, Some(12)]);
    }

    #[test]
    fn huge_token_counts_saturate_instead_of_failing() {
        let body = br#"[{"dp_rank":0,"num_tokens":1e300},{"dp_rank":1,"num_tokens":18446744073709551615}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![None, Some(u64::MAX)]);
    }

    #[test]
    fn bad_dp_rank_entries_are_skipped() {
        let body = br#"[{"dp_rank":"zero","num_tokens":1},{"dp_rank":1,"num_tokens":2}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![None, Some(2)]);
    }

    #[test]
    fn an_unusable_preferred_field_falls_through_to_the_next() {
        let body = br#"{"loads":[{"dp_rank":0,"num_total_tokens":-5,"num_used_tokens":100},
                                  {"dp_rank":1,"num_total_tokens":"x","num_tokens":7,"num_used_tokens":1}]}"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(100), Some(7)]);
    }

    #[test]
    fn fractions_round_and_duplicates_keep_the_last() {
        let body =
            br#"[{"dp_rank":0,"num_tokens":12.5},{"dp_rank":1,"num_tokens":1},{"dp_rank":1,"num_tokens":9},
                        {"dp_rank":2.0,"num_tokens":4},{"dp_rank":-1,"num_tokens":4}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(13), Some(9)]);
    }

    #[test]
    fn a_null_entry_or_null_loads_fail_the_report() {
        assert!(matches!(
            parse_load_report(br#"{"loads":[null]}"#),
            Err(LoadError::NotJson(_))
        ));
        assert!(matches!(
            parse_load_report(br#"{"loads":null}"#),
            Err(LoadError::NotJson(_))
        ));
    }

    #[test]
    fn huge_dp_rank_rejected() {
        assert_eq!(
            parse_load_report(br#"[{"dp_rank":100000000,"num_tokens":1}]"#),
            Err(LoadError::RankOutOfRange(100000000))
        );
    }

    #[test]
    fn malformed_and_truncated_rejected() {
        assert!(matches!(parse_load_report(b"<html>"), Err(LoadError::NotJson(_))));
        assert!(matches!(
            parse_load_report(br#"[{"dp_rank":0,"num_tok"#),
            Err(LoadError::NotJson(_))
        ));
        assert!(matches!(parse_load_report(b""), Err(LoadError::NotJson(_))));
        assert!(matches!(parse_load_report(b"42"), Err(LoadError::NotJson(_))));
        assert!(matches!(
            parse_load_report(br#"{"error":"busy"}"#),
            Err(LoadError::NotJson(_))
        ));
        assert!(matches!(
            parse_load_report(br#"{"loads":"x"}"#),
            Err(LoadError::NotJson(_))
        ));
    }

    #[test]
    fn empty_lists_rejected() {
        assert_eq!(parse_load_report(b"[]"), Err(LoadError::NoRanks));
        assert_eq!(parse_load_report(br#"{"loads":[]}"#), Err(LoadError::NoRanks));
    }
}
