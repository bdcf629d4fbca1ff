//! Simulator presets: which simulated model the workers run, and the regime
//! the bench builds around it (ranks per worker, KV per rank, prompt and
//! answer limits, how trace lengths are scaled, the SLO, harness time
//! scales). Every record and report names its preset.
//!
//! `legacy` is the model the earlier results used (linear prefill at 20k
//! tokens/s per rank, 20 ms + 0.25 us per KV token decode steps). The
//! calibrated presets select the simulator's `--cost-model`; their regime
//! values are marked provisional until re-checked against the merged model
//! (bench/README.md, "Presets"). `deepseek-v3-ep` (the default) splits a
//! step into each rank's own part and the routed experts' shared part;
//! `deepseek-v3-ep-low` and `-high` bracket the lockstep penalty the
//! published figures leave open; `deepseek-v3-dp8` is the first fit, which
//! the stored results name.

use std::fmt::Write as _;

use crate::stats::Slo;
use serde::{Deserialize, Serialize};

/// KV cache per rank: the regime's main knob besides the offered load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Kv {
    /// Ranks fill and queue (the preset's `small` regime).
    Small,
    /// More room, batches run longer (the preset's `large` regime).
    Large,
}

impl Kv {
    pub fn name(self) -> &'static str {
        match self {
            Kv::Small => "small",
            Kv::Large => "large",
        }
    }
}

/// KV tokens and running sequences per rank of one regime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRegime {
    pub tokens: u32,
    pub running: u32,
}

/// How a preset's goodput SLO is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SloRule {
    /// Stated with its reason.
    Fixed(Slo, &'static str),
    /// [`IDLE_TTFT_FACTOR`] x the idle TTFT and [`IDLE_TPOT_FACTOR`] x the
    /// idle TPOT of a [`IDLE_PROMPT_TOKENS`]-token prompt on the preset's
    /// model, rounded up to two significant digits (`slo::derive`).
    FromIdle,
}

pub const IDLE_PROMPT_TOKENS: u32 = 4096;
pub const IDLE_TTFT_FACTOR: f64 = 5.0;
pub const IDLE_TPOT_FACTOR: f64 = 3.0;

#[derive(Debug, PartialEq)]
pub struct SimPreset {
    pub name: &'static str,
    pub about: &'static str,
    /// Simulator flags selecting the model.
    pub sim_args: &'static [&'static str],
    /// The workers are vLLM servers (`--engine vllm`): `/v1/completions`
    /// for SGLang's `/generate`, `/metrics` for `/v1/loads`, vLLM's own
    /// balancer as the in-server choice.
    pub vllm: bool,
    /// Ranks per worker.
    pub dp_size: usize,
    pub small: KvRegime,
    pub large: KvRegime,
    /// Longest prompt a workload sends, and longest answer.
    pub max_prompt: u32,
    pub max_output: u32,
    /// Default input scale of the block-hash traces (`--replay-input-scale`).
    pub trace_input_scale: f64,
    pub slo: SloRule,
    /// Harness time scale per KV size (simulated s per wall s).
    pub time_scale_small: f64,
    pub time_scale_large: f64,
    /// Why the regime values are not final, if they are not.
    pub provisional: Option<&'static str>,
}

const PROVISIONAL_VLLM: &str = "the SGLang preset's regime values on vLLM servers, not yet checked against vLLM's own scheduling (KV per engine, running requests, time scales) (bench/README.md, \"Presets\")";

const PROVISIONAL: &str = "regime values set before the calibrated cost model was merged: check KV per rank, limits, trace scale and time scales against it (bench/README.md, \"Presets\")";

/// KV per rank of the calibrated presets: small, where prefixes compete for
/// the cache, and large, where most fit.
const SMALL: KvRegime = KvRegime {
    tokens: 100_000,
    running: 128,
};
const LARGE: KvRegime = KvRegime {
    tokens: 400_000,
    running: 256,
};
/// The large regime of the split presets: what an 8-GPU node leaves per
/// rank when DP attention keeps a copy of the attention and dense weights
/// on every GPU (sim/README.md, "The fits").
const LARGE_DP_ATTENTION: KvRegime = KvRegime {
    tokens: 300_000,
    running: 256,
};

/// The first calibrated DeepSeek-V3-class preset: every rank prices its
/// own MoE work (the stored results name it).
const DEEPSEEK_V3_DP8: SimPreset = SimPreset {
    name: "deepseek-v3-dp8",
    about: "the first calibrated DeepSeek-V3-class DP-attention node: 8 ranks per worker in lockstep, each pricing its own MoE work (`--cost-model deepseek-v3-dp8`; the earlier results' model)",
    sim_args: &["--cost-model", "deepseek-v3-dp8"],
    vllm: false,
    dp_size: 8,
    small: SMALL,
    large: LARGE,
    max_prompt: 65_536,
    max_output: 4096,
    // A rank prefills a prompt alone: the quadratic attention of the
    // conversation trace's p90 prompt (27k tokens) alone takes ~5 s, where
    // the trace's own deployment split long prefills over several nodes.
    // Lengths and blocks x 1/4 keep arrivals, sharing and answers.
    trace_input_scale: 0.25,
    slo: SloRule::FromIdle,
    time_scale_small: 2.0,
    time_scale_large: 1.0,
    // Checked after the merge (bench/README.md, "Simulator presets").
    provisional: None,
};

/// The split model (the default): each rank's own part of a step, the
/// routed experts' work shared by the group.
const DEEPSEEK_V3_EP: SimPreset = SimPreset {
    name: "deepseek-v3-ep",
    about: "DeepSeek-V3 under DP attention and expert parallelism, 8 ranks per worker in lockstep, a step priced as the slowest rank's own part plus the routed experts' work of all ranks spread over them (`--cost-model deepseek-v3-ep`)",
    sim_args: &["--cost-model", "deepseek-v3-ep"],
    large: LARGE_DP_ATTENTION,
    provisional: None,
    ..DEEPSEEK_V3_DP8
};

/// The split model at the low end of the lockstep penalty.
const DEEPSEEK_V3_EP_LOW: SimPreset = SimPreset {
    name: "deepseek-v3-ep-low",
    about: "the split DeepSeek-V3 model at the low end of the lockstep penalty: full/empty decode step 2.1x, a rank's own part its attention alone (`--cost-model deepseek-v3-ep-low`)",
    sim_args: &["--cost-model", "deepseek-v3-ep-low"],
    ..DEEPSEEK_V3_EP
};

/// The split model at the high end of the lockstep penalty.
const DEEPSEEK_V3_EP_HIGH: SimPreset = SimPreset {
    name: "deepseek-v3-ep-high",
    about: "the DeepSeek-V3 model at the high end of the lockstep penalty: full/empty decode step 6.5x, each rank pricing its whole step, 3% step noise and 1% stragglers (`--cost-model deepseek-v3-ep-high`)",
    sim_args: &["--cost-model", "deepseek-v3-ep-high"],
    ..DEEPSEEK_V3_EP
};

/// The calibrated small dense preset.
const DENSE_8B: SimPreset = SimPreset {
    name: "dense-8b",
    about: "the calibrated small dense model: 4 data-parallel replicas per worker (`--cost-model dense-8b`)",
    sim_args: &["--cost-model", "dense-8b"],
    vllm: false,
    dp_size: 4,
    small: SMALL,
    large: LARGE,
    max_prompt: 32_768,
    max_output: 4096,
    trace_input_scale: 1.0,
    slo: SloRule::FromIdle,
    time_scale_small: 2.0,
    time_scale_large: 1.0,
    provisional: Some(PROVISIONAL),
};

pub const PRESETS: [SimPreset; 8] = [
    SimPreset {
        name: "legacy",
        about: "the uncalibrated model of the earlier results: prefill 20k tokens/s per rank, decode steps 20 ms + 0.25 us per KV token, 4 ranks per worker in lockstep",
        sim_args: &["--cost-model", "legacy"],
        vllm: false,
        dp_size: 4,
        small: KvRegime {
            tokens: 10_000,
            running: 32,
        },
        large: KvRegime {
            tokens: 30_000,
            running: 64,
        },
        max_prompt: 8192,
        max_output: 1024,
        // 512-token blocks become 64: the traces' 12k-token mean prompt fits
        // a 10k-token rank as 1.5k.
        trace_input_scale: 0.125,
        slo: SloRule::Fixed(
            Slo {
                ttft_ms: 1000.0,
                tpot_ms: 60.0,
            },
            "kept from the earlier results: about 25x the idle TTFT of a median prompt and 2.4x an idle decode step (the idle rule of the calibrated presets gives 1,100 ms and 64 ms here)",
        ),
        time_scale_small: 5.0,
        time_scale_large: 2.0,
        provisional: None,
    },
    DEEPSEEK_V3_EP,
    DEEPSEEK_V3_EP_LOW,
    DEEPSEEK_V3_EP_HIGH,
    DEEPSEEK_V3_DP8,
    DENSE_8B,
    // vLLM serving the same models: the same regime, vLLM's engine.
    SimPreset {
        name: "vllm-dense-8b",
        about: "vLLM serving the calibrated small dense model: 4 data-parallel engines per server stepping on their own, vLLM's scheduler (8,192 tokens per step, 16-token blocks) and internal balancer (0.14) (`--engine vllm --cost-model dense-8b`)",
        sim_args: &["--engine", "vllm", "--cost-model", "dense-8b"],
        vllm: true,
        provisional: Some(PROVISIONAL_VLLM),
        ..DENSE_8B
    },
    SimPreset {
        name: "vllm-deepseek-v3-dp8",
        about: "vLLM serving the calibrated DeepSeek-V3-class model with DP and expert parallelism: 8 engines per server stepping together, vLLM's scheduler (8,192 tokens per step, 64-token blocks) and internal balancer (0.14) (`--engine vllm --cost-model deepseek-v3-dp8`)",
        sim_args: &["--engine", "vllm", "--cost-model", "deepseek-v3-dp8"],
        vllm: true,
        trace_input_scale: 1.0,
        provisional: Some(PROVISIONAL_VLLM),
        ..DEEPSEEK_V3_DP8
    },
];

/// The default preset.
pub const DEFAULT_PRESET: &str = "deepseek-v3-ep";

/// The preset named `name`.
pub fn preset(name: &str) -> Result<&'static SimPreset, String> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        format!(
            "unknown simulator preset `{name}`; known: {}",
            PRESETS.map(|p| p.name).join(", ")
        )
    })
}

impl SimPreset {
    pub fn kv(&self, kv: Kv) -> KvRegime {
        match kv {
            Kv::Small => self.small,
            Kv::Large => self.large,
        }
    }

    /// The longest prompt with KV `kv`: what a rank holds with room for the
    /// longest answer, and at most the preset's limit.
    pub fn max_prompt(&self, kv: Kv) -> u32 {
        self.kv(kv)
            .tokens
            .saturating_sub(self.max_output + 16)
            .min(self.max_prompt)
    }

    /// The model and regime flags of every simulated worker.
    pub fn sim_args(&self, kv: Kv) -> Vec<String> {
        let regime = self.kv(kv);
        let mut args: Vec<String> = self.sim_args.iter().map(|a| a.to_string()).collect();
        args.extend([
            "--kv-capacity".into(),
            regime.tokens.to_string(),
            "--max-running".into(),
            regime.running.to_string(),
        ]);
        args
    }

    /// The seed of the simulator's step noise for a run of `seed`: every
    /// variant of a seed meets the same draws, other seeds other draws
    /// (noise plays a part only on presets that have it,
    /// `deepseek-v3-ep-high`, or with `sim.step-noise`).
    pub fn noise_seed_args(seed: u64) -> [String; 2] {
        ["--noise-seed".into(), seed.to_string()]
    }

    pub fn time_scale(&self, kv: Kv) -> f64 {
        match kv {
            Kv::Small => self.time_scale_small,
            Kv::Large => self.time_scale_large,
        }
    }

    pub fn describe_kv(&self, kv: Kv) -> String {
        let r = self.kv(kv);
        format!(
            "{} KV tokens and {} running sequences per rank",
            r.tokens, r.running
        )
    }

    /// Lines for a report's set-up section.
    pub fn describe(&self) -> String {
        let mut out = format!("`{}`: {}", self.name, self.about);
        let _ = write!(
            out,
            "; prompts at most {} tokens, answers at most {}; block-hash traces scaled x {}",
            self.max_prompt, self.max_output, self.trace_input_scale
        );
        if let Some(why) = self.provisional {
            let _ = write!(out, "; PROVISIONAL: {why}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_found_by_name_and_leave_room_for_answers() {
        for p in &PRESETS {
            assert_eq!(preset(p.name).unwrap().name, p.name);
            for kv in [Kv::Small, Kv::Large] {
                assert!(p.max_prompt(kv) + p.max_output <= p.kv(kv).tokens, "{}", p.name);
                let args = p.sim_args(kv);
                assert!(args.contains(&"--kv-capacity".to_string()));
            }
        }
        assert!(preset("nope").unwrap_err().contains("legacy"));
        let legacy = preset("legacy").unwrap();
        assert_eq!(preset(DEFAULT_PRESET).unwrap().name, "deepseek-v3-ep");
        // The bracket's ends and the default share the regime but the model.
        let ends = ["deepseek-v3-ep-low", "deepseek-v3-ep-high"].map(|name| preset(name).unwrap());
        for end in ends {
            assert_eq!(
                (end.small, end.large, end.slo),
                (
                    preset(DEFAULT_PRESET).unwrap().small,
                    LARGE_DP_ATTENTION,
                    SloRule::FromIdle
                )
            );
            assert_eq!(end.sim_args[1], end.name);
        }
        assert_eq!(legacy.max_prompt(Kv::Small), 8192);
        assert!(legacy.provisional.is_none());
        assert_eq!(
            legacy.sim_args,
            ["--cost-model", "legacy"],
            "the simulator's default is a calibrated model"
        );
        // vLLM presets say so in their flags too.
        for p in &PRESETS {
            assert_eq!(
                p.vllm,
                p.sim_args.windows(2).any(|w| w == ["--engine", "vllm"]),
                "{}",
                p.name
            );
        }
    }
}
