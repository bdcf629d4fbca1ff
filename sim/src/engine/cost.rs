//! What one forward pass of a rank costs, from the work in it: pure
//! arithmetic, no scheduling (the rank scheduler builds the work, this
//! prices it). The presets, their sources and how they were fitted are in
//! sim/README.md ("Step costs").

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
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub prefill_base_us: f64,
    pub prefill_us_per_token: f64,
    pub prefill_us_per_pair: f64,
    pub decode_base_us: f64,
    pub decode_us_per_seq: f64,
    pub decode_us_per_kv_token: f64,
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
        let has_prefill = prefill.tokens > 0;
        let has_decode = decode.seqs > 0;
        if !has_prefill && !has_decode {
            return 0;
        }
        let base = match (has_prefill, has_decode) {
            (true, true) => self.prefill_base_us.max(self.decode_base_us),
            (true, false) => self.prefill_base_us,
            _ => self.decode_base_us,
        };
        let us = base
            + self.prefill_us_per_token * prefill.tokens as f64
            + self.prefill_us_per_pair * prefill.pairs
            + self.decode_us_per_seq * decode.seqs as f64
            + self.decode_us_per_kv_token * decode.kv_tokens as f64;
        us.max(0.0).round() as Micros
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
}

/// DeepSeek-V3 under DP attention and expert parallelism on H100-class
/// GPUs, per rank (GPU), fitted in sim/README.md.
pub const DEEPSEEK_V3_DP8: Deployment = Deployment {
    cost: CostModel {
        prefill_base_us: 14_040.0,
        prefill_us_per_token: 131.7,
        prefill_us_per_pair: 0.013_07,
        decode_base_us: 14_040.0,
        decode_us_per_seq: 252.7,
        decode_us_per_kv_token: 0.025_74,
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
    },
    dp_size: 8,
    dp_attention: false,
    kv_capacity: 400_000,
    max_running: 256,
    // vLLM's defaults on an H100 for the OpenAI server: 16-token blocks,
    // max_num_seqs 1024.
    vllm_block_size: 16,
    vllm_max_num_seqs: 1024,
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
    },
    dp_size: 4,
    dp_attention: true,
    kv_capacity: 200_000,
    max_running: 64,
    vllm_block_size: 16,
    vllm_max_num_seqs: 64,
};

/// The deployment the simulator models: a rank's step costs, ranks per
/// worker, DP attention, KV capacity and running requests per rank (each
/// overridable by its own flag). See sim/README.md ("Step costs").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CostPreset {
    /// DeepSeek-V3 under DP attention on H100-class GPUs: 8 ranks in
    /// lockstep, costs fitted to SGLang's and DeepSeek's published figures.
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
    fn the_legacy_preset_is_the_old_model() {
        let model = &LEGACY.cost;
        // 20k tokens/s, no step cost, no attention term.
        assert_eq!(prefill(model, &[(5000, 2000)]), 100_000);
        // 20 ms + 0.25 µs per KV token, whatever the batch.
        assert_eq!(decode(model, 7, 200_000), 70_000);
    }
}
