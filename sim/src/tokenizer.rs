//! A deterministic, content-based tokenizer.
//!
//! Token boundaries are decided locally from the text, the way a BPE
//! pre-tokenizer splits it: a word with its leading space, runs of digits in
//! groups of three, whitespace runs, punctuation in pairs, one token per CJK
//! character, special markers such as `<|im_start|>` whole; a long word is
//! cut into pieces chosen from the word itself. Appending text therefore
//! changes at most the last pre-token (word, digit run, ...) of what was
//! there before, and texts sharing a prefix share its tokens up to the
//! pre-token that straddles the point where they part.
//!
//! Bytes per token depend on the content, as with a real tokenizer: about
//! 4 to 5 for English prose, about 3 for code and digits, 3 for CJK, less
//! for other scripts. `bytes / 4` is therefore only an estimate of what this
//! tokenizer counts.
//!
//! Token ids are hashes of the token's bytes: equal pieces get equal ids.

/// Longest word piece kept whole (in characters).
const WHOLE_WORD_CHARS: usize = 6;
/// Longest piece of a word in a non-Latin script (in characters).
const OTHER_SCRIPT_PIECE_CHARS: usize = 2;
/// Longest whitespace token in bytes.
const WHITESPACE_PIECE_BYTES: usize = 8;
/// Digits per token.
const DIGIT_GROUP: usize = 3;
/// Punctuation characters per token.
const PUNCT_GROUP: usize = 2;
/// Longest special marker `<|...|>` in bytes.
const MARKER_MAX_BYTES: usize = 32;

/// The token ids of `text`.
pub fn tokens(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    for_each_token(text, |piece| ids.push(token_id(piece)));
    ids
}

/// How many tokens `text` has (no allocation).
pub fn count_tokens(text: &str) -> usize {
    let mut count = 0;
    for_each_token(text, |_| count += 1);
    count
}

/// The id of one token: a hash of its bytes.
pub fn token_id(piece: &[u8]) -> u32 {
    let hash = fnv1a(piece);
    (hash ^ (hash >> 32)) as u32
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Word,
    Digit,
    Space,
    Punct,
    /// One token per character (CJK, kana, hangul).
    Ideograph,
    /// Other symbols (emoji, ...): a token per two bytes.
    Symbol,
}

fn class_of(c: char) -> Class {
    if c.is_ascii_alphabetic() {
        Class::Word
    } else if c.is_ascii_digit() {
        Class::Digit
    } else if c.is_whitespace() {
        Class::Space
    } else if c.is_ascii() {
        Class::Punct
    } else if is_ideograph(c) {
        Class::Ideograph
    } else if c.is_alphabetic() {
        Class::Word
    } else if c.is_numeric() {
        Class::Digit
    } else {
        Class::Symbol
    }
}

fn is_ideograph(c: char) -> bool {
    matches!(u32::from(c),
        0x2E80..=0x9FFF | 0xAC00..=0xD7AF | 0xF900..=0xFAFF | 0x20000..=0x2FFFF)
}

/// A special marker `<|name|>` at the start of `rest`, its length in bytes.
fn marker_len(rest: &[u8]) -> Option<usize> {
    if !rest.starts_with(b"<|") {
        return None;
    }
    let limit = rest.len().min(MARKER_MAX_BYTES);
    let mut index = 2;
    while index + 1 < limit {
        let byte = rest[index];
        if byte == b'|' && rest[index + 1] == b'>' {
            return (index > 2).then_some(index + 2);
        }
        if !(byte.is_ascii_alphanumeric() || byte == b'_') {
            return None;
        }
        index += 1;
    }
    None
}

/// Calls `emit` with the bytes of every token of `text`, in order.
pub fn for_each_token(text: &str, mut emit: impl FnMut(&[u8])) {
    let bytes = text.as_bytes();
    let mut pos = 0;
    while pos < bytes.len() {
        let rest = &text[pos..];
        if let Some(len) = marker_len(&bytes[pos..]) {
            emit(&bytes[pos..pos + len]);
            pos += len;
            continue;
        }
        let Some(first) = rest.chars().next() else {
            break;
        };
        let class = class_of(first);
        let run_end = pos + run_len(rest, class);
        match class {
            Class::Space => {
                // A single space before a word belongs to the word.
                let mut end = run_end;
                let next_is_word = text[run_end..]
                    .chars()
                    .next()
                    .is_some_and(|c| class_of(c) == Class::Word);
                if next_is_word && bytes[run_end - 1] == b' ' {
                    end -= 1;
                }
                emit_chunks(&bytes[pos..end], WHITESPACE_PIECE_BYTES, &mut emit);
                if end < run_end {
                    let word_end = run_end + run_len(&text[run_end..], Class::Word);
                    emit_word(&text[end..word_end], &mut emit);
                    pos = word_end;
                } else {
                    pos = end;
                }
            }
            Class::Word => {
                emit_word(&text[pos..run_end], &mut emit);
                pos = run_end;
            }
            Class::Digit => {
                emit_char_groups(&text[pos..run_end], DIGIT_GROUP, &mut emit);
                pos = run_end;
            }
            Class::Punct => {
                emit_char_groups(&text[pos..run_end], PUNCT_GROUP, &mut emit);
                pos = run_end;
            }
            Class::Ideograph => {
                emit_char_groups(&text[pos..run_end], 1, &mut emit);
                pos = run_end;
            }
            Class::Symbol => {
                emit_chunks(&bytes[pos..run_end], 2, &mut emit);
                pos = run_end;
            }
        }
    }
}

/// Bytes of the run of `class` at the start of `text` (markers end runs).
fn run_len(text: &str, class: Class) -> usize {
    let bytes = text.as_bytes();
    let mut len = 0;
    for c in text.chars() {
        if class_of(c) != class || (len > 0 && marker_len(&bytes[len..]).is_some()) {
            break;
        }
        len += c.len_utf8();
    }
    len
}

fn emit_chunks(bytes: &[u8], size: usize, emit: &mut impl FnMut(&[u8])) {
    for chunk in bytes.chunks(size) {
        emit(chunk);
    }
}

/// Groups of `size` characters.
fn emit_char_groups(text: &str, size: usize, emit: &mut impl FnMut(&[u8])) {
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut in_group = 0;
    for (index, _) in text.char_indices() {
        if in_group == size {
            emit(&bytes[start..index]);
            start = index;
            in_group = 0;
        }
        in_group += 1;
    }
    if start < bytes.len() {
        emit(&bytes[start..]);
    }
}

/// A word, possibly with one leading space: whole if short, else pieces
/// whose lengths (3 to 6 characters) come from a hash of the word itself.
fn emit_word(word: &str, emit: &mut impl FnMut(&[u8])) {
    let bytes = word.as_bytes();
    let letters = word.trim_start_matches(' ');
    let chars = letters.chars().count();
    let latin = letters.is_ascii();
    if latin && chars <= WHOLE_WORD_CHARS {
        emit(bytes);
        return;
    }
    let hash = fnv1a(letters.as_bytes());
    let mut piece_index = 0u32;
    let mut start = 0;
    let mut in_piece = 0;
    let mut remaining = chars;
    let mut target = piece_chars(latin, hash, piece_index, remaining);
    // The leading space stays with the first piece.
    let offset = word.len() - letters.len();
    for (index, _) in letters.char_indices() {
        if in_piece == target {
            emit(&bytes[start..offset + index]);
            start = offset + index;
            remaining -= in_piece;
            in_piece = 0;
            piece_index += 1;
            target = piece_chars(latin, hash, piece_index, remaining);
        }
        in_piece += 1;
    }
    emit(&bytes[start..]);
}

fn piece_chars(latin: bool, hash: u64, index: u32, remaining: usize) -> usize {
    if !latin {
        return OTHER_SCRIPT_PIECE_CHARS;
    }
    if remaining <= WHOLE_WORD_CHARS {
        return remaining;
    }
    3 + ((hash >> ((index % 16) * 4)) & 3) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for_each_token(text, |piece| {
            out.push(String::from_utf8_lossy(piece).into_owned())
        });
        out
    }

    #[test]
    fn pieces_follow_the_pre_tokenizer_rules() {
        assert_eq!(pieces("Hello world"), ["Hello", " world"]);
        assert_eq!(
            pieces("x = 1234567;"),
            ["x", " ", "=", " ", "123", "456", "7", ";"]
        );
        assert_eq!(
            pieces("<|im_start|>user\nhi"),
            ["<|im_start|>", "user", "\n", "hi"]
        );
        assert_eq!(pieces("  indent"), [" ", " indent"]);
        assert_eq!(pieces("中文"), ["中", "文"]);
        // A long word is split, deterministically, the leading space kept.
        let long = pieces(" internationalization");
        assert!(long.len() >= 3, "{long:?}");
        assert!(long[0].starts_with(' '));
        assert_eq!(long.concat(), " internationalization");
        assert_eq!(long, pieces(" internationalization"));
        // Not a marker: the bar sequence is punctuation.
        assert_eq!(pieces("<|a b|>"), ["<|", "a", " b", "|>"]);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        for text in ["", "a", "é", "🙂 ok", "tab\there\n\n\n\nnext", "x<|y|>z", "<|"] {
            let mut joined = Vec::new();
            for_each_token(text, |piece| joined.extend_from_slice(piece));
            assert_eq!(joined, text.as_bytes(), "{text:?}");
        }
    }

    #[test]
    fn appending_text_leaves_the_tokens_before_the_last_word_alone() {
        let texts = [
            "The quick brown fox, 12345 times: internationalization!",
            "fn main() {\n    let x = vec![1, 2, 3];\n}",
            "<|im_start|>user\n你好，世界 — café 🙂<|im_end|>",
        ];
        for text in texts {
            let whole = tokens(text);
            for (cut, c) in text.char_indices().skip(1) {
                let before = text[..cut].chars().last().unwrap_or(' ');
                // Cut where a word or number ends: the text so far keeps
                // all its tokens.
                let head_text = &text[..cut];
                let in_marker = head_text.matches("<|").count() > head_text.matches("|>").count();
                if before.is_alphanumeric() && !c.is_alphanumeric() && !in_marker {
                    let head = tokens(&text[..cut]);
                    assert_eq!(&whole[..head.len()], head.as_slice(), "{text:?} cut at {cut}");
                }
            }
            // Texts sharing a prefix share its tokens.
            let other = tokens(&format!("{text} and more"));
            assert_eq!(&other[..whole.len()], whole.as_slice(), "{text:?}");
        }
    }

    #[test]
    fn bytes_per_token_depend_on_the_content() {
        let ratio = |text: &str| text.len() as f64 / count_tokens(text) as f64;
        let english = "The history of artificial intelligence began in antiquity, with myths, stories \
                       and rumors of artificial beings endowed with intelligence or consciousness by \
                       master craftsmen. The seeds of modern AI were planted by philosophers who \
                       attempted to describe the process of human thinking.";
        let code = "fn main() {\n    let mut total: u64 = 0;\n    for (i, v) in values.iter().enumerate() {\n        \
                    if *v > limit { total += v * 2; }\n    }\n}\n";
        let digits = "3.14159265358979 2.71828182845904 1.41421356237309 65536 4294967296";
        let chinese = "人工智能的历史始于古代，有关于由工匠大师赋予智能或意识的人造生物的神话。";
        let english = ratio(english);
        assert!((3.8..5.0).contains(&english), "english {english}");
        assert!(ratio(code) < english - 0.8, "code {}", ratio(code));
        assert!(ratio(digits) < 3.0, "digits {}", ratio(digits));
        assert!((2.5..3.5).contains(&ratio(chinese)), "chinese {}", ratio(chinese));
    }

    #[test]
    fn ids_are_stable_and_count_matches() {
        let text = "The quick brown fox jumps over the lazy dog.";
        assert_eq!(tokens(text), tokens(text));
        assert_eq!(tokens(text).len(), count_tokens(text));
        assert_eq!(tokens(" the")[0], tokens("a the")[1]);
    }
}
