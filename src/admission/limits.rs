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

/// SLO admission's share for `class` of what each rank learns: its TTFT
/// target (the default class's, scaled as its wait limit is) and its share
/// of the learned request limit (scaled as the configured limits are: a
/// quarter of the highest class's less per class below).
fn class_slo(settings: &Settings, class: usize) -> Option<ClassSlo> {
    let slo = settings.slo?;
    let wait_scale = settings.max_wait_ms_of(class) as f64 / settings.max_wait_ms.max(1) as f64;
    let share = |c: usize| (4 - c.min(3)) as f64;
    Some(ClassSlo {
        ttft_ms: (slo.ttft_ms as f64 * wait_scale).round() as u64,
        request_share: share(class) / share(settings.default_class),
    })
}
