//! Per-class limits ([`ClassLimits`]): what each class may take of a rank,
//! as the `admission` block sets it (`max_wait_ms` doubled per class above
//! the default, `max_requests_per_rank` a quarter less per class below the
//! highest, or each class's own; `config/admission.rs` works them out), and
//! the [`Rule`] a request of a class is judged by.

use super::UsageLimitPolicy;
use crate::config::Admission as Settings;
use crate::worker_state::saturation::{Limits, Rule};

/// Each class's limits, as configured.
#[derive(Debug, Clone, Copy)]
pub struct ClassLimits<'s>(pub &'s Settings);

impl UsageLimitPolicy for ClassLimits<'_> {
    fn limits(&self, class: usize) -> Limits {
        let settings = self.0;
        Limits {
            max_wait_ms: settings.max_wait_ms_of(class),
            max_kv_usage: settings.max_kv_usage,
            max_requests: settings.max_requests_of(class),
        }
    }
}

impl ClassLimits<'_> {
    /// The rule a request of `class` (None: the default class) is judged by.
    pub fn rule(&self, class: Option<usize>) -> Rule {
        let settings = self.0;
        Rule {
            limits: self.limits(class.unwrap_or(settings.default_class)),
            prior_tokens_per_s: settings.prefill_tokens_per_s,
            learn: settings.learn_drain_rate,
        }
    }
}
