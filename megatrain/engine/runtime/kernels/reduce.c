/* reduce: compiled on first use by megatrain/engine/runtime/ckernel.py (LazyKernel); see engine/host/reduce_kernel.py. */
#include <string.h>
#include <math.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float f8 __attribute__((vector_size(32)));

static inline float widen(const void *src, int64_t bf16, int64_t i) {
    float g;
    if (bf16) { uint32_t u = ((uint32_t)((const uint16_t *)src)[i]) << 16; memcpy(&g, &u, 4); }
    else g = ((const float *)src)[i];
    return g;
}

static inline float widen16(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float g; memcpy(&g, &u, 4); return g; }

/* Whole 8-blocks: the values written, their squares into the 8 lanes. One function per case, on restrict
   pointers, with nothing but the arithmetic in the loop: each vectorizes (measured: with an exponent-bit test in
   the loop it stayed scalar, and the add ran at a third of the bandwidth). A non-finite value written makes its
   lane, and so the norm, inf or NaN: the finite flag is read off the norm. */
#define BODY_FN(NAME, T, OLD, G) \
__attribute__((noinline)) static uint32_t NAME(const T *__restrict s, float *__restrict d, int64_t n, float *__restrict lanes) { \
    float acc[8]; \
    memcpy(acc, lanes, sizeof acc); \
    for (int64_t i = 0; i + 8 <= n; i += 8) { \
        for (int j = 0; j < 8; j++) { \
            float v = (OLD) + (G); \
            d[i + j] = v; \
            acc[j] = acc[j] + v * v; \
        } \
    } \
    memcpy(lanes, acc, sizeof acc); \
    return 0; \
}
BODY_FN(first_bf16, uint16_t, 0.0f, widen16(s[i + j]))
BODY_FN(add_bf16, uint16_t, d[i + j], widen16(s[i + j]))
BODY_FN(first_fp32, float, 0.0f, s[i + j])
BODY_FN(add_fp32, float, d[i + j], s[i + j])

/* A first write with streaming (non-temporal) stores, for a slab larger than the caches: a plain store first reads
   each destination line into the cache (to write part of it), a third of the pass's traffic for a slab that is
   overwritten whole; a streaming store writes the line without reading it. The same values and lanes as first_*
   (0 + g, products rounded then added); d 32-byte aligned (dense_range checks). An sfence at the end makes the
   stores visible to whichever thread reads the slab next, as plain stores are. */
#if defined(__AVX__)
#define STREAMED 1
#define STREAM_FN(NAME, T, G) \
__attribute__((noinline)) static uint32_t NAME(const T *__restrict s, float *__restrict d, int64_t n, float *__restrict lanes) { \
    f8 acc, v; \
    memcpy(&acc, lanes, sizeof acc); \
    for (int64_t i = 0; i + 8 <= n; i += 8) { \
        for (int j = 0; j < 8; j++) v[j] = 0.0f + (G); \
        _mm256_stream_ps(d + i, (__m256)v); \
        acc = acc + v * v; \
    } \
    memcpy(lanes, &acc, sizeof acc); \
    _mm_sfence(); \
    return 0; \
}
STREAM_FN(first_bf16_stream, uint16_t, widen16(s[i + j]))
STREAM_FN(first_fp32_stream, float, s[i + j])
#else
#define STREAMED 0
#endif

/* Whether this build has the streamed first write (reduce_kernel.py reads it). */
int64_t streamed(void) { return STREAMED; }

/* dst[0..n) = (first ? 0 + g : dst + g), g from src (FP32, or bf16 widened); the squares of the values written
   go to lanes[(off + i) % 8] for off + i < body_end (the slab's whole 8-blocks). Returns 1 if a written value is
   not finite. */
static int64_t dense_range(const void *src, int64_t bf16, float *dst, int64_t off, int64_t n, int64_t first,
                           int64_t body_end, float *lanes) {
    uint32_t bad = 0;
    int64_t i = 0;
    while (i < n && ((off + i) & 7)) {
        float v = first ? 0.0f + widen(src, bf16, i) : dst[i] + widen(src, bf16, i);
        dst[i] = v;
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + v * v;
        uint32_t b; memcpy(&b, &v, 4); bad |= (b & 0x7F800000u) == 0x7F800000u;
        i++;
    }
    int64_t stop = body_end - off < n ? body_end - off : n;
    int64_t m = stop > i ? (stop - i) / 8 * 8 : 0;
#if STREAMED
    if (first == 2 && !((uintptr_t)(dst + i) & 31)) {
        if (bf16) first_bf16_stream((const uint16_t *)src + i, dst + i, m, lanes);
        else first_fp32_stream((const float *)src + i, dst + i, m, lanes);
    } else
#endif
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + i;
        bad |= first ? first_bf16(s, dst + i, m, lanes) : add_bf16(s, dst + i, m, lanes);
    } else {
        const float *s = (const float *)src + i;
        bad |= first ? first_fp32(s, dst + i, m, lanes) : add_fp32(s, dst + i, m, lanes);
    }
    i += m;
    for (; i < n; i++) {
        float v = first ? 0.0f + widen(src, bf16, i) : dst[i] + widen(src, bf16, i);
        dst[i] = v;
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + v * v;
        uint32_t b; memcpy(&b, &v, 4); bad |= (b & 0x7F800000u) == 0x7F800000u;
    }
    return bad != 0;
}

/* The squares of dst[0..n) into the lanes, dst unchanged: what dense_range adds for a gradient of zeros (dst + 0 is
   dst: a slab holds no -0, its zeros being written as 0 + g), without reading a gradient or writing the slab. */

/* Lane j gets d[j]^2, d[j + 8]^2, ... in order, each product rounded then added (-ffp-contract=off): what the loops
   above do. Written on 8-float vectors: the plain loop was vectorized across its lanes with shuffles, at a third of
   torch's norm's speed. */
__attribute__((noinline)) static void keep_body(const float *__restrict d, int64_t n, float *__restrict lanes) {
    f8 acc;
    memcpy(&acc, lanes, sizeof acc);
    for (int64_t i = 0; i + 8 <= n; i += 8) {
        f8 v;
        memcpy(&v, d + i, sizeof v);
        acc = acc + v * v;
    }
    memcpy(lanes, &acc, sizeof acc);
}

static void measure_range(const float *dst, int64_t off, int64_t n, int64_t body_end, float *lanes) {
    int64_t i = 0;
    for (; i < n && ((off + i) & 7); i++)
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + dst[i] * dst[i];
    int64_t stop = body_end - off < n ? body_end - off : n;
    int64_t m = stop > i ? (stop - i) / 8 * 8 : 0;
    keep_body(dst + i, m, lanes);
    for (i += m; i < n; i++)
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + dst[i] * dst[i];
}

/* Whether src[i..i+m) holds only zeros (+0 or -0): 128 bytes ORed at a time as 64-bit words with the sign bits
   masked off, stopping at the first 128 that are not (a dense gradient stops at once). A NULL src has no gradient:
   zeros. */
static int all_zero(const void *src, int64_t bf16, int64_t i, int64_t m) {
    if (!src) return 1;
    int64_t size = bf16 ? 2 : 4, bytes = m * size, a = 0;
    const unsigned char *p = (const unsigned char *)src + i * size;
    uint64_t mask = bf16 ? 0x7FFF7FFF7FFF7FFFull : 0x7FFFFFFF7FFFFFFFull;
    for (; a + 128 <= bytes; a += 128) {
        uint64_t acc = 0;
        for (int k = 0; k < 16; k++) { uint64_t w; memcpy(&w, p + a + 8 * k, 8); acc |= w & mask; }
        if (acc) return 0;
    }
    for (; a < bytes; a += size) {
        uint32_t w = 0;
        memcpy(&w, p + a, size);
        if (w & (uint32_t)mask) return 0;
    }
    return 1;
}


/* dense_range over dst[0..n) (slab offset off), except on ZERO_BLOCK-aligned blocks whose gradient is all zeros (an
   expert no token was routed to) or absent (src NULL): those are set to zero on a first write (0 + 0), else left
   as they are (dst + 0), their squares measured from dst only if `measure`; *skipped counts their elements. The
   slab and the lanes end as dense_range leaves them. */
int64_t reduce_range(const void *src, int64_t bf16, float *dst, int64_t off, int64_t n, int64_t first,
                     int64_t body_end, float *lanes, int64_t measure, int64_t *skipped) {
    int64_t bad = 0, run = 0, i = 0, esize = bf16 ? 2 : 4;
    while (i < n) {
        int64_t end = (off + i) / ZERO_BLOCK * ZERO_BLOCK + ZERO_BLOCK - off;
        if (end > n) end = n;
        if (all_zero(src, bf16, i, end - i)) {
            if (i > run)
                bad |= dense_range((const char *)src + run * esize, bf16, dst + run, off + run, i - run, first,
                                   body_end, lanes);
            if (first) memset(dst + i, 0, (end - i) * 4);
            else if (measure) measure_range(dst + i, off + i, end - i, body_end, lanes);
            *skipped += end - i;
            run = end;
        }
        i = end;
    }
    if (n > run)
        bad |= dense_range((const char *)src + run * esize, bf16, dst + run, off + run, n - run, first, body_end,
                           lanes);
    return bad != 0;
}

/* The norm: the lanes added in order, its square root. */
float finish_norm(const float *lanes) {
    float b = lanes[0];
    for (int j = 1; j < 8; j++) b = b + lanes[j];
    return sqrtf(b);
}
