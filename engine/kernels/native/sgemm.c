/* Orchard's cblas_sgemm: fast paths for the products of a decode step on the CPU, in front of
 * the BLAS library (OpenBLAS by default) that computes everything else.
 *
 * Why (bench/RESULTS.md, "Small-M sgemm"): MLX's CPU backend sends every float32 matmul to
 * cblas_sgemm. A decode step multiplies a few rows (one per sequence of the batch) by each
 * weight matrix; a BLAS library's sgemm packs the weight panel into a buffer on every call,
 * which at a few rows costs as much as the product itself, so the weights are read twice.
 * And the attention of each sequence and KV head is its own tiny product (3 x 64 by 64 x 160,
 * say), ~3,000 of them per step at batch 16, where OpenBLAS's per-call cost is 8-14 us.
 *
 * Fast paths (row-major only; anything else goes to the library unchanged):
 * - A (M x K) times B^T, B stored N x K (`x @ W.T`, every Linear layer, and attention scores),
 *   M <= max_rows: each weight row is read once, from memory, and dotted with every row of A
 *   held in cache; split over the threads by columns of C.
 * - A (M x K) times B, B stored K x N (attention's probabilities times values), M <= 16 and
 *   small: one thread, no packing.
 *
 * Every element of C is a sum in one fixed order that depends only on K (8 lanes of FMAs, the
 * lanes added pairwise, then the tail): a row's result does not depend on how many rows are
 * in the batch, how the columns are split or which tile computed it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "vector.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn backend;
static char backend_path[4096];
static int max_rows = 64;
static int fast = 0; /* the CPU runs the kernels */
static int num_threads = 1;
static atomic_long num_fast, num_forwarded;

/* Products smaller than this many multiply-adds run on the calling thread only. */
#define THREAD_MIN_WORK (1L << 17)
/* A times B (not transposed) takes the fast path up to this many rows and multiply-adds. */
#define NN_MAX_ROWS 16
#define NN_MAX_WORK (1L << 20)
/* How long a pool thread waits for the next product before it sleeps: spinning at first,
 * then yielding its core to any other thread that wants it. */
#define SPIN_NS 200000L
#define YIELD_AFTER_SPINS 512
/* Pieces of a product per thread, so a thread held back leaves its share to the others. */
#define PIECES_PER_THREAD 6

KERNEL INLINE void put(float *c, float r, float alpha, float beta) {
  *c = beta == 0.0f ? alpha * r : alpha * r + beta * *c;
}

/* The cache lines of a block of four B rows (K floats each), numbered row by row within each
 * 16-float stretch of K: line l is row l % 4, floats 16 * (l / 4) on. */
INLINE int block_lines(int K) { return 4 * ((K + 15) / 16); }

INLINE int min_int(int x, int y) { return x < y ? x : y; }

/* C[i][j] for MR rows of A (a, lda) and NR rows of B (b, ldb). `next`, if set, is the next
 * block of four B rows: this tile fetches its lines [pf0, pf1) into cache meanwhile, spread
 * over its loop, so that memory streams the next block while the core computes this one. */
KERNEL INLINE void nt_tile(const int MR, const int NR, int K, const float *a, int lda,
                           const float *b, int ldb, float *c, int ldc, const float *next,
                           int pf0, int pf1, float alpha, float beta) {
  v8 acc[3][4];
  const int points = (K + 15) / 16; /* a prefetch point every 16 floats of K */
  const int per_point = next ? (pf1 - pf0 + points - 1) / points : 0;
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) acc[i][j] = (v8){0};
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    if (per_point && !(k & 15))
      for (int l = pf0 + (k >> 4) * per_point, end = l + per_point; l < end && l < pf1; l++)
        __builtin_prefetch(next + (size_t)(l & 3) * ldb + (size_t)(l >> 2) * 16);
    v8 x[3];
    for (int i = 0; i < MR; i++) x[i] = load(a + (size_t)i * lda + k);
    for (int j = 0; j < NR; j++) {
      v8 w = load(b + (size_t)j * ldb + k);
      for (int i = 0; i < MR; i++) acc[i][j] += x[i] * w;
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) {
      float r = hsum(acc[i][j]);
      for (int t = k; t < K; t++) r = __builtin_fmaf(a[(size_t)i * lda + t], b[(size_t)j * ldb + t], r);
      put(c + (size_t)i * ldc + j, r, alpha, beta);
    }
}

KERNEL static void nt_3x4(int K, const float *a, int lda, const float *b, int ldb, float *c,
                          int ldc, const float *next, int pf0, int pf1, float alpha, float beta) {
  nt_tile(3, 4, K, a, lda, b, ldb, c, ldc, next, pf0, pf1, alpha, beta);
}

KERNEL static void nt_2x4(int K, const float *a, int lda, const float *b, int ldb, float *c,
                          int ldc, const float *next, int pf0, int pf1, float alpha, float beta) {
  nt_tile(2, 4, K, a, lda, b, ldb, c, ldc, next, pf0, pf1, alpha, beta);
}

KERNEL static void nt_1x4(int K, const float *a, int lda, const float *b, int ldb, float *c,
                          int ldc, const float *next, int pf0, int pf1, float alpha, float beta) {
  nt_tile(1, 4, K, a, lda, b, ldb, c, ldc, next, pf0, pf1, alpha, beta);
}

KERNEL static void nt_1x1(int K, const float *a, int lda, const float *b, int ldb, float *c,
                          int ldc, float alpha, float beta) {
  nt_tile(1, 1, K, a, lda, b, ldb, c, ldc, NULL, 0, 0, alpha, beta);
}

/* Columns [n0, n1) of C = alpha * A B^T + beta * C: four rows of B at a time (read from memory
 * once), against the rows of A in tiles of three (then two, or one when M is 1). Every tile
 * of a block prefetches its share of the next block: at 16 rows, prefetching it from the
 * first tile alone left memory idle for the other five (bench/RESULTS.md, "Small-M sgemm":
 * the model's weight matmuls at 16 rows went from 53 to 44 ms on average). */
KERNEL static void nt_columns(int M, int n0, int n1, int K, const float *A, int lda,
                              const float *B, int ldb, float *C, int ldc, float alpha,
                              float beta) {
  int threes = M / 3, twos = 0, ones = 0;
  switch (M % 3) {
  case 1:
    if (threes) threes--, twos = 2;
    else ones = 1;
    break;
  case 2:
    twos = 1;
    break;
  }
  const int lines = block_lines(K), tiles = threes + twos + ones;
  const int share = (lines + tiles - 1) / tiles;
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float *b = B + (size_t)n * ldb;
    const float *next = n + 8 <= n1 ? b + (size_t)4 * ldb : NULL;
    const float *a = A;
    float *c = C + n;
    int pf = 0; /* the first of the next block's lines the next tile prefetches */
    for (int t = 0; t < threes; t++, a += (size_t)3 * lda, c += (size_t)3 * ldc, pf += share)
      nt_3x4(K, a, lda, b, ldb, c, ldc, next, pf, min_int(pf + share, lines), alpha, beta);
    for (int t = 0; t < twos; t++, a += (size_t)2 * lda, c += (size_t)2 * ldc, pf += share)
      nt_2x4(K, a, lda, b, ldb, c, ldc, next, pf, min_int(pf + share, lines), alpha, beta);
    if (ones) nt_1x4(K, a, lda, b, ldb, c, ldc, next, pf, lines, alpha, beta);
  }
  for (; n < n1; n++)
    for (int m = 0; m < M; m++)
      nt_1x1(K, A + (size_t)m * lda, lda, B + (size_t)n * ldb, ldb, C + (size_t)m * ldc + n, ldc,
             alpha, beta);
}

/* Rows [0, MR) of C, columns [n, n + 32): each element a chain of FMAs over k, with every row
 * of B's 32 columns loaded once for the MR rows of A (not once per row). */
KERNEL INLINE void nn_tile(const int MR, int K, const float *A, int lda, const float *B, int ldb,
                           float *C, int ldc, int n, float alpha, float beta) {
  v8 acc[3][4];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = (v8){0};
  for (int k = 0; k < K; k++) {
    const float *b = B + (size_t)k * ldb + n;
    v8 w0 = load(b), w1 = load(b + 8), w2 = load(b + 16), w3 = load(b + 24);
    for (int i = 0; i < MR; i++) {
      v8 s = (v8){0} + A[(size_t)i * lda + k];
      acc[i][0] += s * w0;
      acc[i][1] += s * w1;
      acc[i][2] += s * w2;
      acc[i][3] += s * w3;
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++)
      for (int l = 0; l < 8; l++) put(C + (size_t)i * ldc + n + 8 * j + l, acc[i][j][l], alpha, beta);
}

/* C = alpha * A B + beta * C, B stored K x N: rows of A three at a time (then two, then one)
 * against 32 columns of B at a time, then 8, then one; each element a chain of FMAs over k in
 * order (the scalar tail in the same order), so its bits do not depend on M or the tiling. */
KERNEL static void nn_small(int M, int N, int K, const float *A, int lda, const float *B,
                            int ldb, float *C, int ldc, float alpha, float beta) {
  int n = 0;
  for (; n + 32 <= N; n += 32) {
    int m = 0;
    for (; m + 3 <= M; m += 3)
      nn_tile(3, K, A + (size_t)m * lda, lda, B, ldb, C + (size_t)m * ldc, ldc, n, alpha, beta);
    if (M - m == 2)
      nn_tile(2, K, A + (size_t)m * lda, lda, B, ldb, C + (size_t)m * ldc, ldc, n, alpha, beta);
    else if (M - m == 1)
      nn_tile(1, K, A + (size_t)m * lda, lda, B, ldb, C + (size_t)m * ldc, ldc, n, alpha, beta);
  }
  for (int m = 0; m < M; m++) {
    const float *a = A + (size_t)m * lda;
    float *c = C + (size_t)m * ldc;
    int j = n;
    for (; j + 8 <= N; j += 8) {
      v8 acc = {0};
      for (int k = 0; k < K; k++) acc += ((v8){0} + a[k]) * load(B + (size_t)k * ldb + j);
      for (int l = 0; l < 8; l++) put(c + j + l, acc[l], alpha, beta);
    }
    for (; j < N; j++) {
      float r = 0.0f;
      for (int k = 0; k < K; k++) r = __builtin_fmaf(a[k], B[(size_t)k * ldb + j], r);
      put(c + j, r, alpha, beta);
    }
  }
}

/* One product C = alpha * A B^T + beta * C (row-major, the fast path's operands). */
typedef struct {
  int M, N, K, lda, ldb, ldc;
  const float *A, *B;
  float *C;
  float alpha, beta;
} product_t;

/* The thread pool: the calling thread and `num_threads - 1` workers split one job's range of
 * indices (a product's columns, attention's sequences and heads). One job at a time; a second
 * caller meanwhile computes on its own thread. */
typedef void (*range_fn)(void *ctx, int begin, int end);

typedef struct {
  range_fn fn;
  void *ctx;
  int total, chunk; /* indices [0, total), taken `chunk` at a time */
} job_t;

static struct {
  pthread_mutex_t busy;
  pthread_mutex_t lock;
  pthread_cond_t wake;
  atomic_uint generation;
  atomic_int pending;
  atomic_int sleepers;
  atomic_int next; /* the threads take pieces of the job from here */
  int started;
  unsigned started_at; /* the generation before the workers' first job */
  job_t job;
} pool = {
    .busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

/* Pieces are taken, not assigned: a thread the OS holds back (the engine's own Python thread
 * needs a core now and then) leaves its share to the others instead of making them wait. */
static void run_pieces(const job_t *job) {
  for (;;) {
    int i0 = atomic_fetch_add(&pool.next, job->chunk);
    if (i0 >= job->total) return;
    job->fn(job->ctx, i0, i0 + job->chunk < job->total ? i0 + job->chunk : job->total);
  }
}

static long elapsed_ns(const struct timespec *since) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void *worker(void *arg) {
  (void)arg;
  unsigned seen = pool.started_at;
  for (;;) {
    struct timespec since;
    clock_gettime(CLOCK_MONOTONIC, &since);
    for (int spins = 0; atomic_load(&pool.generation) == seen; spins++) {
      if (spins < YIELD_AFTER_SPINS) {
        relax();
        continue;
      }
      sched_yield(); /* a thread with work to do on this core goes first */
      if ((spins & 15) == 15 && elapsed_ns(&since) > SPIN_NS) {
        atomic_fetch_add(&pool.sleepers, 1);
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
        atomic_fetch_sub(&pool.sleepers, 1);
      }
    }
    seen = atomic_load(&pool.generation);
    run_pieces(&pool.job);
    atomic_fetch_sub(&pool.pending, 1);
  }
  return NULL;
}

static int start_pool(void) {
  pool.started_at = atomic_load(&pool.generation);
  for (int part = 1; part < num_threads; part++) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, worker, (void *)(intptr_t)part);
    pthread_attr_destroy(&attr);
    if (failed) return part;
  }
  return num_threads;
}

static void after_fork_in_child(void) {
  /* The pool's threads did not come along: start new ones when next needed. */
  pthread_mutex_init(&pool.busy, NULL);
  pthread_mutex_init(&pool.lock, NULL);
  pthread_cond_init(&pool.wake, NULL);
  atomic_store(&pool.pending, 0);
  atomic_store(&pool.sleepers, 0);
  pool.started = 0;
}

/* Run fn(ctx, begin, end) over [0, total) in pieces of `chunk` on the pool's threads and the
 * calling one, returning when all are done; on the calling thread alone when the pool is busy
 * with another caller's job or has no other thread. Exported: attention (engine/kernels/native/
 * attention.c and the MLX primitive that calls it) shares the pool with the products. */
__attribute__((visibility("default"))) void orchard_parallel_for(int total, int chunk, range_fn fn,
                                                                 void *ctx) {
  if (total <= 0) return;
  if (chunk < 1) chunk = 1;
  if (num_threads > 1 && total > chunk && pthread_mutex_trylock(&pool.busy) == 0) {
    if (!pool.started) {
      int threads = start_pool();
      if (threads < num_threads) num_threads = threads;
      pool.started = 1;
    }
    if (num_threads > 1) {
      pool.job = (job_t){fn, ctx, total, chunk};
      atomic_store(&pool.next, 0);
      atomic_store(&pool.pending, num_threads - 1);
      atomic_fetch_add(&pool.generation, 1);
      if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
      }
      run_pieces(&pool.job);
      while (atomic_load(&pool.pending)) relax();
      pthread_mutex_unlock(&pool.busy);
      return;
    }
    pthread_mutex_unlock(&pool.busy);
  }
  fn(ctx, 0, total);
}

/* Columns [n0, n1) of a product: one piece of its job. */
KERNEL static void product_columns(void *ctx, int n0, int n1) {
  const product_t *p = ctx;
  nt_columns(p->M, n0, n1, p->K, p->A, p->lda, p->B, p->ldb, p->C, p->ldc, p->alpha, p->beta);
}

KERNEL static void nt_product(product_t *p) {
  long work = (long)p->M * p->N * p->K;
  if (num_threads > 1 && work >= THREAD_MIN_WORK && p->N >= 8 * num_threads) {
    int pieces = num_threads * PIECES_PER_THREAD;
    orchard_parallel_for(p->N, ((p->N + pieces - 1) / pieces + 3) & ~3, product_columns, p);
    return;
  }
  product_columns(p, 0, p->N);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
  if (fast && order == ROW_MAJOR && trans_a == NO_TRANS && M > 0 && N > 0 && K > 0 &&
      M <= max_rows) {
    if (trans_b == TRANS) {
      product_t p = {M, N, K, lda, ldb, ldc, A, B, C, alpha, beta};
      nt_product(&p);
      atomic_fetch_add_explicit(&num_fast, 1, memory_order_relaxed);
      return;
    }
    if (trans_b == NO_TRANS && M <= NN_MAX_ROWS && (long)M * N * K <= NN_MAX_WORK) {
      nn_small(M, N, K, A, lda, B, ldb, C, ldc, alpha, beta);
      atomic_fetch_add_explicit(&num_fast, 1, memory_order_relaxed);
      return;
    }
  }
  atomic_fetch_add_explicit(&num_forwarded, 1, memory_order_relaxed);
  backend(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* Set the library every other product goes to, the threads and the most rows of A the fast
 * paths take (0: none, forward everything). Returns 0, or -1 when the library has no
 * cblas_sgemm (nothing changes then). */
int orchard_sgemm_init(const char *library, int threads, int rows) {
  void *handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!handle) return -1;
  sgemm_fn found = (sgemm_fn)dlsym(handle, "cblas_sgemm");
  if (!found || found == cblas_sgemm) return -1;
  backend = found;
  strncpy(backend_path, library, sizeof backend_path - 1);
  num_threads = threads < 1 ? 1 : threads;
  max_rows = rows < 0 ? 0 : rows;
#if defined(__x86_64__)
  __builtin_cpu_init();
  int supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  int supported = 1;
#endif
  fast = supported;
  static int registered = 0;
  if (!registered) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    registered = 1;
  }
  return 0;
}

/* The most rows of A the fast paths take from now on (0: hand every product to the library);
 * returns the previous value. For measuring both ways in one process. */
int orchard_sgemm_set_max_rows(int rows) {
  int previous = max_rows;
  max_rows = rows < 0 ? 0 : rows;
  return previous;
}

const char *orchard_sgemm_backend(void) { return backend_path; }

/* Whether the fast paths are on (the CPU has what they need and max_rows > 0). */
int orchard_sgemm_fast(void) { return fast && max_rows > 0; }

/* Products taken by the fast paths and forwarded to the library since the start. */
void orchard_sgemm_counts(long *fast_products, long *forwarded) {
  *fast_products = atomic_load(&num_fast);
  *forwarded = atomic_load(&num_forwarded);
}
