#include "copy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "crc32c.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define UCPD_X86 1
#endif

namespace ucpd {
namespace {

// Pieces at least this long are copied with non-temporal (streaming) stores: no read-for-
// ownership of the destination and no cache pollution. glibc's memcpy only streams above
// ~3/4 of the L3 size (114 MiB here), so a snapshot cut into tensors and tasks would otherwise
// use ordinary stores: measured 1.3-1.5x slower for 256 KiB..64 MiB pieces.
constexpr std::size_t kStreamMin = 64 * 1024;

using CopyFn = void (*)(unsigned char*, const unsigned char*, std::size_t);

void copy_plain(unsigned char* d, const unsigned char* s, std::size_t n) { std::memcpy(d, s, n); }

#ifdef UCPD_X86
// Streaming copy of a short run: 64-byte align the destination, then 128 bytes per step.
__attribute__((target("avx2"))) void stream_run(unsigned char* d, const unsigned char* s,
                                                std::size_t n) {
  std::size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 128; n -= 128, d += 128, s += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  std::memcpy(d, s, n);
}

// Streaming copy that walks four pages at once (one 128-byte step in each, round robin), which
// keeps several DRAM pages open and measured ~1.2x faster than a linear streaming loop; the same
// idea as glibc's large-copy path, which it only uses above ~3/4 of the L3 size.
__attribute__((target("avx2"))) void copy_stream_avx2(unsigned char* d, const unsigned char* s,
                                                      std::size_t n) {
  constexpr std::size_t kPage = 4096, kGroup = 4 * kPage;
  std::size_t head = (kPage - (reinterpret_cast<uintptr_t>(d) & (kPage - 1))) & (kPage - 1);
  if (head > n) head = n;
  stream_run(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= kGroup; n -= kGroup, d += kGroup, s += kGroup) {
    for (std::size_t l = 0; l < kPage; l += 128) {
      for (std::size_t p = 0; p < kGroup; p += kPage) {
        const unsigned char* ss = s + p + l;
        unsigned char* dd = d + p + l;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 32));
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 64));
        const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 96));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dd), a);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 32), b);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 64), c);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 96), e);
      }
    }
  }
  stream_run(d, s, n);
  _mm_sfence();  // streaming stores are weakly ordered: drain before the task reports done
}

// Streaming copy of one run of a strided window (a few KiB to a few hundred KiB, at any page
// offset): 64-byte align the destination, then walk four equal quarters of the run at once (one
// 128-byte step in each, round robin), the idea of copy_stream_avx2 without its need for whole
// aligned 4-page groups. No fence: the caller issues one _mm_sfence after its last run.
__attribute__((target("avx2"))) void stream_quarters_avx2(unsigned char* d,
                                                          const unsigned char* s, std::size_t n) {
  std::size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  const std::size_t q = n / 512 * 128;  // bytes per quarter, a multiple of 128
  for (std::size_t l = 0; l < q; l += 128) {
    for (std::size_t p = 0; p < 4 * q; p += q) {
      const unsigned char* ss = s + p + l;
      unsigned char* dd = d + p + l;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 64));
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dd), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dd + 96), e);
    }
  }
  stream_run(d + 4 * q, s + 4 * q, n - 4 * q);
}

#endif

CopyFn stream_copy_fn() {
  static const CopyFn fn = [] {
#ifdef UCPD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return static_cast<CopyFn>(copy_stream_avx2);
#endif
    return static_cast<CopyFn>(copy_plain);
  }();
  return fn;
}

// Copies n bytes, streaming when the piece is long enough.
inline void copy_bytes(unsigned char* d, const unsigned char* s, std::size_t n) {
  if (n >= kStreamMin)
    stream_copy_fn()(d, s, n);
  else
    std::memcpy(d, s, n);
}

constexpr std::size_t kMinTask = 256 * 1024;  // below this a task is not worth a hand-off
constexpr std::size_t kTasksPerThread = 4;    // slack so a slow (preempted) thread is helped

// One piece of one item that a single task copies; never crosses a task or CRC chunk boundary.
struct Segment {
  unsigned char* dst;
  const unsigned char* src;
  std::size_t n;
  std::size_t item;
  std::size_t chunk;
  uint32_t crc;  // in: the CRC to continue (kCrcOnly); out: the segment's CRC
};

void copy_and_crc(Segment& s, const CopyOptions& o) {
  if (o.mode == CrcMode::kCrcOnly) {
    s.crc = crc32c_update(s.crc, s.src, s.n);
    return;
  }
  if (o.mode == CrcMode::kFused) {
    if (s.n < kStreamMin) {  // small: ordinary stores keep it cached, and a CRC of cached bytes is cheap
      s.crc = crc32c_update(0, s.src, s.n);
      std::memcpy(s.dst, s.src, s.n);
      return;
    }
    if (crc32c_copy_fused()) {
      s.crc = crc32c_copy(s.dst, s.src, s.n, 0);
      return;
    }
    // No one-pass kernel (no AVX-512): checksum each 64 KiB block, then stream it out while it
    // is cached, as kCrcThenCopy does. crc32c_copy's own fallback copies with memcpy, whose
    // ordinary stores read every destination line first: measured 1.1x vs 0.8x of a 1-thread
    // streaming memcpy (2 threads, 1 GiB into a warm slot, EPYC with AVX2).
  }
  uint32_t c = 0;
  const std::size_t block = o.mode == CrcMode::kFused ? 64 * 1024 : o.block ? o.block : s.n;
  // Stream every block of a long segment, even blocks shorter than kStreamMin.
  const CopyFn copy = s.n >= kStreamMin ? stream_copy_fn() : copy_plain;
  for (std::size_t off = 0; off < s.n; off += block) {
    const std::size_t len = std::min(block, s.n - off);
    if (o.mode != CrcMode::kCopyThenCrc) {
      c = crc32c_update(c, s.src + off, len);
      copy(s.dst + off, s.src + off, len);
    } else {
      copy(s.dst + off, s.src + off, len);
      c = crc32c_update(c, s.src + off, len);
    }
  }
  s.crc = c;
}

}  // namespace

std::vector<std::vector<uint32_t>> copy_batch(const std::vector<CopyItem>& items,
                                              const CopyOptions& opts) {
  const bool crc = opts.crc_chunk > 0;
  const std::size_t C = opts.crc_chunk;
  std::size_t total = 0;
  for (const CopyItem& it : items) total += it.nbytes;
  const int threads = std::max(1, opts.threads);

  std::size_t task_bytes = total;
  if (threads > 1) task_bytes = std::max(kMinTask, total / (threads * kTasksPerThread) + 1);
  if (task_bytes == 0) task_bytes = 1;

  // Cut the concatenated stream into segments; task boundaries every task_bytes bytes.
  std::vector<Segment> segs;
  segs.reserve(items.size() + (crc ? total / C : 0) + threads * kTasksPerThread + 2);
  std::vector<std::size_t> task_first;  // index of each task's first segment
  std::size_t pos = 0, cur_task = SIZE_MAX;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const CopyItem& it = items[i];
    std::size_t off = 0;
    while (off < it.nbytes) {
      const std::size_t task = pos / task_bytes;
      std::size_t len = std::min(it.nbytes - off, (task + 1) * task_bytes - pos);
      if (crc) len = std::min(len, C - off % C);
      if (task != cur_task) {
        task_first.push_back(segs.size());
        cur_task = task;
      }
      segs.push_back(Segment{static_cast<unsigned char*>(it.dst) + off,
                             static_cast<const unsigned char*>(it.src) + off, len, i,
                             crc ? off / C : 0, off == 0 ? it.crc_init : 0u});
      off += len;
      pos += len;
    }
  }
  task_first.push_back(segs.size());

  const std::size_t ntasks = task_first.size() - 1;
  parallel_for(ntasks, threads, [&](std::size_t t) {
    for (std::size_t s = task_first[t]; s < task_first[t + 1]; ++s) {
      Segment& g = segs[s];
      if (crc)
        copy_and_crc(g, opts);
      else
        copy_bytes(g.dst, g.src, g.n);
    }
  });

  std::vector<std::vector<uint32_t>> out;
  if (!crc) return out;
  out.resize(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) out[i].assign((items[i].nbytes + C - 1) / C, 0);
  // A chunk split over several segments (task boundaries) is stitched with crc32c_combine.
  std::size_t prev_item = SIZE_MAX, prev_chunk = SIZE_MAX;
  for (const Segment& g : segs) {
    uint32_t& slot = out[g.item][g.chunk];
    if (g.item == prev_item && g.chunk == prev_chunk)
      slot = crc32c_combine(slot, g.crc, g.n);
    else
      slot = g.crc;
    prev_item = g.item;
    prev_chunk = g.chunk;
  }
  return out;
}

std::vector<BadChunk> copy_batch_verified(const std::vector<CopyItem>& items,
                                          const std::vector<std::vector<uint32_t>>& expected,
                                          std::size_t C, int threads) {
  if (C == 0) throw std::invalid_argument("copy_batch_verified: chunk must be > 0");
  if (expected.size() != items.size())
    throw std::invalid_argument("copy_batch_verified: one list of CRCs per item");
  struct Piece {
    std::size_t item, chunk;
  };
  std::vector<Piece> pieces;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::size_t n = (items[i].nbytes + C - 1) / C;
    if (expected[i].size() != n)
      throw std::invalid_argument("copy_batch_verified: item " + std::to_string(i) + " has " +
                                  std::to_string(items[i].nbytes) + " bytes: " + std::to_string(n) +
                                  " CRCs expected, got " + std::to_string(expected[i].size()));
    for (std::size_t k = 0; k < n; ++k) pieces.push_back(Piece{i, k});
  }
  std::vector<uint32_t> found(pieces.size(), 0);
  std::vector<unsigned char> ok(pieces.size(), 0);
  const int nthreads = std::max(1, threads);
  const std::size_t per = std::max<std::size_t>(1, pieces.size() / (nthreads * kTasksPerThread));
  const std::size_t ntasks = (pieces.size() + per - 1) / per;
  // Software-pipelined per task: while chunk p is copied (from cache: it was just checksummed),
  // chunk p + 1 is checksummed, block by block, so the CRC work and the stores overlap.
  parallel_for(ntasks, nthreads, [&](std::size_t t) {
    const std::size_t first = t * per, last = std::min(pieces.size(), (t + 1) * per);
    auto src_of = [&](std::size_t p) {
      return static_cast<const unsigned char*>(items[pieces[p].item].src) + pieces[p].chunk * C;
    };
    auto len_of = [&](std::size_t p) {
      return std::min(C, items[pieces[p].item].nbytes - pieces[p].chunk * C);
    };
    if (first >= last) return;
    found[first] = crc32c_update(0, src_of(first), len_of(first));
    for (std::size_t p = first; p < last; ++p) {
      ok[p] = found[p] == expected[pieces[p].item][pieces[p].chunk];
      const bool has_next = p + 1 < last;
      const unsigned char* s = src_of(p);
      unsigned char* d = static_cast<unsigned char*>(items[pieces[p].item].dst) + pieces[p].chunk * C;
      const std::size_t n = len_of(p);
      const unsigned char* ns = has_next ? src_of(p + 1) : nullptr;
      const std::size_t nn = has_next ? len_of(p + 1) : 0;
      // the next chunk checksummed while this one (checked, in cache) is copied
      const uint32_t next = crc32c_update_while_copying(0, ns, nn, d, s, ok[p] ? n : 0);
      if (has_next) found[p + 1] = next;
    }
    stream_fence();
  });
  std::vector<BadChunk> bad;
  for (std::size_t p = 0; p < pieces.size(); ++p)
    if (!ok[p]) bad.push_back(BadChunk{pieces[p].item, pieces[p].chunk, found[p]});
  return bad;
}

void copy_parallel(void* dst, const void* src, std::size_t n, int threads) {
  if (threads <= 1 || n < 2 * kMinTask) {
    copy_bytes(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), n);
    return;
  }
  CopyOptions o;
  o.threads = threads;
  copy_batch({CopyItem{dst, src, n}}, o);
}

// ---------------------------------------------------------------------------------------------
// Strided (N-D window) copy

namespace {

// Runs of a strided copy at least this long are written with streaming stores (four quarters of
// the run at once, see stream_quarters_avx2) when the whole window is at least kMinTask bytes.
// Measured on [N, 2k] <-> [N, k] column windows of 128 MiB (1 and 2 threads): from 1 KiB runs
// 1.2-1.6x faster than memcpy when the destination is strided; when only the source is, about
// even for 1-4 KiB runs and 1.1-1.3x faster for 8-16 KiB runs.
constexpr std::size_t kStridedStreamRun = 1024;

// The streaming run copier, or null when the CPU has none (then memcpy). It issues no fence.
CopyFn strided_stream_fn() {
  static const CopyFn fn = [] {
#ifdef UCPD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return static_cast<CopyFn>(stream_quarters_avx2);
#endif
    return static_cast<CopyFn>(nullptr);
  }();
  return fn;
}

struct SDim {
  std::size_t n, ds, ss;  // size, destination and source strides in bytes
};

// A collapsed window: outer dimensions (outer[0] slowest) over rows; a row is `len` bytes
// contiguous on both sides (contig) or `len` elements of `unit` bytes at byte strides ds / ss.
struct StridedPlan {
  unsigned char* dst = nullptr;
  const unsigned char* src = nullptr;
  SDim outer[kMaxStridedDims];
  int nouter = 0;
  std::size_t rows = 1;
  bool contig = true;
  std::size_t len = 0, unit = 1, ds = 0, ss = 0;
  bool stream = false;  // write runs of at least kStridedStreamRun bytes with streaming stores
};

template <std::size_t U>
void copy_elems_t(unsigned char* d, const unsigned char* s, std::size_t n, std::size_t ds,
                  std::size_t ss) {
  for (; n; --n, d += ds, s += ss) std::memcpy(d, s, U);
}

void copy_elems(unsigned char* d, const unsigned char* s, std::size_t n, std::size_t unit,
                std::size_t ds, std::size_t ss) {
  switch (unit) {
    case 1: return copy_elems_t<1>(d, s, n, ds, ss);
    case 2: return copy_elems_t<2>(d, s, n, ds, ss);
    case 4: return copy_elems_t<4>(d, s, n, ds, ss);
    case 8: return copy_elems_t<8>(d, s, n, ds, ss);
    case 16: return copy_elems_t<16>(d, s, n, ds, ss);
    default:
      for (; n; --n, d += ds, s += ss) std::memcpy(d, s, unit);
  }
}

// Copies part [a, b) (bytes if contig, else elements) of every row in [r0, r1).
void copy_rows(const StridedPlan& p, std::size_t r0, std::size_t r1, std::size_t a,
               std::size_t b) {
  if (a >= b) return;
  std::size_t idx[kMaxStridedDims];
  std::size_t doff = 0, soff = 0, r = r0;
  for (int k = p.nouter - 1; k >= 0; --k) {
    const SDim& g = p.outer[k];
    idx[k] = r % g.n;
    r /= g.n;
    doff += idx[k] * g.ds;
    soff += idx[k] * g.ss;
  }
  const CopyFn stream =
      p.contig && p.stream && b - a >= kStridedStreamRun ? strided_stream_fn() : nullptr;
  for (std::size_t row = r0; row < r1; ++row) {
    unsigned char* d = p.dst + doff;
    const unsigned char* s = p.src + soff;
    if (p.contig) {
      if (stream)
        stream(d + a, s + a, b - a);
      else
        std::memcpy(d + a, s + a, b - a);
    } else {
      copy_elems(d + a * p.ds, s + a * p.ss, b - a, p.unit, p.ds, p.ss);
    }
    // Next row: odometer over the outer dimensions (unsigned wrap-around cancels out).
    for (int k = p.nouter - 1; k >= 0; --k) {
      const SDim& g = p.outer[k];
      doff += g.ds;
      soff += g.ss;
      if (++idx[k] < g.n) break;
      idx[k] = 0;
      doff -= g.n * g.ds;
      soff -= g.n * g.ss;
    }
  }
#ifdef UCPD_X86
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: drain before reporting done
#endif
}

[[noreturn]] void strided_error(const std::string& what) {
  throw std::invalid_argument("copy_strided: " + what);
}

}  // namespace

void copy_strided(void* dst, const std::vector<std::int64_t>& dst_strides, const void* src,
                  const std::vector<std::int64_t>& src_strides,
                  const std::vector<std::int64_t>& shape, std::size_t itemsize, int threads) {
  using u128 = unsigned __int128;
  constexpr u128 kLimit = u128(1) << 62;
  const std::size_t nd = shape.size();
  if (nd > static_cast<std::size_t>(kMaxStridedDims))
    strided_error("at most " + std::to_string(kMaxStridedDims) + " dimensions, got " +
                  std::to_string(nd));
  if (dst_strides.size() != nd || src_strides.size() != nd)
    strided_error("shape has " + std::to_string(nd) + " dimensions but dst_strides has " +
                  std::to_string(dst_strides.size()) + " and src_strides " +
                  std::to_string(src_strides.size()));
  if (itemsize == 0) strided_error("itemsize must be > 0");
  bool empty = false;
  for (std::size_t i = 0; i < nd; ++i) {
    if (shape[i] < 0)
      strided_error("negative size " + std::to_string(shape[i]) + " in dimension " +
                    std::to_string(i));
    if (dst_strides[i] < 0 || src_strides[i] < 0)
      strided_error("negative stride in dimension " + std::to_string(i));
    empty |= shape[i] == 0;
  }
  if (empty) return;
  u128 volume = itemsize, dext = 0, sext = 0;
  for (std::size_t i = 0; i < nd; ++i) {
    const u128 n = static_cast<u128>(shape[i]);
    volume *= n;
    dext += (n - 1) * static_cast<u128>(dst_strides[i]) * itemsize;
    sext += (n - 1) * static_cast<u128>(src_strides[i]) * itemsize;
    if (volume > kLimit || dext > kLimit || sext > kLimit) strided_error("window too large");
  }
  if (!dst || !src) strided_error("null pointer with a non-empty window");

  StridedPlan p;
  p.dst = static_cast<unsigned char*>(dst);
  p.src = static_cast<const unsigned char*>(src);
  SDim dims[kMaxStridedDims];
  int k = 0;
  for (std::size_t i = 0; i < nd; ++i) {
    const std::size_t n = static_cast<std::size_t>(shape[i]);
    const std::size_t ds = static_cast<std::size_t>(dst_strides[i]) * itemsize;
    const std::size_t ss = static_cast<std::size_t>(src_strides[i]) * itemsize;
    if (n == 1) continue;
    if (ds == 0) {  // every index lands on the same destination: the last one wins (numpy)
      p.src += (n - 1) * ss;
      continue;
    }
    dims[k++] = SDim{n, ds, ss};
  }
  // Destination-stride order (slowest first): writes go forward, and a dimension contiguous on
  // both sides ends up innermost. Iteration order does not change the result.
  std::stable_sort(dims, dims + k, [](const SDim& a, const SDim& b) {
    return a.ds != b.ds ? a.ds > b.ds : a.ss > b.ss;
  });
  // Merge each dimension into its outer neighbour when the pair is contiguous on both sides.
  SDim merged[kMaxStridedDims];
  int m = 0;
  for (int i = 0; i < k; ++i) {
    const SDim& g = dims[i];
    if (m > 0 && merged[m - 1].ds == g.n * g.ds && merged[m - 1].ss == g.n * g.ss) {
      merged[m - 1] = SDim{merged[m - 1].n * g.n, g.ds, g.ss};
    } else {
      merged[m++] = g;
    }
  }
  if (m == 0) {
    p.contig = true;
    p.len = itemsize;
  } else if (merged[m - 1].ds == itemsize && merged[m - 1].ss == itemsize) {
    p.contig = true;
    p.len = merged[m - 1].n * itemsize;
    --m;
  } else {
    p.contig = false;
    p.len = merged[m - 1].n;
    p.unit = itemsize;
    p.ds = merged[m - 1].ds;
    p.ss = merged[m - 1].ss;
    --m;
  }
  p.nouter = m;
  for (int i = 0; i < m; ++i) {
    p.outer[i] = merged[i];
    p.rows *= merged[i].n;
  }

  const std::size_t total = static_cast<std::size_t>(volume);
  if (p.contig && p.rows == 1) {  // one run: the contiguous copy (split across threads)
    copy_parallel(p.dst, p.src, p.len, threads);
    return;
  }
  p.stream = total >= kMinTask;
  std::size_t want = 1;
  if (threads > 1 && total >= 2 * kMinTask)
    want = std::min<std::size_t>(static_cast<std::size_t>(threads) * kTasksPerThread,
                                 total / kMinTask);
  if (want <= 1) {
    copy_rows(p, 0, p.rows, 0, p.len);
    return;
  }
  if (p.rows >= want) {  // balanced runs of whole rows
    const std::size_t rows = p.rows;
    parallel_for(want, threads, [&](std::size_t t) {
      copy_rows(p, static_cast<std::size_t>(u128(rows) * t / want),
                static_cast<std::size_t>(u128(rows) * (t + 1) / want), 0, p.len);
    });
    return;
  }
  // Few long rows: split every row into `pieces` parts (64-byte multiples when contiguous).
  const std::size_t pieces = (want + p.rows - 1) / p.rows;
  auto bound = [&](std::size_t j) -> std::size_t {
    if (j >= pieces) return p.len;
    std::size_t x = static_cast<std::size_t>(u128(p.len) * j / pieces);
    if (p.contig) x &= ~std::size_t(63);
    return x;
  };
  parallel_for(p.rows * pieces, threads, [&](std::size_t t) {
    const std::size_t r = t / pieces, j = t % pieces;
    copy_rows(p, r, r + 1, bound(j), bound(j + 1));
  });
}


bool copy_run_streaming(void* dst, const void* src, std::size_t n) {
  const CopyFn fn = n >= kStridedStreamRun ? strided_stream_fn() : nullptr;
  if (!fn) {
    std::memcpy(dst, src, n);
    return false;
  }
  fn(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), n);
  return true;
}

void stream_fence() {
#ifdef UCPD_X86
  _mm_sfence();
#endif
}

}  // namespace ucpd
