// Status: the engine's error value. The engine never throws or aborts on bad
// input; the binding layer turns a non-OK Status into a typed Python exception.
#pragma once

#include <string>
#include <utility>

namespace mlkv {

class Status {
 public:
  enum class Code { kOk = 0, kNotFound, kInvalidArgument, kCorruption, kIOError, kBusy };

  Status() = default;
  static Status OK() { return Status(); }
  static Status NotFound(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status InvalidArgument(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
  static Status Corruption(std::string msg) { return Status(Code::kCorruption, std::move(msg)); }
  static Status IOError(std::string msg) { return Status(Code::kIOError, std::move(msg)); }
  static Status Busy(std::string msg) { return Status(Code::kBusy, std::move(msg)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

inline std::string Status::ToString() const {
  static const char* names[] = {"OK", "NotFound", "InvalidArgument", "Corruption", "IOError", "Busy"};
  if (ok()) return "OK";
  return std::string(names[static_cast<int>(code_)]) + ": " + message_;
}

#define MLKV_RETURN_IF_ERROR(expr) \
  do {                             \
    ::mlkv::Status _st = (expr);   \
    if (!_st.ok()) return _st;     \
  } while (0)

}  // namespace mlkv
