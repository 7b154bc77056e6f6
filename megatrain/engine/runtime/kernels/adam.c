/* adam: compiled on first use by megatrain/engine/runtime/ckernel.py (LazyKernel); see engine/update/adam_kernel.py. */
#include <string.h>
#include <math.h>
#define BLOCK 1024

typedef union { float f; uint32_t u; } fu;

/* bf16 round-to-nearest-even on the bits; a NaN becomes the canonical 0x7FC0 (hilo.py's split and torch's
   conversion do the same). */
static inline uint16_t rne16(uint32_t w) {
    uint32_t nan = (w & 0x7FFFFFFFu) > 0x7F800000u;
    uint32_t rne = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? 0x7FC0u : rne);
}

/* hp: [0] 1 - lr*wd (AdamW) or wd (Adam), [1] 1 - beta1, [2] beta2, [3] 1 - beta2, [4] sqrt(1 - beta2^t),
   [5] eps, [6] -lr / (1 - beta1^t); each rounded to float as torch's kernel does.
   flags: 1 AdamW, 2 maximize, 4 weight decay, 8 bf16 gradients, 16 write the scaled FP32 gradients back,
   32 gradient as 0 + g, 64 the contracted variant (v and Adam's decay as one fused multiply-add each).
   kind: 0 FP32 master (+ its bf16 copy in `hi` if not NULL), 1 hi + lo halves, 2 bf16 master.
   old_ties: ascending positions (relative) whose hi rounded up at a tie; new ones go to ties[] as base + i.
   Returns where it stopped: n, or the start of a block for which ties[] had no room (untouched). */
int64_t adam_pass(void *grad, const float *coefs, int64_t ncoef, float *master, uint16_t *hi,
                        uint16_t *lo, int64_t kind, float *m, float *v, int64_t n, const int64_t *old_ties,
                        int64_t nold, int64_t base, int64_t *ties, int64_t cap, int64_t *count,
                        const double *hp, int64_t flags) {
    float gb[BLOCK], pb[BLOCK];
    uint32_t *pu = (uint32_t *)pb;
    const float f0 = (float)hp[0], w1 = (float)hp[1], b2 = (float)hp[2], c2 = (float)hp[3];
    const float bc2 = (float)hp[4], eps = (float)hp[5], nstep = (float)hp[6];
    const int adamw = flags & 1, maximize = flags & 2, decay = flags & 4, contract = flags & 64;
    /* m.lerp_(g, w1) as torch's vector loop computes it: from the nearer end */
    const int small = fabsf(w1) < 0.5f;
    const float coeff = small ? w1 : w1 - 1.0f;
    int64_t k = *count, t = 0;
    for (int64_t s = 0; s < n; s += BLOCK) {
        if (cap - k < BLOCK) { *count = k; return s; }
        int64_t e = s + BLOCK < n ? s + BLOCK : n, len = e - s;
        if (flags & 8) {
            const uint16_t *g16 = (const uint16_t *)grad + s;
            uint32_t *gu = (uint32_t *)gb;
            for (int64_t i = 0; i < len; i++) gu[i] = (uint32_t)g16[i] << 16;
        } else {
            memcpy(gb, (const float *)grad + s, len * sizeof(float));
        }
        if (flags & 32) for (int64_t i = 0; i < len; i++) gb[i] = gb[i] + 0.0f;
        for (int64_t c = 0; c < ncoef; c++) {
            const float cf = coefs[c];
            for (int64_t i = 0; i < len; i++) gb[i] = gb[i] * cf;
        }
        if ((flags & 16) && ncoef) memcpy((float *)grad + s, gb, len * sizeof(float));
        if (kind == 0) {
            memcpy(pb, master + s, len * sizeof(float));
        } else if (kind == 1) {
            const uint16_t *h = hi + s, *l = lo + s;
            for (int64_t i = 0; i < len; i++) {
                uint32_t q = l[i];
                pu[i] = (((uint32_t)h[i] - (q > 0x8000u)) << 16) | q;
            }
            while (t < nold && old_ties[t] < e) { pu[old_ties[t] - s] -= 65536u; t++; }
        } else {
            const uint16_t *h = hi + s;
            for (int64_t i = 0; i < len; i++) pu[i] = (uint32_t)h[i] << 16;
        }
        float *mm = m + s, *vv = v + s;
        if (contract) {
            for (int64_t i = 0; i < len; i++) {
                float g = gb[i], p = pb[i];
                if (maximize) g = g * -1.0f;
                if (decay) { if (adamw) p = p * f0; else g = fmaf(p, f0, g); }
                float a = fmaf(coeff, g - mm[i], small ? mm[i] : g);
                float b = fmaf(c2 * g, g, vv[i] * b2);
                mm[i] = a;
                vv[i] = b;
                pb[i] = p + nstep * a / (sqrtf(b) / bc2 + eps);
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                float g = gb[i], p = pb[i];
                if (maximize) g = g * -1.0f;
                if (decay) { if (adamw) p = p * f0; else g = g + p * f0; }
                float a = fmaf(coeff, g - mm[i], small ? mm[i] : g);
                float b = vv[i] * b2 + c2 * g * g;
                mm[i] = a;
                vv[i] = b;
                pb[i] = p + nstep * a / (sqrtf(b) / bc2 + eps);
            }
        }
        if (kind == 0) {
            memcpy(master + s, pb, len * sizeof(float));
            if (hi) for (int64_t i = 0; i < len; i++) hi[s + i] = rne16(pu[i]);
        } else if (kind == 1) {
            uint16_t *h = hi + s, *l = lo + s;
            uint32_t found = 0;
            for (int64_t i = 0; i < len; i++) {
                uint32_t w = pu[i];
                uint32_t nan = (w & 0x7FFFFFFFu) > 0x7F800000u;
                h[i] = rne16(w);
                l[i] = (uint16_t)(nan ? 0u : (w & 0xFFFFu));
                found |= ((w & 0x1FFFFu) == 0x18000u) & !nan;
            }
            if (found)
                for (int64_t i = 0; i < len; i++) {
                    uint32_t w = pu[i];
                    if (((w & 0x1FFFFu) == 0x18000u) && !((w & 0x7FFFFFFFu) > 0x7F800000u)) ties[k++] = base + s + i;
                }
        } else {
            for (int64_t i = 0; i < len; i++) hi[s + i] = rne16(pu[i]);
        }
    }
    *count = k;
    return n;
}

/* 1 when no element of x (FP32, or bf16 if `half`) is an infinity or a NaN: its exponent bits not all ones. */
int64_t all_finite(const void *x, int64_t n, int64_t half) {
    uint32_t bad = 0;
    if (half) {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t i = 0; i < n; i++) bad |= (h[i] & 0x7F80u) == 0x7F80u;
    } else {
        const uint32_t *u = (const uint32_t *)x;
        for (int64_t i = 0; i < n; i++) bad |= (u[i] & 0x7F800000u) == 0x7F800000u;
    }
    return !bad;
}
