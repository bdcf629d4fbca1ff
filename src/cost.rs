//! The cost vocabulary every choice shares: a candidate's cost slot, the
//! mark of a removed candidate, and the saturating, weighted additions the
//! scorers make. Ground floor: it imports nothing from the crate.

/// A candidate's cost slot: its cost so far, or [`REMOVED`].
pub type Slot = u64;
/// The slot of a candidate a step removed. Costs saturate just below it.
pub const REMOVED: Slot = u64::MAX;
/// The highest cost a candidate can carry.
pub const MAX_COST: Slot = u64::MAX - 1;

/// Adds `extra` to a candidate's cost (saturating at `MAX_COST`); a removed
/// candidate stays removed.
pub fn add_cost(slot: &mut Slot, extra: u64) {
    if *slot != REMOVED {
        *slot = slot.saturating_add(extra).min(MAX_COST);
    }
}

/// `tokens x weight`, rounded.
pub fn weighted(tokens: u64, weight: f64) -> u64 {
    if weight == 1.0 {
        tokens
    } else {
        (tokens as f64 * weight).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_saturate_below_removed_and_removed_stays() {
        let mut slot = MAX_COST - 1;
        add_cost(&mut slot, 5);
        assert_eq!(slot, MAX_COST);
        let mut removed = REMOVED;
        add_cost(&mut removed, 0);
        assert_eq!(removed, REMOVED);
        assert_eq!(
            (weighted(10, 1.0), weighted(10, 0.25), weighted(3, 0.5)),
            (10, 3, 2)
        );
    }
}
