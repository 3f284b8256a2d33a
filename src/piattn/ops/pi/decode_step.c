/* One decoding step of causal π-Attention for one new query per sequence, in plain C.
 *
 * Compiled on first use by piattn/ops/pi/native.py and called through ctypes. A step of generation on a
 * CPU is a few dozen tensor ops on a handful of numbers each, so its time is the fixed cost of each op,
 * not arithmetic: this file does the whole step of one layer (the gate, scores, clamp,
 * priors, softmax and the weighted sum of values) in one call. It computes what
 * the torch-ops step (`decode_torch.run`) computes, and the tests compare the two.
 *
 * Layouts (element strides; the last dimension of every tensor is contiguous). Q new queries per sequence
 * (Q = 1: the step of generation; Q = 2 … 4: a few tokens at once, each its own one-query step, exact):
 *   q       [B, H, Q, D]         batch stride q_sb, head stride q_sh, query stride q_st
 *   kv      [2, B, H_kv, N, D]   contiguous: the keys, then the values (a ring cache's storage, or a block)
 *   slot    [Q, S] int64         the row of kv each slot of each query reads (`decode_slots.py`); with
 *                                slot_sh > 0 one such table per query head, head h's at h·slot_sh (per-head
 *                                periods in one call: each head's skip key its own)
 *   valid   [Q, S] bool or NULL  whether the slot reads a key (NULL: all do); per head as slot
 *   kind    [S] int64            0: local prior (local and sink slots), 1: skip prior (the same for every head)
 *   y       [B, H, Q, D]         contiguous output
 * Query head h reads key/value head h / (H / H_kv) (grouped-query attention).
 *
 * The one-token step of a decoding layer (`fresh`, `cos`, `sin`; see `pi_step_args`) also stores the new token's
 * key and value in the ring and applies RoPE to q and the new key first, so that a layer's step is its
 * projections and this one call.
 *
 * Priors (log ω added to the clamped scores, Eqs. delta, omega, app_gate):
 *   PRIOR_NONE    "union": nothing.
 *   PRIOR_CONST   "fixed": c_local on local slots, c_skip on the skip slot.
 *   PRIOR_ALPHA   "adaptive" with α given, gate [B, H, Q] (strides gate_sb, gate_sh, gate_st): log max(α, ε),
 *                 log max(1 − α, ε).
 *   PRIOR_HIDDEN  "adaptive" from the gate MLP's hidden pre-activation hidden [B, Q, n_hidden] (strides
 *                 gate_sb, gate_st): α = ε + (1 − 2ε)·σ(w·GELU(hidden) + bias), w [H, n_hidden], bias [H]; then as
 *                 PRIOR_ALPHA.
 *   PRIOR_INPUT   "adaptive" from the gate MLP's input x [B, Q, n_in] (strides gate_sb, gate_st): hidden =
 *                 w_in·x + bias_in, w_in [n_hidden, n_in], bias_in [n_hidden]; then as PRIOR_HIDDEN. The whole
 *                 gate in the step: the layer's projection is then the q, k, v one alone.
 *
 * Non-finite values stay where they are read: slots that read nothing are never touched, and every
 * comparison is written so that a NaN passes through it (as torch's clamp and clamp_min let it).
 *
 * Trust: decode_native.py builds every shape before the call, but this function is the last step before raw
 * pointers, so it checks again what it can see (the sizes, every slot and kind, the prior mode) and
 * returns a PI_ERR_* code, having read nothing, rather than divide by zero (H / H_kv with H_kv > H) or
 * read outside kv (a slot >= N). Its scratch rows live on the heap past PI_STACK_SCRATCH: as stack arrays of
 * any size, a wide gate (n_hidden of a million, or tens of thousands in a thread with a small stack) overflowed
 * the stack and killed the process.
 *
 * The file includes itself once per precision (PI_REAL), as fused_cpu.c does, so that the step is written once as
 * plain C and compiled as pi_step_f32 and pi_step_f64. The gate MLP's layers live in decode_gate.h, included (in
 * the same two ways) where they stood, so the two files are one translation unit. Contents, in the file's order:
 * 1. Shared, once (the file read without PI_REAL): the prior modes and return codes, the argument block
 *    `pi_step_args` and its check `pi_check`; the fp32 gate's vector helpers (decode_gate.h: pi_erf_lanes,
 *    pi_gelu_lanes, pi_sum8).
 * 2. The instantiations: the file includes itself with PI_SUFFIX f32, then f64.
 * 3. One precision (the file read with PI_REAL, after #else): FN(NAME) is NAME_f32 or NAME_f64: pi_rotate; the gate
 *    (decode_gate.h: pi_gelu, pi_affine, pi_last_by_token, pi_last, the fp32 ones in vector lanes, PI_VECTOR_GATE);
 *    and the step, pi_step, which reads its arguments from one `pi_step_args`.
 * 4. Exported entry points (the end of the file): pi_step_args_size, pi_decode_step_packed_f32 and _f64 (the
 *    block copied, then pi_step_f32 / _f64), pi_gelu_f32_row (the fp32 GELU, for its test).
 */
#ifndef PI_REAL
/* Section 1: shared, once. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { PRIOR_NONE = 0, PRIOR_CONST = 1, PRIOR_ALPHA = 2, PRIOR_HIDDEN = 3, PRIOR_INPUT = 4 };
/* Return codes; native.py turns each into its error. */
enum { PI_OK = 0, PI_ERR_SIZE = 1, PI_ERR_SLOT = 2, PI_ERR_KIND = 3, PI_ERR_PRIOR = 4, PI_ERR_MEMORY = 5 };
/* Scratch rows of up to this many elements (4 KiB in fp32) live on the stack, larger ones on the heap: a step's
 * rows are a few hundred elements, and a heap block past glibc's per-thread cache (about 1 KiB) cost a tenth of a
 * small step; a wide gate's rows (n_hidden of tens of thousands) would overflow a thread's stack. */
#define PI_STACK_SCRATCH 1024

/* The step's arguments, in one block: native.py packs them with one `struct.pack` (`native.ARGS`: 8-byte fields,
 * no padding on a 64-bit machine) and makes a one-argument ctypes call, instead of converting 39 arguments one by
 * one on every step; the step reads them from the block. The block is copied first (the caller's bytes need not
 * be aligned), and its size is checked against the one Python packs (`pi_step_args_size`), so that a layout
 * the two sides disagree on is refused at load time, not read. The fields up to y are the layouts, priors and
 * output described at the top of the file.
 *
 * The last six make it the whole one-token step of a layer (`fresh` NULL: the step reads a ring that already
 * holds the new key):
 *   fresh       the new token's key then value, [B, 2, H_kv, D] with batch stride fresh_sb (the q, k, v projection's
 *               k and v columns, not yet rotated), written into row fresh_slot of the ring (the key rotated by
 *               cos, sin when given) before anything is read; Q must be 1.
 *   cos, sin    [D] each, fp32 (rope_f64 0) or fp64 (1), the RoPE angles of the new position (`Rotary`'s table
 *               row): q is rotated by them too, into a scratch row, as `Rotary.rotate` rotates it. NULL: none.
 * The last three are PRIOR_INPUT's gate layer (w_in, bias_in, n_in; NULL and 0 for the other modes). */
typedef struct {
  const void *q;
  int64_t q_sb, q_sh, q_st;
  const void *kv;
  int64_t B, H, H_kv, N, D, Q;
  const int64_t *slot;
  const uint8_t *valid;
  int64_t slot_sh;
  const int64_t *kind;
  int64_t S, prior_mode;
  double c_local, c_skip;
  const void *gate;
  int64_t gate_sb, gate_sh, gate_st, n_hidden;
  const void *w, *bias;
  double scale, clamp, eps;
  void *y;
  const void *fresh;
  int64_t fresh_sb, fresh_slot;
  const void *cos, *sin;
  int64_t rope_f64;
  const void *w_in, *bias_in;
  int64_t n_in;
} pi_step_args;

/* PI_OK when every read and write of the step stays inside the buffers whose sizes it was given. */
static int pi_check(const pi_step_args *a) {
  const int64_t B = a->B, H = a->H, H_kv = a->H_kv, N = a->N, D = a->D, Q = a->Q, S = a->S, n_hidden = a->n_hidden;
  const int64_t slot_sh = a->slot_sh, prior_mode = a->prior_mode;
  const int64_t *const slot = a->slot, *const kind = a->kind;
  if (B < 0 || H < 1 || H_kv < 1 || H_kv > H || H % H_kv || N < 1 || D < 1 || Q < 1 || S < 0 || n_hidden < 0)
    return PI_ERR_SIZE;
  if (slot_sh < 0 || (slot_sh > 0 && slot_sh < Q * S)) return PI_ERR_SIZE; /* the heads' tables do not overlap */
  if ((a->fresh && Q != 1) || (!a->cos) != (!a->sin) || (a->cos && D % 2)) return PI_ERR_SIZE;
  if (a->fresh && (a->fresh_slot < 0 || a->fresh_slot >= N)) return PI_ERR_SLOT;
  if (prior_mode < PRIOR_NONE || prior_mode > PRIOR_INPUT) return PI_ERR_PRIOR; /* an int64: never truncated */
  if (S > 0 && (!slot || !kind)) return PI_ERR_SIZE;
  for (int64_t s = 0; s < S; s++)
    if (kind[s] != 0 && kind[s] != 1) return PI_ERR_KIND;
  for (int64_t h = 0; h < (slot_sh ? H : 1); h++)
    for (int64_t s = 0; s < Q * S; s++)
      if (slot[h * slot_sh + s] < 0 || slot[h * slot_sh + s] >= N) return PI_ERR_SLOT;
  if (B == 0) return PI_OK; /* nothing is read or written, and empty tensors may have no data pointer */
  if (!a->q || !a->kv || !a->y) return PI_ERR_SIZE;
  if (prior_mode >= PRIOR_ALPHA && !a->gate) return PI_ERR_PRIOR;
  if (prior_mode >= PRIOR_HIDDEN && (n_hidden < 1 || !a->w || !a->bias)) return PI_ERR_PRIOR;
  if (prior_mode == PRIOR_INPUT && (a->n_in < 1 || !a->w_in || !a->bias_in)) return PI_ERR_PRIOR;
  return PI_OK;
}

/* The fp32 gate's vector lanes: pi_erf_lanes, pi_gelu_lanes, pi_sum8 (decode_gate.h, read without PI_REAL). */
#include "decode_gate.h"

#define PI_CAT2(a, b) a##_##b
#define PI_CAT(a, b) PI_CAT2(a, b)

/* Section 2: the instantiations. PI_VECTOR_GATE: the gate's GELU, first layer and last linear in vector lanes
 * (fp32; fp64 keeps libm's erf and plain loops). PI_LANE_ROWS: the lanes of pi_last's tokens (0: none). */
#define PI_REAL float
#define PI_SUFFIX f32
#define PI_EXP expf
#define PI_LOG logf
#define PI_VECTOR_GATE 1
#define PI_LANE_ROWS PI_LANES
#include __FILE__
#undef PI_LANE_ROWS
#undef PI_VECTOR_GATE
#undef PI_LOG
#undef PI_EXP
#undef PI_SUFFIX
#undef PI_REAL

#define PI_REAL double
#define PI_SUFFIX f64
#define PI_EXP exp
#define PI_LOG log
#define PI_VECTOR_GATE 0
#define PI_LANE_ROWS 0
#include __FILE__
#undef PI_LANE_ROWS
#undef PI_VECTOR_GATE
#undef PI_LOG
#undef PI_EXP
#undef PI_SUFFIX
#undef PI_REAL

/* Section 4: the exported entry points. */
int64_t pi_step_args_size(void) { return (int64_t)sizeof(pi_step_args); }

int pi_decode_step_packed_f32(const void *packed) {
  pi_step_args a;
  if (!packed) return PI_ERR_SIZE;
  memcpy(&a, packed, sizeof a);
  return pi_step_f32(&a);
}

int pi_decode_step_packed_f64(const void *packed) {
  pi_step_args a;
  if (!packed) return PI_ERR_SIZE;
  memcpy(&a, packed, sizeof a);
  return pi_step_f64(&a);
}

/* The fp32 GELU of the step, exported for its test (n values of x into out). */
void pi_gelu_f32_row(const float *x, int64_t n, float *out) { pi_gelu_f32(x, n, out); }

#else /* one precision */
/* Section 3: one precision, R = PI_REAL; FN(NAME) is NAME_f32 or NAME_f64. */
#define R PI_REAL
#define FN(name) PI_CAT(name, PI_SUFFIX)

/* RoPE of one row x [D] by the angles of its position (cos [D]: cos twice; sin [D]: −sin, then sin; the table of
 * `Rotary`, fp32 (rope_f64 0), or fp64 in a model made fp64) as `Rotary.rotate` computes it: x rounded to fp32,
 * then x·cos + swap(x)·sin in the table's type, each product and the sum rounded (no fused multiply-add:
 * compiled with -ffp-contract=off), then converted to R. */
static void FN(pi_rotate)(const R *x, const void *cos, const void *sin, int64_t rope_f64, int64_t D, R *out) {
  const int64_t half = D / 2;
  if (rope_f64) { /* two loops without a branch: each one vectorizes */
    const double *c = cos, *s = sin;
    for (int64_t i = 0; i < half; i++) out[i] = (R)((double)(float)x[i] * c[i] + (double)(float)x[i + half] * s[i]);
    for (int64_t i = half; i < D; i++) out[i] = (R)((double)(float)x[i] * c[i] + (double)(float)x[i - half] * s[i]);
  } else {
    const float *c = cos, *s = sin;
    for (int64_t i = 0; i < half; i++) out[i] = (R)((float)x[i] * c[i] + (float)x[i + half] * s[i]);
    for (int64_t i = half; i < D; i++) out[i] = (R)((float)x[i] * c[i] + (float)x[i - half] * s[i]);
  }
}

/* The gate MLP's layers of this precision: pi_gelu, pi_affine, pi_last_by_token, pi_last. */
#include "decode_gate.h"

/* One decoding step (the top of the file) of the arguments in `a`, which pi_check checks first. */
static int FN(pi_step)(const pi_step_args *a) {
  const int checked = pi_check(a);
  if (checked != PI_OK || a->B == 0) return checked;
  const R *const q = a->q, *const gate = a->gate, *const w = a->w, *const bias = a->bias, *const fresh = a->fresh;
  const R *const w_in = a->w_in, *const bias_in = a->bias_in;
  R *const kv = (R *)a->kv, *const y = a->y;
  const int64_t q_sb = a->q_sb, q_sh = a->q_sh, q_st = a->q_st, B = a->B, H = a->H, H_kv = a->H_kv, N = a->N, D = a->D;
  const int64_t Q = a->Q, slot_sh = a->slot_sh, S = a->S, gate_sb = a->gate_sb, gate_sh = a->gate_sh;
  const int64_t gate_st = a->gate_st, n_hidden = a->n_hidden, fresh_sb = a->fresh_sb, fresh_slot = a->fresh_slot;
  const int64_t rope_f64 = a->rope_f64, n_in = a->n_in;
  const int64_t *const slot = a->slot, *const kind = a->kind;
  const uint8_t *const valid = a->valid;
  const int prior_mode = (int)a->prior_mode; /* in range: pi_check */
  const double c_local = a->c_local, c_skip = a->c_skip, scale = a->scale, clamp = a->clamp, eps = a->eps;
  const void *const cos = a->cos, *const sin = a->sin;
  const int64_t group = H / H_kv;
  const R lo = (R)eps, width = (R)(1.0 - 2.0 * eps), hi = (R)(1.0 - eps);
  /* One block of scratch rows: the scores z [S]; for the gate, a chunk's GELU act [chunk][n_hidden], LAST's
   * lanes [n_hidden][PI_LANE_ROWS] (several tokens) and its last linear pre [chunk][H]; a rotated q [D]. */
  const int gated = prior_mode >= PRIOR_HIDDEN; /* the gate's last layers run here */
  const int64_t chunk = B * Q < PI_LANES ? B * Q : PI_LANES; /* tokens whose gate runs at once */
  const int64_t n_act = gated ? chunk * n_hidden : 0, n_lanes = gated && chunk > 1 ? n_hidden * PI_LANE_ROWS : 0;
  const int64_t n_pre = gated ? chunk * H : 0;
  const int64_t n_scratch = S + n_act + n_lanes + n_pre + (cos ? D : 0) + 1;
  R on_stack[PI_STACK_SCRATCH];
  R *restrict const z = n_scratch <= PI_STACK_SCRATCH ? on_stack : (R *)malloc(sizeof(R) * (size_t)n_scratch);
  if (!z) return PI_ERR_MEMORY;
  R *const act = z + S;
  R *const lanes = act + n_act;
  R *const pre = lanes + n_lanes;
  R *const q_rotated = pre + n_pre;
  if (fresh) { /* the new token's key (rotated) and value into ring row fresh_slot, before any is read */
    for (int64_t b = 0; b < B; b++)
      for (int64_t g = 0; g < H_kv; g++) {
        const R *k_new = fresh + b * fresh_sb + g * D, *v_new = k_new + H_kv * D;
        R *k_row = kv + ((b * H_kv + g) * N + fresh_slot) * D;
        R *v_row = kv + (((B + b) * H_kv + g) * N + fresh_slot) * D;
        if (cos)
          FN(pi_rotate)(k_new, cos, sin, rope_f64, D, k_row);
        else
          for (int64_t d = 0; d < D; d++) k_row[d] = k_new[d];
        for (int64_t d = 0; d < D; d++) v_row[d] = v_new[d];
      }
  }
  for (int64_t b = 0; b < B; b++) {
    for (int64_t t = 0; t < Q; t++) { /* query t: its own slots, its own one-query step */
      const int64_t token = b * Q + t, in_chunk = token % PI_LANES;
      if (gated && in_chunk == 0) { /* the gate of this token and the next ones of its chunk */
        const int64_t m = B * Q - token < chunk ? B * Q - token : chunk;
        const R *rows[PI_LANES]; /* the tokens' hidden rows (PRIOR_INPUT: their inputs) */
        for (int64_t l = 0; l < m; l++)
          rows[l] = gate + (token + l) / Q * gate_sb + (token + l) % Q * gate_st;
        if (prior_mode == PRIOR_INPUT) { /* the MLP's first layer into act */
          FN(pi_affine)(w_in, bias_in, rows, m, n_hidden, n_in, act);
          for (int64_t l = 0; l < m; l++) rows[l] = act + l * n_hidden;
        }
        for (int64_t l = 0; l < m; l++) FN(pi_gelu)(rows[l], n_hidden, act + l * n_hidden);
        FN(pi_last)(w, bias, act, m, n_hidden, H, lanes, pre);
      }
      for (int64_t h = 0; h < H; h++) {
        R log_local = 0, log_skip = 0;
        if (prior_mode == PRIOR_CONST) {
          log_local = (R)c_local;
          log_skip = (R)c_skip;
        } else if (prior_mode >= PRIOR_ALPHA) {
          R a, rest;
          if (gated) {
            const R u = pre[in_chunk * H + h];
            R s = (R)1 / ((R)1 + PI_EXP(-u));
            a = lo + width * s; /* the clip of Eq. app_gate; 1 − α as decode_torch.py computes it */
            rest = hi - width * s;
          } else {
            a = gate[b * gate_sb + h * gate_sh + t * gate_st];
            rest = (R)1 - a;
          }
          log_local = PI_LOG(a < lo ? lo : a); /* max(·, ε) that keeps a NaN */
          log_skip = PI_LOG(rest < lo ? lo : rest);
        }
        const int64_t *slot_t = slot + h * slot_sh + t * S; /* head h's table (slot_sh 0: the one table) */
        const uint8_t *valid_t = valid ? valid + h * slot_sh + t * S : 0;
        const R *qh = q + b * q_sb + h * q_sh + t * q_st;
        if (cos) {
          FN(pi_rotate)(qh, cos, sin, rope_f64, D, q_rotated);
          qh = q_rotated;
        }
        const R *keys = kv + (b * H_kv + h / group) * N * D;
        const R *values = kv + ((B + b) * H_kv + h / group) * N * D;
        R top = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
          if (valid_t && !valid_t[s]) continue;
          const R *k = keys + slot_t[s] * D;
          /* q·k in four partial sums (d mod 4), then (s0 + s1) + (s2 + s3): four independent chains of
           * additions instead of one of D (a decoding step scores B·H·S keys, each a chain of D).        */
          R s0 = 0, s1 = 0, s2 = 0, s3 = 0;
          int64_t d = 0;
          for (; d + 4 <= D; d += 4) {
            s0 += qh[d] * k[d];
            s1 += qh[d + 1] * k[d + 1];
            s2 += qh[d + 2] * k[d + 2];
            s3 += qh[d + 3] * k[d + 3];
          }
          for (; d < D; d++) s0 += qh[d] * k[d];
          const R dot = (s0 + s1) + (s2 + s3);
          R score = dot * (R)scale;
          if (score > (R)clamp) score = (R)clamp;
          if (score < -(R)clamp) score = -(R)clamp;
          score += kind[s] ? log_skip : log_local;
          z[s] = score;
          if (score > top) top = score;
        }
        R total = 0;
        for (int64_t s = 0; s < S; s++) {
          if (valid_t && !valid_t[s]) continue;
          z[s] = PI_EXP(z[s] - top);
          total += z[s];
        }
        R *out = y + ((b * H + h) * Q + t) * D;
        for (int64_t d = 0; d < D; d++) out[d] = 0;
        for (int64_t s = 0; s < S; s++) {
          if (valid_t && !valid_t[s]) continue;
          const R *v = values + slot_t[s] * D;
          const R p = z[s] / total;
          for (int64_t d = 0; d < D; d++) out[d] += p * v[d];
        }
      }
    }
  }
  if (z != on_stack) free(z);
  return PI_OK;
}

#undef FN
#undef R
#endif /* PI_REAL */
