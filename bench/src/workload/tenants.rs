//! `tenants`: chat requests from a few tenants, each with its own long system
//! prompt; tenant popularity is Zipf, so the hottest prefix carries about a
//! third of the traffic and the coldest a percent or two. A prefix-aware
//! router can reuse each rank's cache of a system prompt, but piling a hot
//! tenant onto one rank queues it.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::lengths::{poisson_arrivals, zipf_pick, zipf_weights, LengthModel};
use super::{answer_tag, bodies, text, Api, OpenRequest, OutputCap, Shape};

pub const DESCRIPTION: &str = "streamed `/v1/chat/completions`, Poisson arrivals; 16 tenants with Zipf(1.2) popularity (the hottest ~36% of requests), each with its own system prompt of lognormal(median 1500, sigma 0.5) in [300, 4000] tokens, then a user question of lognormal(median 150, sigma 0.8) in [8, 2000] tokens; outputs lognormal(median 180, sigma 0.8) in [1, 1024]";

pub const TENANTS: usize = 16;
pub const ZIPF_S: f64 = 1.2;
pub const SYSTEM: LengthModel = LengthModel {
    median: 1500.0,
    sigma: 0.5,
    min: 300,
    max: 4000,
};
pub const QUESTION: LengthModel = LengthModel {
    median: 150.0,
    sigma: 0.8,
    min: 8,
    max: 2000,
};
const TAG: u64 = 3;

pub fn requests(shape: &Shape, cap: OutputCap) -> Result<Vec<OpenRequest>, String> {
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, shape.seed]));
    // System prompts leave room for a question of at least QUESTION.min.
    let system_model = SYSTEM.capped(shape.max_prompt.saturating_sub(QUESTION.min).max(1));
    let systems: Vec<(String, u32)> = (0..TENANTS as u64)
        .map(|tenant| {
            let tokens = system_model.sample(&mut rng);
            (
                text::words(text::seed_of(&[TAG, shape.seed, 1, tenant]), tokens),
                tokens,
            )
        })
        .collect();
    let weights = zipf_weights(TENANTS, ZIPF_S);
    let output = LengthModel::SHAREGPT_OUTPUT.capped(shape.max_output);
    let arrivals = poisson_arrivals(shape.rate, shape.duration_s, &mut rng)?;
    Ok(arrivals
        .iter()
        .enumerate()
        .map(|(i, at_s)| {
            let tenant = zipf_pick(&weights, &mut rng);
            let (system, system_tokens) = &systems[tenant];
            let question_tokens = QUESTION
                .capped(shape.max_prompt.saturating_sub(*system_tokens).max(1))
                .sample(&mut rng);
            let output_tokens = output.sample(&mut rng);
            let question = text::tagged(
                text::seed_of(&[TAG, shape.seed, 2, i as u64]),
                question_tokens,
                answer_tag(&[TAG, shape.seed, i as u64]),
            );
            let messages = [("system", system.as_str()), ("user", question.text.as_str())];
            let max_tokens = cap.cap(output_tokens);
            OpenRequest {
                at_s: *at_s,
                api: Api::Chat,
                body: bodies::chat(&messages, max_tokens),
                input_tokens: text::chat_tokens(&messages) as u32,
                output_tokens,
                answer_tag: question.tag,
                tenant: Some(tenant as u32),
                high: None,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_a_tenant_share_its_system_prompt() {
        let shape = Shape {
            rate: 20.0,
            duration_s: 50.0,
            seed: 8,
            max_prompt: 8000,
            max_output: 1024,
        };
        let requests = requests(&shape, OutputCap::Fixed(2048)).unwrap();
        let system_of = |r: &OpenRequest| -> String {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["messages"][0]["content"].as_str().unwrap().to_string()
        };
        let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for r in &requests {
            *counts.entry(system_of(r)).or_default() += 1;
        }
        let hottest = counts.values().copied().max().unwrap();
        assert!(
            hottest * 4 > requests.len(),
            "hot tenant {hottest} of {}",
            requests.len()
        );
        assert!((10..=16).contains(&counts.len()), "{} tenants seen", counts.len());
        assert!(counts.keys().all(|s| text::count_tokens(s) >= 300));
        assert!(requests.iter().all(|r| r.input_tokens <= 8000 + 16));
    }
}
