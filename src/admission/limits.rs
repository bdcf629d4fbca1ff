//! Per-class limits ([`ClassLimits`]): what each class may take of a rank,
//! as the `admission` block sets it (`max_wait_ms` doubled per class above
//! the default, `max_requests_per_rank` a quarter less per class below the
//! highest, or each class's own; `config/admission.rs` works them out), and
//! the [`Rule`] a request of a class is judged by.

use super::UsageLimitPolicy;
use crate::config::Admission as Settings;
use crate::worker_state::saturation::{ClassSlo, Limits, Rule};

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
            slo: class_slo(settings, class),
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

/// SLO admission's share for `class` of what each rank learns: the
/// highest class may take the whole wait budget and request limit, each
/// class below a quarter less (down to a quarter), as the configured
/// request limits are shared.
fn class_slo(settings: &Settings, class: usize) -> Option<ClassSlo> {
    let slo = settings.slo?;
    Some(ClassSlo {
        ttft_ms: slo.ttft_ms,
        share: (4 - class.min(3)) as f64 / 4.0,
    })
}
