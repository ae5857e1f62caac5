#include "hierarchy.h"

#include <algorithm>
#include <exception>
#include <numeric>

#include "../core/types.h"
#include "comm.h"

namespace pycomm {

namespace {
thread_local bool t_composing = false;
thread_local const ComposedWire* t_wire = nullptr;
}  // namespace

bool in_composed_op() { return t_composing; }

ComposedOpScope::ComposedOpScope() : outer_(t_composing) { t_composing = true; }
ComposedOpScope::~ComposedOpScope() { t_composing = outer_; }

const ComposedWire* composed_wire() { return t_wire; }

ComposedWireScope::ComposedWireScope(const ComposedWire* wire) : outer_(t_wire) { t_wire = wire; }
ComposedWireScope::~ComposedWireScope() { t_wire = outer_; }

const std::vector<HierStep>& all_reduce_steps(const std::string& which) {
  static const std::vector<HierStep> large{{"intra", "reduce_scatter", false},
                                           {"inter", "all_reduce", true},
                                           {"intra", "all_gather", false}};
  static const std::vector<HierStep> small{{"intra", "all_reduce", false},
                                           {"inter", "all_reduce", false}};
  if (which == "large") return large;
  if (which == "small") return small;
  throw UsageError("all_reduce_steps: 'large' or 'small', not '" + which + "'");
}

const std::vector<HierStep>& all_reduce_steps(size_t bytes) {
  return all_reduce_steps(bytes <= kSmallBytes ? "small" : "large");
}

int HostLayout::n_hosts() const {
  return host.empty() ? 0 : *std::max_element(host.begin(), host.end()) + 1;
}

int HostLayout::n_local() const {
  return static_cast<int>(std::count(host.begin(), host.end(), host.empty() ? 0 : host[0]));
}

Hierarchy::Hierarchy(HostLayout layout, int rank, std::shared_ptr<Comm> intra,
                     std::shared_ptr<Comm> inter)
    : layout_(std::move(layout)), rank_(rank), intra_(std::move(intra)), inter_(std::move(inter)) {
  const int n = static_cast<int>(layout_.host.size());
  if (!intra_ || !inter_ || layout_.local.size() != layout_.host.size() || rank < 0 || rank >= n) {
    throw UsageError("compose_hosts: the layout, the rank and the two parts must fit together");
  }
  host_ = layout_.host[rank];
  local_ = layout_.local[rank];
  const int L = layout_.n_local(), H = layout_.n_hosts();
  if (L < 2 || H < 2 || L * H != n || intra_->world_size() != L || inter_->world_size() != H ||
      intra_->rank() != local_ || inter_->rank() != host_) {
    throw UsageError(cat("compose_hosts: ", n, " ranks on ", H, " hosts of ", L,
                         " ranks do not match the parts (intra ", intra_->world_size(), ", inter ",
                         inter_->world_size(), ")"));
  }
  std::vector<int64_t> rows(n);
  for (int g = 0; g < n; ++g) rows[g] = int64_t(layout_.local[g]) * H + layout_.host[g];
  lh_rows_ = at::tensor(rows, at::kLong);
  by_column_ = lh_rows_.argsort();
}

bool Hierarchy::takes(const at::Tensor& t, const std::string& algo, int op) const {
  if (!(t.is_cpu() && t.is_contiguous() && t.numel() > 0 && (algo == "auto" || algo == "ring"))) {
    return false;
  }
  return !(op == static_cast<int>(ReduceOp::kAvg) && !at::isFloatingType(t.scalar_type()));
}

bool Hierarchy::takes_all_reduce(const at::Tensor& t, const std::string& algo, int op,
                                 bool cast_wire, bool quantized, bool to_register) const {
  // A 16-bit wire runs flat; a quantized one composes (algo "auto", checked)
  // unless a registration is asked for.
  return takes(t, algo, op) && !cast_wire && !(quantized && to_register);
}

bool Hierarchy::takes_chunked(const at::Tensor& whole, const at::Tensor& part,
                              const std::string& algo, int op) const {
  return takes(part, algo, op) && whole.is_contiguous() && whole.dtype() == part.dtype() &&
         whole.numel() == int64_t(layout_.host.size()) * part.numel();
}

void Hierarchy::between_hosts(const at::Tensor& part, int64_t offset, int op,
                              const std::optional<QuantWire>& wire) const {
  if (!wire) {
    inter_->all_reduce(part, op, "ring", false);
    return;
  }
  std::optional<at::Tensor> mine;
  if (wire->residual) mine = wire->residual->view(-1).narrow(0, offset, part.numel());
  inter_->all_reduce(part, op, "auto", false, wire->dtype, false, wire->block, mine);
}

void Hierarchy::all_reduce(const at::Tensor& t, int op, const std::string& algo, bool to_register,
                           const std::optional<QuantWire>& wire) const {
  // The steps of all_reduce_steps(t.nbytes()), with the tail of fewer than L
  // elements all-reduced in place beside step 1 and between hosts beside step 2.
  std::optional<ComposedWire> named;
  if (wire) named = ComposedWire{wire->kind, static_cast<int32_t>(wire->block)};
  ComposedWireScope scope(named ? &*named : nullptr);
  const at::Tensor flat = t.view(-1);
  const int64_t L = layout_.n_local(), numel = flat.numel();
  const int64_t m = size_t(t.nbytes()) <= kSmallBytes ? 0 : numel / L;
  const int64_t whole = m * L;
  const at::Tensor mine = flat.narrow(0, local_ * m, m);
  const at::Tensor tail = flat.narrow(0, whole, numel - whole);
  if (m == 0) {
    // Every rank takes the same ops whatever it registers: the intra
    // all-reduce negotiates the registration.
    intra_->all_reduce(flat, op, algo, false, -1, to_register);
    between_hosts(flat, 0, op, wire);
    return;
  }
  intra_->reduce_scatter(mine, flat.narrow(0, 0, whole), op, algo, false);  // 1.
  if (whole < numel) intra_->all_reduce(tail, op, algo, false);
  between_hosts(mine, local_ * m, op, wire);  // 2.
  if (whole < numel) between_hosts(tail, whole, op, wire);
  // 3. In place, as NCCL allows: the input is this rank's block of the output.
  intra_->all_gather(flat.narrow(0, 0, whole), mine, algo, false);
}

void Hierarchy::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op,
                               const std::string& algo) const {
  // Rows of `in` reordered by (local, host): the intra reduce-scatter leaves
  // local rank l the H rows of the ranks with local index l, summed over its
  // host; the inter reduce-scatter gives each its own.
  const int64_t n = static_cast<int64_t>(layout_.host.size());
  const at::Tensor by_column = in.view({n, -1}).index_select(0, by_column_);
  const at::Tensor mid = at::empty({layout_.n_hosts() * out.numel()}, out.options());
  intra_->reduce_scatter(mid, by_column.view(-1), op, algo, false);
  inter_->reduce_scatter(out, mid, op, "ring", false);
}

void Hierarchy::all_gather(const at::Tensor& out, const at::Tensor& in,
                           const std::string& algo) const {
  // Each rank's block crosses hosts once, then the host shares them; the
  // blocks arrive ordered by (local, host) and are put in rank order.
  const int64_t n = static_cast<int64_t>(layout_.host.size()), m = in.numel();
  const at::Tensor mid = at::empty({layout_.n_hosts() * m}, in.options());
  inter_->all_gather(mid, in, "ring", false);
  const at::Tensor by_column = at::empty({n * m}, in.options());
  intra_->all_gather(by_column, mid, algo, false);
  at::Tensor rows = out.view({n, m});
  at::index_select_out(rows, by_column.view({n, m}), 0, lh_rows_);
}

void Hierarchy::broadcast(const at::Tensor& t, int src, const std::string& algo) const {
  // Between the hosts among the ranks with src's local index, then inside
  // every host from that local rank.
  if (local_ == layout_.local[src]) inter_->broadcast(t, layout_.host[src], "ring", false);
  intra_->broadcast(t, layout_.local[src], algo, false);
}

std::pair<Comm*, int> Hierarchy::route(int peer, const char* op) const {
  if (p2p_over_flat_) return {nullptr, peer};
  if (peer == kAnySource) {
    throw NotSupported(cat(op,
                           ": a receive from any source (src=None) is not supported across hosts "
                           "(transport 'shm+gloo': a peer's messages come over shm or gloo by "
                           "where it runs); pass src, or use transport='gloo'"));
  }
  const int n = static_cast<int>(layout_.host.size());
  if (peer >= 0 && peer < n && peer != rank_ && layout_.host[peer] == host_) {
    return {intra_.get(), layout_.local[peer]};
  }
  return {nullptr, peer};
}

void Hierarchy::set_check(bool on) const {
  intra_->set_check(on);
  inter_->set_check(on);
}

void Hierarchy::close() const {
  std::exception_ptr first;
  for (Comm* part : {inter_.get(), intra_.get()}) {
    try {
      part->close();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace pycomm
