"""Writes reference.safetensors (next to this script) with the real safetensors library, for
tests/unit/test_io_safetensors.cpp, which reads it and checks every value.

How it was run (once; the output is committed, and ctest does not need Python):

    python3 -m venv /tmp/stvenv
    /tmp/stvenv/bin/pip install safetensors numpy ml_dtypes
    /tmp/stvenv/bin/python tests/data/safetensors/make_reference.py

with safetensors 0.8.0, numpy 2.4.6 and ml_dtypes 0.6.0. numpy has no bfloat16 of its own;
ml_dtypes provides one that safetensors.numpy.save_file writes as "BF16", so every tensor, the
header and the metadata come from save_file.
"""

import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

tensors = {
    # k / 4 - 1 for k = 0..11
    "f32": (np.arange(12, dtype=np.float32) / 4 - 1).reshape(3, 4),
    # 1/3 rounds to 0x3555 = 0.333251953125; 2^-24 is the smallest subnormal, 2^-14 the smallest
    # normal, 65504 the largest finite value
    "f16": np.array([1 / 3, -2.5, 65504, 2**-24, -(2**-14), 0.0, -0.0, np.inf],
                    dtype=np.float16).reshape(2, 4),
    # (k - 4) * 0.375 for k = 0..6 (exact), then 1/3, which rounds to 0x3eab = 0.333984375
    "bf16": np.array([(k - 4) * 0.375 for k in range(7)] + [1 / 3], dtype=ml_dtypes.bfloat16),
    # k / 3 for k = 0..4: the reader rounds each to the nearest float
    "f64": np.arange(5, dtype=np.float64) / 3,
    # an integer buffer that a reader of float weights must skip, not choke on
    "position_ids": np.arange(8, dtype=np.int64).reshape(1, 8),
    "scalar": np.array(3.25, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
}
metadata = {"format": "np", "source": "make_reference.py", "note": "na\u00efve \u2713"}

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference.safetensors")
save_file(tensors, path, metadata=metadata)
print(f"wrote {path} ({os.path.getsize(path)} bytes)")
