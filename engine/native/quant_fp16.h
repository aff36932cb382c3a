/*
 * The fp16 fields of the GGUF blocks (Q8_0 / Q4_0 / Q4_1 scales, Q4_1 mins, the k-quants'
 * super-block scales), read and converted to fp32 without F16C: the portable row kernels
 * (quant_rows.h through quant_kernels.c) and the int8 route's panel fill (quant_int8.c)
 * unpack the same block headers. One header so the two cannot drift apart; built into the
 * kernel library's cache key (engine/native/build.py, _HEADERS).
 */
#ifndef PAGEDSERVE_QUANT_FP16_H
#define PAGEDSERVE_QUANT_FP16_H

#include <stdint.h>
#include <string.h>

/* The little-endian 16-bit field at p (blocks are byte-packed: p need not be aligned). */
static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float, exact for every input (subnormals, inf, NaN). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
