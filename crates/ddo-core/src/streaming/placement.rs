//! Where each transfer unit lands in the streaming engine's ring ([`Placement`]): units
//! one after another in a circular byte buffer, each knowing the last earlier unit whose
//! bytes it overwrites (its blocker), so its copy waits for that unit's use event only.

/// Where each unit lands in the ring and which earlier unit it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    /// Byte offset of each unit in the ring.
    pub(super) offsets: Vec<u64>,
    /// The last earlier unit whose bytes each unit overwrites.
    pub(super) blockers: Vec<Option<usize>>,
    /// For each of the leading units with no blocker (the ring's first pass), the last unit
    /// of a whole forward whose bytes it overwrites (itself, at the latest): the unit of the
    /// forward before whose use its copy for the next forward waits, when the ring is kept
    /// from one forward to the next.
    pub(super) ahead_blockers: Vec<usize>,
}

impl Placement {
    /// Places `sizes` one after another in a circular buffer of `ring_bytes`, wrapping to
    /// the start when a unit does not fit before the end.
    pub(super) fn new(sizes: &[u64], ring_bytes: u64) -> Self {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut at = 0u64;
        for &size in sizes {
            if at + size > ring_bytes {
                at = 0;
            }
            offsets.push(at);
            at += size;
        }
        let blockers = (0..sizes.len())
            .map(|v| {
                let (a, b) = (offsets[v], offsets[v] + sizes[v]);
                (0..v)
                    .rev()
                    .find(|&w| offsets[w] < b && a < offsets[w] + sizes[w])
            })
            .collect::<Vec<_>>();
        let leading = blockers.iter().take_while(|b| b.is_none()).count();
        let ahead_blockers = (0..leading)
            .map(|v| {
                let (a, b) = (offsets[v], offsets[v] + sizes[v]);
                (v..sizes.len())
                    .rev()
                    .find(|&w| offsets[w] < b && a < offsets[w] + sizes[w])
                    .unwrap_or(v)
            })
            .collect();
        Self {
            offsets,
            blockers,
            ahead_blockers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Placement;

    #[test]
    fn units_wrap_and_wait_for_the_last_unit_they_overwrite() {
        let p = Placement::new(&[4, 4, 4, 6, 2], 10);
        assert_eq!(p.offsets, [0, 4, 0, 4, 0]);
        assert_eq!(p.blockers, [None, None, Some(0), Some(1), Some(2)]);
        // Kept to the next forward: unit 0's bytes were last used by unit 4, unit 1's by
        // unit 3.
        assert_eq!(p.ahead_blockers, [4, 3]);
    }

    /// The next forward's leading units wait for the last unit of the forward before that
    /// overlaps them, and no later one does: a copy ahead never overwrites bytes a unit
    /// still to be used in that forward reads.
    #[test]
    fn ahead_blockers_are_the_last_overlapping_units_of_a_forward() {
        let sizes = [3u64, 9, 1, 1, 1, 9, 2, 9, 9, 5, 4];
        let p = Placement::new(&sizes, 18);
        assert!(!p.ahead_blockers.is_empty());
        for (v, &w) in p.ahead_blockers.iter().enumerate() {
            let overlaps = |x: usize| {
                p.offsets[x] < p.offsets[v] + sizes[v] && p.offsets[v] < p.offsets[x] + sizes[x]
            };
            assert!(w > v && overlaps(w), "unit {v}: {w}");
            assert!((w + 1..sizes.len()).all(|x| !overlaps(x)), "unit {v}");
        }
        // A ring larger than a forward's units: each waits for its own use the forward
        // before.
        assert_eq!(Placement::new(&[2, 3], 10).ahead_blockers, [0, 1]);
    }

    #[test]
    fn a_ring_of_two_largest_units_holds_any_two_consecutive_units() {
        let sizes = [3u64, 9, 1, 1, 1, 9, 2, 9, 9, 5];
        let ring = 2 * 9;
        let p = Placement::new(&sizes, ring);
        for (u, (&o, &s)) in p.offsets.iter().zip(&sizes).enumerate() {
            assert!(o + s <= ring, "unit {u} overruns the ring");
            // The unit before never overlaps it: a unit only waits for older ones.
            if u > 0 {
                let (po, ps) = (p.offsets[u - 1], sizes[u - 1]);
                assert!(
                    po + ps <= o || o + s <= po,
                    "units {} and {u} overlap",
                    u - 1
                );
            }
        }
    }
}
