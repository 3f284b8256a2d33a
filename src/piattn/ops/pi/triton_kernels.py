"""The Triton kernels of backend "triton" (ops/pi/TRITON.md): one forward, two deterministic backward.

Query-side tensors (q, dY, y, dq, gate, statistics) are [N, T, ·] with N = B·H query heads; key-side
tensors (k, v, dk, dv) are [N_kv, T, D] with N_kv = B·H_kv, and query head n reads key/value head
n // group (grouped-query attention; group = H // H_kv, 1 for plain multi-head). A program owns a tile of
BLOCK_T rows (`_tile`, the prologue all three kernels share) and walks the rows it needs in chunks of
BLOCK_K: the local band through `tl.dot` on the chunk with a band mask, each skip offset as one shifted,
contiguous block of rows with a row-wise dot, and each sink slot as one gathered row per query. With
documents (HAS_DOCS), every position carries its document's bounds [start, end) and a slot is read only
when its key lies inside them. With per-head periods (PER_HEAD) each query head reads its own period from
PERIODS int32 [H] (`_head_period`): the skip code is that of the largest skip slot count N_SKIP, masked in a
head whose period lies in its window. The launchers are in `triton.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel MODE: constant priors ("union", "fixed"), priors from the gate ("adaptive"), two groups ("separate").
MODE_CONSTANT, MODE_ADAPTIVE, MODE_SEPARATE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Running-max start: finite, so that exp(m_old - m_new) is never exp(-inf + inf) in all-masked chunks.
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _tile(T, n_tiles, window, CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The prologue of every kernel: this program's head n (int64) and tile of rows [start, start + BT),
    the head's base offset in [·, T, D], the band's right reach and local slot count, the tile's
    positions [BT] with whether they lie inside [0, T), and the column offsets [D]."""
    pid = tl.program_id(0)
    n = (pid // n_tiles).to(tl.int64)
    start = (pid % n_tiles) * BLOCK_T
    base = n * T * D
    right = 0 if CAUSAL else window
    n_local = window + right + 1
    rows = start + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    offs_d = tl.arange(0, D)
    return n, start, base, right, n_local, rows, row_ok, offs_d


@triton.jit
def _head_period(PERIODS, h, window, N_SKIP: tl.constexpr):
    """Query head h's period π_h (PERIODS int32 [H]) and its skip slot count: N_SKIP, or 0 where π_h <= window
    (its skip keys lie in the band already: no skip slot, and its sink slots follow the local ones)."""
    period = tl.load(PERIODS + h)
    return period, (period > window).to(tl.int32) * N_SKIP


@triton.jit
def _skip_ok(keys, lo, hi, n_skip, PER_HEAD: tl.constexpr):
    """Whether a skip slot reads keys [R] (the rows of a skip offset): inside the documents [lo, hi) and, with
    per-head periods, only in a head that has skip slots (n_skip > 0). One period: the bounds alone."""
    ok = (keys >= lo) & (keys < hi)
    if PER_HEAD:
        # where, not `ok & (n_skip > 0)`: Triton 3.9's interpreter makes a block & scalar mask an int array,
        # which tl.load refuses
        ok = tl.where(n_skip > 0, ok, False)
    return ok


@triton.jit
def _bounds(START, END, b, rows, ok, T, HAS_DOCS: tl.constexpr):
    """The document [lo, hi) of each position rows [R] of batch row b (START, END int32 [B, T]); the whole
    sequence [0, T) without documents. Positions not ok get the empty [0, 0)."""
    if HAS_DOCS:
        lo = tl.load(START + b * T + rows, mask=ok, other=0)
        hi = tl.load(END + b * T + rows, mask=ok, other=0)
    else:
        lo = tl.zeros_like(rows)
        hi = tl.where(ok, T, 0)
    return lo, hi


@triton.jit
def _load_rows(ptr, base, rows, ok, offs_d, D: tl.constexpr):
    """rows [R] of a [*, T, D] tensor at `base` -> [R, D], zeros where not ok."""
    return tl.load(ptr + base + rows[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST: fp32 operands, for Triton's CPU interpreter, whose bf16 dots
    multiply bit patterns; the operands are already rounded to the input dtype, so the products agree."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _contained_dot(acc, a, b, reads, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b [M, D], where the rows of b [K, D] (keys, values, queries or cotangents of a chunk) may hold
    NaN or ±inf: a weight of 0 in a (a slot not read) would carry such a value to every output row (0·NaN =
    NaN). Where b holds any, its bad entries are left out of the product and the outputs that read them
    (reads [M, K] bool: row m reads row k) made NaN, column by column; what the "reference" gives. The check
    is one reduction of the chunk; the masked product runs only for a chunk that holds a bad value."""
    bad = ~(tl.abs(b.to(tl.float32)) < float("inf"))  # [K, D] NaN or ±inf
    if tl.max(tl.max(bad.to(tl.int32), 1), 0) > 0:
        acc += _dot(a, tl.where(bad, 0.0, b).to(b.dtype), DOT_PREC, UPCAST)
        hit = _dot(reads.to(b.dtype), bad.to(b.dtype), DOT_PREC, UPCAST)  # [M, D]: bad values read
        acc = tl.where(hit > 0, float("nan"), acc)
    else:
        acc += _dot(a, b, DOT_PREC, UPCAST)
    return acc


@triton.jit
def _row_dot(x, y):
    """Row-wise dot products of two [R, D] blocks, in fp32 -> [R]."""
    return tl.sum(x.to(tl.float32) * y.to(tl.float32), 1)


@triton.jit
def _clamp(z, clamp, HAS_CLAMP: tl.constexpr):
    if HAS_CLAMP:
        # A NaN score stays NaN, as under torch.clamp: plain min/max would return the bound, turning a NaN
        # input into a finite, wrong output.
        z = tl.minimum(tl.maximum(z, -clamp, propagate_nan=tl.PropagateNan.ALL), clamp,
                       propagate_nan=tl.PropagateNan.ALL)
    return z


@triton.jit
def _keep_factor(KEEP, n, T, qrows, slot, ok, keep_scale, N_SLOTS: tl.constexpr):
    """1/(1-p) where the dropout mask keeps (query, slot), else 0; qrows and slot broadcast together."""
    kept = tl.load(KEEP + (n * T + qrows) * N_SLOTS + slot, mask=ok, other=0)
    return tl.where(kept != 0, keep_scale, 0.0)


@triton.jit
def _band(rows, cols, lo, hi, col_ok, window, right, HAS_DOCS: tl.constexpr):
    """[len(rows), len(cols)]: key cols[j] is a local slot of query rows[i] (lo, hi [len(rows)]: the
    query's document; empty for rows outside [0, T)); also that slot's offset."""
    rel = cols[None, :] - rows[:, None]
    band = (rel >= -window) & (rel <= right) & col_ok[None, :] & (hi[:, None] > 0)
    if HAS_DOCS:
        band = band & (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    return band, rel


@triton.jit
def _sink_slot(s, rows, lo, hi, window, right, period, CAUSAL: tl.constexpr, N_SKIP: tl.constexpr):
    """Sink slot s of queries rows [R] in documents [lo, hi): its key lo + s, and whether the slot reads it
    (inside the document, not in the query's future when causal, and not a local or skip key already)."""
    key = lo + s
    d = key - rows
    ok = (key < hi) & ((d < -window) | (d > right))
    if CAUSAL:
        ok = ok & (d <= 0)
    if N_SKIP >= 1:
        ok = ok & (d != -period)
    if N_SKIP == 2:
        ok = ok & (d != period)
    return key, ok


@triton.jit
def _add_rows(acc, w, X, base, rows, offset, ok, offs_d, D: tl.constexpr):
    """acc [BT, D] + w[:, None] · X[rows + offset] (rows masked by ok)."""
    x = _load_rows(X, base, rows + offset, ok, offs_d, D)
    return acc + w[:, None] * x.to(tl.float32)


@triton.jit
def pi_fwd_kernel(
    Q, K, V, GATE, KEEP, START, END, PERIODS, OUT, C_LOC, C_SKIP,
    T, n_tiles, heads, group, window, period, scale, clamp, log_local, log_skip, eps, keep_scale,
    CAUSAL: tl.constexpr, N_SKIP: tl.constexpr, SINKS: tl.constexpr, N_SLOTS: tl.constexpr,
    MODE: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DOCS: tl.constexpr,
    PER_HEAD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Q, OUT [N, T, D]; K, V [N / group, T, D]; GATE [N, T]; KEEP uint8 [N, T, N_SLOTS]; START, END int32
    [N / heads, T]; PERIODS int32 [heads] (PER_HEAD; else `period` for every head); C_LOC, C_SKIP fp32
    [N, T]."""
    n, start, base, right, n_local, rows, row_ok, offs_d = _tile(T, n_tiles, window, CAUSAL, D, BLOCK_T)
    n_skip = N_SKIP  # this head's skip slots: its sink slots start at n_local + n_skip
    if PER_HEAD:
        period, n_skip = _head_period(PERIODS, n % heads, window, N_SKIP)
    kbase = (n // group) * T * D  # the key/value head this query head reads
    lo_q, hi_q = _bounds(START, END, n // heads, rows, row_ok, T, HAS_DOCS)  # each query's document
    q = _load_rows(Q, base, rows, row_ok, offs_d, D)  # [BT, D]

    # Skip scores first, so that the skip keys are never live beside the accumulator. Slot n_local is the
    # key i - period, slot n_local + 1 the key i + period (bidirectional); absent slots stay masked.
    z0 = tl.zeros([BLOCK_T], tl.float32)
    z1 = tl.zeros([BLOCK_T], tl.float32)
    ok0 = rows < 0
    ok1 = rows < 0
    if N_SKIP >= 1:
        ok0 = _skip_ok(rows - period, lo_q, hi_q, n_skip, PER_HEAD)
        z0 = _row_dot(q, _load_rows(K, kbase, rows - period, ok0, offs_d, D)) * scale
        z0 = _clamp(z0, clamp, HAS_CLAMP)
    if N_SKIP == 2:
        ok1 = _skip_ok(rows + period, lo_q, hi_q, n_skip, PER_HEAD)
        z1 = _row_dot(q, _load_rows(K, kbase, rows + period, ok1, offs_d, D)) * scale
        z1 = _clamp(z1, clamp, HAS_CLAMP)

    # Local band: key rows [start - window, start + BLOCK_T + right) inside [0, T), each loaded once;
    # online softmax. Rows of the last chunk past the band are not fetched.
    lo = tl.maximum(start - window, 0)
    hi = tl.minimum(start + BLOCK_T + right, T)
    m_loc = tl.full([BLOCK_T], _NEG, tl.float32)
    l_loc = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for c in range(0, tl.cdiv(hi - lo, BLOCK_K)):
        cols = lo + c * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK] key positions
        col_ok = cols < hi
        k = _load_rows(K, kbase, cols, col_ok, offs_d, D)  # [BK, D]
        v = _load_rows(V, kbase, cols, col_ok, offs_d, D)  # [BK, D]
        band, rel = _band(rows, cols, lo_q, hi_q, col_ok, window, right, HAS_DOCS)  # [BT, BK]
        z = _clamp(_dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale, clamp, HAS_CLAMP)
        z = tl.where(band, z, float("-inf"))  # [BT, BK]
        m_new = tl.maximum(m_loc, tl.max(z, 1))
        alpha = tl.exp(m_loc - m_new)
        p = tl.exp(z - m_new[:, None])  # exactly 0 off the band, since m_new is finite
        l_loc = l_loc * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = p * _keep_factor(KEEP, n, T, rows[:, None], rel + window, band, keep_scale, N_SLOTS)
        # In P·V a non-finite value would reach every query of the tile through its weight 0 (0·NaN = NaN).
        acc = _contained_dot(acc * alpha[:, None], p.to(v.dtype), v, band, DOT_PREC, UPCAST)
        m_loc = m_new

    # Sink slots join the local group (local prior, local branch of "separate"): one gathered key and
    # value row per query and slot, folded into the same online softmax.
    for s in range(0, SINKS):
        key, ok = _sink_slot(s, rows, lo_q, hi_q, window, right, period, CAUSAL, N_SKIP)
        z = _clamp(_row_dot(q, _load_rows(K, kbase, key, ok, offs_d, D)) * scale, clamp, HAS_CLAMP)
        m_new = tl.maximum(m_loc, tl.where(ok, z, _NEG))
        alpha = tl.exp(m_loc - m_new)
        p = tl.where(ok, tl.exp(z - m_new), 0.0)
        l_loc = l_loc * alpha + p
        if HAS_DROPOUT:
            p = p * _keep_factor(KEEP, n, T, rows, n_local + n_skip + s, ok, keep_scale, N_SLOTS)
        acc = acc * alpha[:, None] + p[:, None] * _load_rows(V, kbase, key, ok, offs_d, D).to(tl.float32)
        m_loc = m_new

    if MODE != MODE_CONSTANT:
        a = tl.load(GATE + n * T + rows, mask=row_ok, other=0.5).to(tl.float32)  # [BT] α
    if MODE == MODE_SEPARATE:
        # α·softmax(local) + (1 - α)·softmax(skip), the local branch alone where no skip key exists.
        has_skip = ok0 | ok1
        a_eff = tl.where(has_skip, a, 1.0)
        m = tl.maximum(tl.where(ok0, z0, _NEG), tl.where(ok1, z1, _NEG))
        p0 = tl.where(ok0, tl.exp(z0 - m), 0.0)
        p1 = tl.where(ok1, tl.exp(z1 - m), 0.0)
        l_skip = tl.where(has_skip, p0 + p1, 1.0)
        acc = acc * (a_eff / l_loc)[:, None]
        w0 = (1.0 - a_eff) * p0 / l_skip
        w1 = (1.0 - a_eff) * p1 / l_skip
        c_loc = m_loc + tl.log(l_loc) - tl.log(a_eff)
        c_skip = tl.where(has_skip, m + tl.log(l_skip) - tl.log(1.0 - a), 0.0)
    else:
        # One softmax over both groups; skip logits taken relative to the local prior.
        if MODE == MODE_ADAPTIVE:
            log_local = tl.log(tl.maximum(a, eps, propagate_nan=tl.PropagateNan.ALL))  # a NaN α stays NaN
            log_skip = tl.log(tl.maximum(1.0 - a, eps, propagate_nan=tl.PropagateNan.ALL))
        shift = log_skip - log_local
        z0 += shift
        z1 += shift
        m = tl.maximum(m_loc, tl.maximum(tl.where(ok0, z0, _NEG), tl.where(ok1, z1, _NEG)))
        alpha = tl.exp(m_loc - m)
        p0 = tl.where(ok0, tl.exp(z0 - m), 0.0)
        p1 = tl.where(ok1, tl.exp(z1 - m), 0.0)
        l_all = l_loc * alpha + p0 + p1
        acc = acc * (alpha / l_all)[:, None]
        w0 = p0 / l_all
        w1 = p1 / l_all
        c_loc = m + tl.log(l_all)  # the log-sum-exp less the local prior
        c_skip = c_loc - shift
        if MODE == MODE_ADAPTIVE:
            # The shift leaves the local prior out, so a NaN or +inf α would not reach a row without a skip
            # key; log max(α, ε) on its local slots makes that row NaN, and so does α − α here.
            acc += (a - a)[:, None]
    if HAS_DROPOUT:
        w0 = w0 * _keep_factor(KEEP, n, T, rows, n_local, ok0, keep_scale, N_SLOTS)
        w1 = w1 * _keep_factor(KEEP, n, T, rows, n_local + 1, ok1, keep_scale, N_SLOTS)
    if N_SKIP >= 1:
        acc = _add_rows(acc, w0, V, kbase, rows, -period, ok0, offs_d, D)
    if N_SKIP == 2:
        acc = _add_rows(acc, w1, V, kbase, rows, period, ok1, offs_d, D)
    out = base + rows[:, None] * D + offs_d[None, :]
    tl.store(OUT + out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(C_LOC + n * T + rows, c_loc, mask=row_ok)
    tl.store(C_SKIP + n * T + rows, c_skip, mask=row_ok)


@triton.jit
def _dq_band_terms(
    q, dy, K, V, KEEP, n, kbase, T, lo, hi, c, rows, lo_q, hi_q, offs_d, c_loc, window, right, scale, clamp,
    keep_scale, N_SLOTS: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_DOCS: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Chunk c of the key rows [lo, hi) of a query tile's band: raw scores z, weights w and
    dW = dY·V (dropped), all [BT, BK], and the chunk's keys [BK, D]."""
    cols = lo + c * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK] key positions
    col_ok = cols < hi
    k = _load_rows(K, kbase, cols, col_ok, offs_d, D)  # [BK, D]
    v = _load_rows(V, kbase, cols, col_ok, offs_d, D)  # [BK, D]
    band, rel = _band(rows, cols, lo_q, hi_q, col_ok, window, right, HAS_DOCS)
    z = _dot(q, tl.trans(k), DOT_PREC, UPCAST) * scale
    w = tl.where(band, tl.exp(_clamp(z, clamp, HAS_CLAMP) - c_loc[:, None]), 0.0)
    dw = _dot(dy, tl.trans(v), DOT_PREC, UPCAST)
    if HAS_DROPOUT:
        dw = dw * _keep_factor(KEEP, n, T, rows[:, None], rel + window, band, keep_scale, N_SLOTS)
    # Off the band a bad value's column of dW would reach other queries' Δ through a weight of 0.
    dw = tl.where(band, dw, 0.0)
    return z, w, dw, k, band


@triton.jit
def _dq_row_terms(
    q, dy, K, V, KEEP, n, kbase, T, rows, keys, ok, offs_d, slot, c, scale, clamp, keep_scale,
    N_SLOTS: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr, D: tl.constexpr,
):
    """One skip or sink slot of each query, reading keys [BT] where ok, its weights rebuilt with the
    offsets c [BT]: raw score z, weight w, dW (dropped), the dropout factor (1 without dropout), all [BT]."""
    z = _row_dot(q, _load_rows(K, kbase, keys, ok, offs_d, D)) * scale
    w = tl.where(ok, tl.exp(_clamp(z, clamp, HAS_CLAMP) - c), 0.0)
    dw = _row_dot(dy, _load_rows(V, kbase, keys, ok, offs_d, D))
    kf = tl.zeros_like(z) + 1.0
    if HAS_DROPOUT:
        kf = _keep_factor(KEEP, n, T, rows, slot, ok, keep_scale, N_SLOTS)
        dw = dw * kf
    return z, w, dw, kf


@triton.jit
def pi_bwd_dq_kernel(
    Q, K, V, GATE, KEEP, START, END, PERIODS, DY, C_LOC, C_SKIP, DQ, DELTA_LOC, DELTA_SKIP, DGATE, SINK_DS,
    SINK_WK, T, n_tiles, heads, group, window, period, scale, clamp, eps, keep_scale,
    CAUSAL: tl.constexpr, N_SKIP: tl.constexpr, SINKS: tl.constexpr, N_SLOTS: tl.constexpr,
    MODE: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DOCS: tl.constexpr,
    PER_HEAD: tl.constexpr, HAS_DGATE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """dQ [N, T, D], dα [N, T] and Δ_local, Δ_skip [N, T] (for the dK/dV kernel) of a tile of queries; for
    the sink keys' dK/dV, each sink slot's dlogit (clamp-masked, unscaled) and dropped weight, SINK_DS and
    SINK_WK fp32 [N, T, SINKS] (0 where the slot reads nothing).

    dlogit = w·(dW - Δ) with Δ = Σ_m w·dW over the slot's softmax group, summed exactly from the slots
    (pass 1 over the band and sinks), then dQ = Σ_m dlogit·K·scale (pass 2). PERIODS as in the forward.
    """
    n, start, base, right, n_local, rows, row_ok, offs_d = _tile(T, n_tiles, window, CAUSAL, D, BLOCK_T)
    n_skip = N_SKIP
    if PER_HEAD:
        period, n_skip = _head_period(PERIODS, n % heads, window, N_SKIP)
    kbase = (n // group) * T * D
    lo_q, hi_q = _bounds(START, END, n // heads, rows, row_ok, T, HAS_DOCS)
    q = _load_rows(Q, base, rows, row_ok, offs_d, D)  # [BT, D]
    dy = _load_rows(DY, base, rows, row_ok, offs_d, D)  # [BT, D]
    c_loc = tl.load(C_LOC + n * T + rows, mask=row_ok, other=0.0)  # [BT]
    c_skip = tl.load(C_SKIP + n * T + rows, mask=row_ok, other=0.0)  # [BT]
    lo = tl.maximum(start - window, 0)  # the band's key rows [lo, hi)
    hi = tl.minimum(start + BLOCK_T + right, T)
    n_chunks = tl.cdiv(hi - lo, BLOCK_K)

    # Skip slots first and as [BT] vectors only: their rows are not live during the band passes.
    z0 = tl.zeros([BLOCK_T], tl.float32)
    w0 = tl.zeros([BLOCK_T], tl.float32)
    dw0 = tl.zeros([BLOCK_T], tl.float32)
    z1, w1, dw1 = z0, w0, dw0
    ok0 = rows < 0
    ok1 = rows < 0
    if N_SKIP >= 1:
        ok0 = _skip_ok(rows - period, lo_q, hi_q, n_skip, PER_HEAD)
        z0, w0, dw0, _ = _dq_row_terms(q, dy, K, V, KEEP, n, kbase, T, rows, rows - period, ok0, offs_d, n_local,
                                       c_skip, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP, HAS_DROPOUT, D)
    if N_SKIP == 2:
        ok1 = _skip_ok(rows + period, lo_q, hi_q, n_skip, PER_HEAD)
        z1, w1, dw1, _ = _dq_row_terms(q, dy, K, V, KEEP, n, kbase, T, rows, rows + period, ok1, offs_d,
                                       n_local + 1, c_skip, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP,
                                       HAS_DROPOUT, D)
    has_skip = ok0 | ok1

    sig_loc = tl.zeros([BLOCK_T], tl.float32)
    for c in range(0, n_chunks):
        z, w, dw, k, band = _dq_band_terms(q, dy, K, V, KEEP, n, kbase, T, lo, hi, c, rows, lo_q, hi_q, offs_d,
                                           c_loc, window, right, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP,
                                           HAS_DROPOUT, HAS_DOCS, D, BLOCK_K, DOT_PREC, UPCAST)
        sig_loc += tl.sum(w * dw, 1)
    for s in range(0, SINKS):
        key, ok = _sink_slot(s, rows, lo_q, hi_q, window, right, period, CAUSAL, N_SKIP)
        z, w, dw, kf = _dq_row_terms(q, dy, K, V, KEEP, n, kbase, T, rows, key, ok, offs_d, n_local + n_skip + s,
                                     c_loc, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP, HAS_DROPOUT, D)
        sig_loc += w * dw
    sig_skip = w0 * dw0 + w1 * dw1
    if MODE == MODE_SEPARATE:
        # Each group is a softmax of its own times its coefficient: Δ_g = σ_g / coef_g = Σ_g p·dW.
        a = tl.load(GATE + n * T + rows, mask=row_ok, other=0.5).to(tl.float32)
        delta_loc = sig_loc / tl.where(has_skip, a, 1.0)
        delta_skip = tl.where(has_skip, sig_skip / (1.0 - a), 0.0)
    else:
        delta_loc = sig_loc + sig_skip
        delta_skip = delta_loc
    tl.store(DELTA_LOC + n * T + rows, delta_loc, mask=row_ok)
    tl.store(DELTA_SKIP + n * T + rows, delta_skip, mask=row_ok)

    dq = tl.zeros([BLOCK_T, D], tl.float32)
    g_loc = tl.zeros([BLOCK_T], tl.float32)  # Σ_local dlogit, for dα
    for c in range(0, n_chunks):
        z, w, dw, k, band = _dq_band_terms(q, dy, K, V, KEEP, n, kbase, T, lo, hi, c, rows, lo_q, hi_q, offs_d,
                                           c_loc, window, right, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP,
                                           HAS_DROPOUT, HAS_DOCS, D, BLOCK_K, DOT_PREC, UPCAST)
        ds = w * (dw - delta_loc[:, None])  # [BT, BK]
        g_loc += tl.sum(ds, 1)
        if HAS_CLAMP:
            ds = tl.where(tl.abs(z) <= clamp, ds, 0.0)  # torch.clamp passes the gradient inside [-L, L]
        dq = _contained_dot(dq, ds.to(k.dtype), k, band, DOT_PREC, UPCAST)
    for s in range(0, SINKS):
        key, ok = _sink_slot(s, rows, lo_q, hi_q, window, right, period, CAUSAL, N_SKIP)
        z, w, dw, kf = _dq_row_terms(q, dy, K, V, KEEP, n, kbase, T, rows, key, ok, offs_d, n_local + n_skip + s,
                                     c_loc, scale, clamp, keep_scale, N_SLOTS, HAS_CLAMP, HAS_DROPOUT, D)
        ds = tl.where(ok, w * (dw - delta_loc), 0.0)  # a slot not read stores 0, even in a row whose Δ is NaN
        g_loc += ds
        if HAS_CLAMP:
            ds = tl.where(tl.abs(z) <= clamp, ds, 0.0)
        dq = _add_rows(dq, ds, K, kbase, key, 0, ok, offs_d, D)
        # A sink key is read by queries of any tile of its document: its dK/dV gathers these.
        tl.store(SINK_DS + (n * T + rows) * SINKS + s, ds, mask=row_ok)
        tl.store(SINK_WK + (n * T + rows) * SINKS + s, w * kf, mask=row_ok)
    ds0 = w0 * (dw0 - delta_skip)
    ds1 = w1 * (dw1 - delta_skip)
    g_skip = ds0 + ds1
    if HAS_CLAMP:
        ds0 = tl.where(tl.abs(z0) <= clamp, ds0, 0.0)
        ds1 = tl.where(tl.abs(z1) <= clamp, ds1, 0.0)
    if N_SKIP >= 1:
        dq = _add_rows(dq, ds0, K, kbase, rows, -period, ok0, offs_d, D)
    if N_SKIP == 2:
        dq = _add_rows(dq, ds1, K, kbase, rows, period, ok1, offs_d, D)
    tl.store(DQ + base + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])

    if HAS_DGATE:
        a = tl.load(GATE + n * T + rows, mask=row_ok, other=0.5).to(tl.float32)
        if MODE == MODE_SEPARATE:
            # y = α·local + (1 - α)·skip where a skip exists: dα = Σ_local p·dW - Σ_skip p·dW.
            dgate = tl.where(has_skip, delta_loc - delta_skip, 0.0)
        else:
            # Local (and sink) logits carry log max(α, ε), skip logits log max(1 - α, ε).
            dgate = tl.where(a >= eps, g_loc / a, 0.0) - tl.where(1.0 - a >= eps, g_skip / (1.0 - a), 0.0)
        tl.store(DGATE + n * T + rows, dgate, mask=row_ok)


@triton.jit
def _dkdv_skip_terms(
    k, v, Q, DY, KEEP, C_SKIP, DELTA_SKIP, n, qbase, T, keys, lo_k, hi_k, offs_d, offset, n_skip, slot, scale,
    clamp, keep_scale, N_SLOTS: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PER_HEAD: tl.constexpr, D: tl.constexpr,
):
    """For each key (in document [lo_k, hi_k)), the query keys - offset whose skip slot it is (none in a head
    without skip slots, n_skip = 0): that slot's dropped weight (the factor of dY in dV) and its dlogit with
    the clamp mask (the factor of Q in dK), both [BT], and validity."""
    qrows = keys - offset
    ok = _skip_ok(qrows, lo_k, hi_k, n_skip, PER_HEAD)
    z = _row_dot(k, _load_rows(Q, qbase, qrows, ok, offs_d, D)) * scale
    c_skip = tl.load(C_SKIP + n * T + qrows, mask=ok, other=0.0)
    delta = tl.load(DELTA_SKIP + n * T + qrows, mask=ok, other=0.0)
    w = tl.where(ok, tl.exp(_clamp(z, clamp, HAS_CLAMP) - c_skip), 0.0)
    dw = _row_dot(_load_rows(DY, qbase, qrows, ok, offs_d, D), v)
    wd = w
    if HAS_DROPOUT:
        kf = _keep_factor(KEEP, n, T, qrows, slot, ok, keep_scale, N_SLOTS)
        wd = w * kf
        dw = dw * kf
    ds = w * (dw - delta)
    if HAS_CLAMP:
        ds = tl.where(tl.abs(z) <= clamp, ds, 0.0)
    return wd, ds, ok


@triton.jit
def pi_bwd_dkdv_kernel(
    Q, K, V, KEEP, START, END, PERIODS, DY, C_LOC, C_SKIP, DELTA_LOC, DELTA_SKIP, SINK_DS, SINK_WK, DK, DV,
    T, n_tiles, heads_kv, window, period, scale, clamp, keep_scale,
    CAUSAL: tl.constexpr, N_SKIP: tl.constexpr, SINKS: tl.constexpr, N_SLOTS: tl.constexpr, GROUP: tl.constexpr,
    HAS_CLAMP: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DOCS: tl.constexpr, PER_HEAD: tl.constexpr,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """dK, dV [N_kv, T, D] of a tile of keys of one key/value head, gathered from every query that reads
    them, over the GROUP query heads that share it (a loop inside the program; no atomics). GROUP is a
    constexpr so that plain multi-head attention (GROUP = 1) compiles without the loop.

    Key j is local to the queries j - right … j + window, the skip of j + period (and j - period), and,
    if it is one of the first SINKS keys of its document, a sink of the document's other queries: their
    dlogits and weights come from SINK_DS, SINK_WK (written by the dQ kernel), not recomputed. With per-head
    periods (PER_HEAD) each query head of the group takes its own period from PERIODS int32 [H], H =
    heads_kv·GROUP.
    """
    # The tile's rows are keys here: `keys` [BT] are key positions of key/value head nk.
    nk, start, kvbase, right, n_local, keys, key_ok, offs_d = _tile(T, n_tiles, window, CAUSAL, D, BLOCK_T)
    lo_k, hi_k = _bounds(START, END, nk // heads_kv, keys, key_ok, T, HAS_DOCS)  # each key's document
    k = _load_rows(K, kvbase, keys, key_ok, offs_d, D)  # [BT, D], shared by the group's query heads
    v = _load_rows(V, kvbase, keys, key_ok, offs_d, D)  # [BT, D]
    lo = tl.maximum(start - right, 0)  # the query rows [lo, hi) that hold these keys in their band
    hi = tl.minimum(start + BLOCK_T + window, T)
    if SINKS > 0:
        # The queries that may read this tile's sink keys: the rest of their documents, one contiguous run.
        is_sink = (keys - lo_k < SINKS) & (hi_k > 0)
        slot = keys - lo_k
        first = lo_k  # causal: a sink key's readers start at the key itself, else at its document's start
        if CAUSAL:
            first = keys
        r_lo = tl.min(tl.where(is_sink, first, T), 0)
        r_hi = tl.max(tl.where(is_sink, hi_k, 0), 0)

    dk = tl.zeros([BLOCK_T, D], tl.float32)
    dv = tl.zeros([BLOCK_T, D], tl.float32)
    for g in range(0, GROUP):
        n = nk * GROUP + g  # a query head reading this key/value head
        qbase = n * T * D
        p_n = period  # its period and skip slot count
        n_skip = N_SKIP
        if PER_HEAD:
            p_n, n_skip = _head_period(PERIODS, (nk % heads_kv) * GROUP + g, window, N_SKIP)
        for c in range(0, tl.cdiv(hi - lo, BLOCK_K)):
            qrows = lo + c * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK] query positions
            q_ok = qrows < hi
            q = _load_rows(Q, qbase, qrows, q_ok, offs_d, D)  # [BK, D]
            dy = _load_rows(DY, qbase, qrows, q_ok, offs_d, D)  # [BK, D]
            c_loc = tl.load(C_LOC + n * T + qrows, mask=q_ok, other=0.0)  # [BK]
            delta = tl.load(DELTA_LOC + n * T + qrows, mask=q_ok, other=0.0)  # [BK]
            rel = keys[:, None] - qrows[None, :]  # [BT, BK] key offset from its query
            band = (rel >= -window) & (rel <= right) & key_ok[:, None] & q_ok[None, :]
            if HAS_DOCS:  # the query in the key's document
                band = band & (qrows[None, :] >= lo_k[:, None]) & (qrows[None, :] < hi_k[:, None])
            z = _dot(k, tl.trans(q), DOT_PREC, UPCAST) * scale  # [BT, BK]
            w = tl.where(band, tl.exp(_clamp(z, clamp, HAS_CLAMP) - c_loc[None, :]), 0.0)
            dw = _dot(v, tl.trans(dy), DOT_PREC, UPCAST)  # [BT, BK]
            wd = w
            if HAS_DROPOUT:
                kf = _keep_factor(KEEP, n, T, qrows[None, :], rel + window, band, keep_scale, N_SLOTS)
                wd = w * kf
                dw = dw * kf
            # A bad query's row of Q or dY, or its Δ, must reach only the keys in its band: products over
            # the chunk's queries leave bad values out (`_contained_dot`), dlogits are 0 off the band.
            dv = _contained_dot(dv, wd.to(dy.dtype), dy, band, DOT_PREC, UPCAST)
            ds = tl.where(band, w * (dw - delta[None, :]), 0.0)
            if HAS_CLAMP:
                ds = tl.where(tl.abs(z) <= clamp, ds, 0.0)
            dk = _contained_dot(dk, ds.to(q.dtype), q, band, DOT_PREC, UPCAST)
        # Skip slots after the band, so that their rows are not live during it.
        if N_SKIP >= 1:  # slot n_local of query j + period
            wd0, ds0, ok0 = _dkdv_skip_terms(k, v, Q, DY, KEEP, C_SKIP, DELTA_SKIP, n, qbase, T, keys, lo_k, hi_k,
                                             offs_d, -p_n, n_skip, n_local, scale, clamp, keep_scale, N_SLOTS,
                                             HAS_CLAMP, HAS_DROPOUT, PER_HEAD, D)
            dv = _add_rows(dv, wd0, DY, qbase, keys, p_n, ok0, offs_d, D)
            dk = _add_rows(dk, ds0, Q, qbase, keys, p_n, ok0, offs_d, D)
        if N_SKIP == 2:  # slot n_local + 1 of query j - period
            wd1, ds1, ok1 = _dkdv_skip_terms(k, v, Q, DY, KEEP, C_SKIP, DELTA_SKIP, n, qbase, T, keys, lo_k, hi_k,
                                             offs_d, p_n, n_skip, n_local + 1, scale, clamp, keep_scale, N_SLOTS,
                                             HAS_CLAMP, HAS_DROPOUT, PER_HEAD, D)
            dv = _add_rows(dv, wd1, DY, qbase, keys, -p_n, ok1, offs_d, D)
            dk = _add_rows(dk, ds1, Q, qbase, keys, -p_n, ok1, offs_d, D)

        if SINKS > 0:
            # Sink keys: gather the saved per-slot terms of their readers, [BT, BK] per chunk of queries.
            for c in range(0, tl.cdiv(r_hi - r_lo, BLOCK_K)):
                qrows = r_lo + c * BLOCK_K + tl.arange(0, BLOCK_K)
                q_ok = qrows < r_hi
                read = is_sink[:, None] & (qrows[None, :] >= lo_k[:, None]) & (qrows[None, :] < hi_k[:, None])
                at = qrows[None, :] * SINKS + slot[:, None]  # [BT, BK] offsets inside the head's [T, SINKS]
                ds = tl.load(SINK_DS + n * T * SINKS + at, mask=read, other=0.0)  # [BT, BK]
                wk = tl.load(SINK_WK + n * T * SINKS + at, mask=read, other=0.0)
                q = _load_rows(Q, qbase, qrows, q_ok, offs_d, D)  # [BK, D]
                dy = _load_rows(DY, qbase, qrows, q_ok, offs_d, D)
                # Bad values of queries that do not read a sink key stay out (a slot not read stored 0).
                dk = _contained_dot(dk, ds.to(q.dtype), q, ds != 0.0, DOT_PREC, UPCAST)
                dv = _contained_dot(dv, wk.to(dy.dtype), dy, wk != 0.0, DOT_PREC, UPCAST)

    out = kvbase + keys[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])
