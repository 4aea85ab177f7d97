//! The process-wide ledger of each device ordinal ([`OrdinalLedger`]): which allocator
//! serves `cuda:N` in this process, whatever the number of [`CudaDevice`] values opened on
//! it.
//!
//! Every `CudaDevice` of an ordinal holds the ordinal's one ledger (found or made by
//! [`ledger_of`]), and it records two things: the caching allocations the devices alive now
//! have served on the ordinal, and the device (by instance) whose native VMM allocator, once
//! installed, serves it. From them follow the rules of `CudaDevice::install_native_vmm`:
//! - the native allocator is installed at most once per ordinal: a second install, by the
//!   same device or another one, is refused, and while it is installed no other device of
//!   the ordinal opens ([`OrdinalLedger::check_open`]) or allocates
//!   ([`OrdinalLedger::serve`]) — a second pool would reserve the device's memory again,
//!   and a caching allocation beside the pool would be a second allocator on the device;
//! - it is installed only before anything is allocated on the ordinal: once any live device
//!   of it has served a caching allocation, an install is refused
//!   ([`CudaError::NativeInstallTooLate`], counting every device).
//!
//! A device leaves the ledger when its shared state drops (after its last allocation, with
//! its cache returned to the driver: [`OrdinalLedger::device_gone`]); once every device of
//! an ordinal is gone the ledger is dropped and the ordinal is fresh again, nothing of DDO's
//! being allocated on it. The install holds the ledger's write lock from its checks to the
//! moment the pool serves, and every allocation holds its read lock, so no allocation slips
//! in between.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::error::{CudaError, Result};

#[cfg(doc)]
use super::CudaDevice;

/// The allocator state of one device ordinal in this process (see the module docs).
#[derive(Debug)]
pub(super) struct OrdinalLedger {
    /// The ordinal (`cuda:N`).
    ordinal: usize,
    /// The instance of the device whose native allocator serves the ordinal, if one is
    /// installed: write-locked by an install, read-locked around every allocation.
    native_owner: RwLock<Option<u64>>,
    /// Caching allocations served on the ordinal by the devices alive now.
    caching_allocations: AtomicU64,
}

/// Which allocator serves an allocation ([`OrdinalLedger::serve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Serve {
    /// The device's own native allocator.
    Native,
    /// The device's caching allocator (counted in the ledger).
    Caching,
}

/// The ledgers of the ordinals some live device is open on.
static LEDGERS: Mutex<Vec<(usize, Weak<OrdinalLedger>)>> = Mutex::new(Vec::new());

/// The ledger of `ordinal`: the one every live device of it holds, or a fresh one.
pub(super) fn ledger_of(ordinal: usize) -> Arc<OrdinalLedger> {
    let mut ledgers = LEDGERS.lock();
    ledgers.retain(|(_, l)| l.strong_count() > 0);
    if let Some(l) = ledgers
        .iter()
        .filter(|(n, _)| *n == ordinal)
        .find_map(|(_, l)| l.upgrade())
    {
        return l;
    }
    let l = Arc::new(OrdinalLedger {
        ordinal,
        native_owner: RwLock::new(None),
        caching_allocations: AtomicU64::new(0),
    });
    ledgers.push((ordinal, Arc::downgrade(&l)));
    l
}

impl OrdinalLedger {
    fn device(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn elsewhere(&self) -> CudaError {
        CudaError::NativeInstalledOnAnotherDevice {
            device: self.device(),
        }
    }

    /// Whether a new device may open on the ordinal: not while another device's native
    /// allocator serves it.
    pub(super) fn check_open(&self) -> Result<()> {
        match *self.native_owner.read() {
            Some(_) => Err(self.elsewhere()),
            None => Ok(()),
        }
    }

    /// Which allocator serves an allocation of device `instance`, with the ledger
    /// read-locked until the guard drops (hold it across the allocation): its native
    /// allocator when it installed one; refused while another device's does; else its
    /// caching allocator, counted.
    pub(super) fn serve(&self, instance: u64) -> Result<(RwLockReadGuard<'_, Option<u64>>, Serve)> {
        let owner = self.native_owner.read();
        match *owner {
            Some(o) if o == instance => Ok((owner, Serve::Native)),
            Some(_) => Err(self.elsewhere()),
            None => {
                self.caching_allocations.fetch_add(1, Ordering::AcqRel);
                Ok((owner, Serve::Caching))
            }
        }
    }

    /// Installs device `instance`'s native allocator with `install` (which makes the pool
    /// and puts it in the device's slot), the ledger write-locked throughout: refused when
    /// one is installed on the ordinal already ([`CudaError::NativeAlreadyInstalled`] by
    /// this device, [`CudaError::NativeInstalledOnAnotherDevice`] by another) or when a
    /// live device of the ordinal has served a caching allocation
    /// ([`CudaError::NativeInstallTooLate`]). Nothing changes when `install` fails.
    pub(super) fn install(
        &self,
        instance: u64,
        install: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut owner = self.native_owner.write();
        match *owner {
            Some(o) if o == instance => {
                return Err(CudaError::NativeAlreadyInstalled {
                    device: self.device(),
                });
            }
            Some(_) => return Err(self.elsewhere()),
            None => {}
        }
        let allocations = self.caching_allocations.load(Ordering::Acquire);
        if allocations > 0 {
            return Err(CudaError::NativeInstallTooLate {
                device: self.device(),
                allocations,
            });
        }
        install()?;
        *owner = Some(instance);
        Ok(())
    }

    /// Device `instance` is gone, after serving `caching_allocations` caching allocations
    /// (all freed and returned): it no longer counts, and its native allocator, if it had
    /// one, no longer serves the ordinal.
    pub(super) fn device_gone(&self, instance: u64, caching_allocations: u64) {
        self.caching_allocations
            .fetch_sub(caching_allocations, Ordering::AcqRel);
        let mut owner = self.native_owner.write();
        if *owner == Some(instance) {
            *owner = None;
        }
    }
}

#[cfg(test)]
mod tests {
    //! The ledger's rules without a GPU; ordinals from 1000 up, one per test (the ledgers
    //! are process-wide and tests run in parallel).

    use super::*;

    #[test]
    fn every_device_of_an_ordinal_shares_one_ledger_until_the_last_is_gone() {
        let a = ledger_of(1000);
        let b = ledger_of(1000);
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &ledger_of(1001)));
        let weak = Arc::downgrade(&a);
        drop((a, b));
        assert!(weak.upgrade().is_none(), "nothing keeps a ledger alive");
        assert_eq!(
            ledger_of(1000).caching_allocations.load(Ordering::Acquire),
            0
        );
    }

    #[test]
    fn an_install_after_another_devices_caching_allocation_is_refused_until_it_is_gone() {
        let l = ledger_of(1002);
        let (first, second) = (1, 2);
        let (_guard, serve) = l.serve(first).unwrap();
        assert_eq!(serve, Serve::Caching);
        drop(_guard);
        let mut made = 0;
        let err = l
            .install(second, || {
                made += 1;
                Ok(())
            })
            .unwrap_err();
        assert!(
            matches!(err, CudaError::NativeInstallTooLate { allocations: 1, ref device } if device == "cuda:1002"),
            "{err}"
        );
        assert!(
            err.to_string().contains("CudaDeviceConfig::native_vmm"),
            "{err}"
        );
        assert_eq!(made, 0, "no pool is made for a refused install");
        // The device that allocated is gone (its cache returned): the ordinal is fresh.
        l.device_gone(first, 1);
        l.install(second, || {
            made += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(made, 1);
        assert_eq!(l.serve(second).unwrap().1, Serve::Native);
    }

    #[test]
    fn a_second_device_neither_installs_nor_opens_nor_allocates_beside_the_native_allocator() {
        let l = ledger_of(1003);
        let (owner, other) = (10, 11);
        l.check_open().unwrap();
        l.install(owner, || Ok(())).unwrap();
        let again = l.install(owner, || Ok(())).unwrap_err();
        assert!(
            matches!(again, CudaError::NativeAlreadyInstalled { .. }),
            "{again}"
        );
        let second = l.install(other, || panic!("a second pool")).unwrap_err();
        assert!(
            matches!(second, CudaError::NativeInstalledOnAnotherDevice { .. }),
            "{second}"
        );
        let open = l.check_open().unwrap_err();
        assert!(
            matches!(open, CudaError::NativeInstalledOnAnotherDevice { .. }),
            "{open}"
        );
        let alloc = l.serve(other).unwrap_err();
        assert!(alloc.to_string().contains("share"), "{alloc}");
        assert_eq!(l.caching_allocations.load(Ordering::Acquire), 0);
        assert_eq!(l.serve(owner).unwrap().1, Serve::Native);
        // The owner gone, a device of the ordinal may open and allocate again.
        l.device_gone(owner, 0);
        l.check_open().unwrap();
        assert_eq!(l.serve(other).unwrap().1, Serve::Caching);
    }

    #[test]
    fn a_failed_install_changes_nothing() {
        let l = ledger_of(1004);
        let err = l
            .install(20, || {
                Err(CudaError::NoDevice {
                    ordinal: 1004,
                    count: 0,
                })
            })
            .unwrap_err();
        assert!(matches!(err, CudaError::NoDevice { .. }), "{err}");
        l.check_open().unwrap();
        assert_eq!(l.serve(21).unwrap().1, Serve::Caching);
    }
}
