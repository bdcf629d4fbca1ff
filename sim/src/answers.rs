//! Where a simulated answer ends, known out of band.
//!
//! A real model stops at its end-of-sequence token; `max_new_tokens` is only
//! the client's cap. The simulated model has no EOS of its own, so a
//! benchmark tells it how long each answer is without putting the length
//! in the request: the prompt ends with an opaque tag (a word made of
//! [`MARK`] and letters drawn from a hash, never from the length), and the
//! tag's answer length is given to the simulator apart from the request
//! (`POST /_sim/answers`, or `offline::Request::answer_after`). A router
//! sees the tag as a few words of prompt text and nothing more; the lengths
//! live only in the simulator. A request whose prompt holds no known tag
//! runs to its `max_new_tokens`, as before.

use std::collections::HashMap;
use std::sync::Mutex;

use serde::Deserialize;

use crate::sync::lock;

/// Starts every tag word (after a space): letters no generated text puts
/// together by chance often enough to matter, and an unknown tag is ignored.
pub const MARK: &str = "zqxj";
/// Letters after the mark.
pub const TAG_LETTERS: usize = 8;
/// The token id `/generate` reports as the matched stop token.
pub const EOS_TOKEN_ID: u64 = 2;

/// The tag word for `id` (an opaque number: a hash, not a length), with its
/// leading space, to append to a prompt.
pub fn tag_text(id: u64) -> String {
    let mut text = String::with_capacity(1 + MARK.len() + TAG_LETTERS);
    text.push(' ');
    text.push_str(MARK);
    text.push_str(&tag_letters(id));
    text
}

/// The letters naming `id` (what [`find_tag`] returns).
pub fn tag_letters(id: u64) -> String {
    let mut rest = id;
    (0..TAG_LETTERS)
        .map(|_| {
            let letter = b'a' + (rest % 26) as u8;
            rest /= 26;
            char::from(letter)
        })
        .collect()
}

/// The last tag in `text`: the letters after the last " " + [`MARK`].
pub fn find_tag(text: &str) -> Option<&str> {
    let needle = format!(" {MARK}");
    let start = text.rfind(&needle)? + needle.len();
    let rest = &text[start..];
    let end = rest.find(|c: char| !c.is_ascii_lowercase()).unwrap_or(rest.len());
    (end == TAG_LETTERS).then(|| &rest[..end])
}

/// The answer lengths of one process, by tag.
#[derive(Debug, Default)]
pub struct AnswerBook {
    lengths: Mutex<HashMap<String, u64>>,
}

/// `POST /_sim/answers`: lengths to add (a tag given again is replaced);
/// `clear` empties the book first.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswersUpdate {
    #[serde(default)]
    pub clear: bool,
    #[serde(default)]
    pub lengths: HashMap<String, u64>,
}

impl AnswerBook {
    /// Applies an update; returns how many tags the book holds.
    pub fn apply(&self, update: AnswersUpdate) -> Result<usize, String> {
        if let Some((tag, _)) = update.lengths.iter().find(|(_, n)| **n == 0) {
            return Err(format!("answer length of `{tag}` must be at least 1"));
        }
        let mut lengths = lock(&self.lengths);
        if update.clear {
            lengths.clear();
        }
        lengths.extend(update.lengths);
        Ok(lengths.len())
    }

    pub fn len(&self) -> usize {
        lock(&self.lengths).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The answer length of `tag` (the letters [`find_tag`] returns).
    pub fn length(&self, tag: &str) -> Option<u64> {
        lock(&self.lengths).get(tag).copied()
    }

    /// The answer length of the tag in `text`, if the book knows it.
    pub fn length_of(&self, text: &str) -> Option<u64> {
        self.length(find_tag(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_tag_of_a_text_is_found() {
        let a = tag_text(12_345);
        let b = tag_text(987_654_321);
        assert_ne!(a, b);
        let text = format!("hello there{a} and later{b}");
        assert_eq!(find_tag(&text), Some(&b[1 + MARK.len()..]));
        // In a chat template the tag is followed by markers.
        let chat = format!("<|im_start|>user\nwhat now{a}<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(find_tag(&chat).map(str::to_string), Some(tag_letters(12_345)));
        assert_eq!(find_tag("no tag here"), None);
        // A mark without the right number of letters is not a tag.
        assert_eq!(find_tag(&format!("x {MARK}abc")), None);
    }

    #[test]
    fn the_book_answers_for_known_tags_only() {
        let book = AnswerBook::default();
        let mut lengths = HashMap::new();
        lengths.insert(tag_letters(7), 42);
        assert_eq!(
            book.apply(AnswersUpdate {
                clear: false,
                lengths
            }),
            Ok(1)
        );
        assert_eq!(book.length_of(&format!("prompt{}", tag_text(7))), Some(42));
        assert_eq!(book.length_of(&format!("prompt{}", tag_text(8))), None);
        let mut zero = HashMap::new();
        zero.insert("x".to_string(), 0);
        assert!(book
            .apply(AnswersUpdate {
                clear: false,
                lengths: zero
            })
            .is_err());
        assert_eq!(
            book.apply(AnswersUpdate {
                clear: true,
                ..AnswersUpdate::default()
            }),
            Ok(0)
        );
        assert!(book.is_empty());
    }
}
