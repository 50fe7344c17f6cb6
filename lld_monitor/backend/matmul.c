/* Matrix products in a fixed summation order, for the built-in model's pinned numerics.
 *
 * C[m, n] = sum over k = 0, 1, ..., K-1 of A[m, k] * B[k, n], one fused multiply-add per term, in that
 * order, starting from 0. A fused multiply-add is exactly rounded, so every element's bits follow from
 * its own row of A and column of B alone:
 *   - the same on every x86-64 CPU with AVX2 and FMA: no CPU-dependent blocking or approximate
 *     instructions, and no sum is ever split across vector lanes. That is also why the AVX-512 kernel
 *     below may be used where the CPU has it: it computes more columns at once, each element still by
 *     the same chain, so it gives the same bits as the AVX2 kernel (tests/test_backend_numerics.py);
 *   - the same whatever the number of rows (a row's result does not depend on the batch it is in);
 *   - the same for padded columns and remainder rows (they run the same chains).
 * Compiled with -ffp-contract=off; only the intrinsics below do arithmetic.
 *
 * Layout: A is row-major with row stride lda (contiguous along k). B is read through its strides
 * (sbk, sbn) and packed into panels of 16 columns, k-major, zero-padded (`lld_pack_b`), so any
 * transpose of a contiguous matrix works and a packed weight can be reused across calls.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 16

/* ------------------------------------------------------------------ packing */
int64_t lld_packed_size(int64_t K, int64_t N) { return ((N + NR - 1) / NR) * K * NR; }

void lld_pack_b(const float *B, int64_t sbk, int64_t sbn, int64_t K, int64_t N, float *Bp) {
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        int64_t n0 = p * NR;
        int64_t nn = N - n0 < NR ? N - n0 : NR;
        float *dst = Bp + p * K * NR;
        if (sbn == 1) {
            for (int64_t k = 0; k < K; k++) {
                memcpy(dst + k * NR, B + k * sbk + n0, (size_t)nn * sizeof(float));
                for (int64_t j = nn; j < NR; j++) dst[k * NR + j] = 0.0f;
            }
        } else { /* a transposed matrix: walk each source row along k (contiguous when sbk == 1) */
            for (int64_t j = 0; j < NR; j++) {
                if (j < nn) {
                    const float *src = B + (n0 + j) * sbn;
                    for (int64_t k = 0; k < K; k++) dst[k * NR + j] = src[k * sbk];
                } else {
                    for (int64_t k = 0; k < K; k++) dst[k * NR + j] = 0.0f;
                }
            }
        }
    }
}

static void store_cols(float *c, const float *tile, int64_t nn) { memcpy(c, tile, (size_t)nn * sizeof(float)); }

/* ------------------------------------------------------------------ AVX2: 6 rows x 16 columns */
__attribute__((target("avx2,fma"))) static inline void avx2_store(float *c, __m256 lo, __m256 hi, int64_t nn) {
    if (nn == NR) {
        _mm256_storeu_ps(c, lo);
        _mm256_storeu_ps(c + 8, hi);
    } else {
        float tile[NR];
        _mm256_storeu_ps(tile, lo);
        _mm256_storeu_ps(tile + 8, hi);
        store_cols(c, tile, nn);
    }
}

#define AVX2_ROW(i)                                         \
    a = _mm256_broadcast_ss(A + (i) * lda + k);             \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);              \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);

__attribute__((target("avx2,fma"))) static void avx2_tile6(const float *A, int64_t lda, const float *bp, int64_t K,
                                                           float *C, int64_t ldc, int64_t nn) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(bp + k * NR), b1 = _mm256_loadu_ps(bp + k * NR + 8), a;
        AVX2_ROW(0) AVX2_ROW(1) AVX2_ROW(2) AVX2_ROW(3) AVX2_ROW(4) AVX2_ROW(5)
    }
    avx2_store(C, c00, c01, nn);
    avx2_store(C + ldc, c10, c11, nn);
    avx2_store(C + 2 * ldc, c20, c21, nn);
    avx2_store(C + 3 * ldc, c30, c31, nn);
    avx2_store(C + 4 * ldc, c40, c41, nn);
    avx2_store(C + 5 * ldc, c50, c51, nn);
}

/* one row (the last rows of a matrix): the same chains */
__attribute__((target("avx2,fma"))) static void avx2_row(const float *A, const float *bp, int64_t K, float *C,
                                                         int64_t nn) {
    __m256 x0 = _mm256_setzero_ps(), x1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 a = _mm256_broadcast_ss(A + k);
        x0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(bp + k * NR), x0);
        x1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(bp + k * NR + 8), x1);
    }
    avx2_store(C, x0, x1, nn);
}

__attribute__((target("avx2,fma"))) static void avx2_gemm(const float *A, int64_t lda, const float *Bp, float *C,
                                                          int64_t ldc, int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        int64_t n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
        const float *bp = Bp + p * K * NR;
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) avx2_tile6(A + m * lda, lda, bp, K, C + m * ldc + n0, ldc, nn);
        for (; m < M; m++) avx2_row(A + m * lda, bp, K, C + m * ldc + n0, nn);
    }
}

/* ------------------------------------------------------------------ AVX-512: 8 rows x 32 columns (two panels) */
__attribute__((target("avx512f"))) static inline void avx512_store(float *c, __m512 v, int64_t nn) {
    if (nn == NR) {
        _mm512_storeu_ps(c, v);
    } else if (nn > 0) {
        float tile[NR];
        _mm512_storeu_ps(tile, v);
        store_cols(c, tile, nn);
    }
}

#define AVX512_ROW(i)                                       \
    a = _mm512_set1_ps(A[(i) * lda + k]);                   \
    c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0);              \
    c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);

#define AVX512_STORE(i)                                     \
    avx512_store(C + (i) * ldc, c##i##0, nn0);              \
    avx512_store(C + (i) * ldc + NR, c##i##1, nn1);

__attribute__((target("avx512f"))) static void avx512_tile8(const float *A, int64_t lda, const float *bp0,
                                                            const float *bp1, int64_t K, float *C, int64_t ldc,
                                                            int64_t nn0, int64_t nn1) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    __m512 c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
    for (int64_t k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(bp0 + k * NR), b1 = _mm512_loadu_ps(bp1 + k * NR), a;
        AVX512_ROW(0) AVX512_ROW(1) AVX512_ROW(2) AVX512_ROW(3) AVX512_ROW(4) AVX512_ROW(5) AVX512_ROW(6) AVX512_ROW(7)
    }
    AVX512_STORE(0) AVX512_STORE(1) AVX512_STORE(2) AVX512_STORE(3)
    AVX512_STORE(4) AVX512_STORE(5) AVX512_STORE(6) AVX512_STORE(7)
}

__attribute__((target("avx512f"))) static void avx512_row(const float *A, const float *bp0, const float *bp1, int64_t K,
                                                          float *C, int64_t nn0, int64_t nn1) {
    __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 a = _mm512_set1_ps(A[k]);
        x0 = _mm512_fmadd_ps(a, _mm512_loadu_ps(bp0 + k * NR), x0);
        x1 = _mm512_fmadd_ps(a, _mm512_loadu_ps(bp1 + k * NR), x1);
    }
    avx512_store(C, x0, nn0);
    avx512_store(C + NR, x1, nn1);
}

__attribute__((target("avx512f"))) static void avx512_gemm(const float *A, int64_t lda, const float *Bp, float *C,
                                                           int64_t ldc, int64_t M, int64_t N, int64_t K) {
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p += 2) {
        int64_t n0 = p * NR, nn0 = N - n0 < NR ? N - n0 : NR;
        int64_t nn1 = p + 1 < panels ? (N - n0 - NR < NR ? N - n0 - NR : NR) : 0;
        const float *bp0 = Bp + p * K * NR;
        const float *bp1 = nn1 > 0 ? Bp + (p + 1) * K * NR : bp0; /* a lone last panel: its twin is not stored */
        int64_t m = 0;
        for (; m + 8 <= M; m += 8) avx512_tile8(A + m * lda, lda, bp0, bp1, K, C + m * ldc + n0, ldc, nn0, nn1);
        for (; m < M; m++) avx512_row(A + m * lda, bp0, bp1, K, C + m * ldc + n0, nn0, nn1);
    }
}

/* ------------------------------------------------------------------ entry points */
static int use_avx512 = -1; /* -1: not decided yet */

/* 2 = AVX-512, 1 = AVX2 (`force_avx2` != 0 keeps AVX2 even where AVX-512 exists). Same bits either way. */
int lld_select_isa(int force_avx2) {
    __builtin_cpu_init();
    use_avx512 = !force_avx2 && __builtin_cpu_supports("avx512f");
    return use_avx512 ? 2 : 1;
}

/* C (M x N, row stride ldc) = A (M x K, row stride lda) @ packed B */
void lld_gemm_packed(const float *A, int64_t lda, const float *Bp, float *C, int64_t ldc, int64_t M, int64_t N,
                     int64_t K) {
    if (use_avx512 < 0) lld_select_isa(0);
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        for (int64_t m = 0; m < M; m++) memset(C + m * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    if (use_avx512)
        avx512_gemm(A, lda, Bp, C, ldc, M, N, K);
    else
        avx2_gemm(A, lda, Bp, C, ldc, M, N, K);
}

/* batch x (M x K) @ (K x N) -> batch x (M x N). A: row stride lda, batch stride sab. B: strides (sbb, sbk, sbn),
 * sbb = 0 for one B shared by the batch. C: row stride ldc, batch stride scb. Returns 0, or -1 when out of memory. */
int lld_bmm(const float *A, int64_t sab, int64_t lda, const float *B, int64_t sbb, int64_t sbk, int64_t sbn, float *C,
            int64_t scb, int64_t ldc, int64_t batch, int64_t M, int64_t N, int64_t K) {
    if (batch <= 0 || M <= 0 || N <= 0) return 0;
    float *Bp = (float *)malloc((size_t)(lld_packed_size(K > 0 ? K : 1, N) * sizeof(float)));
    if (Bp == NULL) return -1;
    for (int64_t b = 0; b < batch; b++) {
        if (b == 0 || sbb != 0) lld_pack_b(B + b * sbb, sbk, sbn, K, N, Bp);
        lld_gemm_packed(A + b * sab, lda, Bp, C + b * scb, ldc, M, N, K);
    }
    free(Bp);
    return 0;
}
