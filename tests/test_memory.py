"""experiments/memory.py: with return_freed_memory, a large block freed and asked for again is served by its own
mapping (given back to the system when freed); without it glibc raises its threshold at the first free and serves the
second from the heap, whose freed pages stay with the process. Each case in a fresh process (the threshold is
per-process state)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys
    from experiments.memory import return_freed_memory

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = Mallinfo2
    took = return_freed_memory() if sys.argv[1] == "on" else None
    size = 4 << 20
    libc.free(libc.malloc(size))  # the first free of a mapped block raises glibc's own threshold past it
    p = libc.malloc(size)
    print(took, libc.mallinfo2().hblkhd >= size)
    libc.free(p)
    """
)


def _run(mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_go_back_to_the_system():
    assert _run("on") == ["True", "True"]  # the allocator took the threshold; the block is mapped
    assert _run("off") == ["None", "False"]  # glibc's dynamic threshold: the same block from the heap
