//! The rank value dprank writes for a chosen rank (the body field or the
//! rank header): the worker's own index of it, or the rank as the worker's
//! reports name it, for a worker whose ranks start above 0 (a node of a
//! multi-node deployment). What a worker's refusals teach about the one it
//! reads, and when a worker gets none. The layouts and why:
//! docs/vllm.md, "Deployment layouts".

use crate::config::{Config, RankNumbering, Worker};
use serde::{Deserialize, Serialize};

/// What a worker's answers taught about the rank value it reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Learned {
    /// Nothing: the configured numbering.
    #[default]
    Nothing,
    /// It refused the other numbering, naming a range this one fits.
    Numbering(RankNumbering),
    /// It refused a rank in a way neither numbering explains: no rank is
    /// written for it (its own balancer picks) until its layout changes.
    Unpinned,
}

/// The numbering in force for a worker.
pub fn numbering(config: &Config, worker: &Worker, learned: Learned) -> Option<RankNumbering> {
    match learned {
        Learned::Nothing => Some(worker.rank_numbering.unwrap_or(config.rank_numbering)),
        Learned::Numbering(n) => Some(n),
        Learned::Unpinned => None,
    }
}

/// The value to write for the worker's rank at index `local` (of `ranks`,
/// numbered from `first_rank` by the worker), or None to write none: the
/// worker is unpinned, or it has one rank and the rank travels in a header
/// (a server of one engine needs none, and some refuse one).
pub fn value(
    numbering: Option<RankNumbering>,
    first_rank: u32,
    ranks: usize,
    local: u32,
    in_header: bool,
) -> Option<u32> {
    if in_header && ranks == 1 {
        return None;
    }
    match numbering? {
        RankNumbering::Local => Some(local),
        RankNumbering::Global => Some(first_rank.saturating_add(local)),
    }
}

/// A refusal of a rank value, as the server words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The valid values are `[low, high)`: vLLM's Python frontend
    /// ("data_parallel_rank R is out of range [0, N).") and SGLang's rank
    /// ingress ("routed_dp_rank must be in [0, N)").
    Range { low: u64, high: u64 },
    /// vLLM's Rust frontend ("data parallel rank R is out of range for N
    /// engine(s)"): it wants the global rank of one of its `engines`.
    WantsGlobal { engines: u64 },
}

/// The first bytes of an answer 400 read as a rank refusal, if it is one.
pub fn refusal(body: &[u8]) -> Option<Refusal> {
    let text = String::from_utf8_lossy(body);
    let lower = text.to_ascii_lowercase();
    if !lower.contains("rank") {
        return None;
    }
    if let Some(at) = lower.find("out of range for ") {
        let rest = lower.get(at + "out of range for ".len()..)?;
        let count = rest.split(|c: char| !c.is_ascii_digit()).next()?;
        if rest.get(count.len()..)?.trim_start().starts_with("engine") {
            return Some(Refusal::WantsGlobal {
                engines: count.parse().ok()?,
            });
        }
    }
    let at = lower
        .find("out of range [")
        .map(|i| i + "out of range [".len())
        .or_else(|| lower.find("must be in [").map(|i| i + "must be in [".len()))?;
    let rest = lower.get(at..)?;
    let (low, rest) = rest.split_once(',')?;
    let high = rest.trim_start().split(|c: char| !c.is_ascii_digit()).next()?;
    Some(Refusal::Range {
        low: low.trim().parse().ok()?,
        high: high.parse().ok()?,
    })
}

/// What a refusal of `written` (the value written for index `local` of a
/// worker numbering its ranks from `first_rank`) teaches: the numbering
/// whose value it accepts, else unpinned. None when the refusal is
/// explained without either: a worker whose last report is out of date
/// (restarted with fewer ranks; its next poll tells).
pub fn learn(refusal: Refusal, written: u32, local: u32, first_rank: u32, ranks: usize) -> Option<Learned> {
    let global = first_rank.saturating_add(local);
    match refusal {
        Refusal::WantsGlobal { engines } if engines < ranks as u64 => None,
        Refusal::WantsGlobal { .. } if written != global => Some(Learned::Numbering(RankNumbering::Global)),
        Refusal::WantsGlobal { .. } => Some(Learned::Unpinned),
        Refusal::Range { low, high } => {
            let fits = |v: u32| (low..high).contains(&u64::from(v));
            if fits(written) {
                // Refused a value its own range holds: not a numbering matter.
                return Some(Learned::Unpinned);
            }
            if high.saturating_sub(low) < ranks as u64 {
                // Fewer ranks than its last report: it changed; the next poll tells.
                return None;
            }
            if fits(local) {
                Some(Learned::Numbering(RankNumbering::Local))
            } else if fits(global) {
                Some(Learned::Numbering(RankNumbering::Global))
            } else {
                Some(Learned::Unpinned)
            }
        }
    }
}

/// The rank count a refusal states, when it is below `ranks` (the worker
/// restarted with fewer; its ranks start at 0).
pub fn fewer_ranks(refusal: Refusal, ranks: usize) -> Option<usize> {
    let count = match refusal {
        Refusal::Range { low: 0, high } => high,
        Refusal::WantsGlobal { engines } => engines,
        Refusal::Range { .. } => return None,
    };
    ((count as usize) < ranks && count > 0).then_some(count as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_read_as_each_server_words_them() {
        let python = br#"{"error":{"message":"data_parallel_rank 6 is out of range [0, 4).","type":"BadRequestError","param":null,"code":400}}"#;
        assert_eq!(refusal(python), Some(Refusal::Range { low: 0, high: 4 }));
        let rust = br#"{"error":{"message":"data parallel rank 2 is out of range for 4 engine(s)","type":"invalid_request_error"}}"#;
        assert_eq!(refusal(rust), Some(Refusal::WantsGlobal { engines: 4 }));
        let sglang = br#"{"error":"routed_dp_rank must be in [0, 8)"}"#;
        assert_eq!(refusal(sglang), Some(Refusal::Range { low: 0, high: 8 }));
        assert_eq!(refusal(br#"{"error":"prompt is too long"}"#), None);
        assert_eq!(refusal(b"\xff\xfe rank out of range [x, 4)"), None);
    }

    #[test]
    fn a_refusal_teaches_the_numbering_whose_value_fits() {
        // Node 2 of DP-8 (engines 4..7), global 6 written: Python wants local 2.
        let python = Refusal::Range { low: 0, high: 4 };
        assert_eq!(
            learn(python, 6, 2, 4, 4),
            Some(Learned::Numbering(RankNumbering::Local))
        );
        // Local 2 written to the Rust frontend: it wants 6.
        let rust = Refusal::WantsGlobal { engines: 4 };
        assert_eq!(
            learn(rust, 2, 2, 4, 4),
            Some(Learned::Numbering(RankNumbering::Global))
        );
        // A global value refused by the Rust frontend: nothing fits.
        assert_eq!(learn(rust, 6, 2, 4, 4), Some(Learned::Unpinned));
        // Restarted with two engines: nothing learned, two ranks kept.
        let two = Refusal::Range { low: 0, high: 2 };
        assert_eq!(learn(two, 3, 3, 0, 4), None);
        assert_eq!(fewer_ranks(two, 4), Some(2));
        assert_eq!(learn(Refusal::WantsGlobal { engines: 2 }, 3, 3, 0, 4), None);
        assert_eq!(fewer_ranks(Refusal::WantsGlobal { engines: 2 }, 4), Some(2));
        assert_eq!(fewer_ranks(python, 4), None);
        // A value its range holds was refused: something else; unpinned.
        assert_eq!(learn(python, 1, 1, 0, 4), Some(Learned::Unpinned));
    }

    #[test]
    fn values_follow_the_numbering_and_one_engine_gets_no_header() {
        assert_eq!(value(Some(RankNumbering::Local), 4, 4, 2, true), Some(2));
        assert_eq!(value(Some(RankNumbering::Global), 4, 4, 2, true), Some(6));
        assert_eq!(value(None, 4, 4, 2, true), None);
        assert_eq!(value(Some(RankNumbering::Global), 3, 1, 0, true), None);
        assert_eq!(value(Some(RankNumbering::Global), 3, 1, 0, false), Some(3));
    }
}
