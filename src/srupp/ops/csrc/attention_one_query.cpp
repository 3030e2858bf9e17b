// Attention of one query per (batch, head) for decoding: o = softmax(scale q K^T) V.
//
// A decode step attends from one token to a window of cached keys and values:
// (1 x hd) against (S x hd). Through SDPA or two matmuls that is a few tiny GEMMs,
// whose fixed cost (and, in bf16, a slow small-GEMM path for P V) exceeds the work.
// Here a task walks its keys once for the scores (fp32 dot products, q widened once),
// takes the softmax in fp32, and walks the V rows once accumulating the p-weighted rows
// in fp32; the output rounds to the input dtype once. K and V are read in place at any
// row stride (a [K | V] cache).
//
// Blocks. Each (batch, head)'s keys are cut into blocks of kKeysPerBlock keys aligned to
// the newest key (the last block is full, the first takes the rest); each block keeps its
// own max, sum and weighted rows, merged at the end in block order (the flash-decoding
// split), and the blocks are tasks for the threads, so batch-1 decoding over a long
// window uses every thread. The cut depends on S only, so a query's result is the same
// bits at any batch size, head count and thread count. It is also the same bits under
// extra padding on the left (a batched serving memory, left-padded to its longest
// stream): padded keys in a block add exact zeros to its sum and are skipped for V,
// wholly padded blocks (max -inf) are skipped by the merge, and the real keys' blocks
// keep their bounds, since the cut counts from the end. One block goes through the same
// merge as many (its weight exp(0) = 1 is exact), so growing from one block to several
// by padding changes nothing either.

#include "common.h"

#include <type_traits>

namespace srupp_cpu {
namespace {

inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(__m512(v));
#else
  alignas(64) float lanes[kW];
  v.store(lanes);
  float s = 0.f;
  for (int l = 0; l < kW; ++l) s += lanes[l];
  return s;
#endif
}

// p[0 .. n) = exp(p - mx), returning their sum (all 0 when mx is -inf: every key padded).
// In vectors aligned to the block's end, so that keys added before the first (a left-
// padded memory: their weights are exact zeros) move no key to another lane and change
// no sum's order. Sleef's vector exp (1 ulp), not std::exp key by key: the attention
// 15 to 18% faster (docs/deploy.md).
inline float softmax_weights(float* p, int64_t n, float mx) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  if (mx == kNone) {
    std::fill(p, p + n, 0.f);
    return 0.f;
  }
  const Vec m(mx);
  Vec acc(0.f);
  int64_t t = n;
  for (; t >= kW; t -= kW) {
    const Vec e = (Vec::loadu(p + t - kW) - m).exp();
    e.store(p + t - kW);
    acc = acc + e;
  }
  if (t > 0) {  // the first t weights, in the last t lanes (the others exp(-inf) = 0)
    alignas(64) float lanes[kW];
    std::fill(lanes, lanes + kW - t, kNone);
    std::copy(p, p + t, lanes + kW - t);
    const Vec e = (Vec::loadu(lanes) - m).exp();
    e.store(lanes);
    std::copy(lanes + kW - t, lanes + kW, p);
    acc = acc + e;
  }
  return hsum(acc);
}

// p[j - j0] = score(j) for keys j0 .. j1 - 1 (-inf for padded keys); returns their max
// (-inf when every one is padded).
template <typename Padded, typename Score>
inline float score_keys(int64_t j0, int64_t j1, const Padded& padded, float* p,
                        const Score& score) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = j0; j < j1; ++j) {
    float& pj = p[j - j0];
    if (padded(j)) {
      pj = -std::numeric_limits<float>::infinity();
      continue;
    }
    pj = score(j);
    mx = std::max(mx, pj);
  }
  return mx;
}

// Keys per block. Each block costs one more task and merge, paid at every batch size (the
// cut may not depend on it); its scores (1 KiB) stay in L1. A window of w keys decodes over
// w + 1 (the token's own): at 128 a 128-key window made blocks of 1 and 128 keys, and the
// attention a quarter of a 32-stream step. At 256, batch 1 still splits longer windows
// (1,024 keys: 5 blocks) over the threads.
constexpr int64_t kKeysPerBlock = 256;

// No software prefetching: the hardware's own keeps up with these walks, from L3 and
// from DRAM alike. Asking for keys 8 ahead into L1 and rows 32 ahead into L2 (which once
// helped a slower walk) made them 5 to 40% slower (docs/deploy.md, load).

// acc[0 .. NV*kW) = sum over unpadded j of p[j - j0] * v_j[0 .. NV*kW), in registers: the
// same fmadd per element in the same key order as a loop through memory, so the same bits.
template <int NV, typename T, typename Padded>
inline void weigh_values(const T* vb, int64_t svr, int64_t j0, int64_t j1, const float* p,
                         const Padded& padded, float* acc) {
  Vec a[NV];
  for (int u = 0; u < NV; ++u) a[u] = Vec(0.f);
  for (int64_t j = j0; j < j1; ++j) {
    if (padded(j)) continue;
    const T* vr = vb + j * svr;
    const Vec pj(p[j - j0]);
    for (int u = 0; u < NV; ++u) a[u] = at::vec::fmadd(pj, IO<T>::load(vr + u * kW), a[u]);
  }
  for (int u = 0; u < NV; ++u) a[u].store(acc + u * kW);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// bf16 keys and values on CPUs with AVX512-BF16, heads a multiple of 32 wide (at most
// 512): the generic walk below spent most of its time widening bf16 to fp32, not reading.
// - Scores: vdpbf16ps multiplies 32 bf16 pairs of the key and the query (bf16, as the
//   layer stores it) and adds them into 16 fp32 lanes; the products of two bf16 are
//   exact in fp32, so each lane is a chain of fp32 adds as an fmadd's, in another order
//   than the generic walk (and with fp32 denormals flushed, as the instruction does).
// - Values: 32 bf16 of a row widen in two instructions (the even elements shifted up a
//   half-lane, the odd ones masked), and each element's fmadd chain over the keys is the
//   generic walk's: the same bits. The lanes go back in order when stored.
constexpr int64_t kPairVec = 32;     // bf16 in a 512-bit vector
constexpr int64_t kMaxPairVecs = 16; // hd up to 512

inline bool pairs_path(int64_t hd) { return hd % kPairVec == 0 && hd <= kPairVec * kMaxPairVecs; }


// acc[0 .. NP*32) = sum over unpadded j of p[j - j0] * v_j[0 .. NP*32), as weigh_values
template <int NP, typename Padded>
inline void weigh_values_pairs(const BFloat16* vb, int64_t svr, int64_t j0, int64_t j1,
                               const float* p, const Padded& padded, float* acc) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[NP], odd[NP];
  for (int u = 0; u < NP; ++u) even[u] = odd[u] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    if (padded(j)) continue;
    const BFloat16* vr = vb + j * svr;
    const __m512 pj = _mm512_set1_ps(p[j - j0]);
    for (int u = 0; u < NP; ++u) {
      const __m512i x = _mm512_loadu_si512(vr + u * kPairVec);
      even[u] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), even[u]);
      odd[u] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_and_si512(x, high)), odd[u]);
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int u = 0; u < NP; ++u) {
    _mm512_storeu_ps(acc + u * kPairVec, _mm512_permutex2var_ps(even[u], lo, odd[u]));
    _mm512_storeu_ps(acc + u * kPairVec + 16, _mm512_permutex2var_ps(even[u], hi, odd[u]));
  }
}

// attend_keys (below) for bf16 where pairs_path(hd): q is the bf16 query.
float attend_keys_pairs(const BFloat16* q, const BFloat16* kb, int64_t skr, const BFloat16* vb,
                        int64_t svr, int64_t j0, int64_t j1, int64_t hd, float scale,
                        const bool* pad, int64_t pad_len, float* p, float* acc, float* l) {
  const int64_t nq = hd / kPairVec;
  auto padded = [&](int64_t j) { return pad != nullptr && j < pad_len && pad[j]; };
  __m512bh qv[kMaxPairVecs];
  for (int64_t m = 0; m < nq; ++m) qv[m] = (__m512bh)_mm512_loadu_si512(q + m * kPairVec);
  const float mx = score_keys(j0, j1, padded, p, [&](int64_t j) {
    const BFloat16* kr = kb + j * skr;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t m = 0;
    for (; m + 2 <= nq; m += 2) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(kr + m * kPairVec), qv[m]);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(kr + (m + 1) * kPairVec), qv[m + 1]);
    }
    if (m < nq) a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(kr + m * kPairVec), qv[m]);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * scale;
  });
  const float sum = softmax_weights(p, j1 - j0, mx);
  // the weighted rows, 8 pairs of vectors at a time in registers (then 4, 2, 1)
  int64_t i = 0;
  for (; i + 8 * kPairVec <= hd; i += 8 * kPairVec)
    weigh_values_pairs<8>(vb + i, svr, j0, j1, p, padded, acc + i);
  if (i + 4 * kPairVec <= hd) {
    weigh_values_pairs<4>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += 4 * kPairVec;
  }
  if (i + 2 * kPairVec <= hd) {
    weigh_values_pairs<2>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += 2 * kPairVec;
  }
  if (i < hd) weigh_values_pairs<1>(vb + i, svr, j0, j1, p, padded, acc + i);
  *l = sum;
  return mx;
}
#endif

// Vectors held at once: half the vector registers (AVX-512 has 32, AVX2 16).
constexpr int kAccVecs = kW >= 16 ? 16 : 8;

// One query's softmax pieces over keys j0 .. j1 - 1: returns their max score m (-inf when
// every one is padded) and writes l = sum exp(s - m) to *l and sum exp(s - m) v_j to acc
// (hd_pad floats). qf: the query in fp32 (hd_pad, zero beyond hd); p: j1 - j0 floats.
// Key j is padding when j < pad_len and pad[j] (pad null: none is).
template <typename T>
float attend_keys(const float* qf, const T* kb, int64_t skr, const T* vb, int64_t svr,
                  int64_t j0, int64_t j1, int64_t hd, float scale, const bool* pad,
                  int64_t pad_len, float* p, float* acc, float* l) {
  const int64_t full = hd / kW * kW;
  const int tail = static_cast<int>(hd - full);
  auto padded = [&](int64_t j) { return pad != nullptr && j < pad_len && pad[j]; };
  const float mx = score_keys(j0, j1, padded, p, [&](int64_t j) {
    const T* kr = kb + j * skr;
    Vec a0(0.f), a1(0.f);
    int64_t i = 0;
    for (; i + 2 * kW <= full; i += 2 * kW) {
      a0 = at::vec::fmadd(IO<T>::load(kr + i), Vec::loadu(qf + i), a0);
      a1 = at::vec::fmadd(IO<T>::load(kr + i + kW), Vec::loadu(qf + i + kW), a1);
    }
    for (; i < full; i += kW) a0 = at::vec::fmadd(IO<T>::load(kr + i), Vec::loadu(qf + i), a0);
    if (tail) a1 = at::vec::fmadd(IO<T>::load(kr + i, tail), Vec::loadu(qf + i), a1);
    return hsum(a0 + a1) * scale;
  });
  const float sum = softmax_weights(p, j1 - j0, mx);
  // the weighted rows, kAccVecs vectors at a time in registers (then 8, 4, 2, 1)
  int64_t i = 0;
  for (; i + kAccVecs * kW <= full; i += kAccVecs * kW)
    weigh_values<kAccVecs>(vb + i, svr, j0, j1, p, padded, acc + i);
  if (kAccVecs > 8 && i + 8 * kW <= full) {
    weigh_values<8>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += 8 * kW;
  }
  if (i + 4 * kW <= full) {
    weigh_values<4>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += 4 * kW;
  }
  if (i + 2 * kW <= full) {
    weigh_values<2>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += 2 * kW;
  }
  if (i + kW <= full) {
    weigh_values<1>(vb + i, svr, j0, j1, p, padded, acc + i);
    i += kW;
  }
  if (tail) {  // the last part-vector, its lanes beyond hd zero
    Vec a(0.f);
    for (int64_t j = j0; j < j1; ++j)
      if (!padded(j)) a = at::vec::fmadd(Vec(p[j - j0]), IO<T>::load(vb + j * svr + i, tail), a);
    a.store(acc + i);
  }
  *l = sum;
  return mx;
}

// o = the blocks' weighted rows rescaled to their common max and added in block order,
// divided by their rescaled sums, rounded to T once. m, l: nb floats; acc: nb rows of
// hd_pad floats; out: hd_pad floats of scratch. A block whose keys are all padded
// (m = -inf) adds nothing and moves nothing: it is skipped. One block weighs exp(0) = 1,
// so its rows pass unchanged (acc is never -0: it starts at +0).
template <typename T>
void merge_blocks(const float* m, const float* l, const float* acc, int64_t nb, int64_t hd,
                  int64_t hd_pad, float* out, T* op) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float mx = kNone;
  for (int64_t r = 0; r < nb; ++r) mx = std::max(mx, m[r]);
  std::fill(out, out + hd_pad, 0.f);
  float sum = 0.f;
  if (mx != kNone) {
    for (int64_t r = 0; r < nb; ++r) {
      if (m[r] == kNone) continue;  // all padded
      const float w = std::exp(m[r] - mx);
      sum += w * l[r];
      const Vec wv(w);
      const float* a = acc + r * hd_pad;
      for (int64_t i = 0; i < hd_pad; i += kW)
        at::vec::fmadd(wv, Vec::loadu(a + i), Vec::loadu(out + i)).store(out + i);
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no key left: o = 0
  for (int64_t i = 0; i < hd; ++i) op[i] = static_cast<T>(out[i] * inv);
}

}  // namespace

template <typename T>
OneQuery<T>::OneQuery(const T* q_, const T* k_, const T* v_, T* o_, int64_t B_, int64_t H_,
                      int64_t S_, int64_t hd_, const int64_t* sq_, const int64_t* sk_,
                      const int64_t* sv_, float scale_, const bool* key_pad_, int64_t spad_,
                      int64_t pad_len_, int64_t /*threads: the cut may not depend on it*/)
    : q(q_), k(k_), v(v_), o(o_), B(B_), H(H_), S(S_), hd(hd_), sq(sq_), sk(sk_), sv(sv_),
      scale(scale_), key_pad(key_pad_), spad(spad_), pad_len(pad_len_) {
  hd_pad = (hd + kW - 1) / kW * kW;
  NH = B * H;
  blocks = std::max<int64_t>(1, (S + kKeysPerBlock - 1) / kKeysPerBlock);  // S only
  if (blocks > 1) {
    part_m.resize(NH * blocks);
    part_l.resize(NH * blocks);
    part_acc.resize(NH * blocks * hd_pad);
  }
}

template <typename T>
int64_t OneQuery<T>::scratch() const {
  return 2 * hd_pad + std::max<int64_t>(std::min(S, kKeysPerBlock), 1);
}

template <typename T>
void OneQuery<T>::task(int64_t t, float* scratch_) {
  float* qf = scratch_;
  float* acc = qf + hd_pad;
  float* p = acc + hd_pad;
  const int64_t n = t / blocks, r = t % blocks, b = n / H, h = n % H;
  // block r of the cut from the end: the last block ends at S, the first starts at 0
  const int64_t j1 = S - (blocks - 1 - r) * kKeysPerBlock;
  const int64_t j0 = std::max<int64_t>(0, j1 - kKeysPerBlock);
  const T* qp = q + b * sq[0] + h * sq[1];
  const bool* pad = key_pad == nullptr ? nullptr : key_pad + b * spad;
  float* acc_t = blocks > 1 ? part_acc.data() + t * hd_pad : acc;
  float l = 0.f;
  float m = 0.f;
  bool walked = false;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
  if constexpr (std::is_same<T, BFloat16>::value) {
    if (pairs_path(hd)) {
      m = attend_keys_pairs(qp, k + b * sk[0] + h * sk[1], sk[2], v + b * sv[0] + h * sv[1],
                            sv[2], j0, j1, hd, scale, pad, pad_len, p, acc_t, &l);
      walked = true;
    }
  }
#endif
  if (!walked) {
    for (int64_t i = 0; i < hd; ++i) qf[i] = static_cast<float>(qp[i]);
    std::fill(qf + hd, qf + hd_pad, 0.f);
    m = attend_keys<T>(qf, k + b * sk[0] + h * sk[1], sk[2], v + b * sv[0] + h * sv[1], sv[2],
                       j0, j1, hd, scale, pad, pad_len, p, acc_t, &l);
  }
  if (blocks > 1) {
    part_m[t] = m;
    part_l[t] = l;
    return;
  }
  // one block: the same merge as finish's, so that it gives what several would (qf is
  // free now: the merge's scratch)
  merge_blocks<T>(&m, &l, acc, 1, hd, hd_pad, qf, o + n * hd);
}

template <typename T>
void OneQuery<T>::finish(int64_t n, float* out) const {
  if (blocks == 1) return;  // the task merged its one block
  merge_blocks<T>(part_m.data() + n * blocks, part_l.data() + n * blocks,
                  part_acc.data() + n * blocks * hd_pad, blocks, hd, hd_pad, out, o + n * hd);
}

template struct OneQuery<float>;
template struct OneQuery<BFloat16>;

template <typename T>
void one_query_kernel(const T* q, const T* k, const T* v, T* o, int64_t B, int64_t H,
                      int64_t S, int64_t hd, const int64_t* sq, const int64_t* sk,
                      const int64_t* sv, float scale, const bool* key_pad, int64_t spad,
                      int64_t pad_len) {
  OneQuery<T> att(q, k, v, o, B, H, S, hd, sq, sk, sv, scale, key_pad, spad,
                  pad_len < 0 ? S : pad_len, at::get_num_threads());
  at::parallel_for(0, att.tasks(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(att.scratch());
    for (int64_t t = t0; t < t1; ++t) att.task(t, scratch.data());
  });
  if (att.blocks == 1) return;
  // the merges too are spread over the threads (each pair's is one thread's, in block
  // order): they run at every batch size now, not only at batch 1
  const int64_t grain = std::max<int64_t>(1, 16384 / (att.blocks * att.hd_pad));
  at::parallel_for(0, att.NH, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> out(att.hd_pad);
    for (int64_t n = n0; n < n1; ++n) att.finish(n, out.data());
  });
}

template void one_query_kernel<float>(const float*, const float*, const float*, float*, int64_t,
                                      int64_t, int64_t, int64_t, const int64_t*, const int64_t*,
                                      const int64_t*, float, const bool*, int64_t, int64_t);
template void one_query_kernel<BFloat16>(const BFloat16*, const BFloat16*, const BFloat16*,
                                         BFloat16*, int64_t, int64_t, int64_t, int64_t,
                                         const int64_t*, const int64_t*, const int64_t*, float,
                                         const bool*, int64_t, int64_t);

// q (B, H, 1, hd), k and v (B, H, S, hd), one dtype (fp32 or bf16), the last dim of
// each contiguous (any other strides); returns o (B, H, 1, hd) contiguous.
Tensor attend_one_query_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 &&
              k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
              q.size(3) == k.size(3),
              "srupp attend_one_query: q (B, H, 1, hd), k and v (B, H, S, hd) expected, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "srupp attend_one_query: q, k and v must all be float32 or all bfloat16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "srupp attend_one_query: the last dimension of q, k and v must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), S = k.size(2), hd = q.size(3);
  Tensor o = at::empty({B, H, 1, hd}, q.options());
  const int64_t sq[2] = {q.stride(0), q.stride(1)};
  const int64_t sk[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t sv[3] = {v.stride(0), v.stride(1), v.stride(2)};
  if (q.scalar_type() == at::kFloat) {
    one_query_kernel<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                            o.data_ptr<float>(), B, H, S, hd, sq, sk, sv,
                            static_cast<float>(scale));
  } else {
    one_query_kernel<BFloat16>(q.data_ptr<BFloat16>(), k.data_ptr<BFloat16>(),
                               v.data_ptr<BFloat16>(), o.data_ptr<BFloat16>(), B, H, S, hd,
                               sq, sk, sv, static_cast<float>(scale));
  }
  return o;
}

}  // namespace srupp_cpu
