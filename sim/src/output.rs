//! What the simulated model generates: " the quick brown fox jumps over
//! lazy dog", cycled, one word a token. The words are single tokens of the
//! simulator's tokenizer, so an answer pasted into the next prompt
//! tokenizes to exactly the tokens that were generated.

use crate::tokenizer;

const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog",
];

/// The text of output token `index` (1-based).
pub fn token_text(index: u64) -> &'static str {
    WORDS[((index.max(1) - 1) % WORDS.len() as u64) as usize]
}

/// The token id of output token `index` (1-based).
pub fn token_id(index: u64) -> u32 {
    tokenizer::token_id(token_text(index).as_bytes())
}

/// The text of the first `count` output tokens.
pub fn text_upto(count: u64) -> String {
    (1..=count).map(token_text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_tokenizes_to_the_generated_tokens() {
        let ids: Vec<u32> = (1..=11).map(token_id).collect();
        assert_eq!(tokenizer::tokens(&text_upto(11)), ids);
    }
}
