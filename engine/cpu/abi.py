"""The CPU kernels' C interface as ctypes sees it: engine/csrc/kernels.h's dtype codes, mode bits, norm flavors,
structs and function signatures, written once here for Python (tests/engine/test_cpu_abi.py checks every one of them
against the header)."""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels.h's F32, BF16, F16
I8 = 3  # kernels.h's I8: linear()'s int8 weights (engine/quantization.py's Int8Weight), an int8 KV cache's code
MODE_GLU, PRODUCTS_WIDEN, MODE_GELU = 1, 2, 4  # kernels.h's `mode` bits of linear()
PRODUCTS_TILES = 8  # kernels.h's: attention's bfloat16 products by AMX tiles (full_attention.c)
NORM_LLAMA, NORM_GEMMA = 0, 1  # kernels.h's norm flavors
# A gated MLP's activations (linear()'s `glu`) -> the `mode` bits for it.
GLU_ACTIVATIONS = {"silu": MODE_GLU, "gelu_tanh": MODE_GLU | MODE_GELU}
# An activation of a product's own outputs (linear()'s `act`, no glu) -> the `mode` bits for it.
OUTPUT_ACTIVATIONS = {"gelu_tanh": MODE_GELU}

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class NormArgs(ctypes.Structure):
    """kernels.h's `norm_weights`: one RMSNorm's weight, its dtype, flavor and epsilon (a NULL weight: none)."""

    _fields_ = [("weight", _P), ("dtype", _INT), ("flavor", _INT), ("eps", _F)]


class ProjectionArgs(ctypes.Structure):
    """kernels.h's `projection`: one weight as `linear` reads it (an int8 one with its scales and row sums)."""

    _fields_ = [("weight", _P), ("n", _I64), ("k", _I64), ("stride", _I64), ("bias", _P), ("dtype", _INT),
                ("scale", _P), ("row_sums", _P)]


class LeanLayerArgs(ctypes.Structure):
    """kernels.h's `lean_layer`: one layer's weights and KV cache."""

    _fields_ = [*((name, NormArgs) for name in ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm",
                                                "k_norm")),
                *((name, ProjectionArgs) for name in ("qkv", "o", "gate_up", "down")),
                ("key_cache", _P), ("value_cache", _P), ("key_scales", _P), ("value_scales", _P), ("scaling", _F),
                ("window", _I64), ("act", _INT), ("local_rope", _INT)]


class DecodeStepArgs(ctypes.Structure):
    """kernels.h's `decode_step`: a step's buffers, rotary tables (and their rows: `positions`), token ids and
    embedding (h gathered in the call), attention metadata and sizes."""

    _fields_ = [*((name, _P) for name in ("h", "normed", "qkv", "attended", "o", "gate_up", "down", "cos", "sin",
                                          "local_cos", "local_sin", "positions", "ids", "embedding", "slots",
                                          "query_index", "block_tables", "context_lens")),
                ("final_norm", NormArgs),
                *((name, _I64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "num_seqs",
                                            "block_size", "table_width", "rope_rows", "embedding_rows")),
                *((name, _INT) for name in ("io_dtype", "cache_dtype", "mode", "num_threads"))]


SIGNATURES = {  # function -> argument types (every one returns an int: 0, or why it refused)
    "paged_decode_attention": [_P, _INT, _I64, _I64, _P, _P, _P, _P, _P, _INT, _P, _P, _I64, _I64, _I64, _I64, _I64,
                               _I64, _F, _I64, _P, _INT, _INT],
    "linear": [_P, _INT, _I64, _I64, _P, _INT, _I64, _I64, _P, _P, _P, _INT, _P, _P, _INT],
    "rms_norm": [_P, _INT, _I64, _I64, _P, _INT, _F, _P, _INT],
    "add_rms_norm": [_P, _P, ctypes.POINTER(NormArgs), _INT, _I64, _I64, ctypes.POINTER(NormArgs), _P, _INT],
    "rope_store": [_P, _INT, _I64, _I64, _I64, _I64, _I64, ctypes.POINTER(NormArgs), ctypes.POINTER(NormArgs), _P,
                   _P, _P, _I64, _P, _P, _P, _P, _P, _INT, _INT],
    "gelu_tanh": [_P, _INT, _I64, _INT],
    "sample_rows": [_P, _INT, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _INT],
    "row_max": [_P, _INT, _I64, _I64, _P, _P, _INT],
    "full_attention": [_P, _P, _P, _INT, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _I64, _I64, _INT, _INT],
    "chunk_attention": [_P, _INT, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _INT, _P, _I64, _I64, _I64, _I64, _F,
                        _I64, _P, _INT, _INT],
    "decode_layers": [ctypes.POINTER(DecodeStepArgs), ctypes.POINTER(LeanLayerArgs), _I64],
    "release_scratch": [_INT],
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`'s kernels typed as `SIGNATURES` says; returns it."""
    for function, argtypes in SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = ctypes.c_int
    lib.linear_isa.restype = ctypes.c_char_p
    lib.linear_isa.argtypes = []
    return lib
