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

/// SLO admission's share for `class` of what each rank learns, which is
/// the default class's: doubled per class above it (as the configured
/// wait limits are), a quarter less per class below (down to a quarter).
fn class_slo(settings: &Settings, class: usize) -> Option<ClassSlo> {
    let slo = settings.slo?;
    let default = settings.default_class;
    let share = match class <= default {
        true => 2f64.powi((default - class).min(8) as i32),
        false => (1.0 - 0.25 * (class - default) as f64).max(0.25),
    };
    Some(ClassSlo {
        ttft_ms: slo.ttft_ms,
        share,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_shares_are_the_default_class_s_doubled_above_and_a_quarter_less_below() {
        let json = br#"{"workers":[{"address":"127.0.0.1:1"}],
            "admission":{"slo":{"ttft_ms":800,"tpot_ms":50}}}"#;
        let config = crate::config::Config::from_json(json).unwrap();
        let settings = config.admission.as_ref().unwrap();
        let shares: Vec<f64> = (0..3)
            .map(|c| ClassLimits(settings).limits(c).slo.unwrap().share)
            .collect();
        assert_eq!(
            shares,
            [2.0, 1.0, 0.75],
            "critical, standard (the default), sheddable"
        );
        assert_eq!(
            settings.max_wait_ms, 800,
            "the wait cap defaults to the TTFT target"
        );
        let plain =
            crate::config::Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"admission":{}}"#)
                .unwrap();
        assert!(ClassLimits(plain.admission.as_ref().unwrap())
            .limits(1)
            .slo
            .is_none());
        let off = br#"{"workers":[{"address":"127.0.0.1:1"}], "delivery_timing": false,
            "admission":{"slo":{"ttft_ms":800,"tpot_ms":50}}}"#;
        let err = crate::config::Config::from_json(off).unwrap_err().to_string();
        assert!(err.contains("delivery_timing"), "{err}");
        let zero =
            br#"{"workers":[{"address":"127.0.0.1:1"}],"admission":{"slo":{"ttft_ms":0,"tpot_ms":50}}}"#;
        assert!(crate::config::Config::from_json(zero).is_err());
    }
}
