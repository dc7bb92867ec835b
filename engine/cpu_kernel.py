"""The CPU kernels' names as they were before they became the package `engine.cpu` (build, abi, ops, tuning,
routing), for code outside the engine that imports them from here."""

from engine.cpu.abi import DTYPE_CODES, GLU_ACTIVATIONS, NORM_GEMMA, NORM_LLAMA
from engine.cpu.build import (
    DOT_BUILDS,
    VARIANTS,
    available,
    choose_variant,
    compile_variant,
    cpu_flags,
    load_variant,
    runnable_variants,
    variant,
)
from engine.cpu.ops import (
    PRODUCTS,
    add_rms_norm,
    full_attention,
    gelu_tanh,
    linear,
    paged_decode_attention,
    rms_norm,
    rope_store,
)
from engine.cpu.routing import (
    KERNEL_ROWS,
    KernelLinear,
    KernelPatchConv,
    KernelRMSNorm,
    Norm,
    activation_of,
    route_linears,
    route_norms,
)
from engine.cpu.tuning import bf16_products, measure_row_ranges, median_seconds, set_row_ranges

__all__ = ["DOT_BUILDS", "DTYPE_CODES", "GLU_ACTIVATIONS", "KERNEL_ROWS", "NORM_GEMMA", "NORM_LLAMA", "PRODUCTS",
           "VARIANTS", "KernelLinear", "KernelPatchConv", "KernelRMSNorm", "Norm", "activation_of", "add_rms_norm",
           "available", "bf16_products", "choose_variant", "compile_variant", "cpu_flags", "full_attention",
           "gelu_tanh", "linear", "load_variant", "measure_row_ranges", "median_seconds", "paged_decode_attention",
           "rms_norm", "rope_store", "route_linears", "route_norms", "runnable_variants", "set_row_ranges", "variant"]
