//! The residency planner, now shared with the streaming engine: it lives in
//! `ddo_core::streaming::plan` and is re-exported here so this route's code and its
//! users keep their paths.

pub use ddo_core::streaming::plan::{
    ResidencyPlan, SlotModel, plan_residency, plan_residency_with,
};
