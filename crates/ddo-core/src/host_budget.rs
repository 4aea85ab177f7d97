//! The host budget (issue 35): how much of the machine's RAM a run may make it hold.
//!
//! DDO makes the machine hold two kinds of host memory for weights: **pinned** memory (a
//! pinned home, checkpoint mappings page-locked in place, staging buffers), which the kernel
//! can neither swap nor reclaim, and the **pages of the checkpoint mappings** the process
//! touches, which are clean file pages the kernel takes back under pressure. The budget
//! bounds what cannot be taken back: every phase's pinned bytes plus the process's own
//! working memory ([`HOST_WORKING_BYTES`]) stay within it. The pipeline memory planner in
//! `ddo-routes` plans each phase under it (pinned homes, registrations, staging rings,
//! background attaches); the device's pinned ledger is set to it, so nothing pins past it
//! even where a plan was not asked.
//!
//! Default: the host's `MemAvailable` when the run starts less a reserve
//! ([`HOST_RESERVE_SHARE`] of it, at least [`HOST_RESERVE_MIN`]): room for the page cache
//! that streamed reads go through, the kernel, the GPU driver's own host allocations and
//! other processes' growth. With 31 GiB available that is 27 GiB; with 125 GiB free, 109 GiB.

use std::fmt;

use crate::error::budget_arg;

/// The share of `MemAvailable` the default host budget leaves to the rest of the machine:
/// one eighth.
pub const HOST_RESERVE_SHARE: (u64, u64) = (1, 8);

/// The least host memory the default budget leaves to the rest of the machine: 4 GiB.
/// On the GPU machine with 31 GiB available, a run that pinned 27 GiB of checkpoint
/// mappings (all but 4 GiB) made the kernel kill another process (issue 35).
pub const HOST_RESERVE_MIN: u64 = 4 << 30;

/// The host budget where `/proc/meminfo` cannot be read: 16 GiB.
pub const HOST_BUDGET_UNKNOWN: u64 = 16 << 30;

/// The least budget the default ever gives: 256 MiB (WSL's pinned ration).
pub const HOST_BUDGET_FLOOR: u64 = crate::streaming::WSL_COMPAT_PINNED_LIMIT;

/// The process's own host memory besides weights that the planner counts in every phase:
/// 2 GiB. The CUDA context and its libraries (cuBLAS, cuDNN, NVRTC), the tokenizers,
/// host copies of embeddings, latents and the image, the bounded upload buffers, and the
/// staged units read ahead
/// ([`READ_AHEAD_BYTES`](crate::streaming::staged_read::READ_AHEAD_BYTES)).
pub const HOST_WORKING_BYTES: u64 = 2 << 30;

/// Where a host budget came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostBudgetSource {
    /// `--host-budget`.
    Given,
    /// `MemAvailable` at start less the reserve.
    Available {
        /// `MemAvailable`, bytes.
        available: u64,
        /// The reserve left, bytes.
        reserve: u64,
    },
    /// `/proc/meminfo` could not be read: [`HOST_BUDGET_UNKNOWN`].
    Unknown,
}

/// A host budget: bytes and where they came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBudget {
    /// Bytes of pinned memory plus working memory DDO may make the machine hold.
    pub bytes: u64,
    /// Where the figure came from.
    pub source: HostBudgetSource,
}

impl HostBudget {
    /// A budget the user gave.
    pub fn given(bytes: u64) -> Self {
        Self {
            bytes,
            source: HostBudgetSource::Given,
        }
    }

    /// The default budget for an available-memory reading (`None`: not readable).
    pub fn for_available(available: Option<u64>) -> Self {
        match available {
            None => Self {
                bytes: HOST_BUDGET_UNKNOWN,
                source: HostBudgetSource::Unknown,
            },
            Some(available) => {
                let (num, den) = HOST_RESERVE_SHARE;
                let reserve = (available / den).saturating_mul(num).max(HOST_RESERVE_MIN);
                Self {
                    bytes: available.saturating_sub(reserve).max(HOST_BUDGET_FLOOR),
                    source: HostBudgetSource::Available { available, reserve },
                }
            }
        }
    }

    /// The default budget now: [`HostBudget::for_available`] of this host's `MemAvailable`.
    pub fn default_now() -> Self {
        Self::for_available(crate::host_memory::mem_available())
    }

    /// What the budget leaves for pinned weights once the working memory is counted.
    pub fn pinned_room(&self) -> u64 {
        self.bytes.saturating_sub(HOST_WORKING_BYTES)
    }
}

impl fmt::Display for HostBudgetSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Given => f.write_str("--host-budget"),
            Self::Available { available, reserve } => write!(
                f,
                "MemAvailable {} less a reserve of {}",
                ddo_metrics::format_bytes(*available),
                ddo_metrics::format_bytes(*reserve)
            ),
            Self::Unknown => write!(
                f,
                "MemAvailable unreadable: {}",
                budget_arg(HOST_BUDGET_UNKNOWN)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_leaves_an_eighth_and_at_least_the_minimum() {
        // 31 GiB available (the machine): 4 GiB reserve (an eighth is less).
        let b = HostBudget::for_available(Some(31 * GIB));
        assert_eq!(b.bytes, 27 * GIB);
        assert_eq!(
            b.source,
            HostBudgetSource::Available {
                available: 31 * GIB,
                reserve: 4 * GIB
            }
        );
        // 128 GiB: an eighth, 16 GiB.
        assert_eq!(HostBudget::for_available(Some(128 * GIB)).bytes, 112 * GIB);
        // Less than the reserve: the floor, never zero.
        assert_eq!(
            HostBudget::for_available(Some(2 * GIB)).bytes,
            HOST_BUDGET_FLOOR
        );
        assert_eq!(HostBudget::for_available(None).bytes, HOST_BUDGET_UNKNOWN);
        assert_eq!(
            HostBudget::given(5 * GIB).pinned_room(),
            5 * GIB - HOST_WORKING_BYTES
        );
        assert_eq!(HostBudget::given(GIB).pinned_room(), 0);
    }

    #[test]
    fn the_source_says_where_the_figure_came_from() {
        assert_eq!(HostBudget::given(1).source.to_string(), "--host-budget");
        let s = HostBudget::for_available(Some(31 * GIB)).source.to_string();
        assert!(
            s.contains("MemAvailable 31.00 GiB") && s.contains("4.00 GiB"),
            "{s}"
        );
        assert!(
            HostBudget::for_available(None)
                .source
                .to_string()
                .contains("16GiB")
        );
    }
}
