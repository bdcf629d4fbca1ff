//! What dprank knows of the shape of SGLang request bodies: which fields a
//! client could pick a rank with, how many prompts a batch holds, and how the
//! fields dprank writes look (docs/protocol.md).

use super::JsonObject;

/// Whether a body dprank cannot parse might still carry one of `names` for
/// a more lenient parser (Python's `json` accepts a BOM, NaN, UTF-16): it
/// opens like an object (after any BOM and whitespace) and names a rank field,
/// ignoring NUL bytes (UTF-16/32) and `\u` escapes of ASCII.
pub fn may_name_a_rank(body: &[u8], names: &[&str]) -> bool {
    let narrow: Vec<u8> = body.iter().copied().filter(|b| *b != 0).collect();
    let opens_like_an_object = narrow
        .iter()
        .find(|b| b.is_ascii() && !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !opens_like_an_object {
        return false;
    }
    let mut text = Vec::with_capacity(narrow.len());
    let mut i = 0;
    while let Some(&b) = narrow.get(i) {
        let escaped = (b == b'\\' && narrow.get(i + 1) == Some(&b'u'))
            .then(|| narrow.get(i + 2..i + 6))
            .flatten()
            .and_then(|hex| u32::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
            .filter(|v| *v < 128);
        match escaped {
            Some(v) => {
                text.push(v as u8);
                i += 6;
            }
            None => {
                text.push(b);
                i += 1;
            }
        }
    }
    names
        .iter()
        .any(|name| !name.is_empty() && text.windows(name.len()).any(|w| w == name.as_bytes()))
}

/// JSON string escaping for a value spliced into a body.
pub fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// Number of prompts in a batched request (`text` an array, or `input_ids`
/// an array of arrays), if batched.
pub fn batch_size(object: &JsonObject) -> Option<usize> {
    if let Some(text) = object.raw_value("text") {
        return serde_json::from_slice::<Vec<serde::de::IgnoredAny>>(text)
            .ok()
            .map(|v| v.len());
    }
    let ids = object.raw_value("input_ids")?;
    let rows: Vec<&serde_json::value::RawValue> = serde_json::from_slice(ids).ok()?;
    rows.first()
        .filter(|r| r.get().trim_start().starts_with('['))
        .map(|_| rows.len())
}

/// The PD bootstrap fields both legs carry so that they meet: the prefill
/// worker's host and bootstrap port (null: none) and a room in [0, 2^63-1]
/// drawn from `random`; a batch gets an array of each, one room per prompt.
pub fn bootstrap_fields(
    object: &JsonObject,
    host: std::net::IpAddr,
    port: Option<u16>,
    mut random: impl FnMut() -> u64,
) -> [(&'static str, String); 3] {
    let host = json_string(&host.to_string());
    let port = port.map_or("null".to_string(), |p| p.to_string());
    let mut room = || (random() >> 1).to_string();
    let (host, port, room) = match batch_size(object) {
        Some(n) => {
            let rooms: Vec<String> = (0..n).map(|_| room()).collect();
            (
                format!("[{}]", vec![host; n].join(",")),
                format!("[{}]", vec![port; n].join(",")),
                format!("[{}]", rooms.join(",")),
            )
        }
        None => (host, port, room()),
    };
    [
        ("bootstrap_host", host),
        ("bootstrap_port", port),
        ("bootstrap_room", room),
    ]
}

impl JsonObject<'_> {
    /// The body with `set` written and every field of `neutralise` that the
    /// client sent and `set` does not write set to null (null = let the
    /// server decide).
    pub fn rewritten(&self, set: &[(&str, String)], neutralise: &[&str]) -> Vec<u8> {
        let mut fields: Vec<(&str, &str)> = set.iter().map(|(k, v)| (*k, v.as_str())).collect();
        for name in neutralise {
            if !set.iter().any(|(k, _)| k == name) && self.has_any(&[name]) {
                fields.push((name, "null"));
            }
        }
        self.with_fields(&fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_that_may_name_a_rank() {
        let names = ["routed_dp_rank", "data_parallel_rank"];
        assert!(may_name_a_rank(b"\xef\xbb\xbf{\"routed_dp_rank\":3}", &names));
        assert!(may_name_a_rank(br#" {"routed_dp_rank":3,"t":NaN}"#, &names));
        assert!(may_name_a_rank(br#"{"data_parallel_\u0072\u0061nk":1"#, &names));
        let utf16: Vec<u8> = "\u{feff}{\"routed_dp_rank\":3}"
            .encode_utf16()
            .flat_map(|u| u.to_le_bytes())
            .collect();
        assert!(may_name_a_rank(&utf16, &names));
        assert!(
            !may_name_a_rank(b"text=frank&routed_dp_rank=1", &names),
            "not an object"
        );
        assert!(
            !may_name_a_rank(br#"{"text":"frank","t":NaN}"#, &names),
            "the word, not a field"
        );
        assert!(!may_name_a_rank(b"{\\u00", &names));
    }

    fn obj(body: &str) -> JsonObject<'_> {
        JsonObject::parse(body.as_bytes()).unwrap()
    }

    #[test]
    fn batch_sizes() {
        assert_eq!(batch_size(&obj(r#"{"text":"a"}"#)), None);
        assert_eq!(batch_size(&obj(r#"{"text":["a","b"]}"#)), Some(2));
        assert_eq!(batch_size(&obj(r#"{"input_ids":[1,2,3]}"#)), None);
        assert_eq!(batch_size(&obj(r#"{"input_ids":[[1],[2,3]]}"#)), Some(2));
        assert_eq!(batch_size(&obj(r#"{"prompt":["a","b"]}"#)), None);
    }

    #[test]
    fn bootstrap_fields_per_prompt() {
        let ip = "10.0.0.1".parse().unwrap();
        let mut n = 0u64;
        let mut random = || {
            n += 2;
            u64::MAX - n
        };
        let single = bootstrap_fields(&obj(r#"{"text":"a"}"#), ip, Some(8998), &mut random);
        assert_eq!(single[0], ("bootstrap_host", r#""10.0.0.1""#.to_string()));
        assert_eq!(single[1], ("bootstrap_port", "8998".to_string()));
        assert_eq!(single[2].1, ((u64::MAX - 2) >> 1).to_string());
        let batch = bootstrap_fields(&obj(r#"{"text":["a","b"]}"#), ip, None, &mut random);
        assert_eq!(batch[1].1, "[null,null]");
        let rooms: Vec<u64> = serde_json::from_str(&batch[2].1).unwrap();
        assert_eq!(rooms.len(), 2);
        assert!(rooms[0] != rooms[1] && rooms.iter().all(|r| *r <= i64::MAX as u64));
    }

    #[test]
    fn rewriting_nulls_the_client_fields_it_does_not_set() {
        let body = obj(r#"{"data_parallel_rank":0,"routed_dp_rank":3,"text":"x"}"#);
        let names = ["routed_dp_rank", "data_parallel_rank", "decode_dp_rank"];
        let out = body.rewritten(&[("routed_dp_rank", "2".to_string())], &names);
        assert_eq!(
            out,
            br#"{"data_parallel_rank":null,"routed_dp_rank":2,"text":"x"}"#
        );
        assert_eq!(obj(r#"{"text":"x"}"#).rewritten(&[], &names), br#"{"text":"x"}"#);
    }
}
