//! One thread's held requests, in the order admission lets them in: the
//! highest class first; within a class, the tenants' lines in the order of
//! the [`FairnessPolicy`] (round robin); within a line, the order of the
//! [`OrderingPolicy`] (first come first served). Pure: what is held (`T`)
//! and how it is resumed or answered are the request lifecycle's.

use super::fairness::TenantRoundRobin;
use super::ordering::Fcfs;
use super::{FairnessPolicy, Line, OrderingPolicy, Waiting};
use std::collections::VecDeque;

#[derive(Debug)]
pub struct HeldQueue<T, F = TenantRoundRobin, O = Fcfs> {
    /// Per class (0 highest), the tenants' lines in turn order (front next).
    classes: Vec<VecDeque<Line<T>>>,
    len: usize,
    seq: u64,
    fairness: F,
    ordering: O,
}

impl<T, F: Default, O: Default> Default for HeldQueue<T, F, O> {
    fn default() -> Self {
        HeldQueue {
            classes: Vec::new(),
            len: 0,
            seq: 0,
            fairness: F::default(),
            ordering: O::default(),
        }
    }
}

impl<T, F: FairnessPolicy, O: OrderingPolicy> HeldQueue<T, F, O> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Held requests per class (index = class, as long as the highest class held).
    pub fn counts(&self) -> Vec<u32> {
        self.classes
            .iter()
            .map(|lines| lines.iter().map(|l| l.waiting.len() as u32).sum())
            .collect()
    }

    /// The highest class anything is held in.
    pub fn highest_class(&self) -> Option<usize> {
        self.classes.iter().position(|lines| !lines.is_empty())
    }

    /// The lowest class anything is held in.
    pub fn lowest_class(&self) -> Option<usize> {
        self.classes.iter().rposition(|lines| !lines.is_empty())
    }

    fn class_mut(&mut self, class: usize) -> &mut VecDeque<Line<T>> {
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, VecDeque::new);
        }
        &mut self.classes[class]
    }

    /// Holds a request in its tenant's line, where the ordering puts it
    /// (a new tenant's line joins its class's turns at the back).
    pub fn push(&mut self, id: u32, class: usize, tenant: u64, since_ms: u64, payload: T) {
        self.seq += 1;
        let waiting = Waiting {
            id,
            class,
            tenant,
            since_ms,
            seq: self.seq,
            payload,
        };
        let ordering = &self.ordering;
        let lines = {
            if self.classes.len() <= class {
                self.classes.resize_with(class + 1, VecDeque::new);
            }
            &mut self.classes[class]
        };
        match lines.iter_mut().find(|l| l.tenant == tenant) {
            Some(line) => {
                let mut at = line.waiting.len();
                while at > 0 && ordering.before(&waiting, &line.waiting[at - 1]) {
                    at -= 1;
                }
                line.waiting.insert(at, waiting);
            }
            None => lines.push_back(Line {
                tenant,
                waiting: VecDeque::from([waiting]),
            }),
        }
        self.len += 1;
    }

    /// The request admission lets in next.
    pub fn peek(&self) -> Option<&Waiting<T>> {
        self.classes
            .iter()
            .find_map(|lines| lines.front())
            .and_then(|line| line.waiting.front())
    }

    /// Takes the request admission lets in next: the front of the front
    /// line of the highest class; the fairness policy puts its line back.
    pub fn pop(&mut self) -> Option<Waiting<T>> {
        let class = self.highest_class()?;
        let lines = self.classes.get_mut(class)?;
        let mut line = lines.pop_front()?;
        let next = line.waiting.pop_front();
        if !line.waiting.is_empty() {
            self.fairness.requeue(lines, line);
        }
        if next.is_some() {
            self.len -= 1;
        }
        next
    }

    /// Puts back a request `pop` took that could not go after all: first
    /// in its line again, its line first in its class.
    pub fn unpop(&mut self, waiting: Waiting<T>) {
        let lines = self.class_mut(waiting.class);
        match lines.iter().position(|l| l.tenant == waiting.tenant) {
            Some(i) => {
                if let Some(mut line) = lines.remove(i) {
                    line.waiting.push_front(waiting);
                    lines.push_front(line);
                }
            }
            None => lines.push_front(Line {
                tenant: waiting.tenant,
                waiting: VecDeque::from([waiting]),
            }),
        }
        self.len += 1;
    }

    /// Takes request `id` out, wherever it is.
    pub fn remove(&mut self, id: u32) -> Option<Waiting<T>> {
        for lines in &mut self.classes {
            for i in 0..lines.len() {
                let Some(at) = lines[i].waiting.iter().position(|w| w.id == id) else {
                    continue;
                };
                let taken = lines[i].waiting.remove(at);
                if lines[i].waiting.is_empty() {
                    lines.remove(i);
                }
                self.len -= 1;
                return taken;
            }
        }
        None
    }

    /// The newest request of the lowest class held below `class` (a
    /// higher class's arrival takes its place when the queue is full).
    pub fn newest_below(&self, class: usize) -> Option<u32> {
        let lowest = self.lowest_class().filter(|l| *l > class)?;
        self.newest_in(lowest)
    }

    /// The newest request held in `class` (the latest to arrive).
    pub fn newest_in(&self, class: usize) -> Option<u32> {
        self.classes
            .get(class)?
            .iter()
            .flat_map(|l| l.waiting.iter())
            .max_by_key(|w| w.seq)
            .map(|w| w.id)
    }

    /// The ids of requests that started waiting at or before `cutoff_ms`.
    pub fn waiting_since(&self, cutoff_ms: u64) -> Vec<u32> {
        self.classes
            .iter()
            .flatten()
            .flat_map(|l| l.waiting.iter())
            .filter(|w| w.since_ms <= cutoff_ms)
            .map(|w| w.id)
            .collect()
    }

    /// Every held id.
    pub fn ids(&self) -> Vec<u32> {
        self.waiting_since(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &mut HeldQueue<()>) -> Vec<u32> {
        std::iter::from_fn(|| q.pop().map(|w| w.id)).collect()
    }

    #[test]
    fn higher_classes_first_then_arrival_order() {
        let mut q: HeldQueue<()> = HeldQueue::default();
        q.push(1, 1, 0, 10, ());
        q.push(2, 2, 0, 11, ());
        q.push(3, 0, 0, 12, ());
        q.push(4, 1, 0, 13, ());
        assert_eq!((q.len(), q.counts()), (4, vec![1, 2, 1]));
        assert_eq!((q.highest_class(), q.lowest_class()), (Some(0), Some(2)));
        assert_eq!(q.peek().map(|w| w.id), Some(3));
        assert_eq!(order(&mut q), [3, 1, 4, 2]);
        assert!(q.is_empty() && q.pop().is_none());
    }

    #[test]
    fn tenants_take_turns_within_a_class() {
        let mut q: HeldQueue<()> = HeldQueue::default();
        for (id, tenant) in [(1, 7), (2, 7), (3, 7), (4, 8), (5, 9), (6, 8)] {
            q.push(id, 0, tenant, u64::from(id), ());
        }
        assert_eq!(order(&mut q), [1, 4, 5, 2, 6, 3]);
    }

    #[test]
    fn a_request_put_back_is_first_again() {
        let mut q: HeldQueue<()> = HeldQueue::default();
        q.push(1, 0, 7, 0, ());
        q.push(2, 0, 8, 0, ());
        q.push(3, 0, 7, 0, ());
        let first = q.pop().unwrap();
        q.unpop(first);
        assert_eq!(order(&mut q), [1, 2, 3]);
    }

    #[test]
    fn removal_newest_of_the_lowest_and_time_outs() {
        let mut q: HeldQueue<()> = HeldQueue::default();
        q.push(1, 2, 0, 100, ());
        q.push(2, 2, 5, 100, ());
        q.push(3, 1, 0, 150, ());
        q.push(4, 0, 0, 200, ());
        assert_eq!(q.newest_below(0), Some(2), "same time: the later arrival");
        assert_eq!(q.newest_below(2), None, "nothing below the lowest");
        assert_eq!(q.newest_in(1), Some(3));
        assert_eq!(q.waiting_since(150), [3, 1, 2]);
        assert_eq!(q.remove(2).map(|w| w.tenant), Some(5));
        assert_eq!(q.remove(2), None);
        assert_eq!(q.newest_below(1), Some(1));
        assert_eq!(q.len(), 3);
        assert_eq!(q.ids(), [4, 3, 1]);
    }
}
