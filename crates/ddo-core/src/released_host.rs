//! Pinned host memory a device was handed back ([`Device::release_host`]) and keeps pinned
//! until [`Device::unpin_released`]: one type for every backend, so that the CUDA device and
//! the host backend keep, reuse and give back the same way.
//!
//! A registration of a checkpoint range that was handed back is reused when the same range is
//! registered again ([`ReleasedHost::reuse`]): a long-lived process (`ddo serve`) attaches its
//! routes for each request, and the second attach pins nothing again. A registration that
//! overlaps a new range without being the same one is dropped first
//! ([`ReleasedHost::take_overlapping`]): a page is registered once.
//!
//! [`Device::release_host`]: crate::Device::release_host
//! [`Device::unpin_released`]: crate::Device::unpin_released

use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::host_memory::{CheckpointMap, HostBuffer, register_span};

/// The host memory a device keeps pinned after [`Device::release_host`](crate::Device::release_host) (module docs).
#[derive(Default)]
pub struct ReleasedHost {
    kept: Mutex<Vec<HostBuffer>>,
}

impl ReleasedHost {
    /// An empty keeper.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps `buffer` pinned until [`ReleasedHost::take_all`] (or a reuse).
    pub fn keep(&self, buffer: HostBuffer) {
        self.kept.lock().push(buffer);
    }

    /// Everything kept, handed to the caller to drop (each registration unpins as its last
    /// handle goes; dropping outside the lock lets the backend's unregistering take its
    /// time).
    pub fn take_all(&self) -> Vec<HostBuffer> {
        std::mem::take(&mut *self.kept.lock())
    }

    /// Pinned bytes kept now.
    pub fn pinned_bytes(&self) -> u64 {
        pinned_bytes_of(&self.kept.lock())
    }

    /// How many buffers are kept now.
    pub fn len(&self) -> usize {
        self.kept.lock().len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.kept.lock().is_empty()
    }

    /// The kept registered view of exactly `view`'s checkpoint range (the same mapping, offset
    /// and length), taken out of the keeper: registering `view` again would pin the same pages.
    /// `None` for a view that is not a mapped range or has no such registration.
    pub fn reuse(&self, view: &HostBuffer) -> Option<HostBuffer> {
        let (map, offset, len) = view.mapping()?;
        let mut kept = self.kept.lock();
        let at = kept.iter().position(|b| {
            kept_range(b).is_some_and(|(m, o, l)| Arc::ptr_eq(m, map) && o == offset && l == len)
        })?;
        Some(kept.swap_remove(at))
    }

    /// The kept registrations of `map` whose registered span overlaps `span` (a span of
    /// [`register_span`]), taken out for the caller to drop before registering `span`.
    pub fn take_overlapping(
        &self,
        map: &Arc<CheckpointMap>,
        span: &Range<usize>,
    ) -> Vec<HostBuffer> {
        if span.is_empty() {
            return Vec::new();
        }
        let mut kept = self.kept.lock();
        let (taken, stay): (Vec<HostBuffer>, Vec<HostBuffer>) =
            std::mem::take(&mut *kept).into_iter().partition(|b| {
                kept_range(b).is_some_and(|(m, o, l)| {
                    let s = register_span(m.len(), o, l);
                    Arc::ptr_eq(m, map) && s.start < span.end && span.start < s.end
                })
            });
        *kept = stay;
        taken
    }
}

impl std::fmt::Debug for ReleasedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.kept.lock();
        write!(
            f,
            "ReleasedHost({} buffers, {} B pinned)",
            kept.len(),
            pinned_bytes_of(&kept)
        )
    }
}

/// The checkpoint range a kept registered view reads (`None` for pinned owned memory).
fn kept_range(b: &HostBuffer) -> Option<(&Arc<CheckpointMap>, usize, usize)> {
    b.registered_base().and_then(HostBuffer::mapping)
}

/// Pinned bytes of `buffers` (0 for a buffer that pins nothing).
pub fn pinned_bytes_of(buffers: &[HostBuffer]) -> u64 {
    buffers.iter().map(|b| b.pinned_bytes().unwrap_or(0)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_memory::{PinnedLedger, REGISTER_ALIGN};

    fn map_of(len: usize) -> Arc<CheckpointMap> {
        let mut bytes = memmap2::MmapMut::map_anon(len).unwrap();
        bytes.fill(7);
        CheckpointMap::in_memory("released.safetensors", bytes)
    }

    /// A registered view of `map`'s `offset..offset+len`, counted on `ledger`.
    fn registered(
        map: &Arc<CheckpointMap>,
        offset: usize,
        len: usize,
        ledger: &Arc<PinnedLedger>,
    ) -> HostBuffer {
        let view = HostBuffer::mapped(Arc::clone(map), offset, len).unwrap();
        let span = register_span(map.len(), offset, len);
        let pin = ledger.reserve(span.len() as u64, None).unwrap();
        HostBuffer::registered(view, pin).unwrap()
    }

    #[test]
    fn the_same_range_is_reused_once_and_others_are_not() {
        let ledger = PinnedLedger::new(u64::MAX);
        let (a, b) = (map_of(4 * REGISTER_ALIGN), map_of(4 * REGISTER_ALIGN));
        let kept = ReleasedHost::new();
        kept.keep(registered(&a, 0, REGISTER_ALIGN, &ledger));
        kept.keep(registered(&a, 2 * REGISTER_ALIGN, 100, &ledger));
        assert_eq!(kept.pinned_bytes(), 2 * REGISTER_ALIGN as u64);
        // Another mapping of equal bytes, another length, another offset: not the same range.
        for (map, offset, len) in [
            (&b, 0, REGISTER_ALIGN),
            (&a, 0, REGISTER_ALIGN - 1),
            (&a, 1, REGISTER_ALIGN),
        ] {
            let view = HostBuffer::mapped(Arc::clone(map), offset, len).unwrap();
            assert!(kept.reuse(&view).is_none(), "{offset} {len}");
        }
        let view = HostBuffer::mapped(Arc::clone(&a), 2 * REGISTER_ALIGN, 100).unwrap();
        let again = kept.reuse(&view).expect("the same range");
        assert_eq!(again.pinned_bytes(), Some(REGISTER_ALIGN as u64));
        assert_eq!(kept.len(), 1);
        assert!(kept.reuse(&view).is_none(), "taken once");
        // An owned buffer is no checkpoint range.
        assert!(kept.reuse(&HostBuffer::pageable_from(&[0u8; 8])).is_none());
        drop(again);
        assert_eq!(ledger.pinned(), REGISTER_ALIGN as u64);
    }

    #[test]
    fn overlapping_registrations_are_taken_out_and_the_rest_stay() {
        let ledger = PinnedLedger::new(u64::MAX);
        let (a, b) = (map_of(8 * REGISTER_ALIGN), map_of(8 * REGISTER_ALIGN));
        let kept = ReleasedHost::new();
        kept.keep(registered(&a, 0, REGISTER_ALIGN, &ledger));
        kept.keep(registered(
            &a,
            3 * REGISTER_ALIGN,
            2 * REGISTER_ALIGN,
            &ledger,
        ));
        kept.keep(registered(&b, 0, REGISTER_ALIGN, &ledger));
        // A span touching block 3 (rounded out from one byte in it) overlaps the second only.
        let span = register_span(a.len(), 3 * REGISTER_ALIGN + 5, 1);
        let taken = kept.take_overlapping(&a, &span);
        assert_eq!(taken.len(), 1);
        assert_eq!(
            taken[0]
                .registered_base()
                .and_then(HostBuffer::mapping)
                .map(|(_, o, _)| o),
            Some(3 * REGISTER_ALIGN)
        );
        assert_eq!(kept.len(), 2);
        assert!(
            kept.take_overlapping(&a, &(0..0)).is_empty(),
            "an empty span overlaps nothing"
        );
        // Adjacent is not overlapping.
        assert!(
            kept.take_overlapping(&a, &(REGISTER_ALIGN..2 * REGISTER_ALIGN))
                .is_empty()
        );
        drop(taken);
        assert_eq!(ledger.pinned(), 2 * REGISTER_ALIGN as u64);
        let all = kept.take_all();
        assert_eq!((all.len(), kept.pinned_bytes()), (2, 0));
        drop(all);
        assert_eq!(ledger.pinned(), 0);
    }
}
