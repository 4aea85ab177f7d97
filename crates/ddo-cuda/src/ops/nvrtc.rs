//! NVRTC, CUDA's run-time compiler: the crate's one wrapper of `cudarc::nvrtc::sys`, one
//! thin checked function per need (probe the library, its version, compile a program to
//! PTX or to a cubin and read its log).
//!
//! These functions validate nothing beyond what their signatures guarantee; everything
//! above them ([`kernels`](super::kernels), [`kernel_cache`](super::kernel_cache)) is safe
//! code. cudarc loads libnvrtc on first use and panics when it is missing, so every entry
//! point here checks [`present`] first and answers [`Failure::NoLibrary`] instead.

use std::ffi::{CString, c_char, c_int};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

/// Where libnvrtc is looked for, for error messages.
pub(crate) const NVRTC_HINT: &str = "cudarc loads libnvrtc.so (also libnvrtc.so.13 and other versioned names) at run time \
     through the dynamic loader, which searches LD_LIBRARY_PATH, the ld.so cache and the system library \
     directories; install the CUDA toolkit's NVRTC (or the nvidia-cuda-nvrtc wheel) and add the directory \
     holding libnvrtc.so to LD_LIBRARY_PATH (e.g. /usr/local/cuda/targets/x86_64-linux/lib), or run on the \
     host backend";

/// Whether libnvrtc can be loaded (probed once per process; no compilation is made).
pub(crate) fn present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries `dlopen` on libnvrtc's candidate names and
        // drops what it opened; it calls nothing in the library.
        unsafe { sys::is_culib_present() }
    })
}

/// Whether the loaded libnvrtc can hand out cubins (`nvrtcGetCUBIN`, CUDA 11.1 and later).
/// `false` without libnvrtc.
pub(crate) fn has_cubin() -> bool {
    if !present() {
        return false;
    }
    // SAFETY: libnvrtc loads (checked above), so `culib` returns the library cudarc keeps
    // for the whole process instead of panicking. `get` only looks the symbol up (dlsym);
    // the pointer type is never called through here, and the `Symbol` is dropped at once.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(c"nvrtcGetCUBIN")
            .is_ok()
    }
}

/// NVRTC's version, `(major, minor)`.
pub(crate) fn version() -> Result<(i32, i32), Failure> {
    if !present() {
        return Err(Failure::NoLibrary);
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: libnvrtc loads (checked above); `nvrtcVersion` writes two ints through the
    // two pointers, which point at live locals.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

/// What [`compile`] hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    /// PTX text (without its terminating NUL), for the driver to JIT.
    Ptx,
    /// A cubin: machine code for the one architecture the options name (`sm_XY`).
    Cubin,
}

/// Why [`compile`] produced no image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// libnvrtc does not load.
    NoLibrary,
    /// The source does not compile (`NVRTC_ERROR_COMPILATION`): NVRTC's log.
    Source(String),
    /// Any other failure (an option NVRTC does not know, an unsupported architecture, out
    /// of memory, an internal error): which call, its result and the log when there is one.
    Other(String),
}

fn check(r: sys::nvrtcResult, call: &str) -> Result<(), Failure> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Failure::Other(format!("{call} returned {r:?}")))
    }
}

/// A created NVRTC program, destroyed on drop.
struct Program {
    prog: sys::nvrtcProgram,
}

impl Program {
    /// `nvrtcCreateProgram` of `text` named `name`, with no headers. libnvrtc must load.
    fn create(text: &CString, name: &CString) -> Result<Self, Failure> {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: libnvrtc loads (callers check `present`). `text` and `name` are
        // NUL-terminated and outlive the program (NVRTC copies them at creation anyway);
        // zero headers with null arrays is the documented way to pass none; `prog` is a
        // live local the call writes the handle to.
        let r = unsafe {
            sys::nvrtcCreateProgram(
                &mut prog,
                text.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        check(r, "nvrtcCreateProgram")?;
        Ok(Self { prog })
    }

    /// `nvrtcCompileProgram` with `options`: `Ok(false)` for a compilation error of the
    /// source, `Err` for any other failure.
    fn compile(&self, options: &[CString]) -> Result<bool, Failure> {
        let ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let n = c_int::try_from(ptrs.len())
            .map_err(|_| Failure::Other("too many NVRTC options".into()))?;
        // SAFETY: `self.prog` is a live program (created, not yet destroyed); `ptrs` holds
        // `n` pointers to NUL-terminated strings owned by `options`, all alive for the call.
        let r = unsafe { sys::nvrtcCompileProgram(self.prog, n, ptrs.as_ptr()) };
        match r {
            sys::nvrtcResult::NVRTC_SUCCESS => Ok(true),
            sys::nvrtcResult::NVRTC_ERROR_COMPILATION => Ok(false),
            other => Err(Failure::Other(format!(
                "nvrtcCompileProgram returned {other:?}: {}",
                self.log()
            ))),
        }
    }

    /// The program's log (empty when it cannot be read).
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: `self.prog` is live; the call writes one `usize` to a live local.
        let r = unsafe { sys::nvrtcGetProgramLogSize(self.prog, &mut size) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `self.prog` is live and `buf` holds the `size` bytes (NUL included) that
        // `nvrtcGetProgramLogSize` reported for its log.
        let r = unsafe { sys::nvrtcGetProgramLog(self.prog, buf.as_mut_ptr().cast()) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        text_until_nul(&buf)
    }

    /// The compiled PTX (without its NUL) or cubin.
    fn output(&self, output: Output) -> Result<Vec<u8>, Failure> {
        let mut size = 0usize;
        let (size_call, r) = match output {
            // SAFETY: `self.prog` is live and compiled; the call writes one `usize`.
            Output::Ptx => ("nvrtcGetPTXSize", unsafe {
                sys::nvrtcGetPTXSize(self.prog, &mut size)
            }),
            // SAFETY: as above; libnvrtc has the symbol (callers check `has_cubin`).
            Output::Cubin => ("nvrtcGetCUBINSize", unsafe {
                sys::nvrtcGetCUBINSize(self.prog, &mut size)
            }),
        };
        check(r, size_call)?;
        if size == 0 {
            return Err(Failure::Other(format!(
                "{size_call} reported an empty image (does the architecture option name a real \
                 GPU, sm_XY, for a cubin?)"
            )));
        }
        let mut buf = vec![0u8; size];
        let (call, r) = match output {
            // SAFETY: `self.prog` is live and compiled; `buf` holds the `size` bytes the
            // size call just reported, which is what the call writes.
            Output::Ptx => ("nvrtcGetPTX", unsafe {
                sys::nvrtcGetPTX(self.prog, buf.as_mut_ptr().cast())
            }),
            // SAFETY: as above, for the cubin.
            Output::Cubin => ("nvrtcGetCUBIN", unsafe {
                sys::nvrtcGetCUBIN(self.prog, buf.as_mut_ptr().cast())
            }),
        };
        check(r, call)?;
        if output == Output::Ptx {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            buf.truncate(end);
        }
        Ok(buf)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.prog` was created by `nvrtcCreateProgram` and is destroyed only
        // here, once. A failure leaks the program at worst; it is not reported.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.prog) };
    }
}

/// The text of a NUL-terminated buffer (lossy UTF-8).
fn text_until_nul(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Compiles the CUDA C `text` (`name` in NVRTC's messages) with `options` and returns the
/// `output` image. [`Failure::Source`] carries NVRTC's log.
pub(crate) fn compile(
    text: &str,
    name: &str,
    options: &[String],
    output: Output,
) -> Result<Vec<u8>, Failure> {
    if !present() {
        return Err(Failure::NoLibrary);
    }
    if output == Output::Cubin && !has_cubin() {
        return Err(Failure::Other(
            "this libnvrtc has no nvrtcGetCUBIN (CUDA 11.1 or later has)".into(),
        ));
    }
    let nul = |what: &str| Failure::Other(format!("the {what} holds a NUL byte"));
    let text = CString::new(text).map_err(|_| nul("source"))?;
    let name = CString::new(name).map_err(|_| nul("source name"))?;
    let options = options
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|_| nul("option list")))
        .collect::<Result<Vec<_>, _>>()?;
    let program = Program::create(&text, &name)?;
    if !program.compile(&options)? {
        return Err(Failure::Source(program.log()));
    }
    program.output(output)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_end_at_their_nul() {
        assert_eq!(text_until_nul(b"error: x\0junk"), "error: x");
        assert_eq!(text_until_nul(b"no nul"), "no nul");
        assert_eq!(text_until_nul(b""), "");
    }

    /// Without libnvrtc (as on CI) every entry point answers instead of panicking.
    #[test]
    fn a_missing_library_is_an_answer_not_a_panic() {
        if present() {
            println!("skipped: libnvrtc loads here");
            return;
        }
        assert!(!has_cubin());
        assert_eq!(version(), Err(Failure::NoLibrary));
        assert_eq!(
            compile("", "x.cu", &[], Output::Cubin),
            Err(Failure::NoLibrary)
        );
    }

    /// With libnvrtc: a cubin for sm_90, PTX for compute_90, and a source error with its log.
    #[test]
    fn compiles_cubin_and_ptx_and_reports_source_errors() {
        if !present() {
            println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to its directory)");
            return;
        }
        let src = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }";
        let opts = |arch: &str| vec![format!("--gpu-architecture={arch}")];
        let cubin = compile(src, "k.cu", &opts("sm_90"), Output::Cubin).unwrap();
        assert_eq!(&cubin[..4], b"\x7fELF", "a cubin is an ELF file");
        let ptx = compile(src, "k.cu", &opts("compute_90"), Output::Ptx).unwrap();
        let ptx = String::from_utf8(ptx).unwrap();
        assert!(ptx.contains(".entry k("), "{ptx}");
        match compile("this is not C", "bad.cu", &opts("sm_90"), Output::Cubin) {
            Err(Failure::Source(log)) => assert!(log.contains("bad.cu"), "{log}"),
            other => panic!("expected a source error, got {other:?}"),
        }
        assert!(matches!(
            compile(src, "k.cu", &["--no-such-option".into()], Output::Ptx),
            Err(Failure::Other(_))
        ));
        let (major, _) = version().unwrap();
        assert!(major >= 11);
    }
}
