"""A pytest plugin (``-p tests.gpu.cpu.broken_kernel_source``) that appends a syntax error to the
CPU kernel source before any test builds it: `test_kernel_library.py` runs the suite's library
check under it to prove that a rejected source fails the suite with the compiler's message.
The error goes into a copy of ``vx/gpu/cpu/csrc`` (in a temporary folder), which the build then uses.

Runs in: that child pytest only; it changes nothing else.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

from tests.gpu.cpu.test_kernel_library import use_broken_sources

_copy = tempfile.mkdtemp(prefix="vx-broken-kernels-")
atexit.register(shutil.rmtree, _copy, True)
use_broken_sources(_copy)
