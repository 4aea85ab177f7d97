//! Where each transfer unit lands in the streaming engine's ring ([`Placement`]): units
//! one after another in a circular byte buffer, each knowing the last earlier unit whose
//! bytes it overwrites (its blocker), so its copy waits for that unit's use event only.
//!
//! A ring kept from one forward to the next rolls on: the next forward's units are placed
//! from where this forward's last unit ended ([`Placement::next`]), so the ring is one
//! first-in first-out buffer across forwards. The next forward's leading units (those no
//! earlier unit of it overwrites: the ring's first pass) then each wait for the unit of
//! this forward whose bytes they take, about a ring's bytes before its end, and can be
//! copied while this forward's last ring of units still computes
//! ([`Placement::ahead_blockers`]). A placement fixed at the ring's start instead makes the
//! next forward's first unit wait for whichever late unit wrapped onto it, often the last.

/// Where each unit lands in the ring and which earlier unit it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    /// Byte offset of each unit in the ring.
    pub(super) offsets: Vec<u64>,
    /// The last earlier unit (of the same forward) whose bytes each unit overwrites.
    pub(super) blockers: Vec<Option<usize>>,
    /// The leading units: those before the first unit with a blocker (the ring's first
    /// pass).
    pub(super) leading: usize,
    /// Where the forward's last unit ends (the ring's bytes when there are no units).
    end: u64,
    /// The ring's bytes.
    ring_bytes: u64,
}

impl Placement {
    /// Places `sizes` one after another in a circular buffer of `ring_bytes` from its
    /// start, wrapping to the start when a unit does not fit before the end.
    pub(super) fn new(sizes: &[u64], ring_bytes: u64) -> Self {
        Self::starting_at(sizes, ring_bytes, 0)
    }

    /// [`Placement::new`] with the first unit at byte `start` (where it fits before the
    /// end; else at 0).
    pub(super) fn starting_at(sizes: &[u64], ring_bytes: u64, start: u64) -> Self {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut at = start;
        for &size in sizes {
            if at + size > ring_bytes {
                at = 0;
            }
            offsets.push(at);
            at += size;
        }
        let overlaps = |v: usize, w: usize| {
            offsets[w] < offsets[v] + sizes[v] && offsets[v] < offsets[w] + sizes[w]
        };
        let blockers = (0..sizes.len())
            .map(|v| (0..v).rev().find(|&w| overlaps(v, w)))
            .collect::<Vec<_>>();
        let leading = blockers.iter().take_while(|b| b.is_none()).count();
        Self {
            offsets,
            blockers,
            leading,
            end: if sizes.is_empty() { ring_bytes } else { at },
            ring_bytes,
        }
    }

    /// The next forward's placement in the same ring: from where this one's last unit
    /// ended, or from the largest unit's size where it ended below that (a unit that wraps
    /// to `[0, size)` then never lands on a unit placed at the pass's start, just before
    /// it).
    pub(super) fn next(&self, sizes: &[u64]) -> Self {
        let largest = sizes.iter().copied().max().unwrap_or(0);
        let start = (self.end % self.ring_bytes.max(1)).max(largest);
        Self::starting_at(sizes, self.ring_bytes, start)
    }

    /// For each of `next`'s leading units (placed with `sizes` after this placement's
    /// units of `sizes`, in the same ring), the last unit of this forward whose bytes it
    /// overwrites: the use its copy ahead waits for. A leading unit that overwrites none
    /// (bytes this forward left unused, at the ring's end) waits for this forward's last
    /// unit, behind every earlier use of the ring.
    pub(super) fn ahead_blockers(&self, sizes: &[u64], next: &Placement) -> Vec<usize> {
        let last = sizes.len().saturating_sub(1);
        (0..next.leading)
            .map(|v| {
                let (a, b) = (next.offsets[v], next.offsets[v] + sizes[v]);
                (0..sizes.len())
                    .rev()
                    .find(|&w| self.offsets[w] < b && a < self.offsets[w] + sizes[w])
                    .unwrap_or(last)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Placement;

    #[test]
    fn units_wrap_and_wait_for_the_last_unit_they_overwrite() {
        let sizes = [4, 4, 4, 6, 2];
        let p = Placement::new(&sizes, 10);
        assert_eq!(p.offsets, [0, 4, 0, 4, 0]);
        assert_eq!(p.blockers, [None, None, Some(0), Some(1), Some(2)]);
        assert_eq!(p.leading, 2);
        // Unit 4 ended at byte 2, below the largest unit (6 bytes): the next forward rolls
        // on from byte 6. Its unit 0 takes [6, 10), last used by unit 3 ([4, 10)); unit 1
        // wraps to [0, 4), last used by unit 4 ([0, 2)).
        let n = p.next(&sizes);
        assert_eq!(n.offsets, [6, 0, 4, 0, 6]);
        assert_eq!(n.leading, 2);
        assert_eq!(p.ahead_blockers(&sizes, &n), [3, 4]);
    }

    /// The next forward's leading units wait for the last unit of the forward before that
    /// overlaps them, and no later one does: a copy ahead never overwrites bytes a unit
    /// still to be used in that forward reads.
    #[test]
    fn ahead_blockers_are_the_last_overlapping_units_of_a_forward() {
        let sizes = [3u64, 9, 1, 1, 1, 9, 2, 9, 9, 5, 4];
        let mut p = Placement::new(&sizes, 18);
        for _ in 0..5 {
            let n = p.next(&sizes);
            let ahead = p.ahead_blockers(&sizes, &n);
            assert_eq!(ahead.len(), n.leading);
            assert!(!ahead.is_empty());
            for (v, &w) in ahead.iter().enumerate() {
                let overlaps = |x: usize| {
                    p.offsets[x] < n.offsets[v] + sizes[v] && n.offsets[v] < p.offsets[x] + sizes[x]
                };
                assert!((w + 1..sizes.len()).all(|x| !overlaps(x)), "unit {v}");
                // Bytes the forward left unused wait for its last unit.
                assert!(
                    overlaps(w) || (w == sizes.len() - 1 && (0..w).all(|x| !overlaps(x))),
                    "unit {v}: {w}"
                );
            }
            p = n;
        }
        // A ring larger than a forward's units: each waits for the unit of the forward
        // before on its bytes, or for that forward's last unit where it had none there.
        let p = Placement::new(&[2, 3], 10);
        let n = p.next(&[2, 3]);
        assert_eq!(n.offsets, [5, 7]);
        assert_eq!(p.ahead_blockers(&[2, 3], &n), [1, 1]);
    }

    /// Rolled on, the ring is first in, first out: the next forward's leading units take the
    /// bytes of this forward's last units in order, so the first of them waits for a unit
    /// about a ring before the end, not for the last one.
    #[test]
    fn a_rolled_ring_frees_the_next_forwards_first_unit_early() {
        let sizes = vec![4u64; 25];
        let ring = 4 * 6;
        let p = Placement::new(&sizes, ring);
        let n = p.next(&sizes);
        let ahead = p.ahead_blockers(&sizes, &n);
        assert_eq!(n.leading, 6);
        assert_eq!(ahead, [19, 20, 21, 22, 23, 24]);
        // Fixed at the start, the next forward's first unit would take the bytes of the
        // last unit (unit 24, at [0, 4)).
        assert_eq!(p.offsets[24], 0);
    }

    #[test]
    fn a_ring_of_two_largest_units_holds_any_two_consecutive_units() {
        let sizes = [3u64, 9, 1, 1, 1, 9, 2, 9, 9, 5];
        let ring = 2 * 9;
        let mut rolled = vec![Placement::new(&sizes, ring)];
        for _ in 0..12 {
            let next = rolled[rolled.len() - 1].next(&sizes);
            rolled.push(next);
        }
        for p in rolled {
            let start = p.offsets[0];
            for (u, (&o, &s)) in p.offsets.iter().zip(&sizes).enumerate() {
                assert!(o + s <= ring, "unit {u} overruns the ring");
                // The unit before never overlaps it: a unit only waits for older ones.
                if u > 0 {
                    let (po, ps) = (p.offsets[u - 1], sizes[u - 1]);
                    assert!(
                        po + ps <= o || o + s <= po,
                        "start {start}: units {} and {u} overlap",
                        u - 1
                    );
                }
            }
        }
    }

    proptest::proptest! {
        /// Rolled on forward after forward in a ring of at least two largest units: every
        /// unit lies in the ring, each blocker is the
        /// last earlier unit of the forward on its bytes, the leading units are those with
        /// none, and each copy ahead waits for the last unit of the forward before on its
        /// bytes (its last unit where it had none there).
        #[test]
        fn rolled_placements_keep_their_invariants(
            sizes in proptest::collection::vec(1u64..64, 1..40),
            extra in 0u64..200,
            rolls in 1usize..8,
        ) {
            let largest = *sizes.iter().max().unwrap();
            let ring = 2 * largest + extra;
            let mut p = Placement::new(&sizes, ring);
            for _ in 0..rolls {
                let n = p.next(&sizes);
                let over = |a: &Placement, v: usize, b: &Placement, w: usize| {
                    a.offsets[v] < b.offsets[w] + sizes[w] && b.offsets[w] < a.offsets[v] + sizes[v]
                };
                for (u, &size) in sizes.iter().enumerate() {
                    proptest::prop_assert!(n.offsets[u] + size <= ring);
                    let want = (0..u).rev().find(|&w| over(&n, u, &n, w));
                    proptest::prop_assert_eq!(n.blockers[u], want);
                }
                let leading = n.blockers.iter().take_while(|b| b.is_none()).count();
                proptest::prop_assert_eq!(n.leading, leading);
                let ahead = p.ahead_blockers(&sizes, &n);
                proptest::prop_assert_eq!(ahead.len(), leading);
                for (v, &w) in ahead.iter().enumerate() {
                    let want = (0..sizes.len())
                        .rev()
                        .find(|&x| over(&n, v, &p, x))
                        .unwrap_or(sizes.len() - 1);
                    proptest::prop_assert_eq!(w, want);
                }
                p = n;
            }
        }
    }
}
