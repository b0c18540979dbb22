//! gatestream: run language models larger than memory by streaming only the FFN neurons a token
//! needs from disk. This crate is the library; the `gatestream` binary only parses arguments and
//! prints. See README.md for the code map and the invariants between modules.

pub mod backend;
pub mod bench;
pub mod config;
pub mod engine;
pub mod error;
pub mod eval;
pub mod format;
pub mod gguf;
pub mod gstfile;
pub mod inspect;
pub mod io;
pub mod kv;
pub mod model;
pub mod perplexity;
pub mod placement;
pub mod plot;
pub mod quant;
pub mod reformat;
pub mod runtime;
pub mod safetensors;
pub mod serve;
pub mod sparsity;
pub mod stream;
pub mod synth;
pub mod tensor;

pub use error::{Error, Result};
