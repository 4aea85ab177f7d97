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
            .collect();
        Self { offsets, blockers }
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
