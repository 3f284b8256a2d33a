/* One decoding step of causal π-Attention for one new query per sequence, in plain C.
 *
 * Compiled on first use by piattn/ops/pi/native.py and called through ctypes. A step of generation on a
 * CPU is a few dozen tensor ops on a handful of numbers each, so its time is the fixed cost of each op,
 * not arithmetic: this file does the whole step of one layer (the gate's last layers, scores, clamp,
 * priors, softmax and the weighted sum of values) in one call. It computes what
 * `decode_gathered` in decode.py computes, and the tests compare the two.
 *
 * Layouts (element strides; the last dimension of every tensor is contiguous):
 *   q       [B, H, D]            batch stride q_sb, head stride q_sh
 *   kv      [2, B, H_kv, N, D]   contiguous: the keys, then the values, of a ring cache
 *   slot    [S] int64            the row of kv each slot reads (`ring_slots` in decode.py)
 *   valid   [S] bool or NULL     whether the slot reads a key (NULL: all do)
 *   kind    [S] int64            0: local prior (local and sink slots), 1: skip prior
 *   y       [B, H, D]            contiguous output
 * Query head h reads key/value head h / (H / H_kv) (grouped-query attention).
 *
 * Priors (log ω added to the clamped scores, Eqs. delta, omega, app_gate):
 *   PRIOR_NONE    "union": nothing.
 *   PRIOR_CONST   "fixed": c_local on local slots, c_skip on the skip slot.
 *   PRIOR_ALPHA   "adaptive" with α given, gate [B, H] (batch stride gate_sb): log max(α, ε), log max(1 − α, ε).
 *   PRIOR_HIDDEN  "adaptive" from the gate MLP's hidden pre-activation hidden [B, n_hidden] (batch stride
 *                 gate_sb): α = ε + (1 − 2ε)·σ(w·GELU(hidden) + bias), w [H, n_hidden], bias [H]; then as
 *                 PRIOR_ALPHA.
 *
 * Non-finite values stay where they are read: slots that read nothing are never touched, and every
 * comparison is written so that a NaN passes through it (as torch's clamp and clamp_min let it).
 */
#include <math.h>
#include <stdint.h>

enum { PRIOR_NONE = 0, PRIOR_CONST = 1, PRIOR_ALPHA = 2, PRIOR_HIDDEN = 3 };

#define DEFINE_STEP(NAME, T, EXP, LOG, ERF)                                                                  \
  int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *kv, int64_t B, int64_t H, int64_t H_kv,        \
           int64_t N, int64_t D, const int64_t *slot, const uint8_t *valid, const int64_t *kind, int64_t S,  \
           int prior_mode, double c_local, double c_skip, const T *gate, int64_t gate_sb, int64_t n_hidden,  \
           const T *w, const T *bias, double scale, double clamp, double eps, T *y) {                        \
    const int64_t group = H / H_kv;                                                                          \
    const T lo = (T)eps, width = (T)(1.0 - 2.0 * eps), hi = (T)(1.0 - eps);                                  \
    T z[S > 0 ? S : 1];                                                                                      \
    T act[n_hidden > 0 ? n_hidden : 1];                                                                      \
    for (int64_t b = 0; b < B; b++) {                                                                        \
      if (prior_mode == PRIOR_HIDDEN) { /* GELU(x) = x·Φ(x), exact (erf), once per sequence */              \
        const T *hb = gate + b * gate_sb;                                                                    \
        for (int64_t j = 0; j < n_hidden; j++)                                                               \
          act[j] = (T)0.5 * hb[j] * ((T)1 + ERF(hb[j] * (T)0.70710678118654752440));                         \
      }                                                                                                      \
      for (int64_t h = 0; h < H; h++) {                                                                      \
        T log_local = 0, log_skip = 0;                                                                       \
        if (prior_mode == PRIOR_CONST) {                                                                     \
          log_local = (T)c_local;                                                                            \
          log_skip = (T)c_skip;                                                                              \
        } else if (prior_mode == PRIOR_ALPHA || prior_mode == PRIOR_HIDDEN) {                                \
          T a, rest;                                                                                         \
          if (prior_mode == PRIOR_HIDDEN) {                                                                  \
            T u = bias[h];                                                                                   \
            const T *wh = w + h * n_hidden;                                                                  \
            for (int64_t j = 0; j < n_hidden; j++) u += wh[j] * act[j];                                      \
            T s = (T)1 / ((T)1 + EXP(-u));                                                                   \
            a = lo + width * s; /* the clip of Eq. app_gate; 1 − α computed as decode.py does */            \
            rest = hi - width * s;                                                                           \
          } else {                                                                                           \
            a = gate[b * gate_sb + h];                                                                       \
            rest = (T)1 - a;                                                                                 \
          }                                                                                                  \
          log_local = LOG(a < lo ? lo : a); /* max(·, ε) that keeps a NaN */                                \
          log_skip = LOG(rest < lo ? lo : rest);                                                             \
        }                                                                                                    \
        const T *qh = q + b * q_sb + h * q_sh;                                                               \
        const T *keys = kv + (b * H_kv + h / group) * N * D;                                                 \
        const T *values = kv + ((B + b) * H_kv + h / group) * N * D;                                         \
        T top = -INFINITY;                                                                                   \
        for (int64_t s = 0; s < S; s++) {                                                                    \
          if (valid && !valid[s]) continue;                                                                  \
          const T *k = keys + slot[s] * D;                                                                   \
          T dot = 0;                                                                                         \
          for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];                                               \
          T score = dot * (T)scale;                                                                          \
          if (score > (T)clamp) score = (T)clamp;                                                            \
          if (score < -(T)clamp) score = -(T)clamp;                                                          \
          score += kind[s] ? log_skip : log_local;                                                           \
          z[s] = score;                                                                                      \
          if (score > top) top = score;                                                                      \
        }                                                                                                    \
        T total = 0;                                                                                         \
        for (int64_t s = 0; s < S; s++) {                                                                    \
          if (valid && !valid[s]) continue;                                                                  \
          z[s] = EXP(z[s] - top);                                                                            \
          total += z[s];                                                                                     \
        }                                                                                                    \
        T *out = y + (b * H + h) * D;                                                                        \
        for (int64_t d = 0; d < D; d++) out[d] = 0;                                                          \
        for (int64_t s = 0; s < S; s++) {                                                                    \
          if (valid && !valid[s]) continue;                                                                  \
          const T *v = values + slot[s] * D;                                                                 \
          const T p = z[s] / total;                                                                          \
          for (int64_t d = 0; d < D; d++) out[d] += p * v[d];                                                \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    return 0;                                                                                                \
  }

DEFINE_STEP(pi_decode_step_f32, float, expf, logf, erff)
DEFINE_STEP(pi_decode_step_f64, double, exp, log, erf)
