//! SGLang's load endpoints: `/v1/loads?include=core`, or the older
//! `/get_load` (`load_endpoint`; `auto` falls back for good on a 404), and
//! their reports read into a [`LoadReport`]. Unusable figures are unknown,
//! never guessed; a report whose ranks are not one run S..S+N-1 is refused
//! whole ([`LoadError::BadRanks`]: docs/protocol.md, "Load reports"). Its
//! report is complete in itself; what it keeps of a worker is whether it
//! fell back ([`FellBack`]).

use super::{
    rank_run, Answer, LoadError, LoadReport, LoadSource, Poll, RankLoad, Reading, SourceMemory,
    MAX_RANK_NUMBER,
};
use crate::codec::Record;
use crate::config::{Config, LoadEndpoint};
use serde::{Deserialize, Serialize};
use serde_json::Value;

const V1_LOADS: Poll = Poll {
    path: "/v1/loads?include=core",
    accept: "application/json",
};
const GET_LOAD: Poll = Poll {
    path: "/get_load",
    accept: "application/json",
};

/// SGLang's load source, polling as `load_endpoint` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sglang {
    pub endpoint: LoadEndpoint,
}

impl Sglang {
    pub fn of(config: &Config) -> Sglang {
        Sglang {
            endpoint: config.load_endpoint,
        }
    }
}

/// What SGLang's source keeps of a worker: under `load_endpoint: auto`, that
/// it has no `/v1/loads` (poll `/get_load` from now on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FellBack(pub bool);

/// Kept in the worker's `SourceMemory`.
impl Record for FellBack {
    const TAG: [u8; 4] = *b"DPE1";
}

impl LoadSource for Sglang {
    fn poll(&self, memory: &SourceMemory) -> Poll {
        match self.endpoint {
            LoadEndpoint::GetLoad => GET_LOAD,
            LoadEndpoint::V1Loads => V1_LOADS,
            LoadEndpoint::Auto if memory.read::<FellBack>().0 => GET_LOAD,
            LoadEndpoint::Auto => V1_LOADS,
        }
    }

    fn fall_back(&self, memory: &mut SourceMemory) -> Poll {
        memory.write(&FellBack(true));
        self.poll(memory)
    }

    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer {
        match status {
            200 => match parse(body) {
                Ok(report) => Answer::Report(Reading::new(report)),
                Err(LoadError::BadRanks(why)) => Answer::Refused(why),
                Err(e) => Answer::Failed(e.to_string()),
            },
            404 if *poll == V1_LOADS && self.endpoint == LoadEndpoint::Auto => Answer::FallBack,
            code => Answer::Failed(format!("HTTP {code} from {}", poll.path)),
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
    num_running_reqs: Option<Value>,
    #[serde(default)]
    token_usage: Option<Value>,
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
    Single(Box<RankEntry>),
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

    fn rank_load(&self) -> RankLoad {
        let count = |v: &Option<Value>| v.as_ref().and_then(token_count);
        RankLoad {
            tokens: self.tokens(),
            waiting_requests: count(&self.num_waiting_reqs),
            running_requests: count(&self.num_running_reqs),
            waiting_uncached_tokens: count(&self.num_waiting_uncached_tokens),
            used_tokens: count(&self.num_used_tokens),
            capacity_tokens: count(&self.max_total_num_tokens),
            kv_usage: share(&self.token_usage),
            cache_hit_rate: share(&self.cache_hit_rate),
        }
    }
}

/// A share (0..=1); anything else is unusable.
fn share(v: &Option<Value>) -> Option<f64> {
    v.as_ref()
        .and_then(Value::as_f64)
        .filter(|h| (0.0..=1.0).contains(h))
}

/// A report of either endpoint, rank by rank.
pub fn parse(body: &[u8]) -> Result<LoadReport, LoadError> {
    let report: Report = serde_json::from_slice(body).map_err(|e| LoadError::NotJson(e.to_string()))?;
    let (entries, rank_count) = match report {
        Report::V1 { loads, dp_rank_count } => (loads, dp_rank_count),
        Report::Array(entries) => (entries, None),
        Report::Single(entry) if entry.looks_like_rank() => (vec![*entry], None),
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
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| LoadError::BadRanks(format!("dp_rank_count {v} is not a count")))?,
        ),
    };
    if let Some(count) = count.filter(|c| *c > u64::from(MAX_RANK_NUMBER)) {
        return Err(LoadError::RankOutOfRange(count));
    }
    let numbers = entries
        .iter()
        .enumerate()
        .map(|(index, entry)| match &entry.dp_rank {
            None => Ok(index as u64),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| LoadError::BadRanks(format!("dp_rank {v} is not a rank number"))),
        })
        .collect::<Result<Vec<u64>, LoadError>>()?;
    let (first, n) = rank_run(numbers.iter().copied(), count)?;
    let mut ranks: Vec<RankLoad> = vec![RankLoad::default(); n as usize];
    for (entry, number) in entries.iter().zip(numbers) {
        if let Some(slot) = ranks.get_mut((number - u64::from(first)) as usize) {
            *slot = entry.rank_load();
        }
    }
    Ok(LoadReport {
        first_rank: first,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens per rank of a report.
    fn parse_load_report(body: &[u8]) -> Result<Vec<Option<u64>>, LoadError> {
        parse(body).map(|r| r.tokens())
    }

    #[test]
    fn polls_as_load_endpoint_says_and_falls_back_on_404_only_under_auto() {
        let source = |endpoint| Sglang { endpoint };
        let first = SourceMemory::default();
        let auto = source(LoadEndpoint::Auto);
        let mut fell_back = SourceMemory::default();
        assert_eq!(auto.fall_back(&mut fell_back).path, "/get_load");
        assert_eq!(fell_back.read::<FellBack>(), FellBack(true));
        assert_eq!(auto.poll(&first).path, "/v1/loads?include=core");
        assert_eq!(auto.poll(&fell_back).path, "/get_load");
        assert_eq!(
            source(LoadEndpoint::V1Loads).poll(&fell_back).path,
            "/v1/loads?include=core"
        );
        assert_eq!(source(LoadEndpoint::GetLoad).poll(&first).path, "/get_load");
        assert_eq!(auto.answer(&auto.poll(&first), 404, b""), Answer::FallBack);
        assert_eq!(
            auto.answer(&auto.poll(&fell_back), 404, b""),
            Answer::Failed("HTTP 404 from /get_load".into())
        );
        let v1 = source(LoadEndpoint::V1Loads);
        assert!(matches!(v1.answer(&v1.poll(&first), 404, b""), Answer::Failed(_)));
        assert_eq!(
            auto.answer(&auto.poll(&first), 503, b""),
            Answer::Failed("HTTP 503 from /v1/loads?include=core".into())
        );
        let report = auto.answer(&auto.poll(&first), 200, br#"[{"num_tokens":4}]"#);
        assert!(
            matches!(report, Answer::Report(r) if r.readout::<LoadReport>().unwrap().tokens() == [Some(4)])
        );
        let twice = br#"[{"dp_rank":0},{"dp_rank":0}]"#;
        assert!(
            matches!(auto.answer(&auto.poll(&first), 200, twice), Answer::Refused(why) if why.contains("twice"))
        );
        assert!(matches!(
            auto.answer(&auto.poll(&first), 200, b"<html>"),
            Answer::Failed(_)
        ));
    }

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
        let report = parse(body).unwrap();
        assert_eq!(report.tokens(), vec![Some(1), Some(5)]);
        assert_eq!(
            report.ranks[1],
            RankLoad {
                tokens: Some(5),
                waiting_uncached_tokens: Some(700),
                waiting_requests: Some(3),
                capacity_tokens: Some(200000),
                cache_hit_rate: Some(0.625),
                ..RankLoad::default()
            }
        );
        assert_eq!(
            report.ranks[0],
            RankLoad {
                tokens: Some(1),
                ..RankLoad::default()
            },
            "unusable figures are unknown"
        );
        let get_load =
            parse(br#"[{"dp_rank":0,"num_tokens":3,"num_running_reqs":2,"token_usage":0.5}]"#).unwrap();
        assert_eq!(
            get_load.ranks,
            vec![RankLoad {
                tokens: Some(3),
                running_requests: Some(2),
                kv_usage: Some(0.5),
                ..RankLoad::default()
            }]
        );
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
    fn ranks_must_be_one_run() {
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
        assert!(refused(gap).contains("no entry for rank 2 of 4"));
        let beyond =
            br#"{"dp_rank_count":1,"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":1,"num_tokens":1}]}"#;
        assert!(refused(beyond).contains("rank 1 with 1 ranks"));
        assert!(refused(br#"{"dp_rank_count":"2","loads":[{"dp_rank":0}]}"#).contains("not a count"));
        let null = br#"{"dp_rank_count":null,"loads":[{"dp_rank":0,"num_tokens":3}]}"#;
        assert_eq!(
            parse_load_report(null).unwrap(),
            vec![Some(3)],
            "null: count the entries"
        );
        assert_eq!(
            parse_load_report(br#"{"dp_rank_count":70000,"loads":[{"dp_rank":0}]}"#),
            Err(LoadError::RankOutOfRange(70000))
        );
    }

    #[test]
    fn ranks_are_named_as_the_server_names_them() {
        // A lone object names its rank: SGLang's port of rank 3 reports it alone.
        let one = parse(br#"{"dp_rank":3,"num_tokens":7}"#).unwrap();
        assert_eq!((one.first_rank, one.tokens()), (3, vec![Some(7)]));
        // A node of a DP-8 group reports ranks 4..7, of 8 or on their own.
        for count in ["", r#""dp_rank_count":8,"#] {
            let body = format!(
                r#"{{{count}"loads":[{{"dp_rank":5,"num_tokens":2}},{{"dp_rank":4,"num_tokens":1}},{{"dp_rank":6}},{{"dp_rank":7,"num_tokens":4}}]}}"#
            );
            let node = parse(body.as_bytes()).unwrap();
            assert_eq!(
                (node.first_rank, node.tokens()),
                (4, vec![Some(1), Some(2), None, Some(4)])
            );
        }
        // Its ranks still make one run, no more than the count it states.
        assert!(refused(br#"[{"dp_rank":4},{"dp_rank":6}]"#).contains("no rank 5"));
        assert!(
            refused(br#"{"dp_rank_count":2,"loads":[{"dp_rank":4},{"dp_rank":5},{"dp_rank":6}]}"#)
                .contains("rank 6 with 2 ranks")
        );
        // A rank port states its own count.
        let port = parse(br#"{"dp_rank_count":1,"loads":[{"dp_rank":3,"num_tokens":5}]}"#).unwrap();
        assert_eq!((port.first_rank, port.tokens()), (3, vec![Some(5)]));
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
