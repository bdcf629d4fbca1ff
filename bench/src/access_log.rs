//! What Envoy itself measured of each request, from a JSON access log the
//! harness adds to the listener of runs with admission: how long a refusal
//! took at the proxy, and how long a request sent on waited there between
//! its last byte in and its first byte out (routing, and any hold in
//! dprank's queue). The client's clock includes its own scheduling; this
//! one does not.

use std::path::Path;

use serde::Deserialize;

/// The listener's `stat_prefix` line the access log goes after.
const ANCHOR: &str = "stat_prefix: sglang_ingress";

/// `yaml` (a rendered envoy/dprank.yaml) with a JSON file access log at
/// `path` on its listener.
pub fn with_access_log(yaml: &str, path: &Path) -> Result<String, String> {
    let line = yaml
        .lines()
        .find(|l| l.trim() == ANCHOR)
        .ok_or_else(|| format!("envoy template: no `{ANCHOR}` line for the access log"))?;
    let pad = " ".repeat(line.len() - line.trim_start().len());
    let block = format!(
        "{line}\n\
         {pad}access_log:\n\
         {pad}- name: envoy.access_loggers.file\n\
         {pad}  typed_config:\n\
         {pad}    \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n\
         {pad}    path: {path}\n\
         {pad}    json_format:\n\
         {pad}      start: \"%START_TIME(%s.%6f)%\"\n\
         {pad}      code: \"%RESPONSE_CODE%\"\n\
         {pad}      total_us: \"%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%\"\n\
         {pad}      before_upstream_us: \"%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%\"\n\
         {pad}      admission: \"%RESP(x-dprank-admission)%\"\n\
         {pad}      retry_after: \"%RESP(retry-after)%\"",
        path = path.display()
    );
    Ok(yaml.replacen(line, &block, 1))
}

/// One line of the access log.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Entry {
    /// When Envoy got the request's first byte, Unix seconds.
    #[serde(deserialize_with = "number_text")]
    pub start: f64,
    pub code: u16,
    pub total_us: Option<u64>,
    /// None when the request never went upstream.
    pub before_upstream_us: Option<u64>,
    pub admission: Option<String>,
    pub retry_after: Option<String>,
}

/// Envoy writes `%START_TIME%` as a string.
fn number_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(serde::de::Error::custom)
}

impl Entry {
    /// Refused by dprank's admission (its reason header is on the answer).
    pub fn refused(&self) -> bool {
        self.admission.is_some()
    }
}

/// The proxy's figures of one run's measured window.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, Deserialize)]
pub struct ProxyTimes {
    /// Each refusal by admission: wall ms from its first byte in to its
    /// last byte out.
    pub refusal_ms: Vec<f32>,
    /// Refusals that carried no `retry-after`.
    pub refusals_without_retry_after: usize,
    /// Each request sent on: wall ms from its last byte in to its first
    /// byte upstream.
    pub before_upstream_ms: Vec<f32>,
}

impl ProxyTimes {
    /// Of the entries of requests that reached Envoy at or after `from`
    /// (Unix seconds).
    pub fn of(entries: &[Entry], from: f64) -> ProxyTimes {
        let mut out = ProxyTimes::default();
        for e in entries.iter().filter(|e| e.start >= from) {
            if e.refused() {
                if let Some(us) = e.total_us {
                    out.refusal_ms.push(us as f32 / 1000.0);
                }
                if e.retry_after.is_none() {
                    out.refusals_without_retry_after += 1;
                }
            } else if let Some(us) = e.before_upstream_us {
                out.before_upstream_ms.push(us as f32 / 1000.0);
            }
        }
        out
    }
}

/// The entries of the log at `path`; a line that is not an entry is an
/// error naming it.
pub fn read(path: &Path) -> Result<Vec<Entry>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{} line {}: {e}: {l}", path.display(), i + 1))
        })
        .collect()
}

/// The proxy's figures from `logs` (one per gateway), over requests that
/// reached Envoy from `from_unix_s` on; None without a log. Envoy writes
/// its logs once a second: the wait lets the last lines reach the files.
pub async fn collect(logs: &[&Path], from_unix_s: f64) -> Result<Option<ProxyTimes>, String> {
    if logs.is_empty() {
        return Ok(None);
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let mut entries = Vec::new();
    for log in logs {
        entries.extend(read(log)?);
    }
    Ok(Some(ProxyTimes::of(&entries, from_unix_s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_goes_on_the_listener_of_the_shipped_config() {
        let yaml =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/dprank.yaml")).unwrap();
        let out = with_access_log(&yaml, Path::new("/tmp/x/access.log")).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        let at = lines.iter().position(|l| l.trim() == ANCHOR).unwrap();
        let pad = lines[at].len() - lines[at].trim_start().len();
        assert_eq!(
            lines[at + 1],
            format!("{}access_log:", " ".repeat(pad)),
            "a key of the connection manager"
        );
        assert!(out.contains("      path: /tmp/x/access.log\n"));
        assert!(out.contains("total_us: \"%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%\""));
        assert_eq!(
            out.lines().count(),
            yaml.lines().count() + 12,
            "nothing else changed"
        );
        assert!(with_access_log("admin: {}\n", Path::new("x")).is_err());
    }

    #[test]
    fn refusals_and_waits_come_from_the_measured_window() {
        let lines = [
            r#"{"start":"99.5","code":429,"total_us":900,"before_upstream_us":null,"admission":"saturated","retry_after":"1"}"#,
            r#"{"start":"100.0","code":429,"total_us":1500,"before_upstream_us":null,"admission":"saturated","retry_after":"1"}"#,
            r#"{"start":"100.2","code":503,"total_us":640000,"before_upstream_us":null,"admission":"queue timeout","retry_after":null}"#,
            r#"{"start":"100.3","code":200,"total_us":90000,"before_upstream_us":250,"admission":null,"retry_after":null}"#,
            r#"{"start":"100.4","code":503,"total_us":3000,"before_upstream_us":200,"admission":null,"retry_after":null}"#,
        ];
        let entries: Vec<Entry> = lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
        let t = ProxyTimes::of(&entries, 100.0);
        assert_eq!(
            t.refusal_ms,
            vec![1.5, 640.0],
            "the warm-up's refusal is left out"
        );
        assert_eq!(t.refusals_without_retry_after, 1);
        assert_eq!(
            t.before_upstream_ms,
            vec![0.25, 0.2],
            "a worker's 503 is not a refusal"
        );
    }

    #[test]
    fn a_line_that_is_not_an_entry_is_named() {
        let dir = std::env::temp_dir().join(format!("dprank-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        std::fs::write(&path, "{\"start\":\"1.0\",\"code\":200}\nnot json\n").unwrap();
        let err = read(&path).unwrap_err();
        assert!(err.contains("line 2"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
