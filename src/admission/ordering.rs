//! The order within a tenant's line ([`Fcfs`]): first come, first served.

use super::{OrderingPolicy, Waiting};

/// First come, first served: a later arrival never goes before an earlier one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fcfs;

impl OrderingPolicy for Fcfs {
    fn before<T>(&self, a: &Waiting<T>, b: &Waiting<T>) -> bool {
        a.seq < b.seq
    }
}
