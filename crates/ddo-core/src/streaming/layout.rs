//! [`StagingLayout`]: the streamed params of a schedule, in schedule order, packed into
//! transfer units. Pure: it decides offsets and sizes, and touches no memory.
//!
//! Each unit is copied to the device with one copy and lands in one ring slot. Consecutive
//! schedule positions share a unit until adding the next one would take it past the unit
//! target; a position whose streamed params alone exceed the target is a unit of its own
//! (a leaf's params must all be on the device when it runs). Inside a unit every param
//! starts at a multiple of [`PARAM_ALIGN`] bytes, so device kernels see aligned weights.
//! A param already in the unit being built is not added again (a leaf that runs twice in
//! a row, a tied weight); a param streamed in two units has two locations, and the
//! engine points it at the right one when its position starts ([`StagingLayout::fixups`]).
//! Inside a unit, params follow the schedule or, for copies straight from a registered
//! checkpoint mapping, their place in the file ([`UnitOrder`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::param::{Param, ParamId};

/// Alignment of each param inside a transfer unit (and of each unit's size).
pub const PARAM_ALIGN: u64 = 256;

/// `n` rounded up to a multiple of [`PARAM_ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(PARAM_ALIGN) * PARAM_ALIGN
}

/// One param's place in a transfer unit.
#[derive(Debug, Clone)]
pub struct UnitEntry {
    /// The param.
    pub param: Arc<Param>,
    /// Byte offset inside the unit (a multiple of [`PARAM_ALIGN`]).
    pub offset: u64,
    /// Byte length (the param's bytes).
    pub len: u64,
}

/// Params copied to the device with one copy.
#[derive(Debug, Clone)]
pub struct TransferUnit {
    /// Params in the unit, in schedule order.
    pub entries: Vec<UnitEntry>,
    /// Bytes the unit occupies (aligned end of its last param).
    pub bytes: u64,
    /// Bytes of the params themselves (without alignment padding).
    pub payload: u64,
    /// First schedule position that uses the unit.
    pub first: usize,
    /// Last schedule position that uses the unit.
    pub last: usize,
}

/// A param whose device location changes between schedule positions (it is streamed in
/// more than one unit): where it lives while a position runs.
#[derive(Debug, Clone)]
pub struct Fixup {
    /// The param.
    pub param: Arc<Param>,
    /// The unit holding the copy this position uses.
    pub unit: usize,
    /// Byte offset in that unit.
    pub offset: u64,
}

/// The streamed params of a schedule packed into transfer units.
#[derive(Debug, Clone)]
pub struct StagingLayout {
    units: Vec<TransferUnit>,
    unit_of: Vec<Option<usize>>,
    fixups: Vec<Vec<Fixup>>,
    single: Vec<(Arc<Param>, usize, u64)>,
    unit_target: u64,
}

/// How params are ordered inside each transfer unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnitOrder {
    /// In schedule order (each position's params in segment order).
    #[default]
    Schedule,
    /// By where their host bytes are: checkpoint-mapped params by mapping and file offset,
    /// then the others in schedule order. Params adjacent in the file then sit next to
    /// each other in the unit too, so copies straight from a registered mapping coalesce
    /// (Diffusers checkpoints store a module's tensors one after another). A unit holds
    /// the same params and has the same size either way (each param keeps its aligned
    /// size); only their places inside it change.
    Source,
}

/// Sort key of a param for [`UnitOrder::Source`]: mapped params first, by mapping and
/// offset.
fn source_key(p: &Param) -> (u8, usize, usize) {
    match p.host().mapped_range() {
        Some((map, range)) => (0, Arc::as_ptr(map) as usize, range.start),
        None => (1, 0, 0),
    }
}

impl StagingLayout {
    /// Packs the params of `segments` in the order `schedule` starts them (indices into
    /// `segments`), leaving out the params in `resident`, into units of about `unit_target`
    /// bytes, each unit in schedule order.
    pub fn new(
        segments: &[Vec<Arc<Param>>],
        schedule: &[usize],
        resident: &HashSet<ParamId>,
        unit_target: u64,
    ) -> Self {
        Self::with_order(
            segments,
            schedule,
            resident,
            unit_target,
            UnitOrder::Schedule,
        )
    }

    /// [`StagingLayout::new`] with the params of each unit in `order`. Which params share
    /// a unit, and the units' sizes, do not depend on `order`.
    pub fn with_order(
        segments: &[Vec<Arc<Param>>],
        schedule: &[usize],
        resident: &HashSet<ParamId>,
        unit_target: u64,
        order: UnitOrder,
    ) -> Self {
        let mut units: Vec<TransferUnit> = Vec::new();
        let mut unit_of = vec![None; schedule.len()];
        let mut in_current: HashSet<ParamId> = HashSet::new();
        // (param id) -> (position, unit) for every position that uses it.
        let mut uses: HashMap<ParamId, Vec<(usize, usize)>> = HashMap::new();
        let mut params: HashMap<ParamId, Arc<Param>> = HashMap::new();
        for (pos, &seg) in schedule.iter().enumerate() {
            let streamed: Vec<&Arc<Param>> = segments
                .get(seg)
                .map(|s| s.iter().filter(|p| !resident.contains(&p.id())).collect())
                .unwrap_or_default();
            if streamed.is_empty() {
                continue;
            }
            let added = |in_current: &HashSet<ParamId>| -> u64 {
                streamed
                    .iter()
                    .filter(|p| !in_current.contains(&p.id()))
                    .map(|p| align_up(p.nbytes() as u64))
                    .sum()
            };
            let start_new = match units.last() {
                Some(u) => u.bytes + added(&in_current) > unit_target,
                None => true,
            };
            if start_new {
                in_current.clear();
                units.push(TransferUnit {
                    entries: Vec::new(),
                    bytes: 0,
                    payload: 0,
                    first: pos,
                    last: pos,
                });
            }
            let u = units.len() - 1;
            let unit = &mut units[u];
            for p in streamed {
                if in_current.insert(p.id()) {
                    let offset = unit.bytes;
                    let len = p.nbytes() as u64;
                    unit.entries.push(UnitEntry {
                        param: Arc::clone(p),
                        offset,
                        len,
                    });
                    unit.bytes = offset + align_up(len);
                    unit.payload += len;
                }
                uses.entry(p.id()).or_default().push((pos, u));
                params.entry(p.id()).or_insert_with(|| Arc::clone(p));
            }
            unit.last = pos;
            unit_of[pos] = Some(u);
        }
        if order == UnitOrder::Source {
            for unit in &mut units {
                // Stable: params with equal keys (owned ones) keep schedule order.
                unit.entries.sort_by_cached_key(|e| source_key(&e.param));
                let mut at = 0u64;
                for e in &mut unit.entries {
                    e.offset = at;
                    at += align_up(e.len);
                }
                debug_assert_eq!(at, unit.bytes);
            }
        }
        let offset_in: HashMap<(usize, ParamId), u64> = units
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| {
                unit.entries
                    .iter()
                    .map(move |e| ((u, e.param.id()), e.offset))
            })
            .collect();
        let mut fixups = vec![Vec::new(); schedule.len()];
        let mut single = Vec::new();
        let mut ids: Vec<&ParamId> = uses.keys().collect();
        ids.sort_unstable();
        for id in ids {
            let list = &uses[id];
            let param = &params[id];
            let place = |u: usize| (u, offset_in[&(u, *id)]);
            let first = place(list[0].1);
            if list.iter().all(|&(_, u)| place(u) == first) {
                single.push((Arc::clone(param), first.0, first.1));
            } else {
                for &(pos, u) in list {
                    let (unit, offset) = place(u);
                    fixups[pos].push(Fixup {
                        param: Arc::clone(param),
                        unit,
                        offset,
                    });
                }
            }
        }
        Self {
            units,
            unit_of,
            fixups,
            single,
            unit_target,
        }
    }

    /// The units, in schedule order.
    pub fn units(&self) -> &[TransferUnit] {
        &self.units
    }

    /// The unit a schedule position uses (`None`: all its params are resident, or it has
    /// none).
    pub fn unit_of(&self, pos: usize) -> Option<usize> {
        self.unit_of.get(pos).copied().flatten()
    }

    /// Params whose location must be set when position `pos` starts.
    pub fn fixups(&self, pos: usize) -> &[Fixup] {
        self.fixups.get(pos).map_or(&[], Vec::as_slice)
    }

    /// Streamed params with one location for the whole forward: `(param, unit, offset)`.
    pub fn single_location(&self) -> &[(Arc<Param>, usize, u64)] {
        &self.single
    }

    /// The unit target the layout was made for.
    pub fn unit_target(&self) -> u64 {
        self.unit_target
    }

    /// The largest unit: the size of one ring slot.
    pub fn slot_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes).max().unwrap_or(0)
    }

    /// Bytes copied per forward (units with their alignment padding).
    pub fn streamed_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes).sum()
    }

    /// Param bytes streamed per forward (without padding).
    pub fn payload_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.payload).sum()
    }
}
