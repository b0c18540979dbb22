//! The library's one error type. Every variant says what was wrong, where (file, offset, tensor),
//! and, where there is one, what to do about it. The binary turns these into a message and exit code.
//!
//! The variants without structure say whose fault the error is: [`Error::Input`] (the user's:
//! a flag, a request, a file that does not fit what was asked), [`Error::Device`] (the
//! machine's: a GPU, its driver, the kernel) and [`Error::Internal`] (gatestream's own: a bug).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// (`cause` is shown in the message and deliberately not an error source, so chained
    /// displays do not print it twice.)
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },

    /// A model file whose bytes do not parse: truncated, wrong magic, absurd counts, bad offsets.
    #[error("{path}: malformed {format} file at byte offset {offset_bytes}: {what}")]
    Malformed {
        path: PathBuf,
        format: &'static str,
        offset_bytes: u64,
        what: String,
    },

    /// A tensor element type this build cannot compute on.
    #[error("{path}: tensor `{tensor}` has type {type_name} (ggml type id {type_id}), which gatestream does not support; supported: {supported}. Re-quantize the model to one of these", supported = crate::quant::supported_type_names())]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
        type_name: String,
    },

    #[error("{path}: tensor `{tensor}` is missing (architecture {arch} needs it); is this a complete {arch} model?")]
    MissingTensor {
        path: PathBuf,
        tensor: String,
        arch: String,
    },

    #[error("{path}: tensor `{tensor}` has shape {found:?}, expected {expected:?} from the model config")]
    WrongShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    /// A tensor in the file that the architecture's computation does not read. Running without
    /// it would compute another model than the file describes, so the file is refused.
    #[error(
        "{path}: tensor `{tensor}` (at byte offset {offset_bytes}) is not read by gatestream's `{arch}` model, and it \
         is not one known to leave the output unchanged: running without it would compute another model than \
         llama.cpp does, so the file is refused. If this architecture's files carry it, gatestream does not \
         support that variant yet"
    )]
    UnusedTensor {
        path: PathBuf,
        tensor: String,
        arch: String,
        offset_bytes: u64,
    },

    #[error(
        "{path}: architecture `{arch}`{what} is not supported; supported: llama (with experts: Mixtral; with \
         Llama 3.1+ RoPE factors), qwen2, qwen3, gemma3, qwen2moe, qwen3moe, olmoe, gpt-oss, glm4moe, deepseek2"
    )]
    UnsupportedArchitecture {
        path: PathBuf,
        arch: String,
        /// What the architecture is, when it is one gatestream knows it cannot run (", a
        /// mixture-of-experts model: ...").
        what: String,
    },

    /// A read of a byte range that failed (device error, or the file ends before the range does).
    /// `offset_bytes`/`len_bytes` are the range the caller asked for, not the widened device read.
    /// (`cause` is shown in the message and deliberately not an error source, so chained
    /// displays do not print it twice.)
    #[error("{path}: read of {len_bytes} bytes at offset {offset_bytes} failed: {cause}")]
    Read {
        path: PathBuf,
        offset_bytes: u64,
        len_bytes: u64,
        cause: std::io::Error,
    },

    /// Metadata or config that is present but unusable (missing key, inconsistent sizes).
    #[error("{path}: bad model config: {what}")]
    Config { path: PathBuf, what: String },

    #[error("{path}: no usable tokenizer: {what}")]
    Tokenizer { path: PathBuf, what: String },

    /// The caller cancelled the work (Ctrl-C, a client that went away) before it finished.
    #[error("cancelled")]
    Cancelled,

    /// The user's input cannot be honoured: a flag or value out of range, options that do not go
    /// together, a bad prompt, template or request, or a file or model that does not fit what
    /// was asked (too small a budget, a feature the chosen device does not compute, a report or
    /// checkpoint of another evaluation). The message names what to change. (A file whose bytes
    /// do not parse is [`Error::Malformed`]; the structured variants above come first where one
    /// fits.) The server answers these with 400.
    #[error("{0}")]
    Input(String),

    /// The machine under gatestream failed or lacks something: a CUDA driver or NVRTC call, the
    /// wgpu adapter, device memory, the kernel's I/O (io_uring) or its resources (threads,
    /// sockets). Neither the input nor gatestream is at fault; the message names the device or
    /// facility ("CUDA: ...", "wgpu: ...") and, where there is one, the fix.
    #[error("{0}")]
    Device(String),

    /// A broken invariant of gatestream itself (or of a library caller's contract with it): it
    /// should not happen whatever the input, so it is a bug to report.
    #[error("internal error (a bug in gatestream): {0}")]
    Internal(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause: source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn display_says_whose_fault_it_is() {
        assert_eq!(
            Error::Input("--ctx 2 is too small".into()).to_string(),
            "--ctx 2 is too small"
        );
        assert_eq!(
            Error::Device("CUDA: cuMemAlloc: out of memory".into()).to_string(),
            "CUDA: cuMemAlloc: out of memory"
        );
        assert_eq!(
            Error::Internal("layer 3: the stream served no rows".into()).to_string(),
            "internal error (a bug in gatestream): layer 3: the stream served no rows"
        );
        assert_eq!(Error::Cancelled.to_string(), "cancelled");
    }
}
