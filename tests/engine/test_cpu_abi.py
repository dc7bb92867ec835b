"""engine/cpu/abi.py against engine/csrc/kernels.h: the dtype codes, mode bits and norm flavors, every struct's
fields (names, types, and where the C compiler puts them), every function's arguments. A kernel whose C signature
changes without its ctypes copy fails here, not as a wrong pointer at run time."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from engine.cpu import abi, build

HEADER = (build.FOLDER / "kernels.h").read_text()
# kernels.h's functions that only other kernels call (no ctypes signature).
INTERNAL = {"normalize_row"}
SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
STRUCTS = {"norm_weights": abi.NormArgs, "projection": abi.ProjectionArgs, "lean_layer": abi.LeanLayerArgs,
           "decode_step": abi.DecodeStepArgs}


def _code(header: str = HEADER) -> str:
    """The header without its comments, one space between words."""
    return " ".join(re.sub(r"/\*.*?\*/", " ", header, flags=re.S).split())


def _ctype(declaration: str) -> type:
    """The ctypes type of one C declaration's type ("const norm_weights *" -> POINTER(NormArgs), any other
    pointer -> c_void_p, a scalar or struct by name)."""
    words = declaration.replace("const ", "").replace("*", " * ").split()
    if "*" in words:
        return ctypes.POINTER(STRUCTS[words[0]]) if words[0] in STRUCTS else ctypes.c_void_p
    return STRUCTS.get(words[0]) or SCALARS[words[0]]


def _structs() -> dict[str, list[tuple[str, type]]]:
    """Each typedef struct of kernels.h: its fields in order, with their ctypes types."""
    found = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\} (\w+);", _code()):
        fields = []
        for member in filter(None, (m.strip() for m in body.split(";"))):
            kind, declarators = member.removeprefix("const ").split(" ", 1)
            for declarator in declarators.split(","):
                declarator = declarator.strip()
                pointer = declarator.startswith("*")
                fields.append((declarator.lstrip("*"), ctypes.c_void_p if pointer else _ctype(kind)))
        found[name] = fields
    return found


def _functions(header: str = HEADER) -> dict[str, tuple[str, list[type]]]:
    """Each function the header declares: its return type and its arguments' ctypes types."""
    code = re.sub(r"typedef struct \{.*?\} \w+;", " ", _code(header))
    found = {}
    for result, name, arguments in re.findall(r"((?:const )?\w+ \*?)\s*(\w+)\(([^)]*)\);", code):
        types = [] if arguments.strip() == "void" else [
            _ctype(argument.rsplit(" ", 1)[0] + (" *" if "*" in argument.rsplit(" ", 1)[1] else ""))
            for argument in (a.strip() for a in arguments.split(","))]
        found[name] = (result.strip(), types)
    return found


def test_codes_and_mode_bits_are_the_header_s():
    defines = {name: int(value) for name, value in re.findall(r"#define (\w+) (\d+)", HEADER)}
    enums = {name: int(value) for body in re.findall(r"enum \{(.*?)\}", _code())
             for name, value in re.findall(r"(\w+) = (\d+)", body)}
    assert (abi.MODE_GLU, abi.PRODUCTS_WIDEN, abi.MODE_GELU, abi.PRODUCTS_TILES) == (
        defines["MODE_GLU"], defines["PRODUCTS_WIDEN"], defines["MODE_GELU"], defines["PRODUCTS_TILES"])
    assert (abi.NORM_LLAMA, abi.NORM_GEMMA) == (enums["NORM_LLAMA"], enums["NORM_GEMMA"])
    assert abi.DTYPE_CODES == {torch.float32: enums["F32"], torch.bfloat16: enums["BF16"],
                               torch.float16: enums["F16"]}
    assert abi.I8 == enums["I8"]  # int8 weights of linear(), an int8 KV cache


def test_every_struct_has_the_header_s_fields_in_order():
    structs = _structs()
    assert set(structs) == set(STRUCTS)
    for name, fields in structs.items():
        mirror = [(field, kind) for field, kind in STRUCTS[name]._fields_]
        assert mirror == fields, name


def test_every_function_has_the_header_s_arguments():
    functions = _functions()
    assert set(functions) == set(abi.SIGNATURES) | INTERNAL | {"linear_isa"}
    assert functions["linear_isa"] == ("const char *", [])
    for name, argtypes in abi.SIGNATURES.items():
        result, declared = functions[name]
        assert result == "int", name
        assert argtypes == declared, name


def test_a_drifted_signature_is_caught():
    """The check itself: one argument's type changed in a copy of the header is seen as a difference."""
    drifted = HEADER.replace("int gelu_tanh(void *x, int dtype,", "int gelu_tanh(void *x, int64_t dtype,")
    assert drifted != HEADER and _functions(drifted)["gelu_tanh"][1] != abi.SIGNATURES["gelu_tanh"]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_every_struct_lies_where_the_compiler_puts_it(tmp_path):
    """Each field's offset and each struct's size as the C compiler lays them out, against ctypes'."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "kernels.h"', "int main(void) {"]
    for name, struct in STRUCTS.items():
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));' for field, _ in struct._fields_]
    source = tmp_path / "layout.c"
    source.write_text("\n".join([*lines, "return 0; }"]))
    program = tmp_path / "layout"
    subprocess.run(["cc", f"-I{build.FOLDER}", str(source), "-o", str(program)], check=True)
    printed = dict(line.split() for line in subprocess.run([str(program)], capture_output=True, text=True,
                                                            check=True).stdout.splitlines())
    for name, struct in STRUCTS.items():
        assert int(printed[name]) == ctypes.sizeof(struct), name
        for field, _ in struct._fields_:
            assert int(printed[f"{name}.{field}"]) == getattr(struct, field).offset, (name, field)


def test_loading_the_kernels_leaves_the_process_s_floats_alone():
    """The builds are compiled with -ffast-math, but linked without it: GCC 12 links crtfastmath.o into a shared
    library built with it, whose constructor turned on flush-to-zero and denormals-are-zero for the loading thread
    and the threads it starts (the server then parsed a top_k of 1e-320 as 0.0, an integer). In a fresh process,
    after every build this CPU runs is loaded, a subnormal survives parsing and arithmetic, there and in a new
    thread."""
    import sys

    script = """
import threading
from engine.cpu import build
loaded = [name for name in build.runnable_variants() if build.load_variant(name) is not None]
values = [float("1e-320"), 5e-324 * 3]
thread = threading.Thread(target=lambda: values.append(float("1e-320")))
thread.start()
thread.join()
print(len(loaded), *[v != 0.0 for v in values])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=build.FOLDER.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, *kept = done.stdout.split()
    assert int(loaded) >= 1 and kept == ["True", "True", "True"], done.stdout
