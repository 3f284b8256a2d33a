"""Decoding that trusts nothing it is handed: caches made for another model, inconsistent direct calls of
`decode_ring`, the compiled step (`decode_native.check_step`, then `decode_native.run`) and the C function
itself, the compiled library's folder, a wide gate in a thread with a small stack, non-finite values in slots
nobody reads, and an empty batch.

Cases that crashed the interpreter before (SIGFPE, SIGSEGV, SIGBUS) run in a child process, so that they
fail as a test rather than end the run.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import piattn.ops.pi.decode_native as decode_native
import piattn.ops.pi.native as native
from piattn.config import PI_DEFAULTS
from piattn.config.pi import GATED_VARIANTS, VARIANTS
from piattn.decoding.cache import RingCache
from piattn.models import GPT, GPTConfig
from piattn.ops.pi import decode
from piattn.ops.pi.decode import decode_settings, pi_decode

# One pytest worker runs this file (make test: --dist loadgroup): `built_once` builds its library once.
pytestmark = pytest.mark.xdist_group("decode_trust")

HAS_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler ($CC or cc) to build the compiled decoding step")


@pytest.fixture
def torch_ops(monkeypatch):
    """The compiled step switched off for one test: decoding runs in torch ops."""
    monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})


@pytest.fixture(params=["compiled", "torch ops"])
def step_kind(request, monkeypatch):
    """Each test twice: through the compiled step where a compiler exists, and in torch ops."""
    if request.param == "compiled":
        if not HAS_CC:
            pytest.skip("no C compiler")
        assert native.unavailable() is None, native.unavailable()
    else:
        monkeypatch.setattr(native, "_state", {"functions": None, "reason": "switched off by the test"})
    return request.param


def _child(code: str, tmp_path, *, own_cache: bool = True, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: with PIATTN_CACHE in tmp_path (unless given), or, for a child that
    tests no library folder (`own_cache=False`), the cache this process uses, whose kernels are built already
    (a fresh folder costs a build of the fused kernels, ~15 s, the first time a model runs)."""
    cache = {"PIATTN_CACHE": str(tmp_path)} if own_cache else {}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **cache, **env})


def decode_ring(q, kv_store, gate, *, capacity, position, gate_head=None, scale, **settings):
    """`decode.decode_ring` with its settings spelled as keywords, as the cases here write them (built as given:
    decode_ring checks them)."""
    return decode.decode_ring(q, kv_store, gate, decode_settings(PI_DEFAULTS, scale)._replace(**settings),
                              capacity=capacity, position=position, gate_head=gate_head)


def ring_step(q, kv_store, slot, valid, kind, *, prior_mode, gate=None, gate_weight=None, gate_bias=None,
              logit_clamp, eps, scale):
    """One query of the compiled step on arguments built by hand: `decode_native.check_step`, then
    `decode_native.run` with a stand-in for the plan (the slot kinds, prior mode and settings it reads)."""
    layers = None if gate_weight is None and gate_bias is None else (gate_weight, gate_bias)
    decode_native.check_step(q, kv_store, slot, valid, kind, prior_mode, gate, layers)
    plan = SimpleNamespace(kind=kind, prior_mode=prior_mode, log_priors=(0.0, 0.0), n_heads=q.shape[1],
                           settings=SimpleNamespace(logit_clamp=logit_clamp, eps=eps, scale=scale))
    return decode_native.run(plan, q, kv_store, slot, valid, gate, layers)


def _one_line_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# Finding 2: a cache knows what it was made for; decode_ring, ring_step and the C step check every size.

def _gpt(**extra) -> GPT:
    kw = dict(attention="pi", vocab_size=50, dropout=0.0, n_layer=2, d_model=32, n_head=4, window=2, period=5)
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", **{**kw, **extra})).eval()


# model's settings, the settings of the model whose cache it is given, that cache's batch, the error
MISMATCHES = {
    "larger batch": ({}, {}, 3, r"^cache was made for batch 3 with 4 key/value heads"),
    "no sink slots": (dict(sinks=2), {}, 1, r"^cache was made for a ring of 6 positions and 0 sinks, but this layer "
                                            r"needs at least 6 positions and 2 sinks"),
    "smaller ring": ({}, dict(period=3), 1, r"^cache was made for a ring of 4 positions"),
    "fewer key/value heads": (dict(n_kv_head=2), {}, 1, r"^cache was made for batch 1 with 4 key/value heads"),
    "another depth": ({}, dict(n_layer=3), 1, r"^cache was made for 3 layers, but this model has 2"),
    "a ring for dense attention": (dict(attention="dense"), {}, 1, r"^cache is a ring of 6 positions, but this layer "
                                                                   r"reads every position"),
}


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_cache_made_for_another_model_is_refused_in_one_line(case, tokens, step_kind):
    """Before: the compiled step returned wrong logits for the first three, and read past the ring for the
    second; now the first forward with such a cache raises, and the cache is left as it was."""
    own, other, batch, match = MISMATCHES[case]
    model, cache = _gpt(**own), _gpt(**other).init_cache(batch)
    idx = torch.randint(0, 50, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _one_line_value_error(lambda: model(idx, cache), match)
        assert cache.position == 0
        good = model.init_cache(1)  # the model's own cache decodes what the full forward computes
        torch.testing.assert_close(model(idx, good), model(idx), rtol=0, atol=2e-5)


def test_a_cache_with_more_key_value_heads_than_query_heads_is_refused(tmp_path):
    """Before: the one-head keys broadcast into the 8-head cache and the compiled step divided H = 4 by
    H_kv = 8, then by the group size 0: SIGFPE."""
    done = _child("""
        import torch
        from piattn.models import GPT, GPTConfig
        kw = dict(attention="pi", vocab_size=50, dropout=0.0, n_layer=2, window=2, period=5)
        model = GPT(GPTConfig.from_name("tiny", d_model=32, n_head=4, n_kv_head=1, **kw)).eval()
        cache = GPT(GPTConfig.from_name("tiny", d_model=64, n_head=8, **kw)).init_cache(1)  # 8 heads of width 8
        try:
            with torch.no_grad():
                model(torch.zeros(1, 1, dtype=torch.long), cache)
        except ValueError as err:
            print("ValueError:", err)
    """, tmp_path, own_cache=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ValueError: cache was made for batch 1 with 8 key/value heads of width 8, but "
                                  "this layer runs batch 1 with 1 of width 8")


def test_a_ring_cache_refuses_keys_of_another_shape():
    """Before: one sequence's keys [1, …] were broadcast into every row of a batch-3 cache."""
    cache = RingCache(3, 2, 4, capacity=5)
    for k in (torch.zeros(1, 2, 1, 4), torch.zeros(3, 1, 1, 4), torch.zeros(3, 2, 1, 5), torch.zeros(3, 2, 4)):
        _one_line_value_error(lambda k=k: cache.append(k, k), r"^k must have shape \[B, H_kv, t, D\] = \[3, 2, t, 4\]")
    _one_line_value_error(lambda: cache.append(torch.zeros(3, 2, 2, 4), torch.zeros(3, 2, 1, 4)), r"^k and v must")
    assert cache.seen == 0
    _one_line_value_error(lambda: RingCache(1, 0, 4, capacity=5), r"^n_heads must be an int >= 1")
    _one_line_value_error(lambda: RingCache(1, 2, 4, capacity=5, sinks=-1), r"^sinks must be an int >= 0")


def _ring_case(B=2, H=4, H_kv=2, D=8, N=20, capacity=9, sinks=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    cache = RingCache(B, H_kv, D, capacity, sinks=sinks, dtype=dtype)
    cache.append(torch.randn(B, H_kv, N, D, generator=g, dtype=dtype), torch.randn(B, H_kv, N, D, generator=g,
                                                                                    dtype=dtype))
    return dict(q=torch.randn(B, H, 1, D, generator=g, dtype=dtype), kv_store=cache.kv,
                gate=torch.full((B, H, 1), 0.3, dtype=dtype), capacity=capacity, position=N - 1, window=3, period=8,
                variant="adaptive", prior=0.3, logit_clamp=4.0, eps=1e-3, scale=D**-0.5, sinks=sinks)


def _kv(B=2, H_kv=2, N=11, D=8):
    return torch.zeros(2, B, H_kv, N, D)


HIDDEN = torch.zeros(2, 1, 6)
SMALL_RING = r"^capacity must be an int >= max\(window, period\) \+ 1 = 9"
# Inconsistent calls of decode_ring (on the case above: B 2, H 4, H_kv 2, D 8, ring 9 + 2 sinks) and the
# start of their error. Before, most returned numbers (some read past the buffers), the rest raised from
# deep inside torch or C.
BAD_RING_CALLS = {
    "kv_store of a larger batch": (dict(kv_store=_kv(B=3)), r"^kv_store must be a ring cache's storage"),
    "kv_store of a smaller batch": (dict(kv_store=_kv(B=1)), r"^kv_store must be a ring cache's storage"),
    "kv_store without sink slots": (dict(kv_store=_kv(N=9)), r"^kv_store must be a ring cache's storage"),
    "kv_store of a smaller ring": (dict(kv_store=_kv(N=8), capacity=6), SMALL_RING),
    "capacity below the reach": (dict(capacity=8), SMALL_RING),
    "capacity larger than the store": (dict(capacity=12), r"^kv_store must be a ring cache's storage"),
    "more key/value heads than query heads": (dict(kv_store=_kv(H_kv=8)), r"^kv_store's H_kv = 8 key/value heads"),
    "key/value heads not dividing": (dict(kv_store=_kv(H_kv=3)), r"^kv_store's H_kv = 3 key/value heads"),
    "another head width": (dict(kv_store=_kv(D=4)), r"^kv_store must be a ring cache's storage"),
    "kv_store of 4 dims": (dict(kv_store=torch.zeros(2, 2, 11, 8)), r"^kv_store must be a ring cache's storage"),
    "two queries": (dict(q=torch.zeros(2, 4, 2, 8)), r"^q must be a tensor \[B, H, 1, D\]"),
    "q of 3 dims": (dict(q=torch.zeros(2, 4, 8)), r"^q must be a tensor \[B, H, 1, D\]"),
    "no gate for adaptive": (dict(gate=None), r"^gate must be α \[B, H, 1\] = \(2, 4, 1\)"),
    "gate of another batch": (dict(gate=torch.full((3, 4, 1), 0.3)), r"^gate must be α"),
    "gate of 2 dims": (dict(gate=torch.full((2, 4), 0.3)), r"^gate must be α"),
    "gate for union": (dict(variant="union"), r"^gate is only used by variants"),
    "gate_head for separate": (dict(variant="separate", gate=HIDDEN, gate_head=(torch.zeros(4, 6), torch.zeros(4))),
                               r"^gate_head is taken by variant 'adaptive' only"),
    "α given with gate_head": (dict(gate_head=(torch.zeros(4, 6), torch.zeros(4))),
                               r"^gate must be the gate MLP's hidden layer"),
    "gate_head weight of another width": (dict(gate=HIDDEN, gate_head=(torch.zeros(4, 5), torch.zeros(4))),
                                          r"^gate_head must be \(weight"),
    "gate_head bias of another size": (dict(gate=HIDDEN, gate_head=(torch.zeros(4, 6), torch.zeros(3))),
                                       r"^gate_head must be \(weight"),
    "negative position": (dict(position=-1), r"^position must be an int >= 0"),
    "negative window": (dict(window=-1), r"^window must be an int >= 0"),
    "unknown variant": (dict(variant="both"), r"^variant must be one of"),
    "zero scale": (dict(scale=0.0), r"^scale must be a number > 0"),
}


@pytest.mark.parametrize("case", list(BAD_RING_CALLS))
def test_decode_ring_refuses_every_inconsistent_call_in_one_line(case, step_kind):
    change, match = BAD_RING_CALLS[case]
    args = {**_ring_case(), **change}
    q, kv_store, gate = args.pop("q"), args.pop("kv_store"), args.pop("gate")
    _one_line_value_error(lambda: decode_ring(q, kv_store, gate, **args), match)


def test_decode_ring_still_takes_what_is_consistent(step_kind):
    """The checks leave valid calls alone: a ring larger than the pattern needs, and all four variants."""
    args = _ring_case()
    q, kv_store, gate = args.pop("q"), args.pop("kv_store"), args.pop("gate")
    for variant in VARIANTS:
        y = decode_ring(q, kv_store, gate if variant in GATED_VARIANTS else None,
                        **{**args, "variant": variant})
        assert y.shape == q.shape and bool(y.isfinite().all())


def _step_args():
    args = _ring_case(B=2, H=4, H_kv=2, D=8, N=20, capacity=9, sinks=0)
    slot = torch.arange(5, dtype=torch.int64)
    return dict(q=args["q"], kv_store=args["kv_store"], slot=slot, valid=None, kind=torch.tensor([0, 0, 0, 0, 1]),
                prior_mode=native.PRIOR_NONE, logit_clamp=4.0, eps=1e-3, scale=0.25)


BAD_STEP_CALLS = {
    "slot past the store": (dict(slot=torch.tensor([0, 1, 2, 3, 9])), r"^slot must index rows 0 … N − 1"),
    "negative slot": (dict(slot=torch.tensor([0, 1, -1, 3, 4])), r"^slot must index rows 0 … N − 1"),
    "kind out of range": (dict(kind=torch.tensor([0, 0, 2, 0, 1])), r"^kind must hold 0"),
    "more key/value heads than query heads": (dict(kv_store=torch.zeros(2, 2, 8, 9, 8)), r"^kv_store's H_kv = 8"),
    "kv_store of another batch": (dict(kv_store=torch.zeros(2, 3, 2, 9, 8)), r"^kv_store must be a tensor"),
    "int32 slot": (dict(slot=torch.arange(5, dtype=torch.int32)), r"^slot must be an int64 tensor"),
    "kind shorter than slot": (dict(kind=torch.tensor([0, 0, 1])), r"^kind must be an int64 tensor \[S\] with S = 5"),
    "valid shorter than slot": (dict(valid=torch.ones(1, 3, dtype=torch.bool)), r"^valid must be None or a bool"),
    "strided slot": (dict(slot=torch.arange(10)[::2]), r"^slot must be contiguous"),
    "unknown prior mode": (dict(prior_mode=7), r"^prior_mode must be one of"),
    "no α for PRIOR_ALPHA": (dict(prior_mode=native.PRIOR_ALPHA), r"^gate must be α \[B, H, 1\]"),
    "gate for PRIOR_NONE": (dict(gate=torch.zeros(2, 4, 1)), r"^gate, gate_weight and gate_bias are read by"),
    "hidden weight of another width": (dict(prior_mode=native.PRIOR_HIDDEN, gate=torch.zeros(2, 1, 6),
                                            gate_weight=torch.zeros(4, 5), gate_bias=torch.zeros(4)),
                                       r"^gate_weight must be \[H, n_hidden\] = \(4, 6\)"),
    "hidden bias of another size": (dict(prior_mode=native.PRIOR_HIDDEN, gate=torch.zeros(2, 1, 6),
                                         gate_weight=torch.zeros(4, 6), gate_bias=torch.zeros(2)),
                                    r"^gate_bias must be \[H\]"),
    "two queries": (dict(q=torch.zeros(2, 4, 2, 8)), r"^q must be a tensor \[B, H, 1, D\]"),
}


@needs_cc
@pytest.mark.parametrize("case", list(BAD_STEP_CALLS))
def test_ring_step_refuses_every_inconsistent_call_in_one_line(case):
    """Shapes are checked in Python before the ctypes call; the contents of slot and kind by the C step
    itself, before it reads anything (the first three cases)."""
    assert native.unavailable() is None
    change, match = BAD_STEP_CALLS[case]
    args = {**_step_args(), **change}
    _one_line_value_error(lambda: ring_step(**args), match)


@needs_cc
def test_the_c_step_checks_every_size_itself(tmp_path, built_library):  # the child loads a copy: no build
    """The C function called straight through ctypes with what Python would refuse: it returns an error code
    (1 sizes, 2 slot, 3 kind, 4 prior) having read nothing. Before: H_kv > H divided by zero (SIGFPE), and
    a slot past N was read."""
    done = _child("""
        import ctypes, torch
        import piattn.ops.pi.native as native
        f = native._load()[torch.float64]
        q, kv, y = torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(2, 1, 4, 3, 4, dtype=torch.float64), \\
            torch.zeros(1, 2, 1, 4, dtype=torch.float64)
        gate = torch.full((1, 2, 1), 0.5, dtype=torch.float64)
        new = torch.zeros(1, 2, 1, 4, dtype=torch.float64)  # a new token's key and value, for the fused step
        cos, sin = torch.ones(4), torch.zeros(4)
        def call(H_kv=1, N=3, slot=(0, 1, 2), kind=(0, 0, 1), mode=0, B=1, gate_ptr=0, pointers=True, Q=1,
                 fresh=False, fresh_slot=0, rope=False, D=4, packed=None, slot_sh=0):
            s, k = torch.tensor(slot), torch.tensor(kind)
            ptr = lambda t: t.data_ptr() if pointers else 0
            args = native.ARGS.pack(ptr(q), 8, 4, 4, ptr(kv), B, 2, H_kv, N, D, Q, s.data_ptr(), 0, slot_sh,
                                     k.data_ptr(),
                                     len(kind), mode, 0.0, 0.0, gate_ptr, 2, 1, 1, 0, 0, 0, 0.5, 4.0, 1e-3, ptr(y),
                                     new.data_ptr() if fresh else 0, 8, fresh_slot, cos.data_ptr() if rope else 0,
                                     sin.data_ptr() if rope else 0, 0, 0, 0, 0)
            return f(args if packed is None else packed)
        print(call(), call(H_kv=4), call(H_kv=0), call(N=0), call(slot=(0, 1, 3)), call(slot=(0, -1, 2)),
              call(kind=(0, 2, 1)), call(mode=9), call(mode=2), call(mode=2, gate_ptr=gate.data_ptr()),
              call(B=-1), call(B=0, pointers=False), call(Q=0),
              call(Q=2, slot=(0, 1, 2, 0, 1, 3), kind=(0, 0, 1)),  # the second query's slots are checked too
              # the fused one-token step: its row in range, one query, an even D under RoPE
              call(fresh=True, fresh_slot=2, rope=True), call(fresh=True, fresh_slot=3),
              call(fresh=True, fresh_slot=-1),
              call(fresh=True, Q=2, slot=(0, 1, 2, 0, 1, 2)), call(rope=True, D=3, slot=(0, 0, 0)),
              call(mode=-(2**40)), call(mode=2**40),  # a prior mode past an int is refused, not truncated
              call(mode=5), call(mode=4, gate_ptr=gate.data_ptr()),  # past the last mode; the gate's layers missing
              # one slot table per head (per-head periods): every head's table checked, none overlapping another
              call(slot=(0, 1, 2, 2, 1, 0), slot_sh=3), call(slot=(0, 1, 2, 0, 1, 3), slot_sh=3),
              call(slot=(0, 1, 2, 0, 1, 2), slot_sh=2), call(slot=(0, 1, 2, 0, 1, 2), slot_sh=-3))
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1", "1", "1", "2", "2", "3", "4", "4", "0", "1", "0", "1", "2",
                                   "0", "2", "2", "1", "1", "4", "4", "4", "4", "0", "2", "1", "1"]


# ---------------------------------------------------------------------------------------------------------------
# Finding 3: what the compiled step loads is verified, rebuilt when it fails, from a folder private to the user.

LOAD = "import warnings, piattn.ops.pi.native as n; warnings.simplefilter('always'); print(n.unavailable())"


def _library(tmp_path):
    built = list((tmp_path / "native").glob("decode_step-*.so"))
    assert len(built) == 1
    return built[0]


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """A cache folder whose library a child process built and loaded: built once (seconds of C compiling)
    for the tests below, each of which gets its own copy to tamper with."""
    folder = tmp_path_factory.mktemp("built")
    done = _child(LOAD, folder)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
    _library(folder)
    return folder


@pytest.fixture
def built_library(built_once, tmp_path):
    """The library in `tmp_path`'s own private `native` folder (a copy of `built_once`'s, modes kept)."""
    shutil.copytree(built_once / "native", tmp_path / "native")
    path = _library(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "native").st_mode) == 0o700 and _verified(path)
    return path


def _verified(path) -> bool:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() == path.with_name(path.name + ".sha256").read_text().strip()


@needs_cc
def test_a_new_library_folder_is_private_and_the_library_carries_its_hash(built_once):
    """`built_once` is a fresh folder's first build (the child that made it loaded it: no warning)."""
    assert stat.S_IMODE(os.stat(built_once / "native").st_mode) == 0o700
    assert _verified(_library(built_once))


@needs_cc
@pytest.mark.parametrize("left", [100, 0.5])
def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path, built_library, left):
    """A build killed half-way or a full disk: before, loading half the library killed every later process
    with SIGBUS, and a stub of 100 bytes disabled the step for ever as 'could not build … set CC'."""
    path = built_library
    data = path.read_bytes()
    path.write_bytes(data[:left if isinstance(left, int) else int(len(data) * left)])
    done = _child(LOAD, tmp_path)
    assert done.returncode == 0, f"the child died with {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "None" and "Warning" not in done.stderr
    assert _verified(path) and path.stat().st_size > 1000


PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
  if (f) fclose(f);
}
long long pi_step_args_size(void) { return 280; }
int pi_decode_step_packed_f32(const void *a) { return 0; }
int pi_decode_step_packed_f64(const void *a) { return 0; }
"""


def _plant(tmp_path, path, *, with_hash: bool) -> None:
    """Put a library whose loading leaves a marker file at `path` (and its hash beside it, if asked)."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    if with_hash:
        import hashlib

        path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())


@needs_cc
def test_a_library_the_build_did_not_write_is_never_run(tmp_path, built_library):
    """Before: any library at the predictable name was loaded and its code ran."""
    path = built_library
    _plant(tmp_path, path, with_hash=False)
    marker = tmp_path / "ran"
    done = _child(LOAD, tmp_path, PLANTED_MARKER=str(marker))
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    assert done.stdout.strip() == "None" and _verified(path)


@needs_cc
def test_an_unloadable_library_with_a_good_hash_is_rebuilt(tmp_path, built_library):
    """A verified library that still does not load (another machine's, a broken copy with its hash): rebuilt,
    not reported as a missing compiler."""
    path = built_library
    path.write_bytes(b"not a shared library")
    path.with_name(path.name + ".sha256").write_text(__import__("hashlib").sha256(b"not a shared library").hexdigest())
    done = _child(LOAD, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stdout + done.stderr[-2000:]
    assert _verified(path) and path.stat().st_size > 1000


@needs_cc
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_folder_others_can_write_to_is_refused(tmp_path, built_library, mode):
    """A shared PIATTN_CACHE: another user could put a library and its hash there. Nothing is loaded from
    it, with a warning that says why; decoding runs in torch ops."""
    path = built_library
    _plant(tmp_path, path, with_hash=True)
    os.chmod(tmp_path / "native", mode)
    marker = tmp_path / "ran"
    done = _child(LOAD, tmp_path, PLANTED_MARKER=str(marker))
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
    assert done.stdout.startswith(f"will not load compiled code from a folder others control: {tmp_path / 'native'} "
                                  f"can be written by group or others (mode {mode:o})")
    assert "RuntimeWarning" in done.stderr and "PIATTN_CACHE" in done.stderr


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / "native").mkdir(mode=0o700)
    monkeypatch.setenv("PIATTN_CACHE", str(tmp_path))
    monkeypatch.delenv("PIATTN_NATIVE", raising=False)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.warns(RuntimeWarning, match="set PIATTN_CACHE to a folder of your own"):
        reason = native.unavailable()
    assert reason.startswith(f"will not load compiled code from a folder others control: {tmp_path / 'native'} "
                             "belongs to user id")
    assert not list((tmp_path / "native").iterdir())  # nothing was built there either


# ---------------------------------------------------------------------------------------------------------------
# Finding 4: the gate's hidden row no longer lives on the C stack.

@needs_cc
def test_a_wide_gate_decodes_in_a_thread_with_a_small_stack(tmp_path, built_library):  # loads a copy: no build
    """n_hidden = 40 000 in fp64 is 320 KB: before, on a 256 KiB thread stack, SIGSEGV."""
    done = _child("""
        import threading, torch
        import piattn.ops.pi.native as native
        import piattn.ops.pi.decode_native as decode_native
        from piattn.config import PI_DEFAULTS
        from piattn.ops.pi.decode import gate_tail
        from piattn.ops.pi.decode_plan import decode_plan, decode_settings
        assert native.unavailable() is None
        g = torch.Generator().manual_seed(0)
        f64 = dict(dtype=torch.float64)
        kv = torch.randn(2, 1, 2, 9, 8, generator=g, **f64)
        q = torch.randn(1, 2, 1, 8, generator=g, **f64)
        hidden = torch.randn(1, 1, 40_000, generator=g, **f64)
        weight, bias = torch.randn(2, 40_000, generator=g, **f64) / 200, torch.zeros(2, **f64)
        settings = decode_settings(PI_DEFAULTS, 0.5)._replace(window=3, period=8, sinks=0, variant="adaptive",
                                                              logit_clamp=None, eps=1e-3)
        plan = decode_plan(settings, 2, capacity=9)
        slot, valid = plan.ring_slots(30)
        kind, slot = plan.kind, slot[0]  # one table for both heads
        out = {}

        def step():
            out["y"] = decode_native.run(plan, q, kv, slot, valid, hidden, (weight, bias))

        threading.stack_size(256 * 1024)
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        alpha = 1e-3 + (1 - 2e-3) * gate_tail(hidden, weight, bias).transpose(1, 2)  # [1, 2, 1]
        z = (q * kv[0].index_select(2, slot)).sum(-1) * 0.5 + torch.where(kind == 1, (1 - alpha).log(), alpha.log())
        ref = (z.softmax(-1)[..., None] * kv[1].index_select(2, slot)).sum(2, keepdim=True)
        print(float((out["y"] - ref).abs().max()))
    """, tmp_path)
    assert done.returncode == 0, f"the child died with {done.returncode}: {done.stderr[-2000:]}"
    assert float(done.stdout) < 1e-12


# ---------------------------------------------------------------------------------------------------------------
# Finding 5: decoding in torch ops keeps non-finite values in the rows that read them; an empty batch decodes.



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_value_no_row_reads_stays_out_of_pi_decode(bad, where, variant, dtype):
    """Position 5 (window 3, period 8) reads 2 … 5; its skip slot (−3) reads nothing and points at row 0.
    Before: weight 0 times an inf or NaN value there was NaN (a key there was already masked)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g).to(dtype) for _ in range(3))
    gate = torch.full((1, 2, 6), 0.3)
    kw = dict(window=3, period=8, variant=variant, logit_clamp=4.0)
    gated = variant in GATED_VARIANTS
    for t in (1, 2):  # t = 2: position 4 reads 1 … 4, and its skip slot (−4) reads nothing either
        poisoned = (k.clone(), v.clone())
        poisoned[0 if where == "key" else 1][:, :, 0] = bad
        clean = pi_decode(q[:, :, -t:], k, v, gate[:, :, -t:] if gated else None, **kw)
        y = pi_decode(q[:, :, -t:], *poisoned, gate[:, :, -t:] if gated else None, **kw)
        assert bool(y.isfinite().all()), f"t={t}"
        torch.testing.assert_close(y, clean, rtol=0, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_non_finite_value_no_row_reads_stays_out_of_the_ring_step(variant, torch_ops):
    """The same through a ring cache, before it fills (position 5 of a ring of 9): the skip slot reads
    nothing and points at position 0's slot."""
    args = _ring_case(B=1, H=2, H_kv=1, D=4, N=6, capacity=9, sinks=0)
    q, kv_store, gate = args.pop("q"), args.pop("kv_store"), args.pop("gate")
    args["variant"] = variant
    gate = gate if variant in GATED_VARIANTS else None
    clean = decode_ring(q, kv_store, gate, **args)
    kv_store[1, :, :, 0] = float("inf")  # position 0's value
    y = decode_ring(q, kv_store, gate, **args)
    assert bool(y.isfinite().all())
    torch.testing.assert_close(y, clean, rtol=0, atol=0)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_an_empty_batch_decodes_to_empty_rows(variant, sinks, step_kind):
    """Before: the torch-ops ring step raised 'cannot reshape tensor of 0 elements'."""
    gated = variant in GATED_VARIANTS
    for N in (3, 20):  # before the ring fills, and after
        args = _ring_case(B=0, H=4, H_kv=2, D=8, N=N, capacity=9, sinks=sinks)
        q, kv_store, gate = args.pop("q"), args.pop("kv_store"), args.pop("gate")
        y = decode_ring(q, kv_store, gate if gated else None, **{**args, "variant": variant})
        assert y.shape == (0, 4, 1, 8)
        k = torch.zeros(0, 2, N, 8)
        assert pi_decode(torch.zeros(0, 4, 2, 8), k, k, torch.zeros(0, 4, 2) if gated else None, window=3, period=8,
                         variant=variant, sinks=sinks).shape == (0, 4, 2, 8)


def test_an_empty_batch_runs_through_a_model_step(step_kind):
    model = _gpt()
    cache = model.init_cache(0)
    with torch.no_grad():
        for _ in range(3):
            assert model(torch.zeros(0, 1, dtype=torch.long), cache).shape == (0, 1, 50)
    assert cache.position == 3


def test_the_torch_ops_step_reads_a_cache_of_another_dtype(torch_ops):
    """An fp32 step with an fp64 cache: each operand is brought to the accumulation dtype on its own (before,
    only when q's dtype was not it: baddbmm then met fp32 and fp64)."""
    args = _ring_case(B=1, H=2, H_kv=1, D=4, N=12, capacity=9, sinks=0, dtype=torch.float64)
    q, kv_store, gate = args.pop("q"), args.pop("kv_store"), args.pop("gate")
    y = decode_ring(q.float(), kv_store, gate.float(), **args)
    ref = decode_ring(q.float(), kv_store.float(), gate.float(), **args)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=0, atol=0)



def test_the_front_doors_check_and_the_binding_computes_no_rows():
    """The decoding calls that skip their argument checks (a plan's `rows` and `token`, a step's `run`: for
    callers whose inputs are right by construction) live on the plans and in the steps' modules; the front door
    of decoding (`decode`: `pi_decode`, `decode_ring`) checks what it is given, and the binding of the C step
    (`native`) computes no rows of its own, since the C step reads its buffers by the sizes it is told
    (inconsistent calls read past them; one ended in SIGSEGV)."""
    import inspect

    from piattn.ops.pi import decode, native

    rows = {name for name, f in inspect.getmembers(decode, inspect.isfunction) if f.__module__ == decode.__name__
            and not name.startswith("_") and "check" not in name}
    assert rows == {"pi_decode", "decode_ring"}
    for name in ("pi_decode", "decode_ring"):
        assert "check" in inspect.getsource(getattr(decode, name)).split('"""')[-1]
    public = {name for name in dir(native) if not name.startswith("_")}
    assert not any("step" in name or "unchecked" in name or "rows" in name for name in public), public
