// sicl_fast.ops._C: the ascent's hot CPU ops on float32 numpy buffers (torch tensors pass theirs with .numpy()),
// multithreaded with OpenMP. Python wrappers and shape checks live in sicl_fast/ops/cpp_ops.py; the math is the
// torch reference's (step/proxy.py, step/zo.py) and the noise is
// step/rng.py's, bit for bit.
//
//   randn(out[n], seed64)                                     out[k] = N(0,1) for counter k
//   perturb(X[L,d], out[B,n,d], seed, step[1], N, a, b, mu, central)  the perturbation batch (layout of zo.py)
//   update(X, X0, f[B], out[L,d], seed, step[1], N, a, b, mu, eta, kappa, central, normalize, clip_norm, demos_scope)
// The step is an int64 array of one element (read here, so a loop keeps its counter in a tensor); the Philox
// key is (seed, step), i.e. the 64-bit seed seed + step * 2**32.
//       -> bool fired                                          one ascent step, U regenerated, never stored
//   proxy(lp[B,P], offsets[T+1], alpha, beta, gamma, q, f[B], C[B], R[B], G[B], c[B,T])
//
// Outputs are written in place and must be C-contiguous, writable, of the right dtype (checked here too).
// Every reduction runs in a fixed order (per-row partials, then summed row by row), so results do not depend
// on the number of threads.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.h"
#include "threads.h"
#include "vecmath512.h"
#include "philox.h"  // after pybind11: its no-FMA pragma applies to everything below

namespace py = pybind11;

namespace {

using sicl::cf;
using sicl::check_array;
using sicl::mf;

void randn(py::array out, uint64_t seed64) {
    check_array(out, "out", 'f', {-1}, true);
    const int64_t n = out.shape(0);
    if (n > (int64_t(1) << 31)) throw std::invalid_argument("randn: more than 2**31 counters");
    float* o = mf(out);
    const int nt = sicl::threads_for(n * sicl::kRandnCost);
    py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t k = 0; k < n; ++k) o[k] = sicl::randn_f32(seed64, static_cast<uint32_t>(k));
}

void check_block(int64_t N, int64_t a, int64_t b, int64_t L, int64_t d) {
    if (N < 1) throw std::invalid_argument("N must be >= 1");
    if (!(0 <= a && a < b && b <= L)) {
        throw std::invalid_argument("perturbed rows [a, b) = [" + std::to_string(a) + ", " + std::to_string(b) +
                                    ") must satisfy 0 <= a < b <= L = " + std::to_string(L));
    }
    if (N * (b - a) * d > (int64_t(1) << 31)) throw std::invalid_argument("N * (b - a) * d exceeds 2**31 counters");
}

uint64_t step_key(uint64_t seed, const py::array& step) {
    check_array(step, "step", 'i', {1}, false);
    const int64_t s = *static_cast<const int64_t*>(step.data());
    if (s < 0 || s >= (int64_t(1) << 32)) throw std::invalid_argument("step must be in [0, 2**32)");
    return seed + (static_cast<uint64_t>(s) << 32);
}

void perturb(py::array X, py::array out, uint64_t seed, py::array step, int64_t N, int64_t a, int64_t b, float mu,
             bool central) {
    const uint64_t seed64 = step_key(seed, step);
    check_array(X, "X", 'f', {-1, -1}, false);
    const int64_t L = X.shape(0), d = X.shape(1);
    check_block(N, a, b, L, d);
    const int64_t B = central ? 2 * N + 1 : N + 1;
    check_array(out, "out", 'f', {B, -1, d}, true);
    const int64_t n = out.shape(1);
    if (n < b || n > L) throw std::invalid_argument("out must have between b and L rows");
    const float* x = cf(X);
    float* o = mf(out);
    const int64_t R = b - a;
    const int nt = sicl::threads_for(B * n * d + N * R * d * sicl::kRandnCost);
    py::gil_scoped_release release;
#pragma omp parallel num_threads(nt)
    {
        // plain copies: batch row 0, and the rows outside [a, b) of every batch row
#pragma omp for schedule(static) collapse(2)
        for (int64_t j = 0; j < B; ++j) {
            for (int64_t r = 0; r < n; ++r) {
                if (j == 0 || r < a || r >= b) std::copy(x + r * d, x + (r + 1) * d, o + (j * n + r) * d);
            }
        }
        std::vector<float> u(d);
#pragma omp for schedule(static) collapse(2)
        for (int64_t i = 0; i < N; ++i) {
            for (int64_t r = 0; r < R; ++r) {
                const uint32_t base = static_cast<uint32_t>((i * R + r) * d);
                for (int64_t c = 0; c < d; ++c) u[c] = mu * sicl::randn_f32(seed64, base + static_cast<uint32_t>(c));
                const float* xr = x + (a + r) * d;
                if (!central) {
                    float* p = o + ((1 + i) * n + a + r) * d;
                    for (int64_t c = 0; c < d; ++c) p[c] = xr[c] + u[c];
                } else {
                    float* p = o + ((1 + 2 * i) * n + a + r) * d;
                    float* m = o + ((2 + 2 * i) * n + a + r) * d;
                    for (int64_t c = 0; c < d; ++c) {
                        p[c] = xr[c] + u[c];
                        m[c] = xr[c] - u[c];
                    }
                }
            }
        }
    }
}

bool update(py::array X, py::array X0, py::array f, py::array out, uint64_t seed, py::array step, int64_t N,
            int64_t a, int64_t b, float mu, float eta, double kappa, bool central, bool normalize, float clip_norm,
            bool demos_scope) {
    const uint64_t seed64 = step_key(seed, step);
    check_array(X, "X", 'f', {-1, -1}, false);
    const int64_t L = X.shape(0), d = X.shape(1);
    check_block(N, a, b, L, d);
    check_array(X0, "X0", 'f', {L, d}, false);
    const int64_t B = central ? 2 * N + 1 : N + 1;
    check_array(f, "f", 'f', {B}, false);
    check_array(out, "out", 'f', {L, d}, true);
    const float* x = cf(X);
    const float* x0 = cf(X0);
    const float* fv = cf(f);
    float* o = mf(out);
    const int64_t R = b - a;
    const float eps = 1e-8f;
    const float nf = static_cast<float>(N);
    std::vector<float> w(N);
    for (int64_t i = 0; i < N; ++i) {
        w[i] = central ? (fv[1 + 2 * i] - fv[2 + 2 * i]) / (2.0f * mu) : (fv[1 + i] - fv[0]) / mu;
    }
    const bool project = kappa > 0;
    const int64_t lo = demos_scope ? a : 0, hi = demos_scope ? b : L;
    std::vector<double> pdot(L, 0.0), pxx(L, 0.0), px0(L, 0.0);
    bool fired = false;
    const int nt = sicl::threads_for(L * d + N * R * d * sicl::kRandnCost);
    {
        py::gil_scoped_release release;
#pragma omp parallel num_threads(nt)
        {
            std::vector<float> g(d);
#pragma omp for schedule(static)
            for (int64_t row = 0; row < L; ++row) {
                const float* xr = x + row * d;
                float* orow = o + row * d;
                if (row >= a && row < b) {
                    const int64_t r = row - a;
                    std::fill(g.begin(), g.end(), 0.0f);
                    for (int64_t i = 0; i < N; ++i) {
                        const uint32_t base = static_cast<uint32_t>((i * R + r) * d);
                        const float wi = w[i];
                        for (int64_t c = 0; c < d; ++c)
                            g[c] = g[c] + wi * sicl::randn_f32(seed64, base + static_cast<uint32_t>(c));
                    }
                    double ss = 0.0;
                    for (int64_t c = 0; c < d; ++c) {
                        g[c] = g[c] / nf;
                        ss += static_cast<double>(g[c]) * g[c];
                    }
                    const float norm = static_cast<float>(std::sqrt(ss));
                    if (normalize) {
                        const float den = norm + eps;
                        for (int64_t c = 0; c < d; ++c) orow[c] = xr[c] + eta * (g[c] / den);
                    } else {
                        float scale = clip_norm / (norm + eps);
                        if (scale > 1.0f) scale = 1.0f;
                        for (int64_t c = 0; c < d; ++c) orow[c] = xr[c] + eta * (g[c] * scale);
                    }
                } else {
                    std::copy(xr, xr + d, orow);
                }
                if (project && row >= lo && row < hi) {
                    const float* x0r = x0 + row * d;
                    double sd = 0.0, sx = 0.0, s0 = 0.0;
                    for (int64_t c = 0; c < d; ++c) {
                        const double v = orow[c], v0 = x0r[c];
                        sd += v * v0;
                        sx += v * v;
                        s0 += v0 * v0;
                    }
                    pdot[row] = sd;
                    pxx[row] = sx;
                    px0[row] = s0;
                }
            }
        }
        if (project) {
            double dot = 0.0, xx = 0.0, x0x0 = 0.0;
            for (int64_t row = lo; row < hi; ++row) {
                dot += pdot[row];
                xx += pxx[row];
                x0x0 += px0[row];
            }
            const double nx = std::sqrt(xx), n0 = std::sqrt(x0x0);
            const double cosv = dot / (nx * n0);
            if (cosv < kappa) {
                // X' = |X| (kappa x0_hat + sqrt(1 - kappa^2) perp / |perp|), perp = X - (X . x0_hat) x0_hat
                fired = true;
                const double p = dot / n0;
                const double pn = std::sqrt(std::max(xx - p * p, 0.0));
                const bool axis = pn <= 1e-12;
                const double sk = std::sqrt(1.0 - kappa * kappa);
#pragma omp parallel for schedule(static) num_threads(sicl::threads_for((hi - lo) * d))
                for (int64_t row = lo; row < hi; ++row) {
                    float* orow = o + row * d;
                    const float* x0r = x0 + row * d;
                    for (int64_t c = 0; c < d; ++c) {
                        const double h = x0r[c] / n0;
                        double v;
                        if (axis) {
                            v = nx * h;
                        } else {
                            const double perp = orow[c] - p * h;
                            v = nx * (kappa * h + sk * perp / pn);
                        }
                        orow[c] = static_cast<float>(v);
                    }
                }
            }
        }
    }
    return fired;
}

void proxy(py::array lp, py::array offsets, double alpha, double beta, double gamma, double q, py::array f_out,
           py::array C_out, py::array R_out, py::array G_out, py::array c_out) {
    check_array(lp, "logprobs", 'f', {-1, -1}, false);
    const int64_t B = lp.shape(0), P = lp.shape(1);
    check_array(offsets, "offsets", 'i', {-1}, false);
    const int64_t T = offsets.shape(0) - 1;
    if (T < 1 || P < 1) throw std::invalid_argument("proxy: need P >= 1 and T >= 1");
    const int64_t* off = static_cast<const int64_t*>(offsets.data());
    if (off[0] != 0 || off[T] != P) throw std::invalid_argument("proxy: offsets must run from 0 to P");
    for (int64_t t = 0; t < T; ++t) {
        if (off[t + 1] <= off[t]) throw std::invalid_argument("proxy: every span needs >= 1 token");
    }
    check_array(f_out, "f", 'f', {B}, true);
    check_array(C_out, "C", 'f', {B}, true);
    check_array(R_out, "R", 'f', {B}, true);
    check_array(G_out, "G", 'f', {B}, true);
    check_array(c_out, "c", 'f', {B, T}, true);
    const float* l = cf(lp);
    float *fo = mf(f_out), *Co = mf(C_out), *Ro = mf(R_out), *Go = mf(G_out), *co = mf(c_out);
    const float af = static_cast<float>(alpha), bf = static_cast<float>(beta), gf = static_cast<float>(gamma);
    // torch.quantile: rank = q * (P - 1) in the input dtype, linear interpolation as torch.lerp
    const float rank = static_cast<float>(q) * static_cast<float>(P - 1);
    const int64_t below = static_cast<int64_t>(rank);
    const int64_t above = static_cast<int64_t>(std::ceil(rank));
    const float wq = rank - static_cast<float>(below);
    const int nt = sicl::threads_for(B * P * 4);  // exp, a partial sort and the sums per log-prob
    py::gil_scoped_release release;
#pragma omp parallel num_threads(nt)
    {
        std::vector<float> p(P);
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < B; ++bi) {
            const float* row = l + bi * P;
            float* crow = co + bi * T;
            float Csum = 0.0f, Gsum = 0.0f;
            for (int64_t t = 0; t < T; ++t) {
                float s = 0.0f;
                for (int64_t k = off[t]; k < off[t + 1]; ++k) s += row[k];
                const float ct = std::exp(s / static_cast<float>(off[t + 1] - off[t]));
                crow[t] = ct;
                Csum += ct;
                if (t > 0) Gsum += std::max(ct - crow[t - 1], 0.0f);
            }
            const float Cv = Csum / static_cast<float>(T);
            const float Gv = T >= 2 ? Gsum / static_cast<float>(T - 1) : 0.0f;
            for (int64_t k = 0; k < P; ++k) p[k] = std::exp(row[k]);
            std::nth_element(p.begin(), p.begin() + below, p.end());
            const float vlo = p[below];
            const float vhi = above == below ? vlo : *std::min_element(p.begin() + below + 1, p.end());
            const float Rv = wq < 0.5f ? vlo + wq * (vhi - vlo) : vhi - (vhi - vlo) * (1.0f - wq);
            Co[bi] = Cv;
            Ro[bi] = Rv;
            Go[bi] = Gv;
            fo[bi] = af * Cv + bf * Rv + gf * Gv;
        }
    }
}

int num_threads() { return sicl::max_threads(); }

void set_num_threads(int n) {
    if (n < 1) throw std::invalid_argument("set_num_threads: n must be >= 1, got " + std::to_string(n));
    sicl::set_threads(n);
}

}  // namespace

namespace sicl {
void register_rows_ops(py::module_& m);        // rows.cpp
void register_decoder_ops(py::module_& m);     // decoder.cpp
void register_attention_ops(py::module_& m);   // attention.cpp
void register_span_head_ops(py::module_& m);   // span_head.cpp
void register_step_state_ops(py::module_& m);  // step_state.cpp
}

PYBIND11_MODULE(_C, m) {
    m.doc() = "sicl_fast C++ ops (float32, OpenMP): randn, perturb, update, proxy, bookkeep (sicl_fast.ops.cpp_ops); "
              "norm_rows, rope_rows, gated_rows (sicl_fast.models.rows); residual_norm, rope_qkv "
              "(sicl_fast.models.elementwise); attention, attention_rows (sicl_fast.models.attention); lse_chunk, "
              "lse_chunk_rows (the span heads, sicl_fast.ops.cpp_ops).";
    m.def("randn", &randn, py::arg("out"), py::arg("seed64"), "out[k] = N(0, 1) of Philox counter k under seed64");
    m.def("perturb", &perturb, py::arg("X"), py::arg("out"), py::arg("seed"), py::arg("step"), py::arg("N"),
          py::arg("a"), py::arg("b"), py::arg("mu"), py::arg("central"),
          "the perturbation batch, written into out [B, n, d]");
    m.def("update", &update, py::arg("X"), py::arg("X0"), py::arg("f"), py::arg("out"), py::arg("seed"),
          py::arg("step"), py::arg("N"), py::arg("a"), py::arg("b"), py::arg("mu"), py::arg("eta"), py::arg("kappa"),
          py::arg("central"), py::arg("normalize"), py::arg("clip_norm"), py::arg("demos_scope"),
          "one ascent step written into out [L, d]; returns whether the cosine projection fired");
    m.def("proxy", &proxy, py::arg("logprobs"), py::arg("offsets"), py::arg("alpha"), py::arg("beta"),
          py::arg("gamma"), py::arg("q"), py::arg("f"), py::arg("C"), py::arg("R"), py::arg("G"), py::arg("c"),
          "the ICL proxy, written into f, C, R, G [B] and c [B, T]");
    m.def("num_threads", &num_threads, "threads the ops use at most (csrc/threads.h)");
    m.def("set_plain_forms", [](bool on) { sicl::g_plain_forms.store(on); }, py::arg("on"),
          "the plain loops instead of the AVX-512 forms (for tests of them on an AVX-512 CPU; results within a few "
          "ulp)");
    m.def("set_num_threads", &set_num_threads, py::arg("n"), "the ops' thread count, for every calling thread");
    m.attr("FMA_CONTRACTION") = py::bool_(false);
    sicl::register_rows_ops(m);
    sicl::register_decoder_ops(m);
    sicl::register_attention_ops(m);
    sicl::register_span_head_ops(m);
    sicl::register_step_state_ops(m);
}
