/* kvtier's copy kernel for KV pages on the CPU: many small 2-D matrices, each copied between an
 * engine block and a host row with the strides of either side, plain or transposed.
 *
 * Matrix i has `rows` x `cols` elements of `itemsize` bytes; element (r, c) is at
 * src[i] + (r * s_r + c * s_c) * itemsize and goes to dst[i] + (r * d_r + c * d_c) * itemsize.
 * Both sides row-major and dense: one memcpy. One side's rows are the other's columns (vLLM's CPU
 * layout keeps K as [head_dim, block_size], the host rows as [block_size, head_dim]): a transpose
 * in square tiles held in registers (16 x 16 four-byte elements with AVX-512, 16 x 16 two-byte
 * ones with AVX2) or in L1 otherwise. Anything else: an element loop. Matrices must not overlap.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 16

/* dst (C x R, row stride dst_stride) = transpose of src (R x C, row stride src_stride). */
#define TRANSPOSE(T)                                                                              \
    static void transpose_##T(const T *restrict src, int64_t src_stride, T *restrict dst,         \
                              int64_t dst_stride, int64_t R, int64_t C) {                          \
        for (int64_t r0 = 0; r0 < R; r0 += TILE) {                                                 \
            int64_t r1 = r0 + TILE < R ? r0 + TILE : R;                                            \
            for (int64_t c0 = 0; c0 < C; c0 += TILE) {                                             \
                int64_t c1 = c0 + TILE < C ? c0 + TILE : C;                                        \
                if (r1 - r0 == TILE && c1 - c0 == TILE && tile_##T(src + r0 * src_stride + c0,      \
                                                                    src_stride,                    \
                                                                    dst + c0 * dst_stride + r0,    \
                                                                    dst_stride))                   \
                    continue;                                                                      \
                for (int64_t c = c0; c < c1; c++)                                                  \
                    for (int64_t r = r0; r < r1; r++)                                              \
                        dst[c * dst_stride + r] = src[r * src_stride + c];                         \
            }                                                                                      \
        }                                                                                          \
    }

#ifdef __AVX512F__
/* A 16 x 16 tile of four-byte elements through registers; returns 1 (done). */
static inline int tile_uint32_t(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(src + i * ss)));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++)
        _mm512_storeu_si512((void *)(dst + i * ds), _mm512_castps_si512(r[i]));
    return 1;
}
#else
static inline int tile_uint32_t(const uint32_t *s, int64_t ss, uint32_t *d, int64_t ds) {
    (void)s, (void)ss, (void)d, (void)ds;
    return 0;
}
#endif

#ifdef __AVX2__
/* A 16 x 16 tile of two-byte elements through registers; returns 1 (done). */
static inline int tile_uint16_t(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds) {
    __m256i r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm256_loadu_si256((const __m256i *)(src + i * ss));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm256_unpacklo_epi16(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi16(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm256_unpacklo_epi32(t[i], t[i + 2]);
        r[i + 1] = _mm256_unpackhi_epi32(t[i], t[i + 2]);
        r[i + 2] = _mm256_unpacklo_epi32(t[i + 1], t[i + 3]);
        r[i + 3] = _mm256_unpackhi_epi32(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + 2 * j] = _mm256_unpacklo_epi64(r[i + j], r[i + j + 4]);
            t[i + 2 * j + 1] = _mm256_unpackhi_epi64(r[i + j], r[i + j + 4]);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm256_permute2x128_si256(t[j], t[j + 8], 0x20);
        r[j + 8] = _mm256_permute2x128_si256(t[j], t[j + 8], 0x31);
    }
    for (int i = 0; i < 16; i++)
        _mm256_storeu_si256((__m256i *)(dst + i * ds), r[i]);
    return 1;
}
#else
static inline int tile_uint16_t(const uint16_t *s, int64_t ss, uint16_t *d, int64_t ds) {
    (void)s, (void)ss, (void)d, (void)ds;
    return 0;
}
#endif

static inline int tile_uint8_t(const uint8_t *s, int64_t ss, uint8_t *d, int64_t ds) {
    (void)s, (void)ss, (void)d, (void)ds;
    return 0;
}

static inline int tile_uint64_t(const uint64_t *s, int64_t ss, uint64_t *d, int64_t ds) {
    (void)s, (void)ss, (void)d, (void)ds;
    return 0;
}

TRANSPOSE(uint8_t)
TRANSPOSE(uint16_t)
TRANSPOSE(uint32_t)
TRANSPOSE(uint64_t)

#define DISPATCH(size, src, ss, dst, dstr, R, C)                                                   \
    switch (size) {                                                                                \
    case 1: transpose_uint8_t((const uint8_t *)(src), ss, (uint8_t *)(dst), dstr, R, C); break;     \
    case 2: transpose_uint16_t((const uint16_t *)(src), ss, (uint16_t *)(dst), dstr, R, C); break;  \
    case 4: transpose_uint32_t((const uint32_t *)(src), ss, (uint32_t *)(dst), dstr, R, C); break;  \
    default: transpose_uint64_t((const uint64_t *)(src), ss, (uint64_t *)(dst), dstr, R, C); break; \
    }

static void strided(const char *src, char *dst, int itemsize, int64_t rows, int64_t cols,
                    int64_t s_r, int64_t s_c, int64_t d_r, int64_t d_c) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            memcpy(dst + (r * d_r + c * d_c) * itemsize, src + (r * s_r + c * s_c) * itemsize,
                   (size_t)itemsize);
}

/* Returns 0, or -1 for an element size it does not handle (nothing copied). */
int kvtier_copy_matrices(int64_t count, const uint64_t *src, const uint64_t *dst, int itemsize,
                         int64_t rows, int64_t cols, int64_t s_r, int64_t s_c, int64_t d_r,
                         int64_t d_c) {
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
        return -1;
    size_t bytes = (size_t)(rows * cols * itemsize);
    for (int64_t i = 0; i < count; i++) {
        const char *s = (const char *)(uintptr_t)src[i];
        char *d = (char *)(uintptr_t)dst[i];
        if (s_c == 1 && d_c == 1 && s_r == cols && d_r == cols)
            memcpy(d, s, bytes);
        else if (s_r == 1 && d_c == 1) /* src is cols x rows row-major */
            DISPATCH(itemsize, s, s_c, d, d_r, cols, rows)
        else if (s_c == 1 && d_r == 1) /* dst is cols x rows row-major */
            DISPATCH(itemsize, s, s_r, d, d_c, rows, cols)
        else
            strided(s, d, itemsize, rows, cols, s_r, s_c, d_r, d_c);
    }
    return 0;
}
