//! What the streaming engine's integration tests share (`streaming.rs`, `register.rs`,
//! `coded_sources.rs`): one forward whose "kernels" copy each position's params into its
//! output on the compute stream, and the bytes each position must read.

use std::sync::Arc;

use ddo_core::device::download;
use ddo_core::streaming::StreamingEngine;
use ddo_core::{CoreError, Device, DeviceBuffer, HostBuffer, Param};
use ddo_host::HostDevice;

/// One forward of `schedule`: each position's "kernel" copies its params' device bytes
/// into `outputs[pos]` on the compute stream, behind `lag` (a slow pinned copy, so compute
/// lags the host: a refill that did not wait for compute's use event, or a kernel that did
/// not wait for its unit's copy, shows as wrong bytes) where one is given. Returns the bytes
/// each position read.
pub fn forward(
    d: &HostDevice,
    engine: &mut StreamingEngine,
    segs: &[Vec<Arc<Param>>],
    schedule: &[usize],
    outputs: &[DeviceBuffer],
    lag: Option<&(HostBuffer, DeviceBuffer)>,
) -> ddo_core::Result<Vec<Vec<u8>>> {
    let compute = d.compute_stream();
    engine.begin_forward()?;
    for (pos, &s) in schedule.iter().enumerate() {
        engine.enter(pos)?;
        if let Some((host, device)) = lag {
            d.copy_h2d(&host.slice_all(), &device.slice_all(), &compute)?;
        }
        let mut at = 0;
        for p in &segs[s] {
            let src = p.device().ok_or_else(|| CoreError::NotResident {
                leaf: format!("position {pos}"),
                param: p.name().to_string(),
            })?;
            d.copy_d2d(&src, &outputs[pos].slice(at, p.nbytes())?, &compute)?;
            at += p.nbytes();
        }
        engine.leave(pos)?;
    }
    engine.end_forward()?;
    d.synchronize()?;
    outputs
        .iter()
        .map(|o| download(d, &o.slice_all(), &compute))
        .collect()
}

/// The bytes each position of `schedule` must read: its params' host bytes, in order.
pub fn expected(segs: &[Vec<Arc<Param>>], schedule: &[usize]) -> Vec<Vec<u8>> {
    schedule
        .iter()
        .map(|&s| segs[s].iter().flat_map(|p| p.host().to_vec()).collect())
        .collect()
}
