//! Shared helpers of DDO's examples.
