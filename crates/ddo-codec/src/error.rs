//! The crate's one error enum, [`CodecError`]: everything encoding or decoding a unit can
//! refuse. Every variant says what to do; a decode error means the unit's bytes are not
//! what the encoder wrote, so the remedy is to encode the weights again.

use thiserror::Error;

/// Result alias for the codec.
pub type Result<T, E = CodecError> = std::result::Result<T, E>;

/// What the encoder or the decoder refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The input to the encoder is not a whole number of bf16 words.
    #[error(
        "a unit of bf16 weights must be a whole number of 2-byte words, got {bytes} bytes; \
         encode whole tensors (or pad a unit to an even length)"
    )]
    OddLength {
        /// Length of the input in bytes.
        bytes: usize,
    },
    /// A unit too large for this platform's address space or for the format's 64-bit fields.
    #[error(
        "a unit of {words} words is too large to encode or decode here; split it into smaller units"
    )]
    TooLarge {
        /// Words in the unit.
        words: u64,
    },
    /// The encoded bytes end before the unit does (a short read, a cut-off file).
    #[error(
        "encoded unit truncated: {needed} bytes needed, {got} given; read the whole unit \
         (its length is in its header) or encode the weights again"
    )]
    Truncated {
        /// Bytes the header (or the fixed header size) calls for.
        needed: u64,
        /// Bytes given.
        got: u64,
    },
    /// More bytes were given than the unit's header says it has.
    #[error(
        "encoded unit is {got} bytes but its header says {expected}; pass exactly one unit \
         (split concatenated units by the length in each header)"
    )]
    TrailingBytes {
        /// Length from the header.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// The bytes do not start with the codec's magic.
    #[error(
        "not an encoded unit (magic {found:02x?}, expected \"DDOC\"); pass the encoder's output"
    )]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A format version this decoder does not read.
    #[error(
        "encoded unit has format version {found}, this decoder reads version {supported}; encode the weights again with this build"
    )]
    UnsupportedVersion {
        /// Version in the header.
        found: u16,
        /// The version this build reads and writes.
        supported: u16,
    },
    /// A header field disagrees with the layout the other fields imply.
    #[error("corrupt unit header: {field} {reason}; encode the weights again")]
    BadHeader {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The code table (or the decode table built from it) is not a valid prefix code.
    #[error("corrupt code table: {reason}; encode the weights again")]
    BadTable {
        /// What is wrong with it.
        reason: String,
    },
    /// The metadata (header, tables, chunk offsets) does not hash to the value the header holds.
    #[error(
        "unit metadata does not match its hash (stored {stored:#018x}, computed {computed:#018x}): the unit is corrupt; encode the weights again"
    )]
    MetadataHashMismatch {
        /// Hash in the header.
        stored: u64,
        /// Hash of the bytes given.
        computed: u64,
    },
    /// A padding byte between or after sections is not zero.
    #[error("corrupt unit: padding byte at offset {offset} is not zero; encode the weights again")]
    NonZeroPadding {
        /// Offset of the byte in the unit.
        offset: u64,
    },
    /// The output buffer's length is not the unit's decoded length.
    #[error(
        "output buffer is {got} bytes, the unit decodes to {expected}; size it by `decoded_len`"
    )]
    OutputSize {
        /// Decoded bytes of the unit.
        expected: u64,
        /// Bytes of the buffer given.
        got: u64,
    },
    /// The entropy-coded exponents of a chunk do not decode cleanly.
    #[error("corrupt exponent stream in chunk {chunk}: {reason}; encode the weights again")]
    CorruptStream {
        /// The chunk (of `CHUNK_WORDS` words).
        chunk: u64,
        /// What went wrong.
        reason: &'static str,
    },
    /// The decoded words do not hash to the checksum the encoder stored: the output is
    /// wrong and must not be used.
    #[error(
        "decoded unit does not match its checksum (stored {stored:#018x}, computed {computed:#018x}): the unit is corrupt and the output buffer holds garbage; encode the weights again"
    )]
    ChecksumMismatch {
        /// Checksum in the header.
        stored: u64,
        /// Checksum of what was decoded.
        computed: u64,
    },
    /// Reading or writing a cache file of coded units ([`crate::cache`]) failed at the
    /// file system (not a stale or corrupt cache: those are [`crate::cache::CacheLookup`]s).
    #[error(
        "coded-unit cache {path}: {op} failed: {message}; make its directory writable or free \
         room on its disk (until then the units are coded at every attach, with no cache)"
    )]
    CacheIo {
        /// The cache file (or its temporary file).
        path: std::path::PathBuf,
        /// What was being done: "open", "create", "write", "sync", "rename", "read".
        op: &'static str,
        /// The operating system's message.
        message: String,
    },
    /// Something that DDO does not replace is at the cache's path: a file that is not a DDO
    /// cache (no `DDOCACHE` magic), a read-only file, a directory, a FIFO, a device, a
    /// symbolic link. Nothing was written and it is left as it is.
    #[error(
        "coded-unit cache {path}: {reason}; DDO leaves it as it is (the units are coded at \
         every attach, with no cache): remove or rename it to let DDO keep its cache there"
    )]
    CacheRefused {
        /// The cache's path.
        path: std::path::PathBuf,
        /// What is there.
        reason: String,
    },
}
