/* What Orchard's C kernels (sgemm.c, attention.c) share: 8 float lanes as GCC vector
 * extensions, compiled for AVX2 + FMA on x86-64 (the callers check the CPU at run time). */
#ifndef ORCHARD_VECTOR_H
#define ORCHARD_VECTOR_H

#if defined(__x86_64__)
#define KERNEL __attribute__((target("avx2,fma")))
#else
#define KERNEL
#endif
#define INLINE static inline __attribute__((always_inline))

typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));

KERNEL INLINE v8 load(const float *p) { return *(const v8 *)p; }

/* The lanes added pairwise, in one fixed order. */
KERNEL INLINE float hsum(v8 v) {
  float s0 = (v[0] + v[4]) + (v[1] + v[5]);
  float s1 = (v[2] + v[6]) + (v[3] + v[7]);
  return s0 + s1;
}

#endif
