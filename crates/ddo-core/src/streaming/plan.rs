//! The residency planner: which leaves stay resident under a VRAM budget and which are
//! streamed. Pure and IO-free, so it is tested on its own. Shared by every route that
//! streams under a budget (`native_vmm`, and `diffusers_group_offload` with a stream through
//! the [streaming engine](super)).
//!
//! The problem: given each leaf's weight bytes and a budget, keep resident the set of
//! leaves that leaves the fewest bytes to stream per forward, subject to
//! `resident bytes + slots × slot ≤ budget`, where the slot is room for the largest
//! streamed leaf, or for a coalesced transfer unit of up to `unit_floor` bytes
//! ([`SlotModel`]). [`plan_residency`] is the one-slot model (streamed leaves onloaded one
//! at a time); [`plan_residency_with`] takes the streaming engine's ring. When everything
//! fits, everything is resident and there is no slot.
//!
//! This is a knapsack whose capacity depends on the choice (through the slot), so the
//! planner is a heuristic with a guarantee that is cheap to check:
//!
//! 1. for every candidate slot leaf `k` (leaves by bytes, descending), the leaves larger
//!    than `k` are resident, `k` is streamed, and the smaller leaves are packed
//!    first-fit-decreasing into what is left; the best `k` wins;
//! 2. a local search then applies the best improving single-leaf move (a streamed leaf
//!    made resident) or swap (one resident and one streamed leaf exchanged), recomputing
//!    the slot each time, until none improves.
//!
//! The result never exceeds the budget, and no single move or swap lowers its streamed
//! bytes. It is also within one leaf of the optimum: with the optimum's slot leaf as the
//! candidate `k`, first-fit-decreasing either packs every smaller leaf or leaves less room
//! than the smallest leaf it skipped, which is no larger than the slot. Ties go to the
//! earlier leaf, so plans are deterministic. Planning costs O(n²) in the number of leaves
//! (a few milliseconds for a thousand).

/// Most local-search steps; each step strictly increases the resident bytes, and in
/// practice the search ends after a handful.
const MAX_LOCAL_STEPS: usize = 256;

/// Which leaves stay resident, and which are streamed, under a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidencyPlan {
    /// Paths of the resident leaves, in input order.
    pub resident: Vec<String>,
    /// Paths of the streamed leaves, in input order.
    pub streamed: Vec<String>,
    /// Weight bytes kept resident.
    pub resident_bytes: u64,
    /// Weight bytes copied to the device per forward.
    pub streamed_bytes: u64,
    /// Room kept for streamed leaves ([`SlotModel::room`]); with the one-slot model, the
    /// largest streamed leaf's bytes (0 when nothing is streamed).
    pub slot_bytes: u64,
    /// The budget the plan was made for.
    pub budget_bytes: u64,
}

impl ResidencyPlan {
    /// Most weight bytes the plan puts on the device at once: resident plus slot.
    pub fn device_bytes(&self) -> u64 {
        self.resident_bytes.saturating_add(self.slot_bytes)
    }

    /// Whether the plan keeps within its budget (false only when the budget is below the
    /// largest leaf, which the route's preflight refuses).
    pub fn fits(&self) -> bool {
        self.device_bytes() <= self.budget_bytes
    }

    /// Whether the leaf at `path` is resident.
    pub fn is_resident(&self, path: &str) -> bool {
        self.resident.iter().any(|p| p == path)
    }
}

/// How the device room for streamed leaves is counted: `slots` slots, each as large as the
/// largest streamed leaf or, when several small streamed leaves are coalesced into one
/// transfer unit, as large as that unit (at most `unit_floor` bytes, and at most the streamed
/// bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotModel {
    /// Slots kept on the device for streamed leaves (at least 1).
    pub slots: u64,
    /// Largest coalesced unit (0: no coalescing, a slot holds one leaf).
    pub unit_floor: u64,
    /// Lossless-coded units (`compress=lossless`): the ring also holds the coded slots and
    /// the decoder's status ([`coded_ring_bytes`](super::coded_ring_bytes) of a slot).
    pub coded: bool,
}

impl SlotModel {
    /// One slot of the largest streamed leaf.
    pub const ONE_LEAF: SlotModel = SlotModel {
        slots: 1,
        unit_floor: 0,
        coded: false,
    };

    /// The room streamed leaves need: `slots × max(largest streamed, min(unit_floor,
    /// streamed))`, plus the coded slots of such a slot when coded; 0 when nothing is
    /// streamed.
    pub fn room(self, largest_streamed: u64, streamed: u64) -> u64 {
        if streamed == 0 {
            return 0;
        }
        let slot = largest_streamed.max(self.unit_floor.min(streamed));
        let decoded = self.slots.max(1).saturating_mul(slot);
        if self.coded {
            decoded.saturating_add(super::coded_ring_bytes(slot))
        } else {
            decoded
        }
    }
}

/// Plans residency for `leaves` (`(path, weight bytes)` in execution order) under
/// `budget_bytes`, with one slot of the largest streamed leaf ([`SlotModel::ONE_LEAF`]).
///
/// When the budget is below the largest leaf no plan fits; the result then streams every
/// leaf (and [`ResidencyPlan::fits`] is false). Tied weights shared by two leaves are
/// counted in each, so the plan is conservative: the device holds at most what it says.
pub fn plan_residency<S: AsRef<str>>(leaves: &[(S, u64)], budget_bytes: u64) -> ResidencyPlan {
    plan_residency_with(leaves, budget_bytes, SlotModel::ONE_LEAF)
}

/// [`plan_residency`] with the streamed room counted as `model` says. The plan's
/// `slot_bytes` is then the room of all slots together.
pub fn plan_residency_with<S: AsRef<str>>(
    leaves: &[(S, u64)],
    budget_bytes: u64,
    model: SlotModel,
) -> ResidencyPlan {
    let bytes: Vec<u64> = leaves.iter().map(|(_, b)| *b).collect();
    let resident = choose_resident(&bytes, budget_bytes, model);
    let mut plan = ResidencyPlan {
        resident: Vec::new(),
        streamed: Vec::new(),
        resident_bytes: 0,
        streamed_bytes: 0,
        slot_bytes: 0,
        budget_bytes,
    };
    let mut largest = 0;
    for ((path, b), keep) in leaves.iter().zip(resident) {
        let path = path.as_ref().to_string();
        if keep {
            plan.resident.push(path);
            plan.resident_bytes = plan.resident_bytes.saturating_add(*b);
        } else {
            plan.streamed.push(path);
            plan.streamed_bytes = plan.streamed_bytes.saturating_add(*b);
            largest = largest.max(*b);
        }
    }
    plan.slot_bytes = model.room(largest, plan.streamed_bytes);
    plan
}

/// The residency choice for leaves of `bytes` under `budget`: `true` = resident.
pub(crate) fn choose_resident(bytes: &[u64], budget: u64, model: SlotModel) -> Vec<bool> {
    let n = bytes.len();
    let total = bytes.iter().fold(0u64, |a, b| a.saturating_add(*b));
    if total <= budget {
        return vec![true; n];
    }
    // Leaves by bytes, descending; ties in input order.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| bytes[b].cmp(&bytes[a]).then(a.cmp(&b)));

    let mut best: Option<(u64, Vec<bool>)> = None;
    let mut prefix = 0u64;
    for (pos, &k) in order.iter().enumerate() {
        let slot = bytes[k];
        // The room with `k` the largest streamed leaf, counting the unit floor against
        // everything below `k` (an upper bound on what ends up streamed).
        let below: u64 = total.saturating_sub(prefix);
        let room = model.room(slot, below);
        // `prefix + room` never decreases with `pos` in the one-slot model; with a unit
        // floor it may, so keep looking.
        let Some(mut cap) = budget.checked_sub(prefix.saturating_add(room)) else {
            prefix = prefix.saturating_add(slot);
            continue;
        };
        let mut keep = vec![false; n];
        for &j in &order[..pos] {
            keep[j] = true;
        }
        let mut resident = prefix;
        for &j in &order[pos + 1..] {
            if bytes[j] <= cap {
                keep[j] = true;
                cap -= bytes[j];
                resident += bytes[j];
            }
        }
        if best.as_ref().is_none_or(|(r, _)| resident > *r) {
            best = Some((resident, keep));
        }
        prefix = prefix.saturating_add(slot);
    }
    // With the one-slot model `largest <= budget`, so the first candidate (everything
    // streamed but the packing) always exists; otherwise nothing may fit.
    let mut keep = best.map(|(_, k)| k).unwrap_or_else(|| vec![false; n]);
    for _ in 0..MAX_LOCAL_STEPS {
        match best_single_change(bytes, &keep, budget, model) {
            Some(change) => change.apply(&mut keep),
            None => break,
        }
    }
    keep
}

/// A single-leaf change to a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Make streamed leaf `.0` resident.
    Move(usize),
    /// Make streamed leaf `.0` resident and resident leaf `.1` streamed.
    Swap(usize, usize),
}

impl Change {
    fn apply(self, keep: &mut [bool]) {
        match self {
            Change::Move(t) => keep[t] = true,
            Change::Swap(t, r) => {
                keep[t] = true;
                keep[r] = false;
            }
        }
    }
}

/// The single move or swap that most increases resident bytes while keeping
/// `resident + room ≤ budget`, if any does.
pub(crate) fn best_single_change(
    bytes: &[u64],
    keep: &[bool],
    budget: u64,
    model: SlotModel,
) -> Option<Change> {
    let total = bytes.iter().fold(0u64, |a, b| a.saturating_add(*b));
    let resident: u64 = bytes
        .iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|(b, _)| *b)
        .sum();
    // The two largest streamed leaves (by value, with multiplicity).
    let (mut s1, mut s1_at, mut s2) = (0u64, usize::MAX, 0u64);
    for (i, (&b, &k)) in bytes.iter().zip(keep).enumerate() {
        if k {
            continue;
        }
        if s1_at == usize::MAX || b > s1 {
            s2 = s1;
            (s1, s1_at) = (b, i);
        } else if b > s2 {
            s2 = b;
        }
    }
    if s1_at == usize::MAX {
        return None; // everything is resident
    }
    // The slot once streamed leaf `t` leaves the streamed set.
    let slot_without = |t: usize| if t == s1_at { s2 } else { s1 };
    let mut best: Option<(u64, Change)> = None;
    let mut consider = |gain: u64, change: Change| {
        if gain > 0 && best.is_none_or(|(g, _)| gain > g) {
            best = Some((gain, change));
        }
    };
    for t in (0..bytes.len()).filter(|&t| !keep[t]) {
        let without_t = slot_without(t);
        let moved = resident.saturating_add(bytes[t]);
        let room = model.room(without_t, total.saturating_sub(moved));
        if moved.checked_add(room).is_some_and(|d| d <= budget) {
            consider(bytes[t], Change::Move(t));
        }
        for r in (0..bytes.len()).filter(|&r| keep[r] && bytes[r] < bytes[t]) {
            let after = resident - bytes[r] + bytes[t];
            let room = model.room(without_t.max(bytes[r]), total.saturating_sub(after));
            if after.checked_add(room).is_some_and(|d| d <= budget) {
                consider(bytes[t] - bytes[r], Change::Swap(t, r));
            }
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(bytes: &[u64]) -> Vec<(String, u64)> {
        bytes
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("l{i}"), *b))
            .collect()
    }

    #[test]
    fn everything_fits_means_everything_resident_and_no_slot() {
        let p = plan_residency(&leaves(&[3, 4, 5]), 12);
        assert_eq!(p.resident.len(), 3);
        assert_eq!((p.streamed_bytes, p.slot_bytes), (0, 0));
    }

    #[test]
    fn keeps_room_for_the_largest_streamed_leaf() {
        // 10 + 6 + 4 = 20 > 16: stream 6 (slot 6) and keep 10, or stream 4 and keep 10 + 6?
        // 10 + 6 + slot 4 = 20 > 16, so the best is 10 resident + slot 6 = 16.
        let p = plan_residency(&leaves(&[10, 6, 4]), 16);
        assert!(p.fits());
        assert_eq!(p.resident, vec!["l0".to_string()]);
        assert_eq!(
            (p.resident_bytes, p.slot_bytes, p.streamed_bytes),
            (10, 6, 10)
        );
    }

    #[test]
    fn small_leaves_fill_what_the_big_ones_leave() {
        let p = plan_residency(&leaves(&[8, 8, 8, 1, 1, 1]), 18);
        assert!(p.fits());
        // 8 + 1 + 1 + slot 8 = 18.
        assert_eq!((p.resident_bytes, p.slot_bytes), (10, 8));
    }

    #[test]
    fn a_ring_of_slots_counts_every_slot_and_the_unit_floor() {
        let model = SlotModel {
            slots: 2,
            unit_floor: 15,
            coded: false,
        };
        let sizes = [100, 10, 10, 10, 10, 10, 10];
        // Keeping 100 and streaming the six 10s (coalesced units of up to 15: slots of 15)
        // needs 100 + 2 × 15 = 130. The largest leaf could never be streamed (2 × 100).
        let p = plan_residency_with(&leaves(&sizes), 130, model);
        assert!(p.fits(), "{p:?}");
        assert_eq!(
            (p.resident_bytes, p.streamed_bytes, p.slot_bytes),
            (100, 60, 30)
        );
        // Ten more bytes keep one more 10 resident.
        let p = plan_residency_with(&leaves(&sizes), 140, model);
        assert_eq!((p.resident_bytes, p.device_bytes()), (110, 140));
        // The one-leaf model would have kept more: its slot is one 10.
        let one = plan_residency(&leaves(&sizes), 130);
        assert_eq!((one.resident_bytes, one.slot_bytes), (120, 10));
        // Nothing fits in 129: every leaf is streamed and the plan says so.
        let p = plan_residency_with(&leaves(&sizes), 129, model);
        assert!(p.resident.is_empty() && !p.fits());
    }

    #[test]
    fn a_budget_below_the_largest_leaf_streams_everything_and_does_not_fit() {
        let p = plan_residency(&leaves(&[10, 2]), 9);
        assert!(p.resident.is_empty() && !p.fits());
    }
}
