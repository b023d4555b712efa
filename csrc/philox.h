// Counter-based N(0, 1) noise, bit-identical to step.rng (torch) and sicl_fast.kernels.randn (Triton).
//
// Philox4x32-10 on the counter (c, 0, 0, 0) with key (seed, step); the first two words become uniforms as
// Triton's uint_to_uniform_float does; Box-Muller with the fixed float32 op sequence documented in
// step/rng.py (own log / cos polynomials). Every float operation below is a single correctly rounded
// IEEE float32 + - * / or sqrt; the pragmas below turn FMA contraction off,
// so the compiler cannot fuse a multiply and an add into one rounding.
#pragma once

// No FMA contraction in anything defined after this point (the bit-identity across paths depends on it).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sicl {

// float32 constants, bit-exact (hex literals), shared with step/rng.py's F32 table.
constexpr float kUniformScale = 0x1.fffffep-32f;
constexpr float kU1Min = 0x1.ad7f2ap-24f;
constexpr float kLn2Hi = 0x1.62ep-1f;
constexpr float kLn2Lo = 0x1.0bfbe8p-15f;
constexpr float kL3 = 0x1.555556p-2f;
constexpr float kL5 = 0x1.99999ap-3f;
constexpr float kL7 = 0x1.24924ap-3f;
constexpr float kL9 = 0x1.c71c72p-4f;
constexpr float kL11 = 0x1.745d18p-4f;
constexpr float kTwoPi = 0x1.921fb6p+2f;
constexpr float kC2 = -0x1p-1f;
constexpr float kC4 = 0x1.555556p-5f;
constexpr float kC6 = -0x1.6c16c2p-10f;
constexpr float kC8 = 0x1.a01a02p-16f;
constexpr float kC10 = -0x1.27e4fcp-22f;
constexpr float kS3 = -0x1.555556p-3f;
constexpr float kS5 = 0x1.111112p-7f;
constexpr float kS7 = -0x1.a01a02p-13f;
constexpr float kS9 = 0x1.71de3ap-19f;
constexpr int32_t kLogMLowBits = 0x3F3504F3;
constexpr int32_t kLogShift = 0x3F800000 - 0x3F3504F3;

// The first two output words of Philox4x32-10 for counter (c0, 0, 0, 0) and key (k0, k1).
inline void philox2(uint32_t c0, uint32_t k0, uint32_t k1, uint32_t& o0, uint32_t& o1) {
    uint32_t c1 = 0, c2 = 0, c3 = 0;
    for (int r = 0; r < 10; ++r) {
        const uint64_t pb = static_cast<uint64_t>(0xCD9E8D57u) * c2;
        const uint64_t pa = static_cast<uint64_t>(0xD2511F53u) * c0;
        const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(pb);
        c3 = static_cast<uint32_t>(pa);
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    o0 = c0;
    o1 = c1;
}

inline float uniform_f32(uint32_t bits) {
    int32_t x;
    std::memcpy(&x, &bits, 4);
    if (x < 0) x = ~x;  // -x - 1 without the overflow at INT32_MIN
    return static_cast<float>(x) * kUniformScale;
}

inline float log_f32(float u) {
    int32_t ix;
    std::memcpy(&ix, &u, 4);
    ix += kLogShift;
    const float e = static_cast<float>((ix >> 23) - 127);
    const int32_t mbits = (ix & 0x7FFFFF) + kLogMLowBits;
    float m;
    std::memcpy(&m, &mbits, 4);
    const float fm = m - 1.0f;
    const float s = fm / (fm + 2.0f);
    const float z = s * s;
    float q = z * kL11 + kL9;
    q = q * z + kL7;
    q = q * z + kL5;
    q = q * z + kL3;
    const float t = s * 2.0f;
    const float log_m = t + t * (z * q);
    return e * kLn2Hi + (e * kLn2Lo + log_m);
}

inline float cos_2pi_f32(float u) {
    float t = u >= 0.5f ? 1.0f - u : u;
    const bool neg = t > 0.25f;
    t = neg ? 0.5f - t : t;
    const bool use_sin = t > 0.125f;
    const float v = use_sin ? 0.25f - t : t;
    const float x = v * kTwoPi;
    const float x2 = x * x;
    float r;
    if (use_sin) {
        float s = x2 * kS9 + kS7;
        s = s * x2 + kS5;
        s = s * x2 + kS3;
        r = x + x * (x2 * s);
    } else {
        float c = x2 * kC10 + kC8;
        c = c * x2 + kC6;
        c = c * x2 + kC4;
        c = c * x2 + kC2;
        r = c * x2 + 1.0f;
    }
    return neg ? -r : r;
}

// N(0, 1) for one int32 counter under the 64-bit key seed64 = seed + step * 2**32.
inline float randn_f32(uint64_t seed64, uint32_t counter) {
    uint32_t i1, i2;
    philox2(counter, static_cast<uint32_t>(seed64 & 0xFFFFFFFFu), static_cast<uint32_t>(seed64 >> 32), i1, i2);
    float u1 = uniform_f32(i1);
    const float u2 = uniform_f32(i2);
    if (u1 < kU1Min) u1 = kU1Min;
    const float r = std::sqrt(log_f32(u1) * -2.0f);
    return r * cos_2pi_f32(u2);
}

}  // namespace sicl
