//! The cache file's tests: round trips, every truncation and flipped byte, failed
//! writes, and what is at the path when it is not a DDO cache (a user's file, a read-only
//! cache, a directory, a FIFO, symbolic links, links planted at temporary names).

use super::*;
use crate::encode::encode_unit;
use proptest::prelude::*;

fn units() -> Vec<Vec<u8>> {
    // Weight-like bf16 words (a few exponents) and one odd-sized, incompressible unit.
    let mut v = Vec::new();
    for (u, words) in [(0u32, 5000usize), (1, 333), (2, 9001)] {
        let mut b = Vec::with_capacity(words * 2);
        let mut x = 0x1234_5678u32.wrapping_add(u);
        for _ in 0..words {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let w: u16 = if u == 1 {
                x as u16
            } else {
                (((x >> 8) as u16) & 0x807f) | (((118 + (x % 5)) as u16) << 7)
            };
            b.extend_from_slice(&w.to_le_bytes());
        }
        v.push(encode_unit(&b).map(|e| e.into_bytes()).unwrap_or_default());
    }
    v
}

fn key(tag: u64) -> CacheKey {
    let mut k = CacheKey::new();
    k.push_u64(tag).push_bytes(b"model.safetensors");
    k
}

fn refs(u: &[Vec<u8>]) -> Vec<&[u8]> {
    u.iter().map(Vec::as_slice).collect()
}

fn file_of(u: &[Vec<u8>], key: &CacheKey) -> Vec<u8> {
    let dir = tempdir();
    let p = dir.join("c.ddo-coded");
    write_cache(&p, key, b"xtra", &refs(u)).unwrap();
    let b = std::fs::read(&p).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    b
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "ddo-codec-cache-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn only_file(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn round_trip_returns_the_same_units() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("m.safetensors.ddo-coded");
    assert!(matches!(
        read_cache(&p, &key(1)).unwrap(),
        CacheLookup::Absent
    ));
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    let CacheLookup::Hit(c) = read_cache(&p, &key(1)).unwrap() else {
        panic!("expected a hit");
    };
    assert_eq!(c.len(), u.len());
    assert_eq!(c.extra(), b"xtra");
    for ((bytes, header), want) in c.iter().zip(&u) {
        assert_eq!(bytes, want.as_slice());
        assert_eq!(header.encoded_len(), want.len() as u64);
    }
    assert_eq!(only_file(&dir), vec!["m.safetensors.ddo-coded".to_string()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_open_cache_reads_its_payload_into_the_callers_buffer_and_checks_it() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    let Lookup::Hit(open) = open_cache(&p, &key(1)).unwrap() else {
        panic!("expected a hit");
    };
    assert_eq!(open.units(), u.len());
    assert_eq!(open.extra(), b"xtra");
    let mut payload = vec![0xAAu8; open.payload_len() as usize];
    let units = open.read_into(&mut payload).unwrap().unwrap();
    for ((at, header), want) in units.iter().zip(&u) {
        let at = *at as usize;
        assert_eq!(&payload[at..at + want.len()], want.as_slice());
        assert_eq!(header.encoded_len(), want.len() as u64);
    }
    // A buffer of another size is refused, not partly filled.
    let Lookup::Hit(open) = open_cache(&p, &key(1)).unwrap() else {
        panic!("expected a hit");
    };
    let mut short = vec![0u8; open.payload_len() as usize - 1];
    assert!(matches!(
        open.read_into(&mut short),
        Err(CodecError::CacheIo { op: "read", .. })
    ));
    // A flipped payload byte passes the open (header, key, index) and is caught by the
    // read.
    let mut bytes = std::fs::read(&p).unwrap();
    let last = bytes.len() - 20;
    bytes[last] ^= 0x10;
    std::fs::write(&p, &bytes).unwrap();
    let Lookup::Hit(open) = open_cache(&p, &key(1)).unwrap() else {
        panic!("the header is intact");
    };
    let mut payload = vec![0u8; open.payload_len() as usize];
    assert!(open.read_into(&mut payload).unwrap().is_err());
    // Another key is stale before any payload is read.
    assert!(matches!(open_cache(&p, &key(9)).unwrap(), Lookup::Stale(_)));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn empty_unit_list_round_trips() {
    let b = file_of(&[], &key(3));
    assert!(matches!(check(b, &key(3)), CacheLookup::Hit(c) if c.is_empty()));
}

#[test]
fn another_key_is_stale_and_a_rewrite_replaces_it() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    assert!(matches!(
        read_cache(&p, &key(2)).unwrap(),
        CacheLookup::Stale(_)
    ));
    write_cache(&p, &key(2), b"xtra", &refs(&u[..2])).unwrap();
    assert!(matches!(read_cache(&p, &key(2)).unwrap(), CacheLookup::Hit(c) if c.len() == 2));
    assert!(matches!(
        read_cache(&p, &key(1)).unwrap(),
        CacheLookup::Stale(_)
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_truncation_and_extension_is_corrupt() {
    let b = file_of(&units(), &key(1));
    for cut in (0..b.len()).step_by(7).chain([b.len() - 1]) {
        let r = check(b[..cut].to_vec(), &key(1));
        assert!(matches!(r, CacheLookup::Corrupt(_)), "cut at {cut}: {r:?}");
    }
    let mut longer = b.clone();
    longer.extend_from_slice(&[0; 16]);
    assert!(matches!(check(longer, &key(1)), CacheLookup::Corrupt(_)));
}

#[test]
fn a_unit_that_is_not_coded_is_refused_before_any_file_is_made() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    let bad: Vec<&[u8]> = vec![&u[0], b"not a unit"];
    assert!(write_cache(&p, &key(1), b"xtra", &bad).is_err());
    assert!(only_file(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_write_leaves_no_file_and_the_old_file_intact() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    // No old file: nothing left behind, at every failure point.
    let whole = file_of(&u, &key(1)).len() as u64;
    for after in [0u64, 10, 64, 1000, whole / 2, whole - 1] {
        let r = write_cache_failing_after(&p, &key(1), b"xtra", &refs(&u), Some(after));
        assert!(
            matches!(r, Err(CodecError::CacheIo { op: "write", .. })),
            "{r:?}"
        );
        assert!(only_file(&dir).is_empty(), "after {after}");
    }
    // An old file: still there and still valid.
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    let r = write_cache_failing_after(&p, &key(2), b"xtra", &refs(&u[..1]), Some(100));
    assert!(r.is_err());
    assert_eq!(only_file(&dir), vec!["c".to_string()]);
    assert!(matches!(read_cache(&p, &key(1)).unwrap(), CacheLookup::Hit(c) if c.len() == 3));
    // A directory that does not exist: a typed error, nothing made.
    let r = write_cache(&dir.join("missing").join("c"), &key(1), b"", &refs(&u));
    assert!(
        matches!(r, Err(CodecError::CacheIo { op: "create", .. })),
        "{r:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `f` on a thread of its own and hands back its result, failing the test
/// (instead of hanging the run) when it has not returned within `secs` seconds.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .expect("blocked: no answer in time")
}

fn mkfifo(p: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo {}", p.display());
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

#[test]
fn a_file_that_is_not_a_cache_is_neither_read_nor_replaced() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("w.safetensors.ddo-coded");
    // A safetensors shard's first bytes: its header length, then the header.
    let mut shard = 16u64.to_le_bytes().to_vec();
    shard.extend_from_slice(b"{\"w\":{}}        ");
    for bytes in [b"my notes".to_vec(), shard, Vec::new(), b"DDOCAC".to_vec()] {
        std::fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            open_cache(&p, &key(1)).unwrap(),
            Lookup::NotACache(_)
        ));
        let miss = read_cache(&p, &key(1)).unwrap();
        assert!(
            miss.reason()
                .unwrap_or_default()
                .contains("not a DDO cache"),
            "{miss:?}"
        );
        let r = write_cache(&p, &key(1), b"xtra", &refs(&u));
        assert!(matches!(r, Err(CodecError::CacheRefused { .. })), "{r:?}");
        assert_eq!(std::fs::read(&p).unwrap(), bytes);
        assert_eq!(only_file(&dir), vec!["w.safetensors.ddo-coded".to_string()]);
    }
    // A directory: the same, and it keeps its contents.
    std::fs::remove_file(&p).unwrap();
    std::fs::create_dir(&p).unwrap();
    std::fs::write(p.join("x"), b"x").unwrap();
    let miss = open_cache(&p, &key(1)).unwrap();
    assert!(
        miss.reason().unwrap_or_default().contains("a directory"),
        "{miss:?}"
    );
    let r = write_cache(&p, &key(1), b"xtra", &refs(&u));
    assert!(matches!(r, Err(CodecError::CacheRefused { .. })), "{r:?}");
    assert_eq!(std::fs::read(p.join("x")).unwrap(), b"x");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_read_only_cache_is_read_but_never_replaced() {
    use std::os::unix::fs::PermissionsExt;
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444)).unwrap();
    let before = std::fs::read(&p).unwrap();
    assert!(matches!(read_cache(&p, &key(1)).unwrap(), CacheLookup::Hit(c) if c.len() == 3));
    // Stale for another key, and still not replaced (the folder is writable: a rename
    // would go through).
    assert!(matches!(
        read_cache(&p, &key(2)).unwrap(),
        CacheLookup::Stale(_)
    ));
    let r = write_cache(&p, &key(2), b"xtra", &refs(&u[..1]));
    let Err(CodecError::CacheRefused { reason, .. }) = r else {
        panic!("{r:?}");
    };
    assert!(reason.contains("read-only"), "{reason}");
    assert_eq!(std::fs::read(&p).unwrap(), before);
    assert_eq!(only_file(&dir), vec!["c".to_string()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fifo_or_a_link_to_one_is_refused_without_blocking() {
    let dir = tempdir();
    let fifo = dir.join("pipe.ddo-coded");
    mkfifo(&fifo);
    let link = dir.join("link.ddo-coded");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    for p in [fifo.clone(), link.clone()] {
        let (opened, read, written) = within(30, move || {
            let u = units();
            (
                open_cache(&p, &key(1)).map(|l| l.reason()),
                read_cache(&p, &key(1)).map(|l| l.reason()),
                write_cache(&p, &key(1), b"", &refs(&u)),
            )
        });
        for r in [opened, read] {
            let said = r.unwrap().unwrap_or_default();
            assert!(
                said.contains("not a DDO cache") && said.contains("FIFO"),
                "{said}"
            );
        }
        assert!(
            matches!(&written, Err(CodecError::CacheRefused { reason, .. }) if reason.contains("FIFO")),
            "{written:?}"
        );
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert!(is_link(&link));
    assert_eq!(
        only_file(&dir),
        vec!["link.ddo-coded".to_string(), "pipe.ddo-coded".to_string()]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_symbolic_link_is_read_through_but_never_written_through_nor_replaced() {
    let u = units();
    let dir = tempdir();
    // A link to a cache: read through it (a hit), but a stale one is not replaced.
    let real = dir.join("real");
    write_cache(&real, &key(1), b"xtra", &refs(&u)).unwrap();
    let cache = std::fs::read(&real).unwrap();
    let link = dir.join("m.ddo-coded");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(matches!(read_cache(&link, &key(1)).unwrap(), CacheLookup::Hit(c) if c.len() == 3));
    assert!(matches!(
        read_cache(&link, &key(2)).unwrap(),
        CacheLookup::Stale(_)
    ));
    let r = write_cache(&link, &key(2), b"xtra", &refs(&u));
    assert!(
        matches!(&r, Err(CodecError::CacheRefused { reason, .. }) if reason.contains("symbolic link")),
        "{r:?}"
    );
    assert!(is_link(&link));
    assert_eq!(std::fs::read(&real).unwrap(), cache);
    // A link to a file of the user's, and a link to nothing: neither read nor written.
    let victim = dir.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let to_victim = dir.join("n.ddo-coded");
    std::os::unix::fs::symlink(&victim, &to_victim).unwrap();
    let dangling = dir.join("d.ddo-coded");
    std::os::unix::fs::symlink(dir.join("nothing"), &dangling).unwrap();
    for l in [&to_victim, &dangling] {
        assert!(matches!(
            open_cache(l, &key(1)).unwrap(),
            Lookup::NotACache(_)
        ));
        let r = write_cache(l, &key(1), b"xtra", &refs(&u));
        assert!(matches!(r, Err(CodecError::CacheRefused { .. })), "{r:?}");
        assert!(is_link(l));
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(!dir.join("nothing").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The temporary file is created with `O_EXCL` under a random name, so a link planted
/// at any name (here every name of the old `.NAME.tmp.PID.N` scheme with a small `N`,
/// and guesses at the new one) is never opened: its target keeps its bytes.
#[test]
fn links_planted_at_temporary_names_are_never_followed() {
    let u = units();
    let dir = tempdir();
    let victim = dir.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let p = dir.join("c.ddo-coded");
    let mut planted: Vec<PathBuf> = (0..64)
        .map(|n| dir.join(format!(".c.ddo-coded.tmp.{}.{n}", std::process::id())))
        .collect();
    for guess in ["", "tmp", "000000", "aaaaaa", "AAAAAA", "zzzzzz"] {
        planted.push(dir.join(format!(".c.ddo-coded.{guess}.tmp")));
    }
    for l in &planted {
        std::os::unix::fs::symlink(&victim, l).unwrap();
    }
    for round in 0..8 {
        write_cache(&p, &key(round), b"xtra", &refs(&u)).unwrap();
        assert!(matches!(
            read_cache(&p, &key(round)).unwrap(),
            CacheLookup::Hit(_)
        ));
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(planted.iter().all(|l| is_link(l)));
    assert_eq!(only_file(&dir).len(), planted.len() + 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupt_or_truncated_cache_is_still_replaced() {
    let u = units();
    let dir = tempdir();
    let p = dir.join("c");
    write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
    let good = std::fs::read(&p).unwrap();
    let mut flipped = good.clone();
    let last = flipped.len() - 20;
    flipped[last] ^= 0x10;
    for bad in [
        flipped,
        good[..good.len() / 3].to_vec(),
        good[..10].to_vec(),
    ] {
        std::fs::write(&p, &bad).unwrap();
        assert!(matches!(
            read_cache(&p, &key(1)).unwrap(),
            CacheLookup::Corrupt(_)
        ));
        write_cache(&p, &key(1), b"xtra", &refs(&u)).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), good);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fast_hash_sees_every_byte_and_the_length() {
    let b: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let h = fast_hash(&b);
    for i in 0..b.len() {
        let mut c = b.clone();
        c[i] ^= 1;
        assert_ne!(fast_hash(&c), h, "byte {i}");
    }
    assert_ne!(fast_hash(&b[..999]), h);
    let mut z = b.clone();
    z.push(0);
    assert_ne!(fast_hash(&z), h);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_flipped_byte_anywhere_is_detected(at in any::<prop::sample::Index>(), bit in 0u8..8) {
        static FILE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let b = FILE.get_or_init(|| file_of(&units(), &key(1)));
        let mut c = b.clone();
        let i = at.index(c.len());
        c[i] ^= 1 << bit;
        let r = check(c, &key(1));
        // A flip in the version field is a hashed field too, so corrupt as well.
        prop_assert!(matches!(r, CacheLookup::Corrupt(_)), "byte {} bit {}: {:?}", i, bit, r);
    }
}
