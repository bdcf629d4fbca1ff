//! `no-prefix`: independent `/generate` requests with Poisson arrivals and
//! ShareGPT-like lengths; no two prompts share more than a word or two.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::lengths::{poisson_arrivals, LengthModel};
use super::{answer_tag, bodies, text, Api, OpenRequest, OutputCap, Shape};

pub const DESCRIPTION: &str = "independent streamed `/generate` requests, Poisson arrivals, prompts lognormal(median 200, sigma 1.1) in [4, 8192] tokens, outputs lognormal(median 180, sigma 0.8) in [1, 1024]";

/// Tag mixed into text seeds so workloads never share text by accident.
const TAG: u64 = 1;

pub fn requests(shape: &Shape, cap: OutputCap) -> Result<Vec<OpenRequest>, String> {
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, shape.seed]));
    let arrivals = poisson_arrivals(shape.rate, shape.duration_s, &mut rng)?;
    Ok(with_lengths(&arrivals, shape, cap, TAG, &mut rng))
}

/// Independent requests at `arrivals` with ShareGPT-like lengths (shared by
/// `bursty`, which only changes the arrivals).
pub fn with_lengths(
    arrivals: &[f64],
    shape: &Shape,
    cap: OutputCap,
    tag: u64,
    rng: &mut StdRng,
) -> Vec<OpenRequest> {
    let input = LengthModel::SHAREGPT_INPUT.capped(shape.max_prompt);
    let output = LengthModel::SHAREGPT_OUTPUT.capped(shape.max_output);
    arrivals
        .iter()
        .enumerate()
        .map(|(i, at_s)| {
            let input_tokens = input.sample(rng);
            let output_tokens = output.sample(rng);
            let prompt = text::tagged(
                text::seed_of(&[tag, shape.seed, i as u64]),
                input_tokens,
                answer_tag(&[tag, shape.seed, i as u64]),
            );
            let max_tokens = cap.cap(output_tokens);
            OpenRequest {
                at_s: *at_s,
                api: Api::Generate,
                body: bodies::generate(&prompt.text, max_tokens, true),
                input_tokens: prompt.tokens,
                output_tokens,
                answer_tag: prompt.tag,
                tenant: None,
                high: None,
            }
        })
        .collect()
}
