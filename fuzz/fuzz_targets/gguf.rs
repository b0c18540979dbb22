//! Fuzz target for GGUF files: the parser (header, metadata, tensor infos), then everything a
//! load does with what it accepted — config and tokenizer from the metadata, every tensor's
//! shape and type checked against the config, the matrices prepared for compute. Whatever
//! parses must hand out tensor bytes inside the file. Run by `tools/fuzz.sh`.

#![no_main]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use gatestream::backend::cpu::CpuBackend;
use gatestream::backend::Device;
use gatestream::gguf::GgufFile;
use gatestream::model::{gguf_source, LoadOptions, Model};
use libfuzzer_sys::fuzz_target;

/// One single-threaded device for every input (a thread pool per input would dominate).
fn device() -> Arc<dyn Device> {
    static DEVICE: OnceLock<Arc<dyn Device>> = OnceLock::new();
    DEVICE.get_or_init(|| Arc::new(CpuBackend::new(1))).clone()
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    // The parser takes a map; an anonymous one holds the input.
    let mut map = memmap2::MmapMut::map_anon(data.len()).expect("anonymous map");
    map.copy_from_slice(data);
    let map = Arc::new(map.make_read_only().expect("read-only map"));
    let path = Path::new("fuzz.gguf");
    let Ok(g) = GgufFile::parse(path, map) else {
        return;
    };
    for t in &g.tensors {
        assert_eq!(g.tensor_bytes(t).len() as u64, t.len_bytes, "tensor `{}`", t.name);
    }
    let Ok(src) = gguf_source(g) else {
        return;
    };
    let opts = LoadOptions {
        threads: 1,
        ..Default::default()
    };
    if let Ok(m) = Model::from_source(path, src, &opts, device()) {
        // A model that loads can encode text with its tokenizer.
        let _ = m.tokenizer.encode("Hello world", true);
    }
});
