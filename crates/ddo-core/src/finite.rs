//! Non-finite checks a denoising loop reads one step late ([`DeferredFiniteChecks`]).
//!
//! A pipeline stops on latents holding a NaN or an Inf after a step
//! ([`CoreError::NonFinite`] naming the step). Read at once ([`crate::check_finite`]), the
//! count holds the host until the device has finished the step, so the next forward's
//! first copies and kernels are queued only then and the link and the device wait for the
//! host at every step boundary (about 1% of a streamed FLUX.1-dev step on one H100). Here
//! the count of step `i` is queued (one reduction and an asynchronous copy into pinned
//! memory) and read once step `i + 1` has been queued, when the device is long past it:
//! the loop never waits for it, a non-finite step is still named exactly, and at most one
//! more step runs before the run stops. The last step's check is read at the end of the
//! loop ([`DeferredFiniteChecks::finish`]).

use crate::device::{Device, Event, ops_of};
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostSlice};
use crate::tensor::Tensor;

/// Bytes of one count in host memory (a little-endian `u64`).
pub const COUNT_BYTES: usize = 8;

/// Writes `count` into the first [`COUNT_BYTES`] of `dst` (what
/// [`Ops::queue_count_non_finite`](crate::Ops::queue_count_non_finite) leaves there).
pub fn write_count(dst: &HostSlice, count: u64) -> Result<()> {
    check_len(dst)?;
    dst.with_bytes_mut(|b| b[..COUNT_BYTES].copy_from_slice(&count.to_le_bytes()))
}

fn check_len(dst: &HostSlice) -> Result<()> {
    if dst.len() < COUNT_BYTES {
        return Err(CoreError::Shape {
            what: "queue_count_non_finite".into(),
            message: format!(
                "the count's host buffer has {} bytes; it needs {COUNT_BYTES}",
                dst.len()
            ),
        });
    }
    Ok(())
}

/// One queued count: its pinned buffer, the event after its copy, and what names it.
struct Pending<'d> {
    device: &'d dyn Device,
    host: Option<HostBuffer>,
    event: Event,
    phase: String,
    step: Option<(usize, usize)>,
    what: String,
}

impl Pending<'_> {
    /// Waits for the count (the device is past it when the loop reads it), then returns
    /// the buffer for the next count, or the [`CoreError::NonFinite`] it names.
    fn finish(mut self) -> Result<HostBuffer> {
        self.device.synchronize_event(&self.event)?;
        let host = self.host.take().ok_or_else(|| CoreError::Backend {
            device: self.device.id().to_string(),
            message: "a non-finite count was read twice".into(),
        })?;
        let mut word = [0u8; COUNT_BYTES];
        host.slice_all()
            .with_bytes(|b| word.copy_from_slice(&b[..COUNT_BYTES]));
        match u64::from_le_bytes(word) {
            0 => Ok(host),
            count => Err(CoreError::NonFinite {
                phase: std::mem::take(&mut self.phase),
                step: self.step,
                what: std::mem::take(&mut self.what),
                count,
            }),
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        // The copy may still be writing the buffer: it goes only after the copy is done.
        if self.host.is_some() {
            let _ = self.device.synchronize_event(&self.event);
        }
    }
}

/// The latents checks of one denoising loop, each read one step late (see the
/// [module docs](self)): [`DeferredFiniteChecks::queue`] after each step, then
/// [`DeferredFiniteChecks::finish`] after the loop. Two pinned buffers of
/// [`COUNT_BYTES`], reused.
pub struct DeferredFiniteChecks<'d> {
    device: &'d dyn Device,
    pending: Option<Pending<'d>>,
    spare: Option<HostBuffer>,
}

impl<'d> DeferredFiniteChecks<'d> {
    /// No check queued yet.
    pub fn new(device: &'d dyn Device) -> Self {
        Self {
            device,
            pending: None,
            spare: None,
        }
    }

    /// Queues the count of `x`'s NaN and Inf elements (named by `phase`, `step` and `what`
    /// when it is not 0), then reads the count queued before it: that earlier check's
    /// [`CoreError::NonFinite`], if any, is this call's error.
    pub fn queue(
        &mut self,
        x: &Tensor,
        phase: &str,
        step: Option<(usize, usize)>,
        what: &str,
    ) -> Result<()> {
        let ops = ops_of(self.device)?;
        let host = match self.spare.take() {
            Some(h) => h,
            None => match self.device.alloc_pinned(COUNT_BYTES) {
                Ok(h) => h,
                // No pinned room left (a host budget spent to the byte): read it at once.
                Err(_) => {
                    self.finish()?;
                    return crate::check_finite(ops, x, phase, step, what);
                }
            },
        };
        ops.queue_count_non_finite(x, &host.slice_all())?;
        let event = self.device.record_event(&self.device.compute_stream())?;
        let next = Pending {
            device: self.device,
            host: Some(host),
            event,
            phase: phase.to_string(),
            step,
            what: what.to_string(),
        };
        match self.pending.replace(next) {
            Some(earlier) => {
                self.spare = Some(earlier.finish()?);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Reads the last count queued (waiting for it): its [`CoreError::NonFinite`], if any.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(last) = self.pending.take() {
            self.spare = Some(last.finish()?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_written_little_endian_and_a_short_buffer_is_refused() {
        let b = HostBuffer::pageable_zeroed(16);
        write_count(&b.slice_all(), 0x0102_0304_0506_0708).unwrap();
        let bytes = b.slice_all().with_bytes(<[u8]>::to_vec);
        assert_eq!(&bytes[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&bytes[8..], &[0u8; 8]);
        let short = HostBuffer::pageable_zeroed(4);
        assert!(matches!(
            write_count(&short.slice_all(), 1),
            Err(CoreError::Shape { .. })
        ));
    }
}
