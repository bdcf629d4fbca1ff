//! What one forward pass costs, from the work each rank puts in it: pure
//! arithmetic, no scheduling (the rank scheduler builds the work, this
//! prices it). Under DP attention with expert parallelism a pass has a
//! per-rank part (attention, replicated layers), whose slowest rank sets
//! the pace, and a shared part (routed experts and their all-to-all),
//! spread over every rank of the group. The presets, their sources and how
//! they were fitted are in sim/README.md ("Step costs").

use clap::ValueEnum;

use super::Micros;

/// The step-time model of one rank, in microseconds.
///
/// - prefill step: `prefill_base + prefill_per_token x n + prefill_per_pair
///   x n x (c + n / 2)` summed over the chunks of the batch, a chunk being
///   `n` new tokens of a sequence that already has `c` tokens of KV (its
///   cached prefix, or its earlier chunks): the attention of the new tokens
///   over the earlier ones and over each other;
/// - decode step: `decode_base + decode_per_seq x sequences +
///   decode_per_kv_token x KV tokens the batch reads`.
///
/// For a group of ranks stepping together (`group_us`) the shares
/// `prefill_shared` of the per-token term and `decode_shared` of the
/// per-sequence term are the routed experts' work: priced on the group's
/// total tokens divided by its ranks, not on each rank's own. A rank alone,
/// or a balanced group, costs what the formulas above say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub prefill_base_us: f64,
    pub prefill_us_per_token: f64,
    pub prefill_us_per_pair: f64,
    pub decode_base_us: f64,
    pub decode_us_per_seq: f64,
    pub decode_us_per_kv_token: f64,
    /// Share (0 to 1) of `prefill_us_per_token` spread over the group.
    pub prefill_shared: f64,
    /// Share (0 to 1) of `decode_us_per_seq` spread over the group.
    pub decode_shared: f64,
}

/// What one rank puts into a forward pass: prefill chunks, decodes, or
/// both (vLLM's unified batches, SGLang's mixed chunks).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    pub prefill: PrefillWork,
    pub decode: DecodeWork,
}

impl StepWork {
    pub fn prefill(prefill: PrefillWork) -> Self {
        Self {
            prefill,
            ..Self::default()
        }
    }

    pub fn decode(decode: DecodeWork) -> Self {
        Self {
            decode,
            ..Self::default()
        }
    }

    fn is_empty(&self) -> bool {
        self.prefill.tokens == 0 && self.decode.seqs == 0
    }
}

/// The work of one prefill step of a rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillWork {
    /// New (uncached) tokens computed.
    pub tokens: u64,
    /// (new token, earlier token of its sequence) pairs the attention
    /// computes: `n x (c + n / 2)` per chunk.
    pub pairs: f64,
}

impl PrefillWork {
    /// Adds a chunk of `new` tokens to a sequence holding `context` tokens
    /// of KV already.
    pub fn add(&mut self, context: u64, new: u64) {
        self.tokens += new;
        self.pairs += new as f64 * (context as f64 + new as f64 / 2.0);
    }
}

/// The work of one decode step of a rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeWork {
    /// Sequences in the batch (one new token each).
    pub seqs: u64,
    /// KV tokens the batch reads.
    pub kv_tokens: u64,
}

impl CostModel {
    pub fn prefill_us(&self, work: PrefillWork) -> Micros {
        let us = self.prefill_base_us
            + self.prefill_us_per_token * work.tokens as f64
            + self.prefill_us_per_pair * work.pairs;
        us.max(0.0).round() as Micros
    }

    pub fn decode_us(&self, work: DecodeWork) -> Micros {
        let us = self.decode_base_us
            + self.decode_us_per_seq * work.seqs as f64
            + self.decode_us_per_kv_token * work.kv_tokens as f64;
        us.max(0.0).round() as Micros
    }

    /// A step mixing prefill chunks and decodes in one forward pass (vLLM's
    /// unified batches): one fixed cost, the larger of the two kinds' when
    /// both are in it, plus each kind's variable terms. A step of one kind
    /// costs what `prefill_us` or `decode_us` says.
    pub fn mixed_us(&self, prefill: PrefillWork, decode: DecodeWork) -> Micros {
        let work = StepWork { prefill, decode };
        if work.is_empty() {
            return 0;
        }
        let us = self.base_us(&work)
            + self.prefill_us_per_token * prefill.tokens as f64
            + self.prefill_us_per_pair * prefill.pairs
            + self.decode_us_per_seq * decode.seqs as f64
            + self.decode_us_per_kv_token * decode.kv_tokens as f64;
        us.max(0.0).round() as Micros
    }

    /// The fixed cost of a pass holding `work`.
    fn base_us(&self, work: &StepWork) -> f64 {
        match (work.prefill.tokens > 0, work.decode.seqs > 0) {
            (true, true) => self.prefill_base_us.max(self.decode_base_us),
            (true, false) => self.prefill_base_us,
            _ => self.decode_base_us,
        }
    }

    /// The part of a rank's pass that only it runs: the fixed cost, its
    /// attention and KV reads, and the unshared share of its tokens.
    pub fn rank_us(&self, work: &StepWork) -> Micros {
        if work.is_empty() {
            return 0;
        }
        let us = self.base_us(work)
            + self.prefill_us_per_token * (1.0 - self.prefill_shared) * work.prefill.tokens as f64
            + self.prefill_us_per_pair * work.prefill.pairs
            + self.decode_us_per_seq * (1.0 - self.decode_shared) * work.decode.seqs as f64
            + self.decode_us_per_kv_token * work.decode.kv_tokens as f64;
        us.max(0.0).round() as Micros
    }

    /// The routed experts' share of a rank's tokens, before it is spread.
    fn shared_us(&self, work: &StepWork) -> f64 {
        self.prefill_us_per_token * self.prefill_shared * work.prefill.tokens as f64
            + self.decode_us_per_seq * self.decode_shared * work.decode.seqs as f64
    }

    /// One pass of `ranks` ranks stepping together, `works` being the busy
    /// ones' work (a rank with none runs an idle pass): the slowest rank's
    /// own part, each stretched by `slowdown(rank index in works)`, plus
    /// the shared part of every rank's tokens divided by `ranks`. None when
    /// no rank has work.
    pub fn group_us(
        &self,
        ranks: usize,
        works: &[StepWork],
        mut slowdown: impl FnMut(usize) -> f64,
    ) -> Option<Micros> {
        if works.iter().all(StepWork::is_empty) {
            return None;
        }
        let slowest = works
            .iter()
            .enumerate()
            .map(|(index, work)| {
                let own = self.rank_us(work);
                let factor = slowdown(index);
                if factor == 1.0 {
                    own
                } else {
                    (own as f64 * factor).round() as Micros
                }
            })
            .max()
            .unwrap_or(0);
        let shared: f64 = works.iter().map(|work| self.shared_us(work)).sum();
        Some(slowest + (shared / ranks.max(1) as f64).round() as Micros)
    }
}

/// What a preset models: a rank's step costs and the deployment's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deployment {
    pub cost: CostModel,
    /// Ranks per worker.
    pub dp_size: usize,
    /// SGLang `--enable-dp-attention`: the server divides
    /// `--chunked-prefill-size` by `dp_size` and scales the schedule
    /// conservativeness by 0.3; the ranks step in lockstep.
    pub dp_attention: bool,
    /// KV tokens per rank.
    pub kv_capacity: u64,
    /// Running requests per rank.
    pub max_running: u64,
    /// vLLM mode: the KV block size vLLM uses for the model (16 by default on
    /// CUDA; 64 for MLA under FlashMLA).
    pub vllm_block_size: u64,
    /// vLLM mode: `max_num_seqs` per engine.
    pub vllm_max_num_seqs: u64,
    /// Step-to-step variation of each rank's own part of a step.
    pub noise: StepNoise,
}

/// How much a rank's own part of a step varies from the model's figure:
/// a relative normal spread per step, and now and then a straggler. Drawn
/// from a seed, so a run is reproducible (sim/README.md, "Noise").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepNoise {
    /// Standard deviation of the relative variation (0.03 = 3%).
    pub spread: f64,
    /// Chance that a rank straggles in a step.
    pub straggler_chance: f64,
    /// How much longer a straggling rank's part takes (0.3 = 30%).
    pub straggler_slowdown: f64,
}

impl StepNoise {
    pub const NONE: StepNoise = StepNoise {
        spread: 0.0,
        straggler_chance: 0.0,
        straggler_slowdown: 0.0,
    };

    pub fn is_none(&self) -> bool {
        self.spread <= 0.0 && (self.straggler_chance <= 0.0 || self.straggler_slowdown <= 0.0)
    }

    /// The factor a rank's part is multiplied by, from two uniform draws in
    /// [0, 1) and one standard normal draw; at least 0.5.
    pub fn factor(&self, normal: f64, uniform: f64) -> f64 {
        let mut factor = 1.0 + self.spread * normal;
        if uniform < self.straggler_chance {
            factor += self.straggler_slowdown;
        }
        factor.max(0.5)
    }
}

/// DeepSeek-V3 under DP attention and expert parallelism on H100-class
/// GPUs, per rank (GPU), fitted in sim/README.md, every rank pricing its
/// own MoE work (the first fit; kept for the results made with it).
pub const DEEPSEEK_V3_DP8: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 14_040.0,
        prefill_us_per_token: 131.7,
        prefill_us_per_pair: 0.013_07,
        decode_base_us: 14_040.0,
        decode_us_per_seq: 252.7,
        decode_us_per_kv_token: 0.025_74,
        prefill_shared: 0.0,
        decode_shared: 0.0,
    },
    dp_size: 8,
    dp_attention: true,
    kv_capacity: 500_000,
    max_running: 256,
    // vLLM forces 64-token blocks for MLA under FlashMLA (Hopper);
    // platforms/cuda.py. 256 sequences: the fitted batch (vLLM's own default
    // of 1024 would run the decode fit far outside what it was fitted on).
    vllm_block_size: 64,
    vllm_max_num_seqs: 256,
    noise: StepNoise::NONE,
};

/// The routed experts' share of DeepSeek-V3's compute per token: 8 of 256
/// experts x 58 layers x 44M parameters = 20.4B of 37.4B active.
pub const ROUTED_EXPERT_SHARE: f64 = 0.55;

/// KV tokens per rank of an 8-GPU node serving DeepSeek-V3 under DP
/// attention: every GPU holds an eighth of the routed experts and a copy of
/// everything else (sim/README.md, "The fits").
const DP_ATTENTION_NODE_KV: u64 = 300_000;

/// The split model, fitted (sim/README.md): DeepSeek's production decode
/// figure read as one token per step (full/empty decode step 6.5x), the
/// routed experts' share of the per-token and per-sequence terms spread
/// over the group.
pub const DEEPSEEK_V3_EP: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 14_045.0,
        prefill_us_per_token: 131.08,
        prefill_us_per_pair: 0.013_23,
        decode_base_us: 14_045.0,
        decode_us_per_seq: 252.7,
        decode_us_per_kv_token: 0.025_74,
        prefill_shared: ROUTED_EXPERT_SHARE,
        decode_shared: ROUTED_EXPERT_SHARE,
    },
    kv_capacity: DP_ATTENTION_NODE_KV,
    ..DEEPSEEK_V3_DP8
};

/// The low end of the lockstep penalty: DeepSeek's production decode
/// figure read with multi-token prediction at 90% acceptance (full/empty
/// decode step 2.1x); a rank's own part of a step is its attention alone.
pub const DEEPSEEK_V3_EP_LOW: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 43_824.0,
        prefill_us_per_token: 129.26,
        prefill_us_per_pair: 0.013_23,
        decode_base_us: 43_824.0,
        decode_us_per_seq: 136.4,
        decode_us_per_kv_token: 0.025_74,
        prefill_shared: 1.0,
        decode_shared: 1.0,
    },
    ..DEEPSEEK_V3_EP
};

/// The high end: the one-token reading (6.5x) with every rank pricing its
/// whole step, MoE included, as the first fit did, and each rank's part
/// varying 3% per step with a 1% chance of a 30% straggler (assumed, not
/// measured).
pub const DEEPSEEK_V3_EP_HIGH: Deployment = Deployment {
    cost: CostModel {
        prefill_shared: 0.0,
        decode_shared: 0.0,
        ..DEEPSEEK_V3_EP.cost
    },
    noise: StepNoise {
        spread: 0.03,
        straggler_chance: 0.01,
        straggler_slowdown: 0.3,
    },
    ..DEEPSEEK_V3_EP
};

/// A Llama-3.1-8B-class dense model, one replica per H100, ranks
/// independent, fitted in sim/README.md.
pub const DENSE_8B: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 7_430.0,
        prefill_us_per_token: 31.5,
        prefill_us_per_pair: 0.001_183,
        decode_base_us: 7_430.0,
        decode_us_per_seq: 33.9,
        decode_us_per_kv_token: 0.039_1,
        prefill_shared: 0.0,
        decode_shared: 0.0,
    },
    dp_size: 8,
    dp_attention: false,
    kv_capacity: 400_000,
    max_running: 256,
    // vLLM's defaults on an H100 for the OpenAI server: 16-token blocks,
    // max_num_seqs 1024.
    vllm_block_size: 16,
    vllm_max_num_seqs: 1024,
    noise: StepNoise::NONE,
};

/// The simulator's earlier, uncalibrated model: prefill at 20k tokens/s,
/// decode 20 ms + 0.25 µs per KV token. Kept for the benchmark records made
/// with it and the tests written against its round numbers.
pub const LEGACY: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 0.0,
        prefill_us_per_token: 50.0,
        prefill_us_per_pair: 0.0,
        decode_base_us: 20_000.0,
        decode_us_per_seq: 0.0,
        decode_us_per_kv_token: 0.25,
        prefill_shared: 0.0,
        decode_shared: 0.0,
    },
    dp_size: 4,
    dp_attention: true,
    kv_capacity: 200_000,
    max_running: 64,
    vllm_block_size: 16,
    vllm_max_num_seqs: 64,
    noise: StepNoise::NONE,
};

/// The deployment the simulator models: a rank's step costs, ranks per
/// worker, DP attention, KV capacity and running requests per rank (each
/// overridable by its own flag). See sim/README.md ("Step costs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CostPreset {
    /// DeepSeek-V3 under DP attention and expert parallelism: 8 ranks in
    /// lockstep, the routed experts' work spread over them (the default).
    #[value(name = "deepseek-v3-ep")]
    DeepseekV3Ep,
    /// The same at the low end of the lockstep penalty (decode full/empty
    /// 2.1x, a rank's own part its attention alone).
    #[value(name = "deepseek-v3-ep-low")]
    DeepseekV3EpLow,
    /// The same at the high end (decode full/empty 6.5x, each rank pricing
    /// its whole step, step-time noise and stragglers).
    #[value(name = "deepseek-v3-ep-high")]
    DeepseekV3EpHigh,
    /// The first fit: 8 ranks in lockstep, each pricing its own MoE work,
    /// 500k KV per rank (the results made before the split name it).
    #[value(name = "deepseek-v3-dp8")]
    DeepseekV3Dp8,
    /// A Llama-3.1-8B-class dense model, one replica per H100: 8 ranks
    /// stepping independently.
    #[value(name = "dense-8b")]
    Dense8b,
    /// The earlier uncalibrated model (prefill 20k tokens/s; decode 20 ms +
    /// 0.25 µs per KV token; 4 ranks in lockstep; 200k KV; 64 running).
    #[value(name = "legacy")]
    Legacy,
}

impl Deployment {
    pub fn of(preset: CostPreset) -> Deployment {
        match preset {
            CostPreset::DeepseekV3Ep => DEEPSEEK_V3_EP,
            CostPreset::DeepseekV3EpLow => DEEPSEEK_V3_EP_LOW,
            CostPreset::DeepseekV3EpHigh => DEEPSEEK_V3_EP_HIGH,
            CostPreset::DeepseekV3Dp8 => DEEPSEEK_V3_DP8,
            CostPreset::Dense8b => DENSE_8B,
            CostPreset::Legacy => LEGACY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(model: &CostModel, chunks: &[(u64, u64)]) -> Micros {
        let mut work = PrefillWork::default();
        for &(context, new) in chunks {
            work.add(context, new);
        }
        model.prefill_us(work)
    }

    fn decode(model: &CostModel, seqs: u64, kv_tokens: u64) -> Micros {
        model.decode_us(DecodeWork { seqs, kv_tokens })
    }

    #[test]
    fn prefill_grows_with_new_tokens_and_with_the_context_before_them() {
        for preset in [DEEPSEEK_V3_DP8, DENSE_8B] {
            let model = &preset.cost;
            // More new tokens, same context.
            assert!(prefill(model, &[(0, 2000)]) > prefill(model, &[(0, 1000)]));
            // Same new tokens after a longer cached prefix.
            assert!(prefill(model, &[(8000, 1000)]) > prefill(model, &[(0, 1000)]));
            assert!(prefill(model, &[(32_000, 1000)]) > prefill(model, &[(8000, 1000)]));
            // Superlinear in one prompt's length: the attention term.
            let short = prefill(model, &[(0, 1000)]) - model.prefill_base_us as Micros;
            let long = prefill(model, &[(0, 8000)]) - model.prefill_base_us as Micros;
            assert!(long > 8 * short, "{long} vs 8 x {short}");
        }
    }

    #[test]
    fn chunking_a_prompt_costs_the_same_attention_plus_a_base_per_chunk() {
        let model = &DEEPSEEK_V3_DP8.cost;
        let whole = prefill(model, &[(0, 4096)]);
        let chunks = prefill(model, &[(0, 1024)])
            + prefill(model, &[(1024, 1024)])
            + prefill(model, &[(2048, 1024)])
            + prefill(model, &[(3072, 1024)]);
        let bases = 3 * model.prefill_base_us as Micros;
        assert!(
            chunks.abs_diff(whole + bases) <= 4,
            "{chunks} vs {whole} + {bases}"
        );
    }

    #[test]
    fn decode_grows_with_the_batch_and_with_the_kv_it_reads() {
        for preset in [DEEPSEEK_V3_DP8, DENSE_8B, LEGACY] {
            let model = &preset.cost;
            assert!(decode(model, 64, 100_000) >= decode(model, 32, 100_000));
            assert!(decode(model, 32, 200_000) > decode(model, 32, 100_000));
            assert_eq!(decode(model, 0, 0), model.decode_base_us as Micros);
        }
        let model = &DEEPSEEK_V3_DP8.cost;
        assert!(decode(model, 64, 100_000) > decode(model, 32, 100_000));
    }

    #[test]
    fn a_mixed_step_pays_one_fixed_cost_and_both_kinds_of_work() {
        for preset in [DEEPSEEK_V3_DP8, DENSE_8B, LEGACY] {
            let model = &preset.cost;
            let mut prefill = PrefillWork::default();
            prefill.add(1000, 2000);
            let decode = DecodeWork {
                seqs: 32,
                kv_tokens: 64_000,
            };
            // Alone, each kind costs what its own formula says.
            assert_eq!(
                model.mixed_us(prefill, DecodeWork::default()),
                model.prefill_us(prefill)
            );
            assert_eq!(
                model.mixed_us(PrefillWork::default(), decode),
                model.decode_us(decode)
            );
            // Together: both variable parts, one fixed cost.
            let both = model.mixed_us(prefill, decode);
            let base = model.prefill_base_us.max(model.decode_base_us) as Micros;
            let parts = model.prefill_us(prefill) - model.prefill_base_us as Micros + model.decode_us(decode)
                - model.decode_base_us as Micros;
            assert!(both.abs_diff(base + parts) <= 2, "{both} vs {base} + {parts}");
            let separate = model.prefill_us(prefill) + model.decode_us(decode);
            assert!(both <= separate + 2, "{both} vs {separate}");
            if model.prefill_base_us > 0.0 && model.decode_base_us > 0.0 {
                assert!(both < separate, "{both} vs {separate}");
            }
            assert_eq!(model.mixed_us(PrefillWork::default(), DecodeWork::default()), 0);
        }
    }

    #[test]
    fn a_group_step_is_the_slowest_own_part_plus_the_shared_part_spread() {
        let model = &DEEPSEEK_V3_EP.cost;
        let decode = |seqs| {
            StepWork::decode(DecodeWork {
                seqs,
                kv_tokens: seqs * 2000,
            })
        };
        // A rank alone, or a balanced group, costs the single-rank formula.
        let alone = model.group_us(1, &[decode(64)], |_| 1.0).unwrap();
        assert!(alone.abs_diff(model.decode_us(decode(64).decode)) <= 1);
        let balanced = model.group_us(8, &[decode(64); 8], |_| 1.0).unwrap();
        assert!(balanced.abs_diff(alone) <= 1, "{balanced} vs {alone}");
        // One busy rank among eight: its own part, an eighth of its share.
        let lone = model.group_us(8, &[decode(64)], |_| 1.0).unwrap();
        let shared = model.decode_us_per_seq * model.decode_shared * 64.0;
        assert_eq!(
            lone,
            model.rank_us(&decode(64)) + (shared / 8.0).round() as Micros
        );
        assert!(lone < alone);
        // Without shares the group costs its slowest rank, as it used to.
        let whole = &DEEPSEEK_V3_EP_HIGH.cost;
        let uneven = [decode(10), decode(64)];
        assert_eq!(
            whole.group_us(8, &uneven, |_| 1.0),
            Some(
                whole
                    .decode_us(decode(10).decode)
                    .max(whole.decode_us(decode(64).decode))
            )
        );
        // A slowdown stretches a rank's own part only.
        let slowed = model.group_us(8, &[decode(64)], |_| 1.5).unwrap();
        assert_eq!(
            slowed - lone,
            (model.rank_us(&decode(64)) as f64 * 0.5).round() as Micros
        );
        assert_eq!(model.group_us(8, &[], |_| 1.0), None);
        assert_eq!(model.group_us(8, &[StepWork::default()], |_| 1.0), None);
    }

    #[test]
    fn the_bracket_ends_are_the_two_readings_of_the_decode_figures() {
        let empty_full = |model: &CostModel| {
            model.decode_us(DecodeWork {
                seqs: 256,
                kv_tokens: 512_000,
            }) as f64
                / model.decode_base_us
        };
        assert!((empty_full(&DEEPSEEK_V3_EP_LOW.cost) - 2.1).abs() < 0.05);
        assert!((empty_full(&DEEPSEEK_V3_EP_HIGH.cost) - 6.5).abs() < 0.1);
        // Both reproduce SGLang's full batch: 91.9 ms.
        for model in [
            DEEPSEEK_V3_EP_LOW.cost,
            DEEPSEEK_V3_EP_HIGH.cost,
            DEEPSEEK_V3_EP.cost,
        ] {
            let full = model.decode_us(DecodeWork {
                seqs: 256,
                kv_tokens: 512_000,
            });
            assert!(full.abs_diff(91_913) < 100, "{full}");
        }
        assert!(StepNoise::NONE.is_none() && !DEEPSEEK_V3_EP_HIGH.noise.is_none());
        assert_eq!(DEEPSEEK_V3_EP_HIGH.noise.factor(0.0, 0.5), 1.0);
        assert!((DEEPSEEK_V3_EP_HIGH.noise.factor(1.0, 0.001) - 1.33).abs() < 1e-9);
    }

    #[test]
    fn the_legacy_preset_is_the_old_model() {
        let model = &LEGACY.cost;
        // 20k tokens/s, no step cost, no attention term.
        assert_eq!(prefill(model, &[(5000, 2000)]), 100_000);
        // 20 ms + 0.25 µs per KV token, whatever the batch.
        assert_eq!(decode(model, 7, 200_000), 70_000);
    }
}
