// Few-row projections for decoding: y (R, O) = x (R, I) @ W (O, I)^T [+ bias].
//
// At one token per sequence a decode step is a chain of matrix-vector products, each
// reading its weight once; BLAS's GEMM treats a 1-row product as a small GEMM and
// reaches a fraction of the memory bandwidth. Here each task owns a range of output
// features and walks their rows of W once, with one dot product per row of x (x is
// converted to fp32 once; its rows stay in cache), four vector accumulators each. fp32 or
// bf16 (x, W and bias of one dtype); sums in fp32; the output rounds to the input dtype.
// Several rows of x share each load of W (dot_rows, dot4_rows); a row's arithmetic is
// the same in any block and at any R, so its result is too (batch invariance, which
// the serving engine relies on: tests/ops/test_matmul.py checks it bit for bit).

#include "common.h"

#include <ATen/ops/zeros.h>

// Unrolled, the small loops over a block's rows and features index their accumulator
// arrays with constants, so the compiler keeps the arrays in registers (without, GCC
// kept them on the stack outside the main loop, which short rows felt).
#if defined(__clang__)
#define SRUPP_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define SRUPP_UNROLL _Pragma("GCC unroll 16")
#else
#define SRUPP_UNROLL
#endif

namespace srupp_cpu {

namespace {

// sum[b] = v[b]'s lanes added one by one from 0.f, in lane order: a row's horizontal sum.
// With AVX-512, four rows at once: the four vectors transposed (lane k of each in one
// 128-bit vector) and those sixteen added in order, each lane the same additions as
// the scalar loop; short rows (I of a few hundred) spent nearly half their time in it.
template <int NR>
inline void sum_lanes(const Vec (&v)[NR], float (&sum)[NR]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NR == 4) {
    static_assert(kW == 16, "AVX-512's Vectorized<float> holds 16 lanes");
    const __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
    const __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
    // (v0[k], v1[k], v2[k], v3[k]) for k = 4j + q in 128-bit lane j of column q
    alignas(64) float col[4][16];
    _mm512_store_ps(col[0], _mm512_shuffle_ps(t0, t2, 0x44));
    _mm512_store_ps(col[1], _mm512_shuffle_ps(t0, t2, 0xEE));
    _mm512_store_ps(col[2], _mm512_shuffle_ps(t1, t3, 0x44));
    _mm512_store_ps(col[3], _mm512_shuffle_ps(t1, t3, 0xEE));
    __m128 acc = _mm_setzero_ps();
    for (int j = 0; j < 4; ++j)
      for (int q = 0; q < 4; ++q) acc = _mm_add_ps(acc, _mm_load_ps(col[q] + 4 * j));
    _mm_storeu_ps(sum, acc);
    return;
  }
#endif
  alignas(64) float lanes[kW];
  for (int b = 0; b < NR; ++b) {
    v[b].store(lanes);
    float acc = 0.f;
    for (int k = 0; k < kW; ++k) acc += lanes[k];
    sum[b] = acc;
  }
}

// Rows 0 .. NR - 1 of x (R, I) against one row wr of W: NR dot products, each with four
// vector accumulators, into y[b * ldy] (y points at the first row's output feature).
// Each chunk of W is loaded and widened once and multiplied into every row's
// accumulators: at one row per pass, loading and widening W cost more than the FMAs.
// Every row's arithmetic is that of a row alone (NR = 1): its own accumulators, the
// same FMAs in the same order over i, the same tail, combination and horizontal sum.
// So a row's result depends neither on R nor on its block (batch invariance).
template <typename T, int NR>
inline void dot_rows(const float* x, int64_t I, const T* wr, const T* bias_o, T* y, int64_t ldy) {
  Vec a[NR][4];  // (row, accumulator): 16 registers at NR = 4
  SRUPP_UNROLL
  for (int b = 0; b < NR; ++b)
    for (int q = 0; q < 4; ++q) a[b][q] = Vec(0.f);
  int64_t i = 0;
  for (; i + 4 * kW <= I; i += 4 * kW) {
    const Vec w0 = IO<T>::load(wr + i), w1 = IO<T>::load(wr + i + kW),
              w2 = IO<T>::load(wr + i + 2 * kW), w3 = IO<T>::load(wr + i + 3 * kW);
    SRUPP_UNROLL
    for (int b = 0; b < NR; ++b) {
      const float* xr = x + b * I + i;
      a[b][0] = at::vec::fmadd(w0, Vec::loadu(xr), a[b][0]);
      a[b][1] = at::vec::fmadd(w1, Vec::loadu(xr + kW), a[b][1]);
      a[b][2] = at::vec::fmadd(w2, Vec::loadu(xr + 2 * kW), a[b][2]);
      a[b][3] = at::vec::fmadd(w3, Vec::loadu(xr + 3 * kW), a[b][3]);
    }
  }
  for (; i + kW <= I; i += kW) {  // whole vectors left: into the first accumulator
    const Vec w0 = IO<T>::load(wr + i);
    SRUPP_UNROLL
    for (int b = 0; b < NR; ++b) a[b][0] = at::vec::fmadd(w0, Vec::loadu(x + b * I + i), a[b][0]);
  }
  if (i < I) {  // the last I - i < kW: into the second (zeros beyond I add nothing)
    const int n = static_cast<int>(I - i);
    const Vec w0 = IO<T>::load(wr + i, n);
    SRUPP_UNROLL
    for (int b = 0; b < NR; ++b)
      a[b][1] = at::vec::fmadd(w0, Vec::loadu(x + b * I + i, n), a[b][1]);
  }
  Vec v[NR];
  SRUPP_UNROLL
  for (int b = 0; b < NR; ++b) v[b] = (a[b][0] + a[b][1]) + (a[b][2] + a[b][3]);
  float acc[NR];
  sum_lanes<NR>(v, acc);
  SRUPP_UNROLL
  for (int b = 0; b < NR; ++b) {
    if (bias_o != nullptr) acc[b] += static_cast<float>(*bias_o);
    y[b * ldy] = static_cast<T>(acc[b]);
  }
}

}  // namespace

// Output features o0 .. o1 - 1 of the product (the range a task or a thread owns).
// y's rows are ldy apart. x's rows (fp32) go by in blocks of 4, then 2, then 1 (dot_rows),
// each block against a tile of W's rows: the block's 4 rows stay in L1 while the tile
// (~128 KiB) stays in L2, so W comes from memory once and each FMA's operand from L2 is
// a quarter of a W vector. (Row-block-outer over all of W, x would stream from L2 at a
// vector per FMA: slower than one row at a time at 32 rows.)
template <typename T>
void linear_rows_range(const float* x, const T* w, int64_t ldw, const T* bias, T* y, int64_t ldy,
                       int64_t R, int64_t I, int64_t o0, int64_t o1) {
  const int64_t row_bytes = static_cast<int64_t>(sizeof(T)) * std::max<int64_t>(I, 1);
  const int64_t tile = std::max<int64_t>(1, (int64_t{128} << 10) / row_bytes);  // W's rows
  for (int64_t t0 = o0; t0 < o1; t0 += tile) {
    const int64_t t1 = std::min(o1, t0 + tile);
    // the rows r .. r + NR - 1 against the tile's features
    auto block = [&](auto nr, int64_t r) {
      constexpr int NR = decltype(nr)::value;
      for (int64_t o = t0; o < t1; ++o)
        dot_rows<T, NR>(x + r * I, I, w + o * ldw, bias != nullptr ? bias + o : nullptr,
                        y + r * ldy + o, ldy);
    };
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) block(std::integral_constant<int, 4>(), r);
    if (r + 2 <= R) {
      block(std::integral_constant<int, 2>(), r);
      r += 2;
    }
    if (r < R) block(std::integral_constant<int, 1>(), r);
  }
}

template void linear_rows_range<float>(const float*, const float*, int64_t, const float*, float*,
                                       int64_t, int64_t, int64_t, int64_t, int64_t);
template void linear_rows_range<BFloat16>(const float*, const BFloat16*, int64_t, const BFloat16*,
                                          BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t);

namespace {

// Output features per task (at least): a task works at least as long as reading ~64 KiB
// of W takes at one row, so that 2 threads split a 256 x 256 product. With R rows each
// element of W costs R multiply-adds as well: measured here, an element of W at R rows
// takes about 1 + (R - 1) / 4 times as long as at one row (fp32 and bf16), so the grain
// shrinks by that factor (bf16 rows of 256 at R = 32: 14 features, not 128).
inline int64_t rows_grain(int64_t R, int64_t I, int64_t bytes) {
  const int64_t cost = bytes * std::max<int64_t>(I, 1) * (3 + std::max<int64_t>(R, 1));  // x 4
  return std::max<int64_t>(4, (int64_t{4} << 16) / cost);
}

template <typename T>
void linear_rows_kernel(const float* x, const T* w, int64_t ldw, const T* bias, T* y, int64_t R,
                        int64_t I, int64_t O) {
  at::parallel_for(0, O, rows_grain(R, I, sizeof(T)), [&](int64_t o0, int64_t o1) {
    linear_rows_range<T>(x, w, ldw, bias, y, O, R, I, o0, o1);
  });
}

}  // namespace

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// bf16 rows on CPUs with AVX512-BF16 (built with -march=native there): vdpbf16ps
// multiplies 32 bf16 pairs and adds them into 16 fp32 lanes in one instruction, so
// W is never widened (the generic kernel above spent more time converting W than
// reading it). x is the caller's bf16 x itself. Sums in fp32, as above, in another
// order: the output differs from the generic kernel's by bf16 rounding at most. Four
// outputs round to bf16 in one vcvtneps2bf16 (to nearest even, as common.h's to_bf16:
// fp32 denormals go to 0), where a scalar rounding each cost as much as a quarter of
// the multiply-adds at rows of 256.
//
// Four output features at a time: each load of x serves four rows of W, and the four
// sums leave their vectors in one combined reduction. One row at a time, rows as short
// as SRU++'s (d/4 wide) spent as long on reloading x and reducing as on reading W.
// And two rows of x at a time (dot4_rows): each load of W serves both rows, so a
// vdpbf16ps needs 0.75 loads instead of 1.25. (Tiling W as linear_rows_range does loses
// here: W's four rows, not x's row, would come from L2, twice the traffic.)
namespace {

constexpr int64_t kB = 32;  // bf16 per 512-bit vector

inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {  // (sum a0, .., sum a3)
  auto half = [](__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)),
                                  _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline __m512bh load_bf16(const BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// 4 bf16 at p, widened to fp32 (exact)
inline __m128 bf16x4_to_fp32(const BFloat16* p) {
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

// the last I % kB of a row; zeros beyond I multiply to zero
inline __m512bh load_bf16_tail(const BFloat16* p, __mmask32 tail_mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, p);
}

// Rows 0 .. NR - 1 of x (R, I) against W's four rows w, w + ldw, .., w + 3 ldw: y[r * ldy + q]
// (y points at the first feature's output of row 0). Each (row, feature) has its own two
// accumulators, the FMAs of a row alone in the same order, so NR changes no result.
template <int NR>
inline void dot4_rows(const BFloat16* x, int64_t I, const BFloat16* w, int64_t ldw,
                      const BFloat16* bias, BFloat16* y, int64_t ldy, __mmask32 tail_mask) {
  const BFloat16* wf[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
  // (row, feature): a the even vectors of the row, b the odd ones and the tail: 8 chains a row
  __m512 a[NR][4], b[NR][4];
  SRUPP_UNROLL
  for (int r = 0; r < NR; ++r)
    for (int q = 0; q < 4; ++q) a[r][q] = b[r][q] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kB <= I; i += 2 * kB) {
    __m512bh xa[NR], xb[NR];
    SRUPP_UNROLL
    for (int r = 0; r < NR; ++r) {
      xa[r] = load_bf16(x + r * I + i);
      xb[r] = load_bf16(x + r * I + i + kB);
    }
    SRUPP_UNROLL
    for (int q = 0; q < 4; ++q) {
      const __m512bh wa = load_bf16(wf[q] + i), wb = load_bf16(wf[q] + i + kB);
      SRUPP_UNROLL
      for (int r = 0; r < NR; ++r) {
        a[r][q] = _mm512_dpbf16_ps(a[r][q], wa, xa[r]);
        b[r][q] = _mm512_dpbf16_ps(b[r][q], wb, xb[r]);
      }
    }
  }
  if (i + kB <= I) {
    SRUPP_UNROLL
    for (int q = 0; q < 4; ++q) {
      const __m512bh wa = load_bf16(wf[q] + i);
      SRUPP_UNROLL
      for (int r = 0; r < NR; ++r)
        a[r][q] = _mm512_dpbf16_ps(a[r][q], wa, load_bf16(x + r * I + i));
    }
    i += kB;
  }
  if (tail_mask) {
    SRUPP_UNROLL
    for (int q = 0; q < 4; ++q) {
      const __m512bh wt = load_bf16_tail(wf[q] + i, tail_mask);
      SRUPP_UNROLL
      for (int r = 0; r < NR; ++r)
        b[r][q] = _mm512_dpbf16_ps(b[r][q], wt, load_bf16_tail(x + r * I + i, tail_mask));
    }
  }
  const __m128 b4 = bias != nullptr ? bf16x4_to_fp32(bias) : _mm_setzero_ps();
  SRUPP_UNROLL
  for (int r = 0; r < NR; ++r) {
    __m128 v = sum4(_mm512_add_ps(a[r][0], b[r][0]), _mm512_add_ps(a[r][1], b[r][1]),
                    _mm512_add_ps(a[r][2], b[r][2]), _mm512_add_ps(a[r][3], b[r][3]));
    if (bias != nullptr) v = _mm_add_ps(v, b4);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(y + r * ldy), (__m128i)_mm_cvtneps_pbh(v));
  }
}

// One row xr against one feature wr (the last features of a range, fewer than four)
inline BFloat16 dot1(const BFloat16* xr, int64_t I, const BFloat16* wr, const BFloat16* bias,
                     __mmask32 tail_mask) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kB <= I; i += 2 * kB) {
    a0 = _mm512_dpbf16_ps(a0, load_bf16(wr + i), load_bf16(xr + i));
    a1 = _mm512_dpbf16_ps(a1, load_bf16(wr + i + kB), load_bf16(xr + i + kB));
  }
  if (i + kB <= I) {
    a0 = _mm512_dpbf16_ps(a0, load_bf16(wr + i), load_bf16(xr + i));
    i += kB;
  }
  if (tail_mask)
    a1 = _mm512_dpbf16_ps(a1, load_bf16_tail(wr + i, tail_mask), load_bf16_tail(xr + i, tail_mask));
  // reduced in sum4's order and rounded as dot4_rows rounds, so a feature's value does
  // not depend on its group
  const __m512 z = _mm512_setzero_ps();
  __m128 v = sum4(_mm512_add_ps(a0, a1), z, z, z);
  if (bias != nullptr) v = _mm_add_ss(v, _mm_set_ss(static_cast<float>(*bias)));
  const __m128i h = (__m128i)_mm_cvtneps_pbh(v);
  return c10::BFloat16(static_cast<uint16_t>(_mm_extract_epi16(h, 0)), c10::BFloat16::from_bits());
}

}  // namespace

void linear_rows_bf16_dot_range(const BFloat16* x, const BFloat16* w, int64_t ldw,
                                const BFloat16* bias, BFloat16* y, int64_t ldy, int64_t R,
                                int64_t I, int64_t o0, int64_t o1) {
  const int tail = static_cast<int>(I % kB);
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((uint64_t{1} << tail) - 1) : 0;
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {  // the four features' rows of W stay in L1 while x goes by
    const BFloat16* wo = w + o * ldw;
    const BFloat16* bias_o = bias != nullptr ? bias + o : nullptr;
    int64_t r = 0;
    for (; r + 2 <= R; r += 2)
      dot4_rows<2>(x + r * I, I, wo, ldw, bias_o, y + r * ldy + o, ldy, tail_mask);
    if (r < R) dot4_rows<1>(x + r * I, I, wo, ldw, bias_o, y + r * ldy + o, ldy, tail_mask);
  }
  for (; o < o1; ++o) {  // the last features, one at a time
    const BFloat16* bias_o = bias != nullptr ? bias + o : nullptr;
    for (int64_t r = 0; r < R; ++r)
      y[r * ldy + o] = dot1(x + r * I, I, w + o * ldw, bias_o, tail_mask);
  }
}

namespace {

void linear_rows_bf16_dot(const BFloat16* x, const BFloat16* w, int64_t ldw,
                          const BFloat16* bias, BFloat16* y, int64_t R, int64_t I, int64_t O) {
  at::parallel_for(0, O, rows_grain(R, I, 2), [&](int64_t o0, int64_t o1) {
    linear_rows_bf16_dot_range(x, w, ldw, bias, y, O, R, I, o0, o1);
  });
}

}  // namespace

// ---- Pair-packed bf16 weights ------------------------------------------------------
// W (O, I), I even, held in tiles of 48 outputs as (T, I/2, 48, 2), T = ceil(O / 48):
// tile t, pair p holds outputs 48t .. 48t + 47's weights for inputs 2p and 2p + 1 side by
// side (zeros past O). One vdpbf16ps takes 16 outputs' weights for a pair in one load and
// the row's pair of x broadcast to every lane, and adds both products into the 16
// outputs' lanes. There is no horizontal sum (dot4_rows spent a quarter of its time on
// them at rows of 256), each load of W serves up to 8 rows, and a tile's weights are one
// contiguous stream (the hardware prefetcher follows it when they come from memory).
// Each output is one lane's chain over p = 0, 1, .., I/2 - 1 in order, in any block, at
// any R and on any thread: a row's result is that of the row alone.
namespace {

constexpr int64_t kTile = 48;  // outputs per tile: 3 vectors

// Rows 0 .. NR - 1 of x (ldx apart) against NV vectors of 16 outputs from vector v
// (outputs 16 v .. 16 (v + NV) - 1, those under O), which may span tiles of the packed W
// (P pairs each): y[r * ldy + o]. NR * NV accumulators; at few rows many vectors at once
// keep 12 or more chains going.
template <int NR, int NV>
inline void pairs_block(const BFloat16* x, int64_t ldx, const BFloat16* wp, int64_t P,
                        int64_t O, int64_t v, const BFloat16* bias, BFloat16* y, int64_t ldy) {
  __m512 acc[NR][NV];
  SRUPP_UNROLL
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t tile_elems = P * 2 * kTile;
  const BFloat16* w0[NV];  // vector i's weights for pair 0; pair p is 2 kTile further
  SRUPP_UNROLL
  for (int i = 0; i < NV; ++i) w0[i] = wp + (v + i) / 3 * tile_elems + kB * ((v + i) % 3);
  for (int64_t p = 0; p < P; ++p) {
    __m512bh w[NV];
    SRUPP_UNROLL
    for (int i = 0; i < NV; ++i) w[i] = load_bf16(w0[i] + p * 2 * kTile);
    SRUPP_UNROLL
    for (int r = 0; r < NR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      SRUPP_UNROLL
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w[i], xb);
    }
  }
  SRUPP_UNROLL
  for (int i = 0; i < NV; ++i) {
    const int64_t o = 16 * (v + i);
    if (o >= O) break;
    const int n = static_cast<int>(std::min<int64_t>(16, O - o));
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps()
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + o)), 16));
    SRUPP_UNROLL
    for (int r = 0; r < NR; ++r) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(bias == nullptr ? acc[r][i] : _mm512_add_ps(acc[r][i], b));
      _mm256_mask_storeu_epi16(y + r * ldy + o, m, h);
    }
  }
}

// every row against NV vectors from v: 8 rows at a time, then 4, 2, 1
template <int NV>
void pairs_rows(const BFloat16* x, int64_t ldx, const BFloat16* wp, int64_t P, int64_t O,
                int64_t v, const BFloat16* bias, BFloat16* y, int64_t ldy, int64_t R) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8)
    pairs_block<8, NV>(x + r * ldx, ldx, wp, P, O, v, bias, y + r * ldy, ldy);
  if (r + 4 <= R) {
    pairs_block<4, NV>(x + r * ldx, ldx, wp, P, O, v, bias, y + r * ldy, ldy);
    r += 4;
  }
  if (r + 2 <= R) {
    pairs_block<2, NV>(x + r * ldx, ldx, wp, P, O, v, bias, y + r * ldy, ldy);
    r += 2;
  }
  if (r < R) pairs_block<1, NV>(x + r * ldx, ldx, wp, P, O, v, bias, y + r * ldy, ldy);
}

}  // namespace

void linear_pairs_bf16_range(const BFloat16* x, int64_t ldx, const BFloat16* wp, int64_t I,
                             int64_t O, const BFloat16* bias, BFloat16* y, int64_t ldy,
                             int64_t R, int64_t v0, int64_t v1) {
  const int64_t P = I / 2;
  int64_t v = v0;
  if (R < 4)  // one or a few rows: 12 vectors at once (12 chains a row)
    for (; v + 12 <= v1; v += 12) pairs_rows<12>(x, ldx, wp, P, O, v, bias, y, ldy, R);
  // 3 vectors at a time: 24 accumulators at 8 rows, and their weights (48 KiB at
  // I = 1,024) stay in L1/L2 while every row block goes by
  for (; v + 3 <= v1; v += 3) pairs_rows<3>(x, ldx, wp, P, O, v, bias, y, ldy, R);
  if (v + 2 <= v1) pairs_rows<2>(x, ldx, wp, P, O, v, bias, y, ldy, R);
  else if (v < v1) pairs_rows<1>(x, ldx, wp, P, O, v, bias, y, ldy, R);
}
#endif

int64_t pairs_tiles(int64_t O) { return (O + 47) / 48; }

// (O, I) -> (T, I/2, 48, 2), I even: the layout linear_pairs_bf16 reads.
Tensor pack_pairs_bf16_cpu(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "srupp pack_pairs_bf16: a bfloat16 weight (O, I) with I even expected, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t O = weight.size(0), I = weight.size(1), T = pairs_tiles(O);
  Tensor padded = at::zeros({T * 48, I}, weight.options());
  padded.narrow(0, 0, O).copy_(weight);
  return padded.view({T, 48, I / 2, 2}).transpose(1, 2).contiguous();
}

bool check_pairs(const Tensor& wp) {
  return wp.dim() == 4 && wp.size(2) == 48 && wp.size(3) == 2 &&
         wp.scalar_type() == at::kBFloat16 && wp.is_contiguous();
}

// y (R, O) = x (R, I) @ W^T (+ bias), W (O, I) packed by pack_pairs_bf16 (O given: the
// tiles hold up to 47 zero outputs more).
Tensor linear_pairs_bf16_cpu(const Tensor& x, const Tensor& wp, int64_t O,
                             const std::optional<Tensor>& bias) {
  TORCH_CHECK(linear_rows_bf16_native(),
              "srupp linear_pairs_bf16: needs a CPU with AVX512-BF16 (the extension was built "
              "without it)");
  TORCH_CHECK(check_pairs(wp) && O > 48 * (wp.size(0) - 1) && O <= 48 * wp.size(0),
              "srupp linear_pairs_bf16: weights packed by pack_pairs_bf16 ((T, I/2, 48, 2) "
              "bfloat16 contiguous) for ", O, " outputs expected, got ", wp.scalar_type(), " ",
              wp.sizes());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.size(1) == 2 * wp.size(1),
              "srupp linear_pairs_bf16: x (R, I) bfloat16 contiguous with I = ", 2 * wp.size(1),
              " expected, got ", x.scalar_type(), " ", x.sizes());
  const int64_t R = x.size(0), I = x.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == O,
                "srupp linear_pairs_bf16: bias (O,) bfloat16");
  Tensor y = at::empty({R, O}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  const BFloat16* b = has_bias ? bias->data_ptr<BFloat16>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, rows_grain(R, I, 2) / 16);  // in vectors
  at::parallel_for(0, (O + 15) / 16, grain, [&](int64_t v0, int64_t v1) {
    linear_pairs_bf16_range(x.data_ptr<BFloat16>(), I, wp.data_ptr<BFloat16>(), I, O, b,
                            y.data_ptr<BFloat16>(), O, R, v0, v1);
  });
#endif
  return y;
}

// True when linear_rows' bf16 products use the AVX512-BF16 dot-product instruction.
bool linear_rows_bf16_native() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  return true;
#else
  return false;
#endif
}

// x (R, I) and weight (O, I) of one dtype (fp32 or bf16), x contiguous, weight's rows
// contiguous (any row stride: keys read in place from a cache); bias (O,) or None.
Tensor linear_rows_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "srupp linear_rows: x (R, I) and weight (O, I) expected, got ", x.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "srupp linear_rows: x and weight must both be float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              "srupp linear_rows: x contiguous and weight rows contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                bias->numel() == weight.size(0), "srupp linear_rows: bias (O,) of x's dtype");
  }
  const int64_t R = x.size(0), I = x.size(1), O = weight.size(0);
  Tensor y = at::empty({R, O}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if (x.scalar_type() == at::kBFloat16) {
    linear_rows_bf16_dot(x.data_ptr<BFloat16>(), weight.data_ptr<BFloat16>(), weight.stride(0),
                         has_bias ? bias->data_ptr<BFloat16>() : nullptr,
                         y.data_ptr<BFloat16>(), R, I, O);
    return y;
  }
#endif
  const Tensor xf = x.to(at::kFloat);
  if (x.scalar_type() == at::kFloat) {
    linear_rows_kernel<float>(xf.data_ptr<float>(), weight.data_ptr<float>(), weight.stride(0),
                              has_bias ? bias->data_ptr<float>() : nullptr,
                              y.data_ptr<float>(), R, I, O);
  } else {
    linear_rows_kernel<BFloat16>(xf.data_ptr<float>(), weight.data_ptr<BFloat16>(), weight.stride(0),
                                 has_bias ? bias->data_ptr<BFloat16>() : nullptr,
                                 y.data_ptr<BFloat16>(), R, I, O);
  }
  return y;
}

}  // namespace srupp_cpu
