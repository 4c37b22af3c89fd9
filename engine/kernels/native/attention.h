/* Orchard's decode attention on the CPU: the layout shared by attention.c (the kernel, in the
 * sgemm library) and attention_mlx.cpp (the MLX primitive that calls it). */
#ifndef ORCHARD_ATTENTION_H
#define ORCHARD_ATTENTION_H

#ifdef __cplusplus
extern "C" {
#endif

/* softmax(q k^T * scale, over the visible keys) v for B sequences: H query heads in KH groups
 * (GQA: query head h reads key/value head h / (H / KH)), L queries against S keys each.
 * Strides are in floats; every array's last axis is contiguous. */
typedef struct {
  int B, H, KH, L, S, D, DV;
  const float *q;
  long q_b, q_h, q_l;
  const float *k;
  long k_b, k_h, k_s;
  const float *v;
  long v_b, v_h, v_s;
  const unsigned char *mask; /* bool, true = visible, broadcast by zero strides; NULL: none */
  long m_b, m_h, m_l, m_s;
  int causal; /* also hide key j from query l when j > S - L + l */
  float scale;
  float *out; /* (B, H, L, DV), contiguous */
} orchard_attention_t;

/* The most query rows per key/value head (H / KH * L) and the most dimensions (D, DV) the
 * kernel takes: its per-head state lives on the stack. D and DV must be multiples of 8. */
enum { ORCHARD_ATTENTION_MAX_ROWS = 24, ORCHARD_ATTENTION_MAX_DIM = 256 };

/* 0, or -1 for shapes it does not take (nothing is written then). */
int orchard_attention(const orchard_attention_t *a);

/* Whether this CPU runs the kernel (x86-64: AVX2 and FMA). */
int orchard_attention_supported(void);

#ifdef __cplusplus
}
#endif

#endif
