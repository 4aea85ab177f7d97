//! The crate's one error enum, [`VmmError`], and its conversion into ddo-core's
//! [`CoreError`] at the [`Device`](ddo_core::Device) boundary. Every variant says what to do.

use cudarc::driver::DriverError;
use ddo_core::CoreError;
use thiserror::Error;

/// Result alias for the VMM pool.
pub type Result<T, E = VmmError> = std::result::Result<T, E>;

/// The driver's name for its out-of-memory code (the fake reports the same name).
pub(crate) const OOM_CODE: &str = "CUDA_ERROR_OUT_OF_MEMORY";

/// Everything that can go wrong in the VMM pool and the physical memory under it.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VmmError {
    /// The CUDA driver library could not be loaded.
    #[error(
        "the CUDA driver library (libcuda) could not be loaded: cudarc looks for libcuda.so (also .so.1 and \
         versioned names) through the dynamic loader (LD_LIBRARY_PATH, the ld.so cache, the system library \
         directories); install the NVIDIA driver or add the directory holding libcuda.so to LD_LIBRARY_PATH \
         (e.g. /usr/local/nvidia/lib64), or use the caching allocator on the host backend"
    )]
    NoLibrary,
    /// The device ordinal asked for does not exist.
    #[error(
        "no CUDA device {ordinal}: the driver reports {count} device(s); pick an ordinal below {count} or check \
         CUDA_VISIBLE_DEVICES"
    )]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// The device does not support CUDA virtual memory management.
    #[error(
        "CUDA device {ordinal} does not support virtual memory management \
         (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0); keep the caching allocator \
         (choose a route other than native_vmm)"
    )]
    Unsupported {
        /// The device.
        ordinal: usize,
    },
    /// A driver call failed.
    #[error(
        "CUDA driver call {call} failed with {code} ({message}); a sticky error means the context is lost: \
         restart the process"
    )]
    Driver {
        /// The driver call (`cuMemCreate`, `cuMemMap`, ...).
        call: &'static str,
        /// The error's name (`CUDA_ERROR_...`).
        code: String,
        /// The driver's description of it.
        message: String,
    },
    /// The device has no physical memory left for the chunks an allocation needs.
    #[error(
        "out of device memory on {device}: requested {requested} B with {live} B live and {mapped} B mapped by the \
         native VMM pool, of which {idle} B hold no live byte, {} according to the driver; call release_idle \
         at a quiescent boundary and retry, free allocations, or choose an offloading route or a smaller budget",
        match driver_free { Some(f) => format!("{f} B free"), None => "free memory unknown".to_string() }
    )]
    OutOfMemory {
        /// Device (`cuda:N`, or the pool's label).
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes in live allocations at the time (exact).
        live: u64,
        /// Bytes of mapped chunks at the time (exact).
        mapped: u64,
        /// Mapped bytes in chunks that hold no live byte (what `release_idle` would return).
        idle: u64,
        /// Free bytes according to the driver (sampled), where known.
        driver_free: Option<u64>,
        /// Device capacity according to the driver, or the pool's capacity where unknown.
        capacity: u64,
    },
    /// The pool's reserved address range has no free run long enough.
    #[error(
        "the native VMM pool on {device} has no free address range of {requested} B: {in_use} B of its {capacity} B \
         range are held by allocations and the largest free run is {largest_free} B; free allocations, or create \
         the pool with a larger capacity (address space costs no memory)"
    )]
    AddressSpaceExhausted {
        /// Device (`cuda:N`, or the pool's label).
        device: String,
        /// Bytes of address range asked for (rounded).
        requested: u64,
        /// Capacity of the reserved range.
        capacity: u64,
        /// Bytes of the range held by live allocations (rounded, growth room included).
        in_use: u64,
        /// The longest free run.
        largest_free: u64,
    },
    /// An allocation that is not live in this pool was passed (a double free, or a stale copy).
    #[error(
        "no live allocation {id} at {va:#x} in this pool: it was freed already (a double free) or never came \
         from this pool; this is a bug in the caller"
    )]
    UnknownAllocation {
        /// The allocation's id.
        id: u64,
        /// Its address.
        va: u64,
    },
    /// An allocation of another pool was passed.
    #[error(
        "allocation {id} at {va:#x} belongs to another VMM pool; pass it to the pool that allocated it"
    )]
    WrongPool {
        /// The allocation's id.
        id: u64,
        /// Its address.
        va: u64,
    },
    /// An allocation cannot grow in place: the address range after it is held by another.
    #[error(
        "allocation at {va:#x} ({len} B) cannot grow to {requested} B in place: the address range from \
         {blocked_at:#x} is held by another allocation; allocate a new buffer of the new size and copy \
         (the pool never moves memory), or allocate with alloc_growable and enough room"
    )]
    GrowBlocked {
        /// The allocation's address.
        va: u64,
        /// Its length now.
        len: u64,
        /// The length asked for.
        requested: u64,
        /// First address that is not free.
        blocked_at: u64,
    },
    /// `grow` was asked for a shorter length.
    #[error(
        "allocation at {va:#x} is {len} B; grow cannot shrink it to {requested} B: free it and allocate anew"
    )]
    CannotShrink {
        /// The allocation's address.
        va: u64,
        /// Its length now.
        len: u64,
        /// The length asked for.
        requested: u64,
    },
    /// `release_idle` was called while device work may still use pool memory.
    #[error(
        "release of idle VMM chunks refused, nothing released: work is pending ({what}); release only at a \
         quiescent boundary: synchronise every stream of the device first"
    )]
    NotQuiescent {
        /// What the caller saw pending.
        what: String,
    },
    /// The pool cannot be created with this capacity or granularity.
    #[error("cannot create a VMM pool: {reason}")]
    InvalidConfig {
        /// What is wrong, and what to change.
        reason: String,
    },
    /// The pool was closed while allocations were still live.
    #[error(
        "the VMM pool was closed with {count} live allocation(s) ({bytes} B); their addresses are invalid now. \
         Free every allocation (and drop every buffer that holds one) before closing the pool"
    )]
    LiveAllocations {
        /// Live allocations at the close.
        count: u64,
        /// Their bytes.
        bytes: u64,
    },
    /// A [`PhysicalMemory`](crate::PhysicalMemory) call broke its contract (reported by the
    /// fake, which checks what the driver would not).
    #[error(
        "{call} broke the PhysicalMemory contract: {message}; this is a bug in the VMM pool's bookkeeping \
         (or in code calling the physical layer directly)"
    )]
    Misuse {
        /// The call (named as the driver call it stands for).
        call: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A failure injected on purpose by the fake.
    #[error("injected failure of {call} (call #{nth})")]
    Injected {
        /// The call (named as the driver call it stands for).
        call: &'static str,
        /// Which call of that kind failed (1 = the first since the fake was created).
        nth: u64,
    },
}

/// The driver's name of `err` (`CUDA_ERROR_...`, or `CUresult N` for a code it cannot
/// name) and its description, as [`VmmError::Driver`] holds them. The one place the
/// workspace reads them: `ddo-cuda`'s driver errors are named through it too. The driver
/// library must be present (cudarc asks the driver for both strings).
pub fn driver_error_text(err: &DriverError) -> (String, String) {
    let code = err
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", err.0 as u32));
    let message = err
        .error_string()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "no description".to_string());
    (code, message)
}

impl VmmError {
    /// A driver error from `call`.
    pub(crate) fn driver(call: &'static str, err: DriverError) -> Self {
        let (code, message) = driver_error_text(&err);
        VmmError::Driver {
            call,
            code,
            message,
        }
    }

    /// Whether this is (or wraps) the driver's out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            VmmError::Driver { code, .. } => code == OOM_CODE,
            VmmError::OutOfMemory { .. } | VmmError::AddressSpaceExhausted { .. } => true,
            _ => false,
        }
    }

    /// The `CoreError` this becomes at the `Device` boundary of `device` (`cuda:N`).
    pub fn into_core(self, device: &str) -> CoreError {
        match self {
            VmmError::OutOfMemory {
                requested,
                live,
                capacity,
                ..
            } => CoreError::OutOfMemory {
                device: device.to_string(),
                requested,
                allocated: live,
                capacity,
            },
            VmmError::AddressSpaceExhausted {
                requested,
                capacity,
                in_use,
                ..
            } => CoreError::OutOfMemory {
                device: device.to_string(),
                requested,
                allocated: in_use,
                capacity,
            },
            e @ VmmError::Injected { .. } => CoreError::Injected(e.to_string()),
            other => CoreError::Backend {
                device: device.to_string(),
                message: other.to_string(),
            },
        }
    }
}

impl From<VmmError> for CoreError {
    fn from(e: VmmError) -> Self {
        e.into_core("cuda")
    }
}

/// Extension to tag a cudarc result with the driver call it came from.
pub(crate) trait DriverResultExt<T> {
    /// Maps a [`DriverError`] to [`VmmError::Driver`] naming `call`.
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> DriverResultExt<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|e| VmmError::driver(call, e))
    }
}
