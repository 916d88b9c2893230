// Scatter with checksums; see scatter.h. Hand-written because it is the resharded-restore hot
// path: numpy would need a separate checksum pass and one thread for the strided copy.
#include "scatter.h"

#include <cstring>
#include <stdexcept>

#include "copy.h"
#include "crc32c.h"
#include "thread_pool.h"

namespace ucpd {
namespace {

constexpr std::size_t kStreamRunBytes = 1024;           // copy.cpp's kStridedStreamRun
constexpr std::size_t kStreamWindowBytes = 256 * 1024;  // copy.cpp's kMinTask

struct Window {
  int ndim;
  std::int64_t shape[16];
  std::int64_t dstride[16];
  std::size_t itemsize;
  bool stream;  // innermost runs long enough to write with streaming stores (see prepare)
};

// Copies source elements [e0, e1) (row-major order of the window) to their places in dst,
// returning the CRC32C of their bytes continued from `crc`.
uint32_t copy_range(const Window& w, unsigned char* dst, const unsigned char* src, std::int64_t e0,
                    std::int64_t e1, uint32_t crc) {
  std::int64_t idx[16];
  std::int64_t rem = e0;
  for (int k = w.ndim - 1; k >= 0; --k) {
    idx[k] = rem % w.shape[k];
    rem /= w.shape[k];
  }
  const int last = w.ndim - 1;
  const std::size_t isz = w.itemsize;
  bool streamed = false;
  std::int64_t e = e0;
  while (e < e1) {
    const std::int64_t run = std::min(w.shape[last] - idx[last], e1 - e);
    std::int64_t off = 0;
    for (int k = 0; k < w.ndim; ++k) off += idx[k] * w.dstride[k];
    const unsigned char* s = src + e * isz;
    if (w.dstride[last] == 1 && w.stream) {
      // checksum the run (which pulls it into cache), then stream it out: the destination rows
      // are strided, and ordinary stores would read each destination line before writing it
      const std::size_t n = static_cast<std::size_t>(run) * isz;
      crc = crc32c_update(crc, s, n);
      streamed |= copy_run_streaming(dst + off * isz, s, n);
    } else if (w.dstride[last] == 1) {
      crc = crc32c_copy(dst + off * isz, s, static_cast<std::size_t>(run) * isz, crc);
    } else {
      crc = crc32c_update(crc, s, static_cast<std::size_t>(run) * isz);
      for (std::int64_t j = 0; j < run; ++j) std::memcpy(dst + (off + j * w.dstride[last]) * isz, s + j * isz, isz);
    }
    e += run;
    idx[last] += run;
    for (int k = last; k > 0 && idx[k] >= w.shape[k]; --k) {
      idx[k] = 0;
      ++idx[k - 1];
    }
  }
  if (streamed) stream_fence();  // streaming stores are weakly ordered: drain before reporting done
  return crc;
}


// One item prepared: its window and its units (cut at absolute chunk boundaries).
struct Prepared {
  Window w;
  unsigned char* dst;
  const unsigned char* src;  // the window's first source byte
  std::size_t lo, hi;        // source byte range inside the tensor
  std::vector<std::size_t> cuts;
  std::size_t first_unit;    // index of this item's first unit in the shared task list
};

Prepared prepare(const ScatterItem& it) {
  if (it.shape.size() != it.dst_strides.size() || it.shape.size() > 16)
    throw std::invalid_argument("scatter_crc: shape and dst_strides need the same length (<= 16)");
  if (it.itemsize == 0 || it.chunk == 0 || it.chunk % it.itemsize || it.src_offset % it.itemsize)
    throw std::invalid_argument("scatter_crc: chunk and src_offset must be multiples of a non-zero itemsize");
  Prepared p{};
  p.w.ndim = static_cast<int>(it.shape.size());
  p.w.itemsize = it.itemsize;
  std::int64_t n = 1;
  for (int k = 0; k < p.w.ndim; ++k) {
    if (it.shape[k] < 0 || it.dst_strides[k] < 0) throw std::invalid_argument("scatter_crc: negative size or stride");
    p.w.shape[k] = it.shape[k];
    p.w.dstride[k] = it.dst_strides[k];
    n *= it.shape[k];
  }
  if (p.w.ndim == 0) {  // a scalar: one element
    p.w.ndim = 1;
    p.w.shape[0] = 1;
    p.w.dstride[0] = 1;
  }
  // as copy_strided: stream runs of >= 1 KiB of a window of >= 256 KiB (measured 1.2-1.6x faster
  // into strided rows); where crc32c_copy is the one-pass kernel it streams already
  p.w.stream = !crc32c_copy_fused() && p.w.dstride[p.w.ndim - 1] == 1 &&
               static_cast<std::size_t>(p.w.shape[p.w.ndim - 1]) * it.itemsize >= kStreamRunBytes &&
               static_cast<std::size_t>(n) * it.itemsize >= kStreamWindowBytes;
  p.dst = static_cast<unsigned char*>(it.dst);
  p.src = static_cast<const unsigned char*>(it.src);
  p.lo = it.src_offset;
  p.hi = it.src_offset + static_cast<std::size_t>(n) * it.itemsize;
  if (n == 0) return p;
  if (!p.dst || !p.src) throw std::invalid_argument("scatter_crc: null pointer");
  p.cuts.push_back(p.lo);
  for (std::size_t b = (p.lo / it.chunk + 1) * it.chunk; b < p.hi; b += it.chunk) p.cuts.push_back(b);
  p.cuts.push_back(p.hi);
  return p;
}

}  // namespace

std::vector<ScatterResult> scatter_crc_batch(const std::vector<ScatterItem>& items, int threads) {
  std::vector<Prepared> prep;
  prep.reserve(items.size());
  std::vector<std::pair<std::size_t, std::size_t>> tasks;  // (item, unit)
  for (std::size_t i = 0; i < items.size(); ++i) {
    prep.push_back(prepare(items[i]));
    prep.back().first_unit = tasks.size();
    for (std::size_t u = 0; u + 1 < prep.back().cuts.size(); ++u) tasks.emplace_back(i, u);
  }
  std::vector<uint32_t> crc(tasks.size(), 0);
  parallel_for(tasks.size(), tasks.size() > 1 ? threads : 1, [&](std::size_t t) {
    const Prepared& p = prep[tasks[t].first];
    const std::size_t u = tasks[t].second;
    const std::int64_t isz = static_cast<std::int64_t>(p.w.itemsize);
    const std::int64_t e0 = static_cast<std::int64_t>(p.cuts[u] - p.lo) / isz;
    const std::int64_t e1 = static_cast<std::int64_t>(p.cuts[u + 1] - p.lo) / isz;
    crc[t] = copy_range(p.w, p.dst, p.src, e0, e1, 0);
  });
  std::vector<ScatterResult> out(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const Prepared& p = prep[i];
    const std::size_t chunk = items[i].chunk;
    const std::size_t units = p.cuts.empty() ? 0 : p.cuts.size() - 1;
    const bool head_whole = p.lo % chunk == 0, tail_whole = p.hi % chunk == 0;
    out[i].first_chunk = head_whole ? p.lo / chunk : p.lo / chunk + 1;
    for (std::size_t u = 0; u < units; ++u)
      if ((u > 0 || head_whole) && (u + 1 < units || tail_whole)) out[i].crcs.push_back(crc[p.first_unit + u]);
  }
  return out;
}

ScatterResult scatter_crc(void* dst, const std::vector<std::int64_t>& dst_strides, const void* src,
                          const std::vector<std::int64_t>& shape, std::size_t itemsize,
                          std::size_t chunk, std::size_t src_offset, int threads) {
  return scatter_crc_batch({ScatterItem{dst, dst_strides, src, shape, itemsize, chunk, src_offset}}, threads)[0];
}

}  // namespace ucpd
