//! NVRTC, loaded at run time: the kernels in `kernels/` are compiled for the device's compute
//! capability when a CUDA device first opens, and the compiled module is cached on disk, keyed
//! by the source's hash, the architecture and NVRTC's version. Loaded by our own code rather than
//! cudarc's so a missing or mismatched library is an error naming what was searched and how to
//! point at one (`GATESTREAM_NVRTC`), never a panic.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The kernel sources, one translation unit in this order (embedded in the binary).
pub const SOURCES: [(&str, &str); 4] = [
    ("kernels/quant.cu", include_str!("../../../kernels/quant.cu")),
    ("kernels/mma.cu", include_str!("../../../kernels/mma.cu")),
    ("kernels/ops.cu", include_str!("../../../kernels/ops.cu")),
    ("kernels/attention.cu", include_str!("../../../kernels/attention.cu")),
];

/// The whole source NVRTC compiles.
pub fn source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("// ---- {name}\n{text}\n"));
    }
    s
}

/// Environment variable naming the NVRTC library file to use.
pub const NVRTC_ENV: &str = "GATESTREAM_NVRTC";
/// Environment variable naming the folder of compiled kernels (default
/// `~/.cache/gatestream/kernels`).
pub const CACHE_ENV: &str = "GATESTREAM_KERNEL_CACHE";

type Program = *mut std::ffi::c_void;

/// A loaded NVRTC.
pub struct Nvrtc {
    lib: libloading::Library,
    pub path: String,
    pub version: (i32, i32),
}

/// Where NVRTC is looked for when `GATESTREAM_NVRTC` is not set: the loader's own search (the
/// library path, ldconfig) by these names, then these folders.
const NAMES: [&str; 4] = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"];
const DIRS: [&str; 3] = [
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/lib/x86_64-linux-gnu",
];

fn candidates(cuda_homes: &[PathBuf]) -> Vec<String> {
    let mut out: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    let mut dirs: Vec<PathBuf> = cuda_homes.iter().map(|d| d.join("lib64")).collect();
    dirs.extend(DIRS.iter().map(PathBuf::from));
    for d in dirs {
        for n in NAMES {
            out.push(d.join(n).display().to_string());
        }
    }
    out
}

impl Nvrtc {
    /// `file` when given (only that file: `GATESTREAM_NVRTC`), else the standard names and
    /// folders, and `lib64` of each of `cuda_homes`.
    pub fn load_from(file: Option<String>, cuda_homes: &[PathBuf]) -> Result<Nvrtc> {
        let (tried, explicit) = match file {
            Some(p) => (vec![p], true),
            None => (candidates(cuda_homes), false),
        };
        let mut last = String::new();
        for c in &tried {
            // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
            match unsafe { libloading::Library::new(c) } {
                Ok(lib) => {
                    let mut n = Nvrtc {
                        lib,
                        path: c.clone(),
                        version: (0, 0),
                    };
                    n.version = n.query_version()?;
                    return Ok(n);
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(Error::Device(if explicit {
            format!("CUDA: {NVRTC_ENV}={} could not be loaded as NVRTC: {last}", tried[0])
        } else {
            format!(
                "CUDA: NVRTC (libnvrtc.so, the CUDA runtime compiler) was not found; searched the library path and {}. \
                 Install the CUDA toolkit (or `pip install nvidia-cuda-nvrtc-cu12`) and set {NVRTC_ENV}=/path/to/libnvrtc.so.12",
                DIRS.join(", ")
            )
        }))
    }

    fn sym<T>(&self, name: &str) -> Result<libloading::Symbol<'_, T>> {
        // SAFETY: each caller names the NVRTC function whose C signature `T` spells out.
        unsafe { self.lib.get(name.as_bytes()) }
            .map_err(|e| Error::Device(format!("CUDA: {} has no {name}: {e}", self.path)))
    }

    fn query_version(&self) -> Result<(i32, i32)> {
        let f = self.sym::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>("nvrtcVersion")?;
        let (mut a, mut b) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        check(unsafe { f(&mut a, &mut b) }, "nvrtcVersion")?;
        Ok((a, b))
    }

    /// Compiles `src` to a cubin for `sm_{arch}`; returns the cubin and the compile log (with
    /// `--ptxas-options=-v`, registers and spills per kernel).
    pub fn compile(&self, src: &str, arch: u32) -> Result<(Vec<u8>, String)> {
        type Create = unsafe extern "C" fn(
            *mut Program,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
        type Size = unsafe extern "C" fn(Program, *mut usize) -> c_int;
        type Get = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut Program) -> c_int;
        let create = self.sym::<Create>("nvrtcCreateProgram")?;
        let compile = self.sym::<Compile>("nvrtcCompileProgram")?;
        let log_size = self.sym::<Size>("nvrtcGetProgramLogSize")?;
        let get_log = self.sym::<Get>("nvrtcGetProgramLog")?;
        let cubin_size = self.sym::<Size>("nvrtcGetCUBINSize")?;
        let get_cubin = self.sym::<Get>("nvrtcGetCUBIN")?;
        let destroy = self.sym::<Destroy>("nvrtcDestroyProgram")?;
        let c_src = CString::new(src).map_err(|_| Error::Internal("kernel source holds a NUL byte".into()))?;
        let name = CString::new("gatestream.cu").expect("no NUL");
        let opts: Vec<CString> = compile_options(arch)
            .into_iter()
            .map(|o| CString::new(o).expect("no NUL"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        check(
            // SAFETY: every pointer is a live NUL-terminated string; no headers are passed.
            unsafe {
                create(
                    &mut prog,
                    c_src.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        // SAFETY: `prog` was created above; the option pointers outlive the call.
        let status = unsafe { compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
        let mut n = 0usize;
        // SAFETY: `prog` is live; the buffers are sized by the size queries.
        let log = unsafe {
            log_size(prog, &mut n);
            let mut buf = vec![0 as c_char; n.max(1)];
            get_log(prog, buf.as_mut_ptr());
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        };
        let result = if status != 0 {
            Err(Error::Device(format!(
                "CUDA: NVRTC {}.{} failed to compile the kernels for sm_{arch}:\n{log}",
                self.version.0, self.version.1
            )))
        } else {
            let mut size = 0usize;
            // SAFETY: as above.
            unsafe {
                check(cubin_size(prog, &mut size), "nvrtcGetCUBINSize")?;
                let mut cubin = vec![0u8; size];
                check(get_cubin(prog, cubin.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
                Ok((cubin, log))
            }
        };
        // SAFETY: `prog` is live and destroyed once.
        unsafe { destroy(&mut prog) };
        result
    }
}

fn check(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Device(format!("CUDA: {what} failed with NVRTC error {code}")))
    }
}

/// NVRTC options for `sm_{arch}`: a cubin (machine code, no JIT at load), exact math (the CPU is
/// the reference), ptxas's per-kernel report.
pub fn compile_options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "--ptxas-options=-v".into(),
        "-lineinfo".into(),
    ]
}

/// One kernel's resources as ptxas reported them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelResources {
    pub kernel: String,
    pub arch: String,
    pub registers: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub stack_bytes: u32,
}

/// Parses ptxas's `-v` report (`Compiling entry function 'k' for 'sm_90'`, `N bytes stack frame,
/// N bytes spill stores, N bytes spill loads`, `Used N registers`) into one entry per kernel.
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut parts = rest.split('\'');
            let kernel = parts.next().unwrap_or("").to_string();
            let arch = parts.nth(1).unwrap_or("").to_string();
            out.push(KernelResources {
                kernel,
                arch,
                registers: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
                stack_bytes: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes spill stores") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
            }
        }
    }
    out
}

/// The cached module's file name: source hash, architecture, NVRTC version.
pub fn cache_file_name(src: &str, arch: u32, nvrtc: (i32, i32)) -> String {
    let opts = compile_options(arch).join(" ");
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{src}\n{opts}").as_bytes());
    format!("kernels-{hash:016x}-sm{arch}-nvrtc{}.{}.cubin", nvrtc.0, nvrtc.1)
}

/// The compiled kernels for `sm_{arch}` and whether they came from the cache (the folder
/// `cache`): from the cache when `use_cache` and there, else compiled and stored (written to a
/// temporary name and renamed, so a reader never sees half a file). A cache that cannot be
/// written is not an error: the module is then compiled again next time.
pub fn compiled_module(nvrtc: &Nvrtc, arch: u32, cache: Option<&Path>, use_cache: bool) -> Result<(Vec<u8>, bool)> {
    let src = source();
    let file = cache.map(|d| d.join(cache_file_name(&src, arch, nvrtc.version)));
    if let Some(f) = file.as_ref().filter(|_| use_cache) {
        if let Ok(bytes) = std::fs::read(f) {
            if !bytes.is_empty() {
                return Ok((bytes, true));
            }
        }
    }
    let (cubin, _log) = nvrtc.compile(&src, arch)?;
    if let Some(f) = &file {
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        let stored = f
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| std::fs::write(&tmp, &cubin))
            .and_then(|_| std::fs::rename(&tmp, f));
        if stored.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((cubin, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'matmul_q4_k' for 'sm_90'\n\
            ptxas info    : Function properties for matmul_q4_k\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'add' for 'sm_90'\n\
            ptxas info    : Function properties for add\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 8 registers, 376 bytes cmem[0]\n";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                kernel: "matmul_q4_k".into(),
                arch: "sm_90".into(),
                registers: 40,
                spill_store_bytes: 4,
                spill_load_bytes: 12,
                stack_bytes: 8
            }
        );
        assert_eq!(
            (r[1].kernel.as_str(), r[1].registers, r[1].spill_store_bytes),
            ("add", 8, 0)
        );
    }

    #[test]
    fn cache_key_changes_with_source_arch_and_version() {
        let a = cache_file_name("x", 90, (12, 8));
        assert_ne!(a, cache_file_name("y", 90, (12, 8)));
        assert_ne!(a, cache_file_name("x", 80, (12, 8)));
        assert_ne!(a, cache_file_name("x", 90, (13, 0)));
        assert!(a.ends_with("-sm90-nvrtc12.8.cubin"), "{a}");
    }

    /// Every kernel compiles for sm_80 and sm_90 with no spills; the table of registers is
    /// printed (`--nocapture`). Needs NVRTC: `.ci/run` installs the `nvidia-cuda-nvrtc-cu12` wheel
    /// and points GATESTREAM_NVRTC at it, and then a missing or broken NVRTC fails this test.
    /// With the variable unset and no NVRTC on the machine the check cannot run: it says so, and
    /// the GPU suite (`--test gpu_cuda`, which prints uncaptured) repeats it in its summary line.
    #[test]
    fn kernels_compile_for_sm80_and_sm90_without_spills() {
        let opts = super::super::CudaOptions::from_vars(&|name| std::env::var(name).ok()).unwrap();
        let named = opts.nvrtc.is_some();
        let how = format!("python3 -m pip install --target DIR nvidia-cuda-nvrtc-cu12, then {NVRTC_ENV}=DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        let nvrtc = match Nvrtc::load_from(opts.nvrtc, &opts.cuda_homes) {
            Ok(n) => n,
            Err(e) if !named => {
                eprintln!("kernels_compile_for_sm80_and_sm90_without_spills: NOT RUN: {e}\n(to run it: {how})");
                return;
            }
            Err(e) => panic!("{e}\n(CI installs it: {how})"),
        };
        let src = source();
        let names = super::super::kernel_names();
        println!("NVRTC {}.{} ({})", nvrtc.version.0, nvrtc.version.1, nvrtc.path);
        println!(
            "{:<22} {:>6} {:>10} {:>12} {:>12}",
            "kernel", "arch", "registers", "spill store", "spill load"
        );
        for arch in [80, 90] {
            let (cubin, log) = nvrtc.compile(&src, arch).unwrap();
            assert!(cubin.len() > 1000, "sm_{arch}: a {}-byte cubin", cubin.len());
            let report = parse_ptxas_report(&log);
            for name in &names {
                let k = report
                    .iter()
                    .find(|k| &k.kernel == name)
                    .unwrap_or_else(|| panic!("sm_{arch}: ptxas reported nothing for {name}:\n{log}"));
                println!(
                    "{:<22} {:>6} {:>10} {:>12} {:>12}",
                    k.kernel, k.arch, k.registers, k.spill_store_bytes, k.spill_load_bytes
                );
                assert_eq!(k.arch, format!("sm_{arch}"));
                assert!(k.registers > 0, "{name}: no register count in the report");
                assert_eq!(
                    (k.spill_store_bytes, k.spill_load_bytes),
                    (0, 0),
                    "{name} spills on sm_{arch}"
                );
            }
        }
    }

    #[test]
    fn a_missing_nvrtc_named_by_the_variable_is_a_clear_error() {
        let e = Nvrtc::load_from(Some("/nonexistent/libnvrtc.so.12".into()), &[])
            .err()
            .expect("no such file")
            .to_string();
        assert!(e.contains("GATESTREAM_NVRTC=/nonexistent/libnvrtc.so.12"), "{e}");
    }
}
