/* One decoding step of causal π-Attention for one new query per sequence, in plain C.
 *
 * Compiled on first use by piattn/ops/pi/native.py and called through ctypes. A step of generation on a
 * CPU is a few dozen tensor ops on a handful of numbers each, so its time is the fixed cost of each op,
 * not arithmetic: this file does the whole step of one layer (the gate's last layers, scores, clamp,
 * priors, softmax and the weighted sum of values) in one call. It computes what
 * `decode_gathered` in decode.py computes, and the tests compare the two.
 *
 * Layouts (element strides; the last dimension of every tensor is contiguous). Q new queries per sequence
 * (Q = 1: the step of generation; Q = 2 … 4: a few tokens at once, each its own one-query step, exact):
 *   q       [B, H, Q, D]         batch stride q_sb, head stride q_sh, query stride q_st
 *   kv      [2, B, H_kv, N, D]   contiguous: the keys, then the values (a ring cache's storage, or a block)
 *   slot    [Q, S] int64         the row of kv each slot of each query reads (`ring_slots`, `_slots`)
 *   valid   [Q, S] bool or NULL  whether the slot reads a key (NULL: all do)
 *   kind    [S] int64            0: local prior (local and sink slots), 1: skip prior
 *   y       [B, H, Q, D]         contiguous output
 * Query head h reads key/value head h / (H / H_kv) (grouped-query attention).
 *
 * Priors (log ω added to the clamped scores, Eqs. delta, omega, app_gate):
 *   PRIOR_NONE    "union": nothing.
 *   PRIOR_CONST   "fixed": c_local on local slots, c_skip on the skip slot.
 *   PRIOR_ALPHA   "adaptive" with α given, gate [B, H, Q] (strides gate_sb, gate_sh, gate_st): log max(α, ε),
 *                 log max(1 − α, ε).
 *   PRIOR_HIDDEN  "adaptive" from the gate MLP's hidden pre-activation hidden [B, Q, n_hidden] (strides
 *                 gate_sb, gate_st): α = ε + (1 − 2ε)·σ(w·GELU(hidden) + bias), w [H, n_hidden], bias [H]; then as
 *                 PRIOR_ALPHA.
 *
 * Non-finite values stay where they are read: slots that read nothing are never touched, and every
 * comparison is written so that a NaN passes through it (as torch's clamp and clamp_min let it).
 *
 * Trust: native.py checks every shape before the call, but this function is the last step before raw
 * pointers, so it checks again what it can see (the sizes, every slot and kind, the prior mode) and
 * returns a PI_ERR_* code, having read nothing, rather than divide by zero (H / H_kv with H_kv > H) or
 * read outside kv (a slot >= N). Its scratch rows live on the heap: as stack arrays, a wide gate
 * (n_hidden of a million, or tens of thousands in a thread with a small stack) overflowed the stack and
 * killed the process.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { PRIOR_NONE = 0, PRIOR_CONST = 1, PRIOR_ALPHA = 2, PRIOR_HIDDEN = 3 };
/* Return codes; native.py turns each into its error. */
enum { PI_OK = 0, PI_ERR_SIZE = 1, PI_ERR_SLOT = 2, PI_ERR_KIND = 3, PI_ERR_PRIOR = 4, PI_ERR_MEMORY = 5 };

/* PI_OK when every read and write of the step stays inside the buffers whose sizes it was given. */
static int pi_check(const void *q, const void *kv, int64_t B, int64_t H, int64_t H_kv, int64_t N, int64_t D,
                    int64_t Q, const int64_t *slot, const int64_t *kind, int64_t S, int prior_mode,
                    const void *gate, int64_t n_hidden, const void *w, const void *bias, const void *y) {
  if (B < 0 || H < 1 || H_kv < 1 || H_kv > H || H % H_kv || N < 1 || D < 1 || Q < 1 || S < 0 || n_hidden < 0)
    return PI_ERR_SIZE;
  if (prior_mode < PRIOR_NONE || prior_mode > PRIOR_HIDDEN) return PI_ERR_PRIOR;
  if (S > 0 && (!slot || !kind)) return PI_ERR_SIZE;
  for (int64_t s = 0; s < S; s++)
    if (kind[s] != 0 && kind[s] != 1) return PI_ERR_KIND;
  for (int64_t s = 0; s < Q * S; s++)
    if (slot[s] < 0 || slot[s] >= N) return PI_ERR_SLOT;
  if (B == 0) return PI_OK; /* nothing is read or written, and empty tensors may have no data pointer */
  if (!q || !kv || !y) return PI_ERR_SIZE;
  if ((prior_mode == PRIOR_ALPHA || prior_mode == PRIOR_HIDDEN) && !gate) return PI_ERR_PRIOR;
  if (prior_mode == PRIOR_HIDDEN && (n_hidden < 1 || !w || !bias)) return PI_ERR_PRIOR;
  return PI_OK;
}

#define DEFINE_STEP(NAME, T, EXP, LOG, ERF)                                                                  \
  int NAME(const T *q, int64_t q_sb, int64_t q_sh, int64_t q_st, const T *kv, int64_t B, int64_t H,          \
           int64_t H_kv, int64_t N, int64_t D, int64_t Q, const int64_t *slot, const uint8_t *valid,         \
           const int64_t *kind, int64_t S, int prior_mode, double c_local, double c_skip, const T *gate,     \
           int64_t gate_sb, int64_t gate_sh, int64_t gate_st, int64_t n_hidden, const T *w, const T *bias,   \
           double scale, double clamp, double eps, T *y) {                                                   \
    const int checked = pi_check(q, kv, B, H, H_kv, N, D, Q, slot, kind, S, prior_mode, gate, n_hidden, w,   \
                                 bias, y);                                                                   \
    if (checked != PI_OK || B == 0) return checked;                                                          \
    const int64_t group = H / H_kv;                                                                          \
    const T lo = (T)eps, width = (T)(1.0 - 2.0 * eps), hi = (T)(1.0 - eps);                                  \
    /* One allocation for both scratch rows: the scores z [S], then the gate's GELU act [n_hidden]. */       \
    const int64_t n_act = prior_mode == PRIOR_HIDDEN ? n_hidden : 0;                                         \
    T *const z = (T *)malloc(sizeof(T) * (size_t)(S + n_act + 1));                                           \
    if (!z) return PI_ERR_MEMORY;                                                                            \
    T *const act = z + S;                                                                                    \
    for (int64_t b = 0; b < B; b++) {                                                                        \
      for (int64_t t = 0; t < Q; t++) { /* query t: its own slots, its own one-query step */                 \
        const int64_t *slot_t = slot + t * S;                                                                \
        const uint8_t *valid_t = valid ? valid + t * S : 0;                                                  \
        if (prior_mode == PRIOR_HIDDEN) { /* GELU(x) = x·Φ(x), exact (erf), once per token */                \
          const T *hb = gate + b * gate_sb + t * gate_st;                                                    \
          for (int64_t j = 0; j < n_hidden; j++)                                                             \
            act[j] = (T)0.5 * hb[j] * ((T)1 + ERF(hb[j] * (T)0.70710678118654752440));                       \
        }                                                                                                    \
        for (int64_t h = 0; h < H; h++) {                                                                    \
          T log_local = 0, log_skip = 0;                                                                     \
          if (prior_mode == PRIOR_CONST) {                                                                   \
            log_local = (T)c_local;                                                                          \
            log_skip = (T)c_skip;                                                                            \
          } else if (prior_mode == PRIOR_ALPHA || prior_mode == PRIOR_HIDDEN) {                              \
            T a, rest;                                                                                       \
            if (prior_mode == PRIOR_HIDDEN) {                                                                \
              T u = bias[h];                                                                                 \
              const T *wh = w + h * n_hidden;                                                                \
              for (int64_t j = 0; j < n_hidden; j++) u += wh[j] * act[j];                                    \
              T s = (T)1 / ((T)1 + EXP(-u));                                                                 \
              a = lo + width * s; /* the clip of Eq. app_gate; 1 − α computed as decode.py does */           \
              rest = hi - width * s;                                                                         \
            } else {                                                                                         \
              a = gate[b * gate_sb + h * gate_sh + t * gate_st];                                             \
              rest = (T)1 - a;                                                                               \
            }                                                                                                \
            log_local = LOG(a < lo ? lo : a); /* max(·, ε) that keeps a NaN */                               \
            log_skip = LOG(rest < lo ? lo : rest);                                                           \
          }                                                                                                  \
          const T *qh = q + b * q_sb + h * q_sh + t * q_st;                                                  \
          const T *keys = kv + (b * H_kv + h / group) * N * D;                                               \
          const T *values = kv + ((B + b) * H_kv + h / group) * N * D;                                       \
          T top = -INFINITY;                                                                                 \
          for (int64_t s = 0; s < S; s++) {                                                                  \
            if (valid_t && !valid_t[s]) continue;                                                            \
            const T *k = keys + slot_t[s] * D;                                                               \
            T dot = 0;                                                                                       \
            for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];                                             \
            T score = dot * (T)scale;                                                                        \
            if (score > (T)clamp) score = (T)clamp;                                                          \
            if (score < -(T)clamp) score = -(T)clamp;                                                        \
            score += kind[s] ? log_skip : log_local;                                                         \
            z[s] = score;                                                                                    \
            if (score > top) top = score;                                                                    \
          }                                                                                                  \
          T total = 0;                                                                                       \
          for (int64_t s = 0; s < S; s++) {                                                                  \
            if (valid_t && !valid_t[s]) continue;                                                            \
            z[s] = EXP(z[s] - top);                                                                          \
            total += z[s];                                                                                   \
          }                                                                                                  \
          T *out = y + ((b * H + h) * Q + t) * D;                                                            \
          for (int64_t d = 0; d < D; d++) out[d] = 0;                                                        \
          for (int64_t s = 0; s < S; s++) {                                                                  \
            if (valid_t && !valid_t[s]) continue;                                                            \
            const T *v = values + slot_t[s] * D;                                                             \
            const T p = z[s] / total;                                                                        \
            for (int64_t d = 0; d < D; d++) out[d] += p * v[d];                                              \
          }                                                                                                  \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    free(z);                                                                                                 \
    return PI_OK;                                                                                            \
  }

DEFINE_STEP(pi_decode_step_f32, float, expf, logf, erff)
DEFINE_STEP(pi_decode_step_f64, double, exp, log, erf)
