// Scatter with checksums; see scatter.h. Hand-written because it is the resharded-restore hot
// path: numpy would need a separate checksum pass and one thread for the strided copy.
#include "scatter.h"

#include <cstring>
#include <stdexcept>

#include "crc32c.h"
#include "thread_pool.h"

namespace ucpd {
namespace {

struct Window {
  int ndim;
  std::int64_t shape[16];
  std::int64_t dstride[16];
  std::size_t itemsize;
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
  std::int64_t e = e0;
  while (e < e1) {
    const std::int64_t run = std::min(w.shape[last] - idx[last], e1 - e);
    std::int64_t off = 0;
    for (int k = 0; k < w.ndim; ++k) off += idx[k] * w.dstride[k];
    const unsigned char* s = src + e * isz;
    if (w.dstride[last] == 1) {
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
  return crc;
}

}  // namespace

ScatterResult scatter_crc(void* dst, const std::vector<std::int64_t>& dst_strides, const void* src,
                          const std::vector<std::int64_t>& shape, std::size_t itemsize,
                          std::size_t chunk, std::size_t src_offset, int threads) {
  if (shape.size() != dst_strides.size() || shape.size() > 16)
    throw std::invalid_argument("scatter_crc: shape and dst_strides need the same length (<= 16)");
  if (itemsize == 0 || chunk == 0 || chunk % itemsize || src_offset % itemsize)
    throw std::invalid_argument("scatter_crc: chunk and src_offset must be multiples of a non-zero itemsize");
  Window w{};
  w.ndim = static_cast<int>(shape.size());
  w.itemsize = itemsize;
  std::int64_t n = 1;
  for (int k = 0; k < w.ndim; ++k) {
    if (shape[k] < 0 || dst_strides[k] < 0) throw std::invalid_argument("scatter_crc: negative size or stride");
    w.shape[k] = shape[k];
    w.dstride[k] = dst_strides[k];
    n *= shape[k];
  }
  if (w.ndim == 0) {  // a scalar: one element
    w.ndim = 1;
    w.shape[0] = 1;
    w.dstride[0] = 1;
    n = 1;
  }
  ScatterResult out{0, {}};
  if (n == 0) return out;
  if (!dst || !src) throw std::invalid_argument("scatter_crc: null pointer");
  const std::size_t lo = src_offset, hi = src_offset + static_cast<std::size_t>(n) * itemsize;
  // units: [lo, first boundary), whole chunks, [last boundary, hi)
  std::vector<std::size_t> cuts{lo};
  for (std::size_t b = (lo / chunk + 1) * chunk; b < hi; b += chunk) cuts.push_back(b);
  cuts.push_back(hi);
  const std::size_t units = cuts.size() - 1;
  const bool head_whole = lo % chunk == 0;
  const bool tail_whole = hi % chunk == 0;
  out.first_chunk = head_whole ? lo / chunk : lo / chunk + 1;
  std::vector<uint32_t> crc(units, 0);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src) - lo;  // indexed by tensor byte offsets
  const std::int64_t isz = static_cast<std::int64_t>(itemsize);
  parallel_for(units, units > 1 ? threads : 1, [&](std::size_t u) {
    const std::int64_t e0 = static_cast<std::int64_t>(cuts[u] - lo) / isz;
    const std::int64_t e1 = static_cast<std::int64_t>(cuts[u + 1] - lo) / isz;
    crc[u] = copy_range(w, d, s + lo, e0, e1, 0);
  });
  for (std::size_t u = 0; u < units; ++u) {
    const bool whole = (u > 0 || head_whole) && (u + 1 < units || tail_whole);
    if (whole) out.crcs.push_back(crc[u]);
  }
  return out;
}

}  // namespace ucpd
