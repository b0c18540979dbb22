#!/usr/bin/env python3
"""Compares gatestream's dequantization of a GGUF tensor's first rows with gguf-py's
(`gguf.quants.dequantize`, llama.cpp's Python reader: an implementation of the block formats
independent of gatestream's), bit for bit.

    tools/check-dequant.py MODEL.gguf TENSOR [ROWS]

Needs numpy, llama.cpp's gguf-py (the source tools/llama-cpp.sh unpacks, or GGUF_PY=DIR) and a
release build of the example: `cargo build --release --example dequant_rows`.
"""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
gguf_py = os.environ.get("GGUF_PY", os.path.expanduser(
    "~/.cache/gatestream/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
sys.path.insert(0, gguf_py)
import numpy as np  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

model, name = sys.argv[1], sys.argv[2]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 4
tensor = next(t for t in GGUFReader(model).tensors if t.name == name)
theirs = dequantize(tensor.data[:rows], tensor.tensor_type).astype(np.float32).reshape(-1)
example = os.path.join(here, "..", "target", "release", "examples", "dequant_rows")
ours = np.frombuffer(subprocess.run([example, model, name, str(rows)], check=True, capture_output=True).stdout,
                     dtype=np.float32)
same = ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
print(f"{name} ({tensor.tensor_type.name}): {ours.size} values, "
      + ("bit for bit equal" if same else f"DIFFER: max |a-b| {np.abs(ours - theirs).max()}"))
sys.exit(0 if same else 1)
