//! Fairness among a class's tenants ([`TenantRoundRobin`]): each tenant
//! named by `tenant_header` has its own line, and the lines take turns, one
//! request each, so a tenant sending much cannot starve one sending little.
//! Without a tenant header every request is in one line.

use super::{FairnessPolicy, Line};
use std::collections::VecDeque;

/// Round robin: a line served goes to the back of its class's turns.
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantRoundRobin;

impl FairnessPolicy for TenantRoundRobin {
    fn requeue<T>(&self, lines: &mut VecDeque<Line<T>>, served: Line<T>) {
        lines.push_back(served);
    }
}
