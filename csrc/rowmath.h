// Float32 row helpers shared by the decoder's plain ops (decoder.cpp: residual_norm, rope_qkv) and the difference
// form's row ops (rows.cpp: norm_rows, rope_rows). Defined once, in decoder.cpp (target clones: compiled for
// AVX-512, AVX2 and plain x86-64, picked at load time); the reference's operations one by one (-ffp-contract=off),
// the sum of squares in 16 partial sums (another order than torch's: a few ulp).
//
//   sum_squares(z, n) = sum_j z[j]^2
//   scale_row(z, r, w, o, n):  o[j] = (z[j] * r) * w[j]         (o may be z)
//   mul_row(z, m, o, n):       o[j] = z[j] * m                  (o may be z)
//   add_row(x, y, o, n):       o[j] = x[j] + y[j]
//   rope_head(z, c, s, o, hd, rot): the first rot elements of a head rotated, o[:rot] = z c + rotate_half(z) s
//                              with rotate_half(z) = (-z[h:rot], z[:h]), h = rot / 2 (c, s: rot wide); the other
//                              hd - rot elements copied (partial rotary: Phi-3; rot == hd: the whole head) (o may be z)
//   inv_rms(z, n, eps) = 1 / sqrt(mean(z^2) + eps): rms_norm(z, w) = scale_row(z, inv_rms(z, n, eps), w)
#pragma once
#include <cmath>
#include <cstdint>

namespace sicl {

float sum_squares(const float* z, int64_t n);
void scale_row(const float* z, float r, const float* w, float* o, int64_t n);
void mul_row(const float* z, float m, float* o, int64_t n);
void add_row(const float* x, const float* y, float* o, int64_t n);
void rope_head(const float* z, const float* c, const float* s, float* o, int64_t hd, int64_t rot);

constexpr int64_t kMaxHeadDim = 512;  // rope_head's local copy of a head

inline float inv_rms(const float* z, int64_t n, float eps) {
    return 1.0f / std::sqrt(sum_squares(z, n) / static_cast<float>(n) + eps);
}

}  // namespace sicl
