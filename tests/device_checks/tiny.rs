//! Small random models written by `make-model`'s code (a synthetic vocabulary of 300, text in
//! bytes), for the device suites: one builder an architecture, whichever suites run it.

/// A random model written by `make-model`'s code: `shape` with a vocabulary of 300 (the
/// synthetic tokenizer: text in bytes), its matrices of `mix`, or with `dequantize` their
/// values decoded to F32.
pub fn synth_model(
    dir: &std::path::Path,
    shape: gatestream::synth::Shape,
    mix: gatestream::synth::Mix,
    dequantize: bool,
) -> Result<std::path::PathBuf, String> {
    use gatestream::synth::{write_model, MakeSpec, OutputFormat, Shape, TokenizerChoice};
    let path = dir.join(format!("{}.gguf", shape.arch.name()));
    let spec = MakeSpec {
        shape: Shape {
            vocab: 300,
            context_len: 512,
            ..shape
        },
        mix,
        dequantize,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 5,
        residual_gain: 1.0,
    };
    write_model(&spec, &path, &OutputFormat::Gguf, true, &mut |_, _| {}).map_err(|e| e.to_string())?;
    Ok(path)
}

/// deepseek2: multi-head latent attention (the cache one latent and its rotated part a
/// position, 160 wide; values read from the keys), DeepSeek-V2-Lite's unfactored queries; with
/// `moe`, V3's routing: sigmoid scores with a bias, 4 groups of which 2 are used, a shared expert,
/// the first layer dense.
pub fn synth_deepseek2(dir: &std::path::Path, moe: bool) -> Result<std::path::PathBuf, String> {
    use gatestream::config::Arch;
    use gatestream::synth::{Mix, RoutingShape, Shape};
    let mla = crate::common::small_mla(if moe { 64 } else { 0 });
    let shape = Shape {
        rope_theta: 10000.0,
        experts: moe.then_some((8, 2)),
        mla: Some(mla),
        routing: moe.then(|| RoutingShape::deepseek_v3(256)),
        ..Shape::custom(Arch::Deepseek2, 128, if moe { 64 } else { 256 }, 2, 4, 1, mla.latent())
    };
    synth_model(dir, shape, Mix::Q8_0, true)
}
