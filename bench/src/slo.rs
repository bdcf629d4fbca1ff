//! The goodput SLO of a simulator preset, and the idle latencies it rests
//! on. A calibrated preset's SLO is derived from its own model: 5x the idle
//! TTFT and 3x the idle TPOT of a 4,096-token prompt (one request on an
//! empty fleet, in virtual time), rounded up to two significant digits; a
//! fixed SLO (the `legacy` preset's) is stated with its reason. Reports
//! print the SLO with how it was set.

use dprank_sim::offline::{Fleet, Prompt, Request};

use crate::offline::sim_config;
use crate::preset::{SimPreset, SloRule, IDLE_PROMPT_TOKENS, IDLE_TPOT_FACTOR, IDLE_TTFT_FACTOR};
use crate::runner::Kv;
use crate::stats::Slo;
use crate::workload::text;

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

/// The preset's SLO and how it was set.
pub fn resolve(preset: &SimPreset) -> Result<(Slo, String), String> {
    match preset.slo {
        SloRule::Fixed(slo, why) => Ok((slo, why.to_string())),
        SloRule::FromIdle => from_idle(preset),
    }
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
