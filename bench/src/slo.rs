//! The goodput SLO of a workload on a simulator preset, and the latencies
//! it rests on. A calibrated preset's SLO is derived from its own model, per
//! workload and KV size: TTFT at most 5x the idle TTFT of the workload's
//! 90th-percentile prompt (so long-prompt traces and short-prompt workloads
//! are held to the same slowdown), and TPOT at most one decode step of a
//! full batch (the preset's large-KV running limit at 2,000 KV tokens per
//! sequence: the operating point the cost model's decode figures were
//! published at), each rounded up to two significant digits. A fixed SLO
//! (the `legacy` preset's) is stated with its reason. The command line can
//! override either figure. Reports print the SLO with how it was set.

use dprank_sim::offline::{Fleet, Prompt, Request};

use dprank_sim::engine::cost::DecodeWork;

use crate::offline::sim_config;
use crate::preset::Kv;
use crate::preset::{SimPreset, SloRule, IDLE_PROMPT_TOKENS, IDLE_TPOT_FACTOR, IDLE_TTFT_FACTOR};
use crate::stats::{percentile, Slo};
use crate::workload::chat::TEMPLATE_TOKENS_PER_MESSAGE;
use crate::workload::{switching, text, Plan, Shape, Workload, WorkloadKind};

/// The prompt percentile the TTFT SLO is set at.
pub const SLO_PROMPT_PERCENTILE: f64 = 90.0;
/// KV tokens per sequence of the full batch whose decode step is the TPOT SLO.
pub const FULL_BATCH_KV_PER_SEQUENCE: u64 = 2_000;
/// The plan the prompt lengths are read from: its seed (apart from every
/// tuning and judging seed), rate and length.
const PROMPT_SAMPLE_SEED: u64 = 0x510_5eed;
const PROMPT_SAMPLE_RATE: f64 = 4.0;
const PROMPT_SAMPLE_S: f64 = 600.0;

/// Either figure of an SLO set on the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SloOverride {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl SloOverride {
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none()
    }
}

/// Output tokens of the idle request.
const IDLE_OUTPUT: u64 = 256;

/// Idle TTFT and TPOT (ms) of one `prompt_tokens`-token request on an empty
/// fleet of the preset (its large-KV regime: the prompt always fits).
pub fn idle_latencies(preset: &SimPreset, prompt_tokens: u32) -> Result<(f64, f64), String> {
    let config = sim_config(preset, Kv::Large, preset.dp_size, &[])?;
    let mut fleet = Fleet::new(config, 1)?;
    let prompt = Prompt::Text(text::words(0x1d1e, prompt_tokens));
    let id = fleet.submit(
        0.0,
        0,
        Request::new(prompt, IDLE_OUTPUT).answer_after(IDLE_OUTPUT),
    )?;
    let reports = fleet.run_to_end();
    let at = |finished: bool| {
        reports
            .iter()
            .find(|r| r.req == id && r.finished == finished)
            .map(|r| r.at)
            .ok_or("the idle request did not finish")
    };
    let (first, last) = (at(false)?, at(true)?);
    Ok((first * 1000.0, (last - first) * 1000.0 / (IDLE_OUTPUT - 1) as f64))
}

/// `x` rounded up to two significant digits.
pub fn round_up_2(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return x;
    }
    let unit = 10f64.powi(x.log10().floor() as i32 - 1);
    (x / unit - 1e-9).ceil() * unit
}

/// The SLO the idle rule gives for `preset`, with its derivation.
pub fn from_idle(preset: &SimPreset) -> Result<(Slo, String), String> {
    let (ttft, tpot) = idle_latencies(preset, IDLE_PROMPT_TOKENS)?;
    let slo = Slo {
        ttft_ms: round_up_2(IDLE_TTFT_FACTOR * ttft),
        tpot_ms: round_up_2(IDLE_TPOT_FACTOR * tpot),
    };
    let why = format!(
        "{IDLE_TTFT_FACTOR}x the idle TTFT ({ttft:.1} ms) and {IDLE_TPOT_FACTOR}x the idle TPOT ({tpot:.2} ms) of a {IDLE_PROMPT_TOKENS}-token prompt on preset `{}`, rounded up to two significant digits",
        preset.name
    );
    Ok((slo, why))
}

/// The preset's SLO for a 4,096-token prompt and how it was set (what
/// `dprank-bench slo` prints beside each workload's).
pub fn resolve(preset: &SimPreset) -> Result<(Slo, String), String> {
    match preset.slo {
        SloRule::Fixed(slo, why) => Ok((slo, why.to_string())),
        SloRule::FromIdle => from_idle(preset),
    }
}

/// Every prompt's length in tokens (as the simulator counts them) of a
/// plan; a chat turn's prompt is its whole conversation so far (counted
/// with the template's tokens per message).
pub fn prompt_lengths(plan: &Plan) -> Vec<f64> {
    let mut out: Vec<f64> = plan.requests.iter().map(|r| f64::from(r.input_tokens)).collect();
    for session in &plan.sessions {
        let mut history =
            dprank_sim::tokenizer::count_tokens(&session.system) as f64 + TEMPLATE_TOKENS_PER_MESSAGE;
        for turn in &session.turns {
            history += dprank_sim::tokenizer::count_tokens(&turn.user) as f64 + TEMPLATE_TOKENS_PER_MESSAGE;
            out.push(history + TEMPLATE_TOKENS_PER_MESSAGE);
            history += f64::from(turn.output_tokens) + TEMPLATE_TOKENS_PER_MESSAGE;
        }
    }
    out
}

/// The workload's 90th-percentile prompt with KV `kv` on `preset`.
pub fn prompt_p90(preset: &SimPreset, workload: &Workload, kv: Kv) -> Result<u32, String> {
    let plan = workload.plan(&Shape {
        rate: PROMPT_SAMPLE_RATE,
        duration_s: PROMPT_SAMPLE_S,
        seed: PROMPT_SAMPLE_SEED,
        max_prompt: preset.max_prompt(kv),
        max_output: preset.max_output,
    })?;
    let lengths = prompt_lengths(&plan);
    if lengths.is_empty() {
        return Err(format!("{}: the sample plan sends nothing", workload.name()));
    }
    Ok(percentile(&lengths, SLO_PROMPT_PERCENTILE).round().max(1.0) as u32)
}

/// One decode step of a full batch on `preset` (ms): its large-KV running
/// limit, each sequence reading [`FULL_BATCH_KV_PER_SEQUENCE`] KV tokens.
pub fn full_batch_step_ms(preset: &SimPreset) -> Result<f64, String> {
    let config = sim_config(preset, Kv::Large, preset.dp_size, &[])?;
    let seqs = u64::from(preset.large.running);
    let step = config.cost().decode_us(DecodeWork {
        seqs,
        kv_tokens: seqs * FULL_BATCH_KV_PER_SEQUENCE,
    });
    Ok(step as f64 / 1000.0)
}

/// The SLO of `workload` with KV `kv` on `preset`, and how it was set;
/// `over` replaces either figure.
pub fn for_workload(
    preset: &SimPreset,
    workload: &Workload,
    kv: Kv,
    over: SloOverride,
) -> Result<(Slo, String), String> {
    if workload.kind == WorkloadKind::Switching {
        // One SLO for the mix, as one service states it: the loosest of its
        // parts', so each part can meet it.
        let mut loosest: Option<(Slo, String, String)> = None;
        for kind in switching::PARTS {
            let part = switching::part(workload, kind);
            let (slo, why) = for_workload(preset, &part, kv, over)?;
            if loosest.as_ref().is_none_or(|(l, _, _)| slo.ttft_ms > l.ttft_ms) {
                loosest = Some((slo, part.name(), why));
            }
        }
        let (slo, part, why) = loosest.ok_or("`switching` has no parts")?;
        return Ok((slo, format!("the loosest of its parts', `{part}`'s: {why}")));
    }
    let (mut slo, mut why) = match preset.slo {
        SloRule::Fixed(slo, why) => (slo, why.to_string()),
        SloRule::FromIdle => {
            let prompt = prompt_p90(preset, workload, kv)?;
            let (ttft, _) = idle_latencies(preset, prompt)?;
            let step = full_batch_step_ms(preset)?;
            let slo = Slo {
                ttft_ms: round_up_2(IDLE_TTFT_FACTOR * ttft),
                tpot_ms: round_up_2(step),
            };
            let why = format!(
                "TTFT {IDLE_TTFT_FACTOR}x the idle TTFT ({ttft:.0} ms) of the workload's p90 prompt ({prompt} tokens); TPOT one decode step of a full batch ({} sequences of {FULL_BATCH_KV_PER_SEQUENCE} KV tokens: {step:.1} ms); preset `{}`, rounded up to two significant digits",
                preset.large.running, preset.name
            );
            (slo, why)
        }
    };
    if !over.is_empty() {
        slo.ttft_ms = over.ttft_ms.unwrap_or(slo.ttft_ms);
        slo.tpot_ms = over.tpot_ms.unwrap_or(slo.tpot_ms);
        why = format!("set on the command line (otherwise: {why})");
    }
    Ok((slo, why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::preset;

    #[test]
    fn rounding_is_up_to_two_significant_digits() {
        assert_eq!(round_up_2(1047.0), 1100.0);
        assert_eq!(round_up_2(1000.0), 1000.0);
        assert!((round_up_2(63.2) - 64.0).abs() < 1e-9);
        assert!((round_up_2(0.123) - 0.13).abs() < 1e-12);
    }

    #[test]
    fn the_idle_rule_on_the_legacy_model_is_what_its_preset_says() {
        // legacy: 4,096 tokens at 20k tokens/s + the tokenizer's 4.6 ms;
        // decode steps of 20 ms + 0.25 us per KV token.
        let legacy = preset("legacy").unwrap();
        let (ttft, tpot) = idle_latencies(legacy, IDLE_PROMPT_TOKENS).unwrap();
        assert!((205.0..215.0).contains(&ttft), "{ttft}");
        assert!((20.9..21.2).contains(&tpot), "{tpot}");
        let (slo, why) = from_idle(legacy).unwrap();
        assert_eq!((slo.ttft_ms, slo.tpot_ms), (1100.0, 64.0));
        assert!(why.contains("4096-token"), "{why}");
        // The preset itself keeps its earlier SLO, and says what the rule gives.
        let (fixed, reason) = resolve(legacy).unwrap();
        assert_eq!((fixed.ttft_ms, fixed.tpot_ms), (1000.0, 60.0));
        assert!(reason.contains("1,100 ms and 64 ms"), "{reason}");
    }
}
