//! Prompt text of a known token count, deterministic from a seed.
//!
//! Tokens are counted by the simulator's own tokenizer
//! (`dprank_sim::tokenizer`), so the lengths a workload asks for are the
//! lengths the simulated server sees. That tokenizer is content based: bytes
//! per token depend on the text, as with a real one. Each text here draws
//! its own mix of words, digit groups and punctuation from its seed, so
//! bytes per token vary from text to text (about 3 to 5.5): a router's
//! `bytes / 4` estimate is then an estimate, as on a real fleet.
//!
//! Text is built from atoms that are exactly one token wherever they stand:
//! a word of 1-6 letters with its leading space; a group of up to 3 digits
//! right after a word or punctuation; 1-2 punctuation marks right after a
//! word or digits. Every text starts with a word, so texts can be joined and
//! their counts add up. The text of n tokens is the text of m > n tokens
//! (same seed) cut after its n-th atom.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Tokens the simulated server counts for `text` (a prompt string).
pub fn count_tokens(text: &str) -> usize {
    dprank_sim::tokenizer::count_tokens(text)
}

/// Tokens the simulated server counts for a chat request's messages (its
/// chat template applied, as SGLang applies the model's).
pub fn chat_tokens(messages: &[(&str, &str)]) -> usize {
    let messages: Vec<dprank_sim::chat::Message> = messages
        .iter()
        .map(|(role, content)| dprank_sim::chat::Message::new(*role, *content))
        .collect();
    count_tokens(&dprank_sim::chat::template(&messages))
}

/// Relative frequency of word lengths 1..=6 (English-like, long words cut).
const WORD_LENGTHS: [u32; 6] = [4, 17, 21, 18, 14, 26];
const PUNCTUATION: [&str; 10] = [",", ".", ":", ";", "(", ")", "{", "}", "\"", "=="];

#[derive(Clone, Copy, PartialEq)]
enum Atom {
    Word,
    Digits,
    Punct,
}

/// `tokens` tokens of text drawn from `seed` (see the module documentation).
pub fn words(seed: u64, tokens: u32) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    // This text's mix: the shares of digit groups and punctuation.
    let digits_share = rng.random_range(0.0..0.35);
    let punct_share = rng.random_range(0.03..0.3);
    let total_length: u32 = WORD_LENGTHS.iter().sum();
    let mut text = String::with_capacity(tokens as usize * 5);
    let mut last: Option<Atom> = None;
    for _ in 0..tokens {
        let roll = rng.random::<f64>();
        let atom = match last {
            // Digits after digits, or punctuation after punctuation, would
            // merge into one token: a word goes there instead.
            Some(Atom::Word) | Some(Atom::Punct) if roll < digits_share && last != Some(Atom::Digits) => {
                Atom::Digits
            }
            Some(Atom::Word) | Some(Atom::Digits) if roll >= 1.0 - punct_share => Atom::Punct,
            _ => Atom::Word,
        };
        match atom {
            Atom::Word => {
                let mut pick = rng.random_range(0..total_length);
                let mut letters = 1;
                for (i, weight) in WORD_LENGTHS.iter().enumerate() {
                    if pick < *weight {
                        letters = i + 1;
                        break;
                    }
                    pick -= weight;
                }
                text.push(' ');
                for _ in 0..letters {
                    text.push(char::from(b'a' + rng.random_range(0..26u8)));
                }
            }
            Atom::Digits => {
                for _ in 0..rng.random_range(1..=3) {
                    text.push(char::from(b'0' + rng.random_range(0..10u8)));
                }
            }
            Atom::Punct => text.push_str(PUNCTUATION[rng.random_range(0..PUNCTUATION.len())]),
        }
        last = Some(atom);
    }
    text
}

/// Text ending with an answer tag (`dprank_sim::answers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tagged {
    pub text: String,
    /// Tokens of the whole text, tag included.
    pub tokens: u32,
    /// The tag's letters: the key of its answer length.
    pub tag: String,
}

/// The answer tag of `id` as text to append, its tokens and its letters.
pub fn tag(id: u64) -> (String, u32, String) {
    let text = dprank_sim::answers::tag_text(id);
    let tokens = count_tokens(&text) as u32;
    (text, tokens, dprank_sim::answers::tag_letters(id))
}

/// About `tokens` tokens of text drawn from `seed`, the last few of them the
/// answer tag of `id`: at least one word before the tag, so a tiny prompt
/// comes out a little longer than asked.
pub fn tagged(seed: u64, tokens: u32, id: u64) -> Tagged {
    let (tag_text, tag_tokens, letters) = tag(id);
    let body = tokens.saturating_sub(tag_tokens).max(1);
    Tagged {
        text: words(seed, body) + &tag_text,
        tokens: body + tag_tokens,
        tag: letters,
    }
}

/// A seed for one piece of text, mixed from the pieces that identify it
/// (workload, trace seed, tenant, block id...): SplitMix64 over each part.
pub fn seed_of(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for part in parts {
        h = splitmix(h ^ part);
    }
    h
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_have_the_asked_token_count_and_join_additively() {
        for seed in 0..200 {
            for n in [0, 1, 2, 7, 64, 513] {
                assert_eq!(
                    count_tokens(&words(seed, n)),
                    n as usize,
                    "seed {seed}, {n} tokens"
                );
            }
            let joined = words(seed, 30) + &words(seed + 1000, 50) + &words(seed + 2000, 3);
            assert_eq!(count_tokens(&joined), 83, "seed {seed}");
        }
    }

    #[test]
    fn a_shorter_text_is_the_longer_one_cut_short() {
        for seed in 0..50 {
            let long = words(seed, 300);
            let short = words(seed, 120);
            assert!(long.starts_with(&short), "seed {seed}");
        }
        assert_ne!(words(9, 40), words(10, 40));
    }

    #[test]
    fn bytes_per_token_spread_from_text_to_text() {
        let ratios: Vec<f64> = (0..200)
            .map(|seed| words(seed, 400).len() as f64 / 400.0)
            .collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0.0, f64::max);
        let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
        assert!(
            lo < 3.8 && hi > 4.8 && (3.8..4.8).contains(&mean),
            "{lo} {mean} {hi}"
        );
    }

    #[test]
    fn chat_tokens_include_the_template() {
        let system = words(1, 50);
        let user = words(2, 20);
        let n = chat_tokens(&[("system", &system), ("user", &user)]);
        assert!(n > 70 && n < 90, "{n}");
    }

    #[test]
    fn tagged_text_has_the_asked_tokens_and_ends_with_its_tag() {
        for id in 0..200u64 {
            for n in [1, 2, 5, 40, 700] {
                let t = tagged(id, n, id * 7 + 1);
                assert_eq!(count_tokens(&t.text) as u32, t.tokens, "{id} {n}");
                assert!(
                    t.tokens == n || (n < t.tokens && t.tokens <= 8),
                    "{id} {n}: {}",
                    t.tokens
                );
                assert_eq!(dprank_sim::answers::find_tag(&t.text), Some(t.tag.as_str()));
            }
        }
    }

    #[test]
    fn seeds_differ_by_every_part_and_order() {
        assert_eq!(seed_of(&[1, 2, 3]), seed_of(&[1, 2, 3]));
        assert_ne!(seed_of(&[1, 2, 3]), seed_of(&[1, 2, 4]));
        assert_ne!(seed_of(&[1, 2]), seed_of(&[2, 1]));
    }
}
