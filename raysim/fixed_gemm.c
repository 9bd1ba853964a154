/* raysim's fixed-order GEMM (raysim/fixed_gemm.py): the one float32 matrix product whose every output element is
 * computed by the same arithmetic on every x86-64 CPU, whatever its vector width, cache sizes or vendor:
 *
 *     acc = 0;  for r in 0 .. R-1:  for each block k0 = 0, 64, 128, ... of 0 .. K-1:
 *         part = 0;  for k in k0 .. min(K, k0 + 64) - 1:  part = fma(A[g, r][m, k], B[g, r][k, n], part)
 *         acc = (the first block) ? part : acc + part
 * (so a reduction of at most 64 terms with R = 1 is one fma chain)
 *     acc = acc + bias[g1][n]   (with a bias: as an add after the product)
 *     C[g][m, n] = accumulate ? C[g][m, n] + acc : acc
 *
 * one IEEE fused multiply-add after another within a block, the block sums added in order (a two-level sum: its
 * rounding error grows with 64 + the number of blocks, not with the reduction's length — one chain over 4,608 terms
 * was 8x less precise than oneDNN's blocked sums); nothing else is split or reordered, so
 * the vector kernels below (AVX2 + FMA: 8 output columns per register, 6 x 16 outputs per block, 12 x 8 for narrow
 * outputs; AVX-512 where the CPU has it: 16 columns per register, 6 x 32 outputs per block, 12 x 16 for outputs 9-16
 * wide) give the bits of
 * the scalar loop `gemm_reference` (tests/test_fixed_gemm.py checks it on odd shapes) and of any other correct
 * implementation of the same order. Blocking only decides which outputs are computed together, never how one is.
 *
 * Groups: g = (g1, g2), g1 < G1, g2 < G2; each operand's element offset is g1 * s1 + g2 * s2 + r * sr + its row and
 * column offsets (strides for B and C; two tables for A, am[m] + ak[k], so that A can be an image read in place as
 * the im2col matrix of a convolution: rows the output positions, columns the kernel taps), so a grouped convolution's im2col columns, a weight shared across a batch (s2 = 0) and a transposed
 * operand are all read in place (packed into contiguous panels first: copies only). Compiled with -mavx2 -mfma
 * -ffp-contract=off (no contraction the source does not write) by raysim at first use. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MR 6
#define NR 16
#define KC 64  /* the reduction's block (the definition above) */
/* one reduction step for the 6 x 16 block: 12 register accumulators, each one fma after another */
#define ROW(a, x0, x1) { __m256 av = _mm256_broadcast_ss((a) + off); x0 = _mm256_fmadd_ps(av, b0, x0); \
                         x1 = _mm256_fmadd_ps(av, b1v, x1); }
#define STEP(o) { i64 off = (o); ROW(a0, c00, c01) ROW(a1p, c10, c11) ROW(a2p, c20, c21) ROW(a3, c30, c31) \
                  ROW(a4, c40, c41) ROW(a5, c50, c51) }

typedef long long i64;

int fixed_gemm_version(void) { return 2; }  /* 2: the reduction in blocks of 64 */

/* The definition: plain loops, one fmaf after another. */
void gemm_reference(i64 G1, i64 G2, i64 R, i64 M, i64 N, i64 K,
                    const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                    const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                    float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate, const float *bias, i64 bias1) {
    for (i64 g1 = 0; g1 < G1; g1++)
        for (i64 g2 = 0; g2 < G2; g2++)
            for (i64 m = 0; m < M; m++)
                for (i64 n = 0; n < N; n++) {
                    float acc = 0.0f;
                    int first = 1;
                    for (i64 r = 0; r < R; r++)
                        for (i64 k0 = 0; k0 < K; k0 += KC) {  /* a block of at most KC terms from zero */
                            float part = 0.0f;
                            for (i64 k = k0; k < K && k < k0 + KC; k++)
                                part = fmaf(A[g1 * a1 + g2 * a2 + r * ar + am[m] + ak[k]],
                                            B[g1 * b1 + g2 * b2 + r * br + k * bk + n * bn], part);
                            acc = first ? part : acc + part;
                            first = 0;
                        }
                    if (bias) acc = acc + bias[g1 * bias1 + n];
                    float *c = C + g1 * c1 + g2 * c2 + m * cm + n * cn;
                    *c = accumulate ? *c + acc : acc;
                }
}

/* Panel j of B (columns j*w .. j*w+w-1, zeros past nmax) for every r and k: read in place when B's columns are
 * contiguous (bn == 1), else packed into bp as [r][k][w]. Sets the panel's r and k strides. Copies only. */
static const float *b_panel(const float *Bg, i64 R, i64 K, i64 br, i64 bk, i64 bn, i64 j, i64 w, i64 nmax,
                            float *bp, i64 *sr, i64 *sk) {
    if (bn == 1) {
        *sr = br; *sk = bk;
        return Bg + j * w;
    }
    for (i64 r = 0; r < R; r++)
        for (i64 k = 0; k < K; k++) {
            float *dst = bp + (r * K + k) * w;
            const float *src = Bg + r * br + k * bk + j * w * bn;
            for (i64 jj = 0; jj < w; jj++) dst[jj] = jj < nmax ? src[jj * bn] : 0.0f;
        }
    *sr = K * w; *sk = w;
    return bp;
}

/* The n rows of A starting at row i through its row table; rows past M repeat row M-1 (computed, never stored). */
static void a_rows(const float *Ag, const i64 *am, i64 M, i64 i, int n, const float **rows) {
    for (int ii = 0; ii < n; ii++) rows[ii] = Ag + am[i + ii < M ? i + ii : M - 1];
}

/* The same products as gemm_reference, for groups g1 in [g1_begin, g1_end) (callers split G1 across threads).
 * A is read in place through its tables (6 rows broadcast per step; rows past M repeat row M-1 and are never stored); B in place when
 * its columns are contiguous (bn == 1; the last panel's missing columns masked to zero), else packed into a
 * [r][k][16] panel first. Returns 0, or -1 when scratch memory could not be allocated. */
static int gemm_range_avx2(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                      const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                      const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                      float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                      const float *bias, i64 bias1) {
    i64 nb = (N + NR - 1) / NR;
    float *bp = NULL;
    if (bn != 1) {
        bp = (float *)malloc(sizeof(float) * (size_t)(R * K * NR + 1));
        if (!bp) return -1;
    }
    for (i64 g1 = g1_begin; g1 < g1_end; g1++)
        for (i64 g2 = 0; g2 < G2; g2++) {
            const float *Ag = A + g1 * a1 + g2 * a2, *Bg = B + g1 * b1 + g2 * b2;
            float *Cg = C + g1 * c1 + g2 * c2;
            for (i64 j = 0; j < nb; j++) {
                i64 nmax = N - j * NR < NR ? N - j * NR : NR;
                __m256i m0, m1;
                {
                    int lanes[NR];
                    for (int jj = 0; jj < NR; jj++) lanes[jj] = jj < nmax ? -1 : 0;
                    m0 = _mm256_loadu_si256((const __m256i *)lanes);
                    m1 = _mm256_loadu_si256((const __m256i *)(lanes + 8));
                }
                i64 sr, sk;  /* the panel's r and k strides */
                const float *bpanel = b_panel(Bg, R, K, br, bk, bn, j, NR, nmax, bp, &sr, &sk);
                for (i64 i = 0; i < M; i += MR) {
                    const float *arow[MR];
                    a_rows(Ag, am, M, i, MR, arow);
                    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
                           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
                    const float *a0 = arow[0], *a1p = arow[1], *a2p = arow[2], *a3 = arow[3], *a4 = arow[4],
                                *a5 = arow[5];
                    for (i64 r = 0; r < R; r++) {
                        const float *b = bpanel + r * sr;
                        i64 ra = r * ar;
                        if (nmax == NR) {
                            for (i64 k = 0; k < K; k++) {
                                __m256 b0 = _mm256_loadu_ps(b + k * sk), b1v = _mm256_loadu_ps(b + k * sk + 8);
                                STEP(ra + ak[k])
                            }
                        } else {
                            for (i64 k = 0; k < K; k++) {
                                __m256 b0 = _mm256_maskload_ps(b + k * sk, m0);
                                __m256 b1v = nmax > 8 ? _mm256_maskload_ps(b + k * sk + 8, m1) : _mm256_setzero_ps();
                                STEP(ra + ak[k])
                            }
                        }
                    }
                    __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
                    i64 mmax = M - i < MR ? M - i : MR;
                    for (i64 ii = 0; ii < mmax; ii++) {
                        float *c = Cg + (i + ii) * cm + j * NR * cn;
                        __m256 v0 = acc[ii][0], v1 = acc[ii][1];
                        if (bias) {  /* acc + bias[n], as an add after the product would */
                            const float *bb = bias + g1 * bias1 + j * NR;
                            v0 = _mm256_add_ps(v0, _mm256_maskload_ps(bb, m0));
                            if (nmax > 8) v1 = _mm256_add_ps(v1, _mm256_maskload_ps(bb + 8, m1));
                        }
                        if (cn == 1 && nmax == NR) {
                            if (accumulate) {
                                v0 = _mm256_add_ps(_mm256_loadu_ps(c), v0);
                                v1 = _mm256_add_ps(_mm256_loadu_ps(c + 8), v1);
                            }
                            _mm256_storeu_ps(c, v0);
                            _mm256_storeu_ps(c + 8, v1);
                        } else if (cn == 1) {
                            if (accumulate) {
                                v0 = _mm256_add_ps(_mm256_maskload_ps(c, m0), v0);
                                if (nmax > 8) v1 = _mm256_add_ps(_mm256_maskload_ps(c + 8, m1), v1);
                            }
                            _mm256_maskstore_ps(c, m0, v0);
                            if (nmax > 8) _mm256_maskstore_ps(c + 8, m1, v1);
                        } else {
                            float out[NR];
                            _mm256_storeu_ps(out, v0);
                            _mm256_storeu_ps(out + 8, v1);
                            for (i64 jj = 0; jj < nmax; jj++)
                                c[jj * cn] = accumulate ? c[jj * cn] + out[jj] : out[jj];
                        }
                    }
                }
            }
        }
    free(bp);
    return 0;
}

/* Narrow products (N <= 8: a convolution with few output channels): 12 x 8 outputs a block, one register a row,
 * so a 6-column output uses 6 of 8 lanes instead of 6 of 16 (or 32). The same order per output: the same bits. */
#define R8(a, x) { x = _mm256_fmadd_ps(_mm256_broadcast_ss((a) + off), b0, x); }
static int gemm_range_n8(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                         const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                         const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                         float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                         const float *bias, i64 bias1) {
    enum { M12 = 12 };
    float *bp = NULL;
    if (bn != 1) {
        bp = (float *)malloc(sizeof(float) * (size_t)(R * K * 8 + 1));
        if (!bp) return -1;
    }
    int lanes[8];
    for (int jj = 0; jj < 8; jj++) lanes[jj] = jj < N ? -1 : 0;
    __m256i m0 = _mm256_loadu_si256((const __m256i *)lanes);
    for (i64 g1 = g1_begin; g1 < g1_end; g1++)
        for (i64 g2 = 0; g2 < G2; g2++) {
            const float *Ag = A + g1 * a1 + g2 * a2, *Bg = B + g1 * b1 + g2 * b2;
            float *Cg = C + g1 * c1 + g2 * c2;
            i64 sr, sk;
            const float *bpanel = b_panel(Bg, R, K, br, bk, bn, 0, 8, N, bp, &sr, &sk);
            for (i64 i = 0; i < M; i += M12) {
                const float *q[M12];
                a_rows(Ag, am, M, i, M12, q);
                __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0, x6 = x0, x7 = x0,
                       x8 = x0, x9 = x0, x10 = x0, x11 = x0;
                for (i64 r = 0; r < R; r++) {
                    const float *b = bpanel + r * sr;
                    i64 ra = r * ar;
                    for (i64 k = 0; k < K; k++) {
                        __m256 b0 = _mm256_maskload_ps(b + k * sk, m0);
                        i64 off = ra + ak[k];
                        R8(q[0], x0) R8(q[1], x1) R8(q[2], x2) R8(q[3], x3) R8(q[4], x4) R8(q[5], x5)
                        R8(q[6], x6) R8(q[7], x7) R8(q[8], x8) R8(q[9], x9) R8(q[10], x10) R8(q[11], x11)
                    }
                }
                __m256 acc[M12] = {x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11};
                i64 mmax = M - i < M12 ? M - i : M12;
                for (i64 ii = 0; ii < mmax; ii++) {
                    float *c = Cg + (i + ii) * cm;
                    __m256 v = acc[ii];
                    if (bias) v = _mm256_add_ps(v, _mm256_maskload_ps(bias + g1 * bias1, m0));
                    if (cn == 1) {
                        if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(c, m0), v);
                        _mm256_maskstore_ps(c, m0, v);
                    } else {
                        float out[8];
                        _mm256_storeu_ps(out, v);
                        for (i64 jj = 0; jj < N; jj++) c[jj * cn] = accumulate ? c[jj * cn] + out[jj] : out[jj];
                    }
                }
            }
        }
    free(bp);
    return 0;
}

/* The same products with AVX-512 (16 lanes a register, 6 x 32 outputs a block): every lane is still one output, one
 * fma after another in k order, so the bits are the AVX2 kernel's (and the scalar definition's); only how many
 * outputs one instruction computes changes. Used where the CPU has AVX-512F (tests compare the two bit for bit). */
#define ROW5(a, x0, x1) { __m512 av = _mm512_set1_ps(*((a) + off)); x0 = _mm512_fmadd_ps(av, b0, x0); \
                          x1 = _mm512_fmadd_ps(av, b1v, x1); }
#define STEP5(o) { i64 off = (o); ROW5(a0, c00, c01) ROW5(a1p, c10, c11) ROW5(a2p, c20, c21) ROW5(a3, c30, c31) \
                   ROW5(a4, c40, c41) ROW5(a5, c50, c51) }
__attribute__((target("avx512f")))
static int gemm_range_avx512(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                             const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                             const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                             float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                             const float *bias, i64 bias1) {
    const i64 W2 = 32;
    i64 nb = (N + W2 - 1) / W2;
    float *bp = NULL;
    if (bn != 1) {
        bp = (float *)malloc(sizeof(float) * (size_t)(R * K * W2 + 1));
        if (!bp) return -1;
    }
    for (i64 g1 = g1_begin; g1 < g1_end; g1++)
        for (i64 g2 = 0; g2 < G2; g2++) {
            const float *Ag = A + g1 * a1 + g2 * a2, *Bg = B + g1 * b1 + g2 * b2;
            float *Cg = C + g1 * c1 + g2 * c2;
            for (i64 j = 0; j < nb; j++) {
                i64 nmax = N - j * W2 < W2 ? N - j * W2 : W2;
                __mmask16 m0 = nmax >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nmax) - 1);
                __mmask16 m1 = nmax >= 32 ? (__mmask16)0xFFFF : nmax > 16 ? (__mmask16)((1u << (nmax - 16)) - 1)
                                                                         : (__mmask16)0;
                i64 sr, sk;
                const float *bpanel = b_panel(Bg, R, K, br, bk, bn, j, W2, nmax, bp, &sr, &sk);
                for (i64 i = 0; i < M; i += MR) {
                    const float *arow[MR];
                    a_rows(Ag, am, M, i, MR, arow);
                    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
                           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
                    const float *a0 = arow[0], *a1p = arow[1], *a2p = arow[2], *a3 = arow[3], *a4 = arow[4],
                                *a5 = arow[5];
                    for (i64 r = 0; r < R; r++) {
                        const float *b = bpanel + r * sr;
                        i64 ra = r * ar;
                        for (i64 k = 0; k < K; k++) {
                            __m512 b0 = _mm512_maskz_loadu_ps(m0, b + k * sk);
                            __m512 b1v = _mm512_maskz_loadu_ps(m1, b + k * sk + 16);
                            STEP5(ra + ak[k])
                        }
                    }
                    __m512 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
                    i64 mmax = M - i < MR ? M - i : MR;
                    for (i64 ii = 0; ii < mmax; ii++) {
                        float *c = Cg + (i + ii) * cm + j * W2 * cn;
                        __m512 v0 = acc[ii][0], v1 = acc[ii][1];
                        if (bias) {
                            const float *bb = bias + g1 * bias1 + j * W2;
                            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, bb));
                            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, bb + 16));
                        }
                        if (cn == 1) {
                            if (accumulate) {
                                v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), v0);
                                v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), v1);
                            }
                            _mm512_mask_storeu_ps(c, m0, v0);
                            _mm512_mask_storeu_ps(c + 16, m1, v1);
                        } else {
                            float out[32];
                            _mm512_storeu_ps(out, v0);
                            _mm512_storeu_ps(out + 16, v1);
                            for (i64 jj = 0; jj < nmax; jj++)
                                c[jj * cn] = accumulate ? c[jj * cn] + out[jj] : out[jj];
                        }
                    }
                }
            }
        }
    free(bp);
    return 0;
}

/* Products 8 < N <= 16 with AVX-512 (a convolution with 16 output channels, its weight gradient): 12 x 16 outputs a
 * block, one 16-lane register a row, where the 6 x 32 block would leave half its lanes idle. The same order per
 * output: the same bits. */
#define R16(a, x) { x = _mm512_fmadd_ps(_mm512_set1_ps(*((a) + off)), b0, x); }
__attribute__((target("avx512f")))
static int gemm_range_avx512_n16(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                                 const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                                 const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                                 float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                                 const float *bias, i64 bias1) {
    enum { M12 = 12 };
    float *bp = NULL;
    if (bn != 1) {
        bp = (float *)malloc(sizeof(float) * (size_t)(R * K * 16 + 1));
        if (!bp) return -1;
    }
    __mmask16 m0 = N >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << N) - 1);
    for (i64 g1 = g1_begin; g1 < g1_end; g1++)
        for (i64 g2 = 0; g2 < G2; g2++) {
            const float *Ag = A + g1 * a1 + g2 * a2, *Bg = B + g1 * b1 + g2 * b2;
            float *Cg = C + g1 * c1 + g2 * c2;
            i64 sr, sk;
            const float *bpanel = b_panel(Bg, R, K, br, bk, bn, 0, 16, N, bp, &sr, &sk);
            for (i64 i = 0; i < M; i += M12) {
                const float *q[M12];
                a_rows(Ag, am, M, i, M12, q);
                __m512 x0 = _mm512_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0, x6 = x0, x7 = x0,
                       x8 = x0, x9 = x0, x10 = x0, x11 = x0;
                for (i64 r = 0; r < R; r++) {
                    const float *b = bpanel + r * sr;
                    i64 ra = r * ar;
                    for (i64 k = 0; k < K; k++) {
                        __m512 b0 = _mm512_maskz_loadu_ps(m0, b + k * sk);
                        i64 off = ra + ak[k];
                        R16(q[0], x0) R16(q[1], x1) R16(q[2], x2) R16(q[3], x3) R16(q[4], x4) R16(q[5], x5)
                        R16(q[6], x6) R16(q[7], x7) R16(q[8], x8) R16(q[9], x9) R16(q[10], x10) R16(q[11], x11)
                    }
                }
                __m512 acc[M12] = {x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11};
                i64 mmax = M - i < M12 ? M - i : M12;
                for (i64 ii = 0; ii < mmax; ii++) {
                    float *c = Cg + (i + ii) * cm;
                    __m512 v = acc[ii];
                    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m0, bias + g1 * bias1));
                    if (cn == 1) {
                        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), v);
                        _mm512_mask_storeu_ps(c, m0, v);
                    } else {
                        float out[16];
                        _mm512_storeu_ps(out, v);
                        for (i64 jj = 0; jj < N; jj++) c[jj * cn] = accumulate ? c[jj * cn] + out[jj] : out[jj];
                    }
                }
            }
        }
    free(bp);
    return 0;
}

static int isa = -1;  /* 0: AVX2, 1: AVX-512F; chosen once from the CPU (RAYSIM_FIXED_GEMM_ISA=avx2 forces AVX2) */

static int pick_isa(void) {
    const char *e = getenv("RAYSIM_FIXED_GEMM_ISA");
    if (e && strcmp(e, "avx2") == 0) return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

/* which kernel runs: -1 asks (choosing once), 0 forces AVX2, 1 AVX-512 where the CPU has it; returns the one in
 * force (tests compare the two) */
int kernel_isa(int want) {
    if (want == 0) {
        isa = 0;
    } else if (want == 1) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx512f") ? 1 : 0;
    } else if (isa < 0) {
        isa = pick_isa();
    }
    return isa;
}

/* One fma chain per output over all R x K terms (the kernels): the definition where R = 1 and K <= KC. */
static int chain_range(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                       const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                       const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                       float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                       const float *bias, i64 bias1) {
    if (isa < 0) isa = pick_isa();
    if (N <= 8)
        return gemm_range_n8(g1_begin, g1_end, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn,
                             C, c1, c2, cm, cn, accumulate, bias, bias1);
    if (isa == 1 && N <= 16)
        return gemm_range_avx512_n16(g1_begin, g1_end, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn,
                                     C, c1, c2, cm, cn, accumulate, bias, bias1);
    if (isa == 1)
        return gemm_range_avx512(g1_begin, g1_end, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn,
                                 C, c1, c2, cm, cn, accumulate, bias, bias1);
    return gemm_range_avx2(g1_begin, g1_end, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn,
                           C, c1, c2, cm, cn, accumulate, bias, bias1);
}

/* The definition's blocks: a reduction of more than KC terms (or R > 1) runs block by block through the kernels into a
 * scratch total T (the first block stored, each next one added: the kernels' accumulate store, T + part), then
 * C = T (+ bias) or C + (T (+ bias)), as the one-block path stores. Returns 0, or -1 without scratch memory. */
static int gemm_range(i64 g1_begin, i64 g1_end, i64 G2, i64 R, i64 M, i64 N, i64 K,
                      const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
                      const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
                      float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate,
                      const float *bias, i64 bias1) {
    if (R == 0 || K == 0 || (R == 1 && K <= KC))  /* one chain (no term at all: 0, as the definition) */
        return chain_range(g1_begin, g1_end, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn,
                           C, c1, c2, cm, cn, accumulate, bias, bias1);
    float *T = (float *)malloc(sizeof(float) * (size_t)(M * N + 1));
    if (!T) return -1;
    for (i64 g1 = g1_begin; g1 < g1_end; g1++)
        for (i64 g2 = 0; g2 < G2; g2++) {
            int first = 1;
            for (i64 r = 0; r < R; r++)
                for (i64 k0 = 0; k0 < K; k0 += KC) {
                    i64 kb = K - k0 < KC ? K - k0 : KC;
                    /* group (g1, g2)'s block: the kernels' group g1 with G2 = 1, its pointers moved to g2, r, k0 */
                    if (chain_range(g1, g1 + 1, 1, 1, M, N, kb, A + g2 * a2 + r * ar, a1, 0, 0, am, ak + k0,
                                    B + g2 * b2 + r * br + k0 * bk, b1, 0, 0, bk, bn, T, 0, 0, N, 1, !first, NULL,
                                    0) != 0) {
                        free(T);
                        return -1;
                    }
                    first = 0;
                }
            float *Cg = C + g1 * c1 + g2 * c2;
            const float *bb = bias ? bias + g1 * bias1 : NULL;
            for (i64 m = 0; m < M; m++) {  /* (R, K >= 1 here: at least one block wrote T) */
                const float *t = T + m * N;
                float *c = Cg + m * cm;
                i64 n = 0;
                if (cn == 1)
                    for (; n + 8 <= N; n += 8) {
                        __m256 v = _mm256_loadu_ps(t + n);
                        if (bb) v = _mm256_add_ps(v, _mm256_loadu_ps(bb + n));
                        if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(c + n), v);
                        _mm256_storeu_ps(c + n, v);
                    }
                for (; n < N; n++) {
                    float v = t[n];
                    if (bb) v = v + bb[n];
                    c[n * cn] = accumulate ? c[n * cn] + v : v;
                }
            }
        }
    free(T);
    return 0;
}

/* The groups g1 split across nt OpenMP threads (torch's own runtime where torch is loaded: the library links the
 * libgomp.so.1 already in the process, so ATen's pool serves both). Each output element is computed by one thread:
 * the bits do not depend on nt. Returns 0, or -1 when scratch memory could not be allocated. */
int gemm(int nt, i64 G1, i64 G2, i64 R, i64 M, i64 N, i64 K,
         const float *A, i64 a1, i64 a2, i64 ar, const i64 *am, const i64 *ak,
         const float *B, i64 b1, i64 b2, i64 br, i64 bk, i64 bn,
         float *C, i64 c1, i64 c2, i64 cm, i64 cn, int accumulate, const float *bias, i64 bias1) {
    kernel_isa(-1);  /* chosen before any thread runs */
#ifdef _OPENMP
    if (nt > 1 && G1 > 1) {
        int bad = 0;
#pragma omp parallel num_threads(nt) reduction(|: bad)
        {
            i64 t = omp_get_thread_num(), n = omp_get_num_threads();
            bad |= gemm_range(G1 * t / n, G1 * (t + 1) / n, G2, R, M, N, K, A, a1, a2, ar, am, ak,
                              B, b1, b2, br, bk, bn, C, c1, c2, cm, cn, accumulate, bias, bias1);
        }
        return bad ? -1 : 0;
    }
#endif
    (void)nt;
    return gemm_range(0, G1, G2, R, M, N, K, A, a1, a2, ar, am, ak, B, b1, b2, br, bk, bn, C, c1, c2, cm, cn,
                      accumulate, bias, bias1);
}

/* d[t] = d[t] + s[t] for t < n, eight at a time: each element one add, as the scalar loop gives it. */
static void add_into(float *d, const float *s, i64 n) {
    i64 t = 0;
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(d + t, _mm256_add_ps(_mm256_loadu_ps(d + t), _mm256_loadu_ps(s + t)));
    for (; t < n; t++) d[t] = d[t] + s[t];
}

/* One client's image of a grouped convolution's input gradient: du [L, kh*kw*C] (each output position's tap
 * gradients, taps (i, j, c)) -> dx, that image's C channels in channels-last memory (pixel stride G*C):
 * dx[y, x, c] = the sum of the du entries that read it, added in the order h, w (outer), i, j (inner), from zero.
 * Summed in the client's own contiguous image ``img`` [H, W, C] (scratch), where the kw taps of one kernel row land on
 * kw neighbouring pixels (without dilation), so a row's kw * C values are added as one run — each element still
 * receives its terms one add at a time in the order above — then copied into dx. */
static void col2im_one(const float *du, float *dx, float *img, i64 H, i64 W, i64 G, i64 C, i64 kh, i64 kw, i64 sh,
                       i64 sw, i64 ph, i64 pw, i64 dh, i64 dw, i64 Ho, i64 Wo) {
    memset(img, 0, sizeof(float) * (size_t)(H * W * C));
    const float *src = du;
    for (i64 h = 0; h < Ho; h++)
        for (i64 w = 0; w < Wo; w++)
            for (i64 i = 0; i < kh; i++, src += kw * C) {
                i64 yy = h * sh - ph + i * dh;
                if (yy < 0 || yy >= H) continue;
                i64 x0 = w * sw - pw;
                if (dw == 1) {  /* taps j0 .. j1-1 land on pixels x0+j0 .. x0+j1-1 of row yy */
                    i64 j0 = x0 < 0 ? -x0 : 0, j1 = x0 + kw > W ? W - x0 : kw;
                    if (j1 > j0) add_into(img + (yy * W + x0 + j0) * C, src + j0 * C, (j1 - j0) * C);
                    continue;
                }
                for (i64 j = 0; j < kw; j++) {
                    i64 xx = x0 + j * dw;
                    if (xx >= 0 && xx < W) add_into(img + (yy * W + xx) * C, src + j * C, C);
                }
            }
    for (i64 q = 0; q < H * W; q++) memcpy(dx + q * G * C, img + q * C, sizeof(float) * (size_t)C);
}

static int input_grad_range(i64 g_begin, i64 g_end, i64 B, i64 G, i64 H, i64 W, i64 C, i64 O, i64 kh, i64 kw,
                            i64 sh, i64 sw, i64 ph, i64 pw, i64 dh, i64 dw, i64 Ho, i64 Wo,
                            const float *dy, const float *wo, float *dx) {
    i64 L = Ho * Wo, ckk = kh * kw * C;
    float *du = (float *)malloc(sizeof(float) * (size_t)(L * ckk + H * W * C + 1)), *img = du + L * ckk;
    i64 *am = (i64 *)malloc(sizeof(i64) * (size_t)(L + O + 1));
    if (!du || !am) { free(du); free(am); return -1; }
    i64 *ak = am + L;
    for (i64 l = 0; l < L; l++) am[l] = l * G * O;
    for (i64 o = 0; o < O; o++) ak[o] = o;
    int bad = 0;
    for (i64 g = g_begin; g < g_end && !bad; g++)
        for (i64 b = 0; b < B && !bad; b++) {
            /* du (L x ckk) = dy[b, :, g] (L x O) @ w[g] (O x ckk), the fixed-order product of one group */
            bad = gemm_range(g, g + 1, 1, 1, L, ckk, O, dy + b * L * G * O, O, 0, 0, am, ak,
                             wo, O * ckk, 0, 0, ckk, 1, du, 0, 0, ckk, 1, 0, NULL, 0);
            col2im_one(du, dx + b * H * W * G * C + g * C, img, H, W, G, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho,
                       Wo);
        }
    free(du);
    free(am);
    return bad;
}

/* The input gradient of a grouped convolution (raysim/fixed_gemm.py, _input_grad): per client g and image b, the
 * tap gradients du = dy[b, g] w[g] in a scratch block, then col2im into dx. dy [B, Ho*Wo, G*O] (channels-last),
 * wo [G, O, kh*kw*C], dx [B, H, W, G*C] (channels-last memory, overwritten). Clients split across nt threads. */
int conv_input_grad(int nt, i64 B, i64 G, i64 H, i64 W, i64 C, i64 O, i64 kh, i64 kw, i64 sh, i64 sw, i64 ph,
                    i64 pw, i64 dh, i64 dw, i64 Ho, i64 Wo, const float *dy, const float *wo, float *dx) {
    kernel_isa(-1);
#ifdef _OPENMP
    if (nt > 1 && G > 1) {
        int bad = 0;
#pragma omp parallel num_threads(nt) reduction(|: bad)
        {
            i64 t = omp_get_thread_num(), n = omp_get_num_threads();
            bad |= input_grad_range(G * t / n, G * (t + 1) / n, B, G, H, W, C, O, kh, kw, sh, sw, ph, pw, dh, dw, Ho,
                                    Wo, dy, wo, dx);
        }
        return bad ? -1 : 0;
    }
#endif
    (void)nt;
    return input_grad_range(0, G, B, G, H, W, C, O, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo, dy, wo, dx);
}
