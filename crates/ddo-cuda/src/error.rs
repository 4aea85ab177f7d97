//! The crate's one error enum, [`CudaError`], and its conversion into ddo-core's
//! [`CoreError`] at the [`Device`](ddo_core::Device) boundary. Every variant says what to do.

use cudarc::driver::DriverError;
use cudarc::driver::sys::CUresult;
use ddo_core::CoreError;
use thiserror::Error;

/// Result alias for the CUDA backend.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Everything that can go wrong in the CUDA backend.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A CUDA shared library could not be loaded.
    #[error("the CUDA library `{which}` could not be loaded: {hint}")]
    NoLibrary {
        /// Which library (`libcuda`, `libcublas`, ...).
        which: &'static str,
        /// How it is looked for, and what to change.
        hint: String,
    },
    /// The device ordinal asked for does not exist (or the driver sees no device at all).
    #[error(
        "no CUDA device {ordinal}: the driver reports {count} device(s){}; pick an ordinal below {count}, \
         check CUDA_VISIBLE_DEVICES, or run on the host backend",
        if *count == 0 { " (none visible to this process)" } else { "" }
    )]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error(
        "CUDA driver call {call} failed with {code} ({message}); a sticky error means the context is lost: \
         restart the process"
    )]
    Driver {
        /// The driver call (`cuMemAlloc`, `cuMemcpyHtoDAsync`, ...).
        call: &'static str,
        /// The error's name (`CUDA_ERROR_...`).
        code: String,
        /// The driver's description of it.
        message: String,
    },
    /// The device could not satisfy an allocation, even after returning every idle cached
    /// segment to the driver and retrying.
    #[error(
        "out of device memory on {device}: requested {requested} B with {allocated} B allocated and {reserved} B \
         reserved by DDO's caching allocator, {free} B free according to the driver; choose an offloading route \
         or a smaller budget, or free memory first"
    )]
    OutOfMemory {
        /// Device (`cuda:N`).
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes in live allocations at the time (exact).
        allocated: u64,
        /// Bytes the caching allocator held at the time (exact).
        reserved: u64,
        /// Free bytes according to the driver after the retry (sampled; 0 when unknown).
        free: u64,
        /// Device capacity.
        total: u64,
    },
    /// An error of ddo-core (a wrong handle, a range, the pinned limit).
    #[error(transparent)]
    Core(#[from] CoreError),
    /// An error of the native VMM pool.
    #[error(transparent)]
    Vmm(#[from] ddo_vmm::VmmError),
    /// Installing the native allocator came too late: the caching allocator has served this
    /// device already (through any `CudaDevice` of its ordinal that is still alive).
    #[error(
        "cannot install the native VMM allocator on {device}: the caching allocator has already served {allocations} \
         allocation(s) on it in this process (every CudaDevice of {device} still alive counts); install it first, \
         right after creating the first device of {device} (CudaDeviceConfig::native_vmm, `ddo run --preset vmm_fast` \
         or `--route COMPONENT=native_vmm`), before any weight, activation or workspace is allocated, or drop every \
         CudaDevice of {device} and what it allocated first"
    )]
    NativeInstallTooLate {
        /// Device (`cuda:N`).
        device: String,
        /// Caching allocations made so far by the live devices of the ordinal.
        allocations: u64,
    },
    /// A GPU decode of an encoded unit was refused before its launch: a buffer too small
    /// or misaligned for the unit's header.
    #[error(
        "cannot decode the encoded unit on {device}: {reason}; give the unit's bytes at a \
         16-byte aligned address, an 8-byte aligned output of at least its decoded length \
         and `codec::SCRATCH_BYTES` of 8-byte aligned scratch"
    )]
    CodecLaunch {
        /// Device (`cuda:N`).
        device: String,
        /// What is wrong.
        reason: String,
    },
    /// The native allocator is installed already, by this device.
    #[error(
        "the native VMM allocator is already installed on {device}; install it once per device"
    )]
    NativeAlreadyInstalled {
        /// Device (`cuda:N`).
        device: String,
    },
    /// Another `CudaDevice` of the same ordinal installed the native allocator, which serves
    /// the ordinal alone: this one may not install a second pool, open beside it or allocate
    /// from the caching allocator beside it.
    #[error(
        "the native VMM allocator is installed on {device} by another CudaDevice of this process, and it alone \
         serves {device}: share that device (CudaDevice values are Arcs: clone it) instead of opening a second one, \
         or drop every CudaDevice of {device} and what it allocated first"
    )]
    NativeInstalledOnAnotherDevice {
        /// Device (`cuda:N`).
        device: String,
    },
}

impl CudaError {
    /// A driver error from `call`, its name and description read as ddo-vmm reads them
    /// ([`ddo_vmm::error::driver_error_text`]).
    pub(crate) fn driver(call: &'static str, err: DriverError) -> Self {
        let (code, message) = ddo_vmm::error::driver_error_text(&err);
        CudaError::Driver {
            call,
            code,
            message,
        }
    }

    /// An error of the driver glue shared with `ddo-vmm` (probe, device count, primary
    /// context) as this crate's: a failed driver call stays a [`CudaError::Driver`].
    pub(crate) fn from_shared_glue(e: ddo_vmm::VmmError) -> Self {
        match e {
            ddo_vmm::VmmError::Driver {
                call,
                code,
                message,
            } => CudaError::Driver {
                call,
                code,
                message,
            },
            other => CudaError::Vmm(other),
        }
    }

    /// Whether this is the driver's out-of-memory error.
    pub fn is_driver_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Driver { code, .. } if code == "CUDA_ERROR_OUT_OF_MEMORY")
    }

    /// The `CoreError` this becomes at the `Device` boundary of `device`.
    pub fn into_core(self, device: &str) -> CoreError {
        match self {
            CudaError::OutOfMemory {
                device,
                requested,
                allocated,
                total,
                ..
            } => CoreError::OutOfMemory {
                device,
                requested,
                allocated,
                capacity: total,
            },
            CudaError::Core(e) => e,
            CudaError::Vmm(e) => e.into_core(device),
            other => CoreError::Backend {
                device: device.to_string(),
                message: other.to_string(),
            },
        }
    }
}

/// Whether a raw driver result is the out-of-memory code.
pub(crate) fn is_oom(err: &DriverError) -> bool {
    err.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

impl From<CudaError> for CoreError {
    fn from(e: CudaError) -> Self {
        e.into_core("cuda")
    }
}

/// Extension to tag a cudarc result with the driver call it came from.
pub(crate) trait DriverResultExt<T> {
    /// Maps a [`DriverError`] to [`CudaError::Driver`] naming `call`.
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> DriverResultExt<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|e| CudaError::driver(call, e))
    }
}
