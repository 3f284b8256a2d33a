/* The gate MLP's layers of the compiled decoding step (`decode_step.c`, which includes this file twice and is
 * compiled with it as one translation unit; never compiled alone).
 *
 * The step's priors PRIOR_HIDDEN and PRIOR_INPUT (decode_step.c's top) run the gate in the step: its first layer
 * (PRIOR_INPUT), the GELU and its last linear, for up to PI_LANES tokens at once. This file holds those layers;
 * decode_step.c holds the argument block, its check, RoPE, the ring write and the step itself.
 *
 * As decode_step.c, the file is read in two ways:
 * 1. Without PI_REAL (from decode_step.c's shared section): the fp32 gate's vector types and helpers,
 *    pi_erf_lanes, pi_gelu_lanes, pi_sum8.
 * 2. With PI_REAL (from decode_step.c's section of one precision, R, FN(NAME) and PI_VECTOR_GATE defined there):
 *    pi_gelu, pi_affine, pi_last_by_token, pi_last of that precision (the fp32 ones in vector lanes). */
#ifndef PI_REAL
/* erf for the fp32 step's GELU, in vector lanes (libm's erff is a call per element: at batch 8 and a gate 64
 * wide, 512 calls of ~10 ns a layer, most of what the gate cost a step). z = |x|: z·P(z²) (degree 5) below 1,
 * a degree-12 polynomial in z − 2.5 on [1, 4), 1 from 4 on (erfc(4) = 1.5e-8 is below half an ulp of 1), then
 * the sign of x. The coefficients are fp64 least-squares fits on Chebyshev nodes rounded to fp32; evaluated in
 * fp32 as written (no FMA: -ffp-contract=off) the result is within 1.8e-7 of the exact erf, 3 ulp
 * (tests/decoding/test_gelu_f32.py checks it, and NaN, ±inf, ±0). GCC vector types, not a loop left to the
 * vectorizer (which does not turn the selects into masks): eight lanes with AVX, four without (wider vectors
 * than the registers spill); every lane computes alone, so the bits are the same for every build and width. */
#ifdef __AVX__
#define PI_LANES 8
#else
#define PI_LANES 4
#endif
typedef float pi_vf __attribute__((vector_size(4 * PI_LANES)));
typedef int32_t pi_vi __attribute__((vector_size(4 * PI_LANES)));

static inline pi_vf pi_splat(float c) {
  pi_vf v;
  for (int l = 0; l < PI_LANES; l++) v[l] = c;
  return v;
}

static inline pi_vf pi_erf_lanes(pi_vf x) {
  const pi_vi bits = (pi_vi)x, sign = bits & (int32_t)0x80000000;
  const pi_vf z = (pi_vf)(bits & (int32_t)0x7fffffff), u = z * z, m = z - 2.5f;
  pi_vf small = pi_splat(-0.0005696661f);
  small = small * u + 0.004934507f;
  small = small * u - 0.02672698f;
  small = small * u + 0.112807885f;
  small = small * u - 0.37612414f;
  small = (small * u + 1.1283791f) * z;
  pi_vf large = pi_splat(-8.709274e-06f);
  large = large * m + 2.1406067e-05f;
  large = large * m + 5.9412778e-05f;
  large = large * m - 0.00028087225f;
  large = large * m + 0.00029200182f;
  large = large * m + 0.0005742033f;
  large = large * m - 0.0028237568f;
  large = large * m + 0.006100025f;
  large = large * m - 0.008612778f;
  large = large * m + 0.008354325f;
  large = large * m - 0.0054470706f;
  large = large * m + 0.0021779793f;
  large = large * m + 0.9995931f;
  /* Masks: a NaN fails both comparisons and stays NaN through `large`; every lane's erf(|x|) is >= 0, so the
   * sign goes back with an or. */
  const pi_vi below = z < pi_splat(1.0f), beyond = z >= pi_splat(4.0f);
  const pi_vi e = ((pi_vi)small & below) | ((pi_vi)large & ~(below | beyond)) | ((pi_vi)pi_splat(1.0f) & beyond);
  return (pi_vf)(e | sign);
}

/* GELU(x) = x·Φ(x) = x/2·(1 + erf(x/√2)), exact (erf) as torch's default GELU, over a row of n. */
static inline pi_vf pi_gelu_lanes(pi_vf v) { return 0.5f * v * (1.0f + pi_erf_lanes(v * 0.70710678118654752440f)); }

/* The gate runs for up to PI_LANES tokens at once (a chunk: the tokens of a batch, or a few queries): its
 * weights are read once per chunk instead of once per token, and the tokens' independent sums overlap. Each
 * token's arithmetic is what it gets alone, in the same order, so a token's gate is the same bits at any batch. */

typedef float pi_v8f __attribute__((vector_size(32), aligned(4), may_alias));

static float pi_sum8(pi_v8f p) { return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])); }

#else /* one precision */
#if PI_VECTOR_GATE
static void FN(pi_gelu)(const float *x, int64_t n, float *out) {
  int64_t j = 0;
  for (; j + PI_LANES <= n; j += PI_LANES) {
    pi_vf v;
    memcpy(&v, x + j, sizeof v);
    v = pi_gelu_lanes(v);
    memcpy(out + j, &v, sizeof v);
  }
  if (j < n) { /* the tail in the lanes of one more vector, the rest of it 0 */
    float tail[PI_LANES] = {0};
    const int64_t rest = n - j;
    for (int64_t i = 0; i < rest; i++) tail[i] = x[j + i];
    pi_vf v;
    memcpy(&v, tail, sizeof v);
    v = pi_gelu_lanes(v);
    memcpy(tail, &v, sizeof v);
    for (int64_t i = 0; i < rest; i++) out[j + i] = tail[i];
  }
}

/* out[l][j] = bias[j] + w[j]·xs[l] for the n_out rows of w [n_out, n] and the m <= PI_LANES rows xs[l] [n]
 * (PRIOR_INPUT: the gate MLP's first layer, from the layer's live weights), out [m][n_out]: four rows of w at a
 * time, applied to each token in turn while they are in cache, each sum in eight partial sums (i mod 8) added
 * pairwise at the end. fp32 in GCC vector types of eight lanes (one AVX register, two SSE ones): the same
 * additions in the same order on every build. */
static void FN(pi_affine)(const float *w, const float *bias, const float *const *xs, int64_t m, int64_t n_out,
                          int64_t n, float *out) {
  int64_t j = 0;
  for (; j + 4 <= n_out; j += 4) {
    const float *w0 = w + j * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    for (int64_t l = 0; l < m; l++) {
      const float *x = xs[l];
      pi_v8f p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const pi_v8f xi = *(const pi_v8f *)(x + i);
        p0 += *(const pi_v8f *)(w0 + i) * xi;
        p1 += *(const pi_v8f *)(w1 + i) * xi;
        p2 += *(const pi_v8f *)(w2 + i) * xi;
        p3 += *(const pi_v8f *)(w3 + i) * xi;
      }
      float s0 = pi_sum8(p0), s1 = pi_sum8(p1), s2 = pi_sum8(p2), s3 = pi_sum8(p3);
      for (; i < n; i++) {
        s0 += w0[i] * x[i];
        s1 += w1[i] * x[i];
        s2 += w2[i] * x[i];
        s3 += w3[i] * x[i];
      }
      float *o = out + l * n_out + j;
      o[0] = bias[j] + s0;
      o[1] = bias[j + 1] + s1;
      o[2] = bias[j + 2] + s2;
      o[3] = bias[j + 3] + s3;
    }
  }
  for (; j < n_out; j++) { /* the last rows, one at a time: the same sums as above */
    const float *wj = w + j * n;
    for (int64_t l = 0; l < m; l++) {
      const float *x = xs[l];
      pi_v8f p = {0};
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) p += *(const pi_v8f *)(wj + i) * *(const pi_v8f *)(x + i);
      float sum = pi_sum8(p);
      for (; i < n; i++) sum += wj[i] * x[i];
      out[l * n_out + j] = bias[j] + sum;
    }
  }
}

#else
static void FN(pi_gelu)(const double *x, int64_t n, double *out) {
  for (int64_t j = 0; j < n; j++) out[j] = 0.5 * x[j] * (1.0 + erf(x[j] * 0.70710678118654752440));
}

static void FN(pi_affine)(const double *w, const double *bias, const double *const *xs, int64_t m, int64_t n_out,
                          int64_t n, double *out) {
  for (int64_t j = 0; j < n_out; j++)
    for (int64_t l = 0; l < m; l++) {
      double sum = 0;
      for (int64_t i = 0; i < n; i++) sum += w[j * n + i] * xs[l][i];
      out[l * n_out + j] = bias[j] + sum;
    }
}

#endif

/* The gate's last linear, pre[l][h] = bias[h] + Σ_j w[h][j]·act[l][j] (taken over j in order), for the m
 * tokens act [m][n] (w [H, n], pre [m][H]): token by token, four heads side by side (four independent chains
 * of n additions). */
static void FN(pi_last_by_token)(const R *w, const R *bias, const R *act, int64_t m, int64_t n, int64_t H,
                                 R *pre) {
  for (int64_t l = 0; l < m; l++) {
    const R *x = act + l * n;
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
      const R *w0 = w + h * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
      R u0 = bias[h], u1 = bias[h + 1], u2 = bias[h + 2], u3 = bias[h + 3];
      for (int64_t j = 0; j < n; j++) {
        u0 += w0[j] * x[j];
        u1 += w1[j] * x[j];
        u2 += w2[j] * x[j];
        u3 += w3[j] * x[j];
      }
      pre[l * H + h] = u0;
      pre[l * H + h + 1] = u1;
      pre[l * H + h + 2] = u2;
      pre[l * H + h + 3] = u3;
    }
    for (; h < H; h++) {
      R u = bias[h];
      for (int64_t j = 0; j < n; j++) u += w[h * n + j] * x[j];
      pre[l * H + h] = u;
    }
  }
}

#if PI_VECTOR_GATE
/* fp32 with several tokens: the tokens in the lanes of a vector (act transposed into lanes [n][PI_LANES], the
 * lanes of absent tokens 0), four heads side by side: four chains of n additions for the whole chunk instead of
 * four per token. Every lane adds as pi_last_by_token does, so a token's pre is the same bits either way. One
 * token alone takes pi_last_by_token (its transpose would cost more than its lanes save). */
static void FN(pi_last)(const float *w, const float *bias, const float *act, int64_t m, int64_t n, int64_t H,
                         float *lanes, float *pre) {
  if (m == 1) {
    FN(pi_last_by_token)(w, bias, act, m, n, H, pre);
    return;
  }
  for (int64_t j = 0; j < n; j++)
    for (int64_t l = 0; l < PI_LANES; l++) lanes[j * PI_LANES + l] = l < m ? act[l * n + j] : 0.0f;
  int64_t h = 0;
  for (; h + 4 <= H; h += 4) {
    const float *w0 = w + h * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
    pi_vf u0 = pi_splat(bias[h]), u1 = pi_splat(bias[h + 1]), u2 = pi_splat(bias[h + 2]), u3 = pi_splat(bias[h + 3]);
    for (int64_t j = 0; j < n; j++) {
      pi_vf x;
      memcpy(&x, lanes + j * PI_LANES, sizeof x);
      u0 += w0[j] * x;
      u1 += w1[j] * x;
      u2 += w2[j] * x;
      u3 += w3[j] * x;
    }
    for (int64_t l = 0; l < m; l++) {
      pre[l * H + h] = u0[l];
      pre[l * H + h + 1] = u1[l];
      pre[l * H + h + 2] = u2[l];
      pre[l * H + h + 3] = u3[l];
    }
  }
  for (; h < H; h++) {
    const float *wh = w + h * n;
    pi_vf u = pi_splat(bias[h]);
    for (int64_t j = 0; j < n; j++) {
      pi_vf x;
      memcpy(&x, lanes + j * PI_LANES, sizeof x);
      u += wh[j] * x;
    }
    for (int64_t l = 0; l < m; l++) pre[l * H + h] = u[l];
  }
}

#else
static void FN(pi_last)(const double *w, const double *bias, const double *act, int64_t m, int64_t n, int64_t H,
                         double *lanes, double *pre) {
  (void)lanes; /* fp64 stays token by token */
  FN(pi_last_by_token)(w, bias, act, m, n, H, pre);
}
#endif
#endif /* PI_REAL */
