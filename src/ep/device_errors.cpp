// What the kernels' device error records say, as the Buffer throws them.
#include <sstream>
#include <string>

#include "buffer_state.hpp"
#include "weft/core/error.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep {
namespace {

const char* wait_name(int64_t what) {
  switch (what) {
    case detail::kWaitHandshake: return "the construction handshake of a peer";
    case detail::kWaitCounts: return "a peer's count vector (dispatch count exchange)";
    case detail::kWaitDispatchDone: return "a peer's dispatched rows (dispatch completion)";
    case detail::kWaitCombineEntry: return "a peer to enter combine (its slots to be free)";
    case detail::kWaitCombineRow: return "a peer's expert output row (combine store-back)";
    case detail::kWaitGridBarrier: return "the other blocks of its own kernel (grid barrier)";
    case detail::kWaitCachedEntry: return "a peer to enter a cached dispatch (its rows to be free)";
    default: return "an unknown event";
  }
}

std::string describe(const cuda::DeviceErrorRecord& r, const BufferConfig& config,
                     double timeout_s) {
  std::ostringstream out;
  switch (r.code) {
    case detail::kErrBadExpert:
      out << "weft::ep dispatch on rank " << r.rank << ": token " << r.args[0] << " selection "
          << r.args[1] << " has expert id " << r.args[2] << ", out of range [0, "
          << config.num_experts << ") and not -1 (the selection was dropped)";
      break;
    case detail::kErrTimeout:
      out << "weft::ep on rank " << r.rank << " timed out after " << timeout_s
          << " s waiting for " << wait_name(r.args[0]);
      if (r.args[1] >= 0) out << " from rank " << r.args[1];
      out << " in call " << r.args[2];
      break;
    case detail::kErrPeerFailed:
      out << "weft::ep on rank " << r.rank << ": rank " << r.args[1] << " failed call "
          << r.args[2] << " (a wait timed out there) while this rank waited for "
          << wait_name(r.args[0]) << "; the rows of that call are incomplete";
      break;
    case detail::kErrTooManyRows:
      out << "weft::ep combine on rank " << r.rank << ": " << r.args[0]
          << " rows were received but " << (r.args[2] != 0 ? "topk_weights" : "expert_out")
          << " has only " << r.args[1]
          << " rows; none was read or sent, out was not written";
      break;
    case detail::kErrPeerRowsMissing:
      out << "weft::ep combine on rank " << r.rank << ": rank " << r.args[0]
          << " sent no rows (its expert_out has fewer rows than it received) in call "
          << r.args[1] << "; the tokens it contributes to were not written to out";
      break;
    case detail::kErrLayoutMismatch:
      out << "weft::ep on rank " << r.rank << ": a combine, cached dispatch or copy_out of the "
          << "layout of dispatch " << r.args[0] << " ran while the layout of dispatch "
          << r.args[1] << " was in place (a CUDA graph replayed out of order?); the call was "
          << "skipped (a copy_out writes padding rows only)";
      break;
    case detail::kErrBadSource:
      out << "weft::ep combine on rank " << r.rank << ": received row " << r.args[0]
          << " names source (rank " << r.args[1] << ", token " << r.args[2]
          << "), out of range (recv_src overwritten?); that row was not sent back";
      break;
    case detail::kErrTokensOverflow:
      out << "weft::ep dispatch on rank " << r.rank << ": rank " << r.args[0] << " dispatched "
          << r.args[1] << " tokens, above max_tokens " << r.args[2] << "; no rank moved any row "
          << "(num_recv 0, tokens_required " << r.args[1] << " on every rank); rebuild every "
          << "rank's Buffer with max_tokens >= " << r.args[1] << " and dispatch again "
          << "(CountMode::kExact reports this in DispatchResult::tokens_required instead)";
      break;
    case detail::kErrOverflowedLayout:
      out << "weft::ep combine or cached dispatch on rank " << r.rank << ": its layout is that "
          << "of a dispatch that moved no rows (rank " << r.args[0] << " dispatched " << r.args[1]
          << " tokens, above max_tokens " << r.args[2] << "); the call was skipped on every rank";
      break;
    case detail::kErrExpandOverflow:
      out << "weft::ep combine on rank " << r.rank << ": the expanded dispatch it combines "
          << "overflowed at rank " << r.args[0] << ", which needed " << r.args[1]
          << " rows for a capacity of " << r.args[2] << " (raise BufferConfig::expand_factor); "
          << "no rank combined anything, out was not written";
      break;
    case detail::kErrTooManyHeads:
      out << "weft::ep combine on rank " << r.rank << ": " << r.args[0] << " received rows head "
          << "a chain, but there are at most " << r.args[1] << " (source, token) pairs "
          << "(expand_chain overwritten?); the chains past those were not sent back";
      break;
    default:
      out << "weft::ep on rank " << r.rank << ": device error code " << r.code;
  }
  return out.str();
}

}  // namespace

void Buffer::throw_if_device_error() {
  detail::BufferState& st = *state_;
  // A fatal error first (a bad-data error recorded before it must not hide it), and for good.
  if (st.unusable.empty() && st.fatal.raised()) {
    st.unusable = describe(st.fatal.read(), config_, options_.timeout_s) +
                  "; the ranks no longer agree on the call sequence, so this Buffer refuses "
                  "every call: destroy the Buffers of every rank and build new ones";
  }
  WEFT_CHECK(st.unusable.empty(), st.unusable);
  st.error.throw_if_raised([&](const cuda::DeviceErrorRecord& r) {
    return describe(r, config_, options_.timeout_s);
  });
}

void Buffer::check() { throw_if_device_error(); }

}  // namespace weft::ep
