//! `chat`: multi-turn sessions, closed loop. Sessions start with Poisson
//! arrivals; each has its own system prompt and a few turns. Every turn sends
//! the whole conversation so far (system prompt, every earlier user message
//! and every earlier answer as the server streamed it) plus a new user
//! message, after the previous answer has fully arrived and a think time has
//! passed. The history grows turn by turn, so each turn's prompt extends the
//! previous one: a rank that served the session holds most of it in cache.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Geometric};

use super::lengths::{poisson_arrivals, LengthModel};
use super::{answer_tag, text, OutputCap, Session, Shape, Turn};

pub const DESCRIPTION: &str = "closed-loop multi-turn sessions over streamed `/v1/chat/completions`: sessions start with Poisson arrivals (rate / 4.16 mean turns), 1 + geometric(p = 1/5) turns capped at 8 (mean 4.16; fewer when the history would outgrow the prompt limit), a unique system prompt of lognormal(median 300, sigma 0.5) tokens, user messages lognormal(median 60, sigma 0.9) in [4, 1500], answers lognormal(median 180, sigma 0.7) in [8, 800] tokens, think time exponential(mean 3 s) in [0.5, 10] s; each turn resends the whole history including the streamed answers; benchmark runs send no turn later than 20 s after the last session start";

pub const MAX_TURNS: u32 = 8;
/// Mean turns of a session: 1 + geometric(p = 1/5) capped at 8 has mean
/// (1 - 0.8^8) / 0.2 = 4.16 (the prompt limit trims a little more).
pub const MEAN_TURNS: f64 = 4.16;
pub const SYSTEM: LengthModel = LengthModel {
    median: 300.0,
    sigma: 0.5,
    min: 50,
    max: 1500,
};
pub const USER: LengthModel = LengthModel {
    median: 60.0,
    sigma: 0.9,
    min: 4,
    max: 1500,
};
pub const ANSWER: LengthModel = LengthModel {
    median: 180.0,
    sigma: 0.7,
    min: 8,
    max: 800,
};
pub const THINK_MEAN_S: f64 = 3.0;
/// Benchmark runs send no turn that would start more than this many
/// simulated seconds after the last session start: the sessions still open
/// then trail on at a falling load that says little about routing.
pub const TAIL_S: f64 = 20.0;
pub const THINK_RANGE_S: (f64, f64) = (0.5, 10.0);
/// Prompt tokens an answer of n output tokens adds to the history: the
/// simulator answers one word per token, a token again when resent.
pub const HISTORY_TOKENS_PER_OUTPUT: f64 = 1.0;
/// Tokens the chat template adds around each message.
pub const TEMPLATE_TOKENS_PER_MESSAGE: f64 = 6.0;
const TAG: u64 = 4;

pub fn sessions(shape: &Shape, cap: OutputCap) -> Result<Vec<Session>, String> {
    let mut rng = StdRng::seed_from_u64(text::seed_of(&[TAG, shape.seed]));
    let starts = poisson_arrivals(shape.rate / MEAN_TURNS, shape.duration_s, &mut rng)?;
    let extra_turns = Geometric::new(1.0 / 5.0).map_err(|e| format!("turns: {e}"))?;
    let think = Exp::new(1.0 / THINK_MEAN_S).map_err(|e| format!("think time: {e}"))?;
    let answer = ANSWER.capped(shape.max_output);
    let mut out = Vec::with_capacity(starts.len());
    for (id, start_s) in starts.into_iter().enumerate() {
        let id = id as u32;
        let system_tokens = SYSTEM.capped(shape.max_prompt / 2).sample(&mut rng);
        let system = text::words(text::seed_of(&[TAG, shape.seed, u64::from(id)]), system_tokens);
        let wanted = (1 + extra_turns.sample(&mut rng)).min(u64::from(MAX_TURNS)) as u32;
        let mut history = f64::from(system_tokens);
        let mut turns = Vec::new();
        for turn in 0..wanted {
            let user_tokens = USER.sample(&mut rng);
            let output_tokens = answer.sample(&mut rng);
            let think_s = if turn == 0 {
                0.0
            } else {
                think.sample(&mut rng).clamp(THINK_RANGE_S.0, THINK_RANGE_S.1)
            };
            // Keep drawing so a session's later turns do not depend on the limit.
            let _ = rng.random::<u32>();
            if history + f64::from(user_tokens) + 3.0 * TEMPLATE_TOKENS_PER_MESSAGE
                > f64::from(shape.max_prompt)
            {
                break;
            }
            let user = text::tagged(
                text::seed_of(&[TAG, shape.seed, u64::from(id), 1 + u64::from(turn)]),
                user_tokens,
                answer_tag(&[TAG, shape.seed, u64::from(id), u64::from(turn)]),
            );
            history += f64::from(user.tokens)
                + HISTORY_TOKENS_PER_OUTPUT * f64::from(output_tokens)
                + 2.0 * TEMPLATE_TOKENS_PER_MESSAGE;
            turns.push(Turn {
                think_s,
                user: user.text,
                output_tokens,
                max_tokens: cap.cap(output_tokens),
                answer_tag: user.tag,
            });
        }
        if !turns.is_empty() {
            out.push(Session {
                id,
                start_s,
                system,
                turns,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(max_prompt: u32) -> Shape {
        Shape {
            rate: 10.0,
            duration_s: 200.0,
            seed: 3,
            max_prompt,
            max_output: 1024,
        }
    }

    #[test]
    fn sessions_have_several_turns_at_about_the_asked_rate() {
        let sessions = sessions(&shape(8000), OutputCap::Fixed(4096)).unwrap();
        let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
        let rate = turns as f64 / 200.0;
        assert!((7.0..13.0).contains(&rate), "turn rate {rate}");
        assert!(sessions.iter().all(|s| s.turns[0].think_s == 0.0));
        assert!(sessions
            .iter()
            .flat_map(|s| s.turns.iter().skip(1))
            .all(|t| (0.5..=10.0).contains(&t.think_s)));
        assert!(sessions.iter().any(|s| s.turns.len() >= 5));
    }

    #[test]
    fn the_prompt_limit_trims_sessions() {
        let long: usize = sessions(&shape(8000), OutputCap::Fixed(4096))
            .unwrap()
            .iter()
            .map(|s| s.turns.len())
            .sum();
        let short: usize = sessions(&shape(1200), OutputCap::Fixed(4096))
            .unwrap()
            .iter()
            .map(|s| s.turns.len())
            .sum();
        assert!(short < long, "{short} vs {long}");
    }
}
