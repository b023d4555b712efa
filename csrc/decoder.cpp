// The fast decoder's elementwise work on float32 rows, one pass each (sicl_fast/models/elementwise.py holds the
// torch reference; the Python wrappers are sicl_fast/ops/cpp_ops.py's CppDecoderOps):
//
//   residual_norm(x[M,d], y[M,d], post_w[d], w[d], eps, has_y, has_post, x_out[M,d], h[M,d], y_scale, has_w)
//       y' = has_post ? rms_norm(y, post_w) : y, times y_scale (Granite's residual multiplier; 1: as it is);
//       x_out = x + y' (has_y; else x is not read twice, x_out unused)
//       h = rms_norm(x_out or x, w) (has_w; else h is not written: the next block takes x_out itself, OLMo 2);
//       rms_norm(z, w) = (z / sqrt(mean(z^2) + eps)) * w
//   rope_qkv(q[M,H*hd], k[M,Hk*hd], v[M,Hk*hd], cos[T,rot], sin[T,rot], k_out[M,Hk*hd], v_out[M,Hk*hd])
//       row m is position m % T; q is rotated in place, k rotated into k_out, v copied into v_out; the first rot
//       elements of each head rotated (rot = hd, or fewer with partial rotary), the rest copied:
//       rope(z)[j] = z[j] cos[j] + rotate_half(z)[j] sin[j], rotate_half(z) = (-z[h:rot], z[:h]), h = rot / 2
//
// q, k, v may be row-strided views (the three parts of one fused q / k / v product), and k_out / v_out too (a KV
// cache's rows): rows at any stride, each row's elements contiguous. The rotary products and sum are the
// reference's operations one by one (no FMA contraction: -ffp-contract=off), so rope_qkv is bit-identical to it;
// the norm's sum of squares runs in another order than torch's (a few ulp). The row helpers (sums of squares,
// scaling, rotary of a head) are defined here once and shared with the difference form's row ops (rowmath.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.h"
#include "rowmath.h"
#include "threads.h"

namespace sicl {

// ----------------------------------------------------------------------------------------- rowmath.h's helpers

__attribute__((target_clones("avx512f", "avx2", "default"))) float sum_squares(const float* z, int64_t n) {
    float acc[16] = {0};  // 16 partial sums: the loop vectorises without reassociation flags
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int u = 0; u < 16; ++u) acc[u] += z[j + u] * z[j + u];
    float s = 0.0f;
    for (int u = 0; u < 16; ++u) s += acc[u];
    for (; j < n; ++j) s += z[j] * z[j];
    return s;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void scale_row(const float* z, float r, const float* w,
                                                                          float* o, int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = (z[j] * r) * w[j];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void mul_row(const float* z, float m, float* o,
                                                                        int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = z[j] * m;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void add_row(const float* x, const float* y, float* o,
                                                                        int64_t n) {
    for (int64_t j = 0; j < n; ++j) o[j] = x[j] + y[j];
}

// one head: o = rope(z) over its first rot elements, the rest copied (o may be z: the rotated values go through a
// local copy)
__attribute__((target_clones("avx512f", "avx2", "default"))) void rope_head(const float* z, const float* c,
                                                                          const float* s, float* o, int64_t hd,
                                                                          int64_t rot) {
    float buf[kMaxHeadDim];
    const int64_t half = rot / 2;
    for (int64_t j = 0; j < half; ++j) buf[j] = z[j] * c[j] + (-z[j + half]) * s[j];
    for (int64_t j = half; j < rot; ++j) buf[j] = z[j] * c[j] + z[j - half] * s[j];
    for (int64_t j = rot; j < hd; ++j) buf[j] = z[j];
    std::memcpy(o, buf, sizeof(float) * hd);
}

namespace {

// rows [M, n] float32 whose elements are contiguous within a row; returns the row stride in elements
int64_t row_stride(const py::array& a, const char* name, int64_t M, int64_t n, bool writable) {
    if (!a.dtype().is(py::dtype::of<float>())) throw std::invalid_argument(std::string(name) + " must be float32");
    if (a.ndim() != 2 || a.shape(0) != M || a.shape(1) != n) {
        throw std::invalid_argument(std::string(name) + " must be [" + std::to_string(M) + ", " + std::to_string(n) +
                                    "]");
    }
    if (n > 1 && a.strides(1) != 4) {
        throw std::invalid_argument(std::string(name) + ": a row's elements must be contiguous");
    }
    if (a.strides(0) % 4 || a.strides(0) < 4 * n) throw std::invalid_argument(std::string(name) + ": bad row stride");
    if (writable && !a.writeable()) throw std::invalid_argument(std::string(name) + " must be writable");
    return a.strides(0) / 4;
}

void residual_norm(py::array x, py::array y, py::array post_w, py::array w, double eps, bool has_y, bool has_post,
                   py::array x_out, py::array h, double y_scale, bool has_w) {
    check_array(x, "x", 'f', {-1, -1}, false);
    const int64_t M = x.shape(0), d = x.shape(1);
    if (has_w) {
        check_array(w, "w", 'f', {d}, false);
        check_array(h, "h", 'f', {M, d}, true);
    }
    if (has_y) {
        check_array(y, "y", 'f', {M, d}, false);
        check_array(x_out, "x_out", 'f', {M, d}, true);
    }
    if (has_post) check_array(post_w, "post_w", 'f', {d}, false);
    const float* xp = cf(x);
    const float* yp = has_y ? cf(y) : nullptr;
    const float* pw = has_post ? cf(post_w) : nullptr;
    const float* wp = has_w ? cf(w) : nullptr;
    float* xo = has_y ? mf(x_out) : nullptr;
    float* hp = has_w ? mf(h) : nullptr;
    const float e = static_cast<float>(eps), ys = static_cast<float>(y_scale);
    const bool scaled = ys != 1.0f;
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads(threads_for(M * d * 4))
    {
        std::vector<float> tmp(has_post || scaled ? d : 0);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* z = xp + m * d;
            if (has_y) {
                const float* yr = yp + m * d;
                if (has_post) {
                    scale_row(yr, inv_rms(yr, d, e), pw, tmp.data(), d);
                    yr = tmp.data();
                }
                if (scaled) {
                    mul_row(yr, ys, tmp.data(), d);
                    yr = tmp.data();
                }
                add_row(z, yr, xo + m * d, d);
                z = xo + m * d;
            }
            if (has_w) scale_row(z, inv_rms(z, d, e), wp, hp + m * d, d);
        }
    }
}

void rope_qkv(py::array q, py::array k, py::array v, py::array cos, py::array sin, int64_t H, int64_t Hk,
              py::array k_out, py::array v_out) {
    check_array(cos, "cos", 'f', {-1, -1}, false);
    const int64_t T = cos.shape(0), rot = cos.shape(1);
    check_array(sin, "sin", 'f', {T, rot}, false);
    if (q.ndim() != 2 || H < 1 || q.shape(1) % H) throw std::invalid_argument("rope_qkv: q must be [M, H * hd]");
    const int64_t hd = q.shape(1) / H;
    if (rot % 2 || rot > hd || hd > kMaxHeadDim) {
        throw std::invalid_argument("rope_qkv: the rotary width must be even and at most head_dim, at most 512");
    }
    const int64_t M = q.shape(0);
    if (T < 1 || M % T) throw std::invalid_argument("rope_qkv: rows must be a multiple of the positions");
    const int64_t sq = row_stride(q, "q", M, H * hd, true), sk = row_stride(k, "k", M, Hk * hd, false),
                  sv = row_stride(v, "v", M, Hk * hd, false);
    const int64_t sko = row_stride(k_out, "k_out", M, Hk * hd, true),
                  svo = row_stride(v_out, "v_out", M, Hk * hd, true);
    float* qp = static_cast<float*>(q.mutable_data());
    const float* kp = static_cast<const float*>(k.data());
    const float* vp = static_cast<const float*>(v.data());
    const float *cp = cf(cos), *snp = cf(sin);
    float *ko = static_cast<float*>(k_out.mutable_data()), *vo = static_cast<float*>(v_out.mutable_data());
    py::gil_scoped_release nogil;
#pragma omp parallel for schedule(static) num_threads(threads_for(M * (H + 2 * Hk) * hd * 3))
    for (int64_t m = 0; m < M; ++m) {
        const float *c = cp + (m % T) * rot, *s = snp + (m % T) * rot;
        for (int64_t h = 0; h < H; ++h) rope_head(qp + m * sq + h * hd, c, s, qp + m * sq + h * hd, hd, rot);
        for (int64_t h = 0; h < Hk; ++h) rope_head(kp + m * sk + h * hd, c, s, ko + m * sko + h * hd, hd, rot);
        std::memcpy(vo + m * svo, vp + m * sv, sizeof(float) * Hk * hd);
    }
}

}  // namespace

void register_decoder_ops(py::module_& m) {
    m.def("residual_norm", &residual_norm, py::arg("x"), py::arg("y"), py::arg("post_w"), py::arg("w"),
          py::arg("eps"), py::arg("has_y"), py::arg("has_post"), py::arg("x_out"), py::arg("h"),
          py::arg("y_scale") = 1.0, py::arg("has_w") = true,
          "x_out = x + y_scale (rms_norm(y, post_w) or y), h = rms_norm(x_out, w) (has_w); float32 rows [M, d]");
    m.def("rope_qkv", &rope_qkv, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
          py::arg("H"), py::arg("Hk"), py::arg("k_out"), py::arg("v_out"),
          "q rotated in place, k rotated into k_out, v copied into v_out; float32 rows, position = row % T");
}

}  // namespace sicl
