// Consolidation with checksums on both sides; see consolidate.h. Hand-written because it is the
// flush's hot path: every byte of a checkpoint passes through it once, and the checksums of
// both the snapshot's chunks and the file's chunks come out of that one pass.
#include "consolidate.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "crc32c.h"
#include "thread_pool.h"

namespace ucpd {
namespace {

constexpr std::size_t kMinTask = 256 * 1024;   // below this a task is not worth a hand-off
constexpr std::size_t kTasksPerThread = 4;     // slack so a slow (preempted) thread is helped
constexpr std::size_t kCopyCrcMin = 64 * 1024; // shorter pieces: CRC, then memcpy while cached

// A contiguous run of a window: dst and src byte offsets, length, source index.
struct Run {
  std::uint64_t dst, src, n;
  std::uint32_t source;
};

// A run cut at the destination's and the source's chunk boundaries and at task boundaries.
struct Seg {
  std::uint64_t dst, src, n;
  std::uint32_t source;
  uint32_t crc;
};

struct DstPart {
  std::uint64_t begin, end;
  uint32_t crc;
};

// crc32c_combine with the shift operators of the last few lengths kept: the runs of a window
// share one length, so most combines cost one GF(2) product.
class Combiner {
 public:
  Combiner() {
    for (auto& l : len_) l = ~std::uint64_t{0};
  }
  uint32_t operator()(uint32_t a, uint32_t b, std::uint64_t len) {
    for (int i = 0; i < kWays; ++i)
      if (len_[i] == len) return crc32c_shift(op_[i], a) ^ b;
    const uint32_t op = crc32c_shift_op(len);
    len_[next_] = len;
    op_[next_] = op;
    next_ = (next_ + 1) % kWays;
    return crc32c_shift(op, a) ^ b;
  }

 private:
  static constexpr int kWays = 8;
  std::uint64_t len_[kWays];
  uint32_t op_[kWays] = {};
  int next_ = 0;
};

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("copy_crc_windows: " + what);
}

// Appends the runs of one copy (contiguous in the destination), in window order.
void add_runs(const CrcWindowCopy& c, const std::vector<CrcSource>& sources, std::size_t dst_nbytes,
              std::vector<Run>& runs) {
  if (c.source >= sources.size()) bad("source index " + std::to_string(c.source) + " out of range");
  const CrcSource& s = sources[c.source];
  const std::size_t nd = c.shape.size();
  if (nd != c.dst_strides.size() || nd > 16) bad("shape and dst_strides need the same length (<= 16)");
  if (c.itemsize == 0) bad("itemsize must be > 0");
  if (c.dst_offset < 0) bad("negative dst_offset");
  std::uint64_t numel = 1;
  for (std::size_t k = 0; k < nd; ++k) {
    if (c.shape[k] < 0 || c.dst_strides[k] < 0) bad("negative size or stride");
    numel *= static_cast<std::uint64_t>(c.shape[k]);
  }
  if (numel == 0) return;
  std::uint64_t last = static_cast<std::uint64_t>(c.dst_offset);
  for (std::size_t k = 0; k < nd; ++k)
    last += static_cast<std::uint64_t>(c.shape[k] - 1) * static_cast<std::uint64_t>(c.dst_strides[k]);
  const std::uint64_t isz = c.itemsize;
  if (c.src_offset + numel * isz > s.nbytes) bad("source range outside its source");
  if ((last + 1) * isz > dst_nbytes) bad("window outside the destination");
  if (!s.ptr) bad("null source pointer");
  // drop size-1 dims; fold the innermost dims that are contiguous in dst into one run
  std::int64_t n[16], st[16];
  int m = 0;
  for (std::size_t k = 0; k < nd; ++k)
    if (c.shape[k] != 1) {
      n[m] = c.shape[k];
      st[m] = c.dst_strides[k];
      ++m;
    }
  std::uint64_t run = 1;
  while (m > 0 && static_cast<std::uint64_t>(st[m - 1]) == run) {
    run *= static_cast<std::uint64_t>(n[m - 1]);
    --m;
  }
  const std::uint64_t run_bytes = run * isz, count = numel / run;
  std::int64_t idx[16] = {0};
  std::int64_t off = c.dst_offset;
  std::uint64_t src = c.src_offset;
  runs.reserve(runs.size() + count);
  for (std::uint64_t r = 0; r < count; ++r) {
    runs.push_back(Run{static_cast<std::uint64_t>(off) * isz, src, run_bytes, static_cast<std::uint32_t>(c.source)});
    src += run_bytes;
    for (int k = m - 1; k >= 0; --k) {
      off += st[k];
      if (++idx[k] < n[k]) break;
      off -= st[k] * n[k];
      idx[k] = 0;
    }
  }
}

}  // namespace

ConsolidateResult copy_crc_windows(void* dst, std::size_t dst_nbytes, std::size_t dst_origin,
                                   std::size_t dst_chunk, const std::vector<CrcSource>& sources,
                                   const std::vector<CrcWindowCopy>& copies, int threads) {
  if (dst_chunk == 0) bad("dst_chunk must be > 0");
  for (const CrcSource& s : sources)
    if (s.chunk == 0) bad("a source's chunk must be > 0");
  std::vector<Run> runs;
  for (const CrcWindowCopy& c : copies) add_runs(c, sources, dst_nbytes, runs);

  ConsolidateResult out;
  const std::uint64_t C = dst_chunk, phase = dst_origin % dst_chunk;
  const std::size_t npieces = dst_nbytes ? (dst_nbytes + phase + C - 1) / C : 0;
  out.dst_crcs.assign(npieces, 0);
  out.dst_covered.assign(npieces, 0);
  if (runs.empty()) return out;
  if (!dst) bad("null destination pointer");
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.dst < b.dst; });
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (i + 1 < runs.size() && runs[i].dst + runs[i].n > runs[i + 1].dst) bad("windows overlap");
    total += runs[i].n;
  }

  threads = std::max(1, threads);
  std::uint64_t task_bytes = total;
  if (threads > 1) task_bytes = std::max<std::uint64_t>(kMinTask, total / (threads * kTasksPerThread) + 1);

  std::vector<Seg> segs;
  segs.reserve(runs.size() + total / C + 2 * total / task_bytes + 4);
  std::vector<std::size_t> task_first;
  std::uint64_t pos = 0, cur_task = ~std::uint64_t{0};
  for (const Run& r : runs) {
    const std::uint64_t sc = sources[r.source].chunk;
    for (std::uint64_t off = 0; off < r.n;) {
      const std::uint64_t d = r.dst + off, s = r.src + off;
      std::uint64_t len = r.n - off;
      len = std::min(len, task_bytes - pos % task_bytes);
      len = std::min(len, C - (d + phase) % C);
      len = std::min(len, sc - s % sc);
      const std::uint64_t task = pos / task_bytes;
      if (task != cur_task) {
        task_first.push_back(segs.size());
        cur_task = task;
      }
      segs.push_back(Seg{d, s, len, r.source, 0});
      off += len;
      pos += len;
    }
  }
  task_first.push_back(segs.size());
  const std::size_t ntasks = task_first.size() - 1;

  std::vector<std::vector<DstPart>> dparts(ntasks);
  std::vector<std::vector<CrcRange>> sparts(ntasks);
  auto* dbase = static_cast<unsigned char*>(dst);
  parallel_for(ntasks, threads, [&](std::size_t t) {
    const std::size_t first = task_first[t], last = task_first[t + 1];
    for (std::size_t i = first; i < last; ++i) {
      Seg& g = segs[i];
      const auto* s = static_cast<const unsigned char*>(sources[g.source].ptr) + g.src;
      unsigned char* d = dbase + g.dst;
      if (g.n >= kCopyCrcMin) {
        g.crc = crc32c_copy(d, s, g.n, 0);
      } else {
        g.crc = crc32c_update(0, s, g.n);
        std::memcpy(d, s, g.n);
      }
    }
    Combiner comb;
    auto& dp = dparts[t];
    auto& sp = sparts[t];
    std::vector<std::ptrdiff_t> active(sources.size(), -1);  // each source's open part in sp
    for (std::size_t i = first; i < last; ++i) {
      const Seg& g = segs[i];
      if (!dp.empty() && dp.back().end == g.dst && (g.dst + phase) % C != 0) {
        dp.back().crc = comb(dp.back().crc, g.crc, g.n);
        dp.back().end += g.n;
      } else {
        dp.push_back(DstPart{g.dst, g.dst + g.n, g.crc});
      }
      const std::ptrdiff_t a = active[g.source];
      if (a >= 0 && sp[a].hi == g.src && g.src % sources[g.source].chunk != 0) {
        sp[a].crc = comb(sp[a].crc, g.crc, g.n);
        sp[a].hi += g.n;
      } else {
        active[g.source] = static_cast<std::ptrdiff_t>(sp.size());
        sp.push_back(CrcRange{g.source, g.src, g.src + g.n, g.crc});
      }
    }
  });

  // Stitch the tasks' parts: destination pieces in order, source ranges by source and offset.
  Combiner comb;
  std::vector<std::uint64_t> reach(npieces);
  for (std::size_t k = 0; k < npieces; ++k) reach[k] = k == 0 ? 0 : k * C - phase;
  for (const auto& dp : dparts)
    for (const DstPart& p : dp) {
      const std::size_t k = (p.begin + phase) / C;
      if (p.begin != reach[k]) continue;  // after a gap: the piece's CRC stays that of its prefix
      out.dst_crcs[k] = comb(out.dst_crcs[k], p.crc, p.end - p.begin);
      reach[k] = p.end;
    }
  for (std::size_t k = 0; k < npieces; ++k) out.dst_covered[k] = reach[k] - (k == 0 ? 0 : k * C - phase);

  std::vector<CrcRange> all;
  for (auto& sp : sparts) all.insert(all.end(), sp.begin(), sp.end());
  std::sort(all.begin(), all.end(), [](const CrcRange& a, const CrcRange& b) {
    return a.source != b.source ? a.source < b.source : a.lo < b.lo;
  });
  for (const CrcRange& r : all) {
    if (!out.reads.empty()) {
      CrcRange& p = out.reads.back();
      if (p.source == r.source && p.hi == r.lo && r.lo % sources[r.source].chunk != 0) {
        p.crc = comb(p.crc, r.crc, r.hi - r.lo);
        p.hi = r.hi;
        continue;
      }
    }
    out.reads.push_back(r);
  }
  return out;
}

}  // namespace ucpd
