// Python bindings of ucpd._native. Bindings only: argument conversion, GIL release, and the
// mapping of C++ errors to Python ones (std::invalid_argument -> ValueError,
// std::runtime_error -> RuntimeError). The work lives in the other files of this folder.
// Public contract: ucpd/native.py (the only importer of this module).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer.h"
#include "consolidate.h"
#include "copy.h"
#include "crc32c.h"
#include "parity.h"
#include "reed_solomon.h"
#include "scatter.h"
#include "thread_pool.h"
#ifdef UCPD_HAVE_CUDA
#include "cuda_stage.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace ucpd {
namespace {

int check_threads(int threads) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  return std::min(threads, kMaxThreads);
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// items: iterable of (dst_ptr, src_ptr, nbytes)
std::vector<CopyItem> parse_items(nb::handle items) {
  std::vector<CopyItem> out;
  for (nb::handle h : items) {
    nb::tuple t = nb::borrow<nb::tuple>(h);
    if (!nb::isinstance<nb::tuple>(h) || t.size() != 3)
      throw std::invalid_argument("copy_batch: each item must be a (dst_ptr, src_ptr, nbytes) tuple");
    const uintptr_t dst = nb::cast<uintptr_t>(t[0]);
    const uintptr_t src = nb::cast<uintptr_t>(t[1]);
    const std::size_t n = nb::cast<std::size_t>(t[2]);
    if (n && (!dst || !src)) throw std::invalid_argument("copy_batch: null pointer in a non-empty item");
    out.push_back(CopyItem{as_ptr(dst), reinterpret_cast<const void*>(src), n});
  }
  return out;
}

nb::object crc_lists(const std::vector<std::vector<uint32_t>>& crcs) {
  nb::list out;
  for (const auto& v : crcs) {
    nb::list l;
    for (uint32_t c : v) l.append(nb::int_(c));
    out.append(l);
  }
  return out;
}

}  // namespace
}  // namespace ucpd

NB_MODULE(_native, m) {
  using namespace ucpd;
  m.doc() = "ucpd native kernels (private; use ucpd.native)";

  // ---- copy ----
  m.def("copy", [](nb::handle dst, nb::handle src, int threads) {
    threads = check_threads(threads);
    PyBuf d(dst, true, "copy: dst"), s(src, false, "copy: src");
    if (d.size() < s.size())
      throw std::invalid_argument("copy: dst has " + std::to_string(d.size()) +
                                  " bytes, fewer than src's " + std::to_string(s.size()));
    nb::gil_scoped_release nogil;
    copy_parallel(d.data(), s.data(), s.size(), threads);
  }, "dst"_a, "src"_a, "threads"_a);

  m.def("copy_ptr", [](uintptr_t dst, uintptr_t src, std::size_t n, int threads) {
    threads = check_threads(threads);
    if (n && (!dst || !src)) throw std::invalid_argument("copy_ptr: null pointer");
    nb::gil_scoped_release nogil;
    copy_parallel(as_ptr(dst), as_ptr(src), n, threads);
  }, "dst_ptr"_a, "src_ptr"_a, "nbytes"_a, "threads"_a);

  m.def("copy_strided", [](uintptr_t dst, const std::vector<int64_t>& dst_strides, uintptr_t src,
                           const std::vector<int64_t>& src_strides,
                           const std::vector<int64_t>& shape, std::size_t itemsize, int threads) {
    threads = check_threads(threads);
    nb::gil_scoped_release nogil;
    copy_strided(as_ptr(dst), dst_strides, as_ptr(src), src_strides, shape, itemsize, threads);
  }, "dst_ptr"_a, "dst_strides"_a, "src_ptr"_a, "src_strides"_a, "shape"_a, "itemsize"_a,
     "threads"_a);

  m.def("scatter_crc", [](uintptr_t dst, const std::vector<int64_t>& dst_strides, uintptr_t src,
                          const std::vector<int64_t>& shape, std::size_t itemsize, std::size_t chunk,
                          std::size_t src_offset, int threads) {
    threads = check_threads(threads);
    ScatterResult r;
    {
      nb::gil_scoped_release nogil;
      r = scatter_crc(as_ptr(dst), dst_strides, reinterpret_cast<const void*>(src), shape, itemsize, chunk,
                      src_offset, threads);
    }
    return nb::make_tuple(r.first_chunk, r.crcs);
  }, "dst_ptr"_a, "dst_strides"_a, "src_ptr"_a, "shape"_a, "itemsize"_a, "chunk"_a, "src_offset"_a,
     "threads"_a);

  m.def("scatter_crc_batch", [](nb::list items, int threads) {
    threads = check_threads(threads);
    std::vector<ScatterItem> v;
    v.reserve(items.size());
    for (nb::handle h : items) {
      auto t = nb::cast<nb::tuple>(h);
      if (t.size() != 7) throw std::invalid_argument("scatter_crc_batch: items are 7-tuples");
      v.push_back(ScatterItem{as_ptr(nb::cast<uintptr_t>(t[0])), nb::cast<std::vector<int64_t>>(t[1]),
                              reinterpret_cast<const void*>(nb::cast<uintptr_t>(t[2])),
                              nb::cast<std::vector<int64_t>>(t[3]), nb::cast<std::size_t>(t[4]),
                              nb::cast<std::size_t>(t[5]), nb::cast<std::size_t>(t[6])});
    }
    std::vector<ScatterResult> r;
    {
      nb::gil_scoped_release nogil;
      r = scatter_crc_batch(v, threads);
    }
    nb::list out;
    for (auto& x : r) out.append(nb::make_tuple(x.first_chunk, x.crcs));
    return out;
  }, "items"_a, "threads"_a);

  m.def("copy_crc_windows", [](uintptr_t dst, std::size_t dst_nbytes, std::size_t dst_origin,
                               std::size_t dst_chunk, nb::list sources, nb::list copies, int threads) {
    threads = check_threads(threads);
    std::vector<CrcSource> src;
    src.reserve(sources.size());
    for (nb::handle h : sources) {
      auto t = nb::cast<nb::tuple>(h);
      if (t.size() != 3) throw std::invalid_argument("copy_crc_windows: sources are (ptr, nbytes, chunk)");
      src.push_back(CrcSource{reinterpret_cast<const void*>(nb::cast<uintptr_t>(t[0])), nb::cast<std::size_t>(t[1]),
                              nb::cast<std::size_t>(t[2])});
    }
    std::vector<CrcWindowCopy> cps;
    cps.reserve(copies.size());
    for (nb::handle h : copies) {
      auto t = nb::cast<nb::tuple>(h);
      if (t.size() != 6)
        throw std::invalid_argument(
            "copy_crc_windows: copies are (source, src_offset, dst_offset, shape, dst_strides, itemsize)");
      cps.push_back(CrcWindowCopy{nb::cast<std::size_t>(t[0]), nb::cast<std::size_t>(t[1]), nb::cast<int64_t>(t[2]),
                                  nb::cast<std::vector<int64_t>>(t[3]), nb::cast<std::vector<int64_t>>(t[4]),
                                  nb::cast<std::size_t>(t[5])});
    }
    ConsolidateResult r;
    {
      nb::gil_scoped_release nogil;
      r = copy_crc_windows(as_ptr(dst), dst_nbytes, dst_origin, dst_chunk, src, cps, threads);
    }
    nb::list crcs, covered, reads;
    for (uint32_t c : r.dst_crcs) crcs.append(nb::int_(c));
    for (auto c : r.dst_covered) covered.append(nb::int_(c));
    for (const CrcRange& x : r.reads) reads.append(nb::make_tuple(x.source, x.lo, x.hi, x.crc));
    return nb::make_tuple(crcs, covered, reads);
  }, "dst_ptr"_a, "dst_nbytes"_a, "dst_origin"_a, "dst_chunk"_a, "sources"_a, "copies"_a, "threads"_a);

  m.def("copy_batch", [](nb::handle items, int threads, std::size_t crc_chunk,
                         const std::string& mode, std::size_t block) -> nb::object {
    CopyOptions o;
    o.threads = check_threads(threads);
    o.crc_chunk = crc_chunk;
    o.block = block;
    if (mode == "fused")
      o.mode = CrcMode::kFused;
    else if (mode == "crc-then-copy")
      o.mode = CrcMode::kCrcThenCopy;
    else if (mode == "copy-then-crc")
      o.mode = CrcMode::kCopyThenCrc;
    else
      throw std::invalid_argument("copy_batch: mode must be fused, crc-then-copy or copy-then-crc");
    std::vector<CopyItem> v = parse_items(items);
    std::vector<std::vector<uint32_t>> crcs;
    {
      nb::gil_scoped_release nogil;
      crcs = copy_batch(v, o);
    }
    if (crc_chunk == 0) return nb::none();
    return crc_lists(crcs);
  }, "items"_a, "threads"_a, "crc_chunk"_a = 0, "mode"_a = "fused", "block"_a = 64 * 1024);
  m.def("crc32c_copy_fused", &crc32c_copy_fused);

  // items: (dst_ptr, src_ptr, nbytes); expected: one list of chunk CRCs per item
  m.def("copy_batch_verified", [](nb::handle items, nb::handle expected, std::size_t chunk, int threads) {
    std::vector<CopyItem> v = parse_items(items);
    std::vector<std::vector<uint32_t>> want;
    for (nb::handle h : expected) {
      std::vector<uint32_t> w;
      for (nb::handle c : h) w.push_back(nb::cast<uint32_t>(c));
      want.push_back(std::move(w));
    }
    const int t = check_threads(threads);
    std::vector<BadChunk> bad;
    {
      nb::gil_scoped_release nogil;
      bad = copy_batch_verified(v, want, chunk, t);
    }
    nb::list out;
    for (const BadChunk& b : bad) out.append(nb::make_tuple(b.item, b.chunk, b.crc));
    return out;
  }, "items"_a, "expected"_a, "chunk"_a, "threads"_a);

  // items: iterable of (ptr, nbytes) or (ptr, nbytes, crc to continue); chunk 0: one CRC per item
  m.def("crc32c_batch", [](nb::handle items, int threads, std::size_t chunk) -> nb::object {
    std::vector<CopyItem> v;
    std::size_t longest = 1;
    for (nb::handle h : items) {
      nb::tuple t = nb::borrow<nb::tuple>(h);
      if (!nb::isinstance<nb::tuple>(h) || (t.size() != 2 && t.size() != 3))
        throw std::invalid_argument("crc32c_batch: each item must be a (ptr, nbytes) or (ptr, nbytes, crc) tuple");
      const uintptr_t ptr = nb::cast<uintptr_t>(t[0]);
      const std::size_t n = nb::cast<std::size_t>(t[1]);
      const uint32_t init = t.size() == 3 ? nb::cast<uint32_t>(t[2]) : 0u;
      if (n && !ptr) throw std::invalid_argument("crc32c_batch: null pointer in a non-empty item");
      v.push_back(CopyItem{nullptr, reinterpret_cast<const void*>(ptr), n, init});
      longest = std::max(longest, n);
    }
    CopyOptions o;
    o.threads = check_threads(threads);
    o.mode = CrcMode::kCrcOnly;
    o.crc_chunk = chunk ? chunk : longest;
    std::vector<std::vector<uint32_t>> crcs;
    {
      nb::gil_scoped_release nogil;
      crcs = copy_batch(v, o);
    }
    if (chunk) return crc_lists(crcs);
    nb::list out;
    for (std::size_t i = 0; i < v.size(); ++i) out.append(nb::int_(crcs[i].empty() ? v[i].crc_init : crcs[i][0]));
    return out;
  }, "items"_a, "threads"_a, "chunk"_a = 0);

  m.def("pool_workers", &pool_worker_count);

  // ---- crc32c ----
  m.def("crc32c", [](nb::handle buf, uint32_t value) {
    PyBuf b(buf, false, "crc32c: buf");
    nb::gil_scoped_release nogil;
    return crc32c_update(value, b.data(), b.size());
  }, "buf"_a, "value"_a = 0);
  m.def("crc32c_ptr", [](uintptr_t ptr, std::size_t n, uint32_t value) {
    if (n && !ptr) throw std::invalid_argument("crc32c_ptr: null pointer");
    nb::gil_scoped_release nogil;
    return crc32c_update(value, as_ptr(ptr), n);
  }, "ptr"_a, "nbytes"_a, "value"_a = 0);
  m.def("crc32c_portable", [](nb::handle buf, uint32_t value) {
    PyBuf b(buf, false, "crc32c_portable: buf");
    nb::gil_scoped_release nogil;
    return crc32c_portable(value, b.data(), b.size());
  }, "buf"_a, "value"_a = 0);
  m.def("crc32c_combine", &crc32c_combine, "crc_a"_a, "crc_b"_a, "len_b"_a);
  m.def("crc32c_backend", [] { return std::string(crc32c_backend()); });
  auto chunks = [](const void* p, std::size_t n, std::size_t chunk, int threads) {
    if (chunk == 0) throw std::invalid_argument("crc32c_chunks: chunk must be > 0");
    std::vector<uint32_t> out(n ? (n + chunk - 1) / chunk : 0);
    {
      nb::gil_scoped_release nogil;
      crc32c_chunks(p, n, chunk, threads, out.data());
    }
    return out;
  };
  m.def("crc32c_chunks", [chunks](nb::handle buf, std::size_t chunk, int threads) {
    threads = check_threads(threads);
    PyBuf b(buf, false, "crc32c_chunks: buf");
    return chunks(b.data(), b.size(), chunk, threads);
  }, "buf"_a, "chunk"_a, "threads"_a);
  m.def("crc32c_chunks_ptr", [chunks](uintptr_t ptr, std::size_t n, std::size_t chunk, int threads) {
    threads = check_threads(threads);
    if (n && !ptr) throw std::invalid_argument("crc32c_chunks_ptr: null pointer");
    return chunks(as_ptr(ptr), n, chunk, threads);
  }, "ptr"_a, "nbytes"_a, "chunk"_a, "threads"_a);

  m.def("crc32c_chunks_match", [](nb::handle items, std::size_t chunk, int threads) -> nb::object {
    // items: iterable of (ptr, nbytes, expected chunk CRCs); returns one bool per item
    threads = check_threads(threads);
    if (chunk == 0) throw std::invalid_argument("crc32c_chunks_match: chunk must be > 0");
    std::vector<const void*> data;
    std::vector<std::size_t> sizes;
    std::vector<std::vector<uint32_t>> expected;
    for (nb::handle it : items) {
      nb::tuple t = nb::cast<nb::tuple>(it);
      if (t.size() != 3)
        throw std::invalid_argument("crc32c_chunks_match: each item must be a (ptr, nbytes, crcs) tuple");
      const uintptr_t ptr = nb::cast<uintptr_t>(t[0]);
      const std::size_t n = nb::cast<std::size_t>(t[1]);
      if (n && !ptr) throw std::invalid_argument("crc32c_chunks_match: null pointer in a non-empty item");
      std::vector<uint32_t> crcs = nb::cast<std::vector<uint32_t>>(t[2]);
      if (crcs.size() != (n + chunk - 1) / chunk)
        throw std::invalid_argument("crc32c_chunks_match: an item needs one CRC per chunk of its bytes");
      data.push_back(reinterpret_cast<const void*>(ptr));
      sizes.push_back(n);
      expected.push_back(std::move(crcs));
    }
    std::vector<const uint32_t*> want(expected.size());
    for (std::size_t k = 0; k < expected.size(); ++k) want[k] = expected[k].data();
    std::vector<bool> same;
    {
      nb::gil_scoped_release nogil;
      same = crc32c_chunks_match(data, sizes, want, chunk, threads);
    }
    nb::list out;
    for (bool b : same) out.append(nb::bool_(b));
    return out;
  }, "items"_a, "chunk"_a, "threads"_a);

  // ---- parity ----
  m.def("xor_parity", [](nb::handle out, nb::handle inputs, int threads) {
    threads = check_threads(threads);
    PyBuf o(out, true, "xor_parity: out");
    std::vector<PyBuf> held;
    for (nb::handle h : inputs) held.emplace_back(h, false, "xor_parity: input");
    std::vector<ConstSpan> spans;
    for (const PyBuf& b : held) spans.push_back(ConstSpan{b.bytes(), b.size()});
    nb::gil_scoped_release nogil;
    xor_parity(o.bytes(), o.size(), spans, threads);
  }, "out"_a, "inputs"_a, "threads"_a);
  m.def("xor_parity_ptr", [](uintptr_t out, std::size_t out_len, nb::handle inputs, int threads) {
    threads = check_threads(threads);
    if (out_len && !out) throw std::invalid_argument("xor_parity_ptr: null out pointer");
    std::vector<ConstSpan> spans;
    for (nb::handle h : inputs) {
      nb::tuple t = nb::borrow<nb::tuple>(h);
      if (!nb::isinstance<nb::tuple>(h) || t.size() != 2)
        throw std::invalid_argument("xor_parity_ptr: each input must be a (ptr, nbytes) tuple");
      const uintptr_t p = nb::cast<uintptr_t>(t[0]);
      const std::size_t n = nb::cast<std::size_t>(t[1]);
      if (n && !p) throw std::invalid_argument("xor_parity_ptr: null input pointer");
      spans.push_back(ConstSpan{reinterpret_cast<const unsigned char*>(p), n});
    }
    nb::gil_scoped_release nogil;
    xor_parity(static_cast<unsigned char*>(as_ptr(out)), out_len, spans, threads);
  }, "out_ptr"_a, "out_len"_a, "inputs"_a, "threads"_a);
  m.def("xor_backend", [] { return std::string(xor_backend()); });

  // ---- reed-solomon ----
  m.def("rs_parity_matrix", [](int k, int m) {
    std::vector<uint8_t> c = rs_parity_matrix(k, m);
    return nb::bytes(reinterpret_cast<const char*>(c.data()), c.size());
  }, "k"_a, "m"_a);
  m.def("rs_backend", [] { return std::string(rs_backend()); });
  m.def("rs_encode", [](nb::handle data, nb::handle parity, int threads) {
    threads = check_threads(threads);
    std::vector<PyBuf> d, p;
    for (nb::handle h : data) d.emplace_back(h, false, "rs_encode: data shard");
    for (nb::handle h : parity) p.emplace_back(h, true, "rs_encode: parity shard");
    if (d.empty() || p.empty()) throw std::invalid_argument("rs_encode: need >= 1 data and >= 1 parity shard");
    const std::size_t len = d[0].size();
    for (const PyBuf& b : d)
      if (b.size() != len) throw std::invalid_argument("rs_encode: data shards differ in length");
    for (const PyBuf& b : p)
      if (b.size() != len) throw std::invalid_argument("rs_encode: parity shards must have the data shards' length " + std::to_string(len));
    std::vector<const unsigned char*> dp;
    std::vector<unsigned char*> pp;
    for (const PyBuf& b : d) dp.push_back(b.bytes());
    for (const PyBuf& b : p) pp.push_back(b.bytes());
    nb::gil_scoped_release nogil;
    rs_encode(dp, pp, len, threads);
  }, "data"_a, "parity"_a, "threads"_a);
  m.def("rs_decode", [](nb::handle shards, int k, int m, nb::handle missing_out, int threads) {
    // shards: sequence of k+m buffers or None; missing_out: sequence of (index, writable buffer)
    threads = check_threads(threads);
    std::vector<PyBuf> held;
    std::vector<int> present_idx;
    int i = 0;
    for (nb::handle h : shards) {
      if (!h.is_none()) {
        held.emplace_back(h, false, "rs_decode: shard");
        present_idx.push_back(i);
      }
      ++i;
    }
    if (i != k + m) throw std::invalid_argument("rs_decode: got " + std::to_string(i) + " shards, expected k + m = " + std::to_string(k + m));
    std::vector<const unsigned char*> ptrs(k + m, nullptr);
    std::size_t len = SIZE_MAX;
    for (std::size_t j = 0; j < held.size(); ++j) {
      if (len == SIZE_MAX) len = held[j].size();
      if (held[j].size() != len) throw std::invalid_argument("rs_decode: present shards differ in length");
      ptrs[present_idx[j]] = held[j].bytes();
    }
    std::vector<int> missing;
    std::vector<PyBuf> outs;
    for (nb::handle h : missing_out) {
      nb::tuple t = nb::borrow<nb::tuple>(h);
      if (!nb::isinstance<nb::tuple>(h) || t.size() != 2) throw std::invalid_argument("rs_decode: missing_out items are (index, buffer)");
      const int idx = nb::cast<int>(t[0]);
      if (idx < 0 || idx >= k + m || ptrs[idx]) throw std::invalid_argument("rs_decode: output index " + std::to_string(idx) + " is not a missing shard");
      missing.push_back(idx);
      outs.emplace_back(t[1], true, "rs_decode: output shard");
      if (len != SIZE_MAX && outs.back().size() < len) throw std::invalid_argument("rs_decode: output shard shorter than the shards (" + std::to_string(len) + " bytes)");
    }
    if (len == SIZE_MAX) len = 0;
    std::vector<unsigned char*> op;
    for (const PyBuf& b : outs) op.push_back(b.bytes());
    nb::gil_scoped_release nogil;
    rs_decode(k, m, ptrs, missing, op, len, threads);
  }, "shards"_a, "k"_a, "m"_a, "missing_out"_a, "threads"_a);

  // ---- cuda ----
#ifdef UCPD_HAVE_CUDA
  m.attr("cuda_compiled") = true;
  namespace cu = ucpd::cuda;
  m.def("cuda_available", [] {
    nb::gil_scoped_release nogil;
    return cu::available();
  });
  m.def("cuda_device_count", [] {
    nb::gil_scoped_release nogil;
    return cu::device_count();
  });
  m.def("host_register", [](uintptr_t ptr, std::size_t n, bool read_only) {
    if (!ptr || !n) throw std::invalid_argument("host_register: need a non-null pointer and nbytes > 0");
    nb::gil_scoped_release nogil;
    cu::host_register(as_ptr(ptr), n, read_only);
  }, "ptr"_a, "nbytes"_a, "read_only"_a = false);
  m.def("host_unregister", [](uintptr_t ptr) {
    nb::gil_scoped_release nogil;
    cu::host_unregister(as_ptr(ptr));
  }, "ptr"_a);
  m.def("stream_create", [](int device) {
    nb::gil_scoped_release nogil;
    return cu::stream_create(device);
  }, "device"_a);
  m.def("stream_destroy", [](uintptr_t s) {
    nb::gil_scoped_release nogil;
    cu::stream_destroy(s);
  }, "stream"_a);
  m.def("stream_synchronize", [](uintptr_t s) {
    nb::gil_scoped_release nogil;
    cu::stream_synchronize(s);
  }, "stream"_a);
  m.def("stream_query", [](uintptr_t s) { return cu::stream_query(s); }, "stream"_a);
  m.def("event_create", [](bool timing) { return cu::event_create(timing); }, "timing"_a);
  m.def("event_destroy", [](uintptr_t e) { cu::event_destroy(e); }, "event"_a);
  m.def("event_record", [](uintptr_t e, uintptr_t s) { cu::event_record(e, s); }, "event"_a, "stream"_a);
  m.def("event_synchronize", [](uintptr_t e) {
    nb::gil_scoped_release nogil;
    cu::event_synchronize(e);
  }, "event"_a);
  m.def("event_query", [](uintptr_t e) { return cu::event_query(e); }, "event"_a);
  auto batch = [](bool to_host, nb::handle items, uintptr_t base, uintptr_t stream,
                  std::size_t small, std::size_t host_nbytes) {
    std::vector<cu::BatchItem> v;
    for (nb::handle h : items) {
      nb::tuple t = nb::borrow<nb::tuple>(h);
      if (!nb::isinstance<nb::tuple>(h) || t.size() != 3)
        throw std::invalid_argument("batched copy: each item must be a (device_ptr, host_offset, nbytes) tuple");
      v.push_back(cu::BatchItem{nb::cast<uintptr_t>(t[0]), nb::cast<std::size_t>(t[1]),
                                nb::cast<std::size_t>(t[2])});
    }
    if (!base) throw std::invalid_argument("batched copy: null host buffer");
    cu::BatchStats st;
    {
      nb::gil_scoped_release nogil;
      st = to_host ? cu::pack_d2h(v, as_ptr(base), host_nbytes, stream, small)
                   : cu::unpack_h2d(v, as_ptr(base), host_nbytes, stream, small);
    }
    nb::dict d;
    d["kernel_items"] = st.kernel_items;
    d["kernel_bytes"] = st.kernel_bytes;
    d["memcpy_items"] = st.memcpy_items;
    d["memcpy_bytes"] = st.memcpy_bytes;
    return d;
  };
  m.def("pack_d2h", [batch](nb::handle items, uintptr_t base, uintptr_t stream, std::size_t small,
                            std::size_t host_nbytes) {
    return batch(true, items, base, stream, small, host_nbytes);
  }, "items"_a, "dst_base_ptr"_a, "stream"_a, "small_threshold"_a, "dst_nbytes"_a = 0);
  m.def("unpack_h2d", [batch](nb::handle items, uintptr_t base, uintptr_t stream, std::size_t small,
                              std::size_t host_nbytes) {
    return batch(false, items, base, stream, small, host_nbytes);
  }, "items"_a, "src_base_ptr"_a, "stream"_a, "small_threshold"_a, "src_nbytes"_a = 0);
  m.def("copy_h2d_async", [](uintptr_t dst, uintptr_t src, std::size_t n, uintptr_t stream) {
    nb::gil_scoped_release nogil;
    cu::copy_h2d_async(dst, as_ptr(src), n, stream);
  }, "dst_dev"_a, "src_host"_a, "nbytes"_a, "stream"_a);
  m.def("copy_d2h_async", [](uintptr_t dst, uintptr_t src, std::size_t n, uintptr_t stream) {
    nb::gil_scoped_release nogil;
    cu::copy_d2h_async(as_ptr(dst), src, n, stream);
  }, "dst_host"_a, "src_dev"_a, "nbytes"_a, "stream"_a);
  m.def("copy_h2d_2d_async", [](uintptr_t dst, std::size_t dpitch, uintptr_t src, std::size_t spitch,
                                std::size_t width, std::size_t rows, uintptr_t stream) {
    if (spitch < width || dpitch < width)
      throw std::invalid_argument("copy_h2d_2d_async: a pitch is smaller than the row width");
    nb::gil_scoped_release nogil;
    cu::copy_h2d_2d_async(dst, dpitch, as_ptr(src), spitch, width, rows, stream);
  }, "dst_dev"_a, "dst_pitch"_a, "src_host"_a, "src_pitch"_a, "width"_a, "rows"_a, "stream"_a);
#else
  m.attr("cuda_compiled") = false;
#endif
}
