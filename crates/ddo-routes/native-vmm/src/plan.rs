//! The residency planner, shared with the streaming engine: it lives in
//! `ddo_core::streaming::plan` (with the ring-aware `plan_residency_with`) and is
//! re-exported here so this route's code and its users keep their paths.

pub use ddo_core::streaming::plan::{
    ResidencyPlan, SlotModel, plan_residency, plan_residency_with,
};
