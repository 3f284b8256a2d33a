"""The hybrid study of docs/results.md §11 (issue 59), one entry per part:

    python experiments/hybrids.py mqar [ARGS]      # (a) MQAR in hybrid stacks: experiments/hybrid_stacks.py
    python experiments/hybrids.py text [ARGS]      # (b) books in hybrid stacks: experiments/hybrid_text.py
    python experiments/hybrids.py convert [ARGS]   # (c) dense heads in a converted model: experiments/hybrid_heads.py

ARGS go to that part's script (`python experiments/hybrids.py mqar --help`).
"""

from __future__ import annotations

import sys

PARTS = {"mqar": "hybrid_stacks", "text": "hybrid_text", "convert": "hybrid_heads"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in PARTS:
        print(__doc__, file=sys.stderr)
        print(f"hybrids.py: the first argument must be one of {list(PARTS)}, got {argv[0] if argv else 'nothing'!r}",
              file=sys.stderr)
        return 2
    part = __import__(PARTS[argv[0]])
    return part.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
