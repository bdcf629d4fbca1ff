//! A reader of the Prometheus text exposition format (0.0.4, and the
//! OpenMetrics 1.0 text client libraries write for the same samples), one
//! line at a time, borrowing from the body. It never panics and its work is
//! linear in the input; a line that breaks the format is reported as
//! [`Line::Invalid`] and the lines after it are still read. The rules are in
//! docs/vllm-metrics.md.

use std::borrow::Cow;

/// One line of an exposition.
#[derive(Debug, Clone, PartialEq)]
pub enum Line<'a> {
    /// Empty, or only blanks.
    Blank,
    /// `# HELP name text`, the text as written (escapes left in).
    Help {
        name: &'a str,
        text: &'a str,
    },
    /// `# TYPE name kind`.
    Type {
        name: &'a str,
        kind: &'a str,
    },
    /// `# EOF`, the last line of an OpenMetrics exposition.
    Eof,
    /// Any other line starting with `#`.
    Comment,
    Sample(Sample<'a>),
    /// A line that breaks the format, and why.
    Invalid(&'static str),
    /// The body's last line, not ended by a line feed: perhaps cut short, so
    /// not read at all.
    Unterminated,
}

/// One sample: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The text between the braces, already checked (empty without braces).
    labels: &'a str,
    pub value: f64,
    /// As written: milliseconds in 0.0.4, seconds in OpenMetrics.
    pub timestamp: Option<f64>,
}

/// What a sample says about one label name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Label<'a> {
    Absent,
    /// The value, unescaped.
    Value(Cow<'a, str>),
    /// The name appears more than once in the sample's label set.
    Repeated,
}

/// The lines of `body`, split at line feeds (a carriage return before one is
/// dropped).
pub fn lines(body: &[u8]) -> Lines<'_> {
    Lines { rest: body }
}

/// The iterator of [`lines`]: one [`Line`] per line feed, plus
/// [`Line::Unterminated`] for text after the last one.
pub struct Lines<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Lines<'a> {
    type Item = Line<'a>;

    fn next(&mut self) -> Option<Line<'a>> {
        if self.rest.is_empty() {
            return None;
        }
        let Some(end) = self.rest.iter().position(|&b| b == b'\n') else {
            self.rest = &[];
            return Some(Line::Unterminated);
        };
        let (line, rest) = self.rest.split_at(end);
        self.rest = rest.get(1..).unwrap_or_default();
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        Some(match std::str::from_utf8(line) {
            Ok(text) => parse_line(text),
            Err(_) => Line::Invalid("not UTF-8"),
        })
    }
}

impl<'a> Sample<'a> {
    /// Every label as (name, unescaped value), in the order written.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, Cow<'a, str>)> {
        let set = self.labels;
        let mut at = 0;
        std::iter::from_fn(move || match next_label(set, at) {
            Ok(Some(pair)) => {
                at = pair.next;
                Some((pair.name, unescape(pair.value)))
            }
            // The set was checked when the line was read.
            Ok(None) | Err(_) => None,
        })
    }

    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Label<'a> {
        let mut found = Label::Absent;
        for (n, value) in self.labels() {
            if n == name {
                if found != Label::Absent {
                    return Label::Repeated;
                }
                found = Label::Value(value);
            }
        }
        found
    }
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn skip_blanks(s: &[u8], mut at: usize) -> usize {
    while s.get(at).is_some_and(|&b| is_blank(b)) {
        at += 1;
    }
    at
}

/// The end of the name starting at `at` (`at` itself if there is none):
/// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names, the same without `:` for
/// label names.
fn name_end(s: &[u8], at: usize, colon: bool) -> usize {
    let mut end = at;
    while let Some(&b) = s.get(end) {
        let ok =
            b.is_ascii_alphabetic() || b == b'_' || (colon && b == b':') || (end > at && b.is_ascii_digit());
        if !ok {
            break;
        }
        end += 1;
    }
    end
}

/// The end of the token starting at `at`: the next blank or the line's end.
fn token_end(s: &[u8], at: usize) -> usize {
    let mut end = at;
    while s.get(end).is_some_and(|&b| !is_blank(b)) {
        end += 1;
    }
    end
}

/// `text[from..to]`, or "" when that is no slice of it.
fn cut(text: &str, from: usize, to: usize) -> &str {
    text.get(from..to).unwrap_or_default()
}

/// A number as Prometheus writes one: decimal with an optional exponent, or
/// `NaN` and `Inf` (any case, `+Inf`, `-Inf`, `Infinity`). Decimals are read by
/// serde_json, already in the filter: std's float parser would add about 17 KiB
/// to the wasm (docs/vllm-metrics.md).
fn number(token: &str) -> Option<f64> {
    if token.is_empty()
        || !token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    {
        return None;
    }
    let (negative, unsigned) = match token.as_bytes().first() {
        Some(b'-') => (true, cut(token, 1, token.len())),
        Some(b'+') => (false, cut(token, 1, token.len())),
        _ => (false, token),
    };
    if unsigned.eq_ignore_ascii_case("nan") {
        return Some(f64::NAN);
    }
    if unsigned.eq_ignore_ascii_case("inf") || unsigned.eq_ignore_ascii_case("infinity") {
        return Some(if negative {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
    }
    // JSON's grammar: no sign of its own here, no leading `.`, no trailing `.`.
    if unsigned.starts_with(['-', '+']) {
        return None;
    }
    let magnitude: f64 = serde_json::from_str(unsigned).ok()?;
    Some(if negative { -magnitude } else { magnitude })
}

fn parse_line(text: &str) -> Line<'_> {
    let s = text.as_bytes();
    let start = skip_blanks(s, 0);
    match s.get(start) {
        None => Line::Blank,
        Some(b'#') => parse_comment(text, start + 1),
        Some(_) => match parse_sample(text, start) {
            Ok(sample) => Line::Sample(sample),
            Err(why) => Line::Invalid(why),
        },
    }
}

/// The rest of a line after its `#`.
fn parse_comment(text: &str, at: usize) -> Line<'_> {
    let s = text.as_bytes();
    let word_at = skip_blanks(s, at);
    let word_end = token_end(s, word_at);
    let word = cut(text, word_at, word_end);
    if word == "EOF" && skip_blanks(s, word_end) == s.len() {
        return Line::Eof;
    }
    if word != "HELP" && word != "TYPE" {
        return Line::Comment;
    }
    let name_at = skip_blanks(s, word_end);
    let end = name_end(s, name_at, true);
    if end == name_at || s.get(end).is_some_and(|&b| !is_blank(b)) {
        return Line::Invalid("HELP or TYPE without a metric name");
    }
    let name = cut(text, name_at, end);
    let rest_at = skip_blanks(s, end);
    if word == "HELP" {
        return Line::Help {
            name,
            text: cut(text, rest_at, s.len()),
        };
    }
    let kind_end = token_end(s, rest_at);
    if kind_end == rest_at || skip_blanks(s, kind_end) != s.len() {
        return Line::Invalid("TYPE without exactly one kind");
    }
    Line::Type {
        name,
        kind: cut(text, rest_at, kind_end),
    }
}

fn parse_sample(text: &str, at: usize) -> Result<Sample<'_>, &'static str> {
    let s = text.as_bytes();
    let end = name_end(s, at, true);
    if end == at {
        return Err("a sample line must start with a metric name");
    }
    let name = cut(text, at, end);
    let mut at = end;
    let mut labels = "";
    let brace = skip_blanks(s, end);
    if s.get(brace) == Some(&b'{') {
        let open = brace + 1;
        let close = label_set_end(s, open)?;
        labels = cut(text, open, close);
        check_label_set(labels)?;
        at = close + 1;
    }
    let value_at = skip_blanks(s, at);
    if value_at == at {
        return Err("no blank before the value");
    }
    let value_end = token_end(s, value_at);
    let value = number(cut(text, value_at, value_end)).ok_or("the value is not a number")?;
    // Tokens end at a blank, so whatever follows is after a blank.
    let mut timestamp = None;
    let mut at = skip_blanks(s, value_end);
    if at < s.len() && s.get(at) != Some(&b'#') {
        let ts_end = token_end(s, at);
        timestamp = Some(number(cut(text, at, ts_end)).ok_or("the timestamp is not a number")?);
        at = skip_blanks(s, ts_end);
    }
    // Only an OpenMetrics exemplar (`# {labels} value`) may follow: not read.
    if at < s.len() && s.get(at) != Some(&b'#') {
        return Err("text after the timestamp");
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

/// One `name="value"` of a label set: the value still escaped.
struct LabelPair<'a> {
    name: &'a str,
    value: &'a str,
    /// Where the next pair (or the end of the set) starts.
    next: usize,
}

/// The pair starting at or after `at` in `set` (the text between the
/// braces), `None` at the end of the set. Blanks may surround names, `=`
/// and commas; a comma may end the set.
fn next_label(set: &str, at: usize) -> Result<Option<LabelPair<'_>>, &'static str> {
    let s = set.as_bytes();
    let name_at = skip_blanks(s, at);
    if name_at == s.len() {
        return Ok(None);
    }
    let name_stop = name_end(s, name_at, false);
    if name_stop == name_at {
        return Err("a label name is missing or malformed");
    }
    let eq = skip_blanks(s, name_stop);
    if s.get(eq) != Some(&b'=') {
        return Err("a label name without `=`");
    }
    let quote = skip_blanks(s, eq + 1);
    if s.get(quote) != Some(&b'"') {
        return Err("a label value without quotes");
    }
    let close = value_end(s, quote + 1)?;
    let after = skip_blanks(s, close + 1);
    let next = match s.get(after) {
        None => after,
        Some(b',') => after + 1,
        Some(_) => return Err("labels must be separated by commas"),
    };
    Ok(Some(LabelPair {
        name: cut(set, name_at, name_stop),
        value: cut(set, quote + 1, close),
        next,
    }))
}

/// The index of the quote closing a label value that starts at `at`.
fn value_end(s: &[u8], mut at: usize) -> Result<usize, &'static str> {
    loop {
        match s.get(at) {
            None => return Err("a label value without its closing quote"),
            Some(b'"') => return Ok(at),
            Some(b'\\') => match s.get(at + 1) {
                Some(b'\\' | b'"' | b'n') => at += 2,
                _ => return Err("a label value with an unknown escape"),
            },
            Some(b'\n') => return Err("a line feed in a label value"),
            Some(_) => at += 1,
        }
    }
}

/// The index of the `}` closing the label set that starts at `open` (just
/// after its `{`): the first one outside quotes.
fn label_set_end(s: &[u8], open: usize) -> Result<usize, &'static str> {
    let mut at = open;
    let mut quoted = false;
    loop {
        match s.get(at) {
            None => return Err("a label set without its closing brace"),
            Some(b'"') => quoted = !quoted,
            Some(b'\\') if quoted => at += 1,
            Some(b'}') if !quoted => return Ok(at),
            Some(_) => {}
        }
        at += 1;
    }
}

/// Checks every pair of a label set (the text between the braces).
fn check_label_set(set: &str) -> Result<(), &'static str> {
    let mut at = 0;
    while let Some(pair) = next_label(set, at)? {
        at = pair.next;
    }
    Ok(())
}

/// A label value with `\\`, `\"` and `\n` turned back into what they stand for.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(body: &str) -> Vec<Line<'_>> {
        lines(body.as_bytes()).collect()
    }

    fn sample(line: &str) -> Sample<'_> {
        match parse_line(line) {
            Line::Sample(s) => s,
            other => panic!("{line:?} gave {other:?}"),
        }
    }

    fn invalid(line: &str) -> &'static str {
        match parse_line(line) {
            Line::Invalid(why) => why,
            other => panic!("{line:?} gave {other:?}"),
        }
    }

    fn value(s: &Sample<'_>, name: &str) -> String {
        match s.label(name) {
            Label::Value(v) => v.into_owned(),
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn comments_help_type_blank_and_eof() {
        let body = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    \n   \t\n\
                    # a plain comment\n\
                    #\n\
                    # HELP x_total Doc with \\\\ and \\n escapes\n\
                    # TYPE\tx_total  counter \n\
                    # EOF\n";
        assert_eq!(
            all(body),
            vec![
                Line::Help {
                    name: "vllm:num_requests_running",
                    text: "Number of requests in model execution batches."
                },
                Line::Type {
                    name: "vllm:num_requests_running",
                    kind: "gauge"
                },
                Line::Blank,
                Line::Blank,
                Line::Comment,
                Line::Comment,
                Line::Help {
                    name: "x_total",
                    text: "Doc with \\\\ and \\n escapes"
                },
                Line::Type {
                    name: "x_total",
                    kind: "counter"
                },
                Line::Eof,
            ]
        );
        assert_eq!(
            parse_line("# HELP"),
            Line::Invalid("HELP or TYPE without a metric name")
        );
        assert_eq!(
            parse_line("# TYPE 9x gauge"),
            Line::Invalid("HELP or TYPE without a metric name")
        );
        assert_eq!(
            parse_line("# TYPE x"),
            Line::Invalid("TYPE without exactly one kind")
        );
        assert_eq!(
            parse_line("# TYPE x gauge extra"),
            Line::Invalid("TYPE without exactly one kind")
        );
        assert_eq!(parse_line("# EOF trailing"), Line::Comment);
        assert_eq!(parse_line("# HELP x"), Line::Help { name: "x", text: "" });
    }

    #[test]
    fn samples_with_labels_in_any_order() {
        let s = sample(r#"vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 4.0"#);
        assert_eq!(
            (s.name, s.value, s.timestamp),
            ("vllm:num_requests_waiting", 4.0, None)
        );
        assert_eq!(value(&s, "engine"), "1");
        assert_eq!(value(&s, "model_name"), "Qwen/Qwen3-8B");
        assert_eq!(s.label("le"), Label::Absent);
        let s = sample(r#"vllm:num_requests_waiting{ model_name = "m" , engine="1", } 4"#);
        assert_eq!(value(&s, "engine"), "1");
        assert_eq!(
            s.labels().map(|(n, v)| (n, v.into_owned())).collect::<Vec<_>>(),
            vec![("model_name", "m".to_string()), ("engine", "1".to_string())]
        );
        let bare = sample("process_open_fds 6.0");
        assert_eq!(
            (bare.name, bare.value, bare.labels().count()),
            ("process_open_fds", 6.0, 0)
        );
        let spaced = sample("  up {} \t 1 ");
        assert_eq!(
            (spaced.name, spaced.value, spaced.labels().count()),
            ("up", 1.0, 0)
        );
    }

    #[test]
    fn label_values_are_unescaped() {
        let s = sample(r#"m{model_name="we\"ird\\name\nx",engine="0"} 1"#);
        assert_eq!(value(&s, "model_name"), "we\"ird\\name\nx");
        // Quoted braces, commas, `=` and `#` are part of the value.
        let s = sample(r#"m{a="}{,=# 1",b="ü"} 2"#);
        assert_eq!(
            (value(&s, "a"), value(&s, "b"), s.value),
            ("}{,=# 1".to_string(), "ü".to_string(), 2.0)
        );
        assert!(matches!(
            s.label("a"),
            Label::Value(std::borrow::Cow::Borrowed(_))
        ));
        assert_eq!(invalid(r#"m{a="\t"} 1"#), "a label value with an unknown escape");
        assert_eq!(invalid(r#"m{a="\"} 1"#), "a label set without its closing brace");
    }

    #[test]
    fn a_repeated_label_is_told_apart() {
        let s = sample(r#"m{engine="0",model_name="m",engine="1"} 1"#);
        assert_eq!(s.label("engine"), Label::Repeated);
        assert_eq!(value(&s, "model_name"), "m");
    }

    #[test]
    fn numbers_as_prometheus_writes_them() {
        for (text, want) in [
            ("3.0", 3.0),
            ("0", 0.0),
            ("-0", 0.0),
            ("42", 42.0),
            ("1.2345678e+07", 12345678.0),
            ("1e-05", 0.00001),
            ("2.5E3", 2500.0),
            ("+7", 7.0),
            ("-1.5", -1.5),
            ("0.17222468796268697", 0.17222468796268697),
            ("+Inf", f64::INFINITY),
            ("-Inf", f64::NEG_INFINITY),
            ("inf", f64::INFINITY),
            ("Infinity", f64::INFINITY),
        ] {
            assert_eq!(number(text), Some(want), "{text}");
        }
        assert!(number("NaN").is_some_and(f64::is_nan));
        assert!(number("nan").is_some_and(f64::is_nan));
        for bad in [
            "", "x", "1,5", "0x10", "--1", "+-1", "1e", ".5", "5.", "1_000", "1e400", "١", "Infx", "NaNa",
        ] {
            assert_eq!(number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn timestamps_and_exemplars() {
        let s = sample("http_requests_total{handler=\"/v1/models\"} 3 1764083412345");
        assert_eq!((s.value, s.timestamp), (3.0, Some(1764083412345.0)));
        let s = sample("a_total 3 1764083412.345 # {trace_id=\"abc\"} 1.0 1764083412.0");
        assert_eq!((s.value, s.timestamp), (3.0, Some(1764083412.345)));
        let s = sample("a_bucket{le=\"0.5\"} 3 # {trace_id=\"abc\"} 0.2");
        assert_eq!((s.value, s.timestamp), (3.0, None));
        assert_eq!(invalid("a 3 12 13"), "text after the timestamp");
        assert_eq!(invalid("a 3 soon"), "the timestamp is not a number");
    }

    #[test]
    fn lines_that_break_the_format() {
        for (line, why) in [
            ("9lives 1", "a sample line must start with a metric name"),
            ("{engine=\"0\"} 1", "a sample line must start with a metric name"),
            (
                "<html><body>502 Bad Gateway</body></html>",
                "a sample line must start with a metric name",
            ),
            ("m", "no blank before the value"),
            ("m{a=\"1\"}2", "no blank before the value"),
            ("m-x 1", "no blank before the value"),
            ("m 1.0.0", "the value is not a number"),
            ("m{a=\"1\"} ", "the value is not a number"),
            ("m{a=\"1\" 1", "a label set without its closing brace"),
            ("m{a=1} 1", "a label value without quotes"),
            ("m{a} 1", "a label name without `=`"),
            ("m{a=\"1\" b=\"2\"} 1", "labels must be separated by commas"),
            ("m{a=\"1\",,b=\"2\"} 1", "a label name is missing or malformed"),
            ("m{a:b=\"1\"} 1", "a label name without `=`"),
            ("m{1a=\"1\"} 1", "a label name is missing or malformed"),
        ] {
            assert_eq!(invalid(line), why, "{line}");
        }
    }

    #[test]
    fn crlf_unterminated_and_non_utf8_lines() {
        let body = b"a 1\r\nb{x=\"y\"} 2\r\n\xff\xfe 3\nc 4\nd 5";
        let got: Vec<_> = lines(body).collect();
        assert_eq!(got.len(), 5);
        assert!(matches!(&got[0], Line::Sample(s) if s.name == "a" && s.value == 1.0));
        assert!(matches!(&got[1], Line::Sample(s) if s.name == "b" && s.value == 2.0));
        assert_eq!(got[2], Line::Invalid("not UTF-8"));
        assert!(matches!(&got[3], Line::Sample(s) if s.name == "c"));
        assert_eq!(
            got[4],
            Line::Unterminated,
            "the last line may have been cut short"
        );
        assert_eq!(lines(b"").count(), 0);
        assert_eq!(all("\n"), vec![Line::Blank]);
        assert_eq!(all("a 1\r"), vec![Line::Unterminated]);
    }

    #[test]
    fn one_item_per_line_whatever_the_bytes() {
        let garbage: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let feeds = garbage.iter().filter(|&&b| b == b'\n').count();
        let tail = usize::from(!garbage.ends_with(b"\n"));
        assert_eq!(lines(&garbage).count(), feeds + tail);
    }
}
