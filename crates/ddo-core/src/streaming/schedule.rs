//! [`Schedule`]: the order in which a component's streamed segments start, learned on the
//! first forward and fixed afterwards. A forward that starts its segments in another order
//! makes the schedule learn again, and counts it.

/// What [`Schedule::end_forward`] concluded about the forward that just ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleOutcome {
    /// The first forward: the order was learned.
    Learned,
    /// The forward followed the fixed order.
    Followed,
    /// The forward left the fixed order; the new order replaces it (counted in
    /// [`Schedule::relearned`]).
    Relearned,
}

/// The learned order of segment starts (segment = an offload group or a leaf, whatever the
/// route streams as one piece), and the position of the running forward in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    fixed: Option<Vec<usize>>,
    observed: Vec<usize>,
    cursor: usize,
    diverged: bool,
    relearned: u64,
    /// The fixed order is a prediction no forward has confirmed yet.
    predicted: bool,
}

impl Schedule {
    /// An empty schedule: the next forward learns the order.
    pub fn new() -> Self {
        Self::default()
    }

    /// A schedule that expects `order` before any forward ran (a route's prediction, e.g.
    /// the component's leaf order): the first forward follows it when it is right, and
    /// learns the real order without counting a relearn when it is not.
    pub fn predicted(order: Vec<usize>) -> Self {
        Self {
            fixed: Some(order),
            predicted: true,
            ..Self::default()
        }
    }

    /// Whether the fixed order is still an unconfirmed prediction.
    pub fn is_predicted(&self) -> bool {
        self.predicted
    }

    /// The fixed order, once learned.
    pub fn order(&self) -> Option<&[usize]> {
        self.fixed.as_deref()
    }

    /// How many times the order changed and was learned again.
    pub fn relearned(&self) -> u64 {
        self.relearned
    }

    /// Whether the running forward follows the fixed order so far (false while learning
    /// and after a divergence).
    pub fn following(&self) -> bool {
        self.fixed.is_some() && !self.diverged
    }

    /// Position of the next expected start in the fixed order.
    pub fn cursor(&self) -> usize {
        self.cursor
    }

    /// Starts a forward.
    pub fn begin_forward(&mut self) {
        self.observed.clear();
        self.cursor = 0;
        self.diverged = false;
    }

    /// Records that `segment` starts. Returns its position in the fixed order when the
    /// forward follows it, `None` while learning or once the forward has left the order
    /// (the first start that does not match makes it leave).
    pub fn start(&mut self, segment: usize) -> Option<usize> {
        self.observed.push(segment);
        if self.diverged {
            return None;
        }
        let fixed = self.fixed.as_ref()?;
        if fixed.get(self.cursor) == Some(&segment) {
            self.cursor += 1;
            Some(self.cursor - 1)
        } else {
            self.diverged = true;
            None
        }
    }

    /// Ends the forward: learns the order on the first forward, and learns it again when
    /// this forward ran another order (a prefix or an extension counts as another order).
    pub fn end_forward(&mut self) -> ScheduleOutcome {
        let observed = std::mem::take(&mut self.observed);
        self.cursor = 0;
        self.diverged = false;
        let predicted = std::mem::take(&mut self.predicted);
        match &self.fixed {
            None => {
                self.fixed = Some(observed);
                ScheduleOutcome::Learned
            }
            Some(f) if *f == observed => ScheduleOutcome::Followed,
            Some(_) if predicted => {
                self.fixed = Some(observed);
                ScheduleOutcome::Learned
            }
            Some(_) => {
                self.fixed = Some(observed);
                self.relearned += 1;
                ScheduleOutcome::Relearned
            }
        }
    }

    /// Forgets the running forward's starts (an aborted forward); the fixed order stays.
    pub fn abandon_forward(&mut self) {
        self.observed.clear();
        self.cursor = 0;
        self.diverged = false;
    }

    /// Forgets everything, the fixed order included.
    pub fn reset(&mut self) {
        *self = Self {
            relearned: self.relearned,
            ..Self::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_is_followed_when_right_and_learned_without_a_relearn_when_wrong() {
        let mut s = Schedule::predicted(vec![0, 1, 2]);
        assert!(s.is_predicted() && s.following());
        s.begin_forward();
        assert_eq!(
            (s.start(0), s.start(1), s.start(2)),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(s.end_forward(), ScheduleOutcome::Followed);
        assert!(!s.is_predicted());

        let mut s = Schedule::predicted(vec![0, 1, 2]);
        s.begin_forward();
        assert_eq!((s.start(1), s.start(0)), (None, None));
        assert_eq!(s.end_forward(), ScheduleOutcome::Learned);
        assert_eq!((s.order(), s.relearned()), (Some(&[1, 0][..]), 0));
        // Confirmed orders relearn as before.
        s.begin_forward();
        s.start(0);
        assert_eq!(s.end_forward(), ScheduleOutcome::Relearned);
        assert_eq!(s.relearned(), 1);
    }

    #[test]
    fn learns_then_follows_then_relearns_on_a_change() {
        let mut s = Schedule::new();
        s.begin_forward();
        assert_eq!((s.start(2), s.start(0)), (None, None));
        assert_eq!(s.end_forward(), ScheduleOutcome::Learned);
        assert_eq!(s.order(), Some(&[2, 0][..]));
        s.begin_forward();
        assert!(s.following());
        assert_eq!((s.start(2), s.start(0)), (Some(0), Some(1)));
        assert_eq!(s.end_forward(), ScheduleOutcome::Followed);
        s.begin_forward();
        assert_eq!(s.start(2), Some(0));
        assert_eq!(s.start(1), None);
        assert!(!s.following());
        assert_eq!(
            s.start(0),
            None,
            "stays diverged for the rest of the forward"
        );
        assert_eq!(s.end_forward(), ScheduleOutcome::Relearned);
        assert_eq!((s.order(), s.relearned()), (Some(&[2, 1, 0][..]), 1));
        // A prefix of the order is another order too.
        s.begin_forward();
        assert_eq!(s.start(2), Some(0));
        assert_eq!(s.end_forward(), ScheduleOutcome::Relearned);
        assert_eq!(s.relearned(), 2);
    }
}
