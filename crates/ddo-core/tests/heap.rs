//! `host_memory::heap_in_use` (what `ddo serve`'s soak measures), alone in its binary: a
//! test beside it on another thread would move the figure it reads.

/// The allocator's in-use bytes rise by what is allocated and held, and fall back when it
/// is freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn heap_in_use_follows_what_is_held() {
    use ddo_core::host_memory::heap_in_use;
    let before = heap_in_use().unwrap();
    let held: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1 << 20]).collect();
    let during = heap_in_use().unwrap();
    assert!(during >= before + (64 << 20), "{before} -> {during}");
    assert!(during <= before + (65 << 20), "{before} -> {during}");
    drop(held);
    let after = heap_in_use().unwrap();
    assert!(
        after <= before + (1 << 20),
        "{before} -> {during} -> {after}"
    );
}

/// Off glibc the figure is not known, and says so.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[test]
fn heap_in_use_is_unknown_off_glibc() {
    assert_eq!(ddo_core::host_memory::heap_in_use(), None);
}
