"""`python -m piattn.ops.pi.prebuild`: compile the C kernels now (the fused CPU backend, `fused_cpu.c`, and the
decoding step, `decode_step.c`) into the cache, so that no later call waits on the compiler in silence.

`make demo` and `make test` run it after installing; a user's first call otherwise builds what it needs (with a
line on stderr). Where a kernel cannot be built (no C compiler, `PIATTN_NATIVE=0`) it says why and exits 0:
piattn then runs those paths in torch ops, as it would anyway.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import cbuild, fused, native

KERNELS = {"fused CPU backend (fused_cpu.c)": fused.unavailable, "decoding step (decode_step.c)": native.unavailable}


def main() -> int:
    print(f"piattn: the C kernels, built into {cbuild.library_folder()} unless there already",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(KERNELS)) as pool:  # the two compilers side by side; each loads its cached library
        reasons = dict(zip(KERNELS, pool.map(lambda unavailable: unavailable(), KERNELS.values()), strict=True))
    for name, reason in reasons.items():
        if reason:
            print(f"piattn: {name} not built ({reason}); its torch path runs instead", file=sys.stderr)
    ready = sum(reason is None for reason in reasons.values())
    print(f"piattn: {ready} of {len(KERNELS)} C kernels ready ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
