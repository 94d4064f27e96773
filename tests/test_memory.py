"""experiments/memory.py: after many heap blocks are freed (the last one kept, so the heap's top cannot shrink on its
own), trim() gives their pages back to the system: the resident set falls by most of what was freed; without the call
it stays. In a fresh process (the allocator's state is per process)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys
    from experiments.memory import trim

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def rss_kb():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

    blocks = [libc.malloc(64 << 10) for _ in range(1600)]  # 100 MiB of 64-KiB blocks: below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)
    before = rss_kb()
    took = trim() if sys.argv[1] == "on" else None
    print(took, (before - rss_kb()) // 1024)
    """
)


def _run(mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_trim_gives_freed_heap_pages_back():
    took, freed_mb = _run("on")
    assert took == "True" and int(freed_mb) >= 80  # of the 100 MiB freed
    took, freed_mb = _run("off")
    assert took == "None" and int(freed_mb) < 10
