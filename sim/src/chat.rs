//! The chat template the simulated model uses (ChatML markers).
//!
//! Every message is rendered as `<|im_start|>{role}\n{content}<|im_end|>\n`,
//! in order, and the generation prompt `<|im_start|>assistant\n` follows. A
//! conversation's next request (history + the assistant's answer + a new
//! user message) therefore starts with the previous request's prompt
//! followed by the answer, so its tokens extend the previous turn's tokens
//! and the answer's: what SGLang's radix cache needs for a multi-turn hit.

use serde_json::Value;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

const START: &str = "<|im_start|>";
const END: &str = "<|im_end|>\n";
const GENERATION_PROMPT: &str = "<|im_start|>assistant\n";

/// The prompt text for `messages`: every message, then the generation prompt.
pub fn template(messages: &[Message]) -> String {
    let mut text = String::new();
    for message in messages {
        push_message(&mut text, &message.role, [message.content.as_str()]);
    }
    text.push_str(GENERATION_PROMPT);
    text
}

fn push_message<'a>(text: &mut String, role: &str, content: impl IntoIterator<Item = &'a str>) {
    text.push_str(START);
    text.push_str(role);
    text.push('\n');
    for part in content {
        text.push_str(part);
    }
    text.push_str(END);
}

/// The prompt text for the `messages` array of an OpenAI chat request:
/// `content` as a string or as parts with `text`; a missing role counts as
/// `user`. None if `messages` is not an array.
pub fn template_json(messages: &Value) -> Option<String> {
    let Value::Array(messages) = messages else {
        return None;
    };
    let mut text = String::new();
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("user");
        let parts: Vec<&str> = match message.get("content") {
            Some(Value::String(content)) => vec![content.as_str()],
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect(),
            _ => Vec::new(),
        };
        push_message(&mut text, role, parts);
    }
    text.push_str(GENERATION_PROMPT);
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tokens;
    use serde_json::json;

    #[test]
    fn the_next_turn_extends_the_previous_prompt_and_answer() {
        let first = vec![
            Message::new("system", "Be brief."),
            Message::new("user", "Hi there"),
        ];
        let answer = " the quick brown fox";
        let mut second = first.clone();
        second.push(Message::new("assistant", answer));
        second.push(Message::new("user", "And then?"));
        let first_text = template(&first);
        let second_text = template(&second);
        assert!(second_text.starts_with(&format!("{first_text}{answer}")));
        let mut expected = tokens(&first_text);
        expected.extend(tokens(answer));
        let second_tokens = tokens(&second_text);
        assert_eq!(&second_tokens[..expected.len()], expected.as_slice());
    }

    #[test]
    fn json_messages_render_like_typed_ones() {
        let messages = json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]);
        assert_eq!(
            template_json(&messages).unwrap(),
            template(&[Message::new("system", "S"), Message::new("user", "ab")])
        );
        assert!(template_json(&json!({})).is_none());
    }
}
