//! The group plan: how a component's leaves fall into offload groups ([`GroupPlan`],
//! [`Group`]), at leaf or block level.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use ddo_core::streaming::CODED_PIECE_SLACK;
use ddo_core::streaming::layout::align_up;
use ddo_core::{Component, LeafId, OffloadType, Param, ParamId, Placement};

use crate::config::GroupOffloadConfig;

use crate::UNMATCHED_LABEL;

/// One offload group: params that move to the device together.
#[derive(Debug, Clone)]
pub struct Group {
    pub(crate) label: String,
    pub(crate) leaves: Vec<LeafId>,
    pub(crate) params: Vec<Arc<Param>>,
    bytes: u64,
}

impl Group {
    /// A readable name: the leaf path (leaf level), `list[first..=last]` (block level), or
    /// [`UNMATCHED_LABEL`].
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The leaves (with params) in the group, in component order.
    pub fn leaves(&self) -> &[LeafId] {
        &self.leaves
    }

    /// The group's params, each once (a tied weight inside one group counts once).
    pub fn params(&self) -> &[Arc<Param>] {
        &self.params
    }

    /// Bytes of the group's params.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// How a component's leaves fall into offload groups for one [`GroupOffloadConfig`].
///
/// Leaves without params belong to no group: they need nothing on the device.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    pub(crate) groups: Vec<Group>,
    pub(crate) leaf_group: Vec<Option<usize>>,
    pub(crate) leaf_paths: Vec<String>,
    pub(crate) unmatched: Option<usize>,
}

impl GroupPlan {
    /// Groups `component`'s leaves as `config` says (`offload_type`, `num_blocks_per_group`).
    pub fn new(component: &Component, config: &GroupOffloadConfig) -> Self {
        let leaves = component.leaves();
        let mut plan = Self {
            groups: Vec::new(),
            leaf_group: vec![None; leaves.len()],
            leaf_paths: leaves.iter().map(|l| l.path().to_string()).collect(),
            unmatched: None,
        };
        let per_group = config.num_blocks_per_group.max(1);
        let mut block_groups: HashMap<(String, usize), usize> = HashMap::new();
        let mut block_last: HashMap<usize, (String, usize, usize)> = HashMap::new();
        let mut seen: Vec<HashSet<ParamId>> = Vec::new();
        for leaf in leaves {
            if leaf.params().is_empty() {
                continue;
            }
            let g = match config.offload_type {
                OffloadType::LeafLevel => plan.push_group(leaf.path().to_string(), &mut seen),
                OffloadType::BlockLevel => match leaf.placement() {
                    Placement::Block { list, index } => {
                        let chunk = index / per_group;
                        let key = (list.clone(), chunk);
                        let g = match block_groups.get(&key) {
                            Some(&g) => g,
                            None => {
                                let g = plan.push_group(String::new(), &mut seen);
                                block_groups.insert(key, g);
                                g
                            }
                        };
                        let first = chunk * per_group;
                        let entry = block_last
                            .entry(g)
                            .or_insert_with(|| (list.clone(), first, *index));
                        entry.2 = entry.2.max(*index);
                        g
                    }
                    Placement::Unmatched => match plan.unmatched {
                        Some(g) => g,
                        None => {
                            let g = plan.push_group(UNMATCHED_LABEL.to_string(), &mut seen);
                            plan.unmatched = Some(g);
                            g
                        }
                    },
                },
            };
            plan.leaf_group[leaf.id().0] = Some(g);
            let group = &mut plan.groups[g];
            group.leaves.push(leaf.id());
            for (_, p) in leaf.params() {
                if seen[g].insert(p.id()) {
                    group.bytes += p.nbytes() as u64;
                    group.params.push(Arc::clone(p));
                }
            }
        }
        for (g, (list, first, last)) in block_last {
            plan.groups[g].label = format!("{list}[{first}..={last}]");
        }
        plan
    }

    fn push_group(&mut self, label: String, seen: &mut Vec<HashSet<ParamId>>) -> usize {
        self.groups.push(Group {
            label,
            leaves: Vec::new(),
            params: Vec::new(),
            bytes: 0,
        });
        seen.push(HashSet::new());
        self.groups.len() - 1
    }

    /// The groups, in the order their first leaf appears in the component.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether there are no groups (a component without params).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The group of `leaf`, if it has params.
    pub fn group_of(&self, leaf: LeafId) -> Option<usize> {
        self.leaf_group.get(leaf.0).copied().flatten()
    }

    /// The block-level group of leaves outside the block lists, if there is one.
    pub fn unmatched(&self) -> Option<usize> {
        self.unmatched
    }

    /// Bytes of the largest group other than the unmatched one.
    pub fn largest_group_bytes(&self) -> u64 {
        self.streamed_group_bytes().max().unwrap_or(0)
    }

    /// Sum of the `k` largest groups other than the unmatched one.
    pub fn largest_groups_bytes(&self, k: usize) -> u64 {
        let mut sizes: Vec<u64> = self.streamed_group_bytes().collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.into_iter().take(k).sum()
    }

    /// Bytes of the unmatched group (0 when there is none).
    pub fn unmatched_bytes(&self) -> u64 {
        self.unmatched.map_or(0, |g| self.groups[g].bytes)
    }

    /// Leaves whose weights move to the device per forward (every leaf with params).
    pub fn streamed_leaves(&self) -> u64 {
        self.leaf_group.iter().filter(|g| g.is_some()).count() as u64
    }

    /// The order streamed groups are expected to start in: every group with params other
    /// than the unmatched one, by its first leaf in the component's leaf order.
    pub fn predicted_order(&self) -> Vec<usize> {
        let mut order = Vec::new();
        for g in self.leaf_group.iter().flatten() {
            if Some(*g) != self.unmatched && !order.contains(g) {
                order.push(*g);
            }
        }
        order
    }

    /// The groups the streaming engine streams or keeps resident, as the residency planner
    /// sees them: `(label, bytes)` with each param at the engine's alignment, the unmatched
    /// group left out (it is onloaded for the whole forward).
    pub fn engine_segments(&self) -> Vec<(String, u64)> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(i, g)| !g.params.is_empty() && Some(*i) != self.unmatched)
            .map(|(_, g)| {
                let bytes = g.params.iter().map(|p| align_up(p.nbytes() as u64)).sum();
                (g.label.clone(), bytes)
            })
            .collect()
    }

    /// With weights coded in their files (`ddo convert --compress lossless`), an upper
    /// bound of the coded home of the engine segments `streamed` (labels; `None`: all):
    /// a param read coded is its unit (16-byte aligned); the others are coded at attach in
    /// runs, each at most its bytes plus [`CODED_PIECE_SLACK`]. A run starts at a segment's
    /// start, after a param read coded, or at a transfer unit's start (units of `unit_bytes`
    /// or more), so a segment holds at most `coded + 2 + bytes / unit_bytes` of them. `None`
    /// when no param is read coded (the home is coded at attach: its size is known only
    /// then).
    pub fn coded_home_bytes(&self, streamed: Option<&[String]>, unit_bytes: u64) -> Option<u64> {
        let mut any = false;
        let mut total = 0u64;
        for (i, g) in self.groups.iter().enumerate() {
            if g.params.is_empty()
                || Some(i) == self.unmatched
                || streamed.is_some_and(|s| !s.contains(&g.label))
            {
                continue;
            }
            let (mut raw, mut coded, mut read_coded, mut others) = (0u64, 0u64, 0u64, false);
            for p in &g.params {
                raw += align_up(p.nbytes() as u64);
                match p.host().coded_source() {
                    Some(c) => {
                        read_coded += 1;
                        coded += (c.len as u64).next_multiple_of(16);
                    }
                    None => {
                        others = true;
                        coded += align_up(p.nbytes() as u64);
                    }
                }
            }
            any |= read_coded > 0;
            if others {
                coded += (read_coded + 2 + raw / unit_bytes.max(1)) * CODED_PIECE_SLACK;
            }
            total += coded;
        }
        any.then_some(total)
    }

    fn streamed_group_bytes(&self) -> impl Iterator<Item = u64> + '_ {
        self.groups
            .iter()
            .enumerate()
            .filter(|(g, _)| Some(*g) != self.unmatched)
            .map(|(_, group)| group.bytes)
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::reference::{LeafSpec, ReferenceSpec, build};
    use ddo_core::{DType, OffloadType, RouteOptions, RouteTarget};
    use ddo_core::{Result, RouteId, RouteSpec};

    fn config(offload_type: OffloadType, n: Option<usize>) -> GroupOffloadConfig {
        let spec = RouteSpec::new(
            RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            RouteOptions {
                offload_type: Some(offload_type),
                num_blocks_per_group: n,
                ..RouteOptions::default()
            },
        )
        .unwrap();
        GroupOffloadConfig::from_spec(&spec)
    }

    #[test]
    fn leaf_level_makes_one_group_per_leaf_with_params() {
        let spec = ReferenceSpec::small("vae", 3, 4, DType::F32);
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::LeafLevel, None));
        assert_eq!(plan.len(), c.leaves().len());
        assert_eq!(plan.unmatched(), None);
        for (i, leaf) in c.leaves().iter().enumerate() {
            assert_eq!(plan.group_of(leaf.id()), Some(i));
            assert_eq!(plan.groups()[i].label(), leaf.path());
            assert_eq!(plan.groups()[i].bytes(), leaf.param_bytes());
        }
        assert_eq!(plan.streamed_leaves(), c.leaves().len() as u64);
    }

    #[test]
    fn block_level_chunks_blocks_and_collects_the_rest_in_one_unmatched_group() {
        let spec = ReferenceSpec::small("transformer", 5, 4, DType::F16);
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(2)));
        // Blocks 0-1, 2-3, 4, plus the unmatched stem and head.
        assert_eq!(plan.len(), 4);
        let labels: Vec<&str> = plan.groups().iter().map(Group::label).collect();
        assert_eq!(
            labels,
            vec![
                UNMATCHED_LABEL,
                "blocks[0..=1]",
                "blocks[2..=3]",
                "blocks[4..=4]"
            ]
        );
        let u = plan.unmatched().unwrap();
        let stem = c.leaf_by_path("stem_0").unwrap().id();
        let head = c.leaf_by_path("head_1").unwrap().id();
        assert_eq!(plan.group_of(stem), Some(u));
        assert_eq!(plan.group_of(head), Some(u));
        assert_eq!(plan.groups()[1].leaves().len(), 4);
        assert_eq!(plan.param_total(), c.param_bytes());
    }

    #[test]
    fn tied_weights_count_once_per_group() {
        let mut spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
        spec.tie_head_to_stem = true;
        let c = build(&spec).unwrap();
        let block = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(1)));
        let u = block.unmatched().unwrap();
        let tied = c.leaf_by_path("tied_proj").unwrap();
        assert_eq!(block.group_of(tied.id()), Some(u));
        assert_eq!(block.param_total(), c.param_bytes());
        let leaf = GroupPlan::new(&c, &config(OffloadType::LeafLevel, None));
        // The tied weight is in two leaf groups: one hold each, one copy at a time.
        assert_eq!(leaf.param_total(), c.param_bytes() + 4 * 4 * 4);
    }

    #[test]
    fn a_block_list_shorter_than_a_group_is_one_group() {
        let spec = ReferenceSpec {
            stem: vec![LeafSpec::linear(3)],
            blocks: vec![vec![LeafSpec::norm()]],
            head: vec![],
            ..ReferenceSpec::small("x", 0, 3, DType::F32)
        };
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(3)));
        assert_eq!(plan.len(), 2);
        assert_eq!(plan.groups()[1].label(), "blocks[0..=0]");
        assert_eq!(plan.largest_group_bytes(), 2 * 3 * 4);
        assert_eq!(plan.largest_groups_bytes(5), 2 * 3 * 4);
        assert_eq!(plan.unmatched_bytes(), (3 * 3 + 3) * 4);
    }

    struct NoProgram;

    impl ddo_core::ComponentProgram for NoProgram {
        fn forward(
            &self,
            _ctx: &mut ddo_core::ForwardContext<'_>,
            input: ddo_core::Tensor,
        ) -> Result<ddo_core::Tensor> {
            Ok(input)
        }
    }

    #[test]
    fn leaves_without_params_belong_to_no_group() {
        use ddo_core::{LeafKind, Module, ParamKind};
        let w =
            Param::from_f32("w", ParamKind::Parameter, DType::F32, vec![2], &[1.0, 2.0]).unwrap();
        let root = Module::container(
            "",
            vec![
                Module::leaf("act", LeafKind::Other, vec![]),
                Module::block_list(
                    "blocks",
                    vec![Module::container(
                        "0",
                        vec![
                            Module::leaf("lin", LeafKind::Linear, vec![("weight".into(), w)]),
                            Module::leaf("act", LeafKind::Other, vec![]),
                        ],
                    )],
                ),
            ],
        );
        let c = Component::new("x", "X", root, Arc::new(NoProgram)).unwrap();
        for (offload_type, n) in [
            (OffloadType::LeafLevel, None),
            (OffloadType::BlockLevel, Some(1)),
        ] {
            let plan = GroupPlan::new(&c, &config(offload_type, n));
            assert_eq!(plan.len(), 1, "{offload_type:?}");
            assert_eq!(plan.unmatched(), None);
            assert_eq!(plan.group_of(LeafId(0)), None);
            assert_eq!(plan.group_of(LeafId(1)), Some(0));
            assert_eq!(plan.group_of(LeafId(2)), None);
            assert_eq!(plan.streamed_leaves(), 1);
        }
    }

    impl GroupPlan {
        fn param_total(&self) -> u64 {
            self.groups.iter().map(|g| g.bytes).sum()
        }
    }
}
