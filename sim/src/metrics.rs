//! vLLM mode: `GET /metrics`, the per-engine series in the Prometheus text
//! exposition (format 0.0.4) as a vLLM server writes them through
//! prometheus_client: `# HELP` and `# TYPE` per family, one sample per line,
//! labels sorted by name, values as Python floats (`3.0`, `1.7e+09` from a
//! million up), each counter as `NAME_total` followed by its `NAME_created`
//! gauge family. With one API process (0.14's default) the process and
//! Python series come first; with several (0.34's default) prometheus_client
//! runs in multiprocess mode: neither those nor the `_created` families.
//! The HELP texts are the simulator's own words. Series, labels and order
//! follow vllm/v1/metrics/loggers.py (sim/README.md, "vLLM mode").

use std::fmt::Write as _;

use crate::engine::vllm::{EngineStats, QUEUE_TIME_BUCKETS};

/// A fault injected into the exposition (tests of a reader's defences).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Garble {
    #[default]
    None,
    /// Running requests and KV usage read `NaN`.
    Nan,
    /// Engine labels that are not engine numbers (`engine="e0"`).
    WrongLabels,
    /// Padded with an unrelated series beyond 9 MiB.
    Huge,
}

/// What the exposition is made from.
#[derive(Debug, Clone, Copy)]
pub struct MetricsView<'a> {
    pub stats: &'a [EngineStats],
    /// Empty engines appended (a server reporting the wrong size).
    pub extra_engines: usize,
    /// The `engine` label of the first engine: the server's start rank
    /// (`--data-parallel-start-rank`; vLLM labels the engines an API server
    /// manages with their global ranks). The others follow.
    pub first_engine: usize,
    pub model: &'a str,
    pub block_size: u64,
    /// KV blocks of one engine. `cache_config_info` shows their sum over
    /// the server's engines, as vLLM's API server holds it (its start-up
    /// handshake adds every engine's blocks).
    pub num_gpu_blocks: u64,
    /// Unix seconds the series were created (the server's start).
    pub created: f64,
    /// prometheus_client's multiprocess mode (several API processes).
    pub multiprocess: bool,
    pub garble: Garble,
}

/// A float as prometheus_client writes it: Python's `repr`, switched to an
/// exponent from a million up (`floatToGoString`).
pub fn py_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    let repr = py_repr(value);
    if value > 0.0 {
        if let Some(dot) = repr.find('.') {
            if dot > 6 {
                let digits: String = repr.chars().filter(|c| *c != '.').collect();
                let mantissa = format!("{}.{}", &digits[..1], &digits[1..]);
                let mantissa = mantissa.trim_end_matches(['0', '.']);
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    repr
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed
/// notation for exponents -4 to 15 (with `.0` when whole), else `1.5e-05`.
fn py_repr(value: f64) -> String {
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{value:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let rest = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{}{rest}e{exp_sign}{:02}", &digits[..1], exponent.abs())
    }
}

fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('\n', r"\n")
        .replace('"', "\\\"")
}

struct Writer<'a> {
    out: String,
    view: &'a MetricsView<'a>,
}

impl Writer<'_> {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// A sample with sorted `labels` (name, value).
    fn sample(&mut self, name: &str, labels: &mut [(&str, String)], value: &str) {
        labels.sort_by(|a, b| a.0.cmp(b.0));
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {value}");
            return;
        }
        let joined: Vec<String> = labels
            .iter()
            .map(|(key, value)| format!("{key}=\"{}\"", escape(value)))
            .collect();
        let _ = writeln!(self.out, "{name}{{{}}} {value}", joined.join(","));
    }

    fn engines(&self) -> Vec<(String, EngineStats)> {
        let mut engines: Vec<(String, EngineStats)> = self
            .view
            .stats
            .iter()
            .enumerate()
            .map(|(index, stats)| ((self.view.first_engine + index).to_string(), *stats))
            .collect();
        let base = self.view.first_engine + engines.len();
        engines.extend(
            (0..self.view.extra_engines).map(|extra| ((base + extra).to_string(), EngineStats::default())),
        );
        if self.view.garble == Garble::WrongLabels {
            for (label, _) in &mut engines {
                label.insert(0, 'e');
            }
        }
        engines
    }

    fn labels(&self, engine: &str) -> Vec<(&'static str, String)> {
        vec![
            ("engine", engine.to_string()),
            ("model_name", self.view.model.to_string()),
        ]
    }

    /// A gauge per engine.
    fn gauge(&mut self, name: &str, help: &str, value: impl Fn(&EngineStats) -> String) {
        self.family(name, "gauge", help);
        for (engine, stats) in self.engines() {
            let mut labels = self.labels(&engine);
            self.sample(name, &mut labels, &value(&stats));
        }
    }

    /// A counter per engine, then its `_created` family.
    fn counter(&mut self, name: &str, help: &str, value: impl Fn(&EngineStats) -> u64) {
        let total = format!("{name}_total");
        self.family(&total, "counter", help);
        for (engine, stats) in self.engines() {
            let mut labels = self.labels(&engine);
            self.sample(&total, &mut labels, &py_float(value(&stats) as f64));
        }
        self.created(name, help, &[]);
    }

    /// The `_created` family of a counter or histogram whose children carry
    /// `extra` labels besides engine and model (one child per value list).
    fn created(&mut self, name: &str, help: &str, extra: &[Vec<(&'static str, String)>]) {
        if self.view.multiprocess {
            return;
        }
        let created = format!("{name}_created");
        self.family(&created, "gauge", help);
        let stamp = py_float(self.view.created);
        let children: Vec<Vec<(&'static str, String)>> = if extra.is_empty() {
            vec![Vec::new()]
        } else {
            extra.to_vec()
        };
        for child in &children {
            for (engine, _) in self.engines() {
                let mut labels = self.labels(&engine);
                labels.extend(child.iter().cloned());
                self.sample(&created, &mut labels, &stamp);
            }
        }
    }

    fn process_series(&mut self) {
        for (generation, collected) in [("0", 9_873.0), ("1", 1_204.0), ("2", 97.0)] {
            if generation == "0" {
                self.family(
                    "python_gc_objects_collected_total",
                    "counter",
                    "Objects the garbage collector found, by generation.",
                );
            }
            let mut labels = vec![("generation", generation.to_string())];
            self.sample(
                "python_gc_objects_collected_total",
                &mut labels,
                &py_float(collected),
            );
        }
        self.family(
            "python_info",
            "gauge",
            "The Python interpreter the server runs on.",
        );
        let mut labels = vec![
            ("implementation", "CPython".to_string()),
            ("major", "3".to_string()),
            ("minor", "12".to_string()),
            ("patchlevel", "11".to_string()),
            ("version", "3.12.11".to_string()),
        ];
        self.sample("python_info", &mut labels, "1.0");
        for (name, kind, help, value) in [
            (
                "process_virtual_memory_bytes",
                "gauge",
                "Virtual memory of the process, bytes.",
                4.2e10,
            ),
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory of the process, bytes.",
                3.1e9,
            ),
            (
                "process_start_time_seconds",
                "gauge",
                "When the process started, Unix seconds.",
                self.view.created.floor(),
            ),
            (
                "process_cpu_seconds_total",
                "counter",
                "CPU time of the process, seconds.",
                812.25,
            ),
            ("process_open_fds", "gauge", "Open file descriptors.", 211.0),
            (
                "process_max_fds",
                "gauge",
                "Most file descriptors the process may open.",
                1_048_576.0,
            ),
        ] {
            self.family(name, kind, help);
            self.sample(name, &mut [], &py_float(value));
        }
    }

    fn finish_reasons(&mut self) {
        let name = "vllm:request_success";
        let total = format!("{name}_total");
        let help = "Requests finished, by why they finished.";
        self.family(&total, "counter", help);
        let reasons = ["stop", "length", "abort", "error"];
        for reason in reasons {
            for (engine, stats) in self.engines() {
                let value = match reason {
                    "stop" => stats.finished_stop,
                    "length" => stats.finished_length,
                    "abort" => stats.finished_abort,
                    _ => 0,
                };
                let mut labels = self.labels(&engine);
                labels.push(("finished_reason", reason.to_string()));
                self.sample(&total, &mut labels, &py_float(value as f64));
            }
        }
        let extra: Vec<Vec<(&'static str, String)>> = reasons
            .iter()
            .map(|reason| vec![("finished_reason", reason.to_string())])
            .collect();
        self.created(name, help, &extra);
    }

    fn queue_time(&mut self) {
        let name = "vllm:request_queue_time_seconds";
        let help = "Time requests waited before they were first scheduled, seconds.";
        self.family(name, "histogram", help);
        for (engine, stats) in self.engines() {
            let mut cumulative = 0;
            let bounds = QUEUE_TIME_BUCKETS
                .iter()
                .map(|b| py_float(*b))
                .chain(["+Inf".to_string()]);
            for (count, bound) in stats.queue_time_counts.iter().zip(bounds) {
                cumulative += count;
                let mut labels = self.labels(&engine);
                labels.push(("le", bound));
                self.sample(
                    &format!("{name}_bucket"),
                    &mut labels,
                    &py_float(cumulative as f64),
                );
            }
            let mut labels = self.labels(&engine);
            self.sample(
                &format!("{name}_count"),
                &mut labels,
                &py_float(cumulative as f64),
            );
            let mut labels = self.labels(&engine);
            self.sample(
                &format!("{name}_sum"),
                &mut labels,
                &py_float(stats.queue_time_sum),
            );
        }
        self.created(name, help, &[]);
    }

    fn cache_config(&mut self) {
        let name = "vllm:cache_config_info";
        self.family(name, "gauge", "The engine's KV cache configuration.");
        let block = self.view.block_size.to_string();
        let blocks = (self.view.num_gpu_blocks * self.view.stats.len().max(1) as u64).to_string();
        for (engine, _) in self.engines() {
            let mut labels: Vec<(&str, String)> = [
                ("block_size", block.as_str()),
                ("cache_dtype", "auto"),
                ("calculate_kv_scales", "False"),
                ("cpu_kvcache_space_bytes", "None"),
                ("cpu_offload_gb", "0"),
                ("enable_prefix_caching", "True"),
                ("gpu_memory_utilization", "0.9"),
                ("is_attention_free", "False"),
                ("kv_cache_memory_bytes", "None"),
                ("kv_offloading_backend", "native"),
                ("kv_offloading_size", "None"),
                ("kv_sharing_fast_prefill", "False"),
                ("mamba_block_size", "None"),
                ("mamba_cache_dtype", "auto"),
                ("mamba_page_size_padded", "None"),
                ("mamba_ssm_cache_dtype", "auto"),
                ("num_cpu_blocks", "None"),
                ("num_gpu_blocks", blocks.as_str()),
                ("num_gpu_blocks_override", "None"),
                ("prefix_caching_hash_algo", "sha256"),
                ("sliding_window", "None"),
                ("swap_space", "4"),
            ]
            .into_iter()
            .map(|(key, value)| (key, value.to_string()))
            .collect();
            labels.push(("engine", engine));
            self.sample(name, &mut labels, "1.0");
        }
    }
}

/// The text of `GET /metrics`.
pub fn exposition(view: &MetricsView) -> String {
    let mut writer = Writer {
        out: String::new(),
        view,
    };
    if !view.multiprocess {
        writer.process_series();
    }
    let nan = view.garble == Garble::Nan;
    writer.gauge(
        "vllm:num_requests_running",
        "Requests in the engine's running batch.",
        |s| {
            if nan {
                "NaN".into()
            } else {
                py_float(s.running as f64)
            }
        },
    );
    writer.gauge(
        "vllm:num_requests_waiting",
        "Requests queued in the engine, not yet scheduled.",
        |s| py_float(s.waiting as f64),
    );
    let name = "vllm:engine_sleep_state";
    writer.family(
        name,
        "gauge",
        "Whether the engine is awake (1) or asleep at level 1 or 2.",
    );
    for state in ["awake", "weights_offloaded", "discard_all"] {
        for (engine, _) in writer.engines() {
            let mut labels = writer.labels(&engine);
            labels.push(("sleep_state", state.to_string()));
            writer.sample(name, &mut labels, if state == "awake" { "1.0" } else { "0.0" });
        }
    }
    writer.gauge(
        "vllm:kv_cache_usage_perc",
        "Share of the engine's KV cache blocks in use, 0 to 1.",
        |s| if nan { "NaN".into() } else { py_float(s.kv_usage) },
    );
    writer.counter(
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        |s| s.prefix_queries,
    );
    writer.counter(
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        |s| s.prefix_hits,
    );
    writer.counter(
        "vllm:num_preemptions",
        "Requests preempted by the engine since it started.",
        |s| s.preemptions,
    );
    writer.counter(
        "vllm:prompt_tokens",
        "Prompt tokens of the requests that got their first token.",
        |s| s.prompt_tokens,
    );
    writer.counter("vllm:generation_tokens", "Tokens generated.", |s| {
        s.generation_tokens
    });
    writer.finish_reasons();
    writer.queue_time();
    writer.cache_config();
    if view.garble == Garble::Huge {
        let name = "vllm:sim_padding";
        writer.family(name, "gauge", "Padding that makes this answer too large to read.");
        let mut index = 0u64;
        while writer.out.len() < 9 << 20 {
            let _ = writeln!(writer.out, "{name}{{index=\"{index}\"}} 0.0");
            index += 1;
        }
    }
    writer.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_prometheus_client_writes_them() {
        for (value, text) in [
            (3.0, "3.0"),
            (0.0, "0.0"),
            (100.0, "100.0"),
            (0.5, "0.5"),
            (0.041_234_567_890_123_45, "0.04123456789012345"),
            (999_999.0, "999999.0"),
            (1_234_567.0, "1.234567e+06"),
            (1_000_000.0, "1e+06"),
            (1_750_421_896.371_524_6, "1.7504218963715246e+09"),
            (12_345_678_901.5, "1.23456789015e+010"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (-2.5, "-2.5"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(py_float(value), text, "{value}");
        }
    }

    fn view(stats: &[EngineStats], multiprocess: bool) -> MetricsView<'_> {
        MetricsView {
            stats,
            extra_engines: 0,
            first_engine: 0,
            model: "org/model \"x\"",
            block_size: 16,
            num_gpu_blocks: 25_000,
            created: 1_750_000_000.25,
            multiprocess,
            garble: Garble::None,
        }
    }

    #[test]
    fn every_engine_has_its_series_with_sorted_labels() {
        let stats = [
            EngineStats {
                running: 3,
                waiting: 1,
                kv_usage: 0.25,
                prefix_queries: 2_000_000,
                prefix_hits: 640,
                ..EngineStats::default()
            },
            EngineStats::default(),
        ];
        let text = exposition(&view(&stats, false));
        let model = r#"model_name="org/model \"x\"""#;
        assert!(text.contains(&format!(
            "vllm:num_requests_running{{engine=\"0\",{model}}} 3.0\n"
        )));
        assert!(text.contains(&format!(
            "vllm:num_requests_waiting{{engine=\"1\",{model}}} 0.0\n"
        )));
        assert!(text.contains(&format!(
            "vllm:kv_cache_usage_perc{{engine=\"0\",{model}}} 0.25\n"
        )));
        assert!(text.contains(&format!(
            "vllm:prefix_cache_queries_total{{engine=\"0\",{model}}} 2e+06\n"
        )));
        assert!(text.contains(&format!(
            "vllm:prefix_cache_hits_total{{engine=\"0\",{model}}} 640.0\n"
        )));
        assert!(text.contains(&format!(
            "vllm:prefix_cache_hits_created{{engine=\"1\",{model}}} 1.75000000025e+09\n"
        )));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_created gauge\n"));
        assert!(text.contains(&format!(
            "vllm:request_queue_time_seconds_bucket{{engine=\"0\",le=\"+Inf\",{model}}} 0.0\n"
        )));
        assert!(text.contains("block_size=\"16\""));
        // Two engines of 25,000 blocks: the server's sum, as vLLM shows it.
        assert!(text.contains("num_gpu_blocks=\"50000\""));
        assert!(text.starts_with("# HELP python_gc_objects_collected_total"));
        // Multiprocess: no _created, no process series.
        let text = exposition(&view(&stats, true));
        assert!(!text.contains("_created") && !text.contains("python_") && !text.contains("process_"));
        assert!(text.starts_with("# HELP vllm:num_requests_running"));
    }

    #[test]
    fn garbling_breaks_what_it_says() {
        let stats = [EngineStats::default()];
        let mut v = view(&stats, true);
        v.garble = Garble::Nan;
        assert!(exposition(&v)
            .contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"org/model \\\"x\\\"\"} NaN\n"));
        v.garble = Garble::WrongLabels;
        assert!(exposition(&v).contains("engine=\"e0\""));
        v.garble = Garble::Huge;
        assert!(exposition(&v).len() > 9 << 20);
        v.garble = Garble::None;
        v.extra_engines = 2;
        assert!(exposition(&v).contains("vllm:num_requests_running{engine=\"2\","));
    }
}
