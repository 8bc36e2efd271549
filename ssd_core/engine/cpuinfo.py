"""The CPU's name and flags from /proc/cpuinfo, without torch (the start-up bench reads them from outside the
app; engine.machine adds the thread count and the flags that change kernel rankings)."""
from __future__ import annotations

# instruction sets that change which kernel wins (recorded with every kernel choice, profile and start-up run)
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                "amx_bf16", "asimd", "sve")


def read_cpuinfo() -> tuple[str, set[str]]:
    """(the first "model name" / "Processor", the first "flags" / "Features" as a set); empty where unreadable."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Processor") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags
