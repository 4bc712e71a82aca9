"""A pytest plugin (``-p tests.gpu.broken_kernel_source``) that appends a syntax error to the
CPU kernel source before any test builds it: `test_kernel_library.py` runs the suite's library
check under it to prove that a rejected source fails the suite with the compiler's message.

Runs in: that child pytest only; it changes nothing else.
"""

from __future__ import annotations

from tests.gpu.test_kernel_library import BROKEN_LINE
from vx.gpu import kv_cache

kv_cache._DECODE_KERNEL_SOURCE += BROKEN_LINE + "\n"
