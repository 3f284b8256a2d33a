"""src/piattn/ops/pi/README.md maps the paper's equations onto the code: every name it gives in a code span
still exists, so that a reader who follows it lands on the function it says.

What a span is checked as:
- a dotted name (`pattern.Pattern.offsets`, `torch._weights`, `piattn.analysis.min_depth`): resolved
  attribute by attribute from a module of `piattn.ops.pi`, a package of `piattn`, `piattn` itself, or a class
  defined in `piattn.ops.pi`, `piattn.layers` or `piattn.decoding` (then PyTorch, for `torch.where`);
- a file name (`decode_step.c`) in src/piattn/ops/pi, a path (`tests/ops/test_compile.py`) from the root;
- a bare identifier with an underscore (`_softmax_backward`, `fused_forward`): a whole word of some source
  file under src/piattn (Python, C or a header) or tests, a C function named with or without its precision
  (`pi_last_f32` is made by `FN(pi_last)`; `pi_fused_backward` names pi_fused_backward_f32 and its kin), or
  a method of torch.Tensor (`bernoulli_`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import torch

import piattn.decoding
import piattn.layers
import piattn.ops.pi

ROOT = Path(__file__).resolve().parents[2]
PI = ROOT / "src" / "piattn" / "ops" / "pi"
MAP = PI / "README.md"

DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")
IDENTIFIER = re.compile(r"(_?[A-Za-z]\w*_\w*)(?:\(.*\))?")
SOURCE_FILE = re.compile(r"[\w.]+\.(?:py|c|h)")
ROOT_PATH = re.compile(r"(?:tests|benchmarks)/[\w./-]+")


def spans() -> list[str]:
    return sorted(set(re.findall(r"`([^`\n]+)`", MAP.read_text(encoding="utf-8"))))


def _modules(package) -> list:
    return [importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)]


def _chain(obj, names: list[str]) -> bool:
    for i, name in enumerate(names):
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        if isinstance(obj, type) and i == len(names) - 1:  # a dataclass's or NamedTuple's field
            return any(name in inspect.get_annotations(cls) for cls in obj.__mro__)
        if not hasattr(obj, "__path__"):
            return False
        try:
            obj = importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            return False
    return True


def resolves(dotted: str, homes: list) -> bool:
    first, *rest = dotted.split(".")
    starts = []
    if first == "piattn":
        starts.append((importlib.import_module("piattn"), rest))
    if first == "__init__":
        starts.append((piattn.ops.pi, rest))
    for package in ("piattn.ops.pi", "piattn"):
        with contextlib.suppress(ImportError):
            starts.append((importlib.import_module(f"{package}.{first}"), rest))
    starts += [(module, [first, *rest]) for module in homes]
    if first == "torch":  # `torch._weights` is piattn's backend "torch" (tried above), `torch.where` PyTorch's
        starts.append((importlib.import_module("torch"), rest))
    return any(_chain(obj, names) for obj, names in starts)


PRECISIONS = ("_f32", "_f64", "_bf16", "_f16")


def words_of_the_sources() -> set[str]:
    words: set[str] = set()
    for path in [*(ROOT / "src" / "piattn").rglob("*"), *(ROOT / "tests").rglob("*.py")]:
        if path.suffix in (".py", ".c", ".h"):
            words |= set(re.findall(r"\w+", path.read_text(encoding="utf-8")))
    return words


def named(identifier: str, words: set[str]) -> bool:
    bare = next((identifier.removesuffix(p) for p in PRECISIONS if identifier.endswith(p)), identifier)
    return (bare in words or any(identifier + p in words for p in PRECISIONS)
            or hasattr(torch.Tensor, identifier))


def test_every_name_in_the_map_exists():
    homes = [piattn.ops.pi, *_modules(piattn.ops.pi), *_modules(piattn.layers), *_modules(piattn.decoding)]
    words = words_of_the_sources()
    missing, checked = [], 0
    for span in spans():
        if SOURCE_FILE.fullmatch(span):
            ok = (PI / span).is_file()
        elif ROOT_PATH.fullmatch(span):
            ok = (ROOT / span).exists()
        elif DOTTED.fullmatch(span) and not span.startswith(("torch.compile(", "torch._inductor.")):
            ok = resolves(DOTTED.fullmatch(span).group(1), homes)
        elif IDENTIFIER.fullmatch(span):
            ok = named(IDENTIFIER.fullmatch(span).group(1), words)
        else:
            continue
        checked += 1
        if not ok:
            missing.append(span)
    assert checked > 100, f"only {checked} spans checked: has the map's form changed?"
    assert not missing, f"src/piattn/ops/pi/README.md names what no longer exists: {missing}"


PAGES = [ROOT / "README.md", ROOT / "docs" / "design.md", MAP, PI / "TRITON.md"]


def test_every_piattn_name_in_the_pages_exists():
    """The README, the design and the ops/pi pages: a span that spells out `piattn.…` names something that
    exists (docs/results.md is a dated record of the code of its day, and is not checked)."""
    missing = []
    for page in PAGES:
        for span in sorted(set(re.findall(r"`(piattn\.[^`\n]+)`", page.read_text(encoding="utf-8")))):
            match = DOTTED.fullmatch(span)
            if match and not resolves(match.group(1), []):
                missing.append(f"{page.relative_to(ROOT)}: {span}")
    assert not missing, missing


def test_a_stale_name_is_caught():
    """The checks can fail: a renamed function, a moved file and a missing attribute are all reported."""
    homes = [piattn.ops.pi, *_modules(piattn.ops.pi)]
    assert resolves("weights.pi_attention_weights", homes) and resolves("Pattern.valid", homes)
    assert not resolves("reference._no_such_function", homes)
    assert not resolves("Pattern.no_such_attribute", homes)
    assert not (PI / "no_such_file.c").is_file()
    words = {"pi_last", "pi_fused_backward_f32", "softmax_rows"}
    assert named("pi_last_f32", words) and named("pi_fused_backward", words) and named("bernoulli_", words)
    assert not named("pi_first_f32", words) and not named("softmax_columns", words)
