//! Fuzz target for Hugging Face model folders: the input is a u16 little-endian length, that
//! many bytes of config.json, then a model.safetensors file. Both are parsed (the config into a
//! model config, the header by the `safetensors` crate through our mapping) and, when both are
//! accepted, every tensor is checked against the config and prepared as a load does. Whatever
//! the header accepts lies inside the file. Run by `tools/fuzz.sh`.

#![no_main]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use gatestream::config::ModelConfig;
use gatestream::model::weights::{ModelWeights, TensorSource};
use gatestream::safetensors::{parse_header, SafetensorsModel};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(len) = data.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize) else {
        return;
    };
    let Some(config) = data.get(2..2 + len) else {
        return;
    };
    let file = &data[2 + len..];
    let dir = Path::new("fuzz-model");
    let config = serde_json::from_slice::<serde_json::Value>(config)
        .ok()
        .and_then(|v| ModelConfig::from_hf_config(&dir.join("config.json"), &v).ok());

    let st_path = dir.join("model.safetensors");
    let Ok(tensors) = parse_header(&st_path, file, 0) else {
        return;
    };
    for t in &tensors {
        assert!(t.offset_bytes + t.len_bytes <= file.len(), "tensor `{}` beyond the file", t.name);
    }
    let (Some(config), false) = (config, file.is_empty()) else {
        return;
    };
    let mut map = memmap2::MmapMut::map_anon(file.len()).expect("anonymous map");
    map.copy_from_slice(file);
    let map = Arc::new(map.make_read_only().expect("read-only map"));
    let model = SafetensorsModel {
        paths: vec![st_path],
        maps: vec![map],
        tensors: tensors.into_iter().map(|t| (t.name.clone(), t)).collect::<HashMap<_, _>>(),
    };
    let src = TensorSource::Safetensors {
        dir: dir.to_path_buf(),
        model,
    };
    let _ = ModelWeights::load(&src, &config);
});
