//! Loading the NVIDIA driver library at run time, and what its absence or version says.

use super::*;

/// Environment variable naming the driver library (`libcuda.so.1`) when it is not on the
/// loader's path.
pub const LIBCUDA_ENV: &str = "GATESTREAM_LIBCUDA";

pub(super) fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Device(format!("CUDA: {what}: {e}"))
}

/// Makes the driver library loadable by its standard name: `libcuda` ([`LIBCUDA_ENV`]) is loaded
/// first (the loader then finds it by its soname; the first one named in the process stays), and
/// its absence is reported before cudarc could panic on it.
pub(super) fn ensure_driver(libcuda: Option<&str>) -> Result<()> {
    use std::sync::OnceLock;
    static PRELOADED: OnceLock<std::result::Result<Option<libloading::Library>, String>> = OnceLock::new();
    let pre = PRELOADED.get_or_init(|| match libcuda {
        Some(p) => {
            // SAFETY: loading the driver runs its initializers, which have no preconditions.
            unsafe { libloading::Library::new(p) }
                .map(Some)
                .map_err(|e| format!("CUDA: {LIBCUDA_ENV}={p} could not be loaded: {e}"))
        }
        None => Ok(None),
    });
    if let Err(e) = pre {
        return Err(Error::Device(e.clone()));
    }
    // SAFETY: only tries to load the library by its standard names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Device(format!(
            "CUDA: the NVIDIA driver library (libcuda.so.1) was not found on the library path; this machine has \
             no NVIDIA driver. Install one, or set {LIBCUDA_ENV}=/path/to/libcuda.so.1 (use --device cpu to run on the CPU)"
        )));
    }
    Ok(())
}

/// The driver's CUDA version, `(major, minor)`.
pub(super) fn driver_version() -> Result<(i32, i32)> {
    let mut v = 0;
    // SAFETY: the driver library is present (checked by `ensure_driver`); the call writes one int.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device(format!("CUDA: cuDriverGetVersion failed: {r:?}")));
    }
    Ok((v / 1000, (v % 1000) / 10))
}
