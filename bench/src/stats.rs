//! Small helpers for reporting several runs: median with min–max spread.

/// Median, min and max of `values` (NaN-free); None if empty.
pub fn spread(values: &[f64]) -> Option<(f64, f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some((median, v[0], v[n - 1]))
}

pub fn median(values: &[f64]) -> f64 {
    spread(values).map_or(f64::NAN, |(m, _, _)| m)
}

/// "median (min–max)" with `decimals`; the range is omitted for a single run.
pub fn fmt_spread(values: &[f64], decimals: usize) -> String {
    match spread(values) {
        None => "n/a".into(),
        Some((m, lo, hi)) if values.len() == 1 || lo == hi => format!("{m:.decimals$}"),
        Some((m, lo, hi)) => format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})"),
    }
}

/// Markdown table from a header and rows.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("| {} |\n", header.join(" | "));
    out.push_str(&format!(
        "|{}\n",
        header.iter().map(|_| "---|").collect::<String>()
    ));
    for row in rows {
        out.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    out
}

/// Machine description for result files: CPU model, cores, kernel.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{model}, {} cores, Linux {}", crate::cpu::cores(), kernel.trim())
}

/// UTC date and time now, `YYYY-MM-DD HH:MM UTC`.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let (h, m) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{d:02} {h:02}:{m:02} UTC")
}

/// The opening of every results file: the title, then when, where and how it was measured.
pub fn report_header(title: &str, command_line: &str) -> String {
    format!(
        "# {title}\n\n- date: {}\n- machine: {}\n- command: `{command_line}`\n\n",
        now_utc(),
        machine()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_format() {
        assert_eq!(spread(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(fmt_spread(&[3.0, 1.0, 2.0], 1), "2.0 (1.0–3.0)");
        assert_eq!(fmt_spread(&[5.0], 0), "5");
        assert_eq!(fmt_spread(&[], 0), "n/a");
    }
}
