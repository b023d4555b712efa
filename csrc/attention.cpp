// Attention of the fast decoder on float32 rows, in one call per layer (sicl_fast/models/attention.py holds the
// torch references, attend_math and attention_rows_reference; the Python wrappers are sicl_fast/ops/cpp_ops.py's
// attention and attention_rows):
//
//   attention(q[B*T, H*hd], k[kB*N, Hk*hd], v[kB*N, Hk*hd], pk[a, Hk*hd], pv[a, Hk*hd], out[B*T, H*hd],
//             B, T, H, Hk, kB, pos0, k0, scale, softcap, window)
//   query row t of batch row b sits at position pos0 + t; the shared keys pk / pv (a shared prefix, every batch
//   row attends to them) at positions 0 .. a-1; the own keys of batch row b (k / v rows b*N .., or the only ones
//   when kB == 1) at k0 .. k0+N-1 (a <= k0). A query sees the keys at positions <= its own and, with a window,
//   > its position - window. Query head h reads key head h / (H / Hk).
//   s = (q . k) * scale, soft-capped (softcap > 0: cap tanh(s / cap)); o = sum_j exp(s_j - max) v_j / sum_j
//   exp(s_j - max); 0 where a query sees no key; NaN where a NaN (or a score of +inf) reaches the row, as torch's.
//   attention_rows(q[R, H*hd], k[R, Hk*hd], v[R, Hk*hd], pk[a, Hk*hd], pv[a, Hk*hd], anchor[B], lead, T, pos0, H,
//                  Hk, scale, softcap, window, out[R, H*hd] bf16, o_ref[V, H*hd] f32 | None)
//   a difference-form pass (rows.h): the lead rows attend causally among themselves, the batch rows to the prefix
//   (the lead rows' keys, or the kept pk / pv when lead is 0) and causally to their own keys; out: the rows in
//   difference form, the value rows against o_ref (the output projection's input reference; None: none). Both
//   query sets in one parallel region, then the epilogue after a barrier (its differences read their anchors'
//   float32 outputs).
//
// q, k, v may be row-strided views (the parts of one fused q / k / v product); out is contiguous. Each (batch row,
// key head)'s keys are transposed once per call; the work is then cut into tiles of a few query positions x the
// G query heads of one key head (12-24 rows), each over the keys its rows see (one pass: the tile's scores fit in
// cache). Where the CPU has AVX-512 and the head dim is a multiple of 16, the products, the transposition and the
// softmax run on its registers (the softmax too: in plain loops its exp and sum stayed scalar, a quarter of the
// call); plain loops elsewhere. Float32 throughout, with the scale folded into q and sums in another order than
// the reference (a few ulp); exp is vecmath.h's (about 1 ulp; on 16 lanes, the same polynomial).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <immintrin.h>

#include "arrays.h"
#include "rows.h"
#include "softmax_rows.h"
#include "threads.h"
#include "vecmath512.h"

namespace sicl {

namespace {

struct Rows {  // a row-strided float32 matrix: row i at p + i * stride, its elements contiguous
    const float* p;
    int64_t stride;
};

Rows rows_of(const py::array& a, const char* name, int64_t n) {
    if (!a.dtype().is(py::dtype::of<float>())) throw std::invalid_argument(std::string(name) + " must be float32");
    if (a.ndim() != 2 || a.shape(1) != n) {
        throw std::invalid_argument(std::string(name) + " must be [rows, " + std::to_string(n) + "]");
    }
    if (n > 1 && a.shape(0) > 0 && a.strides(1) != 4) {
        throw std::invalid_argument(std::string(name) + ": a row's elements must be contiguous");
    }
    if (a.shape(0) > 1 && (a.strides(0) % 4 || a.strides(0) < 4 * n)) {
        throw std::invalid_argument(std::string(name) + ": bad row stride");
    }
    return {static_cast<const float*>(a.data()), a.shape(0) > 1 ? a.strides(0) / 4 : n};
}

constexpr int64_t kRows = 4;   // query rows per register block
constexpr int64_t kCols = 32;  // keys per register block of the scores

// S[r][j] = sum_d Q[r][d] Kt[d][j] for r < R (a multiple of kRows), j < W (a multiple of 16)
__attribute__((target("avx512f"))) void scores_avx512(const float* Q, const float* Kt, int64_t ldk, float* S,
                                                     int64_t lds, int64_t R, int64_t W, int64_t hd) {
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
        int64_t j0 = 0;
        for (; j0 + kCols <= W; j0 += kCols) {
            __m512 acc[kRows][2];
            for (int64_t rr = 0; rr < kRows; ++rr) acc[rr][0] = acc[rr][1] = _mm512_setzero_ps();
            for (int64_t d = 0; d < hd; ++d) {
                const __m512 k0 = _mm512_loadu_ps(Kt + d * ldk + j0), k1 = _mm512_loadu_ps(Kt + d * ldk + j0 + 16);
                for (int64_t rr = 0; rr < kRows; ++rr) {
                    const __m512 q = _mm512_set1_ps(Q[(r0 + rr) * hd + d]);
                    acc[rr][0] = _mm512_fmadd_ps(q, k0, acc[rr][0]);
                    acc[rr][1] = _mm512_fmadd_ps(q, k1, acc[rr][1]);
                }
            }
            for (int64_t rr = 0; rr < kRows; ++rr) {
                _mm512_storeu_ps(S + (r0 + rr) * lds + j0, acc[rr][0]);
                _mm512_storeu_ps(S + (r0 + rr) * lds + j0 + 16, acc[rr][1]);
            }
        }
        if (j0 < W) {  // the last 16 keys
            __m512 acc[kRows];
            for (int64_t rr = 0; rr < kRows; ++rr) acc[rr] = _mm512_setzero_ps();
            for (int64_t d = 0; d < hd; ++d) {
                const __m512 k0 = _mm512_loadu_ps(Kt + d * ldk + j0);
                for (int64_t rr = 0; rr < kRows; ++rr)
                    acc[rr] = _mm512_fmadd_ps(_mm512_set1_ps(Q[(r0 + rr) * hd + d]), k0, acc[rr]);
            }
            for (int64_t rr = 0; rr < kRows; ++rr) _mm512_storeu_ps(S + (r0 + rr) * lds + j0, acc[rr]);
        }
    }
}

// kt[d * ldk + j] = src[j * lds + d] for j < n, d < hd: n keys (rows of stride lds) as columns of kt
void transpose_plain(const float* src, int64_t lds, int64_t n, int64_t hd, float* kt, int64_t ldk) {
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < hd; ++d) kt[d * ldk + j] = src[j * lds + d];
}

// transpose_plain with hd % 16 == 0: 16 x 16 blocks transposed in registers, the last n % 16 keys by the plain form
__attribute__((target("avx512f"))) void transpose_avx512(const float* src, int64_t lds, int64_t n, int64_t hd,
                                                        float* kt, int64_t ldk) {
    int64_t j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        for (int64_t d0 = 0; d0 < hd; d0 += 16) {
            __m512 r[16], t[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (j0 + i) * lds + d0);
            for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: pairs of rows' elements 4L, 4L+1 | 4L+2, 4L+3
                t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L: column 4L + c of rows i .. i+3
                r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
                r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
                r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
                r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
                const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0)),
                             v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1)),
                             w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0)),
                             w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
                _mm512_storeu_ps(kt + (d0 + c) * ldk + j0, _mm512_shuffle_f32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0)));
                _mm512_storeu_ps(kt + (d0 + 4 + c) * ldk + j0, _mm512_shuffle_f32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0)));
                _mm512_storeu_ps(kt + (d0 + 8 + c) * ldk + j0, _mm512_shuffle_f32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1)));
                _mm512_storeu_ps(kt + (d0 + 12 + c) * ldk + j0, _mm512_shuffle_f32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1)));
            }
        }
    }
    transpose_plain(src + j0 * lds, lds, n - j0, hd, kt + j0, ldk);
}

// dst[i] = src[i] * c for i < n
__attribute__((target_clones("avx512f", "avx2", "default"))) void scaled_copy(const float* src, float* dst,
                                                                            int64_t n, float c) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * c;
}

void scores_plain(const float* Q, const float* Kt, int64_t ldk, float* S, int64_t lds, int64_t R, int64_t W,
                  int64_t hd) {
    for (int64_t r = 0; r < R; ++r) {
        float* s = S + r * lds;
        for (int64_t j = 0; j < W; ++j) s[j] = 0.0f;
        for (int64_t d = 0; d < hd; ++d) {
            const float q = Q[r * hd + d];
            const float* kt = Kt + d * ldk;
            for (int64_t j = 0; j < W; ++j) s[j] += q * kt[j];
        }
    }
}

// O[r][:] += sum_j P[r][j] V[j][:] for r < R (a multiple of kRows), j < W; V row j at V + j * ldv; hd % 16 == 0
__attribute__((target("avx512f"))) void values_avx512(const float* P, int64_t ldp, const float* V, int64_t ldv,
                                                     float* O, int64_t R, int64_t W, int64_t hd) {
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
        for (int64_t d0 = 0; d0 < hd; d0 += 64) {
            const int64_t nv = std::min<int64_t>(4, (hd - d0) / 16);
            __m512 acc[kRows][4];
            for (int64_t rr = 0; rr < kRows; ++rr)
                for (int64_t u = 0; u < 4; ++u)
                    acc[rr][u] = u < nv ? _mm512_loadu_ps(O + (r0 + rr) * hd + d0 + 16 * u) : _mm512_setzero_ps();
            if (nv == 4) {
                for (int64_t j = 0; j < W; ++j) {
                    const float* vj = V + j * ldv + d0;
                    const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16),
                                 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
                    for (int64_t rr = 0; rr < kRows; ++rr) {
                        const __m512 p = _mm512_set1_ps(P[(r0 + rr) * ldp + j]);
                        acc[rr][0] = _mm512_fmadd_ps(p, v0, acc[rr][0]);
                        acc[rr][1] = _mm512_fmadd_ps(p, v1, acc[rr][1]);
                        acc[rr][2] = _mm512_fmadd_ps(p, v2, acc[rr][2]);
                        acc[rr][3] = _mm512_fmadd_ps(p, v3, acc[rr][3]);
                    }
                }
            } else {
                for (int64_t j = 0; j < W; ++j) {
                    const float* vj = V + j * ldv + d0;
                    for (int64_t rr = 0; rr < kRows; ++rr) {
                        const __m512 p = _mm512_set1_ps(P[(r0 + rr) * ldp + j]);
                        for (int64_t u = 0; u < nv; ++u)
                            acc[rr][u] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * u), acc[rr][u]);
                    }
                }
            }
            for (int64_t rr = 0; rr < kRows; ++rr)
                for (int64_t u = 0; u < nv; ++u) _mm512_storeu_ps(O + (r0 + rr) * hd + d0 + 16 * u, acc[rr][u]);
        }
    }
}

void values_plain(const float* P, int64_t ldp, const float* V, int64_t ldv, float* O, int64_t R, int64_t W,
                  int64_t hd) {
    for (int64_t r = 0; r < R; ++r) {
        float* o = O + r * hd;
        for (int64_t j = 0; j < W; ++j) {
            const float p = P[r * ldp + j];
            const float* vj = V + j * ldv;
            for (int64_t d = 0; d < hd; ++d) o[d] += p * vj[d];
        }
    }
}

// one row of (already scaled) scores s[0, W) -> unnormalised probabilities in place over the visible keys [lo, hi)
// (0 elsewhere); returns their sum (softmax_rows.h: NaN and +inf make it NaN), 0 where the query sees no key or
// only scores of -inf (as the reference: its row of 0 then; a NaN among them still makes the sum NaN)
float softmax_row(float* s, int64_t W, int64_t lo, int64_t hi, float cap, bool vec) {
    std::fill(s, s + lo, 0.0f);
    std::fill(s + std::max(lo, hi), s + W, 0.0f);
    if (hi <= lo) return 0.0f;
    float* t = s + lo;
    const int64_t n = hi - lo;
    const float m = vec ? capped_max_avx512(t, n, cap) : capped_max_plain(t, n, cap);
    if (m == -std::numeric_limits<float>::infinity() && std::none_of(t, t + n, [](float x) { return x != x; })) {
        std::fill(t, t + n, 0.0f);
        return 0.0f;
    }
    return vec ? exp_sum_avx512<true>(t, n, m) : exp_sum_plain<true>(t, n, m);
}

// What every query set of a call shares: the heads, the scale, the soft-cap and window, the tile shape.
struct Config {
    int64_t H, Hk, hd, G;
    float scale, cap;
    int64_t window;  // 0: none
    bool vec;        // AVX-512 and hd % 16 == 0
    int64_t QT, R;   // a tile: QT query positions x the G heads of one key head, R rows (padded to kRows)
};

Config make_config(int64_t H, int64_t Hk, int64_t hd, double scale, double softcap, int64_t window) {
    if (H < 1 || Hk < 1 || H % Hk || hd < 1) throw std::invalid_argument("attention: bad H, Hk or head dim");
    const int64_t G = H / Hk;
    // a tile: QT query positions x the G heads, 12-24 rows (1 position where G > 12), the QT with the fewest padding
    // rows per row (R, the rows computed, is a multiple of kRows): G 3: 4 positions, 12 rows; G 7: 2, 14 + 2 padding
    const auto padding = [G](int64_t qt) { return ((qt * G + kRows - 1) / kRows) * kRows - qt * G; };
    int64_t QT = 0;
    for (int64_t qt = std::max<int64_t>(1, (12 + G - 1) / G); qt <= std::max<int64_t>(1, 24 / G); ++qt)
        if (QT == 0 || padding(qt) * QT < padding(QT) * qt) QT = qt;
    return {H, Hk, hd, G, static_cast<float>(scale), static_cast<float>(softcap), window, has_avx512() && hd % 16 == 0,
            QT, QT * G + padding(QT)};
}

// One set of query rows and the keys they see: B batch rows of T queries at positions pos0 ..; each sees the shared
// keys PK / PV (positions 0 .. a-1) and its own keys K / V (rows b*N .., or the only ones when kB == 1) at k0 ..
// (a <= k0); out: its B*T rows of H*hd, contiguous.
struct Problem {
    Rows Q, K, V, PK, PV;
    int64_t B, T, kB, N, a, pos0, k0;
    float* out;
    // set by prepare(): keys in all, Kt's row length, tiles per (batch row, key head), every (key batch row, key
    // head)'s keys transposed, Kt[d][j] for key j (the shared ones first), zero-padded
    int64_t Ntot = 0, ldk = 0, tiles = 0;
    std::unique_ptr<float[]> Kt;

    void prepare(const Config& c) {
        if ((kB != 1 && kB != B) || a > k0) throw std::invalid_argument("attention: bad key batch or key positions");
        Ntot = a + N;
        ldk = ((Ntot + kCols - 1) / kCols) * kCols + kCols;
        tiles = (T + c.QT - 1) / c.QT;
        Kt.reset(new float[kB * c.Hk * c.hd * ldk]);  // its padding columns zeroed by transpose()
    }
    int64_t key_pos(int64_t i) const { return i < a ? i : k0 + (i - a); }
    // keys [lo, hi) a query at position p sees (positions increase with the index)
    void seen(int64_t p, int64_t window, int64_t& lo, int64_t& hi) const {
        int64_t x = 0, y = Ntot;  // hi: the first key after p
        while (x < y) {
            const int64_t mid = (x + y) / 2;
            if (key_pos(mid) <= p) x = mid + 1; else y = mid;
        }
        hi = x, lo = 0;
        if (window > 0) {
            x = 0, y = hi;
            while (x < y) {
                const int64_t mid = (x + y) / 2;
                if (key_pos(mid) <= p - window) x = mid + 1; else y = mid;
            }
            lo = x;
        }
    }
    int64_t work(const Config& c) const { return B * c.Hk * T * c.G * Ntot * c.hd * 2; }
};

struct Scratch {  // one thread's tile buffers
    std::vector<float> Qb, S, Ob, l;
    std::vector<int64_t> lo, hi;
    Scratch(const Config& c, int64_t ldk) : Qb(c.R * c.hd), S(c.R * ldk), Ob(c.R * c.hd), l(c.R), lo(c.R), hi(c.R) {}
};

// the keys of (key batch row, key head) bh transposed into P.Kt
void transpose_keys(const Config& c, Problem& P, int64_t bh) {
    const int64_t b = bh / c.Hk, kh = bh % c.Hk, hd = c.hd;
    float* kt = P.Kt.get() + bh * hd * P.ldk;
    auto transpose = c.vec ? transpose_avx512 : transpose_plain;
    transpose(P.PK.p + kh * hd, P.PK.stride, P.a, hd, kt, P.ldk);  // the shared keys, then the row's own
    transpose(P.K.p + b * P.N * P.K.stride + kh * hd, P.K.stride, P.N, hd, kt + P.a, P.ldk);
    for (int64_t d = 0; d < hd; ++d) std::fill(kt + d * P.ldk + P.Ntot, kt + (d + 1) * P.ldk, 0.0f);
}

// one tile of P: batch row b, key head kh, query positions t0 .. t0+QT-1 (task = (b * Hk + kh) * tiles + tile)
void attend_tile(const Config& c, const Problem& P, int64_t task, Scratch& w) {
    const int64_t hd = c.hd, G = c.G, R = c.R, ldk = P.ldk;
    const int64_t b = task / (c.Hk * P.tiles), kh = (task / P.tiles) % c.Hk, t0 = (task % P.tiles) * c.QT;
    const int64_t nt = std::min(c.QT, P.T - t0), rows = nt * G;
    int64_t klo = P.Ntot, khi = 0;
    for (int64_t r = 0; r < R; ++r) {
        if (r < rows) {
            P.seen(P.pos0 + t0 + r / G, c.window, w.lo[r], w.hi[r]);
            klo = std::min(klo, w.lo[r]), khi = std::max(khi, w.hi[r]);
            const float* src = P.Q.p + (b * P.T + t0 + r / G) * P.Q.stride + (kh * G + r % G) * hd;
            scaled_copy(src, w.Qb.data() + r * hd, hd, c.scale);  // the scale folded into q
        } else {
            w.lo[r] = w.hi[r] = 0;
            std::fill(w.Qb.data() + r * hd, w.Qb.data() + (r + 1) * hd, 0.0f);
        }
    }
    if (khi <= klo) klo = khi = 0;
    const int64_t W = khi - klo, Wp = ((W + 15) / 16) * 16;
    const float* Kt = P.Kt.get() + ((P.kB == 1 ? 0 : b) * c.Hk + kh) * hd * ldk + klo;  // the tile's keys
    float* S = w.S.data();
    if (c.vec) scores_avx512(w.Qb.data(), Kt, ldk, S, ldk, R, Wp, hd);
    else scores_plain(w.Qb.data(), Kt, ldk, S, ldk, R, Wp, hd);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t l0 = std::max<int64_t>(0, w.lo[r] - klo), h0 = std::max<int64_t>(l0, w.hi[r] - klo);
        w.l[r] = softmax_row(S + r * ldk, Wp, l0, r < rows ? h0 : l0, c.cap, c.vec);
    }
    // the values: the shared keys' rows, then the own keys' rows (two strided runs)
    const int64_t V_ld = P.V.stride;
    const float* vb = P.V.p + (P.kB == 1 ? 0 : b * P.N) * V_ld + kh * hd;
    std::fill(w.Ob.begin(), w.Ob.end(), 0.0f);
    auto values = [&](int64_t j0, int64_t j1, const float* V0, int64_t ldv) {  // keys klo+j0 .. klo+j1
        if (c.vec) values_avx512(S + j0, ldk, V0, ldv, w.Ob.data(), R, j1 - j0, hd);
        else values_plain(S + j0, ldk, V0, ldv, w.Ob.data(), R, j1 - j0, hd);
    };
    const int64_t split = std::clamp<int64_t>(P.a - klo, 0, W);  // tile keys [0, split) are shared ones
    if (split > 0) values(0, split, P.PV.p + klo * P.PV.stride + kh * hd, P.PV.stride);
    if (W > split) values(split, W, vb + (klo + split - P.a) * V_ld, V_ld);
    for (int64_t r = 0; r < rows; ++r) {
        float* dst = P.out + (b * P.T + t0 + r / G) * c.H * hd + (kh * G + r % G) * hd;
        // l is 0 only where the query sees no key (else >= 1, or NaN: a NaN or +inf score, kept as NaN)
        if (w.l[r] != 0.0f) scaled_copy(w.Ob.data() + r * hd, dst, hd, 1.0f / w.l[r]);
        else std::fill(dst, dst + hd, 0.0f);
    }
}

// The problems' attention in one parallel region: every key transposition, then every tile (dynamically
// scheduled), then, when `epilogue_rows` > 0, epilogue(r) for each r < epilogue_rows (after every tile is done).
template <class Epilogue>
void run_attention(const Config& c, std::vector<Problem*> problems, int64_t epilogue_rows, Epilogue epilogue) {
    int64_t work = 0, ldk = kCols, transposes = 0, tiles = 0;
    for (Problem* P : problems) {
        P->prepare(c);
        work += P->work(c);
        ldk = std::max(ldk, P->ldk);
        transposes += P->kB * c.Hk;
        tiles += P->B * c.Hk * P->tiles;
    }
    // index i of the problems' joint list of n(P) items each -> (problem, its own index)
    auto locate = [&](int64_t i, auto n) {
        for (Problem* P : problems) {
            if (i < n(*P)) return std::make_pair(P, i);
            i -= n(*P);
        }
        throw std::logic_error("attention: bad index");
    };
    auto n_transposes = [&](const Problem& P) { return P.kB * c.Hk; };
    auto n_tiles = [&](const Problem& P) { return P.B * c.Hk * P.tiles; };
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads(threads_for(work / 4))
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < transposes; ++i) {
            auto [P, bh] = locate(i, n_transposes);
            transpose_keys(c, *P, bh);
        }
        Scratch w(c, ldk);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tiles; ++i) {
            auto [P, task] = locate(i, n_tiles);
            attend_tile(c, *P, task, w);
        }
        if (epilogue_rows > 0) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < epilogue_rows; ++r) epilogue(r);
        }
    }
}

void attention(py::array q, py::array k, py::array v, py::array pk, py::array pv, py::array out, int64_t B,
               int64_t T, int64_t H, int64_t Hk, int64_t kB, int64_t pos0, int64_t k0, double scale,
               double softcap, int64_t window) {
    if (B < 1 || T < 1 || H < 1 || Hk < 1 || H % Hk) throw std::invalid_argument("attention: bad B, T, H or Hk");
    const int64_t Hd = q.ndim() == 2 ? q.shape(1) : 0, hd = Hd / H;
    if (hd < 1 || Hd != H * hd) throw std::invalid_argument("attention: q must be [B*T, H*hd]");
    const Config c = make_config(H, Hk, hd, scale, softcap, window);
    const Rows Qr = rows_of(q, "q", H * hd), Kr = rows_of(k, "k", Hk * hd), Vr = rows_of(v, "v", Hk * hd),
               PKr = rows_of(pk, "pk", Hk * hd), PVr = rows_of(pv, "pv", Hk * hd);
    if (q.shape(0) != B * T) throw std::invalid_argument("attention: q must have B*T rows");
    const int64_t a = pk.shape(0), kn = k.shape(0);
    if (pv.shape(0) != a || v.shape(0) != kn) throw std::invalid_argument("attention: k / v rows differ");
    if ((kB != 1 && kB != B) || kn % kB) throw std::invalid_argument("attention: kB must be 1 or B, dividing k's rows");
    if (a > 0 && a > k0) throw std::invalid_argument("attention: the shared keys must come before the own keys");
    check_array(out, "out", 'f', {B * T, H * hd}, true);
    Problem P{Qr, Kr, Vr, PKr, PVr, B, T, kB, kn / kB, a, pos0, k0, mf(out)};
    run_attention(c, {&P}, 0, [](int64_t) {});
}

// The attention of a difference-form pass (rows.h): q [R, H*hd], k, v [R, Hk*hd] float32 rows of the pass (lead
// rows, then B x T batch rows); pk, pv [a, Hk*hd] the kept prefix's keys (a = 0 with lead rows: the lead rows' own
// keys are the batch rows' prefix then) -> out [R, H*hd] bf16 in difference form. The lead rows attend causally
// among themselves (positions 0 ..); the batch rows to the prefix and causally to their own keys (pos0 ..). Both
// sets of queries in one parallel region, their float32 outputs into a scratch, then the rows minus their anchor
// rows (the value rows minus their rows of o_ref [V, H*hd], when given), rounded to bf16.
void attention_rows(py::array q, py::array k, py::array v, py::array pk, py::array pv, py::array anchor,
                    int64_t lead, int64_t T, int64_t pos0, int64_t H, int64_t Hk, double scale, double softcap,
                    int64_t window, py::array out, py::object o_ref) {
    const RowForm f = row_form(anchor, lead, T, "attention_rows");
    const int64_t R = f.R();
    const int64_t Hd = q.ndim() == 2 ? q.shape(1) : 0, hd = H > 0 ? Hd / H : 0;
    if (hd < 1 || Hd != H * hd || q.shape(0) != R) throw std::invalid_argument("attention_rows: q must be [R, H*hd]");
    const Config c = make_config(H, Hk, hd, scale, softcap, window);
    const Rows Qr = rows_of(q, "q", H * hd), Kr = rows_of(k, "k", Hk * hd), Vr = rows_of(v, "v", Hk * hd),
               PKr = rows_of(pk, "pk", Hk * hd), PVr = rows_of(pv, "pv", Hk * hd);
    if (k.shape(0) != R || v.shape(0) != R) throw std::invalid_argument("attention_rows: k / v must have R rows");
    const int64_t a = pk.shape(0);
    if (pv.shape(0) != a || (lead > 0 && a > 0)) {
        throw std::invalid_argument("attention_rows: the prefix is the lead rows or a kept one, not both");
    }
    check_array(out, "out", 'h', {R, H * hd}, true);
    const float* orf = row_reference(o_ref, f, H * hd, "o_ref");
    std::unique_ptr<float[]> o(new float[R * H * hd]);  // the float32 outputs
    auto at = [](const Rows& x, int64_t r) { return Rows{x.p + r * x.stride, x.stride}; };
    Problem L{Qr, Kr, Vr, PKr, PVr, 1, lead, 1, lead, 0, 0, 0, o.get()};  // the lead rows: no shared keys
    Problem Bt{at(Qr, lead), at(Kr, lead), at(Vr, lead), lead ? Kr : PKr, lead ? Vr : PVr, f.B, T, f.B, T,
               lead ? lead : a, pos0, pos0, o.get() + lead * H * hd};
    std::vector<Problem*> problems;
    if (lead > 0) problems.push_back(&L);
    if (f.B > 0) problems.push_back(&Bt);
    uint16_t* op = mh(out);
    const float* of = o.get();
    run_attention(c, problems, R, [&](int64_t r) {
        const int64_t ar = f.anchor_row(r);
        form_row(of + r * Hd, ar != r ? of + ar * Hd : f.ref_of(orf, r, Hd), op + r * Hd, Hd);
    });
}

}  // namespace

void register_attention_ops(py::module_& m) {
    m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("pk"), py::arg("pv"),
          py::arg("out"), py::arg("B"), py::arg("T"), py::arg("H"), py::arg("Hk"), py::arg("kB"), py::arg("pos0"),
          py::arg("k0"),
          py::arg("scale"), py::arg("softcap"), py::arg("window"),
          "causal attention over shared keys (positions 0..a-1) and each batch row's own keys (k0..), float32 rows");
    m.def("attention_rows", &attention_rows, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("pk"), py::arg("pv"),
          py::arg("anchor"), py::arg("lead"), py::arg("T"), py::arg("pos0"), py::arg("H"), py::arg("Hk"),
          py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("out"), py::arg("o_ref") = py::none(),
          "the attention of a difference-form pass (lead rows, batch rows over the prefix), out in difference form");
}

}  // namespace sicl
