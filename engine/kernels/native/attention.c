/* Orchard's decode attention on the CPU, one fused kernel (attention.h has the contract).
 *
 * Why (bench/RESULTS.md, "Fused decode attention"): MLX's CPU backend runs attention as
 * separate ops, its two matmuls one tiny product per sequence and KV head (~2,900 a step at
 * batch 16 in the default model), each a call with its own overhead on one thread, plus the
 * softmax's ~10 ops. Here each (sequence, KV head) is one task: the queries of its query heads
 * are scored against its keys a block at a time, softmaxed online (the running maximum and sum
 * rescaled when a block raises the maximum) and their weights applied to the block's values
 * while it is in cache; keys and values are each read once, and the tasks are split over the
 * sgemm pool's threads (orchard_parallel_for, sgemm.c).
 *
 * Numerics: float32 throughout, scores as dot(q, k) * scale (8 lanes of FMAs added pairwise),
 * exp by a range reduction to 2^n * p(r) with a degree-7 polynomial (relative error ~2e-7),
 * weights normalised once at the end. A row's result depends only on its own sequence (its
 * keys, values and mask), never on the batch around it, the thread that computed it or how
 * many hidden keys pad it on the left (blocks start at the first visible key). A row
 * with no visible key averages all S values, as MLX's bool masks do (their masked scores are
 * float32's lowest, so every weight is equal).
 */
#include "attention.h"
#include "vector.h"

#include <math.h>
#include <stdint.h>

typedef int32_t v8i __attribute__((vector_size(32), aligned(4), may_alias));

void orchard_parallel_for(int total, int chunk, void (*fn)(void *, int, int), void *ctx);

enum { BLOCK = 64 }; /* keys per block: its scores stay in L1 beside the values' rows */
enum { MAX_ROWS = ORCHARD_ATTENTION_MAX_ROWS, MAX_DIM = ORCHARD_ATTENTION_MAX_DIM };

KERNEL INLINE void store(float *p, v8 x) { *(v8 *)p = x; }
KERNEL INLINE v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
KERNEL INLINE v8 select(v8i mask, v8 yes, v8 no) {
  return (v8)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

/* e^x for x <= 0 (or -inf): 0 below -87.3, where float32's result would be subnormal. */
KERNEL INLINE v8 exp_nonpositive(v8 x) {
  const v8 lowest = splat(-87.3f), shifter = splat(12582912.0f); /* 1.5 * 2^23 */
  v8i under = x < lowest;
  x = select(under, lowest, x);
  v8 t = x * splat(1.44269504088896341f) + shifter; /* n = round(x / ln 2), in t's low bits */
  v8 n = t - shifter;
  v8i bits = ((v8i)t - (v8i)shifter + 127) << 23; /* 2^n */
  v8 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f); /* |r| <= ln 2 / 2 */
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  return select(under, splat(0.0f), p * (v8)bits);
}

/* Scores of MR query rows against NK keys (k, one key every k_s floats) into s[i][j]. */
KERNEL INLINE void scores_tile(const int MR, const int NK, int D, const float *const *q,
                               const float *k, long k_s, float (*s)[BLOCK + 8], float scale) {
  v8 acc[3][4];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NK; j++) acc[i][j] = splat(0.0f);
  for (int d = 0; d < D; d += 8) {
    v8 x[3];
    for (int i = 0; i < MR; i++) x[i] = load(q[i] + d);
    for (int j = 0; j < NK; j++) {
      v8 w = load(k + j * k_s + d);
      for (int i = 0; i < MR; i++) acc[i][j] += x[i] * w;
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NK; j++) s[i][j] = hsum(acc[i][j]) * scale;
}

/* acc[i][c, c + 8 * NC) += sum over the block's n keys of w[i][j] * v_j[c, ...], MR rows. */
KERNEL INLINE void values_tile(const int MR, const int NC, int n, float (*w)[BLOCK + 8],
                               const float *v, long v_s, float *acc, int DV, int c) {
  v8 sum[3][4];
  for (int i = 0; i < MR; i++)
    for (int t = 0; t < NC; t++) sum[i][t] = load(acc + i * DV + c + 8 * t);
  for (int j = 0; j < n; j++) {
    int any = 0;
    for (int i = 0; i < MR; i++) any |= w[i][j] != 0.0f;
    if (!any) continue; /* hidden keys (padding): not read at all */
    v8 x[4];
    for (int t = 0; t < NC; t++) x[t] = load(v + j * v_s + c + 8 * t);
    for (int i = 0; i < MR; i++) {
      v8 wi = splat(w[i][j]);
      for (int t = 0; t < NC; t++) sum[i][t] += wi * x[t];
    }
  }
  for (int i = 0; i < MR; i++)
    for (int t = 0; t < NC; t++) store(acc + i * DV + c + 8 * t, sum[i][t]);
}

KERNEL static void scores_rows(int MR, int n, int D, const float *const *q, const float *k,
                               long k_s, float (*s)[BLOCK + 8], float scale) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *kj = k + j * k_s;
    float(*sj)[BLOCK + 8] = (float(*)[BLOCK + 8])(&s[0][j]);
    if (MR == 3) scores_tile(3, 4, D, q, kj, k_s, sj, scale);
    else if (MR == 2) scores_tile(2, 4, D, q, kj, k_s, sj, scale);
    else scores_tile(1, 4, D, q, kj, k_s, sj, scale);
  }
  for (; j < n; j++) {
    const float *kj = k + j * k_s;
    float(*sj)[BLOCK + 8] = (float(*)[BLOCK + 8])(&s[0][j]);
    if (MR == 3) scores_tile(3, 1, D, q, kj, k_s, sj, scale);
    else if (MR == 2) scores_tile(2, 1, D, q, kj, k_s, sj, scale);
    else scores_tile(1, 1, D, q, kj, k_s, sj, scale);
  }
}

KERNEL static void values_rows(int MR, int n, float (*w)[BLOCK + 8], const float *v, long v_s,
                               float *acc, int DV) {
  int c = 0;
  for (; c + 32 <= DV; c += 32) {
    if (MR == 3) values_tile(3, 4, n, w, v, v_s, acc, DV, c);
    else if (MR == 2) values_tile(2, 4, n, w, v, v_s, acc, DV, c);
    else values_tile(1, 4, n, w, v, v_s, acc, DV, c);
  }
  for (; c < DV; c += 8) {
    if (MR == 3) values_tile(3, 1, n, w, v, v_s, acc, DV, c);
    else if (MR == 2) values_tile(2, 1, n, w, v, v_s, acc, DV, c);
    else values_tile(1, 1, n, w, v, v_s, acc, DV, c);
  }
}

/* One sequence and KV head: its R = H / KH * L query rows against all S keys. */
KERNEL static void head(const orchard_attention_t *a, int b, int kh) {
  const int G = a->H / a->KH, L = a->L, R = G * L, S = a->S, D = a->D, DV = a->DV;
  float s[MAX_ROWS][BLOCK + 8] __attribute__((aligned(32)));
  float acc[MAX_ROWS * MAX_DIM] __attribute__((aligned(32)));
  float top[MAX_ROWS], total[MAX_ROWS];
  int nan[MAX_ROWS]; /* a visible score was NaN: the row's output is NaN, as MLX's */
  const float *q[MAX_ROWS];
  const unsigned char *mask[MAX_ROWS];
  int last[MAX_ROWS]; /* the last key row r may see */
  for (int r = 0; r < R; r++) {
    int h = kh * G + r / L, l = r % L;
    q[r] = a->q + b * a->q_b + h * a->q_h + l * a->q_l;
    mask[r] = a->mask ? a->mask + b * a->m_b + h * a->m_h + l * a->m_l : 0;
    last[r] = a->causal ? S - L + l : S - 1;
    top[r] = -INFINITY;
    total[r] = 0.0f;
    nan[r] = 0;
  }
  for (int i = 0; i < R * DV; i++) acc[i] = 0.0f;
  const float *k = a->k + b * a->k_b + kh * a->k_h;
  const float *v = a->v + b * a->v_b + kh * a->v_h;
  /* Blocks start at the first key any row sees: a left-padded sequence (mlx-lm's batch
   * caches) is then summed in the same blocks, so to the same bits, as the sequence alone. */
  int first = S;
  for (int r = 0; r < R && first; r++) {
    int j = 0;
    if (mask[r])
      while (j < first && !mask[r][(long)j * a->m_s]) j++;
    if (j < first) first = j;
  }
  for (int j0 = first; j0 < S; j0 += BLOCK) {
    const int n = S - j0 < BLOCK ? S - j0 : BLOCK;
    for (int r = 0; r < R; r += 3)
      scores_rows(R - r < 3 ? R - r : 3, n, D, q + r, k + j0 * a->k_s, a->k_s, s + r, a->scale);
    for (int r = 0; r < R; r++) {
      float *sr = s[r], block_top = -INFINITY;
      for (int j = 0; j < n; j++) {
        int visible = j0 + j <= last[r] && (!mask[r] || mask[r][(long)(j0 + j) * a->m_s]);
        if (!visible) sr[j] = -INFINITY;
        else if (sr[j] > block_top) block_top = sr[j];
        else if (sr[j] != sr[j]) nan[r] = 1, sr[j] = -INFINITY;
      }
      for (int j = n; j < ((n + 7) & ~7); j++) sr[j] = -INFINITY;
      if (block_top > top[r]) { /* rescale what the earlier blocks summed */
        if (top[r] != -INFINITY) {
          float f = exp_nonpositive(splat(top[r] - block_top))[0];
          total[r] *= f;
          for (int i = 0; i < DV; i += 8) store(acc + r * DV + i, load(acc + r * DV + i) * f);
        }
        top[r] = block_top;
      }
      v8 sum = splat(0.0f), t = splat(top[r]);
      for (int j = 0; j < n; j += 8) {
        /* -inf - top is -inf, e^-inf is 0; top itself -inf (nothing visible yet): all 0 */
        v8 e = top[r] == -INFINITY ? splat(0.0f) : exp_nonpositive(load(sr + j) - t);
        store(sr + j, e);
        sum += e;
      }
      total[r] += hsum(sum);
    }
    for (int r = 0; r < R; r += 3)
      values_rows(R - r < 3 ? R - r : 3, n, s + r, v + j0 * a->v_s, a->v_s, acc + r * DV, DV);
  }
  for (int r = 0; r < R; r++) {
    int h = kh * G + r / L, l = r % L;
    float *out = a->out + (((long)b * a->H + h) * L + l) * DV;
    if (nan[r]) {
      for (int i = 0; i < DV; i++) out[i] = NAN;
      continue;
    }
    if (top[r] == -INFINITY) { /* no visible key: the mean of all values */
      for (int i = 0; i < DV; i += 8) {
        v8 m = splat(0.0f);
        for (int j = 0; j < S; j++) m += load(v + j * a->v_s + i);
        store(out + i, m / splat((float)S));
      }
      continue;
    }
    v8 inverse = splat(1.0f / total[r]);
    for (int i = 0; i < DV; i += 8) store(out + i, load(acc + r * DV + i) * inverse);
  }
}

KERNEL static void heads(void *ctx, int begin, int end) {
  const orchard_attention_t *a = ctx;
  for (int u = begin; u < end; u++) head(a, u / a->KH, u % a->KH);
}

int orchard_attention_supported(void) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return 1;
#endif
}

int orchard_attention(const orchard_attention_t *a) {
  if (a->B < 1 || a->KH < 1 || a->H % a->KH || a->L < 1 || a->S < 1 || a->D < 8 || a->DV < 8 ||
      a->D % 8 || a->DV % 8 || a->D > MAX_DIM || a->DV > MAX_DIM ||
      a->H / a->KH * a->L > MAX_ROWS)
    return -1;
  orchard_parallel_for(a->B * a->KH, 1, heads, (void *)a);
  return 0;
}
