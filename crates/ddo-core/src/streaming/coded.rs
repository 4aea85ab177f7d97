//! The host side of lossless-coded streaming (`compress=lossless`,
//! [`StagingKind::Coded`](super::StagingKind::Coded)): the coded units' pinned home, built
//! once at attach by coding each transfer unit's slot image with `ddo_codec` on every core,
//! or read from the cache file beside the checkpoint.
//!
//! **One host copy.** The coded home is the streamed weights' host copy. Params mapped from
//! a checkpoint file keep pointing into the mapping (their bytes read the same), but their
//! pages are released from the process as soon as their unit is hashed or coded
//! ([`CheckpointMap::release_pages`]): the process holds the coded units, not the raw
//! weights beside them. Params made in memory (random or converted weights) keep their
//! bytes: releasing those pages would lose them.
//!
//! **The cache.** When every streamed param is mapped from checkpoint files (one file, or
//! the shards of a Diffusers folder), the coded units are kept in `<first file>.ddo-coded`
//! beside the first of those files in path order ([`coded_cache_path`], a file of
//! [`ddo_codec::cache`]). Its key is each file's name, size, modification time, device and
//! inode, then per unit its length and where each of its params lies (file, offset, length,
//! place in the unit): all from the files' metadata and headers, so a hit **reads no raw
//! byte** of the checkpoint (issue 35: a hit used to hash every raw unit, reading the 23.8 GB
//! transformer beside its 15.5 GB cache on a cold start). The files are trusted by size,
//! modification time and inode: a file replaced (a new inode) or touched is stale, one
//! rewritten in place keeping all three is not (the trade the issue asks for); each coded
//! unit's decoded checksum is still verified where it is decoded (the GPU kernel, the host
//! decoder). A valid cache is read straight into the pinned home
//! ([`ddo_codec::cache::OpenCache::read_into`], every unit checked); an absent, stale or
//! corrupt one is coded again and rewritten; where it cannot be read or written, the units
//! are coded with no cache and [`StreamingFigures::coded_cache_note`] says why.
//!
//! **What the cache never touches.** The cache path is never one of the checkpoint files
//! the units are coded from (compared by name, canonical path, and device and inode, so a
//! hard or symbolic link to a shard is caught): then there is no cache. Anything at the
//! path that is not a DDO cache (no `DDOCACHE` magic: a user's file, a shard; a read-only
//! file; a directory, a FIFO, a device, a symbolic link other than to a regular file) is
//! neither read further nor replaced, and opening never blocks (`ddo_codec::cache`'s
//! module docs): the units are coded without the cache and the note says what is there.
//!
//! **Coded files.** Where params are read coded from their files (`ddo convert --compress
//! lossless`: [`HostSlice::coded_source`](crate::HostSlice::coded_source)), no cache is
//! needed: each such param's unit is copied into the home as it is, the runs of other params
//! between them (biases, norms) are coded here, and a unit is the list of these pieces, each
//! decoded into its place in the slot (`CodedUnit`); a unit whose pieces would not fit a
//! coded slot is coded whole. `home_bound` bounds that home from the files and the layout
//! before anything is read.
//!
//! [`StreamingFigures::coded_cache_note`]: super::StreamingFigures::coded_cache_note

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use ddo_codec::UnitHeader;
use ddo_codec::cache::{CacheKey, Lookup};

use crate::device::Device;
use crate::error::{CoreError, Result};
use crate::host_memory::{CheckpointMap, CodedSource, HostBuffer};
use crate::streaming::figures::{CodedCache, nanos};
use crate::streaming::layout::{StagingLayout, TransferUnit};

/// The coded units in one pinned buffer: per unit, where its coded bytes lie and the coded
/// pieces they hold.
#[derive(Debug)]
pub(crate) struct CodedHome {
    pub(crate) home: HostBuffer,
    pub(crate) units: Vec<CodedUnit>,
}

/// One transfer unit's coded bytes in the home: one copy carries them, and each piece
/// decodes into its place in the unit's slot.
#[derive(Debug, Clone)]
pub(crate) struct CodedUnit {
    /// Where the unit's coded bytes start in the home (16-byte aligned).
    pub(crate) at: u64,
    /// Their length (the pieces, each 16-byte aligned).
    pub(crate) len: u64,
    /// The pieces, in slot order.
    pub(crate) pieces: Vec<CodedPiece>,
}

/// One coded unit of `ddo_codec`'s format inside a [`CodedUnit`]: the whole slot image (a
/// unit coded here), or one param read coded from its checkpoint file (`ddo convert
/// --compress lossless`), or a run of the other params coded here.
#[derive(Debug, Clone)]
pub(crate) struct CodedPiece {
    /// Where it starts in the unit's coded bytes (16-byte aligned).
    pub(crate) at: u64,
    /// Its validated header.
    pub(crate) header: UnitHeader,
    /// Where its decoded bytes go in the unit's slot.
    pub(crate) dst: u64,
}

impl CodedUnit {
    /// A unit coded whole: one piece at its start.
    fn whole(at: u64, header: UnitHeader) -> Self {
        Self {
            at,
            len: header.encoded_len(),
            pieces: vec![CodedPiece {
                at: 0,
                header,
                dst: 0,
            }],
        }
    }
}

/// What [`build`] made.
pub(crate) struct BuiltCoded {
    pub(crate) home: CodedHome,
    pub(crate) coded_bytes: u64,
    pub(crate) entropy_millibits: u64,
    pub(crate) cache: CodedCache,
    pub(crate) coding_ns: u64,
    pub(crate) note: Option<String>,
    /// The cache file's path, where the params are mapped from files (used or not).
    pub(crate) cache_path: Option<PathBuf>,
    /// Bytes of the streamed params' file pages released from the process.
    pub(crate) released: u64,
}

/// The cache file of a checkpoint's coded units: `<checkpoint>.ddo-coded`, beside it (for a
/// sharded checkpoint, beside its first file in path order).
pub fn coded_cache_path(checkpoint: &Path) -> PathBuf {
    let mut name = checkpoint.as_os_str().to_os_string();
    name.push(".ddo-coded");
    name.into()
}

/// A unit's slot image: its params at their offsets, zeros between.
fn slot_image(unit: &TransferUnit, image: &mut Vec<u8>) {
    image.clear();
    image.resize(unit.bytes as usize, 0u8);
    for e in &unit.entries {
        let at = e.offset as usize;
        e.param.host().with_bytes(|src| {
            image[at..at + e.len as usize].copy_from_slice(src);
        });
    }
}

/// Releases the process's pages of the unit's params that are mapped from a file; returns
/// the bytes released.
fn release_unit_pages(unit: &TransferUnit) -> u64 {
    unit.entries
        .iter()
        .map(|e| e.param.host().release_pages())
        .sum()
}

/// Runs `work` over every unit on every core (units handed out one at a time); returns the
/// results in unit order, or the first error.
fn per_unit<T: Send>(
    units: &[TransferUnit],
    device: &dyn Device,
    work: impl Fn(usize, &TransferUnit, &mut Vec<u8>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(units.len().max(1));
    let next = AtomicUsize::new(0);
    let parts: Vec<Result<Vec<(usize, T)>>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<Vec<(usize, T)>> {
                    let mut done = Vec::new();
                    let mut image = Vec::new();
                    loop {
                        let u = next.fetch_add(1, Ordering::Relaxed);
                        let Some(unit) = units.get(u) else {
                            return Ok(done);
                        };
                        done.push((u, work(u, unit, &mut image)?));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| {
                    Err(CoreError::Backend {
                        device: device.id().to_string(),
                        message: "a coding thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut all = Vec::with_capacity(units.len());
    for part in parts {
        all.extend(part?);
    }
    all.sort_by_key(|(u, _)| *u);
    Ok(all.into_iter().map(|(_, t)| t).collect())
}

/// The checkpoint files every streamed param is mapped from, in path order, or why the
/// units cannot be cached.
fn cache_sources(layout: &StagingLayout) -> std::result::Result<Vec<Arc<CheckpointMap>>, String> {
    let mut files: Vec<Arc<CheckpointMap>> = Vec::new();
    for unit in layout.units() {
        for e in &unit.entries {
            let host = e.param.host();
            let Some((map, _)) = host.mapped_range() else {
                return Err(format!(
                    "param `{}` is not mapped from a checkpoint file",
                    e.param.name()
                ));
            };
            if !map.is_file() {
                return Err(
                    "the weights were made in memory (random or converted), not mapped from a file"
                        .into(),
                );
            }
            if !files.iter().any(|f| Arc::ptr_eq(f, map)) {
                files.push(Arc::clone(map));
            }
        }
    }
    if files.is_empty() {
        return Err("no streamed params".into());
    }
    files.sort_by(|a, b| a.path().cmp(b.path()));
    Ok(files)
}

/// Why `path` may not hold the cache: it is one of the checkpoint `files` the units are
/// coded from, by name, by canonical path (a symbolic link to one) or by device and inode
/// (a hard link to one). DDO never writes the files it reads weights from.
fn is_an_input(path: &Path, files: &[Arc<CheckpointMap>]) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let (cache_id, cache_canonical) = (id(path), canonical(path));
    files.iter().find_map(|f| {
        let same = f.path() == path
            || cache_canonical.is_some() && canonical(f.path()) == cache_canonical
            || cache_id.is_some() && id(f.path()) == cache_id;
        same.then(|| {
            format!(
                "the cache path {} is the checkpoint file {} (the same file), which DDO only reads",
                path.display(),
                f.path().display()
            )
        })
    })
}

/// The cache key's first part: per source file its name, size, modification time, device
/// and inode.
fn files_key(files: &[Arc<CheckpointMap>]) -> std::result::Result<CacheKey, String> {
    use std::os::unix::fs::MetadataExt;
    let mut key = CacheKey::new();
    key.push_bytes(b"ddo-core streaming coded units, v3")
        .push_u64(files.len() as u64);
    for f in files {
        let path = f.path();
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .ok_or_else(|| format!("{}: no modification time", path.display()))?;
        let name = path
            .file_name()
            .map(|n| n.as_encoded_bytes())
            .unwrap_or_default();
        key.push_bytes(name)
            .push_u64(meta.len())
            .push_u64(mtime.as_secs())
            .push_u64(u64::from(mtime.subsec_nanos()))
            .push_u64(meta.dev())
            .push_u64(meta.ino());
    }
    Ok(key)
}

/// The cache key's second part: per unit its length and, per param in it, its file (index
/// in `files`), its range there and its offset in the unit. Read from the layout and the
/// mappings' ranges: no weight byte is touched.
fn push_units(key: &mut CacheKey, layout: &StagingLayout, files: &[Arc<CheckpointMap>]) {
    key.push_u64(layout.units().len() as u64);
    for unit in layout.units() {
        key.push_u64(unit.bytes).push_u64(unit.entries.len() as u64);
        for e in &unit.entries {
            let host = e.param.host();
            let (file, start) = host.mapped_range().map_or((u64::MAX, 0), |(map, range)| {
                let file = files.iter().position(|f| Arc::ptr_eq(f, map));
                (file.map_or(u64::MAX, |i| i as u64), range.start as u64)
            });
            key.push_u64(file)
                .push_u64(start)
                .push_u64(e.len)
                .push_u64(e.offset);
        }
    }
}

/// Builds the coded home of `layout`'s units (see the [module docs](self)): from a valid
/// cache, or by coding every unit's slot image on every core (then written to the cache
/// where there is one). Each unit starts 16-byte aligned (the decoders read sections at
/// that alignment). Errors: the coded units over `pinned_room`
/// ([`CoreError::CodedPinnedLimit`]), a unit the codec refuses, a device failure.
pub(crate) fn build(
    device: &dyn Device,
    layout: &StagingLayout,
    pinned_room: u64,
) -> Result<BuiltCoded> {
    if layout.units().iter().any(|u| {
        u.entries
            .iter()
            .any(|e| e.param.host().coded_source().is_some())
    }) {
        return build_from_sources(device, layout, pinned_room);
    }
    let started = Instant::now();
    let units = layout.units();
    let released = AtomicU64::new(0);
    // The key comes from the files' metadata and the layout alone: a hit reads no raw byte.
    let sources = cache_sources(layout);
    let cache_path = sources
        .as_ref()
        .ok()
        .map(|files| coded_cache_path(files[0].path()));
    let sources = sources.and_then(|files| {
        let path = coded_cache_path(files[0].path());
        if let Some(why) = is_an_input(&path, &files) {
            return Err(why);
        }
        let mut key = files_key(&files)?;
        push_units(&mut key, layout, &files);
        Ok((path, key))
    });
    let absent = matches!(&sources, Ok((path, _)) if std::fs::symlink_metadata(path)
        .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound));
    let cache = sources;
    let (cache, mut note) = match cache {
        Ok((path, key)) if absent => (Some((path, key)), Some("no cache file: rebuilt".into())),
        Ok((path, key)) => match ddo_codec::cache::open_cache(&path, &key) {
            Ok(Lookup::Hit(open)) if open.units() == units.len() => {
                match home_from_cache(device, open, layout, pinned_room)? {
                    Ok((home, entropy_millibits)) => {
                        // Whatever touched the raw pages before (nothing of the hit did),
                        // the process keeps none of them: advice only, no byte read.
                        let dropped: u64 = units.iter().map(release_unit_pages).sum();
                        released.fetch_add(dropped, Ordering::Relaxed);
                        let coded_bytes = home.units.iter().map(|u| u.len).sum();
                        return Ok(BuiltCoded {
                            home,
                            coded_bytes,
                            entropy_millibits,
                            cache: CodedCache::Used,
                            coding_ns: nanos(started.elapsed()),
                            note: None,
                            cache_path,
                            released: released.into_inner(),
                        });
                    }
                    Err(reason) => (
                        Some((path, key)),
                        Some(format!("corrupt: {reason}: rebuilt")),
                    ),
                }
            }
            Ok(Lookup::Hit(open)) => (
                Some((path, key)),
                Some(format!(
                    "cache holds {} units, the layout {}: rebuilt",
                    open.units(),
                    units.len()
                )),
            ),
            Ok(Lookup::NotACache(what)) => (
                None,
                Some(format!(
                    "coded without a cache: {} is {what}, not a DDO cache; DDO leaves it as it is: \
                     remove or rename it to let DDO keep its cache there",
                    path.display()
                )),
            ),
            Ok(miss) => (
                Some((path, key)),
                miss.reason().map(|r| format!("{r}: rebuilt")),
            ),
            Err(e) => (None, Some(format!("coded without a cache: {e}"))),
        },
        Err(reason) => (None, Some(format!("coded without a cache: {reason}"))),
    };
    // Coding reads every unit again (faulting released pages back in) and releases them
    // again: count them once.
    let code_all = || {
        released.store(0, Ordering::Relaxed);
        per_unit(units, device, |u, unit, image| {
            slot_image(unit, image);
            let mut out = Vec::new();
            let (header, stats) = ddo_codec::encode_unit_into(image, &mut out).map_err(|e| {
                CoreError::InvalidOption {
                    option: "compress".into(),
                    value: "lossless".into(),
                    hint: format!(
                        "unit {u} could not be coded ({e}): stream it with compress=none"
                    ),
                }
            })?;
            released.fetch_add(release_unit_pages(unit), Ordering::Relaxed);
            Ok((out, header, stats))
        })
    };
    let coded = code_all()?;
    let stats = ddo_codec::Stats::total(coded.iter().map(|c| &c.2));
    let entropy_millibits = (stats.exponent_entropy() * 1000.0).round() as u64;
    let mut state = CodedCache::Unavailable;
    if let Some((path, key)) = &cache {
        let bytes: Vec<&[u8]> = coded.iter().map(|c| c.0.as_slice()).collect();
        match ddo_codec::cache::write_cache(path, key, &entropy_millibits.to_le_bytes(), &bytes) {
            Ok(()) => state = CodedCache::Built,
            Err(e) => note = Some(format!("coded without a cache: {e}")),
        }
    }
    // With the cache written, the coded units go first and the home is read back from the
    // file (from the page cache, checked as any hit is): the process never holds the coded
    // units twice.
    let coded = match (state, &cache) {
        (CodedCache::Built, Some((path, key))) => {
            drop(coded);
            let back = match ddo_codec::cache::open_cache(path, key) {
                Ok(Lookup::Hit(open)) => home_from_cache(device, open, layout, pinned_room)?,
                Ok(miss) => Err(miss.reason().unwrap_or_default()),
                Err(e) => Err(e.to_string()),
            };
            match back {
                Ok((home, _)) => {
                    let coded_bytes = home.units.iter().map(|u| u.len).sum();
                    return Ok(BuiltCoded {
                        home,
                        coded_bytes,
                        entropy_millibits,
                        cache: state,
                        coding_ns: nanos(started.elapsed()),
                        note,
                        cache_path,
                        released: released.into_inner(),
                    });
                }
                Err(reason) => {
                    // Not seen in practice (the file was just written and synced): code
                    // again.
                    note = Some(format!(
                        "coded without a cache: the cache just written did not read back ({reason})"
                    ));
                    state = CodedCache::Unavailable;
                    code_all()?
                }
            }
        }
        _ => coded,
    };
    let mut built = finish(
        device,
        coded,
        pinned_room,
        entropy_millibits,
        state,
        note,
        started,
        &released,
    )?;
    built.cache_path = cache_path;
    Ok(built)
}

/// The coded home of units coded in memory.
#[allow(clippy::too_many_arguments)]
fn finish(
    device: &dyn Device,
    coded: Vec<Coded>,
    pinned_room: u64,
    entropy_millibits: u64,
    cache: CodedCache,
    note: Option<String>,
    started: Instant,
    released: &AtomicU64,
) -> Result<BuiltCoded> {
    let home = home_from_units(device, &coded, pinned_room)?;
    let coded_bytes = coded.iter().map(|c| c.1.encoded_len()).sum();
    Ok(BuiltCoded {
        home,
        coded_bytes,
        entropy_millibits,
        cache,
        coding_ns: nanos(started.elapsed()),
        note,
        cache_path: None,
        released: released.load(Ordering::Relaxed),
    })
}

/// A unit coded in memory: its bytes, header and statistics.
type Coded = (Vec<u8>, UnitHeader, ddo_codec::Stats);

/// The typed error for coded units over the pinned room (its hint names what works with
/// coded units: they need a pinned home, so staging without one is no way out).
fn over_pinned_room(device: &dyn Device, total: u64, pinned_room: u64) -> CoreError {
    let pinned = device.memory_info().pinned_host;
    CoreError::CodedPinnedLimit {
        requested: total,
        pinned,
        limit: pinned_room.saturating_add(pinned),
    }
}

/// The coded home's pinned buffer; the device's own refusal over its pinned limit is the
/// coded one ([`over_pinned_room`]'s hint).
fn alloc_coded_home(device: &dyn Device, bytes: u64) -> Result<HostBuffer> {
    device
        .alloc_pinned(bytes.max(1) as usize)
        .map_err(|e| match e {
            CoreError::PinnedLimit {
                requested,
                pinned,
                limit,
            } => CoreError::CodedPinnedLimit {
                requested,
                pinned,
                limit,
            },
            e => e,
        })
}

/// Copies coded units into one pinned buffer, each 16-byte aligned.
fn home_from_units(device: &dyn Device, coded: &[Coded], pinned_room: u64) -> Result<CodedHome> {
    let mut offsets = Vec::with_capacity(coded.len());
    let mut total = 0u64;
    for c in coded {
        offsets.push(total);
        total += (c.0.len() as u64).div_ceil(16) * 16;
    }
    if total > pinned_room {
        return Err(over_pinned_room(device, total, pinned_room));
    }
    let home = alloc_coded_home(device, total)?;
    home.with_bytes_mut(|dst| {
        for (c, &at) in coded.iter().zip(&offsets) {
            dst[at as usize..at as usize + c.0.len()].copy_from_slice(&c.0);
        }
    })?;
    let units = coded
        .iter()
        .zip(offsets)
        .map(|(c, at)| CodedUnit::whole(at, c.1.clone()))
        .collect();
    Ok(CodedHome { home, units })
}

/// Reads a cache whose header, key and index checked out straight into a pinned buffer
/// (its payload is laid out as [`home_from_units`] lays units out) and checks every unit,
/// and that each decodes to its unit's bytes. `Ok(Err(reason))`: the payload is corrupt
/// (the buffer is dropped, nothing used); `Err`: over the pinned room, or the file or the
/// device failed.
fn home_from_cache(
    device: &dyn Device,
    open: ddo_codec::cache::OpenCache,
    layout: &StagingLayout,
    pinned_room: u64,
) -> Result<std::result::Result<(CodedHome, u64), String>> {
    let total = open.payload_len();
    if total > pinned_room {
        return Err(over_pinned_room(device, total, pinned_room));
    }
    let entropy = open
        .extra()
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    let home = alloc_coded_home(device, total)?;
    let read = home.with_bytes_mut(|dst| open.read_into(&mut dst[..total as usize]))?;
    let units = match read {
        Ok(Ok(units)) => units,
        Ok(Err(reason)) => return Ok(Err(reason)),
        Err(e) => return Ok(Err(e.to_string())),
    };
    if let Some(u) = (0..units.len()).find(|&u| units[u].1.decoded_len() != layout.units()[u].bytes)
    {
        return Ok(Err(format!(
            "unit {u} decodes to {} bytes, the layout's unit is {}",
            units[u].1.decoded_len(),
            layout.units()[u].bytes
        )));
    }
    let units = units
        .into_iter()
        .map(|(at, header)| CodedUnit::whole(at, header))
        .collect();
    Ok(Ok((CodedHome { home, units }, entropy)))
}

/// What one piece of a unit is made of, planned before any byte is read.
enum PiecePlan {
    /// A param's coded unit, copied as it is from its file.
    Source(CodedSource),
    /// The slot image's bytes `start..end` (other params, zeros between), coded here.
    Run { start: u64, end: u64 },
}

/// The pieces of `unit`, each with where it decodes to in the slot: each param read coded
/// from its file on its own, the params between them in runs (a run's end rounded up to a
/// whole 16-bit word, inside the unit's aligned bytes).
fn plan_pieces(unit: &TransferUnit) -> Vec<(PiecePlan, u64)> {
    let mut out = Vec::new();
    let mut run: Option<(u64, u64)> = None;
    let flush = |run: &mut Option<(u64, u64)>, out: &mut Vec<(PiecePlan, u64)>| {
        if let Some((start, end)) = run.take() {
            let end = end.next_multiple_of(2).min(unit.bytes);
            out.push((PiecePlan::Run { start, end }, start));
        }
    };
    for e in &unit.entries {
        let host = e.param.host();
        match host.coded_source() {
            Some(c) => {
                flush(&mut run, &mut out);
                out.push((PiecePlan::Source(c.clone()), e.offset));
            }
            None => {
                let end = e.offset + e.len;
                run = Some(run.map_or((e.offset, end), |(start, _)| (start, end)));
            }
        }
    }
    flush(&mut run, &mut out);
    out
}

/// The slot image's bytes `start..end`: the params in that range at their offsets, zeros
/// between; a coded param that does not decode is the typed error.
fn run_image(unit: &TransferUnit, start: u64, end: u64, image: &mut Vec<u8>) -> Result<()> {
    image.clear();
    image.resize((end - start) as usize, 0u8);
    for e in &unit.entries {
        if e.offset >= start && e.offset + e.len <= end {
            let at = (e.offset - start) as usize;
            e.param.host().try_with_bytes(|src| {
                image[at..at + e.len as usize].copy_from_slice(src);
            })?;
        }
    }
    Ok(())
}

/// An upper bound of the coded home [`build`] makes of `layout`, read from the files and
/// the layout alone: each param read coded at its unit's length, each run of other params
/// at its bytes plus a header, and no unit over a coded slot.
pub(crate) fn home_bound(layout: &StagingLayout) -> u64 {
    // A unit is its pieces where they fit a coded slot, else coded whole: either way
    // within a coded slot.
    let coded_slot = crate::streaming::coded_slot_bytes(layout.slot_bytes());
    layout
        .units()
        .iter()
        .map(|unit| {
            let bound: u64 = plan_pieces(unit)
                .iter()
                .map(|(plan, _)| match plan {
                    PiecePlan::Source(c) => (c.len as u64).next_multiple_of(16),
                    PiecePlan::Run { start, end } => {
                        end - start + crate::streaming::CODED_PIECE_SLACK
                    }
                })
                .sum();
            bound.min(coded_slot)
        })
        .sum()
}

/// Codes `words` (one piece) or says why it cannot be.
fn code_piece(u: usize, words: &[u8]) -> Result<(Vec<u8>, UnitHeader)> {
    let mut out = Vec::new();
    let (header, _) =
        ddo_codec::encode_unit_into(words, &mut out).map_err(|e| CoreError::InvalidOption {
            option: "compress".into(),
            value: "lossless".into(),
            hint: format!("unit {u} could not be coded ({e}): stream it with compress=none"),
        })?;
    Ok((out, header))
}

/// A piece built: coded here (its bytes), or a param's unit to copy from its file.
enum BuiltPiece {
    Here(Vec<u8>, UnitHeader),
    Source(CodedSource),
}

impl BuiltPiece {
    fn len(&self) -> u64 {
        match self {
            BuiltPiece::Here(b, _) => b.len() as u64,
            BuiltPiece::Source(c) => c.len as u64,
        }
    }

    fn header(&self) -> &UnitHeader {
        match self {
            BuiltPiece::Here(_, h) => h,
            BuiltPiece::Source(c) => &c.header,
        }
    }
}

/// The coded home of a layout some of whose params are read coded from their files (a
/// `ddo convert --compress lossless` folder): those params' units are copied into the home
/// as they are (no decode, no coding: coding never falls inside a run), the params between
/// them are coded here in runs (biases, norms: small), and each unit decodes piece by piece.
/// A unit whose pieces would not fit a coded slot (each piece carries its own header and
/// tables) is coded whole from its slot image instead. No cache file: the sources are the
/// coded form.
fn build_from_sources(
    device: &dyn Device,
    layout: &StagingLayout,
    pinned_room: u64,
) -> Result<BuiltCoded> {
    let started = Instant::now();
    let units = layout.units();
    let coded_slot = crate::streaming::coded_slot_bytes(layout.slot_bytes());
    let built: Vec<Vec<(BuiltPiece, u64)>> = per_unit(units, device, |u, unit, image| {
        let mut pieces = Vec::new();
        for (plan, dst) in plan_pieces(unit) {
            pieces.push(match plan {
                PiecePlan::Source(c) => (BuiltPiece::Source(c), dst),
                PiecePlan::Run { start, end } => {
                    run_image(unit, start, end, image)?;
                    let (bytes, header) = code_piece(u, image)?;
                    (BuiltPiece::Here(bytes, header), dst)
                }
            });
        }
        let total: u64 = pieces
            .iter()
            .map(|(p, _)| p.len().next_multiple_of(16))
            .sum();
        if total > coded_slot {
            run_image(unit, 0, unit.bytes, image)?;
            let (bytes, header) = code_piece(u, image)?;
            pieces = vec![(BuiltPiece::Here(bytes, header), 0)];
        }
        Ok(pieces)
    })?;
    // Lay the units out: each piece 16-byte aligned inside its unit.
    let mut coded_units = Vec::with_capacity(built.len());
    let mut windows: Vec<(&BuiltPiece, usize, usize)> = Vec::new();
    let mut total = 0u64;
    for pieces in &built {
        let at = total;
        let mut list = Vec::with_capacity(pieces.len());
        for (piece, dst) in pieces {
            let p_at = total - at;
            windows.push((piece, total as usize, piece.len() as usize));
            list.push(CodedPiece {
                at: p_at,
                header: piece.header().clone(),
                dst: *dst,
            });
            total += piece.len().next_multiple_of(16);
        }
        coded_units.push(CodedUnit {
            at,
            len: total - at,
            pieces: list,
        });
    }
    if total > pinned_room {
        return Err(over_pinned_room(device, total, pinned_room));
    }
    let home = alloc_coded_home(device, total)?;
    let released = AtomicU64::new(0);
    home.with_bytes_mut(|dst| {
        crate::host_memory::fill_in_parallel(dst, &windows, |piece, out| {
            match piece {
                BuiltPiece::Here(bytes, _) => out.copy_from_slice(bytes),
                BuiltPiece::Source(c) => {
                    c.map.prefetch(c.offset..c.offset + c.len);
                    out.copy_from_slice(c.bytes());
                    // The home is the one host copy: the file's pages go.
                    released.fetch_add(
                        c.map.release_pages(c.offset..c.offset + c.len),
                        Ordering::Relaxed,
                    );
                }
            }
            Ok::<(), CoreError>(())
        })
    })??;
    let coded_bytes = coded_units.iter().map(|u| u.len).sum();
    Ok(BuiltCoded {
        home: CodedHome {
            home,
            units: coded_units,
        },
        coded_bytes,
        entropy_millibits: 0,
        cache: CodedCache::Sources,
        coding_ns: nanos(started.elapsed()),
        note: Some(
            "the weights are coded in their files (ddo convert --compress lossless): no cache"
                .into(),
        ),
        cache_path: None,
        released: released.into_inner(),
    })
}
