//! Prompt text of a known token count, deterministic from a seed.
//!
//! Token counting follows the simulator's prompt-size rule, so the lengths a
//! workload asks for are the lengths the simulated server sees. Today's
//! simulator counts ceil(UTF-8 bytes / 4) (sim/README.md, "Prompt size");
//! every word here is four bytes (three letters and a space), so a text of n
//! words is exactly n tokens and concatenating texts adds their counts.
//! SIM-TOKENIZER: when the simulator ships its content-based tokenizer
//! (`dprank_sim::tokenizer`), `count_tokens` and `words` switch to it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Four-byte words: enough variety that two unrelated prompts share no
/// prefix beyond a word or two (prefix-aware routers compare text).
const WORDS: [&str; 32] = [
    "the ", "cat ", "sat ", "far ", "big ", "red ", "sky ", "old ", "new ", "air ", "sea ", "map ", "key ",
    "row ", "set ", "top ", "law ", "box ", "pen ", "oak ", "ice ", "sun ", "dog ", "fox ", "war ", "art ",
    "end ", "day ", "way ", "car ", "job ", "tea ",
];

/// Tokens the simulated server counts for `text` (prompt strings).
pub fn count_tokens(text: &str) -> usize {
    text.len().div_ceil(4)
}

/// `tokens` tokens of text drawn from `seed`. The text for n tokens is a
/// prefix of the text for m > n tokens with the same seed, so a block cut
/// short still shares its opening with the whole block.
pub fn words(seed: u64, tokens: u32) -> String {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut text = String::with_capacity(tokens as usize * 4);
    for _ in 0..tokens {
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text
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
    fn words_have_the_asked_token_count_and_are_prefix_stable() {
        for n in [0, 1, 7, 512, 3000] {
            assert_eq!(count_tokens(&words(5, n)), n as usize);
        }
        let long = words(9, 100);
        assert!(long.starts_with(&words(9, 40)));
        assert_ne!(words(9, 40), words(10, 40));
        let joined = words(1, 30) + &words(2, 50);
        assert_eq!(count_tokens(&joined), 80);
    }

    #[test]
    fn seeds_differ_by_every_part_and_order() {
        assert_eq!(seed_of(&[1, 2, 3]), seed_of(&[1, 2, 3]));
        assert_ne!(seed_of(&[1, 2, 3]), seed_of(&[1, 2, 4]));
        assert_ne!(seed_of(&[1, 2]), seed_of(&[2, 1]));
    }
}
