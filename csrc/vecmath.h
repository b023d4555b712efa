// Per-element float helpers shared by the extension's vectorised loops: bf16 <-> float32 bits and a vectorisable
// exp, both carrying NaN and inf through as torch does. Forced inline: the loops that call them are target clones
// (or carry an optimize pragma), and GCC does not inline a helper compiled for another target / other options into
// them otherwise; a call per element keeps a loop scalar.
#pragma once
#include <cstdint>
#include <cstring>
#include <limits>

#define SICL_INLINE __attribute__((always_inline)) inline

namespace sicl {

SICL_INLINE uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    // NaN -> torch's quiet NaN 0x7FC0 (rounding would carry some NaNs' payloads into +-0 or inf); an integer
    // test, so that it holds in code compiled with finite-math options too
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even (inf stays inf)
    return nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(u >> 16);
}

SICL_INLINE float from_bf16(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// exp(x) to about 1 ulp on [-87, 88]; exp(-87) below (~1e-38, not 0); +inf past float32's range (as std::exp, so
// that -inf / exp(+inf) is NaN in SiLU as in torch). NaN gives NaN: it fails both comparisons of the clamp, which
// keeps it (x86's max / min return their second operand on NaN, and the compiler must order them so) and the
// polynomial carries it. Callers must not be compiled with -ffinite-math-only, which lets the clamp drop it.
SICL_INLINE float exp_f32(float x0) {
    float x = x0 < -87.0f ? -87.0f : x0;
    x = x > 88.0f ? 88.0f : x;
    // n = round(x / ln 2) by the 1.5 * 2^23 trick (exact for |n| < 2^22; vectorises, unlike floor / nearbyint)
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  // ln 2 = hi + lo
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
    float scale;
    std::memcpy(&scale, &bits, 4);
    return x0 > 88.72284f ? std::numeric_limits<float>::infinity() : p * scale;  // ln(FLT_MAX) = 88.7228...
}

// soft-capping, cap tanh(x / cap), written as cap (1 - 2 / (exp(2 x / cap) + 1)) (exp_f32 vectorises; tanh not)
SICL_INLINE float softcap_f32(float x, float cap) { return cap * (1.0f - 2.0f / (exp_f32(2.0f / cap * x) + 1.0f)); }

}  // namespace sicl
