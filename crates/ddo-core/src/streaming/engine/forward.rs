//! The per-forward side of [`StreamingEngine`]: beginning a forward (the ring taken, the
//! streamed params pointed into it, the first units queued), queuing each unit's copy as its
//! blocker is used, `enter` / `leave` around each position, and the end of the forward; the
//! copies from pinned and staged host memory.

use super::*;

impl StreamingEngine {
    /// Starts a forward: makes the resident params resident (first forward of a phase),
    /// takes the ring, points the streamed params into it and queues the first units.
    pub fn begin_forward(&mut self) -> Result<()> {
        let entry = Instant::now();
        if self.active {
            self.abort()?;
        }
        if self.resident.is_empty() && !self.resident_params.is_empty() {
            self.upload = Some(FirstUpload {
                next_queue: 0,
                next_wait: 0,
                ready: (0..self.resident_at.len()).map(|_| None).collect(),
                queued: std::time::Duration::ZERO,
                pages_kept: Vec::new(),
            });
        }
        if self.slots == 0 {
            self.active = true;
            if let Err(e) = self.queue_residents_before(usize::MAX) {
                let _ = self.abort();
                return Err(e);
            }
            return Ok(());
        }
        if let Some(reader) = self.host.as_mut().and_then(Host::staged_reader_mut) {
            reader.begin_forward();
        }
        // The ring the last forward kept, its leading units copied ahead, or a new one.
        let (buffer, mut copied_ahead, issued, prior_use) = match self.kept.take() {
            Some(k) => {
                self.placement = k.placement;
                (k.buffer, k.ready, k.ahead.units, Some(k.last_use))
            }
            None => {
                self.placement = Arc::clone(&self.base_placement);
                (
                    self.device.alloc(self.figures.ring_bytes() as usize)?,
                    Vec::new(),
                    0,
                    None,
                )
            }
        };
        if let Some(decode) = &self.decode {
            // The decoder's status starts clear each forward.
            let zeros = HostBuffer::pageable_from(&[0u8; 16]);
            let at = scratch_offset(&self.figures);
            let scratch = buffer.slice(at as usize, 16)?;
            if let Err(e) = self.device.copy_h2d(&zeros.slice_all(), &scratch, decode) {
                self.device.release_after(buffer, &self.compute)?;
                return Err(e);
            }
        }
        for (p, unit, offset) in self.layout.single_location() {
            let at = self.placement.offsets[*unit] + offset;
            p.set_device(Some(buffer.slice(at as usize, p.nbytes())?))?;
        }
        let units = self.layout.units().len();
        let trace = if self.timeline {
            Some(Trace::new(
                self.device.record_timed_event(&self.compute)?,
                entry,
                units,
            ))
        } else {
            None
        };
        self.ahead = self.ahead_limit > 0 && self.completed >= 1;
        copied_ahead.resize(units, None);
        self.ring = Some(Ring {
            buffer,
            ready: copied_ahead,
            used: vec![None; units],
            next_issue: issued,
            entered: 0,
            trace,
            coded_used: vec![None; CODED_SLOTS as usize],
            next_ready: Vec::new(),
            next: None,
            prior_use,
            ahead: AheadCopies::default(),
        });
        self.active = true;
        // The link starts now, while the program prepares and uploads its inputs (a
        // backend stages pageable uploads so that they do not hold the host behind these
        // copies: ddo-cuda's upload buffers).
        let first_unit = self.layout.units().first().map_or(usize::MAX, |u| u.first);
        if let Err(e) = self
            .queue_residents_before(first_unit)
            .and_then(|()| self.issue_ready())
        {
            let _ = self.abort();
            return Err(e);
        }
        Ok(())
    }

    /// Queues, in order, every unit whose blocker's use event has been recorded.
    fn issue_ready(&mut self) -> Result<()> {
        loop {
            let Some(ring) = self.ring.as_ref() else {
                return Ok(());
            };
            let u = ring.next_issue;
            if u >= self.layout.units().len() {
                return self.issue_ahead();
            }
            if let Some(b) = self.placement.blockers[u]
                && ring.used[b].is_none()
            {
                return Ok(());
            }
            self.issue(u)?;
            if let Some(ring) = self.ring.as_mut() {
                ring.next_issue = u + 1;
            }
        }
    }

    /// How many of a forward's leading units (those the ring's first pass holds) can be
    /// copied ahead into the ring kept for it, at most: those copied from pinned memory (a
    /// pinned home or registered mappings; not staged through host buffers). None when the
    /// forward is traced or its units are coded (a decode stream checks each forward's
    /// status). Fixed once the host side is built ([`StreamingEngine::new`]).
    pub(super) fn ahead_limit(&self) -> usize {
        if self.timeline || self.decode.is_some() {
            return 0;
        }
        let units = self.layout.units().len();
        match &self.host {
            Some(Host::Home { .. }) => units,
            Some(Host::Registered { staged, .. }) => {
                staged.as_ref().map_or(units, |st| units.min(st.from))
            }
            _ => 0,
        }
    }

    /// Once every unit of the running forward is queued: copies, in order, the next
    /// forward's leading units whose bytes this forward has used for the last time (the
    /// use event of their [`ahead blocker`](Placement::ahead_blockers) recorded), so the
    /// link runs up to a ring ahead across the forwards' boundary too. A forward whose
    /// stretches differ — link-bound blocks first, compute-bound ones last, as a 4-bit
    /// FLUX.1-dev's double and single blocks — then starts with its first units on the
    /// device instead of waiting for them.
    fn issue_ahead(&mut self) -> Result<()> {
        if !self.ahead {
            return Ok(());
        }
        loop {
            let Some(ring) = self.ring.as_mut() else {
                return Ok(());
            };
            let (next, blockers) = ring.next.get_or_insert_with(|| {
                let next = self.placement.next(&self.unit_sizes);
                let mut blockers = self.placement.ahead_blockers(&self.unit_sizes, &next);
                blockers.truncate(self.ahead_limit);
                (next, blockers)
            });
            let v = ring.ahead.units;
            if v >= blockers.len() {
                return Ok(());
            }
            let Some(used) = ring.used[blockers[v]].as_ref() else {
                return Ok(());
            };
            let at = next.offsets[v];
            self.device.wait_event(&self.copy, used)?;
            let unit = &self.layout.units()[v];
            let (copies, bytes) = copy_pinned(
                &*self.device,
                &self.metrics,
                &self.copy,
                self.host.as_ref(),
                (v, unit.bytes),
                &ring.buffer,
                at,
            )?;
            if copies == 0 {
                return Ok(());
            }
            ring.next_ready
                .push(Some(self.device.record_event(&self.copy)?));
            ring.ahead.add(AheadCopies {
                units: 1,
                bytes,
                copies,
            });
        }
    }

    /// Units copied ahead, during a forward, for the forward after it (see
    /// [`StreamingEngine::end_forward`]), over the engine's life.
    pub fn units_copied_ahead(&self) -> u64 {
        self.copied_ahead
    }

    /// Whether the engine holds the ring kept from the last forward (from a phase's second
    /// forward on, until the phase ends; see [`StreamingEngine::end_forward`]).
    pub fn keeps_ring(&self) -> bool {
        self.kept.is_some()
    }

    /// Bytes and copies made ahead that no forward has used yet: those in the ring kept for
    /// the next forward, and those for a next forward that never ran (the phase ended, or a
    /// forward was aborted), over the engine's life. The route's metrics count them beyond
    /// each forward's own streamed bytes and copies.
    pub fn copied_ahead_unconsumed(&self) -> (u64, u64) {
        let mut all = self.ahead_unused;
        if let Some(k) = &self.kept {
            all.add(k.ahead);
        }
        (all.bytes, all.copies)
    }

    /// Queues unit `u`'s copy, then the resident params of the first forward that compute
    /// needs before the next unit.
    fn issue(&mut self, u: usize) -> Result<()> {
        self.issue_unit(u)?;
        let next = self
            .layout
            .units()
            .get(u + 1)
            .map_or(usize::MAX, |n| n.first);
        self.queue_residents_before(next)
    }

    /// Queues, on the copy stream, every batch of the first upload whose position is below
    /// `limit`, recording an event after each; once the last is queued, the registered
    /// ranges only resident params needed are let go.
    pub(super) fn queue_residents_before(&mut self, limit: usize) -> Result<()> {
        let Some(upload) = self.upload.as_mut() else {
            return Ok(());
        };
        let total = self.resident_at.len();
        if upload.next_queue >= total {
            return Ok(());
        }
        let started = Instant::now();
        let host = self.host.as_ref();
        while upload.next_queue < total && self.resident_at[upload.next_queue].0 < limit {
            let i = upload.next_queue;
            self.resident.acquire(
                &*self.device,
                &self.resident_at[i].1,
                &|p: &Param| resident_source(host, p),
                &self.copy,
                &self.metrics,
            )?;
            upload.ready[i] = Some(self.device.record_event(&self.copy)?);
            upload.next_queue = i + 1;
            // Issue 35: the batch's file pages leave the process as soon as its copies are
            // queued, so an upload holds one batch's pages at a time, not the resident
            // part's. Advice only: a copy that has yet to read them faults them back in
            // from the page cache or the file (the bytes stay readable).
            for p in &self.resident_at[i].1 {
                match p.host().release_pages() {
                    0 if p.host().mapped_range().is_some() => upload.pages_kept.push(Arc::clone(p)),
                    n => self.figures.host_bytes_released += n,
                }
            }
        }
        upload.queued += started.elapsed();
        if upload.next_queue == total {
            self.metrics
                .record_resident_upload(upload.queued, std::time::Duration::ZERO);
            self.release_resident_registrations()?;
        }
        Ok(())
    }

    /// Compute waits for the first upload's batches up to position `pos` (queueing any
    /// not queued yet: a forward never reads a resident param before its copy).
    fn wait_residents(&mut self, pos: usize) -> Result<()> {
        let Some(upload) = self.upload.as_ref() else {
            return Ok(());
        };
        let (next_wait, next_queue) = (upload.next_wait, upload.next_queue);
        let upto = next_wait + self.resident_at[next_wait..].partition_point(|(at, _)| *at <= pos);
        if upto == next_wait {
            return Ok(());
        }
        if upto > next_queue {
            self.queue_residents_before(pos + 1)?;
        }
        let Some(upload) = self.upload.as_mut() else {
            return Ok(());
        };
        for i in next_wait..upto {
            if let Some(ev) = upload.ready[i].take() {
                self.device.wait_event(&self.compute, &ev)?;
            }
        }
        upload.next_wait = upto;
        Ok(())
    }

    /// Queues unit `u`'s copy into its place, behind the last use of the bytes it
    /// overwrites.
    fn issue_unit(&mut self, u: usize) -> Result<()> {
        let Some(ring) = self.ring.as_mut() else {
            return Ok(());
        };
        let unit = &self.layout.units()[u];
        // Coded units: the decode writes the ring, so it is the decode that waits.
        let writer = self.decode.as_ref().unwrap_or(&self.copy);
        match self.placement.blockers[u] {
            Some(b) => {
                if let Some(ev) = ring.used[b].as_ref() {
                    self.device.wait_event(writer, ev)?;
                }
            }
            // Bytes no earlier unit of this forward used: in a kept ring, the last forward's
            // units may still read them (the writer's later copies queue behind this wait).
            None => {
                if let Some(ev) = ring.prior_use.take() {
                    self.device.wait_event(writer, &ev)?;
                }
            }
        }
        if let Some(t) = ring.trace.as_mut() {
            t.copy_start[u] = Some(self.device.record_timed_event(&self.copy)?);
        }
        let dst_base = self.placement.offsets[u];
        match self.host.as_mut() {
            Some(Host::Coded { home, units }) => {
                let coded_base = self.figures.decoded_ring_bytes();
                let coded_slot = crate::streaming::coded_slot_bytes(self.figures.slot_bytes);
                let scratch_at = scratch_offset(&self.figures);
                let coded_unit = &units[u];
                let decode = self.decode.as_ref().ok_or_else(|| CoreError::Backend {
                    device: self.device.id().to_string(),
                    message: "streaming engine: coded units without a decode stream".into(),
                })?;
                let cs = u % CODED_SLOTS as usize;
                if let Some(ev) = ring.coded_used[cs].take() {
                    self.device.wait_event(&self.copy, &ev)?;
                }
                let len = coded_unit.len;
                let src = home.slice(coded_unit.at as usize, len as usize)?;
                let at = coded_base + cs as u64 * coded_slot;
                let coded = ring.buffer.slice(at as usize, len as usize)?;
                self.device.copy_h2d(&src, &coded, &self.copy)?;
                self.metrics.record_h2d(len);
                let copied = self.device.record_event(&self.copy)?;
                self.device.wait_event(decode, &copied)?;
                let scratch = ring.buffer.slice(scratch_at as usize, 16)?;
                // One decode per piece: the unit coded whole, or its params read coded
                // from their files and the runs of others coded at build.
                for piece in &coded_unit.pieces {
                    let (h, p_at) = (&piece.header, piece.at as usize);
                    let piece_src = ring
                        .buffer
                        .slice(at as usize + p_at, h.encoded_len() as usize)?;
                    let dst = ring
                        .buffer
                        .slice((dst_base + piece.dst) as usize, h.decoded_len() as usize)?;
                    self.device
                        .decode_lossless(h, &piece_src, &dst, &scratch, decode)?;
                }
                ring.coded_used[cs] = Some(self.device.record_event(decode)?);
            }
            Some(Host::Staged {
                buffers,
                last_copy,
                next,
                reader,
            }) => {
                copy_staged(
                    &*self.device,
                    &self.metrics,
                    &self.copy,
                    (u, unit),
                    (buffers, last_copy, next, reader),
                    &ring.buffer,
                    dst_base,
                )?;
            }
            Some(Host::Registered {
                staged: Some(staged),
                ..
            }) if u >= staged.from => {
                copy_staged(
                    &*self.device,
                    &self.metrics,
                    &self.copy,
                    (u, unit),
                    (
                        &staged.buffers,
                        &mut staged.last_copy,
                        &mut staged.next,
                        &mut staged.reader,
                    ),
                    &ring.buffer,
                    dst_base,
                )?;
            }
            host @ (Some(Host::Home { .. }) | Some(Host::Registered { .. })) => {
                copy_pinned(
                    &*self.device,
                    &self.metrics,
                    &self.copy,
                    host.map(|h| &*h),
                    (u, unit.bytes),
                    &ring.buffer,
                    dst_base,
                )?;
            }
            None => {}
        }
        let writer = self.decode.as_ref().unwrap_or(&self.copy);
        let ready = match ring.trace.as_mut() {
            Some(t) => {
                let e = self.device.record_timed_event(writer)?;
                t.copy_end[u] = Some(e.clone());
                e
            }
            None => self.device.record_event(writer)?,
        };
        ring.ready[u] = Some(ready);
        Ok(())
    }

    /// Schedule position `pos` starts: when it opens a unit, compute waits for that unit's
    /// copy; params with several locations are pointed at this position's copy.
    pub fn enter(&mut self, pos: usize) -> Result<()> {
        self.wait_residents(pos)?;
        let Some(ring) = self.ring.as_mut() else {
            return Ok(());
        };
        if let Some(u) = self.layout.unit_of(pos)
            && self.layout.units()[u].first == pos
        {
            if let Some(t) = ring.trace.as_mut() {
                t.host_enter[u] = Some(t.host_entry.elapsed());
            }
            match ring.ready[u].take() {
                Some(ev) => {
                    self.device.wait_event(&self.compute, &ev)?;
                    ring.entered += 1;
                    if let Some(t) = ring.trace.as_mut() {
                        t.compute_start[u] = Some(self.device.record_timed_event(&self.compute)?);
                    }
                }
                None => {
                    return Err(CoreError::Backend {
                        device: self.device.id().to_string(),
                        message: format!(
                            "streaming engine: unit {u} entered out of order (position {pos}); \
                             the route must follow the schedule or abort"
                        ),
                    });
                }
            }
        }
        for f in self.layout.fixups(pos) {
            let at = self.placement.offsets[f.unit] + f.offset;
            f.param
                .set_device(Some(ring.buffer.slice(at as usize, f.param.nbytes())?))?;
        }
        Ok(())
    }

    /// Schedule position `pos` ended: when it closes a unit, compute records the unit's
    /// use event and every unit waiting for those bytes is queued.
    pub fn leave(&mut self, pos: usize) -> Result<()> {
        let Some(ring) = self.ring.as_mut() else {
            return Ok(());
        };
        let Some(u) = self.layout.unit_of(pos) else {
            return Ok(());
        };
        if self.layout.units()[u].last != pos {
            return Ok(());
        }
        let used = match ring.trace.as_mut() {
            Some(t) => {
                let e = self.device.record_timed_event(&self.compute)?;
                t.compute_end[u] = Some(e.clone());
                e
            }
            None => self.device.record_event(&self.compute)?,
        };
        ring.used[u] = Some(used);
        self.issue_ready()
    }

    /// Ends a forward that entered every unit: the ring goes back in stream order behind
    /// compute and the streamed params are host-only again. A forward that did not enter
    /// every unit is aborted instead (copies still queued are waited for).
    ///
    /// With [`StreamingConfig::copy_ahead`], from a phase's second forward on (a component
    /// run in a loop: denoising steps, a bench's forwards), the ring is kept for the next
    /// forward instead, its leading units
    /// copied into it ahead while this forward's last units ran
    /// ([`StreamingEngine::units_copied_ahead`]); [`StreamingEngine::release_device`] (the
    /// phase's end) or [`StreamingEngine::abort`] lets it go once those copies are done. A
    /// component run once a phase never holds it between forwards.
    pub fn end_forward(&mut self) -> Result<()> {
        if self.upload_unfinished() {
            // A forward that did not reach every resident position: start over next time.
            return self.abort();
        }
        if let Some(upload) = self.upload.take() {
            // The resident params are on the device now: the file pages kept while their
            // copies were queued leave the process too (issue 35: a resident part needs no
            // host copy; the bytes stay readable, from the page cache or the file, if a
            // later attach needs them).
            self.figures.host_bytes_released += upload
                .pages_kept
                .iter()
                .map(|p| p.host().release_pages())
                .sum::<u64>();
        }
        let Some(ring) = self.ring.take() else {
            self.active = false;
            return Ok(());
        };
        if ring.entered < self.layout.units().len() {
            self.ring = Some(ring);
            return self.abort();
        }
        self.active = false;
        self.completed += 1;
        self.clear_streamed_pointers();
        if self.ahead {
            // Kept: the next forward's copies into it wait for this forward's last use.
            let last_use = self.device.record_event(&self.compute)?;
            self.copied_ahead += ring.ahead.units as u64;
            let placement = Arc::new(match ring.next {
                Some((next, _)) => next,
                None => self.placement.next(&self.unit_sizes),
            });
            self.kept = Some(KeptRing {
                buffer: ring.buffer,
                ready: ring.next_ready,
                ahead: ring.ahead,
                last_use,
                placement,
            });
            return Ok(());
        }
        if let Some(trace) = &ring.trace {
            let end = self.device.record_timed_event(&self.compute)?;
            let host_forward = trace.host_entry.elapsed();
            if let Some(mut t) =
                trace.timeline(&*self.device, &self.layout, &self.placement.blockers, &end)?
            {
                t.host_begin_ns = i64::try_from(trace.host_begin.as_nanos()).unwrap_or(i64::MAX);
                t.host_forward_ns = i64::try_from(host_forward.as_nanos()).unwrap_or(i64::MAX);
                self.metrics.set_timeline(t);
            }
        }
        let checked = match &self.decode {
            Some(decode) => {
                let at = scratch_offset(&self.figures);
                ring.buffer
                    .slice(at as usize, 16)
                    .and_then(|scratch| self.device.check_lossless(&scratch, decode))
            }
            None => Ok(()),
        };
        let released = self.device.release_after(ring.buffer, &self.compute);
        checked.and(released)
    }

    /// Waits for the decode stream, where there is one.
    pub(super) fn synchronize_decode(&self) -> Result<()> {
        self.decode
            .as_ref()
            .map_or(Ok(()), |d| self.device.synchronize_stream(d))
    }

    /// The timeline of a traced forward that ended at `end` (waits for its events), or
    /// `None` where the device keeps no timestamps.
    pub(super) fn clear_streamed_pointers(&self) {
        for (p, _, _) in self.layout.single_location() {
            // Clearing a device copy cannot fail.
            let _ = p.set_device(None);
        }
        for pos in 0..self.layout.units().last().map_or(0, |u| u.last + 1) {
            for f in self.layout.fixups(pos) {
                let _ = f.param.set_device(None);
            }
        }
    }
}

/// Queues on `copy` the copy of unit `u` (`bytes` long) into `ring` at `dst_base` from
/// pinned memory: its slot image in a pinned home, or its runs from the registered
/// mappings (and the home of unmapped params); returns the copies and bytes queued (none for
/// a host side of another kind).
fn copy_pinned(
    device: &dyn Device,
    metrics: &RouteMetrics,
    copy: &Stream,
    host: Option<&Host>,
    (u, bytes): (usize, u64),
    ring: &DeviceBuffer,
    dst_base: u64,
) -> Result<(u64, u64)> {
    match host {
        Some(Host::Home { home, unit_offsets }) => {
            let src = home.slice(unit_offsets[u], bytes)?;
            let dst = ring.slice(dst_base as usize, bytes as usize)?;
            device.copy_h2d(&src, &dst, copy)?;
            metrics.record_h2d(bytes);
            Ok((1, bytes))
        }
        Some(Host::Registered {
            sources,
            home,
            runs,
            ..
        }) => {
            for run in &runs[u] {
                let src = match run.source {
                    RunSource::Registered { source, offset } => {
                        sources[source].slice(offset as usize, run.len as usize)?
                    }
                    RunSource::Home { offset } => match home {
                        Some(home) => home.slice(offset, run.len)?,
                        None => {
                            return Err(CoreError::Backend {
                                device: device.id().to_string(),
                                message:
                                    "streaming engine: a run reads a pinned home that was not built"
                                        .into(),
                            });
                        }
                    },
                };
                let dst = ring.slice((dst_base + run.dst) as usize, run.len as usize)?;
                device.copy_h2d(&src, &dst, copy)?;
                metrics.record_h2d(run.len);
            }
            Ok((runs[u].len() as u64, runs[u].iter().map(|r| r.len).sum()))
        }
        _ => Ok((0, 0)),
    }
}

/// Copies unit `u` into the ring at `dst_base` through the staging buffers: each chunk is
/// written by the host from the params' own bytes into the next buffer
/// ([`StagedReader::fill`], the units after it read ahead), once the copy that last read
/// that buffer is done, then copied on `copy`; past the page cache limit the unit's pages
/// go back once written.
fn copy_staged(
    device: &dyn Device,
    metrics: &RouteMetrics,
    copy: &Stream,
    (u, unit): (usize, &crate::streaming::TransferUnit),
    (buffers, last_copy, next, reader): (
        &[HostBuffer],
        &mut [Option<Event>],
        &mut usize,
        &mut StagedReader,
    ),
    ring: &DeviceBuffer,
    dst_base: u64,
) -> Result<()> {
    reader.read_ahead(u);
    let chunk = buffers[0].len() as u64;
    let mut at = 0u64;
    while at < unit.bytes {
        let n = chunk.min(unit.bytes - at);
        let b = *next;
        *next = (*next + 1) % buffers.len();
        if let Some(ev) = last_copy[b].take() {
            // The copy that last read this staging buffer must be done before the host
            // writes it again.
            let started = Instant::now();
            device.synchronize_event(&ev)?;
            metrics.record_copy_wait(started.elapsed());
        }
        let staging = &buffers[b];
        staging.with_bytes_mut(|dst| reader.fill(u, &mut dst[..n as usize], unit, at))??;
        let src = staging.slice(0, n as usize)?;
        let dst = ring.slice((dst_base + at) as usize, n as usize)?;
        device.copy_h2d(&src, &dst, copy)?;
        metrics.record_h2d(n);
        last_copy[b] = Some(device.record_event(copy)?);
        at += n;
    }
    reader.done(u);
    Ok(())
}
