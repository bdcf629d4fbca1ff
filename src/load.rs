//! Parsing of the workers' load reports (`/v1/loads` and `/get_load`) into
//! tokens per rank. Unknown keys are ignored; a rank whose figures are missing
//! or unusable is reported as unknown rather than guessed. The ranks
//! themselves must make sense: exactly 0..N-1, each once, where N is the
//! report's `dp_rank_count` or else its number of entries. A report naming
//! any other rank, a rank twice, or leaving a gap is refused whole
//! ([`LoadError::BadRanks`]): a rank dprank cannot trust is a rank it might
//! write into a request, and the server answers that with a 400.

use crate::config::MAX_DP_SIZE;
use crate::state::RankFigures;
use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// Tokens per rank, indexed by `dp_rank`; `None` = the report said nothing usable.
pub type RankTokens = Vec<Option<u64>>;

/// A report's tokens per rank and the figures prefix affinity reads (those
/// of ranks the report lists without tokens are kept too).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadReport {
    pub tokens: RankTokens,
    pub figures: Vec<RankFigures>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    NotJson(String),
    NoRanks,
    RankOutOfRange(u64),
    /// The ranks are not exactly 0..N-1 (another rank, a duplicate, a gap,
    /// or a `dp_rank` that is not a rank number).
    BadRanks(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotJson(e) => write!(f, "load report is not a known JSON shape: {e}"),
            LoadError::NoRanks => write!(f, "load report lists no ranks"),
            LoadError::RankOutOfRange(r) => {
                write!(f, "load report names dp_rank {r} (limit {MAX_DP_SIZE})")
            }
            LoadError::BadRanks(why) => write!(f, "load report refused: its ranks are not 0..N-1 ({why})"),
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
    #[serde(default)]
    num_waiting_uncached_tokens: Option<Value>,
    #[serde(default)]
    num_waiting_reqs: Option<Value>,
    #[serde(default)]
    max_total_num_tokens: Option<Value>,
    #[serde(default)]
    cache_hit_rate: Option<Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Report {
    /// `/v1/loads`: `{"loads":[...], "dp_rank_count": N, ...}`
    V1 {
        loads: Vec<RankEntry>,
        #[serde(default)]
        dp_rank_count: Option<Value>,
    },
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

    fn figures(&self) -> RankFigures {
        RankFigures {
            waiting_uncached: self.num_waiting_uncached_tokens.as_ref().and_then(token_count),
            waiting_requests: self.num_waiting_reqs.as_ref().and_then(token_count),
            used: self.num_used_tokens.as_ref().and_then(token_count),
            capacity: self.max_total_num_tokens.as_ref().and_then(token_count),
            cache_hit_rate: self
                .cache_hit_rate
                .as_ref()
                .and_then(Value::as_f64)
                .filter(|h| (0.0..=1.0).contains(h)),
        }
    }
}

/// Tokens per rank of a report.
pub fn parse_load_report(body: &[u8]) -> Result<RankTokens, LoadError> {
    parse_load_details(body).map(|report| report.tokens)
}

/// Tokens per rank and the figures prefix affinity reads.
pub fn parse_load_details(body: &[u8]) -> Result<LoadReport, LoadError> {
    let report: Report = serde_json::from_slice(body).map_err(|e| LoadError::NotJson(e.to_string()))?;
    let (entries, rank_count) = match report {
        Report::V1 { loads, dp_rank_count } => (loads, dp_rank_count),
        Report::Array(entries) => (entries, None),
        Report::Single(entry) if entry.looks_like_rank() => (vec![entry], None),
        Report::Single(_) => {
            return Err(LoadError::NotJson(
                "an object with neither `loads` nor rank fields".into(),
            ))
        }
    };
    if entries.is_empty() {
        return Err(LoadError::NoRanks);
    }
    let count = match &rank_count {
        None | Some(Value::Null) => entries.len() as u64,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| LoadError::BadRanks(format!("dp_rank_count {v} is not a count")))?,
    };
    if count > u64::from(MAX_DP_SIZE) {
        return Err(LoadError::RankOutOfRange(count));
    }
    let mut ranks: RankTokens = vec![None; count as usize];
    let mut figures: Vec<RankFigures> = vec![RankFigures::default(); count as usize];
    let mut seen = vec![false; count as usize];
    for (index, entry) in entries.iter().enumerate() {
        let rank = match &entry.dp_rank {
            None => index as u64,
            Some(v) => v
                .as_u64()
                .ok_or_else(|| LoadError::BadRanks(format!("dp_rank {v} is not a rank number")))?,
        };
        if rank >= u64::from(MAX_DP_SIZE) {
            return Err(LoadError::RankOutOfRange(rank));
        }
        let Some(first) = seen.get_mut(rank as usize) else {
            return Err(LoadError::BadRanks(format!("dp_rank {rank} with {count} ranks")));
        };
        if std::mem::replace(first, true) {
            return Err(LoadError::BadRanks(format!("dp_rank {rank} listed twice")));
        }
        if let Some(slot) = ranks.get_mut(rank as usize) {
            *slot = entry.tokens();
        }
        if let Some(slot) = figures.get_mut(rank as usize) {
            *slot = entry.figures();
        }
    }
    if let Some(gap) = seen.iter().position(|s| !s) {
        return Err(LoadError::BadRanks(format!(
            "no entry for dp_rank {gap} of {count}"
        )));
    }
    Ok(LoadReport {
        tokens: ranks,
        figures,
    })
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
    fn v1_loads_figures_for_prefix_affinity() {
        let body = br#"{"loads":[{"dp_rank":1,"num_total_tokens":5,"num_waiting_uncached_tokens":700,"num_waiting_reqs":3,
                                   "max_total_num_tokens":200000,"cache_hit_rate":0.625},
                                  {"dp_rank":0,"num_total_tokens":1,"cache_hit_rate":1.5,
                                   "num_waiting_uncached_tokens":-1}]}"#;
        let report = parse_load_details(body).unwrap();
        assert_eq!(report.tokens, vec![Some(1), Some(5)]);
        assert_eq!(
            report.figures[1],
            RankFigures {
                waiting_uncached: Some(700),
                waiting_requests: Some(3),
                used: None,
                capacity: Some(200000),
                cache_hit_rate: Some(0.625),
            }
        );
        assert_eq!(
            report.figures[0],
            RankFigures::default(),
            "unusable figures are unknown"
        );
        let get_load = parse_load_details(br#"[{"dp_rank":0,"num_tokens":3}]"#).unwrap();
        assert_eq!(get_load.figures, vec![RankFigures::default()]);
    }

    #[test]
    fn ranks_out_of_order() {
        let body = br#"[{"dp_rank":2,"num_tokens":9},{"dp_rank":0,"num_tokens":1},{"dp_rank":1}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(1), None, Some(9)]);
    }

    fn refused(body: &[u8]) -> String {
        match parse_load_report(body) {
            Err(LoadError::BadRanks(why)) => why,
            other => panic!("{} gave {other:?}", String::from_utf8_lossy(body)),
        }
    }

    #[test]
    fn ranks_must_be_exactly_zero_to_n_minus_one() {
        // The report from issue 14: rank 99 on a worker with two entries.
        assert!(
            refused(br#"{"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":99,"num_tokens":0}]}"#)
                .contains("99")
        );
        assert!(
            refused(br#"[{"dp_rank":0,"num_tokens":1},{"dp_rank":0,"num_tokens":2},{"dp_rank":1}]"#)
                .contains("twice")
        );
        assert!(refused(br#"[{"dp_rank":2,"num_tokens":9},{"dp_rank":0,"num_tokens":1}]"#).contains("2"));
        // A position stands for the rank: a duplicate of a named one is refused too.
        assert!(refused(br#"[{"dp_rank":1,"num_tokens":1},{"num_tokens":2}]"#).contains("twice"));
    }

    #[test]
    fn dp_rank_count_sets_n_when_present() {
        let gap =
            br#"{"dp_rank_count":4,"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":1,"num_tokens":1}]}"#;
        assert!(refused(gap).contains("no entry for dp_rank 2 of 4"));
        let beyond =
            br#"{"dp_rank_count":1,"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":1,"num_tokens":1}]}"#;
        assert!(refused(beyond).contains("dp_rank 1 with 1 ranks"));
        assert!(refused(br#"{"dp_rank_count":"2","loads":[{"dp_rank":0}]}"#).contains("not a count"));
        let null = br#"{"dp_rank_count":null,"loads":[{"dp_rank":0,"num_tokens":3}]}"#;
        assert_eq!(
            parse_load_report(null).unwrap(),
            vec![Some(3)],
            "null: count the entries"
        );
        assert_eq!(
            parse_load_report(br#"{"dp_rank_count":5000,"loads":[{"dp_rank":0}]}"#),
            Err(LoadError::RankOutOfRange(5000))
        );
    }

    #[test]
    fn a_lone_object_must_be_rank_zero() {
        assert!(refused(br#"{"dp_rank":3,"num_tokens":7}"#).contains("dp_rank 3 with 1 ranks"));
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
    fn a_dp_rank_that_is_no_rank_number_refuses_the_report() {
        for bad in [r#""zero""#, "2.0", "-1", "true", "[1]"] {
            let body = format!(r#"[{{"dp_rank":{bad},"num_tokens":1}},{{"dp_rank":1,"num_tokens":2}}]"#);
            assert!(refused(body.as_bytes()).contains("is not a rank number"), "{bad}");
        }
        let null = br#"[{"dp_rank":null,"num_tokens":1},{"dp_rank":1,"num_tokens":2}]"#;
        assert_eq!(
            parse_load_report(null).unwrap(),
            vec![Some(1), Some(2)],
            "null: its position"
        );
    }

    #[test]
    fn an_unusable_preferred_field_falls_through_to_the_next() {
        let body = br#"{"loads":[{"dp_rank":0,"num_total_tokens":-5,"num_used_tokens":100},
                                  {"dp_rank":1,"num_total_tokens":"x","num_tokens":7,"num_used_tokens":1}]}"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(100), Some(7)]);
    }

    #[test]
    fn fractions_round() {
        let body = br#"[{"dp_rank":0,"num_tokens":12.5},{"dp_rank":1,"num_tokens":8.49}]"#;
        assert_eq!(parse_load_report(body).unwrap(), vec![Some(13), Some(8)]);
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

pub mod prometheus;
pub mod vllm;
