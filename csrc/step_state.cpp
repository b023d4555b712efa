// The static step's bookkeeping on the CPU in one call (step/step_state.py holds the torch reference,
// bookkeep_reference, and the state; the Python wrapper is sicl_fast/ops/cpp_ops.py's CppStepOps.bookkeep):
//
//   bookkeep(f[B] f32, fired[1] i32, X[L,d], X_next[L,d], best_X[L,d], best_f[1] f32, counters[3] i32, step[1],
//           steps_run[1], reason[1], low_snr[1], projections[1] i64, history[n] f32, anchor[1] f32, codes[6] i64,
//           tau, snr_threshold, min_delta, min_delta_rel, patience, max_steps, mu, central)
//
// after the update wrote X_next (its projection flag `fired`): the stopping rule of step/stop_rule.py
// (the gate, the best X with best_f and the counters: since best, best step, steps seen; patience, with min_delta
// or min_delta_rel > 0 counted from the anchor; the SNR skip and stop, max_steps), a non-finite proxy, the history
// entry, the counters, the stop reason and the step index, in place. codes: the stop reasons as the state stores them
// (RUNNING, GATE, PATIENCE, SNR, MAX_STEPS, NONFINITE of step.step_state).
//
// Bit-identical to the reference: comparisons, copies and counters, the comparisons with tau, the SNR threshold
// and the margin in float64 as its; the SNR's finite differences, mean and standard deviation as torch computes
// them on the CPU (the float32 sum in torch's order: torch_sum below; the standard deviation by Welford's method in
// float64). A few element operations: one thread.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "arrays.h"

namespace sicl {

namespace {

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// torch's multi_row_sum (aten/src/ATen/native/cpu/SumKernel.cpp): the sums of 4 columns over `size` rows, row i's
// column k the W floats at x + (4 i + k) W, accumulated in levels (a cascade past 16 rows)
template <int W>
void multi_row_sum(const float* x, int64_t size, float out[4][W]) {
    constexpr int levels = 4;
    const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels), step = int64_t(1) << power, mask = step - 1;
    float acc[levels][4][W] = {};
    auto add = [&](int64_t i) {
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l) acc[0][k][l] += x[(4 * i + k) * W + l];
    };
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i) add(i);
        for (int j = 1; j < levels; ++j) {
            for (int k = 0; k < 4; ++k) {
                for (int l = 0; l < W; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i) add(i);
    for (int j = 1; j < levels; ++j)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    std::memcpy(out, acc[0], sizeof(float) * 4 * W);
}

// torch's row_sum: n elements of W floats in 4 interleaved partial sums, the tail into the first, then added
template <int W>
void row_sum(const float* x, int64_t n, float out[W]) {
    float part[4][W];
    multi_row_sum<W>(x, n / 4, part);
    for (int64_t i = n / 4 * 4; i < n; ++i)
        for (int l = 0; l < W; ++l) part[0][l] += x[i * W + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < W; ++l) part[0][l] += part[k][l];
    std::memcpy(out, part[0], sizeof(float) * W);
}

// torch.sum of a contiguous float32 vector on the CPU (its cascade_sum): under 8 elements row_sum over scalars;
// else row_sum over 8-lane vectors, the tail elements, then the 8 lanes added to them; added to the zeroed output
float torch_sum(const float* x, int64_t n) {
    if (n < 8) {
        float r[1];
        row_sum<1>(x, n, r);
        return 0.0f + r[0];
    }
    float lanes[8];
    row_sum<8>(x, n / 8, lanes);
    float acc = 0.0f;
    for (int64_t k = n / 8 * 8; k < n; ++k) acc += x[k];
    for (int l = 0; l < 8; ++l) acc += lanes[l];
    return 0.0f + acc;
}

// |mean| / (std + 1e-12) of the finite differences d [N] (step.zo.finite_differences), as the reference's
// torch ops: the mean a float32 sum / N, the standard deviation (N - 1) by Welford in float64, rounded to float32
float snr_of(const float* f, int64_t B, double mu, bool central) {
    const int64_t N = central ? (B - 1) / 2 : B - 1;
    if (N < 2) return 0.0f;
    std::vector<float> d(N);
    const float div = static_cast<float>(central ? 2.0 * mu : mu);
    for (int64_t i = 0; i < N; ++i) d[i] = (central ? f[1 + 2 * i] - f[2 + 2 * i] : f[1 + i] - f[0]) / div;
    const float mean = torch_sum(d.data(), N) / static_cast<float>(N);
    double m = 0.0, m2 = 0.0;
    for (int64_t i = 0; i < N; ++i) {
        const double x = d[i], delta = x - m;
        m += delta / static_cast<double>(i + 1);
        m2 += delta * (x - m);
    }
    const float sd = static_cast<float>(std::sqrt(m2 / static_cast<double>(N - 1)));
    return std::fabs(mean) / (sd + 1e-12f);
}

template <class T>
T& one(py::array& a, const char* name, char kind) {
    check_array(a, name, kind, {1}, true);
    return *static_cast<T*>(a.mutable_data());
}

void bookkeep(py::array f, py::array fired, py::array X, py::array X_next, py::array best_X, py::array best_f,
             py::array counters, py::array step, py::array steps_run, py::array reason, py::array low_snr,
             py::array projections, py::array history, py::array anchor, py::array codes, double tau,
             double snr_threshold, double min_delta, double min_delta_rel, int64_t patience, int64_t max_steps,
             double mu, bool central) {
    check_array(f, "f", 'f', {-1}, false);
    check_array(fired, "fired", 'n', {1}, false);
    check_array(X, "X", 'f', {-1, -1}, true);
    const int64_t B = f.shape(0), n = X.size();
    if (B < 1) throw std::invalid_argument("bookkeep: f is empty");
    check_array(X_next, "X_next", 'f', {X.shape(0), X.shape(1)}, false);
    check_array(best_X, "best_X", 'f', {X.shape(0), X.shape(1)}, true);
    check_array(counters, "counters", 'n', {3}, true);
    check_array(history, "history", 'f', {-1}, true);
    check_array(codes, "codes", 'i', {6}, false);
    const int64_t* code = ci(codes);  // RUNNING, GATE, PATIENCE, SNR, MAX_STEPS, NONFINITE
    float &bf = one<float>(best_f, "best_f", 'f'), &anc = one<float>(anchor, "anchor", 'f');
    int64_t &s = one<int64_t>(step, "step", 'i'), &run = one<int64_t>(steps_run, "steps_run", 'i');
    int64_t &rs = one<int64_t>(reason, "reason", 'i'), &low_n = one<int64_t>(low_snr, "low_snr", 'i');
    int64_t& proj = one<int64_t>(projections, "projections", 'i');
    int32_t* cnt = static_cast<int32_t*>(counters.mutable_data());  // since best, best step, steps seen
    float* hist = mf(history);
    if (s < 0 || s >= history.shape(0)) throw std::out_of_range("bookkeep: the step is past the history");
    const float* fp = cf(f);
    const float f0 = fp[0], inf = std::numeric_limits<float>::infinity();
    const bool active = rs == code[0], finite = std::isfinite(f0), ok = active && finite;
    run += active;
    if (active) hist[s] = f0;
    const bool bad = active && !finite;
    const bool gate = ok && s == 0 && static_cast<double>(f0) < tau;
    // track_best with f0 as -inf unless ok; with a margin, patience counts from the anchor instead
    const float fb = ok ? f0 : -inf;
    const int32_t since = cnt[0];
    const bool better = fb > bf;
    if (better) {
        std::memcpy(mf(best_X), cf(X), sizeof(float) * n);
        bf = fb;
    }
    cnt[0] = better ? 0 : since + 1;
    cnt[1] = better ? cnt[2] : cnt[1];
    cnt[2] = cnt[2] + 1;
    if (min_delta > 0 || min_delta_rel > 0) {
        const bool first = anc == -inf;
        const double a = first ? 0.0 : static_cast<double>(anc);
        const double margin = std::max(min_delta_rel * std::fabs(a), min_delta);
        const bool counted = fb > anc && (first || static_cast<double>(fb) - a > margin);
        if (counted) anc = fb;
        cnt[0] = counted ? 0 : since + 1;
    }
    const bool stop_patience = patience > 0 && ok && !gate && cnt[0] >= patience;
    const bool go = ok && !gate && !stop_patience;
    bool low = false, snr_stop = false;
    if (snr_threshold > 0) {
        low = go && static_cast<double>(snr_of(fp, B, mu, central)) < snr_threshold;
        low_n = low ? low_n + 1 : go ? 0 : low_n;
        snr_stop = low && low_n >= std::max<int64_t>(patience, 1);
    }
    const bool last = go && !snr_stop && s == max_steps - 1;
    const bool update = go && !low && !last;
    if (update) std::memcpy(mf(X), cf(X_next), sizeof(float) * n);
    proj += update && *static_cast<const int32_t*>(fired.data()) != 0;
    const int64_t why = bad ? code[5] : gate ? code[1] : stop_patience ? code[2] : snr_stop ? code[3]
                      : last ? code[4] : code[0];  // at most one of them holds
    if (active) rs = why;
    if (active && why == code[0]) s += 1;
}

}  // namespace

void register_step_state_ops(py::module_& m) {
    m.def("bookkeep", &bookkeep, py::arg("f"), py::arg("fired"), py::arg("X"), py::arg("X_next"), py::arg("best_X"),
          py::arg("best_f"), py::arg("counters"), py::arg("step"), py::arg("steps_run"), py::arg("reason"),
          py::arg("low_snr"), py::arg("projections"), py::arg("history"), py::arg("anchor"), py::arg("codes"),
          py::arg("tau"), py::arg("snr_threshold"), py::arg("min_delta"), py::arg("min_delta_rel"),
          py::arg("patience"), py::arg("max_steps"), py::arg("mu"), py::arg("central"),
          "the static step's bookkeeping of one step, in place (step.step_state.bookkeep_reference)");
}

}  // namespace sicl
