//! The route's settings: a [`RouteSpec`]'s options with Diffusers' defaults applied.

use ddo_core::{OffloadType, RouteSpec};

/// Diffusers-style group offload settings with Diffusers' defaults applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupOffloadConfig {
    /// Leaf or block level.
    pub offload_type: OffloadType,
    /// Blocks per group (block level).
    pub num_blocks_per_group: usize,
    /// Prefetch on a copy stream.
    pub use_stream: bool,
    /// Stream-ordered frees instead of a synchronisation.
    pub record_stream: bool,
    /// Pin on the fly instead of keeping pinned copies.
    pub low_cpu_mem_usage: bool,
    /// Page-lock the weights' one host copy: without a stream a pinned home made at attach,
    /// with one the streaming engine's staging. Default: with a stream unless
    /// `low_cpu_mem_usage`; without one never, as Diffusers pins only for a stream
    /// (`ModuleGroup._init_cpu_param_dict`), the seed's VAE leaf calls included.
    pub pinned: bool,
}

impl GroupOffloadConfig {
    /// The settings `spec` asks for, with Diffusers' defaults where it is silent (leaf
    /// level, one block per group, no stream, no record_stream, pinned only for a stream).
    pub fn from_spec(spec: &RouteSpec) -> Self {
        let o = spec.options();
        let use_stream = o.use_stream.unwrap_or(false);
        let low_cpu_mem_usage = o.low_cpu_mem_usage.unwrap_or(false);
        GroupOffloadConfig {
            offload_type: o.offload_type.unwrap_or(OffloadType::LeafLevel),
            num_blocks_per_group: o.num_blocks_per_group.unwrap_or(1),
            use_stream,
            record_stream: o.record_stream.unwrap_or(false),
            low_cpu_mem_usage,
            pinned: o.pinned.unwrap_or(use_stream && !low_cpu_mem_usage),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_get_diffusers_defaults() {
        let s: RouteSpec = ddo_core::RouteSpec::parse("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true,record_stream=true", &ddo_core::RouteId::BUILT_IN)
            .unwrap();
        let c = GroupOffloadConfig::from_spec(&s);
        assert_eq!(c.offload_type, OffloadType::BlockLevel);
        assert!(c.use_stream && c.record_stream && c.pinned && !c.low_cpu_mem_usage);
        let leaf: RouteSpec =
            ddo_core::RouteSpec::parse("diffusers_group_offload", &ddo_core::RouteId::BUILT_IN)
                .unwrap();
        let c = GroupOffloadConfig::from_spec(&leaf);
        assert_eq!(c.offload_type, OffloadType::LeafLevel);
        // Without a stream nothing is page-locked by default: Diffusers pins only for a
        // stream. `pinned=true` asks for it.
        assert!(!c.use_stream && !c.pinned);
        let pinned: RouteSpec = ddo_core::RouteSpec::parse(
            "diffusers_group_offload:pinned=true",
            &ddo_core::RouteId::BUILT_IN,
        )
        .unwrap();
        assert!(GroupOffloadConfig::from_spec(&pinned).pinned);
        let low = GroupOffloadConfig::from_spec(&RouteSpec::leaf_group(true, true));
        assert!(low.use_stream && !low.pinned);
    }
}
