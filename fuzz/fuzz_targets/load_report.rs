//! SGLang's load report parser (`load/sglang.rs`) on arbitrary bytes, and on load reports generated from
//! a specification drawn from the same bytes (`arbitrary`).
//!
//! The oracles do not parse reports the way `load/sglang.rs` does:
//! - raw bytes: never panics; `Ok` only when serde_json reads the bytes as a
//!   JSON value, with 1..=MAX_DP_SIZE ranks, and every known figure is one of
//!   the numbers in that value (rounded); `RankOutOfRange(r)` only for
//!   r > MAX_DP_SIZE (when `BadRanks` comes is checked on generated reports);
//! - generated reports: the generator first decides what each rank's figure
//!   is (or that it has none), then writes a report that says so in one of the
//!   shapes of docs/protocol.md (`/get_load` array or single object,
//!   `/v1/loads` object), hiding the figure behind unusable values in the
//!   preferred fields, among unrelated keys, with the members in any order.
//!   The expected result is the specification itself, never a reading of the
//!   generated text. Shapes that are not reports come with the error they
//!   must give.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use dprank::config::MAX_DP_SIZE;
use dprank::load::{sglang, LoadError, MAX_RANK_NUMBER};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// The first rank and the tokens per rank `sglang::parse` reads.
fn parse_load_report(body: &[u8]) -> std::result::Result<Ranks, LoadError> {
    sglang::parse(body).map(|report| (report.first_rank, report.tokens()))
}

/// A report's first rank, and its tokens rank by rank from there.
type Ranks = (u32, Vec<Option<u64>>);

/// In the order a report's figure is preferred (docs/protocol.md).
const TOKEN_FIELDS: [&str; 3] = ["num_total_tokens", "num_tokens", "num_used_tokens"];
const UNRELATED: [&str; 8] = [
    "num_reqs",
    "num_waiting_reqs",
    "num_running_reqs",
    "max_total_num_tokens",
    "token_usage",
    "ts_tic",
    "rid",
    "num_pending_tokens",
];

/// A figure as written, with the count it stands for.
#[derive(Debug)]
enum Figure {
    Int(u32),
    Huge(u64),
    /// `whole.thousandths`: stands for the nearest integer (halves up).
    Decimal {
        whole: u32,
        thousandths: u16,
    },
}

impl<'a> Arbitrary<'a> for Figure {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(match u.int_in_range(0..=5)? {
            0 => Figure::Huge(u.arbitrary()?),
            1 => Figure::Decimal {
                whole: u.int_in_range(0..=1_000_000)?,
                thousandths: u.int_in_range(0..=999)?,
            },
            _ => Figure::Int(u.arbitrary()?),
        })
    }
}

impl Figure {
    fn text(&self) -> String {
        match self {
            Figure::Int(n) => n.to_string(),
            Figure::Huge(n) => n.to_string(),
            Figure::Decimal { whole, thousandths } => format!("{whole}.{thousandths:03}"),
        }
    }
    fn count(&self) -> u64 {
        match self {
            Figure::Int(n) => u64::from(*n),
            Figure::Huge(n) => *n,
            Figure::Decimal { whole, thousandths } => u64::from(*whole) + u64::from(*thousandths >= 500),
        }
    }
}

/// A value that is no token count.
#[derive(Debug, Arbitrary)]
enum Junk {
    Null,
    Bool(bool),
    Negative(u32),
    Text(String),
    NumberAsText(u16),
    List(Vec<u8>),
    Object,
    Overflowing,
}

impl Junk {
    fn text(&self) -> String {
        match self {
            Junk::Null => "null".into(),
            Junk::Bool(b) => b.to_string(),
            Junk::Negative(n) => format!("-{}", u64::from(*n) + 1),
            Junk::Text(s) => serde_json::to_string(s).unwrap_or_default(),
            Junk::NumberAsText(n) => format!("\"{n}\""),
            Junk::List(v) => serde_json::to_string(v).unwrap_or_default(),
            Junk::Object => r#"{"num_tokens":7}"#.into(),
            Junk::Overflowing => "1e300".into(),
        }
    }
}

/// What one entry of the report says, decided before it is written. A
/// `dp_rank` of null means no rank, like an absent one.
#[derive(Debug, Arbitrary)]
struct EntrySpec {
    /// `dp_rank` (0..8), or none: the entry's position then names its rank.
    rank: Option<u8>,
    /// A `dp_rank` that is no rank: the entry must count for nothing.
    bad_rank: Option<Junk>,
    /// The rank's figure, or none (every token field junk or absent).
    figure: Option<Figure>,
    /// Which token field carries the figure (0..3).
    carrier: u8,
    /// For each token field: junk to write where no figure is (None: absent).
    decoys: [Option<Junk>; 3],
    /// A figure after the carrier, which must lose to it.
    later: Option<u32>,
    unrelated: Vec<(u8, Junk)>,
    shuffle: u64,
}

impl EntrySpec {
    fn carrier(&self) -> usize {
        usize::from(self.carrier % 3)
    }

    fn text(&self) -> String {
        let mut members: Vec<(String, String)> = Vec::new();
        match (&self.bad_rank, self.rank) {
            (Some(junk), _) => members.push(("dp_rank".into(), junk.text())),
            (None, Some(r)) => members.push(("dp_rank".into(), (r % 8).to_string())),
            (None, None) => {}
        }
        for (i, name) in TOKEN_FIELDS.iter().enumerate() {
            let value = match &self.figure {
                Some(f) if i == self.carrier() => Some(f.text()),
                Some(_) if i > self.carrier() => self.later.map(|n| n.to_string()),
                _ => self.decoys[i].as_ref().map(Junk::text),
            };
            if let Some(v) = value {
                members.push((name.to_string(), v));
            }
        }
        for (i, junk) in &self.unrelated {
            let name = UNRELATED[usize::from(*i) % UNRELATED.len()];
            if !members.iter().any(|(n, _)| n == name) {
                members.push((name.to_string(), junk.text()));
            }
        }
        let mut s = self.shuffle;
        for i in (1..members.len()).rev() {
            members.swap(i, (s % (i as u64 + 1)) as usize);
            s = s.rotate_left(7) ^ 0x9E37_79B9_7F4A_7C15;
        }
        let body: Vec<String> = members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    }
}

#[derive(Debug, Arbitrary)]
enum Shape {
    GetLoadArray,
    GetLoadSingle,
    V1Loads { aggregate: bool },
}

#[derive(Debug, Arbitrary)]
enum NotAReport {
    Scalar(Junk),
    EmptyArray,
    EmptyLoads,
    LoadsNotAList(Junk),
    ErrorObject(String),
    RankTooLarge(u16),
}

#[derive(Debug, Arbitrary)]
enum Generated {
    Report { shape: Shape, entries: Vec<EntrySpec> },
    Not(NotAReport),
}

/// The result a report written from `entries` must give: each entry names
/// its rank (or its position does), and the ranks named must be one run
/// S..S+N-1 with N the number of entries (the generator writes that as
/// `dp_rank_count` too), each once; an entry with a `dp_rank` that is no
/// rank number refuses the report.
fn expected(entries: &[EntrySpec]) -> std::result::Result<Ranks, LoadError> {
    if entries.is_empty() {
        return Err(LoadError::NoRanks);
    }
    // By rank number (below 8 + N): the figure of the entry naming it.
    let mut by_rank: Vec<Option<Option<u64>>> = vec![None; 8 + entries.len()];
    for (position, e) in entries.iter().enumerate() {
        let rank = match (&e.bad_rank, e.rank) {
            (Some(Junk::Null), _) | (None, None) => position,
            (Some(_), _) => return Err(LoadError::BadRanks(String::new())),
            (None, Some(r)) => usize::from(r % 8),
        };
        match &mut by_rank[rank] {
            slot @ None => *slot = Some(e.figure.as_ref().map(Figure::count)),
            Some(_) => return Err(LoadError::BadRanks("named twice".into())),
        }
    }
    let first = by_rank.iter().position(Option::is_some).unwrap_or(0);
    let run: Vec<Option<Option<u64>>> = by_rank[first..first + entries.len()].to_vec();
    if run.iter().any(Option::is_none) {
        // N different ranks, not all within S..S+N-1: a gap.
        return Err(LoadError::BadRanks("a gap".into()));
    }
    Ok((first as u32, run.into_iter().map(Option::flatten).collect()))
}

fn write(shape: &Shape, entries: &[EntrySpec]) -> String {
    let list = entries.iter().map(EntrySpec::text).collect::<Vec<_>>().join(",");
    match shape {
        Shape::GetLoadArray | Shape::GetLoadSingle => format!("[{list}]"),
        Shape::V1Loads { aggregate } => format!(
            "{{\"timestamp\":\"2026-01-01T00:00:00Z\",\"dp_rank_count\":{},\"loads\":[{list}]{}}}",
            entries.len(),
            if *aggregate {
                ",\"aggregate\":{\"num_used_tokens\":3}"
            } else {
                ""
            }
        ),
    }
}

fn same(got: &std::result::Result<Ranks, LoadError>, want: &std::result::Result<Ranks, LoadError>) -> bool {
    match (got, want) {
        (Err(LoadError::NotJson(_)), Err(LoadError::NotJson(_))) => true,
        (Err(LoadError::BadRanks(_)), Err(LoadError::BadRanks(_))) => true,
        (g, w) => g == w,
    }
}

fn check_generated(data: &[u8]) {
    let Ok(generated) = Generated::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let (text, want) = match &generated {
        Generated::Report {
            shape: Shape::GetLoadSingle,
            entries,
        } => match entries.first() {
            // A lone object is a report only if it names its rank.
            Some(e) if e.rank.is_some() && e.bad_rank.is_none() => (e.text(), expected(&entries[..1])),
            // Without a rank it is a report only if it has a token field:
            // not a question of the specification, so not asked here.
            _ => return,
        },
        Generated::Report { shape, entries } => (write(shape, entries), expected(entries)),
        Generated::Not(not) => {
            let not_json = Err(LoadError::NotJson(String::new()));
            match not {
                NotAReport::Scalar(Junk::Object | Junk::List(_)) => return,
                NotAReport::Scalar(j) => (j.text(), not_json),
                NotAReport::EmptyArray => ("[]".into(), Err(LoadError::NoRanks)),
                NotAReport::EmptyLoads => (r#"{"loads":[]}"#.into(), Err(LoadError::NoRanks)),
                NotAReport::LoadsNotAList(Junk::List(_)) => return,
                NotAReport::LoadsNotAList(j) => (format!("{{\"loads\":{}}}", j.text()), not_json),
                NotAReport::ErrorObject(s) => (
                    format!("{{\"error\":{}}}", serde_json::to_string(s).unwrap_or_default()),
                    not_json,
                ),
                NotAReport::RankTooLarge(extra) => {
                    let rank = u64::from(MAX_RANK_NUMBER) + u64::from(*extra);
                    (
                        format!(r#"[{{"dp_rank":{rank},"num_tokens":1}}]"#),
                        Err(LoadError::RankOutOfRange(rank)),
                    )
                }
            }
        }
    };
    let got = parse_load_report(text.as_bytes());
    if std::env::var_os("DPRANK_FUZZ_TRACE").is_some() {
        eprintln!("TRACE {text}\nTRACE => {got:?}");
    }
    assert!(same(&got, &want), "report {text}\n got {got:?}\nwant {want:?}");
}

/// Every number in a JSON value, as the counts it could stand for.
fn numbers(v: &Value, out: &mut Vec<u64>) {
    match v {
        Value::Number(n) => {
            out.extend(n.as_u64());
            if let Some(f) = n.as_f64().filter(|f| f.is_finite() && *f >= 0.0) {
                out.push(f.round() as u64);
            }
        }
        Value::Array(a) => a.iter().for_each(|v| numbers(v, out)),
        Value::Object(o) => o.values().for_each(|v| numbers(v, out)),
        _ => {}
    }
}

fn check_raw(data: &[u8]) {
    match parse_load_report(data) {
        Ok((_, ranks)) => {
            assert!(
                !ranks.is_empty() && ranks.len() <= MAX_DP_SIZE as usize,
                "{} ranks",
                ranks.len()
            );
            let doc: Value = serde_json::from_slice(data).expect("Ok for invalid JSON");
            let mut seen = Vec::new();
            numbers(&doc, &mut seen);
            for t in ranks.iter().flatten() {
                assert!(seen.contains(t), "tokens {t} are not a number of the report");
            }
        }
        // A rank number of MAX_RANK_NUMBER or more, more than MAX_DP_SIZE
        // ranks, or a dp_rank_count above MAX_RANK_NUMBER.
        Err(LoadError::RankOutOfRange(r)) => assert!(r > u64::from(MAX_DP_SIZE)),
        Err(LoadError::NoRanks | LoadError::NotJson(_) | LoadError::BadRanks(_)) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    check_raw(data);
    check_generated(data);
});
