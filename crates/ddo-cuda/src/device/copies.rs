//! Copies of a [`CudaDevice`]: the bodies of the `Device` trait's host→device,
//! device→host and device→device copies, and the staging of pageable uploads through
//! pinned upload buffers (one buffer, or chunk by chunk filled by [`parallel_copy`]).

use ddo_core::{CoreError, Device, DeviceSlice, HostBuffer, HostMemoryKind, HostSlice, Stream};

use super::CudaDevice;
use super::memory::CudaAllocation;
use super::streams::{CudaStreamHandle, Held};
use crate::driver;
use crate::error::DriverResultExt;

#[cfg(doc)]
use super::CudaDeviceConfig;
#[cfg(doc)]
use ddo_core::MemoryInfo;

/// Smallest pinned upload buffer (smaller uploads share its size class).
const UPLOAD_STAGING_MIN: usize = 64 << 10;

/// Threads that fill one upload chunk from pageable memory.
const UPLOAD_COPY_THREADS: usize = 8;

/// `dst.copy_from_slice(src)` on up to [`UPLOAD_COPY_THREADS`] threads (one below 1 MiB).
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, UPLOAD_COPY_THREADS);
    if threads == 1 || src.len() < (1 << 20) {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

impl CudaDevice {
    /// Pinned bytes held for staging pageable uploads (part of
    /// [`MemoryInfo::pinned_host`]; see [`CudaDeviceConfig::upload_staging_bytes`]).
    pub fn upload_staging_bytes(&self) -> u64 {
        self.upload_staging
            .lock()
            .iter()
            .map(|b| b.len() as u64)
            .sum()
    }

    /// A pinned upload buffer of at least `len` bytes that no queued copy reads, or `None`
    /// when `len` is too large to stage or no buffer can be had (the caller then copies
    /// from pageable memory). Completed copies must have been retired (`poll`) first.
    fn upload_staging_buffer(&self, len: usize) -> Option<HostBuffer> {
        let cap = self.config.upload_staging_bytes;
        if len == 0 || len as u64 > cap / 2 {
            return None;
        }
        let class = len.next_power_of_two().max(UPLOAD_STAGING_MIN);
        let mut pool = self.upload_staging.lock();
        let mut best: Option<usize> = None;
        for i in 0..pool.len() {
            let fits = pool[i].len() >= len && pool[i].is_exclusive();
            if fits && best.is_none_or(|b| pool[i].len() < pool[b].len()) {
                best = Some(i);
            }
        }
        if let Some(i) = best {
            return Some(pool[i].clone());
        }
        // Room for a new buffer: free ones that are too small go first.
        let mut held: u64 = pool.iter().map(|b| b.len() as u64).sum();
        if held + class as u64 > cap {
            pool.retain_mut(|b| {
                if held + class as u64 > cap && b.is_exclusive() {
                    held -= b.len() as u64;
                    false
                } else {
                    true
                }
            });
            if held + class as u64 > cap {
                return None;
            }
        }
        drop(pool);
        // At the pinned limit (or refused by the driver): not staged. (`alloc_pinned` takes
        // the pool's lock when it needs room, so it is not held here.)
        let buffer = self.alloc_pinned(class).ok()?;
        self.upload_staging.lock().push(buffer.clone());
        Some(buffer)
    }

    /// Bytes of one chunk of a large pageable upload: half the upload buffers' room.
    fn upload_chunk(&self) -> usize {
        (self.config.upload_staging_bytes / 2) as usize
    }

    /// A pageable upload larger than one upload buffer, chunk by chunk through the upload
    /// buffers: each chunk is copied into a free buffer on up to [`UPLOAD_COPY_THREADS`]
    /// threads and its device copy queued, so the host fills the next chunk while the link
    /// carries the last (a plain pageable copy runs at the driver's pageable rate, about
    /// 7 GB/s on the H200's host). When no buffer is free the oldest queued copies are
    /// waited for, one at a time (the whole stream only when that frees none). The source
    /// can change as soon as this returns.
    fn upload_in_chunks(
        &self,
        src: &HostSlice,
        to: u64,
        alloc: &CudaAllocation,
        s: &CudaStreamHandle,
    ) -> ddo_core::Result<()> {
        let chunk = self.upload_chunk().max(1);
        let mut at = 0usize;
        while at < src.len() {
            let n = chunk.min(src.len() - at);
            // No free buffer: wait for the oldest queued copies, one at a time, so the
            // host fills this chunk while the link still carries the newer ones.
            let mut free = self.upload_staging_buffer(n);
            while free.is_none() && s.retire_oldest().map_err(|e| self.core(e))? {
                free = self.upload_staging_buffer(n);
            }
            let staging = match free {
                Some(b) => b,
                None => {
                    s.stream
                        .synchronize()
                        .call("cuStreamSynchronize")
                        .map_err(|e| self.core(e))?;
                    s.retire_all();
                    match self.upload_staging_buffer(n) {
                        Some(b) => b,
                        None => {
                            // The room went to pinned memory asked for meanwhile: the rest
                            // goes the driver's pageable way.
                            src.with_bytes(|bytes| {
                                driver::memcpy_htod_async(to + at as u64, &bytes[at..], &s.stream)?;
                                s.stream.synchronize().call("cuStreamSynchronize")
                            })
                            .map_err(|e| self.core(e))?;
                            s.retire_all();
                            return Ok(());
                        }
                    }
                }
            };
            let view = staging.slice(0, n)?;
            view.with_bytes_mut(|dst| {
                src.with_bytes(|from| parallel_copy(dst, &from[at..at + n]));
            })?;
            view.with_bytes(|bytes| driver::memcpy_htod_async(to + at as u64, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            alloc.note_use(s);
            s.track((Held::Host(view), None))
                .map_err(|e| self.core(e))?;
            self.poll()?;
            at += n;
        }
        Ok(())
    }

    /// A whole coded checkpoint tensor (`ddo convert --compress lossless`) uploaded as its
    /// coded bytes, about two thirds of the weights', and decoded on the device into `dst`
    /// (`kernels/codec.cu`, 478 GB/s on an H100 against the host decoder's 0.6 GB/s a
    /// core): the bytes go from the file's mapping through the upload buffers, chunk by
    /// chunk on several threads (as a large pageable upload does), into device scratch the
    /// size of the unit, which is freed once the decode is done. The decoder's status is
    /// read back before this returns (one synchronisation per tensor), so a unit that does
    /// not decode is this call's typed error naming the file and the tensor.
    fn upload_coded(
        &self,
        coded: &ddo_core::host_memory::CodedSource,
        dst: &DeviceSlice,
        stream: &Stream,
        s: &CudaStreamHandle,
    ) -> ddo_core::Result<()> {
        use ddo_core::host_memory::CODED_READ_AHEAD;
        let status_at = coded.len.next_multiple_of(256);
        let scratch = self.alloc(status_at + 256)?;
        let units = scratch.slice(0, coded.len)?;
        let status = scratch.slice(status_at, crate::ops::codec::SCRATCH_BYTES)?;
        crate::ops::codec::clear_scratch(self, &status, stream)?;
        coded
            .map
            .read_ahead(coded.offset, coded.len.saturating_add(CODED_READ_AHEAD));
        let bytes = HostBuffer::mapped(std::sync::Arc::clone(&coded.map), coded.offset, coded.len)?;
        let alloc = self.allocation(units.buffer())?;
        self.upload_in_chunks(&bytes.slice_all(), alloc.ptr, alloc, s)?;
        crate::ops::codec::decode_unit(self, &coded.header, &units, dst, &status, stream, true)?;
        let result = crate::ops::codec::read_status(self, &status, stream)?;
        drop(scratch);
        if result.is_ok() {
            return Ok(());
        }
        Err(CoreError::Checkpoint {
            path: coded.map.path().to_path_buf(),
            message: format!(
                "coded tensor `{}` does not decode on the device (status {:#x}): the file \
                 changed or is corrupt; convert the folder again with ddo convert --compress lossless",
                coded.name,
                result.bits()
            ),
        })
    }

    /// Drops the pinned upload buffers no queued copy reads; returns their bytes.
    pub(super) fn release_upload_staging(&self) -> u64 {
        let mut released = 0;
        self.upload_staging.lock().retain_mut(|b| {
            if b.is_exclusive() {
                released += b.len() as u64;
                false
            } else {
                true
            }
        });
        released
    }

    fn check_len(what: &str, expected: usize, actual: usize) -> ddo_core::Result<()> {
        if expected == actual {
            Ok(())
        } else {
            Err(CoreError::SizeMismatch {
                what: what.to_string(),
                expected,
                actual,
            })
        }
    }

    /// The body of [`Device::copy_h2d`].
    pub(super) fn copy_h2d_impl(
        &self,
        src: &HostSlice,
        dst: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("host->device copy", dst.len(), src.len())?;
        let alloc = self.allocation(dst.buffer())?;
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if src.is_empty() {
            return Ok(());
        }
        self.order_use(alloc, s)?;
        let to = alloc.ptr + dst.offset() as u64;
        if src.kind() == HostMemoryKind::Pinned {
            src.with_bytes(|bytes| driver::memcpy_htod_async(to, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            s.track((Held::Host(src.clone()), Some(Held::Device(dst.clone()))))
                .map_err(|e| self.core(e))
        } else if let Some(staging) = (src.kind() == HostMemoryKind::Pageable
            || src.buffer().coded_source().is_some())
        .then(|| self.upload_staging_buffer(src.len()))
        .flatten()
        {
            // Pageable: the bytes go into a pinned upload buffer now, and the copy from it
            // is queued like any pinned copy. A pageable copy would hold the host until it
            // is done, queued behind whatever the link already carries. A coded checkpoint
            // tensor decodes straight into the buffer (a part of one through a decoded copy).
            let view = staging.slice(0, src.len())?;
            match src.coded_source() {
                Some(coded) => view.with_bytes_mut(|to| coded.decode_into(to))??,
                None => {
                    view.with_bytes_mut(|to| src.try_with_bytes(|from| to.copy_from_slice(from)))??
                }
            }
            view.with_bytes(|bytes| driver::memcpy_htod_async(to, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            // The destination is not held: its free is ordered behind the copy instead, so
            // a tensor just uploaded is still its buffer's only holder (in-place ops).
            alloc.note_use(s);
            s.track((Held::Host(view), None)).map_err(|e| self.core(e))
        } else if let Some(coded) = src.coded_source().filter(|_| self.upload_chunk() > 0) {
            self.upload_coded(coded, dst, stream, s)
        } else if let Some(coded) = src
            .buffer()
            .coded_source()
            .filter(|_| self.upload_chunk() > 0)
        {
            // A coded checkpoint tensor too large for one upload buffer: decoded on every
            // core into pageable memory, then copied chunk by chunk through the upload
            // buffers like any large pageable upload (the link carries one tensor while the
            // host decodes the next).
            let decoded = HostBuffer::owned(coded.decode()?, None);
            self.upload_in_chunks(&decoded.slice(src.offset(), src.len())?, to, alloc, s)
        } else if src.kind() == HostMemoryKind::Pageable && self.upload_chunk() > 0 {
            self.upload_in_chunks(src, to, alloc, s)
        } else {
            // Pageable or mapped: the copy completes before the bytes' borrow ends (a coded
            // checkpoint tensor is decoded for it; one that does not decode is the error).
            src.try_with_bytes(|bytes| {
                driver::memcpy_htod_async(to, bytes, &s.stream)?;
                s.stream.synchronize().call("cuStreamSynchronize")
            })?
            .map_err(|e| self.core(e))?;
            s.retire_all();
            Ok(())
        }
    }

    /// The body of [`Device::copy_d2h`].
    pub(super) fn copy_d2h_impl(
        &self,
        src: &DeviceSlice,
        dst: &HostSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("device->host copy", src.len(), dst.len())?;
        let alloc = self.allocation(src.buffer())?;
        if dst.kind() == HostMemoryKind::CheckpointMapped {
            return Err(CoreError::Backend {
                device: self.id().to_string(),
                message: "device->host copy into a read-only checkpoint mapping".into(),
            });
        }
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if dst.is_empty() {
            return Ok(());
        }
        self.order_use(alloc, s)?;
        let from = alloc.ptr + src.offset() as u64;
        if dst.kind() == HostMemoryKind::Pinned {
            dst.with_bytes_mut(|bytes| driver::memcpy_dtoh_async(bytes, from, &s.stream))?
                .map_err(|e| self.core(e))?;
            s.track((Held::Device(src.clone()), Some(Held::Host(dst.clone()))))
                .map_err(|e| self.core(e))
        } else {
            dst.with_bytes_mut(|bytes| {
                driver::memcpy_dtoh_async(bytes, from, &s.stream)?;
                s.stream.synchronize().call("cuStreamSynchronize")
            })?
            .map_err(|e| self.core(e))?;
            s.retire_all();
            Ok(())
        }
    }

    /// The body of [`Device::copy_d2d`].
    pub(super) fn copy_d2d_impl(
        &self,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("device->device copy", dst.len(), src.len())?;
        let src_alloc = self.allocation(src.buffer())?;
        let dst_alloc = self.allocation(dst.buffer())?;
        let from = src_alloc.ptr + src.offset() as u64;
        let to = dst_alloc.ptr + dst.offset() as u64;
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if src.is_empty() {
            return Ok(());
        }
        self.order_use(src_alloc, s)?;
        self.order_use(dst_alloc, s)?;
        driver::memcpy_dtod_async(to, from, src.len(), &s.stream).map_err(|e| self.core(e))?;
        s.track((Held::Device(src.clone()), Some(Held::Device(dst.clone()))))
            .map_err(|e| self.core(e))
    }
}
