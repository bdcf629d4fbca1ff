//! The admission controller: the configured policies put together behind
//! one call, [`Controller::admit`], with what an overloaded pool means for
//! a request by its class and the mode (`when_saturated`). The routing
//! pipeline's `admission` stage asks it to judge the fleet
//! ([`Controller::judge`]) once the fleet is refreshed.

use super::limits::ClassLimits;
use super::saturation::ExpectedWait;
use super::{Applicant, Judgement, Overloaded, Refusal, SaturationDetector, UsageLimitPolicy, Verdict};
use crate::config::Admission as Settings;
use crate::host::Host;
use crate::metrics::{self, AdmissionEvent};
use crate::worker_state::saturation::Rule;
use crate::worker_state::RankQueue;

/// Admission under the `admission` block (None: off, every request let in).
#[derive(Debug, Clone, Copy)]
pub struct Controller<'s> {
    settings: Option<&'s Settings>,
    detector: ExpectedWait,
}

impl<'s> Controller<'s> {
    pub fn new(settings: Option<&'s Settings>) -> Controller<'s> {
        Controller {
            settings,
            detector: ExpectedWait,
        }
    }

    /// Whether an overloaded pool holds requests rather than refuse them.
    pub fn queues(&self) -> bool {
        self.settings.is_some_and(Settings::queues)
    }

    /// Whether `applicant` is let in, held or refused. `held` is the
    /// highest class held, here or on another thread at the last look
    /// (None: nothing, or the applicant is the one held and its turn
    /// came). In queue mode a request does not overtake those held of its
    /// class or higher, and a sheddable one is refused while anything is
    /// held; otherwise `route` looks at the fleet (its `admission` stage
    /// calls [`Controller::judge`]) and decides, or finds it overloaded.
    pub fn admit<D>(
        &self,
        applicant: Option<&Applicant>,
        held: Option<usize>,
        route: impl FnOnce() -> Result<D, Overloaded>,
    ) -> Verdict<D> {
        if let (true, Some(a)) = (self.queues(), applicant) {
            if self.is_sheddable(a) {
                if held.is_some() {
                    return Verdict::Refused {
                        refusal: Refusal::Sheddable,
                        retry_after_ms: 0,
                    };
                }
            } else if held.is_some_and(|h| h <= a.class) {
                return Verdict::Held { retry_after_ms: 0 };
            }
        }
        match route() {
            Ok(decided) => Verdict::Admitted(decided),
            Err(overloaded) => self.when_overloaded(applicant, overloaded),
        }
    }

    /// Every candidate is saturated: a sheddable request, or any in reject
    /// mode, is refused at once (429); in queue mode the request waits.
    fn when_overloaded<D>(&self, applicant: Option<&Applicant>, overloaded: Overloaded) -> Verdict<D> {
        let retry_after_ms = overloaded.retry_after_ms;
        let refusal = match applicant {
            Some(a) if self.is_sheddable(a) => Refusal::Sheddable,
            _ if !self.queues() => Refusal::Saturated,
            _ => return Verdict::Held { retry_after_ms },
        };
        Verdict::Refused {
            refusal,
            retry_after_ms,
        }
    }

    fn is_sheddable(&self, a: &Applicant) -> bool {
        self.settings.is_some_and(|s| s.is_sheddable(a.class))
    }

    /// The rule a request of `class` (None: the default class) is judged
    /// by; None without admission.
    pub fn rule(&self, class: Option<usize>) -> Option<Rule> {
        self.settings.map(|s| ClassLimits(s).rule(class))
    }

    /// What the pool of `candidates` says about one more request of
    /// `class` (None: the default class); room without admission.
    pub fn judgement(
        &self,
        class: Option<usize>,
        candidates: impl IntoIterator<Item = RankQueue>,
    ) -> Judgement {
        match self.settings {
            Some(s) => {
                let limits = ClassLimits(s).limits(class.unwrap_or(s.default_class));
                self.detector.judge(candidates, &limits)
            }
            None => Judgement::Room,
        }
    }

    /// The routing pipeline's `admission` stage, for a request of `class`
    /// (None: the default class): the rule it chooses by (None: no
    /// admission, or nothing to judge), or the overload that keeps it out.
    /// Without fresh data there is nothing to judge: the request is
    /// admitted (counted), and `fail_mode` decides what becomes of it, as
    /// without admission.
    pub fn judge(
        &self,
        host: &dyn Host,
        class: Option<usize>,
        candidates: impl IntoIterator<Item = RankQueue>,
    ) -> Result<Option<Rule>, Overloaded> {
        if self.settings.is_none() {
            return Ok(None);
        }
        match self.judgement(class, candidates) {
            Judgement::Room => Ok(self.rule(class)),
            Judgement::NoData => {
                host.count(metrics::ADMISSION_NO_DATA, 1);
                Ok(None)
            }
            Judgement::Overloaded(overloaded) => Err(overloaded),
        }
    }

    /// How many of `candidates` are saturated for the default class (the
    /// gauge).
    pub fn saturated_ranks(&self, candidates: impl IntoIterator<Item = RankQueue>) -> u64 {
        let Some(s) = self.settings else {
            return 0;
        };
        let limits = ClassLimits(s).limits(s.default_class);
        candidates
            .into_iter()
            .filter(|q| self.detector.is_saturated(q, &limits))
            .count() as u64
    }

    /// Counts `event` for a request of `class`.
    pub fn count(&self, host: &dyn Host, event: AdmissionEvent, class: usize) {
        if let Some(s) = self.settings {
            host.count(&metrics::admission(event, s.class_name(class)), 1);
        }
    }

    /// Counts a refusal by admission of a request of `class` (None: not
    /// admission's applicant): by reason, and by reason and class.
    pub fn count_refusal(&self, host: &dyn Host, refusal: Refusal, class: Option<usize>) {
        host.count(&metrics::rejected(refusal.as_str()), 1);
        if let (Some(class), Some(s)) = (class, self.settings) {
            host.count(
                &metrics::admission_rejected(refusal.as_str(), s.class_name(class)),
                1,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::shared_data::testing::config;

    fn overloaded(ms: u64) -> Result<&'static str, Overloaded> {
        Err(Overloaded {
            retry_after_ms: ms,
            saturated_ranks: 8,
        })
    }

    #[test]
    fn reject_mode_refuses_an_overloaded_pool_and_sheds_first() {
        let c = config(r#","admission":{}"#);
        let admission = Controller::new(c.admission.as_ref());
        let standard = Applicant { class: 1, tenant: 0 };
        let sheddable = Applicant { class: 2, tenant: 0 };
        assert_eq!(
            admission.admit(Some(&standard), Some(0), || Ok("routed")),
            Verdict::Admitted("routed"),
            "no line in reject mode"
        );
        assert_eq!(
            admission.admit(Some(&standard), None, || overloaded(700)),
            Verdict::Refused {
                refusal: Refusal::Saturated,
                retry_after_ms: 700
            }
        );
        assert_eq!(
            admission.admit(Some(&sheddable), None, || overloaded(700)),
            Verdict::Refused {
                refusal: Refusal::Sheddable,
                retry_after_ms: 700
            }
        );
    }

    #[test]
    fn queue_mode_keeps_the_line_and_holds_an_overloaded_request() {
        let c = config(r#","admission":{"when_saturated":"queue"}"#);
        let admission = Controller::new(c.admission.as_ref());
        let (critical, standard, sheddable) = (
            Applicant { class: 0, tenant: 0 },
            Applicant { class: 1, tenant: 0 },
            Applicant { class: 2, tenant: 0 },
        );
        let never = || -> Result<&str, Overloaded> { panic!("the fleet is not looked at") };
        assert_eq!(
            admission.admit(Some(&standard), Some(1), never),
            Verdict::Held { retry_after_ms: 0 },
            "behind its own class"
        );
        assert_eq!(
            admission.admit(Some(&sheddable), Some(0), never),
            Verdict::Refused {
                refusal: Refusal::Sheddable,
                retry_after_ms: 0
            }
        );
        assert_eq!(
            admission.admit(Some(&critical), Some(1), || Ok("routed")),
            Verdict::Admitted("routed"),
            "a higher class goes ahead"
        );
        assert_eq!(
            admission.admit(Some(&standard), None, || overloaded(300)),
            Verdict::Held { retry_after_ms: 300 }
        );
    }

    #[test]
    fn without_the_block_everything_is_let_in_and_nothing_counted() {
        let c = config("");
        let h = FakeHost::default();
        let off = Controller::new(c.admission.as_ref());
        assert_eq!(off.admit(None, Some(0), || Ok(1)), Verdict::Admitted(1));
        assert_eq!(off.judge(&h, None, std::iter::empty()), Ok(None));
        assert_eq!(off.rule(None), None);
        off.count(&h, AdmissionEvent::Admitted, 0);
        assert_eq!(h.total_host_calls(), 0);
    }
}
