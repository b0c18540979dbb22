//! Writes the first rows of a GGUF tensor, dequantized by gatestream, as little-endian `f32` to
//! standard output: the bytes `tools/check-dequant.py` compares with gguf-py's
//! `gguf.quants.dequantize` of the same rows (an implementation of the formats independent of
//! this crate's).
//!
//! `cargo run --release --example dequant_rows -- MODEL.gguf TENSOR [ROWS] > rows.f32`

use std::io::Write;

use gatestream::gguf::GgufFile;
use gatestream::quant::dequantize_row;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: dequant_rows MODEL.gguf TENSOR [ROWS]");
        std::process::exit(2);
    }
    let file = GgufFile::open(std::path::Path::new(&args[1])).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let Some(t) = file.tensor(&args[2]) else {
        eprintln!("{}: no tensor named {}", args[1], args[2]);
        std::process::exit(1)
    };
    let Some(ty) = t.ty else {
        eprintln!(
            "{}: {} has ggml type id {}, which gatestream does not read",
            args[1], t.name, t.type_id
        );
        std::process::exit(1)
    };
    let cols = t.dims[0] as usize;
    let rows = args.get(3).map_or(4, |r| r.parse().expect("ROWS is a number"));
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let bytes = file.tensor_bytes(t);
    let mut out = std::io::stdout().lock();
    let mut values = vec![0f32; cols];
    for row in bytes.chunks_exact(row_bytes).take(rows) {
        dequantize_row(ty, row, &mut values);
        for v in &values {
            out.write_all(&v.to_le_bytes()).unwrap();
        }
    }
}
