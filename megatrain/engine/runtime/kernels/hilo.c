/* hilo: compiled on first use by megatrain/engine/runtime/ckernel.py (LazyKernel); see engine/host/hilo.py. */
#define BLOCK 4096

/* Returns the index where it stopped: n, or the start of a block whose ties did not fit in `ties`. */
int64_t hilo_split(const uint32_t *u, uint16_t *hi, uint16_t *lo, int64_t n, int64_t base,
                         int64_t *ties, int64_t cap, int64_t *count, uint32_t *poison, uint32_t nan_bits) {
    int64_t k = *count;
    for (int64_t s = 0; s < n; s += BLOCK) {
        int64_t e = s + BLOCK < n ? s + BLOCK : n;
        uint32_t found = 0;
        for (int64_t i = s; i < e; i++) {
            uint32_t w = u[i];
            uint32_t nan = (w & 0x7FFFFFFFu) > 0x7F800000u;
            uint32_t rne = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
            hi[i] = (uint16_t)(nan ? 0x7FC0u : rne);
            lo[i] = (uint16_t)(nan ? 0u : (w & 0xFFFFu));
            found |= ((w & 0x1FFFFu) == 0x18000u) & !nan;
        }
        if (found) {
            int64_t m = 0;
            for (int64_t i = s; i < e; i++) {
                uint32_t w = u[i];
                m += ((w & 0x1FFFFu) == 0x18000u) && !((w & 0x7FFFFFFFu) > 0x7F800000u);
            }
            if (k + m > cap) { *count = k; return s; }
            for (int64_t i = s; i < e; i++) {
                uint32_t w = u[i];
                if (((w & 0x1FFFFu) == 0x18000u) && !((w & 0x7FFFFFFFu) > 0x7F800000u)) ties[k++] = base + i;
            }
        }
        if (poison) for (int64_t i = s; i < e; i++) poison[i] = nan_bits;
    }
    *count = k;
    return n;
}

void hilo_join(const uint16_t *hi, const uint16_t *lo, uint32_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t l = lo[i];
        out[i] = (((uint32_t)hi[i] - (l > 0x8000u)) << 16) | l;
    }
}
