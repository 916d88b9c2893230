// RAII view of a Python object's memory through the buffer protocol (numpy arrays, bytes,
// bytearray, mmap, memoryview). The export is held until destruction, so the memory stays
// valid (an mmap cannot be closed, a bytearray cannot be resized) while the GIL is released.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace ucpd {

class PyBuf {
 public:
  PyBuf(nanobind::handle obj, bool writable, const char* what) {
    const int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      std::string reason = "unknown";
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      if (value) {
        PyObject* s = PyObject_Str(value);
        if (s) {
          const char* u = PyUnicode_AsUTF8(s);
          if (u) reason = u;
          Py_DECREF(s);
        }
      }
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      PyErr_Clear();
      throw std::invalid_argument(std::string(what) + ": needs a contiguous " +
                                  (writable ? "writable " : "") +
                                  "buffer (numpy array, bytearray, mmap, memoryview), got " +
                                  Py_TYPE(obj.ptr())->tp_name + " (" + reason + ")");
    }
    held_ = true;
  }
  ~PyBuf() {
    if (held_) PyBuffer_Release(&view_);
  }
  PyBuf(const PyBuf&) = delete;
  PyBuf& operator=(const PyBuf&) = delete;
  PyBuf(PyBuf&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }

  void* data() const { return view_.buf; }
  unsigned char* bytes() const { return static_cast<unsigned char*>(view_.buf); }
  std::size_t size() const { return static_cast<std::size_t>(view_.len); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

}  // namespace ucpd
