/* π-Attention forward and backward in one pass each over the rows, on the CPU (built and called by fused.py).
 *
 * Why: the eager backend moves each step's [T, |U|] intermediate through memory; here a query row's whole
 * computation (its scores, the softmax, the weighted sum of values, and in the backward every gradient it
 * feeds) runs while that row and the few key rows it reads are in cache. The local keys i − window … i
 * (+ window) and the skip keys i ∓ period lie at most max(window, period) rows away, so each row of q, k, v,
 * dy is read from memory about once and each output row written once: the pass is bound by memory traffic.
 *
 * Shapes (contiguous, one precision R = float or double, the accumulation type too):
 *   q, y, dy, dq [B, H, T, D]; k, v, dk, dv [B, H_kv, T, D] (query head h reads key/value head h / G, G = H / H_kv);
 *   gate, dgate [B, H, T] ("adaptive" and "separate" only); stat [B, H, T, S] double, S = 2 for "separate",
 *   else 1.
 * The forward writes y and stat: the log-sum-exp of the row's logits (for "separate" one per branch, local and
 * skip). The backward recomputes the scores from q and k, the weights from stat, and takes Σ_m w_m·dp_m over
 * the row's own slots, so it reads neither y nor a saved weight tensor.
 *
 * Slots of query i of head h (docs/design.md §3): local keys i − window … i (+ window when bidirectional),
 * clipped to the query's document [start, end) ([0, T) without documents); the document's sink keys start + s,
 * s < sinks, not already local or a skip (at or before i when causal); the skip keys i − π_h (and i + π_h when
 * bidirectional) when π_h > window and inside the document. Each query head has its own period π_h (an int64
 * buffer of H); local and sink slots form the local group (the local prior, the local branch of "separate").
 * Dropout: a uint8 keep mask [B, H, T, keep_slots], each head's row in the contract's slot order of its own
 * pattern (pattern.Pattern: local keys i − window …, i − π_h, i + π_h, sinks); a weight is multiplied by
 * keep_scale = 1 / (1 − p) where kept, by 0 where dropped (after mixing, for "separate").
 * Logits z = clamp(q·k·scale, ±clamp) + log-prior ("fixed": log max(prior, ε), log max(1 − prior, ε);
 * "adaptive": the same with α = gate); "separate" mixes two softmaxes with α and 1 − α (α = 1 without a skip).
 *
 * Threads (OpenMP): over (batch, key/value head). One thread runs the G query heads of a key/value head row
 * by row, so a key row is read once for all of them and dk, dv of that head are written by that thread only
 * (no atomics). dk and dv are summed in a window of rows in cache, each row zeroed when the row loop first
 * reaches it (key j is first read by query j − reach) and written out once final, so dk and dv go to memory
 * once. The forward, which writes only its own rows, also splits the rows of a head into blocks when there
 * are fewer heads than threads.
 *
 * Rows in vector lanes (the fp32 forward): LANES consecutive rows of a query head whose slots have the same
 * structure run at once, the softmax with the rows in the lanes of a vector (forward_block_d); each row gets
 * the bits it would get alone. Where the call outgrows the cache, y (and the backward's dq, dk, dv) are
 * written by streaming stores (pi_streaming).
 *
 * Non-finite inputs stay in the rows that read them: only valid slots are visited (an invalid slot is
 * skipped, never weighted by 0, since 0·NaN = NaN), and every comparison lets a NaN through as torch's clamp
 * and clamp_min do.
 *
 * Trust: fused.py checks the tensors before the call; the entry points check again what they can see (the
 * sizes, the settings, every buffer's length against the sizes) and return a PI_ERR_* code, having touched
 * nothing, rather than read or write outside a buffer.
 *
 * The file includes itself once per precision (PI_REAL), so each kernel is written once as plain C.
 *
 * Contents, in the file's order, each section under a comment "Section N" that grep finds:
 * 1. Shared, once (the file read without PI_REAL): return codes, pi_buffer, pi_call; pi_pattern_of / pi_patterns
 *    (a head's slot offsets); pi_check_call, pi_check_buffer, pi_check_layout (the trust checks);
 *    pi_forward_blocks, pi_streaming; the bf16 / fp16 conversions pi_bf16_to_f32, pi_f32_to_bf16, pi_f16_to_f32,
 *    pi_f32_to_f16.
 * 2. The instantiations: the file includes itself with PI_SUFFIX f32, bf16, f16, f64.
 * 3. The kernels of one precision (the file read with PI_REAL, after #else): every kernel there is named NAME
 *    and compiled as the static NAME_f32, NAME_bf16, NAME_f16 and NAME_f64 (FN(NAME): the suffix is PI_SUFFIX
 *    of each instantiation). In order: vectors (load, store, splat, load_s, pack_s, store_s, row_r, put,
 *    rows_s); reductions and row arithmetic (sum_lanes, dot, dot2, weighted_sum, add2); slots (slot_rows,
 *    dropout_row); log and exp (log_lanes, logs, log1, exp_lanes, exps, exp_shifted, normalise); the logits
 *    (log_priors, logits); scratch; the forward (forward_row_d; block_slots, forward_block_d: rows in lanes;
 *    forward_row, forward_block); the backward (backward_row_d, backward_block_d: rows in lanes for bf16 and
 *    fp16; backward_row, backward_block, backward_log_priors); the bodies of the entry points, forward and
 *    backward.
 * 4. Exported entry points (the end of the file), the only symbols fused.py calls, each defined there by name
 *    and calling forward_SUFFIX or backward_SUFFIX of section 3:
 *      pi_fused_forward_f32, pi_fused_forward_bf16, pi_fused_forward_f16, pi_fused_forward_f64
 *      pi_fused_backward_f32, pi_fused_backward_bf16, pi_fused_backward_f16, pi_fused_backward_f64
 */
#ifndef PI_REAL
/* Section 1: shared, once. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { PI_UNION = 0, PI_FIXED = 1, PI_ADAPTIVE = 2, PI_SEPARATE = 3 };
/* Return codes; fused.py turns each into its error. */
enum { PI_OK = 0, PI_ERR_SIZE = 1, PI_ERR_SETTING = 2, PI_ERR_BUFFER = 3, PI_ERR_MEMORY = 4 };

/* One call's sizes and settings; fused.py's _Call mirrors it field by field. The periods (one per query
 * head) and the document bounds are buffers. */
typedef struct {
  int64_t B, H, H_kv, T, D;
  int64_t window, sinks, causal, variant, has_clamp, threads;
  int64_t keep_slots; /* the last dimension of the dropout keep mask (0 without dropout) */
  double clamp, prior, eps, scale;
  double keep_scale; /* 1 / (1 − p): the factor of a kept weight */
} pi_call;

/* A tensor's data and its number of elements (checked against the sizes before anything is read). */
typedef struct {
  void *data;
  int64_t numel;
} pi_buffer;

/* The slot offsets of one query head's queries, before clipping to their document (or [0, T)). */
typedef struct {
  int64_t left, right;           /* local keys i − left … i + right (window clipped to T − 1) */
  int64_t skip_back, skip_ahead; /* whether i − period, i + period are slots of their own */
  int64_t period;                /* this head's π_h */
  int64_t sinks, causal;
  int64_t n_rel_local; /* the contract's local slots (pattern.Pattern, window as given): 2·window + 1 or window + 1 */
  int64_t slots;       /* the contract's slots of this head: local, skips, sinks (the dropout mask's layout) */
  int64_t reach; /* the largest forward offset: key j is first read by query j − reach */
  int64_t n_max; /* the most slots a query has */
  double fixed_local, fixed_skip; /* the log-priors of "fixed" (pattern.log_priors): once per call, in double */
} pi_pattern;

static pi_pattern pi_pattern_of(const pi_call *c, int64_t period) {
  pi_pattern p;
  const int64_t window = c->window < c->T - 1 ? c->window : c->T - 1;
  p.left = window;
  p.right = c->causal ? 0 : window;
  /* A skip within the window (period <= window, the window as asked) is a local key already. */
  p.skip_back = period > c->window;
  p.skip_ahead = p.skip_back && !c->causal;
  p.period = period;
  p.sinks = c->sinks;
  p.causal = c->causal;
  p.n_rel_local = c->window + (c->causal ? 0 : c->window) + 1;
  p.slots = p.n_rel_local + p.skip_back + p.skip_ahead + c->sinks;
  p.reach = p.skip_ahead && period > p.right ? period : p.right;
  /* Bidirectional sinks: key start + s is read by every query of its document, the earliest s rows before it. */
  if (!c->causal && c->sinks - 1 > p.reach) p.reach = c->sinks - 1;
  /* sinks beyond T read nothing more: at most T keys in all */
  p.n_max = p.left + p.right + 1 + p.skip_back + p.skip_ahead + (c->sinks < c->T ? c->sinks : c->T);
  p.fixed_local = log(c->prior < c->eps ? c->eps : c->prior);
  p.fixed_skip = log(1 - c->prior < c->eps ? c->eps : 1 - c->prior);
  return p;
}

/* The patterns of the H query heads (periods[h], each checked >= 1 by pi_check_layout), with the largest
 * reach and slot count among them in *reach and *n_max; NULL with *err set when out of memory, or when a
 * head's slots do not fit in a dropout mask of keep_slots. */
static pi_pattern *pi_patterns(const pi_call *c, const int64_t *periods, int64_t *reach, int64_t *n_max, int *err) {
  pi_pattern *p = malloc(sizeof(pi_pattern) * (size_t)c->H);
  *reach = 0;
  *n_max = 1;
  *err = PI_ERR_MEMORY;
  if (!p) return NULL;
  for (int64_t h = 0; h < c->H; h++) {
    p[h] = pi_pattern_of(c, periods[h]);
    if (p[h].reach > *reach) *reach = p[h].reach;
    if (p[h].n_max > *n_max) *n_max = p[h].n_max;
    if (c->keep_slots && p[h].slots > c->keep_slots) {
      free(p);
      *err = PI_ERR_BUFFER;
      return NULL;
    }
  }
  *err = PI_OK;
  return p;
}

static int64_t pi_stats_per_row(const pi_call *c) { return c->variant == PI_SEPARATE ? 2 : 1; }

static int pi_gated(const pi_call *c) { return c->variant == PI_ADAPTIVE || c->variant == PI_SEPARATE; }

/* PI_OK when the sizes and settings are consistent and B·H·T·D counts no more elements than int64 holds. */
static int pi_check_call(const pi_call *c) {
  if (!c) return PI_ERR_SIZE;
  if (c->B < 0 || c->H < 1 || c->H_kv < 1 || c->H_kv > c->H || c->H % c->H_kv || c->T < 1 || c->D < 1)
    return PI_ERR_SIZE;
  const int64_t most = INT64_MAX / 4;
  if (c->T > most / c->D || c->H > most / (c->T * c->D) || (c->B && c->B > most / (c->H * c->T * c->D)))
    return PI_ERR_SIZE;
  if (c->window < 0 || c->sinks < 0 || (c->causal != 0 && c->causal != 1) || c->variant < PI_UNION ||
      c->variant > PI_SEPARATE || (c->has_clamp != 0 && c->has_clamp != 1) || c->threads < 1 || c->keep_slots < 0)
    return PI_ERR_SETTING;
  if (c->keep_slots && !(c->keep_scale >= 1 && c->keep_scale < INFINITY)) return PI_ERR_SETTING;
  if ((c->has_clamp && !(c->clamp > 0)) || !(c->scale > 0) || !(c->eps >= 0 && c->eps < 0.5) ||
      !(c->prior >= 0 && c->prior <= 1))
    return PI_ERR_SETTING;
  return PI_OK;
}

/* A buffer the call uses must hold exactly `numel` elements; one it does not use must be empty (NULL, 0). */
static int pi_check_buffer(const pi_buffer *b, int used, int64_t numel) {
  if (!used) return b->data == NULL && b->numel == 0 ? PI_OK : PI_ERR_BUFFER;
  return b->numel == numel && (b->data != NULL || numel == 0) ? PI_OK : PI_ERR_BUFFER;
}

/* The per-head periods (>= 1) and, when documents are given (start and end both non-empty, B·T each), bounds
 * with start[b, i] <= i < end[b, i] <= T: every key a slot reads then lies in [0, T). */
static int pi_check_layout(const pi_call *c, const pi_buffer *periods, const pi_buffer *start, const pi_buffer *end,
                           const pi_buffer *keep) {
  if (periods->numel != c->H || !periods->data) return PI_ERR_BUFFER;
  /* the keep mask [B, H, T, keep_slots] (bytes) when keep_slots > 0, else empty; every head's slots fit in it */
  if (c->keep_slots > INT64_MAX / 4 / (c->B * c->H * c->T + 1)) return PI_ERR_SIZE;
  int err = pi_check_buffer(keep, c->keep_slots > 0, c->B * c->H * c->T * c->keep_slots);
  if (err) return err;
  for (int64_t h = 0; h < c->H; h++)
    if (((const int64_t *)periods->data)[h] < 1) return PI_ERR_SETTING;
  const int docs = start->data != NULL || start->numel != 0;
  if ((err = pi_check_buffer(start, docs, c->B * c->T)) || (err = pi_check_buffer(end, docs, c->B * c->T)))
    return err;
  if (!docs) return PI_OK;
  const int64_t *s = start->data, *e = end->data;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t i = 0; i < c->T; i++) {
      const int64_t at = b * c->T + i;
      if (!(s[at] >= 0 && s[at] <= i && i < e[at] && e[at] <= c->T)) return PI_ERR_SETTING;
    }
  return PI_OK;
}

/* The rows of each (batch, key/value head) cut into `blocks` pieces for the forward: more work items than
 * threads where there are fewer heads than threads. */
static int64_t pi_forward_blocks(const pi_call *c) {
  const int64_t heads = c->B * c->H_kv;
  if (heads == 0 || heads >= c->threads) return 1;
  const int64_t blocks = (c->threads + heads - 1) / heads * 4;
  return blocks < c->T ? blocks : c->T;
}

/* The width of the vectors the loops over D work in: one AVX register, or one SSE register without AVX. */
#ifdef __AVX__
#define PI_VECTOR_BYTES 32
#else
#define PI_VECTOR_BYTES 16
#endif

/* Streaming stores (x86: movntps for an fp32 vector, movntdq for the 16 bytes of 8 bf16 / fp16 values; none
 * elsewhere) and the fence that orders such stores. */
#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#define PI_FENCE() _mm_sfence()
#ifdef __AVX__
#define PI_STREAM_F32(p, x) _mm256_stream_ps((p), (__m256)(x))
#define PI_STREAM_X16(p, h) _mm_stream_si128((__m128i *)(void *)(p), (__m128i)(h))
#else
#define PI_STREAM_F32(p, x) _mm_stream_ps((p), (__m128)(x))
#endif
#endif

/* Whether a call writes an output whose rows start at `out` (elements of `bytes` each) by streaming stores:
 * the forward's y, the backward's dq, dk and dv. A plain store to a line not in cache first reads the line
 * from memory: a quarter more traffic for the forward where H = H_kv (q, k, v, y read, y written), three
 * sevenths more for the backward. When the forward of the call moves more bytes (q, k, v read, y written)
 * than PI_STREAM_BYTES, an output's first lines are gone from the cache before anyone reads them anyway; a
 * smaller output stays in cache for the next operation. 16 MiB: with B 1, H 8, D 64 on one thread, side by
 * side, the bf16 / fp16 calls at 8K and the fp32 ones at 4K (forwards of 32 MiB) were 3-14 % slower with plain
 * stores than with streaming ones. Every row must start on a vector boundary (a vector: `vector` bytes of the
 * output). */
#define PI_STREAM_BYTES ((int64_t)16 << 20)
/* The backward's window of dk, dv rows in R holds back + reach + 1 + PI_WINDOW_ROWS key rows (backward): moved
 * on once every PI_WINDOW_ROWS queries, 2·(PI_WINDOW_ROWS + …)·D·sizeof(R) bytes of scratch (the L2 cache). */
#define PI_WINDOW_ROWS ((int64_t)256)
#if defined(PI_STREAM_F32) || defined(PI_STREAM_X16) /* only targets with streaming stores call it */
static int pi_streaming(const pi_call *c, const void *out, int64_t bytes, int64_t vector) {
  const int64_t kv = c->B * c->H_kv * c->T * c->D, qy = c->B * c->H * c->T * c->D; /* each <= INT64_MAX / 4 */
  return (uintptr_t)out % (uintptr_t)vector == 0 && c->D * bytes % vector == 0 &&
         kv + qy > PI_STREAM_BYTES / 2 / bytes;
}
#endif

static const int32_t pi_lane_index[8] = {0, 1, 2, 3, 4, 5, 6, 7};

/* The helpers the rows' inner loops call: inlined whatever the compiler's size limits (the blocks' kernels,
 * three copies each for D 64, 128 and any, exhaust GCC's growth allowance), so that their loops over D see the
 * constant D and the vectors stay in registers. */
#define PI_INLINE static inline __attribute__((always_inline))

#define PI_CAT2(a, b) a##_##b
#define PI_CAT(a, b) PI_CAT2(a, b)

/* bf16 and fp16 (IEEE binary16) values, as torch rounds them: to the nearest, ties to even; a NaN stays a
 * NaN (bf16: 0x7fc0, as torch; fp16: a quiet NaN of its sign), overflow goes to ±inf. Plain C on the bits,
 * for any target; the kernels' vectors convert the same way (load_s, store_s), by F16C's instructions where
 * the target has them (the same results: IEEE's conversions). */
static inline float pi_bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t pi_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float pi_f16_to_f32(uint16_t h) {
  uint32_t o = (uint32_t)(h & 0x7fffu) << 13; /* exponent and mantissa, in a float's places */
  const uint32_t e = o & 0x0f800000u;
  float f;
  o += 0x38000000u;                   /* the exponent's bias, 15 -> 127 */
  if (e == 0x0f800000u) o += 0x38000000u; /* inf, NaN: the largest exponent */
  else if (e == 0) {                  /* zero, subnormal: renormalised by a float subtraction */
    o += 1u << 23;
    memcpy(&f, &o, sizeof f);
    f -= 6.103515625e-05f; /* 2^-14 */
    memcpy(&o, &f, sizeof o);
  }
  o |= (uint32_t)(h & 0x8000u) << 16;
  memcpy(&f, &o, sizeof f);
  return f;
}

static inline uint16_t pi_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= 0x47800000u) o = u > 0x7f800000u ? 0x7e00 : 0x7c00; /* >= 2^16: NaN, or inf */
  else if (u < 0x38800000u) {                                   /* < 2^-14: a subnormal (or zero) result */
    float t;
    memcpy(&t, &u, sizeof t);
    t += 0.5f; /* the float addition rounds the mantissa at 2^-24, to even */
    uint32_t r;
    memcpy(&r, &t, sizeof r);
    o = (uint16_t)(r - 0x3f000000u);
  } else { /* normal: rebias, round the 13 dropped bits to even */
    u += 0xc8000fffu + ((u >> 13) & 1u);
    o = (uint16_t)(u >> 13);
  }
  return (uint16_t)(o | (sign >> 16));
}

/* Section 2: the instantiations. */

/* One instantiation per storage type: R the type the kernels compute and accumulate in, S the type of the
 * tensors they read and write (PI_STORAGE 0: S = R; 1: bf16 and 2: fp16 in uint16_t, computed in float). */
#define PI_REAL float
#define PI_STORAGE 0
#define PI_LANES (PI_VECTOR_BYTES / 4) /* a literal, for #if */
#define PI_SUFFIX f32
#define PI_EXP expf
#define PI_LOG logf
#define PI_VECTOR_EXP 1 /* exp by a vector polynomial (float only: fp64 keeps libm's) */
#ifdef PI_STREAM_F32
#define PI_STREAM PI_STREAM_F32
#endif
#include __FILE__
#undef PI_STREAM
#undef PI_SUFFIX
#undef PI_STORAGE

#ifdef PI_STREAM_X16
#define PI_STREAM PI_STREAM_X16
#endif
#define PI_STORAGE 1
#define PI_SUFFIX bf16
#include __FILE__
#undef PI_SUFFIX
#undef PI_STORAGE

#define PI_STORAGE 2
#define PI_SUFFIX f16
#include __FILE__
#undef PI_SUFFIX
#undef PI_STORAGE
#undef PI_STREAM
#undef PI_VECTOR_EXP
#undef PI_REAL
#undef PI_LANES
#undef PI_EXP
#undef PI_LOG

#define PI_REAL double
#define PI_STORAGE 0
#define PI_LANES (PI_VECTOR_BYTES / 8)
#define PI_SUFFIX f64
#define PI_EXP exp
#define PI_LOG log
#define PI_VECTOR_EXP 0
#include __FILE__
#undef PI_VECTOR_EXP
#undef PI_SUFFIX
#undef PI_STORAGE
#undef PI_REAL
#undef PI_LANES
#undef PI_EXP
#undef PI_LOG
/* The exported entry points follow the kernels, at the end of the file (again without PI_REAL). */

#else /* the kernels of one precision */
/* Section 3: the kernels of one precision. */

#define R PI_REAL
#if PI_STORAGE
#define S uint16_t
#else
#define S PI_REAL
#endif
#define FN(name) PI_CAT(name, PI_SUFFIX)

/* Vectors of PI_VECTOR_BYTES (GCC/Clang vector extensions): the loops over D say what runs in one instruction,
 * instead of leaving the compiler to version each loop for alignment, aliasing and tails. Loads and stores
 * go through an unaligned, may_alias type (rows start anywhere D·sizeof(R) puts them). */
typedef R FN(vec) __attribute__((vector_size(PI_VECTOR_BYTES)));
typedef R FN(uvec) __attribute__((vector_size(PI_VECTOR_BYTES), aligned(sizeof(R)), may_alias));
#define LANES ((int64_t)PI_LANES)

static inline FN(vec) FN(load)(const R *p) { return *(const FN(uvec) *)p; }
static inline void FN(store)(R *p, FN(vec) x) { *(FN(uvec) *)p = x; }
/* x in every lane: x − 0 is x for every x (−0 included), so the compiler drops the subtraction (0 + x, which
 * turns −0 into +0, costs an addition). */
static inline FN(vec) FN(splat)(R x) { return x - (FN(vec)){0}; }

/* The tensors' elements (S) to and from R: load_s / store_s a vector of LANES, get_s / set_s one. With S = R
 * they are load and store; bf16 and fp16 convert (to float exactly, from float rounding to nearest even, as
 * pi_f32_to_bf16 / pi_f32_to_f16). */
#if PI_STORAGE
typedef uint16_t FN(hvec) __attribute__((vector_size(PI_LANES * 2), aligned(2), may_alias));
typedef uint32_t FN(wvec) __attribute__((vector_size(PI_VECTOR_BYTES)));
typedef int32_t FN(mvec) __attribute__((vector_size(PI_VECTOR_BYTES)));
static inline FN(vec) FN(pick)(FN(mvec) mask, FN(wvec) a, FN(wvec) b) {
  return (FN(vec))((a & (FN(wvec))mask) | (b & ~(FN(wvec))mask));
}
/* LANES 16-bit elements, zero-extended to 32 bits: one instruction with AVX2 or SSE4.1 (GCC splits
 * convertvector's widening in two halves). */
static inline FN(wvec) FN(widen)(const S *p) {
#if defined(__AVX2__) && PI_LANES == 8
  return (FN(wvec))_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
#elif defined(__SSE4_1__) && PI_LANES == 4
  return (FN(wvec))_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
#else
  return __builtin_convertvector(*(const FN(hvec) *)p, FN(wvec));
#endif
}
#endif

#if PI_STORAGE == 1
static inline R FN(get_s)(S x) { return pi_bf16_to_f32(x); }
static inline S FN(set_s)(R x) { return pi_f32_to_bf16(x); }
static inline FN(vec) FN(load_s)(const S *p) { return (FN(vec))(FN(widen)(p) << 16); }
/* A vector as its LANES values of S (store_s writes them, put may stream them). */
static inline FN(hvec) FN(pack_s)(FN(vec) x) {
  const FN(wvec) u = (FN(wvec))x;
  const FN(wvec) r = (FN(wvec))FN(pick)(x != x, u - u + 0x7fc0u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return __builtin_convertvector(r, FN(hvec));
}
static inline void FN(store_s)(S *p, FN(vec) x) { *(FN(hvec) *)p = FN(pack_s)(x); }
#elif PI_STORAGE == 2
static inline R FN(get_s)(S x) { return pi_f16_to_f32(x); }
static inline S FN(set_s)(R x) { return pi_f32_to_f16(x); }
#if defined(__F16C__) && (PI_LANES == 8 || PI_LANES == 4)
#include <immintrin.h>
static inline FN(vec) FN(load_s)(const S *p) {
#if PI_LANES == 8
  return (FN(vec))_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
#else
  return (FN(vec))_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(const void *)p));
#endif
}
#if PI_LANES == 8
static inline FN(hvec) FN(pack_s)(FN(vec) x) {
  return (FN(hvec))_mm256_cvtps_ph((__m256)x, 0); /* 0: to nearest, ties to even */
}
static inline void FN(store_s)(S *p, FN(vec) x) { *(FN(hvec) *)p = FN(pack_s)(x); }
#else
static inline void FN(store_s)(S *p, FN(vec) x) {
  _mm_storel_epi64((__m128i *)(void *)p, _mm_cvtps_ph((__m128)x, 0)); /* 0: to nearest, ties to even */
}
#endif
#else /* pi_f16_to_f32 and pi_f32_to_f16 lane by lane, their branches as selects */
static inline FN(vec) FN(load_s)(const S *p) {
  const FN(wvec) h = FN(widen)(p);
  FN(wvec) o = (h & 0x7fffu) << 13;
  const FN(wvec) e = o & 0x0f800000u;
  o += 0x38000000u;
  o += (FN(wvec))(e == 0x0f800000u) & 0x38000000u;
  const FN(vec) sub = (FN(vec))(o + (1u << 23)) - FN(splat)(6.103515625e-05f);
  o = (FN(wvec))FN(pick)(e == 0, (FN(wvec))sub, o);
  return (FN(vec))(o | (h & 0x8000u) << 16);
}
static inline FN(hvec) FN(pack_s)(FN(vec) x) {
  FN(wvec) u = (FN(wvec))x;
  const FN(wvec) sign = u & 0x80000000u;
  u ^= sign;
  const FN(wvec) big = (FN(wvec))FN(pick)(u > 0x7f800000u, u - u + 0x7e00u, u - u + 0x7c00u);
  const FN(wvec) tiny = (FN(wvec))((FN(vec))u + FN(splat)(0.5f)) - 0x3f000000u;
  const FN(wvec) normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
  FN(wvec) o = (FN(wvec))FN(pick)(u >= 0x47800000u, big, (FN(wvec))FN(pick)(u < 0x38800000u, tiny, normal));
  return __builtin_convertvector(o | sign >> 16, FN(hvec));
}
static inline void FN(store_s)(S *p, FN(vec) x) { *(FN(hvec) *)p = FN(pack_s)(x); }
#endif
#else
static inline R FN(get_s)(S x) { return x; }
static inline S FN(set_s)(R x) { return x; }
static inline FN(vec) FN(load_s)(const S *p) { return FN(load)(p); }
static inline FN(vec) FN(pack_s)(FN(vec) x) { return x; }
static inline void FN(store_s)(S *p, FN(vec) x) { FN(store)(p, x); }
#endif

/* A row of D elements of S as R: the row itself where S = R, else converted into `to` (D of R). */
PI_INLINE const R *FN(row_r)(const S *x, R *to, int64_t D) {
#if PI_STORAGE
  const int64_t whole = D - D % LANES;
  for (int64_t d = 0; d < whole; d += LANES) FN(store)(to + d, FN(load_s)(x + d));
  for (int64_t d = whole; d < D; d++) to[d] = FN(get_s)(x[d]);
  return to;
#else
  (void)to, (void)D;
  return x;
#endif
}

/* A store of an output the caller will not read soon: streaming (non-temporal: written to memory without
 * first reading its cache line, which a plain store of a line not in cache does) where `streaming` and the
 * target has streaming stores; p then lies on a vector boundary (pi_streaming). */
static inline void FN(put)(S *p, FN(vec) x, int streaming) {
#ifdef PI_STREAM
  if (streaming) {
    PI_STREAM(p, FN(pack_s)(x));
    return;
  }
#endif
  (void)streaming;
  FN(store_s)(p, x);
}

/* Rows of R written to S (dk, dv, summed in R): n elements (streaming: as put). */
static inline void FN(rows_s)(S *to, const R *x, int64_t n, int streaming) {
  const int64_t whole = n - n % LANES;
  for (int64_t d = 0; d < whole; d += LANES) FN(put)(to + d, FN(load)(x + d), streaming);
  for (int64_t d = whole; d < n; d++) to[d] = FN(set_s)(x[d]);
}

/* The sum of a vector's lanes, as a tree: the two halves added as vectors first (one extract and one add
 * on AVX), then the remaining lanes. */
typedef R FN(half) __attribute__((vector_size(PI_VECTOR_BYTES / 2)));
static inline R FN(sum_lanes)(FN(vec) x) {
  FN(half) lo, hi;
  memcpy(&lo, &x, sizeof lo);
  memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
  lo += hi;
#if PI_LANES == 8
  return (lo[0] + lo[2]) + (lo[1] + lo[3]);
#elif PI_LANES == 4
  return lo[0] + lo[1];
#else
  return lo[0];
#endif
}

/* a·b over D: two vector accumulators, so consecutive multiply-adds do not wait on each other. */
static inline R FN(dot)(const R *a, const S *b, int64_t D) {
  FN(vec) s0 = {0}, s1 = {0};
  int64_t d = 0;
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    s0 += FN(load)(a + d) * FN(load_s)(b + d);
    s1 += FN(load)(a + d + LANES) * FN(load_s)(b + d + LANES);
  }
  for (; d + LANES <= D; d += LANES) s0 += FN(load)(a + d) * FN(load_s)(b + d);
  R s = FN(sum_lanes)(s0 + s1);
  for (; d < D; d++) s += a[d] * FN(get_s)(b[d]);
  return s;
}

/* (a·b, c·e) over D in one pass: a slot's score and dL/dweight in the backward. */
PI_INLINE void FN(dot2)(const R *a, const S *b, const R *c, const S *e, int64_t D, R *ab, R *ce) {
  FN(vec) s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};
  int64_t d = 0;
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    s0 += FN(load)(a + d) * FN(load_s)(b + d);
    t0 += FN(load)(c + d) * FN(load_s)(e + d);
    s1 += FN(load)(a + d + LANES) * FN(load_s)(b + d + LANES);
    t1 += FN(load)(c + d + LANES) * FN(load_s)(e + d + LANES);
  }
  for (; d + LANES <= D; d += LANES) {
    s0 += FN(load)(a + d) * FN(load_s)(b + d);
    t0 += FN(load)(c + d) * FN(load_s)(e + d);
  }
  R x = FN(sum_lanes)(s0 + s1), y = FN(sum_lanes)(t0 + t1);
  for (; d < D; d++) {
    x += a[d] * FN(get_s)(b[d]);
    y += c[d] * FN(get_s)(e[d]);
  }
  *ab = x;
  *ce = y;
}

/* out[d] = Σ_m w[m·stride]·x[row[m] + d] for m < n (row: element offsets of rows of x; stride: 1, or LANES
 * for a row of a block's slot-major weights). Eight (then four) vectors of out at a time, summed over the
 * slots in registers, then written once: each slot's weight broadcast and its row's offset read once for
 * eight vectors (D 64 in fp32 on AVX: the whole row in one pass). Every lane's sum is taken over m in order
 * whichever width covers it, so the bits do not depend on D's split. */
PI_INLINE void FN(weighted_sum)(S *out, const R *w, int64_t stride, const S *x, const int64_t *row, int64_t n,
                                    int64_t D, int streaming) {
  int64_t d = 0;
  for (; d + 8 * LANES <= D; d += 8 * LANES) {
    FN(vec) a[8] = {{0}};
    for (int64_t m = 0; m < n; m++) {
      const FN(vec) wm = FN(splat)(w[m * stride]);
      const S *r = x + row[m] + d;
      for (int j = 0; j < 8; j++) a[j] += wm * FN(load_s)(r + j * LANES);
    }
    for (int j = 0; j < 8; j++) FN(put)(out + d + j * LANES, a[j], streaming);
  }
  for (; d + 4 * LANES <= D; d += 4 * LANES) {
    FN(vec) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t m = 0; m < n; m++) {
      const FN(vec) wm = FN(splat)(w[m * stride]);
      const S *r = x + row[m] + d;
      a0 += wm * FN(load_s)(r);
      a1 += wm * FN(load_s)(r + LANES);
      a2 += wm * FN(load_s)(r + 2 * LANES);
      a3 += wm * FN(load_s)(r + 3 * LANES);
    }
    FN(put)(out + d, a0, streaming);
    FN(put)(out + d + LANES, a1, streaming);
    FN(put)(out + d + 2 * LANES, a2, streaming);
    FN(put)(out + d + 3 * LANES, a3, streaming);
  }
  for (; d + LANES <= D; d += LANES) {
    FN(vec) acc = {0};
    for (int64_t m = 0; m < n; m++) acc += FN(splat)(w[m * stride]) * FN(load_s)(x + row[m] + d);
    FN(put)(out + d, acc, streaming);
  }
  for (; d < D; d++) {
    R acc = 0;
    for (int64_t m = 0; m < n; m++) acc += w[m * stride] * FN(get_s)(x[row[m] + d]);
    out[d] = FN(set_s)(acc);
  }
}

/* a[d] += s·x[d] and b[d] += t·y[d] over D: a slot's terms of dk and dv (loads before stores in each step). */
PI_INLINE void FN(add2)(R *a, R s, const R *x, R *b, R t, const R *y, int64_t D) {
  const FN(vec) vs = FN(splat)(s), vt = FN(splat)(t);
  const int64_t whole = D - D % LANES;
  int64_t d = 0;
  for (; d < whole; d += LANES) {
    const FN(vec) na = FN(load)(a + d) + vs * FN(load)(x + d), nb = FN(load)(b + d) + vt * FN(load)(y + d);
    FN(store)(a + d, na);
    FN(store)(b + d, nb);
  }
  for (; d < D; d++) {
    a[d] += s * x[d];
    b[d] += t * y[d];
  }
}

/* Where query i's valid slots read: the element offsets key·D of their key rows in a [T, D] head. Its
 * document is [start, end) ([0, T) without documents). The local group first (how many: *n_local): the
 * local keys, then the sinks start + s not already local or a skip (precedence local > skip > sink; at or
 * before i when causal); then the skips. Returns how many. */
static inline int64_t FN(slot_rows)(const pi_pattern *p, int64_t start, int64_t end, int64_t D, int64_t i,
                                    int64_t *row, int64_t *n_local) {
  const int64_t lo = start - i > -p->left ? start - i : -p->left;
  const int64_t hi = end - 1 - i < p->right ? end - 1 - i : p->right;
  int64_t n = 0;
  for (int64_t o = lo; o <= hi; o++) row[n++] = (i + o) * D;
  for (int64_t s = 0; s < p->sinks; s++) {
    const int64_t key = start + s, o = key - i;
    if (key >= end || (p->causal && key > i)) break;
    if ((o >= -p->left && o <= p->right) || (p->skip_back && o == -p->period) || (p->skip_ahead && o == p->period))
      continue;
    row[n++] = key * D;
  }
  *n_local = n;
  if (p->skip_back && i - p->period >= start) row[n++] = (i - p->period) * D;
  if (p->skip_ahead && i + p->period < end) row[n++] = (i + p->period) * D;
  return n;
}

/* The dropout multiplier of each of query i's slots (in slot_rows' order, from their key rows): keep_scale
 * where the contract's keep mask keeps its slot, else 0 (a multiplier, not a skip: the reference multiplies a
 * dropped weight by 0 as well). keep: the query's row of the mask [slots of the contract's layout: local
 * keys i − window …, then i − π, i + π, then sink s]. */
static inline void FN(dropout_row)(const pi_call *c, const pi_pattern *p, int64_t start, int64_t i, int64_t D,
                                   const int64_t *row, int64_t n, int64_t n_local, const uint8_t *keep, R *mult) {
  const R scale = (R)c->keep_scale;
  const int64_t n_rel = p->n_rel_local + p->skip_back + p->skip_ahead;
  for (int64_t m = 0; m < n; m++) {
    const int64_t key = row[m] / D, o = key - i;
    int64_t slot;
    if (m >= n_local) slot = p->n_rel_local + (o > 0 && p->skip_back); /* skips: i − π first */
    else if (o >= -p->left && o <= p->right) slot = o + c->window;      /* local */
    else slot = n_rel + (key - start);                                  /* sink key start + s */
    mult[m] = keep[slot] ? scale : 0;
  }
}

#if PI_VECTOR_EXP
typedef int32_t FN(ivec) __attribute__((vector_size(PI_VECTOR_BYTES)));
typedef uint32_t FN(uivec) __attribute__((vector_size(PI_VECTOR_BYTES)));

/* Whether any lane of a mask is set. */
static inline int FN(any)(FN(ivec) mask) {
  int32_t lanes[LANES];
  memcpy(lanes, &mask, sizeof lanes);
  int32_t seen = 0;
  for (int64_t j = 0; j < LANES; j++) seen |= lanes[j];
  return seen != 0;
}

/* log of each lane, for the normal lanes in [FLT_MIN, FLT_MAX] (Cephes' logf: x = m·2^e with m in [√½, √2),
 * a degree-9 polynomial in m − 1; within 1 ulp of the exact log, every such float checked). Lanes outside (0,
 * negatives, subnormals, inf, NaN) are left to libm by the caller: *inside says which lanes this computed. */
static inline FN(vec) FN(log_lanes)(FN(vec) x, FN(ivec) * inside) {
  *inside = (x >= FN(splat)(1.17549435e-38f)) & (x <= FN(splat)(3.40282347e+38f));
  const FN(ivec) bits = (FN(ivec))x & *inside; /* lanes outside: 0, so nothing below overflows */
  FN(ivec) e = (bits >> 23) - 126;
  FN(vec) m = (FN(vec))((bits & 0x007fffff) | 0x3f000000); /* x = m·2^e, m in [0.5, 1) */
  const FN(ivec) small = m < FN(splat)(0.707106781186547524f);
  e += small;                                  /* e − 1 where m < √½ ... */
  m = m + (FN(vec))((FN(ivec))m & small) - 1; /* ... and 2m − 1 there, else m − 1 */
  const FN(vec) z = m * m;
  FN(vec) y = FN(splat)(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const FN(vec) fe = (FN(vec))(e + 0x4b400000) - 12582912.0f; /* e as a float: 1.5·2^23 + e, less 1.5·2^23 */
  y += fe * -2.12194440e-4f; /* ln 2 as 0.693359375 − 2.12194440e-4: the first part exact times e */
  y += z * -0.5f;
  return (m + y) + fe * 0.693359375f;
}
#endif

/* log of each lane: log_lanes, libm for the lanes outside its range (fp64: libm). A row alone takes the same
 * lanes as a block of rows (forward_block_d), so that its logs are the same bits either way. Not inlined: it
 * runs once for a block of rows, and inlined into the blocks it made the forward 1.03–1.07× slower. */
static __attribute__((noinline)) FN(vec) FN(logs)(FN(vec) x) {
#if PI_VECTOR_EXP
  FN(ivec) inside;
  FN(vec) y = FN(log_lanes)(x, &inside);
  if (FN(any)(~inside))
    for (int64_t j = 0; j < LANES; j++)
      if (!inside[j]) y[j] = PI_LOG(x[j]);
  return y;
#else
  for (int64_t j = 0; j < LANES; j++) x[j] = PI_LOG(x[j]);
  return x;
#endif
}

/* log of one value, as logs takes it (the other lanes 1: never outside). */
static inline R FN(log1)(R x) {
#if PI_VECTOR_EXP
  FN(vec) v = FN(splat)(1);
  v[0] = x;
  return FN(logs)(v)[0];
#else
  return PI_LOG(x);
#endif
}

/* The log-priors of a query's local and skip slots (0 for "union" and "separate", whose α mixes after
 * normalising); `a` is its gate value. */
static inline void FN(log_priors)(const pi_call *c, const pi_pattern *p, R a, R *local, R *skip) {
  const R eps = (R)c->eps;
  if (c->variant == PI_FIXED) {
    *local = (R)p->fixed_local;
    *skip = (R)p->fixed_skip;
  } else if (c->variant == PI_ADAPTIVE) {
    const R rest = 1 - a;
#if PI_VECTOR_EXP
    FN(vec) both = FN(splat)(1); /* the two logs in lanes 0 and 1, as a block's rows take them */
    both[0] = a < eps ? eps : a; /* max(·, ε) that keeps a NaN */
    both[1] = rest < eps ? eps : rest;
    both = FN(logs)(both);
    *local = both[0];
    *skip = both[1];
#else
    *local = PI_LOG(a < eps ? eps : a); /* max(·, ε) that keeps a NaN */
    *skip = PI_LOG(rest < eps ? eps : rest);
#endif
  } else {
    *local = 0;
    *skip = 0;
  }
}

/* The logits from the dot products z[m] (m < n, local slots first: n_local): scaled, clamped (a NaN passes),
 * plus the slot's log-prior; pass[m] (when not NULL): whether the clamp lets the gradient through (a NaN
 * score: not, as torch's mask). After all the dots of a row, in loops of their own: no branch per slot, and
 * the dots' latencies overlap. */
static inline void FN(logits)(const pi_call *c, R *z, R *pass, int64_t n, int64_t n_local, R lp_local,
                              R lp_skip) {
  const R scale = (R)c->scale, limit = (R)c->clamp;
  if (c->has_clamp) {
    for (int64_t m = 0; m < n; m++) {
      R score = z[m] * scale;
      if (pass) pass[m] = (R)(score <= limit && score >= -limit);
      score = score > limit ? limit : score;
      score = score < -limit ? -limit : score;
      z[m] = score + (m < n_local ? lp_local : lp_skip);
    }
  } else {
    for (int64_t m = 0; m < n; m++) {
      if (pass) pass[m] = 1;
      z[m] = z[m] * scale + (m < n_local ? lp_local : lp_skip);
    }
  }
}

#if PI_VECTOR_EXP
/* exp of each lane, for lanes in [-87, 88] (Cephes' expf: x = n·ln 2 + r, a degree-6 polynomial in r, 2^n from
 * the exponent bits; within about 2 ulp of libm). Lanes outside, NaN included, are left to libm by the
 * caller: *inside says which lanes this computed. */
PI_INLINE FN(vec) FN(exp_lanes)(FN(vec) x, FN(ivec) * inside) {
  const FN(vec) magic = FN(splat)(12582912.0f); /* 1.5·2^23: adding it rounds to an integer */
  *inside = (x >= FN(splat)(-87.0f)) & (x <= FN(splat)(88.0f));
  x = (FN(vec))((FN(ivec))x & *inside); /* lanes outside: 0, so nothing below overflows */
  const FN(vec) t = x * FN(splat)(1.44269504088896341f) + magic;
  const FN(vec) n = t - magic;
  const FN(vec) r = x - n * FN(splat)(0.693359375f) - n * FN(splat)(-2.12194440e-4f);
  FN(vec) p = FN(splat)(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const FN(uivec) bits = (FN(uivec))((FN(ivec))t - (FN(ivec))magic + 127) << 23; /* 2^n, n in [-126, 127] */
  return p * (FN(vec))bits;
}


/* exp of each lane: exp_lanes, libm for the lanes outside its range (a block of rows: forward_block_d,
 * backward_block_d; the same bits as exp_shifted gives each lane). */
PI_INLINE FN(vec) FN(exps)(FN(vec) x) {
  FN(ivec) inside;
  FN(vec) e = FN(exp_lanes)(x, &inside);
  if (FN(any)(~inside))
    for (int64_t j = 0; j < LANES; j++)
      if (!inside[j]) e[j] = PI_EXP(x[j]);
  return e;
}

/* z[m] = exp(z[m] − shift) for m in [from, to), a vector at a time; returns their sum. shift is taken as a
 * float pair hi + lo, so that (z − hi) − lo keeps the precision of a shift in double (a log-sum-exp: see
 * normalise). The last vector may read lanes past `to` (the scratch rows are padded) but never writes them;
 * lanes outside the polynomial's range, NaN included, take libm's exp. */
static inline R FN(exp_shifted)(R *z, int64_t from, int64_t to, double shift) {
  const R hi = (R)shift, lo = (R)(shift - (double)hi);
  const FN(ivec) index = *(const FN(ivec) *)(const void *)pi_lane_index;
  FN(vec) sum = {0};
  for (int64_t m = from; m < to; m += LANES) {
    const int64_t count = to - m < LANES ? to - m : LANES;
    const FN(ivec) valid = index < (FN(ivec)){0} + (int32_t)count;
    const FN(vec) x = (FN(load)(z + m) - hi) - lo;
    FN(ivec) inside;
    FN(vec) e = (FN(vec))((FN(ivec))FN(exp_lanes)(x, &inside) & valid);
    if (FN(any)(valid & ~inside))
      for (int64_t j = 0; j < count; j++)
        if (!inside[j]) e[j] = PI_EXP(x[j]);
    sum += e;
    if (count == LANES) FN(store)(z + m, e);
    else
      for (int64_t j = 0; j < count; j++) z[m + j] = e[j];
  }
  return FN(sum_lanes)(sum);
}
#else
/* z[m] = exp(z[m] − shift) for m in [from, to), the difference taken in double; returns their sum. */
static inline R FN(exp_shifted)(R *z, int64_t from, int64_t to, double shift) {
  R total = 0;
  for (int64_t m = from; m < to; m++) {
    z[m] = PI_EXP((R)((double)z[m] - shift));
    total += z[m];
  }
  return total;
}
#endif

/* Softmax of z[from … to) in place; returns the log-sum-exp, in double: the backward takes exp(z − lse), and
 * an fp32 lse would be off by |lse|·2^-24, an error that grows with the logits (and multiplies every
 * gradient). A NaN logit makes every weight NaN. */
static inline double FN(normalise)(R *z, int64_t from, int64_t to) {
  R top = -INFINITY;
  for (int64_t m = from; m < to; m++)
    if (z[m] > top) top = z[m];
  const R total = FN(exp_shifted)(z, from, to, top);
  const R inverse = 1 / total;
  for (int64_t m = from; m < to; m++) z[m] *= inverse;
  /* total lies in [1, to − from]: its log in R is accurate to an ulp of a small number; top is added in double */
  return (double)top + (double)FN(log1)(total);
}

/* Scratch of one thread, p->n_max (n) each: key row offsets, logits (then weights), dL/dweights (then
 * dL/dlogits), clamp mask, dropout multipliers; for blocks of LANES rows (forward_block_d, backward_block_d)
 * the key row offsets of each row [LANES][n], vector-aligned slot by slot [n][LANES]: the logits (then
 * weights), dL/dweights (then dL/dlogits), clamp masks and dropout multipliers, and the dots before their last
 * sum, of q·k and of dy·v [2][n][LANES][LANES]; rows of q and dy converted to R where S is not R: 2·LANES·D. */
typedef struct {
  int64_t *row;
  R *z, *dp, *pass, *mult;
  int64_t *rows;
  R *zt, *dpt, *passt, *multt, *lanes, *conv;
  int64_t n;
} FN(pi_scratch);

/* The scratch rows in one allocation (free(w->row) releases them); NULL members when out of memory. */
static FN(pi_scratch) FN(scratch)(int64_t n, int64_t D) {
  /* z is padded by a vector (exp_shifted may read a whole last vector) and zeroed, so that what it reads past
   * the row's slots is a number; the block rows start at a vector boundary (at most a vector of padding) */
  const size_t head = sizeof(int64_t) * (size_t)(n + LANES * n) + sizeof(R) * (size_t)(4 * n + LANES);
  const size_t conv = PI_STORAGE ? (size_t)(2 * LANES * D) : 0;
  const size_t bytes = head + sizeof(R) * (size_t)(4 * LANES * n + 2 * LANES * LANES * n + conv) + PI_VECTOR_BYTES;
  FN(pi_scratch) w = {calloc(1, bytes), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, n};
  if (w.row) {
    w.rows = w.row + n;
    w.z = (R *)(w.rows + LANES * n);
    w.dp = w.z + n + LANES;
    w.pass = w.dp + n;
    w.mult = w.pass + n;
    const uintptr_t align = PI_VECTOR_BYTES, after = (uintptr_t)(w.mult + n);
    w.zt = (R *)((after + align - 1) / align * align); /* LANES·n: a whole number of vectors after it */
    w.dpt = w.zt + LANES * n;
    w.passt = w.dpt + LANES * n;
    w.multt = w.passt + LANES * n;
    w.lanes = w.multt + LANES * n;
    w.conv = w.lanes + 2 * LANES * LANES * n;
  }
  return w;
}

/* One query row: y_i and its statistics. qi [D], k, v [T, D] of its key/value head, a its gate value. */
static inline __attribute__((always_inline)) void FN(forward_row_d)(const pi_call *c, const pi_pattern *p,
                                                                   int64_t i, int64_t start, int64_t end,
                                                                   const S *q_i, const S *k, const S *v,
                                                                   R a, S *yi, double *stat, const uint8_t *keep,
                                                                   FN(pi_scratch) * w, const int64_t D) {
  int64_t *row = w->row, nl;
  R *z = w->z;
  const R *qi = FN(row_r)(q_i, w->conv, D);
  const int64_t n = FN(slot_rows)(p, start, end, D, i, row, &nl);
  R lp_local, lp_skip;
  FN(log_priors)(c, p, a, &lp_local, &lp_skip);
  for (int64_t m = 0; m < n; m++) z[m] = FN(dot)(qi, k + row[m], D);
  FN(logits)(c, z, NULL, n, nl, lp_local, lp_skip);
  if (c->variant != PI_SEPARATE) {
    stat[0] = FN(normalise)(z, 0, n);
  } else {
    stat[0] = FN(normalise)(z, 0, nl);
    stat[1] = n > nl ? FN(normalise)(z, nl, n) : 0;
    if (n > nl) { /* α is read only where a skip key exists: elsewhere the local branch has weight 1 */
      for (int64_t m = 0; m < nl; m++) z[m] *= a;
      for (int64_t m = nl; m < n; m++) z[m] *= 1 - a;
    }
  }
  if (keep) { /* dropout on the weights (after mixing, for "separate") */
    FN(dropout_row)(c, p, start, i, D, row, n, nl, keep, w->mult);
    for (int64_t m = 0; m < n; m++) z[m] *= w->mult[m];
  }
  FN(weighted_sum)(yi, z, 1, v, row, n, D, 0);
}

#if PI_VECTOR_EXP
/* The sum of each lane's LANES values s[0 … LANES): the lanes of a row's sum vector in exp_shifted, added as
 * sum_lanes adds them (the same bits). */
static inline FN(vec) FN(sum_lanes_rows)(const FN(vec) *s) {
#if PI_LANES == 8
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
#elif PI_LANES == 4
  return (s[0] + s[2]) + (s[1] + s[3]);
#else
  return s[0] + s[1];
#endif
}

/* Lanes of two vectors, picked by index (0 … LANES − 1: a's, LANES …: b's): GCC's and Clang's spellings. */
#ifndef PI_SHUFFLE
#ifdef __clang__
#define PI_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PI_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (FN(ivec)){__VA_ARGS__})
#endif
#endif

/* a·b over D as a vector whose lanes sum_lanes adds up (D a multiple of LANES; a as vectors): dot without its
 * last step. */
PI_INLINE FN(vec) FN(dot_lanes)(const FN(vec) *a, const S *b, int64_t D) {
  FN(vec) s0 = {0}, s1 = {0};
  int64_t d = 0;
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    s0 += a[d / LANES] * FN(load_s)(b + d);
    s1 += a[d / LANES + 1] * FN(load_s)(b + d + LANES);
  }
  for (; d + LANES <= D; d += LANES) s0 += a[d / LANES] * FN(load_s)(b + d);
  return s0 + s1;
}

#if PI_LANES == 8 || PI_LANES == 4
/* The vector of sum_lanes(x[r]) for r < LANES, the lanes of each added in sum_lanes' order (the same bits as
 * LANES calls), by shuffles that transpose as they add: a few vector instructions instead of LANES
 * horizontal sums and LANES stores. */
PI_INLINE FN(vec) FN(sum_lanes_of)(const FN(vec) *x) {
#if PI_LANES == 8
  /* u_r = low half + high half of x[r]; p[r] = [u_r | u_r+4] */
  FN(vec) p[4];
  for (int j = 0; j < 4; j++)
    p[j] = PI_SHUFFLE(x[j], x[j + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           PI_SHUFFLE(x[j], x[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  /* in each half: [u_a0 + u_a2, u_b0 + u_b2, u_a1 + u_a3, u_b1 + u_b3] for the pairs (a, b) = (0, 1), (2, 3) */
  const FN(vec) s01 =
      PI_SHUFFLE(p[0], p[1], 0, 8, 1, 9, 4, 12, 5, 13) + PI_SHUFFLE(p[0], p[1], 2, 10, 3, 11, 6, 14, 7, 15);
  const FN(vec) s23 =
      PI_SHUFFLE(p[2], p[3], 0, 8, 1, 9, 4, 12, 5, 13) + PI_SHUFFLE(p[2], p[3], 2, 10, 3, 11, 6, 14, 7, 15);
  /* (u0 + u2) + (u1 + u3) of rows 0 … 3 in the low half, 4 … 7 in the high half */
  return PI_SHUFFLE(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13) + PI_SHUFFLE(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
#else
  /* [u_a0, u_b0, u_a1, u_b1] with u_r = [x_r0 + x_r2, x_r1 + x_r3], for (a, b) = (0, 1), (2, 3) */
  const FN(vec) t01 = PI_SHUFFLE(x[0], x[1], 0, 4, 1, 5) + PI_SHUFFLE(x[0], x[1], 2, 6, 3, 7);
  const FN(vec) t23 = PI_SHUFFLE(x[2], x[3], 0, 4, 1, 5) + PI_SHUFFLE(x[2], x[3], 2, 6, 3, 7);
  return PI_SHUFFLE(t01, t23, 0, 1, 4, 5) + PI_SHUFFLE(t01, t23, 2, 3, 6, 7);
#endif
}
#endif

/* a where mask is set, else b, lane by lane. */
static inline FN(vec) FN(select)(FN(ivec) mask, FN(vec) a, FN(vec) b) {
  return (FN(vec))(((FN(ivec))a & mask) | ((FN(ivec))b & ~mask));
}

/* Each lane clamped to [−limit, limit] as FN(logits) clamps a score (a NaN passes). */
static inline FN(vec) FN(clamp_lanes)(FN(vec) x, FN(vec) limit) {
  x = FN(select)(x > limit, limit, x);
  return FN(select)(x < -limit, -limit, x);
}

/* The slots of LANES consecutive query rows i0 … of one head, in w->rows (rows[r·w->n + m]: key row offset of
 * slot m of row i0 + r), how many (*n) and how many local (*n_local), when all the rows' slots have the same
 * structure (every row but those near the sequence's or a document's edges); else 0. start, end: the rows'
 * document bounds (NULL: none). */
static inline int FN(block_slots)(const pi_call *c, const pi_pattern *p, int64_t i0, const int64_t *start,
                                  const int64_t *end, int64_t D, FN(pi_scratch) * w, int64_t *n_slots,
                                  int64_t *n_local) {
  const int64_t stride = w->n;
  int64_t *rows = w->rows, n = 0, nl = 0, last = (LANES - 1) * stride;
  int same = !p->sinks; /* no sinks, and the rows in one document: */
  for (int64_t r = 1; r < LANES && same && start; r++) same = start[r] == start[0] && end[r] == end[0];
  if (same) {
    /* Each part of a row's slots (the local keys clipped to the document, each skip) is there from some row
     * on, or up to some row: where the first and last rows agree, so do all between, with the keys shifted. */
    int64_t nl_last;
    n = FN(slot_rows)(p, start ? start[0] : 0, start ? end[0] : c->T, D, i0, rows, &nl);
    if (FN(slot_rows)(p, start ? start[0] : 0, start ? end[0] : c->T, D, i0 + LANES - 1, rows + last, &nl_last) != n ||
        nl_last != nl)
      return 0;
    for (int64_t m = 0; m < n; m++)
      if (rows[last + m] != rows[m] + (LANES - 1) * D) return 0;
    for (int64_t r = 1; r < LANES - 1; r++)
      for (int64_t m = 0; m < n; m++) rows[r * stride + m] = rows[m] + r * D;
  } else {
    for (int64_t r = 0; r < LANES; r++) {
      int64_t nl_r;
      const int64_t n_r = FN(slot_rows)(p, start ? start[r] : 0, start ? end[r] : c->T, D, i0 + r,
                                        rows + r * stride, &nl_r);
      if (r == 0) n = n_r, nl = nl_r;
      else if (n_r != n || nl_r != nl) return 0;
    }
  }
  *n_slots = n;
  *n_local = nl;
  return 1;
}

/* LANES consecutive query rows i0 … i0 + LANES − 1 of one head at once (fp32 without "separate"), when their
 * slots have the same structure: as many slots and as many local ones, each row with its own keys (every row
 * but those near the sequence's or a document's edges). Why: a row alone is a short chain of dependent steps
 * (dots, max, exp, sum, divide, log) that the CPU barely overlaps with the next row's; here the dots of all the
 * rows are issued back to back, and the softmax runs with the rows in the lanes of a vector: z[m·LANES + r] is
 * slot m of row i0 + r. Each lane-wise step is the per-row one in the same order (the max as `if (z > top)`,
 * so a NaN is skipped; exp_lanes with libm for the lanes outside its range; the sum's lanes added as
 * sum_lanes adds them), so a row's outputs are the same bits whichever path it takes, whatever block the
 * thread count puts it in. start, end: the rows' document bounds (NULL: none); q, gate, y, stat, keep: at row
 * i0 of the head. Returns 0, having written nothing, when the rows' slots differ: they take forward_row_d. */
static inline __attribute__((always_inline)) int FN(forward_block_d)(const pi_call *c, const pi_pattern *p,
                                                                    int64_t i0, const int64_t *start,
                                                                    const int64_t *end, const S *q_rows, const S *k,
                                                                    const S *v, const S *gate, S *y,
                                                                    double *stat, const uint8_t *keep, int streaming,
                                                                    FN(pi_scratch) * w, const int64_t D) {
  int64_t n, nl;
  if (!FN(block_slots)(c, p, i0, start, end, D, w, &n, &nl)) return 0;
  const int64_t stride = w->n, *rows = w->rows;
  R *z = w->zt;
  const R *q = FN(row_r)(q_rows, w->conv, LANES * D); /* the block's rows of q, as R */
  /* The dots, all independent (their latencies overlap), row by row (each row's q read once, the keys read in
   * order: a stream the prefetchers follow); then, slot by slot, the vector of the block's rows. */
#if PI_LANES == 8 || PI_LANES == 4
  if (D % LANES == 0 && D <= 16 * LANES) {
    FN(vec) *x = (FN(vec) *)(void *)w->lanes; /* x[m·LANES + r]: slot m of row r, its lanes not yet summed */
    for (int64_t r = 0; r < LANES; r++) {
      FN(vec) qr[16]; /* the row's q, in registers for all its slots */
      for (int64_t d = 0; d < D; d += LANES) qr[d / LANES] = FN(load)(q + r * D + d);
      for (int64_t m = 0; m < n; m++) x[m * LANES + r] = FN(dot_lanes)(qr, k + rows[r * stride + m], D);
    }
    for (int64_t m = 0; m < n; m++) FN(store)(z + m * LANES, FN(sum_lanes_of)(x + m * LANES));
  } else
#endif
    for (int64_t r = 0; r < LANES; r++)
      for (int64_t m = 0; m < n; m++) z[m * LANES + r] = FN(dot)(q + r * D, k + rows[r * stride + m], D);
  /* the log-priors (as log_priors, lane by lane) */
  FN(vec) local = FN(splat)(0), skip = FN(splat)(0);
  if (c->variant == PI_FIXED) {
    local = FN(splat)((R)p->fixed_local);
    skip = FN(splat)((R)p->fixed_skip);
  } else if (c->variant == PI_ADAPTIVE) {
    const FN(vec) a = FN(load_s)(gate), rest = 1 - a, eps = FN(splat)((R)c->eps);
    local = FN(logs)(FN(select)(a < eps, eps, a));
    skip = FN(logs)(FN(select)(rest < eps, eps, rest));
  }
  /* the logits (as FN(logits)) and their max */
  const FN(vec) scale = FN(splat)((R)c->scale), limit = FN(splat)((R)c->clamp);
  FN(vec) top = FN(splat)(-INFINITY);
  for (int64_t m = 0; m < n; m++) {
    FN(vec) score = FN(load)(z + m * LANES) * scale;
    if (c->has_clamp) score = FN(clamp_lanes)(score, limit);
    score += m < nl ? local : skip;
    FN(store)(z + m * LANES, score);
    top = FN(select)(score > top, score, top);
  }
  /* exp(z − top) as exp_shifted: the shift as the pair hi = top, lo = top − top (0, or NaN where top is
   * infinite: what (R)(shift − (double)hi) is there) */
  const FN(vec) hi = top, lo = top - top;
  FN(vec) sum[LANES];
  for (int64_t j = 0; j < LANES; j++) sum[j] = FN(splat)(0);
  for (int64_t m = 0; m < n; m++) {
    const FN(vec) e = FN(exps)((FN(load)(z + m * LANES) - hi) - lo);
    sum[m % LANES] += e;
    FN(store)(z + m * LANES, e);
  }
  const FN(vec) total = FN(sum_lanes_rows)(sum), inverse = FN(splat)(1) / total;
  for (int64_t m = 0; m < n; m++) FN(store)(z + m * LANES, FN(load)(z + m * LANES) * inverse);
  const FN(vec) log_total = FN(logs)(total);
  for (int64_t r = 0; r < LANES; r++) stat[r] = (double)top[r] + (double)log_total[r];
  if (keep) /* dropout on the weights */
    for (int64_t r = 0; r < LANES; r++) {
      FN(dropout_row)(c, p, start ? start[r] : 0, i0 + r, D, rows + r * stride, n, nl, keep + r * c->keep_slots,
                      w->mult);
      for (int64_t m = 0; m < n; m++) z[m * LANES + r] *= w->mult[m];
    }
  for (int64_t r = 0; r < LANES; r++)
    FN(weighted_sum)(y + r * D, z + r, LANES, v, rows + r * stride, n, D, streaming);
  return 1;
}
#endif

#if PI_VECTOR_EXP && !PI_STORAGE && (PI_LANES == 8 || PI_LANES == 4)
/* backward_row_d for fp32 without "separate" (D a multiple of LANES, at most 16 vectors), with the row's slots
 * in the lanes of vectors, LANES slots a vector. Why: backward_row_d's first half is a chain of scalar steps,
 * one per slot (a horizontal sum per dot, the logits, the softmax's gradient, dgate's sums), and exp's vector
 * loads of the logits wait there for the scalar stores before them (a load that spans several stores is not
 * forwarded); here each step is one vector instruction for LANES slots. The dots, logits and weights are the
 * bits backward_row_d gets (sum_lanes_of adds as sum_lanes does); the softmax's sums over the slots are taken
 * lane-wise, then across the lanes: another order than backward_row_d's, the same sums. */
#define PI_ROW_LANES 1
PI_INLINE void FN(backward_row_lanes_d)(const pi_call *c, const pi_pattern *p, int64_t i, int64_t start, int64_t end,
                                        const R *qi, const R *dyi, const R *k, const R *v, R a, const R *lp,
                                        const double *stat, R *dqi, R *dk, R *dv, int64_t at, R *dgate,
                                        const uint8_t *keep, int streaming, FN(pi_scratch) * w, const int64_t D) {
  int64_t *row = w->row, nl;
  const int64_t n = FN(slot_rows)(p, start, end, D, i, row, &nl), width = (n + LANES - 1) / LANES * LANES;
  /* [width]: slot m at m (lane m % LANES of vector m / LANES); the lanes past n are 0 where they are read */
  R *z = w->zt, *dp = w->dpt, *pass = w->passt, *mult = w->multt;
  FN(vec) *xz = (FN(vec) *)(void *)w->lanes, *xp = xz + width; /* [width]: the dots before their last sum */
  FN(vec) qr[16], dyr[16]; /* the row's q and dy, in registers for all its slots */
  for (int64_t d = 0; d < D; d += LANES) {
    qr[d / LANES] = FN(load)(qi + d);
    dyr[d / LANES] = FN(load)(dyi + d);
  }
  for (int64_t m = 0; m < n; m++) {
    xz[m] = FN(dot_lanes)(qr, k + row[m], D);
    xp[m] = FN(dot_lanes)(dyr, v + row[m], D);
  }
  for (int64_t m = n; m < width; m++) xz[m] = xp[m] = FN(splat)(0);
  R lp_local, lp_skip; /* "adaptive": lp (backward_log_priors), the same bits as log_priors */
  if (lp) lp_local = lp[0], lp_skip = lp[LANES];
  else FN(log_priors)(c, p, a, &lp_local, &lp_skip);
  if (keep) {
    FN(dropout_row)(c, p, start, i, D, row, n, nl, keep, mult);
    for (int64_t m = n; m < width; m++) mult[m] = 0;
  }
  const FN(ivec) index = *(const FN(ivec) *)(const void *)pi_lane_index;
  const FN(vec) scale = FN(splat)((R)c->scale), limit = FN(splat)((R)c->clamp), one = FN(splat)(1),
                none = FN(splat)(0), prior_local = FN(splat)(lp_local), prior_skip = FN(splat)(lp_skip);
  const R shift = (R)stat[0];
  const FN(vec) hi = FN(splat)(shift), lo = FN(splat)((R)(stat[0] - (double)shift));
  /* the weights exp(logit − stat) (z; the shift as the pair hi + lo: exp_shifted) and dL/dweight (dp) */
  FN(vec) sum = none;
  for (int64_t g = 0; g < width; g += LANES) {
    const FN(ivec) slot = index + (int32_t)g;
    FN(vec) score = FN(sum_lanes_of)(xz + g) * scale, grad = FN(sum_lanes_of)(xp + g);
    if (c->has_clamp) { /* as FN(logits): a NaN passes the clamp but not the mask */
      FN(store)(pass + g, FN(select)((score <= limit) & (score >= -limit), one, none));
      score = FN(clamp_lanes)(score, limit);
    }
    score += FN(select)(slot < (int32_t)nl, prior_local, prior_skip);
    const FN(vec) e = FN(select)(slot < (int32_t)n, FN(exps)((score - hi) - lo), none);
    if (keep) grad *= FN(load)(mult + g); /* dL/dweight before dropout: the kept ones scaled, the dropped 0 */
    FN(store)(z + g, e);
    sum += e * grad;
    FN(store)(dp + g, grad);
  }
  /* dp becomes the gradient of the logits, then of the dots (the clamp's mask, the scale) */
  const FN(vec) total = FN(splat)(FN(sum_lanes)(sum));
  FN(vec) d_local = none, d_skip = none;
  for (int64_t g = 0; g < width; g += LANES) {
    const FN(ivec) slot = index + (int32_t)g;
    const FN(vec) grad = FN(load)(z + g) * (FN(load)(dp + g) - total);
    d_local += FN(select)(slot < (int32_t)nl, grad, none);
    d_skip += FN(select)((slot >= (int32_t)nl) & (slot < (int32_t)n), grad, none);
    FN(store)(dp + g, grad * (c->has_clamp ? FN(load)(pass + g) * scale : scale));
    if (keep) FN(store)(z + g, FN(load)(z + g) * FN(load)(mult + g)); /* dv reads the weights after dropout */
  }
  if (dgate && c->variant == PI_ADAPTIVE) { /* d log max(α, ε) / dα = 1/α where α >= ε, else 0 */
    const R eps = (R)c->eps, rest = 1 - a;
    const R skip = n > nl ? FN(sum_lanes)(d_skip) * (R)(rest >= eps) / rest : 0;
    *dgate = FN(sum_lanes)(d_local) * (R)(a >= eps) / a - skip;
  }
  /* dq_i = Σ_m dz_m·k_m; dk_m += dz_m·q_i and dv_m += w_m·dy_i, one pass over D per slot. */
  FN(weighted_sum)(dqi, dp, 1, k, row, n, D, streaming);
  for (int64_t m = 0; m < n; m++) FN(add2)(dk + (row[m] - at), dp[m], qi, dv + (row[m] - at), z[m], dyi, D);
}
#else
#define PI_ROW_LANES 0
#endif

/* One query row's gradients: dq_i, dgate_i (when dgate is not NULL), and its terms of dk, dv (key j's row at
 * j·D − at: the backward's window of rows). */
static inline __attribute__((always_inline)) void FN(backward_row_d)(const pi_call *c, const pi_pattern *p,
                                                                    int64_t i, int64_t start, int64_t end,
                                                                    const S *q_i, const S *dy_i,
                                                                    const S *k, const S *v, R a, const R *lp,
                                                                    const double *stat, S *dqi, R *dk, R *dv,
                                                                    int64_t at, S *dgate, const uint8_t *keep,
                                                                    int streaming, FN(pi_scratch) * w,
                                                                    const int64_t D) {
#if PI_ROW_LANES
  if (c->variant != PI_SEPARATE && D % LANES == 0 && D <= 16 * LANES) {
    FN(backward_row_lanes_d)(c, p, i, start, end, q_i, dy_i, k, v, a, lp, stat, dqi, dk, dv, at, dgate, keep,
                             streaming, w, D);
    return;
  }
#endif
  int64_t *row = w->row, nl;
  R *z = w->z, *dp = w->dp, *pass = w->pass;
  const R *qi = FN(row_r)(q_i, w->conv, D), *dyi = FN(row_r)(dy_i, w->conv + D, D);
  const int64_t n = FN(slot_rows)(p, start, end, D, i, row, &nl);
  R lp_local, lp_skip; /* "adaptive": lp (backward_log_priors), the same bits as log_priors */
  if (lp) lp_local = lp[0], lp_skip = lp[LANES];
  else FN(log_priors)(c, p, a, &lp_local, &lp_skip);
  const R scale = (R)c->scale;
  for (int64_t m = 0; m < n; m++) FN(dot2)(qi, k + row[m], dyi, v + row[m], D, &z[m], &dp[m]);
  FN(logits)(c, z, pass, n, nl, lp_local, lp_skip);
  if (keep) { /* dL/dweight before dropout: the kept ones scaled, the dropped ones 0 */
    FN(dropout_row)(c, p, start, i, D, row, n, nl, keep, w->mult);
    for (int64_t m = 0; m < n; m++) dp[m] *= w->mult[m];
  }
  /* z becomes the weights, dp the gradient of the logits (before the clamp mask). */
  if (c->variant != PI_SEPARATE) {
    FN(exp_shifted)(z, 0, n, stat[0]);
    R sum = 0;
    for (int64_t m = 0; m < n; m++) sum += z[m] * dp[m];
    R d_local = 0, d_skip = 0;
    for (int64_t m = 0; m < n; m++) {
      dp[m] = z[m] * (dp[m] - sum);
      if (m < nl) d_local += dp[m];
      else d_skip += dp[m];
    }
    if (dgate && c->variant == PI_ADAPTIVE) { /* d log max(α, ε) / dα = 1/α where α >= ε, else 0 */
      const R eps = (R)c->eps, rest = 1 - a;
      *dgate = FN(set_s)(d_local * (R)(a >= eps) / a - (n > nl ? d_skip * (R)(rest >= eps) / rest : 0));
    }
  } else {
    FN(exp_shifted)(z, 0, nl, stat[0]);
    FN(exp_shifted)(z, nl, n, stat[1]);
    R sum_local = 0, sum_skip = 0;
    for (int64_t m = 0; m < n; m++) {
      if (m < nl) sum_local += z[m] * dp[m];
      else sum_skip += z[m] * dp[m];
    }
    const R coef_local = n > nl ? a : 1, coef_skip = 1 - coef_local;
    for (int64_t m = 0; m < n; m++) {
      const R coef = m < nl ? coef_local : coef_skip;
      dp[m] = coef * z[m] * (dp[m] - (m < nl ? sum_local : sum_skip));
      z[m] *= coef;
    }
    if (dgate) *dgate = FN(set_s)(n > nl ? sum_local - sum_skip : 0);
  }
  if (keep) /* the weights dv reads are those after dropout */
    for (int64_t m = 0; m < n; m++) z[m] *= w->mult[m];
  /* dq_i = Σ_m dz_m·k_m; dk_m += dz_m·q_i and dv_m += w_m·dy_i, one pass over D per slot. */
  for (int64_t m = 0; m < n; m++) dp[m] *= pass[m] * scale;
  FN(weighted_sum)(dqi, dp, 1, k, row, n, D, streaming);
  for (int64_t m = 0; m < n; m++) FN(add2)(dk + (row[m] - at), dp[m], qi, dv + (row[m] - at), z[m], dyi, D);
}

/* Whether the backward takes rows in vector lanes (backward_block_d): for bf16 and fp16 only. Measured side by
 * side (one thread, B 1, H 8, D 64, T 8K-32K): it takes the bf16 / fp16 backward from 32 to 26 ms at 16K,
 * where converting the rows dominates. For fp32 it depends on the CPU: on an Intel Xeon 1.04-1.13x slower at
 * 8K-32K (a row's loads of k and v, spread over its other work, come back to back), on an AMD EPYC 0.88-0.93x
 * but 1.05x at 2K (docs/results.md section 5). */
#define PI_BACKWARD_BLOCKS (PI_VECTOR_EXP && PI_STORAGE)

#if PI_BACKWARD_BLOCKS
/* LANES consecutive query rows i0 … i0 + LANES − 1 of one head at once (bf16, fp16 without "separate"), when
 * their slots have the same structure (block_slots): backward_row_d with the rows in the lanes of a vector, as
 * forward_block_d is forward_row_d. Why: a row alone is a chain of dependent steps (dots, exp, sums, dgate)
 * the CPU barely overlaps with the next row's; here the dots of all the rows are issued back to back and the
 * softmax's gradient runs lane-wise, each step in backward_row_d's order, so that a row's dq and dgate are the
 * bits it gets alone. Then each row's dq, and its terms of dk and dv (key j's row at j·D − at). lp: the rows'
 * log-priors of "adaptive" (backward_log_priors: LANES local, then LANES skip); q_rows, dy_rows, gate, stat,
 * dq, dgate, keep: at row i0 of the head. Returns 0, having written nothing, when the rows' slots differ. */
static inline __attribute__((always_inline)) int FN(backward_block_d)(
    const pi_call *c, const pi_pattern *p, int64_t i0, const int64_t *start, const int64_t *end, const S *q_rows,
    const S *dy_rows, const S *k, const S *v, const S *gate, const R *lp, const double *stat, S *dq, R *dk,
    R *dv, int64_t at, S *dgate, const uint8_t *keep, int streaming, FN(pi_scratch) * w, const int64_t D) {
  int64_t n, nl;
  if (!FN(block_slots)(c, p, i0, start, end, D, w, &n, &nl)) return 0;
  const int64_t stride = w->n, *rows = w->rows;
  R *z = w->zt, *dp = w->dpt, *pass = w->passt, *mult = w->multt; /* [n][LANES]: slot m of row i0 + r at m·LANES + r */
  const R *q = FN(row_r)(q_rows, w->conv, LANES * D), *dy = FN(row_r)(dy_rows, w->conv + LANES * D, LANES * D);
  /* the dots q·k (z) and dy·v (dp) */
#if PI_LANES == 8 || PI_LANES == 4
  if (D % LANES == 0 && D <= 16 * LANES) {
    FN(vec) *xz = (FN(vec) *)(void *)w->lanes, *xp = xz + LANES * n; /* [n][LANES]: lanes not yet summed */
    for (int64_t r = 0; r < LANES; r++) {
      FN(vec) qr[16], dyr[16]; /* the row's q and dy, in registers for all its slots */
      for (int64_t d = 0; d < D; d += LANES) {
        qr[d / LANES] = FN(load)(q + r * D + d);
        dyr[d / LANES] = FN(load)(dy + r * D + d);
      }
      for (int64_t m = 0; m < n; m++) {
        xz[m * LANES + r] = FN(dot_lanes)(qr, k + rows[r * stride + m], D);
        xp[m * LANES + r] = FN(dot_lanes)(dyr, v + rows[r * stride + m], D);
      }
    }
    for (int64_t m = 0; m < n; m++) {
      FN(store)(z + m * LANES, FN(sum_lanes_of)(xz + m * LANES));
      FN(store)(dp + m * LANES, FN(sum_lanes_of)(xp + m * LANES));
    }
  } else
#endif
    for (int64_t r = 0; r < LANES; r++)
      for (int64_t m = 0; m < n; m++)
        FN(dot2)(q + r * D, k + rows[r * stride + m], dy + r * D, v + rows[r * stride + m], D, &z[m * LANES + r],
                 &dp[m * LANES + r]);
  /* the logits and the clamp's mask (as FN(logits)) */
  FN(vec) local = FN(splat)(0), skip = FN(splat)(0);
  if (c->variant == PI_FIXED) {
    local = FN(splat)((R)p->fixed_local);
    skip = FN(splat)((R)p->fixed_skip);
  } else if (c->variant == PI_ADAPTIVE) {
    local = FN(load)(lp);
    skip = FN(load)(lp + LANES);
  }
  const FN(vec) scale = FN(splat)((R)c->scale), limit = FN(splat)((R)c->clamp), one = FN(splat)(1),
                none = FN(splat)(0);
  for (int64_t m = 0; m < n; m++) {
    FN(vec) score = FN(load)(z + m * LANES) * scale;
    if (c->has_clamp) {
      FN(store)(pass + m * LANES, FN(select)((score <= limit) & (score >= -limit), one, none));
      score = FN(clamp_lanes)(score, limit);
    }
    FN(store)(z + m * LANES, score + (m < nl ? local : skip));
  }
  if (keep) { /* dL/dweight before dropout: the kept ones scaled, the dropped ones 0 */
    for (int64_t r = 0; r < LANES; r++) {
      FN(dropout_row)(c, p, start ? start[r] : 0, i0 + r, D, rows + r * stride, n, nl, keep + r * c->keep_slots,
                      w->mult);
      for (int64_t m = 0; m < n; m++) mult[m * LANES + r] = w->mult[m];
    }
    for (int64_t m = 0; m < n; m++) FN(store)(dp + m * LANES, FN(load)(dp + m * LANES) * FN(load)(mult + m * LANES));
  }
  /* z becomes the weights exp(z − stat) (the shift as the pair hi + lo: exp_shifted), dp the gradient of the
   * logits before the clamp's mask */
  FN(vec) hi, lo;
  for (int64_t r = 0; r < LANES; r++) {
    hi[r] = (R)stat[r];
    lo[r] = (R)(stat[r] - (double)hi[r]);
  }
  FN(vec) sum = FN(splat)(0);
  for (int64_t m = 0; m < n; m++) {
    const FN(vec) e = FN(exps)((FN(load)(z + m * LANES) - hi) - lo);
    FN(store)(z + m * LANES, e);
    sum += e * FN(load)(dp + m * LANES);
  }
  FN(vec) d_local = FN(splat)(0), d_skip = FN(splat)(0);
  for (int64_t m = 0; m < n; m++) {
    const FN(vec) g = FN(load)(z + m * LANES) * (FN(load)(dp + m * LANES) - sum);
    FN(store)(dp + m * LANES, g);
    if (m < nl) d_local += g;
    else d_skip += g;
  }
  if (dgate && c->variant == PI_ADAPTIVE) { /* d log max(α, ε) / dα = 1/α where α >= ε, else 0 */
    const FN(vec) a = FN(load_s)(gate), rest = 1 - a, eps = FN(splat)((R)c->eps);
    FN(vec) g = d_local * FN(select)(a >= eps, one, none) / a;
    if (n > nl) g = g - d_skip * FN(select)(rest >= eps, one, none) / rest;
    FN(store_s)(dgate, g);
  }
  /* dq_r = Σ_m dz_m·k_m; dk_m += dz_m·q_r and dv_m += w_m·dy_r */
  for (int64_t m = 0; m < n; m++) {
    FN(vec) g = FN(load)(dp + m * LANES) * (c->has_clamp ? FN(load)(pass + m * LANES) * scale : scale);
    FN(store)(dp + m * LANES, g);
    if (keep) /* the weights dv reads are those after dropout */
      FN(store)(z + m * LANES, FN(load)(z + m * LANES) * FN(load)(mult + m * LANES));
  }
  for (int64_t r = 0; r < LANES; r++) {
    FN(weighted_sum)(dq + r * D, dp + r, LANES, k, rows + r * stride, n, D, streaming);
    for (int64_t m = 0; m < n; m++)
      FN(add2)(dk + (rows[r * stride + m] - at), dp[m * LANES + r], q + r * D, dv + (rows[r * stride + m] - at),
               z[m * LANES + r], dy + r * D, D);
  }
  return 1;
}
#endif

/* The rows for any D, and for the common head dims as constants: then the compiler unrolls the loops over D
 * whole and keeps a row's q (and dy) in registers across its slots. */
static void FN(forward_row)(const pi_call *c, const pi_pattern *p, int64_t i, int64_t start, int64_t end,
                            const S *qi, const S *k, const S *v, R a, S *yi, double *stat, const uint8_t *keep,
                            FN(pi_scratch) * w) {
  switch (c->D) {
  case 64: FN(forward_row_d)(c, p, i, start, end, qi, k, v, a, yi, stat, keep, w, 64); break;
  case 128: FN(forward_row_d)(c, p, i, start, end, qi, k, v, a, yi, stat, keep, w, 128); break;
  default: FN(forward_row_d)(c, p, i, start, end, qi, k, v, a, yi, stat, keep, w, c->D);
  }
}

#if PI_VECTOR_EXP
static int FN(forward_block)(const pi_call *c, const pi_pattern *p, int64_t i0, const int64_t *start,
                             const int64_t *end, const S *q, const S *k, const S *v, const S *gate, S *y, double *stat,
                             const uint8_t *keep, int streaming, FN(pi_scratch) * w) {
  switch (c->D) {
  case 64: return FN(forward_block_d)(c, p, i0, start, end, q, k, v, gate, y, stat, keep, streaming, w, 64);
  case 128: return FN(forward_block_d)(c, p, i0, start, end, q, k, v, gate, y, stat, keep, streaming, w, 128);
  default: return FN(forward_block_d)(c, p, i0, start, end, q, k, v, gate, y, stat, keep, streaming, w, c->D);
  }
}
#endif

static void FN(backward_row)(const pi_call *c, const pi_pattern *p, int64_t i, int64_t start, int64_t end,
                             const S *qi, const S *dyi, const S *k, const S *v, R a, const R *lp, const double *stat,
                             S *dqi, R *dk, R *dv, int64_t at, S *dgate, const uint8_t *keep, int streaming,
                             FN(pi_scratch) * w) {
  switch (c->D) {
  case 64:
    FN(backward_row_d)(c, p, i, start, end, qi, dyi, k, v, a, lp, stat, dqi, dk, dv, at, dgate, keep, streaming, w,
                       64);
    break;
  case 128:
    FN(backward_row_d)(c, p, i, start, end, qi, dyi, k, v, a, lp, stat, dqi, dk, dv, at, dgate, keep, streaming, w,
                       128);
    break;
  default:
    FN(backward_row_d)(c, p, i, start, end, qi, dyi, k, v, a, lp, stat, dqi, dk, dv, at, dgate, keep, streaming, w,
                       c->D);
  }
}

#if PI_BACKWARD_BLOCKS
static int FN(backward_block)(const pi_call *c, const pi_pattern *p, int64_t i0, const int64_t *start,
                              const int64_t *end, const S *q, const S *dy, const S *k, const S *v, const S *gate,
                              const R *lp, const double *stat, S *dq, R *dk, R *dv, int64_t at, S *dgate,
                              const uint8_t *keep, int streaming, FN(pi_scratch) * w) {
  switch (c->D) {
  case 64:
    return FN(backward_block_d)(c, p, i0, start, end, q, dy, k, v, gate, lp, stat, dq, dk, dv, at, dgate, keep,
                                streaming, w, 64);
  case 128:
    return FN(backward_block_d)(c, p, i0, start, end, q, dy, k, v, gate, lp, stat, dq, dk, dv, at, dgate, keep,
                                streaming, w, 128);
  default:
    return FN(backward_block_d)(c, p, i0, start, end, q, dy, k, v, gate, lp, stat, dq, dk, dv, at, dgate, keep,
                                streaming, w, c->D);
  }
}
#endif

/* The log-priors of "adaptive" for the LANES rows i0 … of one query head (fewer at the sequence's end), as
 * log_priors takes them lane by lane (the same bits: each lane's log is its own): lp[r] local, lp[LANES + r]
 * skip. Two vector logs for LANES rows instead of one for each row. gate: at row i0. */
static void FN(backward_log_priors)(const pi_call *c, const S *gate, int64_t rows, R *lp) {
  FN(vec) a = FN(splat)(1);
  if (rows == LANES) a = FN(load_s)(gate);
  else
    for (int64_t r = 0; r < rows; r++) a[r] = FN(get_s)(gate[r]);
  const FN(vec) rest = 1 - a;
  const R eps = (R)c->eps;
  for (int64_t r = 0; r < LANES; r++) { /* max(·, ε) that keeps a NaN */
    a[r] = a[r] < eps ? eps : a[r];
    lp[LANES + r] = rest[r] < eps ? eps : rest[r];
  }
  FN(store)(lp, FN(logs)(a));
  FN(store)(lp + LANES, FN(logs)(FN(load)(lp + LANES)));
}

/* The forward of this precision, the body of pi_fused_forward_SUFFIX (section 4). noinline, as the backward:
 * compiled as it was when it was the exported function itself (inlined into its one caller, it would shift
 * GCC's inlining of the helpers above), so the entry point is one jump to it. */
static __attribute__((noinline)) int FN(forward)(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  /* buf: q, k, v, gate, y, stat, periods [H] int64, doc_start, doc_end [B, T] int64 (both empty: none), keep
   * [B, H, T, keep_slots] uint8 (empty without dropout) */
  int err = pi_check_call(c);
  if (err) return err;
  if (!buf || n_buf != 10) return PI_ERR_BUFFER;
  const int64_t B = c->B, H = c->H, H_kv = c->H_kv, T = c->T, D = c->D, G = H / H_kv;
  const int64_t n_stat = pi_stats_per_row(c);
  const int64_t sizes[6] = {B * H * T * D, B * H_kv * T * D, B * H_kv * T * D, B * H * T, B * H * T * D,
                            B * H * T * n_stat};
  for (int j = 0; j < 6; j++)
    if ((err = pi_check_buffer(&buf[j], j != 3 || pi_gated(c), sizes[j]))) return err;
  if ((err = pi_check_layout(c, &buf[6], &buf[7], &buf[8], &buf[9]))) return err;
  if (B == 0) return PI_OK;
  const S *q = buf[0].data, *k = buf[1].data, *v = buf[2].data, *gate = buf[3].data;
  S *y = buf[4].data;
  double *stat = buf[5].data;
  const int64_t *doc_start = buf[7].data, *doc_end = buf[8].data;
  const uint8_t *keep = buf[9].data;
  int64_t reach, n_max;
  pi_pattern *p = pi_patterns(c, buf[6].data, &reach, &n_max, &err);
  if (!p) return err;
  const int64_t blocks = pi_forward_blocks(c), items = B * H_kv * blocks, rows = (T + blocks - 1) / blocks;
#if PI_VECTOR_EXP && defined(PI_STREAM)
  const int streaming = pi_streaming(c, y, sizeof(S), LANES * (int64_t)sizeof(S));
#elif PI_VECTOR_EXP
  const int streaming = 0;
#endif
  int failed = 0;
#pragma omp parallel num_threads(c->threads) if (c->threads > 1 && items > 1)
  {
    FN(pi_scratch) w = FN(scratch)(n_max, D);
    if (!w.row) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
      if (!w.row) continue;
      const int64_t bn = item / blocks, t0 = item % blocks * rows, t1 = t0 + rows < T ? t0 + rows : T;
      const int64_t b = bn / H_kv, n = bn % H_kv;
      const S *kh = k + bn * T * D, *vh = v + bn * T * D;
      for (int64_t i = t0; i < t1;) {
        /* LANES rows at once (forward_block) where the item has as many left, else (or where their slots
         * differ) row by row */
        const int64_t count = PI_VECTOR_EXP && c->variant != PI_SEPARATE && t1 - i >= LANES ? LANES : 1;
        for (int64_t g = 0; g < G; g++) {
          const int64_t row = (b * H + n * G + g) * T + i;
#if PI_VECTOR_EXP
          if (count > 1 && FN(forward_block)(c, &p[n * G + g], i, doc_start ? doc_start + b * T + i : NULL,
                                             doc_start ? doc_end + b * T + i : NULL, q + row * D, kh, vh,
                                             gate ? gate + row : NULL, y + row * D, stat + row * n_stat,
                                             keep ? keep + row * c->keep_slots : NULL, streaming, &w))
            continue;
#endif
          for (int64_t r = 0; r < count; r++) {
            const int64_t at = b * T + i + r, start = doc_start ? doc_start[at] : 0, end = doc_start ? doc_end[at] : T;
            FN(forward_row)(c, &p[n * G + g], i + r, start, end, q + (row + r) * D, kh, vh,
                            gate ? FN(get_s)(gate[row + r]) : 0,
                            y + (row + r) * D, stat + (row + r) * n_stat,
                            keep ? keep + (row + r) * c->keep_slots : NULL, &w);
          }
        }
        i += count;
      }
    }
#if PI_VECTOR_EXP && defined(PI_STREAM)
    if (streaming) PI_FENCE(); /* the streaming stores are ordered before what follows (the threads' join) */
#endif
    free(w.row);
  }
  free(p);
  return failed ? PI_ERR_MEMORY : PI_OK;
}

/* The backward of this precision, the body of pi_fused_backward_SUFFIX (section 4). */
static __attribute__((noinline)) int FN(backward)(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  /* buf: q, k, v, gate, dy, stat, dq, dk, dv, dgate (dgate empty: not wanted), periods [H] int64, doc_start,
   * doc_end [B, T] int64 (both empty: no documents), keep [B, H, T, keep_slots] uint8 (empty without dropout) */
  int err = pi_check_call(c);
  if (err) return err;
  if (!buf || n_buf != 14) return PI_ERR_BUFFER;
  const int64_t B = c->B, H = c->H, H_kv = c->H_kv, T = c->T, D = c->D, G = H / H_kv;
  const int64_t n_stat = pi_stats_per_row(c);
  const int64_t q_size = B * H * T * D, kv_size = B * H_kv * T * D, gate_size = B * H * T;
  const int64_t sizes[10] = {q_size, kv_size, kv_size, gate_size, q_size, gate_size * n_stat,
                             q_size, kv_size, kv_size, gate_size};
  const int want_dgate = buf[9].data != NULL || buf[9].numel != 0;
  if (want_dgate && !pi_gated(c)) return PI_ERR_BUFFER;
  for (int j = 0; j < 10; j++) {
    const int used = j == 3 ? pi_gated(c) : j == 9 ? want_dgate : 1;
    if ((err = pi_check_buffer(&buf[j], used, sizes[j]))) return err;
  }
  if ((err = pi_check_layout(c, &buf[10], &buf[11], &buf[12], &buf[13]))) return err;
  if (B == 0) return PI_OK;
  const S *q = buf[0].data, *k = buf[1].data, *v = buf[2].data, *gate = buf[3].data, *dy = buf[4].data;
  const double *stat = buf[5].data;
  S *dq = buf[6].data, *dk = buf[7].data, *dv = buf[8].data, *dgate = buf[9].data;
  const int64_t *doc_start = buf[11].data, *doc_end = buf[12].data;
  const uint8_t *keep = buf[13].data;
  int64_t reach, n_max;
  pi_pattern *p = pi_patterns(c, buf[10].data, &reach, &n_max, &err);
  if (!p) return err;
  const int64_t items = B * H_kv;
  /* dk and dv are summed in R over a window of `cap` key rows of one head, [first, first + cap): in cache,
   * where dk and dv themselves would go to memory between a key's first and last term, and written out as S
   * (by streaming stores, where the call outgrows the cache) once no later query adds to them. Key j is first
   * read by query j − reach and last by query j + back (its local and skip slots); a sink key is read up to its
   * document's end, so with sinks the window is the whole head. When query i's newest key i + reach falls past
   * the window, the window moves on to start at the first key not yet written. */
  int64_t back = 0;
  for (int64_t h = 0; h < H; h++) {
    const int64_t last = p[h].skip_back && p[h].period > p[h].left ? p[h].period : p[h].left;
    if (last > back) back = last;
  }
  const int64_t cap = c->sinks || back + reach + 1 + PI_WINDOW_ROWS >= T ? T : back + reach + 1 + PI_WINDOW_ROWS;
#ifdef PI_STREAM
  const int64_t vector = LANES * (int64_t)sizeof(S);
  const int streaming = pi_streaming(c, dq, sizeof(S), vector) && pi_streaming(c, dk, sizeof(S), vector) &&
                        pi_streaming(c, dv, sizeof(S), vector);
#else
  const int streaming = 0;
#endif
  int failed = 0;
#pragma omp parallel num_threads(c->threads) if (c->threads > 1 && items > 1)
  {
    FN(pi_scratch) w = FN(scratch)(n_max, D);
    R *lp = w.row ? malloc(sizeof(R) * 2 * (size_t)(LANES * G)) : NULL; /* backward_log_priors of the G heads */
    R *acc = lp ? malloc(sizeof(R) * 2 * (size_t)(cap * D)) : NULL;    /* the window of dk, then of dv */
    if (!acc) {
      free(w.row);
      w.row = NULL;
    }
    if (!w.row) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t bn = 0; bn < items; bn++) {
      if (!w.row) continue;
      const int64_t b = bn / H_kv, n = bn % H_kv;
      const S *kh = k + bn * T * D, *vh = v + bn * T * D;
      R *dkh = acc, *dvh = acc + cap * D; /* key row j at (j − first)·D */
      int64_t first = 0, written = 0;     /* key rows [0, written) are final and written out */
      const int64_t zeroed = reach < T ? reach : T;
      memset(dkh, 0, sizeof(R) * (size_t)(zeroed * D));
      memset(dvh, 0, sizeof(R) * (size_t)(zeroed * D));
      for (int64_t i = 0; i < T;) {
        /* LANES rows at once (backward_block, where PI_BACKWARD_BLOCKS) where as many are left, else (or where
         * their slots differ) row by row; i stays a multiple of LANES but in the last rows, so lp holds the
         * block's log-priors */
        const int64_t count = PI_BACKWARD_BLOCKS && c->variant != PI_SEPARATE && T - i >= LANES ? LANES : 1;
        for (int64_t key = i + reach; key < i + count + reach && key < T; key++) {
          /* the first query that reads key `key`: its rows start at zero */
          if (key >= first + cap) { /* (never with sinks) written = i − back: the rest moves to the start */
            memmove(dkh, dkh + (written - first) * D, sizeof(R) * (size_t)((first + cap - written) * D));
            memmove(dvh, dvh + (written - first) * D, sizeof(R) * (size_t)((first + cap - written) * D));
            first = written;
          }
          memset(dkh + (key - first) * D, 0, sizeof(R) * (size_t)D);
          memset(dvh + (key - first) * D, 0, sizeof(R) * (size_t)D);
        }
        const int adaptive = c->variant == PI_ADAPTIVE;
        if (adaptive && i % LANES == 0)
          for (int64_t g = 0; g < G; g++)
            FN(backward_log_priors)(c, gate + (b * H + n * G + g) * T + i, T - i < LANES ? T - i : LANES,
                                    lp + 2 * LANES * g);
        for (int64_t g = 0; g < G; g++) {
          const int64_t row = (b * H + n * G + g) * T + i;
          const R *lp_g = adaptive ? lp + 2 * LANES * g : NULL;
#if PI_BACKWARD_BLOCKS
          if (count > 1 && FN(backward_block)(c, &p[n * G + g], i, doc_start ? doc_start + b * T + i : NULL,
                                              doc_start ? doc_end + b * T + i : NULL, q + row * D, dy + row * D, kh,
                                              vh, gate ? gate + row : NULL, lp_g, stat + row * n_stat,
                                              dq + row * D, dkh, dvh, first * D, dgate ? dgate + row : NULL,
                                              keep ? keep + row * c->keep_slots : NULL, streaming, &w))
            continue;
#endif
          for (int64_t r = 0; r < count; r++) {
            const int64_t at = b * T + i + r, start = doc_start ? doc_start[at] : 0, end = doc_start ? doc_end[at] : T;
            FN(backward_row)(c, &p[n * G + g], i + r, start, end, q + (row + r) * D, dy + (row + r) * D, kh, vh,
                             gate ? FN(get_s)(gate[row + r]) : 0, adaptive ? lp_g + (i + r) % LANES : NULL,
                             stat + (row + r) * n_stat, dq + (row + r) * D, dkh, dvh, first * D,
                             dgate ? dgate + row + r : NULL, keep ? keep + (row + r) * c->keep_slots : NULL,
                             streaming, &w);
          }
        }
        i += count;
        if (!c->sinks && i - 1 - back >= written) { /* keys up to i − 1 − back are final */
          FN(rows_s)(dk + (bn * T + written) * D, dkh + (written - first) * D, (i - back - written) * D, streaming);
          FN(rows_s)(dv + (bn * T + written) * D, dvh + (written - first) * D, (i - back - written) * D, streaming);
          written = i - back;
        }
      }
      FN(rows_s)(dk + (bn * T + written) * D, dkh + (written - first) * D, (T - written) * D, streaming);
      FN(rows_s)(dv + (bn * T + written) * D, dvh + (written - first) * D, (T - written) * D, streaming);
    }
#ifdef PI_STREAM
    if (streaming) PI_FENCE(); /* the streaming stores are ordered before what follows (the threads' join) */
#endif
    free(acc);
    free(lp);
    free(w.row);
  }
  free(p);
  return failed ? PI_ERR_MEMORY : PI_OK;
}

#undef R
#undef S
#undef FN
#undef LANES
#undef PI_BACKWARD_BLOCKS
#undef PI_ROW_LANES

#endif /* the kernels of one precision */

#ifndef PI_REAL
/* Section 4: exported entry points, the only symbols fused.py calls (its _FUNCTIONS), one per direction and
 * storage type, each written out by name. Each calls its precision's kernel, forward_SUFFIX or backward_SUFFIX
 * (FN(forward), FN(backward) of section 3, static, noinline and called only here): the compiler makes each
 * entry point one jump to it. */

int pi_fused_forward_f32(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return forward_f32(c, buf, n_buf);
}
int pi_fused_forward_bf16(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return forward_bf16(c, buf, n_buf);
}
int pi_fused_forward_f16(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return forward_f16(c, buf, n_buf);
}
int pi_fused_forward_f64(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return forward_f64(c, buf, n_buf);
}

int pi_fused_backward_f32(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return backward_f32(c, buf, n_buf);
}
int pi_fused_backward_bf16(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return backward_bf16(c, buf, n_buf);
}
int pi_fused_backward_f16(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return backward_f16(c, buf, n_buf);
}
int pi_fused_backward_f64(const pi_call *c, const pi_buffer *buf, int64_t n_buf) {
  return backward_f64(c, buf, n_buf);
}
#endif
