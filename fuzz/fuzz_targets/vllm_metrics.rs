//! `parse_vllm_metrics` (and the line reader under it) on arbitrary bytes,
//! and on `/metrics` answers generated from a specification drawn from the
//! same bytes (`arbitrary`); the vLLM load source's answer and the mapping
//! of a report into load figures, over polls, on both.
//!
//! The oracles do not read the text the way `load/vllm.rs` does:
//! - raw bytes: never panics; `prometheus::lines` gives one line per line
//!   feed, plus one for an unterminated tail; `Ok` only with 1..=MAX_DP_SIZE
//!   engines, the first 64 engine numbers written in the body as `"N"`,
//!   KV usage within 0..=1; reading again with the model name it reported
//!   gives the same report; `TooLarge` only above the limit.
//! - generated answers: engines S..S+N-1 (S = 0, or up to 16 as on a
//!   second node); the generator first decides every line (which
//!   engine, figure, value and model a sample of dprank's carries, or that
//!   it is unrelated), then writes them in one of the shapes prometheus_client
//!   gives vLLM (single process with `_created` families, multiprocess,
//!   OpenMetrics with `vllm_` or `vllm:` sample names), with labels in any
//!   order among others, blanks, timestamps, CRLF, comments, other families
//!   carrying engine labels of any kind, and now and then one fault: a
//!   duplicate, a gap, an engine label that is no engine number or is
//!   missing, one beyond MAX_RANK_NUMBER, a second model, a broken line, a cut
//!   last line. The expected result is computed from those decisions, never
//!   from the text.
//! - the source and the mapping (every readable answer, read as three polls
//!   a drawn time apart with a drawn mean request): the source reports only
//!   a readable answer ending with a line feed whose engines all have their
//!   running, waiting and KV figures, refuses only bad engines; per rank,
//!   KV in use is at most the engine's share of the capacity, tokens are KV
//!   in use (or running x mean) plus waiting x mean, waiting uncached at
//!   most waiting x mean, a hit rate within 0..=1; the memory stays within
//!   its limits and a first poll knows no hit rate.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use dprank::config::MAX_DP_SIZE;
use dprank::load::prometheus::{self, Line};
use dprank::load::vllm::mapping::{rank_loads, CacheCounters};
use dprank::load::vllm::{
    parse_vllm_metrics, EngineFigures, Vllm, VllmMetricsError, VllmReport, MAX_METRICS_BYTES,
};
use dprank::load::{Answer, LoadSource, Reading, ReportContext, SourceMemory, MAX_RANK_NUMBER};
use libfuzzer_sys::fuzz_target;

const FIGURES: [&str; 5] = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
];
const KV: usize = 2;
/// Model names, unescaped; written escaped.
const MODELS: [&str; 5] = ["Qwen/Qwen3-8B", "m", "we\"ird\\name\nx", "", "模型 ü"];

/// A value as written, with what it must read as.
#[derive(Debug, Clone, Copy)]
enum Value {
    Int(u32),
    /// `whole.thousandths`: a count rounds it (halves up), KV usage takes it as is.
    Decimal {
        whole: u16,
        thousandths: u16,
    },
    /// Written `d.ddde+XX` as Go and prometheus_client write large numbers.
    Exponent(u32),
    Nan,
    PlusInf,
    MinusInf,
    Negative(u16),
}

impl<'a> Arbitrary<'a> for Value {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(match u.int_in_range(0..=12)? {
            0 => Value::Nan,
            1 => Value::PlusInf,
            2 => Value::MinusInf,
            3 => Value::Negative(u.arbitrary()?),
            4..=6 => Value::Decimal {
                whole: u.int_in_range(0..=3)?,
                thousandths: u.int_in_range(0..=999)?,
            },
            7 | 8 => Value::Exponent(u.arbitrary()?),
            _ => Value::Int(u.arbitrary()?),
        })
    }
}

impl Value {
    fn text(self, u: &mut Unstructured<'_>) -> String {
        match self {
            Value::Int(n) => match u.int_in_range(0..=2).unwrap_or(0) {
                0 => format!("{n}.0"),
                1 => n.to_string(),
                _ => format!("+{n}"),
            },
            Value::Decimal { whole, thousandths } => format!("{whole}.{thousandths:03}"),
            Value::Exponent(n) => {
                let digits = n.to_string();
                let (first, rest) = digits.split_at(1);
                let rest = rest.trim_end_matches('0');
                let dot = if rest.is_empty() {
                    String::new()
                } else {
                    format!(".{rest}")
                };
                format!("{first}{dot}e+{:02}", digits.len() - 1)
            }
            Value::Nan => "NaN".into(),
            Value::PlusInf => "+Inf".into(),
            Value::MinusInf => "-Inf".into(),
            Value::Negative(n) => format!("-{}.5", u32::from(n) + 1),
        }
    }

    fn count(self) -> Option<u64> {
        match self {
            Value::Int(n) | Value::Exponent(n) => Some(u64::from(n)),
            Value::Decimal { whole, thousandths } => Some(u64::from(whole) + u64::from(thousandths >= 500)),
            _ => None,
        }
    }

    fn fraction(self) -> Option<f64> {
        let v = match self {
            Value::Int(n) | Value::Exponent(n) => f64::from(n),
            Value::Decimal { whole, thousandths } => f64::from(whole) + f64::from(thousandths) / 1000.0,
            _ => return None,
        };
        (v <= 1.0).then_some(v)
    }
}

/// A sample of dprank's figures, decided before it is written.
#[derive(Debug, Clone)]
struct Ours {
    engine: EngineLabel,
    figure: usize,
    value: Value,
    /// Index in MODELS.
    model: usize,
    /// Written so that the line breaks the format.
    broken: bool,
}

#[derive(Debug, Clone)]
enum EngineLabel {
    Number(usize),
    Missing,
    /// Written as is: no engine number.
    Junk(&'static str),
    TooLarge(u64),
}

#[derive(Debug, Arbitrary)]
enum Shape {
    SingleProcess,
    Multiprocess,
    OpenMetrics,
    OpenMetricsBeforeUtf8,
}

#[derive(Debug, Arbitrary)]
enum Fault {
    Duplicate { engine: u8, figure: u8 },
    Gap { engine: u8 },
    JunkEngine { at: u8, junk: u8 },
    MissingEngine { at: u8 },
    EngineTooLarge { at: u8, extra: u32 },
    SecondModel { at: u8 },
    Broken { at: u8 },
    CutLastLine,
}

#[derive(Debug, Arbitrary)]
struct Spec {
    shape: Shape,
    /// 1..=12 engines.
    engines: u8,
    /// The first engine's number: 0, or (a node of a multi-node
    /// deployment) up to 16.
    first_engine: Option<u8>,
    /// Per engine and figure: written (with this value) or not.
    values: Vec<[Option<Value>; 5]>,
    model: u8,
    filter: bool,
    /// Samples of another model (read only without a filter: then a fault).
    other_model_lines: u8,
    crlf: bool,
    timestamps: bool,
    fault: Option<Fault>,
}

const JUNK: [&str; 8] = ["one", "01", "-1", "+1", "1.0", "", " 1", "0x1"];

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A label set with `pairs` in an order and spacing drawn from `u`, among
/// labels dprank does not read.
fn label_set(u: &mut Unstructured<'_>, mut pairs: Vec<(String, String)>) -> String {
    if u.ratio(1, 4).unwrap_or(false) {
        pairs.push(("lora_name".into(), String::new()));
    }
    if u.ratio(1, 4).unwrap_or(false) {
        pairs.push(("le".into(), "+Inf".into()));
    }
    shuffle(u, &mut pairs);
    let spaced = u.ratio(1, 5).unwrap_or(false);
    let sep = if spaced { " , " } else { "," };
    let mut text = pairs
        .iter()
        .map(|(n, v)| {
            if spaced {
                format!("{n} = \"{v}\"")
            } else {
                format!("{n}=\"{v}\"")
            }
        })
        .collect::<Vec<_>>()
        .join(sep);
    if u.ratio(1, 6).unwrap_or(false) {
        text.push(',');
    }
    format!("{{{text}}}")
}

fn shuffle<T>(u: &mut Unstructured<'_>, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = u.int_in_range(0..=i).unwrap_or(0);
        items.swap(i, j);
    }
}

/// A line as decided: its text, and what it is to the reader.
struct Written {
    text: String,
    ours: Option<Ours>,
}

fn sample_name(shape: &Shape, figure: &str) -> String {
    match shape {
        Shape::OpenMetrics => format!("vllm_{figure}"),
        _ => format!("vllm:{figure}"),
    }
}

fn sample_line(u: &mut Unstructured<'_>, spec: &Spec, ours: &Ours) -> String {
    let mut pairs = Vec::new();
    match &ours.engine {
        EngineLabel::Number(n) => pairs.push(("engine".to_string(), n.to_string())),
        EngineLabel::Missing => {}
        EngineLabel::Junk(j) => pairs.push(("engine".to_string(), j.to_string())),
        EngineLabel::TooLarge(n) => pairs.push(("engine".to_string(), n.to_string())),
    }
    pairs.push(("model_name".to_string(), escape(MODELS[ours.model])));
    let labels = label_set(u, pairs);
    let value = ours.value.text(u);
    let name = sample_name(&spec.shape, FIGURES[ours.figure]);
    let ts = if spec.timestamps { " 1764083412345" } else { "" };
    if ours.broken {
        // A label set never closed.
        return format!("{name}{} {value}{ts}", labels.trim_end_matches('}'));
    }
    format!("{name}{labels} {value}{ts}")
}

/// Families dprank does not read, some with engine labels of any kind.
fn unrelated(u: &mut Unstructured<'_>, engines: usize) -> Vec<Vec<String>> {
    let mut families = vec![
        vec![
            "# HELP python_gc_objects_collected_total Objects collected during gc".into(),
            "# TYPE python_gc_objects_collected_total counter".into(),
            "python_gc_objects_collected_total{generation=\"0\"} 12286.0".into(),
        ],
        vec!["# a comment".into(), String::new(), "   ".into()],
    ];
    let mut sleep = vec![
        "# HELP vllm:engine_sleep_state Engine sleep state".into(),
        "# TYPE vllm:engine_sleep_state gauge".into(),
    ];
    let mut hist = vec![
        "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.".into(),
        "# TYPE vllm:request_queue_time_seconds histogram".into(),
    ];
    for e in 0..engines + 2 {
        sleep.push(format!(
            "vllm:engine_sleep_state{{engine=\"{e}\",model_name=\"m\",sleep_state=\"awake\"}} 1.0"
        ));
        hist.push(format!(
            "vllm:request_queue_time_seconds_bucket{{engine=\"{e}\",le=\"0.3\",model_name=\"m\"}} 4.0"
        ));
    }
    families.push(sleep);
    families.push(hist);
    families.push(vec![
        "vllm:cache_config_info{block_size=\"16\",engine=\"\"} 1.0".into(),
        "vllm:num_preemptions_total{engine=\"x\",model_name=\"m\"} 0.0".into(),
        "vllm:prefix_cache_queries_created{engine=\"99999\",model_name=\"m\"} 1.7640834123456e+09".into(),
        "num_requests_running{engine=\"0\"} 5".into(),
    ]);
    if u.ratio(1, 3).unwrap_or(false) {
        families.push(vec!["<html><body>502 Bad Gateway</body></html>".into()]);
    }
    families
}

/// The result `lines` must give: samples of the model read (the filter's,
/// or the first one seen) name engines S..S+N-1 (one run, no gap), each
/// figure once per engine; the first problem met, in line order, is the
/// error, and a gap is found once every line is read.
fn expected(lines: &[Written], filter: Option<usize>) -> std::result::Result<Expected, VllmMetricsError> {
    let bad = || VllmMetricsError::BadEngines(String::new());
    let mut engines: Vec<(EngineFigures, u8)> = Vec::new();
    let mut model = None;
    for ours in lines.iter().filter_map(|l| l.ours.as_ref()).filter(|o| !o.broken) {
        if filter.is_some_and(|f| MODELS[f] != MODELS[ours.model]) {
            continue;
        }
        match model {
            None => model = Some(ours.model),
            Some(m) if MODELS[m] != MODELS[ours.model] => {
                return Err(VllmMetricsError::SeveralModels(String::new(), String::new()))
            }
            Some(_) => {}
        }
        let engine = match ours.engine {
            EngineLabel::Number(n) => n,
            EngineLabel::Missing | EngineLabel::Junk(_) => return Err(bad()),
            EngineLabel::TooLarge(_) => return Err(VllmMetricsError::TooManyEngines(String::new())),
        };
        if engines.len() <= engine {
            engines.resize(engine + 1, (EngineFigures::default(), 0));
        }
        let (figures, seen) = &mut engines[engine];
        if *seen & (1 << ours.figure) != 0 {
            return Err(bad());
        }
        *seen |= 1 << ours.figure;
        let v = ours.value;
        match ours.figure {
            0 => figures.running = v.count(),
            1 => figures.waiting = v.count(),
            KV => figures.kv_usage = v.fraction(),
            3 => figures.prefix_queries = v.count(),
            _ => figures.prefix_hits = v.count(),
        }
    }
    let Some(model) = model else {
        return Err(VllmMetricsError::NoFigures {
            model: None,
            seen: None,
        });
    };
    let first = engines.iter().position(|(_, seen)| *seen != 0).unwrap_or(0);
    if engines[first..].iter().any(|(_, seen)| *seen == 0) {
        return Err(bad());
    }
    Ok(Expected {
        first_engine: first as u32,
        engines: engines.into_iter().skip(first).map(|(f, _)| f).collect(),
        model_name: MODELS[model],
    })
}

/// A report as the specification says it must read.
#[derive(Debug)]
struct Expected {
    first_engine: u32,
    engines: Vec<EngineFigures>,
    model_name: &'static str,
}

fn same(
    got: &std::result::Result<VllmReport, VllmMetricsError>,
    want: &std::result::Result<Expected, VllmMetricsError>,
) -> bool {
    match (got, want) {
        (Ok(g), Ok(w)) => {
            g.model_name == w.model_name
                && g.first_engine == w.first_engine
                && g.engines.len() == w.engines.len()
                && g.engines.iter().zip(&w.engines).all(|(g, w)| {
                    let kv_same = match (g.kv_usage, w.kv_usage) {
                        (Some(a), Some(b)) => (a - b).abs() < 1e-12,
                        (a, b) => a == b,
                    };
                    kv_same
                        && (g.running, g.waiting, g.prefix_queries, g.prefix_hits)
                            == (w.running, w.waiting, w.prefix_queries, w.prefix_hits)
                })
        }
        (Err(VllmMetricsError::BadEngines(_)), Err(VllmMetricsError::BadEngines(_)))
        | (Err(VllmMetricsError::TooManyEngines(_)), Err(VllmMetricsError::TooManyEngines(_)))
        | (Err(VllmMetricsError::SeveralModels(..)), Err(VllmMetricsError::SeveralModels(..)))
        | (Err(VllmMetricsError::NoFigures { .. }), Err(VllmMetricsError::NoFigures { .. })) => true,
        _ => false,
    }
}

fn check_generated(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(spec) = Spec::arbitrary(&mut u) else { return };
    let engines = usize::from(spec.engines % 12) + 1;
    let first_engine = spec.first_engine.map_or(0, |f| usize::from(f % 17));
    let model = usize::from(spec.model) % MODELS.len();
    let other = (model + 1) % MODELS.len();
    let filter = spec.filter.then_some(model);

    // Our samples, one family per figure.
    let mut ours: Vec<Ours> = Vec::new();
    for engine in first_engine..first_engine + engines {
        let values = spec
            .values
            .get(engine - first_engine)
            .copied()
            .unwrap_or([Some(Value::Int(1)); 5]);
        for (figure, value) in values.iter().enumerate() {
            if let Some(value) = value {
                ours.push(Ours {
                    engine: EngineLabel::Number(engine),
                    figure,
                    value: *value,
                    model,
                    broken: false,
                });
            }
        }
    }
    for i in 0..usize::from(spec.other_model_lines % 4) {
        let engine = if i % 2 == 0 {
            EngineLabel::Number(i)
        } else {
            EngineLabel::Junk("zz")
        };
        ours.push(Ours {
            engine,
            figure: i % 5,
            value: Value::Int(7),
            model: other,
            broken: false,
        });
    }
    let pick = |at: u8, len: usize| usize::from(at) % len.max(1);
    let mut cut_last = false;
    match &spec.fault {
        None => {}
        Some(Fault::Duplicate { engine, figure }) => ours.push(Ours {
            engine: EngineLabel::Number(first_engine + usize::from(*engine) % engines),
            figure: usize::from(*figure) % 5,
            value: Value::Int(2),
            model,
            broken: false,
        }),
        Some(Fault::Gap { engine }) => {
            let gone = first_engine + usize::from(*engine) % engines;
            ours.retain(|o| !matches!(o.engine, EngineLabel::Number(n) if n == gone && o.model == model));
        }
        Some(Fault::JunkEngine { at, junk }) => {
            let at = pick(*at, ours.len());
            if let Some(o) = ours.get_mut(at) {
                o.engine = EngineLabel::Junk(JUNK[usize::from(*junk) % JUNK.len()]);
            }
        }
        Some(Fault::MissingEngine { at }) => {
            let at = pick(*at, ours.len());
            if let Some(o) = ours.get_mut(at) {
                o.engine = EngineLabel::Missing;
            }
        }
        Some(Fault::EngineTooLarge { at, extra }) => {
            let at = pick(*at, ours.len());
            if let Some(o) = ours.get_mut(at) {
                o.engine = EngineLabel::TooLarge(u64::from(MAX_RANK_NUMBER) + u64::from(*extra));
            }
        }
        Some(Fault::SecondModel { at }) => {
            let at = pick(*at, ours.len());
            if let Some(o) = ours.get_mut(at) {
                o.model = other;
            }
        }
        Some(Fault::Broken { at }) => {
            let at = pick(*at, ours.len());
            if let Some(o) = ours.get_mut(at) {
                o.broken = true;
            }
        }
        Some(Fault::CutLastLine) => cut_last = true,
    }

    // Families: HELP/TYPE, then the samples in any order; then the
    // families themselves in any order.
    let mut families: Vec<Vec<Written>> = Vec::new();
    for (figure, name) in FIGURES.iter().enumerate() {
        let family_name = match spec.shape {
            Shape::OpenMetrics | Shape::OpenMetricsBeforeUtf8 => {
                format!("vllm:{}", name.trim_end_matches("_total"))
            }
            _ => format!("vllm:{name}"),
        };
        let mut lines = vec![
            Written {
                text: format!("# HELP {family_name} what it is"),
                ours: None,
            },
            Written {
                text: format!(
                    "# TYPE {family_name} {}",
                    if figure >= 3 { "counter" } else { "gauge" }
                ),
                ours: None,
            },
        ];
        let mut samples: Vec<Written> = Vec::new();
        for o in ours.iter().filter(|o| o.figure == figure) {
            samples.push(Written {
                text: sample_line(&mut u, &spec, o),
                ours: Some(o.clone()),
            });
            let created = name.replace("_total", "_created");
            if figure >= 3 && matches!(spec.shape, Shape::OpenMetrics | Shape::OpenMetricsBeforeUtf8) {
                samples.push(Written {
                    text: format!(
                        "{}{{engine=\"0\",model_name=\"m\"}} 1.7640834123456e+09",
                        sample_name(&spec.shape, &created)
                    ),
                    ours: None,
                });
            }
        }
        shuffle(&mut u, &mut samples);
        lines.extend(samples);
        families.push(lines);
        if figure >= 3 && matches!(spec.shape, Shape::SingleProcess) {
            let created = name.replace("_total", "_created");
            families.push(vec![
                Written {
                    text: format!("# TYPE vllm:{created} gauge"),
                    ours: None,
                },
                Written {
                    text: format!("vllm:{created}{{engine=\"0\",model_name=\"m\"}} 1.7640834123456e+09"),
                    ours: None,
                },
            ]);
        }
    }
    for family in unrelated(&mut u, engines) {
        families.push(
            family
                .into_iter()
                .map(|text| Written { text, ours: None })
                .collect(),
        );
    }
    shuffle(&mut u, &mut families);
    let mut lines: Vec<Written> = families.into_iter().flatten().collect();
    if matches!(spec.shape, Shape::OpenMetrics | Shape::OpenMetricsBeforeUtf8) {
        lines.push(Written {
            text: "# EOF".into(),
            ours: None,
        });
    }
    if cut_last {
        // The last line loses its line feed: not read.
        if let Some(last) = lines.last_mut() {
            last.ours = None;
        }
    }
    let newline = if spec.crlf { "\r\n" } else { "\n" };
    let mut body: String = lines.iter().map(|l| format!("{}{newline}", l.text)).collect();
    if cut_last {
        body.truncate(body.len() - newline.len());
    }
    let want = expected(&lines, filter);
    let got = parse_vllm_metrics(body.as_bytes(), filter.map(|m| MODELS[m]));
    if std::env::var_os("DPRANK_FUZZ_TRACE").is_some() {
        eprintln!("TRACE {body}\nTRACE => {got:?}\nTRACE want {want:?}");
    }
    assert!(same(&got, &want), "answer:\n{body}\n got {got:?}\nwant {want:?}");
    check_source(&mut u, body.as_bytes(), filter.map(|m| MODELS[m]));
}

/// The source's answer to `body`, and its report over three polls.
fn check_source(u: &mut Unstructured<'_>, body: &[u8], model: Option<&str>) {
    let vllm = Vllm { model };
    let poll = vllm.poll(&SourceMemory::default());
    let answer = vllm.answer(&poll, 200, body);
    let parsed = parse_vllm_metrics(body, model);
    match (&answer, &parsed) {
        (Answer::Report(reading), Ok(parsed)) => {
            let report = reading.readout::<VllmReport>().expect("vLLM's readout");
            assert_eq!(report, parsed);
            assert!(body.ends_with(b"\n"), "a cut answer is no report");
            assert!(
                report
                    .engines
                    .iter()
                    .all(|e| e.running.is_some() && e.waiting.is_some() && e.kv_usage.is_some()),
                "{report:?}"
            );
        }
        (Answer::Refused(_), Err(VllmMetricsError::BadEngines(_) | VllmMetricsError::TooManyEngines(_))) => {}
        (Answer::Failed(_), _) => {
            // Bad engines are refused, unless the answer was cut short first.
            let cut = !body.is_empty() && !body.ends_with(b"\n") && body.len() <= MAX_METRICS_BYTES;
            assert!(
                cut || !matches!(
                    parsed,
                    Err(VllmMetricsError::BadEngines(_) | VllmMetricsError::TooManyEngines(_))
                )
            );
        }
        other => panic!("the source answered {other:?}"),
    }
    let Ok(report) = parsed else { return };
    let mut memory = SourceMemory::default();
    let mut now: u64 = u.int_in_range(0..=u64::MAX / 4).unwrap_or(0);
    for poll in 0..3 {
        let context = ReportContext {
            now_ms: now,
            request_tokens: u.arbitrary().unwrap_or(0),
        };
        let loads = Reading::new(report.clone()).report(&mut memory, &context);
        check_loads(&report, &loads.ranks, &context, poll == 0);
        assert!(memory.within_limits(report.engines.len()));
        now = now.saturating_add(u.int_in_range(0..=100_000).unwrap_or(0));
    }
    let mut counters = CacheCounters::default();
    let first = rank_loads(
        &report,
        &mut counters,
        &ReportContext {
            now_ms: 1,
            request_tokens: 1,
        },
    );
    assert!(first.ranks.iter().all(|r| r.cache_hit_rate.is_none()));
}

fn check_loads(report: &VllmReport, ranks: &[dprank::load::RankLoad], context: &ReportContext, first: bool) {
    assert_eq!(ranks.len(), report.engines.len());
    let mean = context.request_tokens.max(1);
    let engines = report.engines.len() as u64;
    let capacity = report.kv_capacity_tokens.map(|c| c / engines).filter(|c| *c > 0);
    for (rank, engine) in ranks.iter().zip(&report.engines) {
        assert_eq!(rank.capacity_tokens, capacity);
        assert_eq!(
            (rank.waiting_requests, rank.running_requests),
            (engine.waiting, engine.running)
        );
        if let (Some(used), Some(c)) = (rank.used_tokens, capacity) {
            assert!(used <= c, "{used} of {c}");
        }
        assert_eq!(
            rank.used_tokens.is_some(),
            capacity.is_some() && engine.kv_usage.is_some()
        );
        let queued = engine.waiting.map(|w| w.saturating_mul(mean));
        let in_use = rank
            .used_tokens
            .or(engine.running.map(|r| r.saturating_mul(mean)));
        assert_eq!(rank.tokens, in_use.zip(queued).map(|(a, b)| a.saturating_add(b)));
        if let (Some(uncached), Some(q)) = (rank.waiting_uncached_tokens, queued) {
            assert!(uncached <= q);
        }
        assert_eq!(rank.waiting_uncached_tokens.is_some(), queued.is_some());
        assert!(rank.cache_hit_rate.is_none_or(|h| (0.0..=1.0).contains(&h)));
        assert!(
            !first || rank.cache_hit_rate.is_none(),
            "a first poll knows no rate"
        );
    }
}

fn check_raw(data: &[u8]) {
    let feeds = data.iter().filter(|&&b| b == b'\n').count();
    let tail = usize::from(!data.is_empty() && !data.ends_with(b"\n"));
    let read = prometheus::lines(data).count();
    assert_eq!(read, feeds + tail, "one line per line feed");
    let unterminated = prometheus::lines(data)
        .filter(|l| *l == Line::Unterminated)
        .count();
    assert_eq!(unterminated, tail);

    match parse_vllm_metrics(data, None) {
        Ok(report) => {
            let n = report.engines.len();
            assert!((1..=MAX_DP_SIZE as usize).contains(&n), "{n} engines");
            let text = String::from_utf8_lossy(data);
            for engine in (0..n.min(64)).map(|i| report.first_engine as usize + i) {
                assert!(
                    text.contains(&format!("\"{engine}\"")),
                    "engine {engine} is not in the body"
                );
            }
            for e in &report.engines {
                assert!(e.kv_usage.is_none_or(|kv| (0.0..=1.0).contains(&kv)), "{e:?}");
            }
            let again = parse_vllm_metrics(data, Some(&report.model_name));
            assert_eq!(
                again.as_ref(),
                Ok(&report),
                "reading only its model changes the report"
            );
        }
        Err(VllmMetricsError::TooLarge(n)) => assert!(n > MAX_METRICS_BYTES),
        Err(_) => {}
    }
    check_source(&mut Unstructured::new(data), data, None);
}

fuzz_target!(|data: &[u8]| {
    check_raw(data);
    check_generated(data);
});
