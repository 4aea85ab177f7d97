//! Bad checkpoints: property tests of `Checkpoint` (the safetensors header and data layout)
//! against generated valid files and targeted corruptions of them — header length beyond
//! the file or absurdly large, overlapping or out-of-range offsets, dtype/shape byte-count
//! mismatches, non-UTF-8 names, duplicate names, truncation — and arbitrary bytes. Each is
//! a typed `CoreError::Checkpoint` naming the file (and the tensor where one is at fault);
//! none panics, and no single allocation grows with what the header claims (a counting
//! allocator watches the largest request made by the test's own thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use ddo_core::{Checkpoint, CoreError};
use proptest::prelude::*;

/// The system allocator, recording the largest request of the current thread.
struct LargestRequest;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to `System` unchanged; the thread-local it touches is a
// `Cell<usize>` with a const initialiser, which never allocates.
unsafe impl GlobalAlloc for LargestRequest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(new_size)));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestRequest = LargestRequest;

/// Runs `f`, returning its result and the largest allocation it requested on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(Cell::get))
}

const PATH: &str = "/models/bad.safetensors";

fn check(bytes: &[u8]) -> Result<usize, CoreError> {
    Checkpoint::validate_bytes(bytes, Path::new(PATH))
}

/// The message of a `Checkpoint` error for `PATH`; anything else fails the test.
fn checkpoint_error(result: Result<usize, CoreError>) -> String {
    match result {
        Err(CoreError::Checkpoint { path, message }) => {
            assert_eq!(path, PathBuf::from(PATH));
            let shown = CoreError::Checkpoint {
                path,
                message: message.clone(),
            }
            .to_string();
            assert!(shown.contains(PATH), "{shown}");
            message
        }
        other => panic!("expected a Checkpoint error, got {other:?}"),
    }
}

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    dtype: &'static str,
    size: usize,
    shape: Vec<usize>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.size
    }
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        "[a-z]{1,6}(\\.[a-z0-9_]{1,6}){0,2}",
        prop::sample::select(vec![
            ("F32", 4usize),
            ("F16", 2),
            ("BF16", 2),
            ("U8", 1),
            ("I64", 8),
        ]),
        prop::collection::vec(1usize..5, 0..4),
    )
        .prop_map(|(name, (dtype, size), shape)| Entry {
            name,
            dtype,
            size,
            shape,
        })
}

/// Unique names; at least one tensor.
fn entries() -> impl Strategy<Value = Vec<Entry>> {
    prop::collection::vec(entry(), 1..6).prop_map(|mut v| {
        let mut seen = std::collections::BTreeSet::new();
        v.retain(|e| seen.insert(e.name.clone()));
        v
    })
}

/// Header entries as JSON text pieces with their offsets (consecutive, in order).
fn header_pieces(entries: &[Entry]) -> (Vec<String>, usize) {
    let mut at = 0;
    let mut pieces = Vec::new();
    for e in entries {
        let end = at + e.bytes();
        pieces.push(format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{at},{end}]}}",
            e.name, e.dtype, e.shape
        ));
        at = end;
    }
    (pieces, at)
}

fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend((0..data_len).map(|i| i as u8));
    bytes
}

fn valid_file(entries: &[Entry]) -> (Vec<u8>, usize) {
    let (pieces, data_len) = header_pieces(entries);
    let header = format!(
        "{{{},\"__metadata__\":{{\"format\":\"pt\"}}}}",
        pieces.join(",")
    );
    (file(&header, data_len), data_len)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn valid_files_open_and_list_every_tensor(entries in entries()) {
        let (bytes, _) = valid_file(&entries);
        prop_assert_eq!(check(&bytes).unwrap(), entries.len());
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_allocate_little(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        claimed in any::<u64>(),
    ) {
        for candidate in [bytes.clone(), {
            let mut b = claimed.to_le_bytes().to_vec();
            b.extend_from_slice(&bytes);
            b
        }] {
            let (result, largest) = largest_allocation(|| check(&candidate));
            if result.is_err() {
                checkpoint_error(result);
            }
            prop_assert!(largest < 64 * 1024, "a {largest} B allocation for {} B of input", candidate.len());
        }
    }

    #[test]
    fn truncation_is_a_typed_error(entries in entries(), cut in any::<prop::sample::Index>()) {
        let (bytes, data_len) = valid_file(&entries);
        prop_assume!(data_len > 0);
        let keep = cut.index(bytes.len());
        let message = checkpoint_error(check(&bytes[..keep]));
        prop_assert!(
            ["shorter than", "header length", "outside", "not a JSON", "UTF-8"]
                .iter()
                .any(|n| message.contains(n)),
            "{message}"
        );
    }

    #[test]
    fn a_header_length_beyond_the_file_or_absurd_is_refused_without_allocating_it(
        entries in entries(),
        extra in 1u64..u64::MAX / 2,
    ) {
        let (mut bytes, _) = valid_file(&entries);
        let real = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let claimed = real.saturating_add(bytes.len() as u64).saturating_add(extra);
        bytes[..8].copy_from_slice(&claimed.to_le_bytes());
        let (result, largest) = largest_allocation(|| check(&bytes));
        let message = checkpoint_error(result);
        prop_assert!(message.contains("header length"), "{message}");
        prop_assert!(largest < 64 * 1024, "allocated {largest} B");
    }

    #[test]
    fn out_of_range_or_overlapping_offsets_name_the_tensor(
        entries in entries(),
        victim in any::<prop::sample::Index>(),
        shift in 1usize..1 << 40,
        overlap in any::<bool>(),
    ) {
        let (mut pieces, data_len) = header_pieces(&entries);
        let i = victim.index(entries.len());
        let e = &entries[i];
        let (start, end) = if overlap && entries.len() > 1 && e.bytes() > 0 {
            // Move the tensor onto the previous/next one's bytes (same length).
            let other = if i == 0 { 1 } else { i - 1 };
            let other_start: usize = entries[..other].iter().map(Entry::bytes).sum();
            prop_assume!(entries[other].bytes() > 0);
            let start = other_start + entries[other].bytes() / 2;
            (start, start + e.bytes())
        } else {
            let start: usize = data_len + shift;
            (start, start + e.bytes())
        };
        pieces[i] = format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{start},{end}]}}",
            e.name, e.dtype, e.shape
        );
        let bytes = file(&format!("{{{}}}", pieces.join(",")), data_len);
        let (result, largest) = largest_allocation(|| check(&bytes));
        let message = checkpoint_error(result);
        prop_assert!(
            message.contains("overlap") || message.contains(&format!("`{}`", e.name)),
            "{message}"
        );
        prop_assert!(largest < 64 * 1024);
    }

    #[test]
    fn a_byte_count_that_does_not_match_dtype_and_shape_names_the_tensor(
        entries in entries(),
        victim in any::<prop::sample::Index>(),
        grow in 1usize..1 << 50,
    ) {
        let (mut pieces, data_len) = header_pieces(&entries);
        let i = victim.index(entries.len());
        let e = &entries[i];
        let mut shape = e.shape.clone();
        shape.push(grow.max(2));
        let start: usize = entries[..i].iter().map(Entry::bytes).sum();
        pieces[i] = format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
            e.name, e.dtype, start + e.bytes()
        );
        let bytes = file(&format!("{{{}}}", pieces.join(",")), data_len);
        let (result, largest) = largest_allocation(|| check(&bytes));
        let message = checkpoint_error(result);
        prop_assert!(message.contains(&format!("`{}`", e.name)), "{message}");
        prop_assert!(message.contains("needs") || message.contains("overflows"), "{message}");
        prop_assert!(largest < 64 * 1024);
    }

    #[test]
    fn duplicate_names_are_refused_naming_the_tensor(
        entries in entries(),
        victim in any::<prop::sample::Index>(),
    ) {
        let (mut pieces, data_len) = header_pieces(&entries);
        let i = victim.index(entries.len());
        pieces.push(pieces[i].clone());
        let bytes = file(&format!("{{{}}}", pieces.join(",")), data_len);
        let message = checkpoint_error(check(&bytes));
        prop_assert!(
            message.contains(&format!("duplicate name `{}`", entries[i].name)),
            "{message}"
        );
    }

    #[test]
    fn non_utf8_names_are_refused(entries in entries(), byte in 0x80u8..=0xff) {
        let (pieces, data_len) = header_pieces(&entries);
        let header = format!("{{{}}}", pieces.join(","));
        let mut bytes = file(&header, data_len);
        // The first name's first character (after `{"`), made an invalid UTF-8 byte.
        bytes[8 + 2] = byte;
        let message = checkpoint_error(check(&bytes));
        prop_assert!(message.contains("UTF-8"), "{message}");
    }
}

#[test]
fn escaped_lone_surrogates_in_names_are_refused() {
    let header = r#"{"\udc80x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let message = checkpoint_error(check(&file(header, 4)));
    assert!(message.contains("JSON"), "{message}");
}

#[test]
fn a_shape_whose_byte_count_overflows_is_refused() {
    let header = format!(
        r#"{{"big":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,4]}}}}"#,
        usize::MAX / 2,
        4
    );
    let (result, largest) = largest_allocation(|| check(&file(&header, 4)));
    let message = checkpoint_error(result);
    assert!(
        message.contains("`big`") && message.contains("overflows"),
        "{message}"
    );
    assert!(largest < 64 * 1024);
}

#[test]
fn open_reports_the_same_errors_as_validate_bytes_with_the_file_path() {
    let dir = std::env::temp_dir().join(format!("ddo-st-props-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dup.safetensors");
    let one = r#""a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    std::fs::write(&path, file(&format!("{{{one},{one}}}"), 4)).unwrap();
    let err = Checkpoint::open(&path).unwrap_err();
    assert!(
        matches!(&err, CoreError::Checkpoint { path: p, message } if p == &path && message.contains("duplicate name `a`")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_allocation_watcher_sees_large_requests() {
    let (v, largest) = largest_allocation(|| vec![7u8; 1 << 20]);
    assert_eq!(v.len(), 1 << 20);
    assert!(largest >= 1 << 20, "{largest}");
}

#[test]
fn the_fuzz_seed_corpus_replays_on_stable() {
    // `fuzz/corpus/safetensors_header/` is what `cargo xtask fuzz` starts from; CI (stable,
    // no cargo-fuzz) replays it here with the fuzz target's own check.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/safetensors_header");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("seed corpus") {
        let bytes = std::fs::read(entry.expect("entry").path()).expect("seed");
        let (result, largest) = largest_allocation(|| check(&bytes));
        if result.is_err() {
            checkpoint_error(result);
        }
        assert!(largest < 64 * 1024);
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} seeds in {}", dir.display());
}
