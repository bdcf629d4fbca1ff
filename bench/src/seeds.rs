//! Seed sets: tuning seeds 1-10 (what dprank's rule and smg's settings were
//! chosen on) and judging seeds 101 and up (what results are reported on).
//! Every suite and report says which set it used; published suites judge.

use serde::{Deserialize, Serialize};

/// Seeds of the tuning set: 1..=TUNING_SEEDS.
pub const TUNING_SEEDS: u64 = 10;
/// The first judging seed.
pub const FIRST_JUDGING_SEED: u64 = 101;
/// Seeds from here on belong to capacity measurements, never to a table.
pub const FIRST_CAPACITY_SEED: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SeedSet {
    /// Seeds 1-10: for choosing settings.
    Tune,
    /// Seeds 101 and up: held out, for reporting.
    Judge,
}

impl SeedSet {
    pub fn name(self) -> &'static str {
        match self {
            SeedSet::Tune => "tune",
            SeedSet::Judge => "judge",
        }
    }

    /// The first `n` seeds of the set.
    pub fn seeds(self, n: u64) -> Result<Vec<u64>, String> {
        let n = n.max(1);
        match self {
            SeedSet::Tune if n > TUNING_SEEDS => Err(format!(
                "the tuning set has {TUNING_SEEDS} seeds (1-{TUNING_SEEDS}); {n} asked"
            )),
            SeedSet::Tune => Ok((1..=n).collect()),
            SeedSet::Judge => Ok((FIRST_JUDGING_SEED..FIRST_JUDGING_SEED + n).collect()),
        }
    }

    /// The set a seed belongs to (None: a capacity seed or an unused one).
    pub fn of(seed: u64) -> Option<SeedSet> {
        match seed {
            1..=TUNING_SEEDS => Some(SeedSet::Tune),
            s if (FIRST_JUDGING_SEED..FIRST_CAPACITY_SEED).contains(&s) => Some(SeedSet::Judge),
            _ => None,
        }
    }

    /// How reports say it.
    pub fn describe(self) -> &'static str {
        match self {
            SeedSet::Tune => "tuning seeds (1-10, the seeds settings were chosen on)",
            SeedSet::Judge => "judging seeds (101 and up, held out from all tuning)",
        }
    }
}

/// What `seeds` are, in words: their set, or that they mix sets.
pub fn describe_seeds(seeds: &[u64]) -> String {
    let mut sets: Vec<Option<SeedSet>> = seeds.iter().map(|s| SeedSet::of(*s)).collect();
    sets.dedup();
    let list = match (seeds.first(), seeds.last()) {
        (Some(a), Some(b)) if seeds.len() > 2 => format!("{a}-{b}"),
        _ => seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
    };
    match sets.as_slice() {
        [Some(set)] => format!("{} seeds, {list}: {}", seeds.len(), set.describe()),
        _ => format!(
            "{} seeds, {list}: MIXED seed sets (tuning and judging together)",
            seeds.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_disjoint_and_tuning_has_ten_seeds() {
        assert_eq!(SeedSet::Tune.seeds(3).unwrap(), vec![1, 2, 3]);
        assert_eq!(SeedSet::Judge.seeds(2).unwrap(), vec![101, 102]);
        assert!(SeedSet::Tune.seeds(11).is_err());
        assert_eq!(SeedSet::Judge.seeds(30).unwrap().len(), 30);
        assert_eq!(SeedSet::of(10), Some(SeedSet::Tune));
        assert_eq!(SeedSet::of(11), None);
        assert_eq!(SeedSet::of(150), Some(SeedSet::Judge));
        assert_eq!(SeedSet::of(FIRST_CAPACITY_SEED), None);
        assert!(describe_seeds(&[101, 102, 103]).contains("judging"));
        assert!(describe_seeds(&[1, 101]).contains("MIXED"));
    }
}
