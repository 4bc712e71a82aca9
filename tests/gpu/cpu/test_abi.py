"""The ctypes table of the CPU kernel library (`vx.gpu.cpu.abi`) agrees with the C header
(``vx/gpu/cpu/csrc/vx_kernels.h``): the same functions, the same number of arguments, and each
argument and result of the same kind (pointer, 64-bit or 32-bit integer, float, none).

Runs in: the test process; it parses text only and builds nothing.

Why: a ctypes binding that disagrees with the C passes the wrong bits without an error (an
int64 taken as an int, a float passed as an integer), so the table is held to the header,
which the compiler holds to the definitions (each kernel file includes it).
"""

from __future__ import annotations

import ctypes
import os
import re

from vx.gpu.cpu import abi as cpu_abi, library

_PROTOTYPE = re.compile(r"^(int64_t|int|void)\s+(vx_\w+)\(([^)]*)\);", re.M)


def _c_kind(decl: str) -> str:
    decl = decl.strip()
    if "*" in decl:
        return "pointer"
    ctype = decl.rsplit(None, 1)[0] if " " in decl else decl
    ctype = ctype.replace("const ", "").strip()
    return {"int64_t": "i64", "int": "i32", "int32_t": "i32", "float": "f32", "void": "none"}[
        ctype
    ]


def _ctypes_kind(t: type | None) -> str:
    return {
        ctypes.c_void_p: "pointer",
        ctypes.c_int64: "i64",
        ctypes.c_int: "i32",
        ctypes.c_float: "f32",
        None: "none",
    }[t]


def header_prototypes() -> dict[str, tuple[str, list[str]]]:
    """{function: (result kind, [argument kinds])} of every prototype in vx_kernels.h."""
    with open(os.path.join(library.CSRC, "vx_kernels.h")) as f:
        text = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
    found = {}
    for ret, name, args in _PROTOTYPE.findall(text):
        params = [a for a in (p.strip() for p in args.split(",")) if a and a != "void"]
        found[name] = (_c_kind(ret), [_c_kind(p) for p in params])
    return found


def test_the_header_declares_every_exported_function() -> None:
    protos = header_prototypes()
    assert len(protos) >= 50  # the parse found the prototypes
    assert set(protos) == set(cpu_abi.KERNEL_ABI)


def test_the_table_binds_what_the_header_declares() -> None:
    protos = header_prototypes()
    for name, (restype, argtypes) in cpu_abi.KERNEL_ABI.items():
        table = (_ctypes_kind(restype), [_ctypes_kind(t) for t in argtypes])
        assert table == protos[name], name


def test_optional_symbols_are_in_the_table() -> None:
    assert cpu_abi.OPTIONAL <= set(cpu_abi.KERNEL_ABI)


def test_a_missing_optional_symbol_does_not_fail_the_bind() -> None:
    class Lib:  # a library built without the optional symbols
        def __init__(self) -> None:
            for name in set(cpu_abi.KERNEL_ABI) - cpu_abi.OPTIONAL:
                setattr(self, name, ctypes.CFUNCTYPE(None)())

    lib = Lib()
    cpu_abi.bind_kernels(lib)  # type: ignore[arg-type]
    assert lib.vx_has_gemv.argtypes == []
    delattr(lib, "vx_has_gemv")
    try:
        cpu_abi.bind_kernels(lib)  # type: ignore[arg-type]
    except AttributeError:
        pass
    else:
        raise AssertionError("a missing required symbol must fail the bind")
