//! Coded tensors in a checkpoint mapping ([`CodedSource`]): a `ddo convert --compress
//! lossless` unit, decoded on the host where it is read, copied as it is where it streams.

use std::sync::Arc;

use super::{AlignedBytes, CheckpointMap};
use crate::error::{CoreError, Result};

/// A coded tensor's unit in a checkpoint mapping (a `ddo convert --compress lossless`
/// file): what a [`HostBuffer::coded`](super::HostBuffer::coded) decodes where it is read, and what coded streaming
/// copies as it is.
#[derive(Debug, Clone)]
pub struct CodedSource {
    /// The file's mapping.
    pub map: Arc<CheckpointMap>,
    /// The tensor's name, for errors.
    pub name: String,
    /// Where the unit starts in the mapping.
    pub offset: usize,
    /// The unit's (coded) length.
    pub len: usize,
    /// Its validated header.
    pub header: Arc<ddo_codec::UnitHeader>,
}

impl CodedSource {
    /// The unit's coded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map.bytes()[self.offset..self.offset + self.len]
    }

    /// Decodes the unit on up to [`CODED_DECODE_THREADS`] threads, its checksum verified.
    /// Errors: no memory for the decoded bytes, or a unit that does not decode (the file
    /// changed or is corrupt), naming the file and the tensor.
    pub fn decode(&self) -> Result<AlignedBytes> {
        let mut out = AlignedBytes::try_zeroed(self.header.decoded_len() as usize)?;
        self.decode_into(out.as_mut_slice())?;
        Ok(out)
    }

    /// [`CodedSource::decode`] into `out` (exactly the decoded length: a backend's pinned
    /// upload buffer, say). After an error `out` holds garbage.
    pub fn decode_into(&self, out: &mut [u8]) -> Result<()> {
        // The unit and the file's next CODED_READ_AHEAD bytes behind it (the tensors a
        // loader reads next, in file order) are read ahead on the read-ahead thread: the
        // decoding threads fault in pages on their way, and the disk keeps reading while
        // this tensor decodes and copies.
        self.map
            .read_ahead(self.offset, self.len.saturating_add(CODED_READ_AHEAD));
        self.decode_in_place(out)
    }

    /// [`CodedSource::decode_into`] without the file-order read-ahead: for a reader that
    /// reads ahead in an order of its own (the staged units of a forward, in schedule
    /// order), where the next tensors in the file may be ones a later forward needs, or
    /// ones whose pages it has just given back.
    pub fn decode_in_place(&self, out: &mut [u8]) -> Result<()> {
        self.decode_from(self.bytes(), out)
    }

    /// [`CodedSource::decode_in_place`] of the unit read with `pread` into `scratch` on up
    /// to `readers` threads (its pages never mapped into the process): the disk tier, where
    /// page faults on the mapping would read the file a few pages a request. `scratch` grows
    /// to the unit's length and is kept for the next unit.
    pub fn read_decode_into(
        &self,
        scratch: &mut Vec<u8>,
        readers: usize,
        out: &mut [u8],
    ) -> Result<()> {
        if !self.map.is_file() {
            return self.decode_in_place(out);
        }
        scratch.resize(self.len, 0);
        let per = self.len.div_ceil(readers.max(1)).max(1 << 20);
        std::thread::scope(|s| {
            let parts: Vec<_> = scratch
                .chunks_mut(per)
                .enumerate()
                .map(|(i, part)| {
                    let at = self.offset + i * per;
                    s.spawn(move || self.map.read_at(at, part))
                })
                .collect();
            parts.into_iter().try_for_each(|p| {
                p.join().unwrap_or_else(|_| {
                    Err(CoreError::Checkpoint {
                        path: self.map.path().to_path_buf(),
                        message: "a read thread panicked".into(),
                    })
                })
            })
        })?;
        self.decode_from(scratch, out)
    }

    /// Decodes `encoded` (this unit's bytes, wherever they were read) into `out`.
    fn decode_from(&self, encoded: &[u8], out: &mut [u8]) -> Result<()> {
        let len = out.len();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(CODED_DECODE_THREADS)
            .min(len.div_ceil(1 << 20).max(1));
        ddo_codec::decode_unit_parallel(encoded, out, threads).map_err(|e| CoreError::Checkpoint {
            path: self.map.path().to_path_buf(),
            message: format!(
                "coded tensor `{}` does not decode ({e}): the file changed or is corrupt; \
                     convert the folder again with ddo convert --compress lossless",
                self.name
            ),
        })
    }
}

/// Bytes of a coded file read ahead past a tensor decoded on the host
/// ([`CodedSource::decode`]).
pub const CODED_READ_AHEAD: usize = 512 << 20;

/// Most threads one coded tensor is decoded on where it is read on the host.
pub const CODED_DECODE_THREADS: usize = 16;

/// The 16-bit word a coded tensor that fails to decode reads as through the infallible
/// [`HostBuffer::with_bytes`](super::HostBuffer::with_bytes): NaN in bf16 and f16 alike, so the model's non-finite checks
/// stop the run rather than an image of wrong weights (the copies go through
/// [`HostBuffer::try_with_bytes`](super::HostBuffer::try_with_bytes) and get the typed error).
pub const CODED_FAILURE_WORD: u16 = 0xffff;
