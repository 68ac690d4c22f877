#include "remotehead/server/head_service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "remotehead/core/checkpoint.h"
#include "remotehead/core/status_macros.h"
#include "remotehead/server/status_mapping.h"
#include "remotehead/server/tensor_codec.h"
#include "compute_pool.h"
#include "retained_inputs.h"
#include "step_session.h"

namespace remotehead::server {

// Everything a streaming step call shares with the others.
struct StepEnvironment {
  HeadRegistry* registry;
  RetainedInputStore* retained;
  ComputePool* compute;
  AdmissionController* admission;
  const ServiceOptions* options;
};

namespace {

void LogEvent(const ServiceOptions& options, const std::string& line) {
  if (options.event_log == nullptr) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  *options.event_log << "remotehead-server: " << line << std::endl;
}

std::string HeadSummary(const v1::HeadInfo& info) {
  return absl::StrCat("\"", info.head_id(), "\" [", info.vocab_size(), ", ", info.hidden_size(),
                      "] ", v1::DType_Name(info.dtype()), info.has_bias() ? " with bias" : "",
                      " on ", info.device(), ", version ", info.weight_version());
}

absl::Status DescribeInto(HeadEntry& entry, v1::HeadInfo* info) {
  std::lock_guard<std::mutex> lock(entry.mu);
  const core::Head& head = *entry.head;
  info->set_head_id(entry.id);
  info->set_vocab_size(head.vocab_size());
  info->set_hidden_size(head.hidden_size());
  ASSIGN_OR_RETURN(const v1::DType dtype, ToWireDtype(head.dtype()));
  info->set_dtype(dtype);
  info->set_has_bias(head.has_bias());
  info->set_device(head.device().str());
  info->set_weight_version(head.version());
  info->set_accumulated_micro_batches(static_cast<int64_t>(entry.applied.size()));
  return absl::OkStatus();
}

// Runs `fn` (returning absl::Status) and finishes a unary call with its status. No exception
// escapes a handler: anything thrown becomes INTERNAL with its message.
template <typename Fn>
grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, Fn&& fn) {
  absl::Status status;
  try {
    status = fn();
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One ForwardBackward / Forward / Backward call, pipelined: gRPC's callback threads only move
// messages — reading up to `read_ahead_messages` ahead and writing results as they are produced
// (one write in flight; back-pressure through OnWriteDone) — while a ComputePool thread runs the
// engine on one rows message at a time, in order. So rows k+1 arrive and the results of k−1 go
// out while k is computed.
//
// Lifecycle: the header is read and validated first, then the request waits for admission
// (memory budget, request limits; RESOURCE_EXHAUSTED when the queue is full) before any rows
// are read. Any error, cancellation or expired deadline finishes the call at once; the session
// then commits nothing. The reactor is deleted by whichever of OnDone and a running compute
// task comes last.
class StepReactor final : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepReactor(grpc::CallbackServerContext* context, StepSession::Mode mode,
              const StepEnvironment& env)
      : context_(context),
        env_(env),
        mode_(mode),
        session_(env.registry, env.retained, mode, env.options->response_chunk_bytes),
        ticket_(env.admission->NewTicket()),
        deadline_(context->deadline()),
        started_(Clock::now()) {
    session_.set_should_stop([this] {
      return stop_.load(std::memory_order_relaxed) || std::chrono::system_clock::now() > deadline_;
    });
    std::lock_guard<std::mutex> lock(mu_);
    StartReadLocked();
  }

  ~StepReactor() override {
    // Frees this call's admitted bytes, or withdraws it from the queue. Waits for an admission
    // callback running on another thread, which then sees finished_ and does nothing.
    env_.admission->Release(ticket_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (finished_) return;
    if (!ok) {
      if (context_->IsCancelled()) {
        FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
        return;
      }
      client_done_ = true;
    } else {
      inbox_.push_back(std::move(incoming_));
      incoming_.Clear();
      ++messages_read_;
    }
    if (starved_) {
      receive_wait_ += Clock::now() - starved_since_;
      starved_ = false;
    }
    StartReadLocked();
    ScheduleComputeLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    pending_bytes_ -= static_cast<int64_t>(outbox_.front().ByteSizeLong());
    outbox_.pop_front();
    if (summary_produced_ && outbox_.empty()) {
      FinishLocked(grpc::Status::OK);
      return;
    }
    StartWriteLocked();
    ScheduleComputeLocked();
  }

  void OnCancel() override {
    stop_.store(true);
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED,
                              "cancelled by the client, or its deadline expired"));
  }

  void OnDone() override {
    std::unique_lock<std::mutex> lock(mu_);
    done_ = true;
    if (computing_) return;  // the compute task deletes this when it returns
    lock.unlock();
    delete this;
  }

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kHeader, kAdmitting, kRunning };

  // Reads the next message if the pipeline has room: only the header before admission, then up
  // to read_ahead_messages not yet computed.
  void StartReadLocked() {
    if (reading_ || finished_ || client_done_) return;
    if (phase_ != Phase::kRunning && messages_read_ > 0) return;
    if (static_cast<int>(inbox_.size()) >= env_.options->read_ahead_messages) return;
    reading_ = true;
    StartRead(&incoming_);
  }

  void StartWriteLocked() {
    if (writing_ || finished_ || outbox_.empty()) return;
    writing_ = true;
    StartWrite(&outbox_.front());
  }

  bool HasWorkLocked() const {
    switch (phase_) {
      case Phase::kHeader:
        return !inbox_.empty() || client_done_;
      case Phase::kAdmitting:
        return false;
      case Phase::kRunning:
        return !inbox_.empty() || (client_done_ && !summary_produced_);
    }
    return false;
  }

  void ScheduleComputeLocked() {
    if (computing_ || finished_ || !HasWorkLocked()) return;
    if (pending_bytes_ >= env_.options->max_pending_response_bytes) {
      if (!send_blocked_) send_blocked_since_ = Clock::now();
      send_blocked_ = true;
      return;  // OnWriteDone schedules again once the client has taken some results
    }
    if (send_blocked_) {
      send_wait_ += Clock::now() - send_blocked_since_;
      send_blocked_ = false;
    }
    computing_ = true;
    env_.compute->Submit([this] { ComputeNext(); });
  }

  // On a ComputePool thread: one message (or the end of the stream), then reschedules itself,
  // so calls sharing the pool take turns message by message.
  void ComputeNext() {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<v1::StepRequest> request;
    bool end = false;
    bool more_queued = false;
    if (!finished_ && HasWorkLocked()) {
      if (!inbox_.empty()) {
        request = std::move(inbox_.front());
        inbox_.pop_front();
        more_queued = !inbox_.empty();
        StartReadLocked();
      } else if (context_->IsCancelled()) {
        FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
      } else {
        end = true;
      }
    }
    if (!request.has_value() && !end) {
      ReturnFromComputeLocked(std::move(lock));
      return;
    }
    const Phase phase = phase_;
    v1::StepTimings timings;
    if (end) {
      timings = TimingsLocked();
      session_.set_timings(timings);
    }
    lock.unlock();

    std::vector<v1::StepResponse> produced;
    absl::Status status;
    const Clock::time_point t0 = Clock::now();
    try {
      status = end ? session_.OnClientDone(&produced)
                   : session_.OnRequest(std::move(*request), &produced, more_queued);
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
    const Clock::duration spent = Clock::now() - t0;
    // Done computing: give the memory back before the summary reaches the client, so a trainer
    // that sends its next request on seeing it is not refused for its own previous one.
    if (end && status.ok()) {
      env_.admission->Release(ticket_);
      if (env_.options->metrics != nullptr) {
        env_.options->metrics->ObserveStep(RpcName(), session_.head_id(), session_.function(),
                                           session_.valid_tokens(), timings,
                                           session_.logits_chunk_bytes());
      }
    }
    bool admitting = false;
    if (status.ok() && phase == Phase::kHeader && session_.has_header()) {
      {
        std::lock_guard<std::mutex> relock(mu_);
        phase_ = Phase::kAdmitting;
        queued_since_ = Clock::now();
      }
      admitting = true;
      const MemoryEstimate need = session_.EstimateMemory(PipelineBytes());
      // on_admitted may run right here, or later on the thread that frees capacity.
      status = env_.admission->Admit(ticket_, need.bytes, need.breakdown, [this] { OnAdmitted(); });
    }

    lock.lock();
    compute_ += spent;
    if (!status.ok()) {
      FinishLocked(ToGrpcStatus(status));
    } else if (!admitting) {
      for (auto& r : produced) {
        pending_bytes_ += static_cast<int64_t>(r.ByteSizeLong());
        outbox_.push_back(std::move(r));
      }
      if (end) summary_produced_ = true;
      StartWriteLocked();
    }
    ReturnFromComputeLocked(std::move(lock));
  }

  void ReturnFromComputeLocked(std::unique_lock<std::mutex> lock) {
    computing_ = false;
    if (done_) {
      lock.unlock();
      delete this;
      return;
    }
    if (phase_ == Phase::kRunning && !finished_ && inbox_.empty() && !client_done_ &&
        !starved_) {
      starved_ = true;  // waiting for the client's next rows
      starved_since_ = Clock::now();
    }
    ScheduleComputeLocked();
  }

  // Called by the AdmissionController, under its lock.
  void OnAdmitted() {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    phase_ = Phase::kRunning;
    queue_ += Clock::now() - queued_since_;
    StartReadLocked();
    ScheduleComputeLocked();
  }

  // What this call may buffer: the rows read ahead (messages of up to 4 MiB assumed) and the
  // results waiting to be sent.
  int64_t PipelineBytes() const {
    return (env_.options->read_ahead_messages + 1) * (int64_t{4} << 20) +
           env_.options->max_pending_response_bytes;
  }

  v1::StepTimings TimingsLocked() const {
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    v1::StepTimings t;
    t.set_queue_seconds(seconds(queue_));
    t.set_receive_wait_seconds(seconds(receive_wait_));
    t.set_compute_seconds(seconds(compute_));
    t.set_send_wait_seconds(seconds(send_wait_));
    t.set_total_seconds(seconds(Clock::now() - started_));
    return t;
  }

  const char* RpcName() const {
    switch (mode_) {
      case StepSession::Mode::kFused:
        return "ForwardBackward";
      case StepSession::Mode::kForward:
        return "Forward";
      case StepSession::Mode::kBackward:
        return "Backward";
    }
    return "";
  }

  void FinishLocked(grpc::Status status) {
    if (finished_) return;
    finished_ = true;
    stop_.store(true);
    Finish(std::move(status));
  }

  grpc::CallbackServerContext* context_;  // valid until OnDone
  const StepEnvironment env_;
  const StepSession::Mode mode_;
  StepSession session_;  // used by one compute task at a time
  const uint64_t ticket_;
  const std::chrono::system_clock::time_point deadline_;
  const Clock::time_point started_;
  std::atomic<bool> stop_{false};

  std::mutex mu_;  // guards everything below
  Phase phase_ = Phase::kHeader;
  v1::StepRequest incoming_;            // target of the read in flight
  std::deque<v1::StepRequest> inbox_;   // read, not yet computed
  std::deque<v1::StepResponse> outbox_;  // produced, not yet written (front: in flight)
  int64_t pending_bytes_ = 0;            // bytes in outbox_
  int64_t messages_read_ = 0;
  bool reading_ = false;
  bool writing_ = false;
  bool computing_ = false;
  bool client_done_ = false;
  bool summary_produced_ = false;
  bool finished_ = false;
  bool done_ = false;
  // Timings reported in the summary.
  Clock::time_point queued_since_, starved_since_, send_blocked_since_;
  bool starved_ = false;
  bool send_blocked_ = false;
  Clock::duration queue_{}, receive_wait_{}, compute_{}, send_wait_{};
};

// A snapshot of a head's [V, D] matrix and optional [V] vector (weights or gradients), taken
// under the head's lock, copied to the CPU in the requested dtype (default: as stored).
struct Snapshot {
  torch::Tensor matrix;
  torch::Tensor vector;
  v1::HeadInfo info;
};

absl::StatusOr<Snapshot> TakeSnapshot(HeadRegistry* registry, const std::string& head_id,
                                      v1::DType wire_dtype, bool gradients) {
  ASSIGN_OR_RETURN(auto entry, registry->Get(head_id));
  std::optional<torch::ScalarType> dtype;
  if (wire_dtype != v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(dtype, FromWireDtype(wire_dtype, "dtype"));
  }
  Snapshot snapshot;
  {
    std::lock_guard<std::mutex> lock(entry->mu);
    const core::Head& head = *entry->head;
    const torch::Tensor& m = gradients ? head.grads().weight : head.weight();
    const torch::Tensor& v = gradients ? head.grads().bias : head.bias();
    const torch::ScalarType out = dtype.value_or(m.scalar_type());
    snapshot.matrix = m.to(torch::kCPU, out, /*non_blocking=*/false, /*copy=*/true);
    if (v.defined()) snapshot.vector = v.to(torch::kCPU, out, false, true);
  }
  RETURN_IF_ERROR(DescribeInto(*entry, &snapshot.info));
  return snapshot;
}

// Streams a Snapshot as row chunks — the matrix, then the vector — and, when `info_field` is
// given, the HeadInfo last. One message is built per OnWriteDone, so only the snapshot is held.
template <typename Response>
class SnapshotStreamReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using ChunkField = v1::TensorChunk* (Response::*)();
  using InfoField = v1::HeadInfo* (Response::*)();

  SnapshotStreamReactor(absl::StatusOr<Snapshot> snapshot, int64_t chunk_bytes,
                        ChunkField matrix_field, ChunkField vector_field, InfoField info_field)
      : matrix_field_(matrix_field), vector_field_(vector_field), info_field_(info_field) {
    if (!snapshot.ok()) {
      this->Finish(ToGrpcStatus(snapshot.status()));
      return;
    }
    snapshot_ = *std::move(snapshot);
    const torch::Tensor& m = snapshot_.matrix;
    for (const auto& [offset, rows] :
         PlanRowChunks(m.size(0), m.size(1) * m.element_size(), chunk_bytes)) {
      pieces_.push_back({false, offset, rows});
    }
    if (snapshot_.vector.defined()) {
      const torch::Tensor& v = snapshot_.vector;
      for (const auto& [offset, rows] : PlanRowChunks(v.size(0), v.element_size(), chunk_bytes)) {
        pieces_.push_back({true, offset, rows});
      }
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      this->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    bool vector;
    int64_t offset;
    int64_t rows;
  };

  void WriteNext() {
    response_.Clear();
    if (next_ < pieces_.size()) {
      const Piece& p = pieces_[next_++];
      v1::TensorChunk* chunk = (response_.*(p.vector ? vector_field_ : matrix_field_))();
      chunk->set_row_offset(p.offset);
      const torch::Tensor& source = p.vector ? snapshot_.vector : snapshot_.matrix;
      const absl::Status s =
          EncodeTensor(source.narrow(0, p.offset, p.rows), chunk->mutable_values());
      if (!s.ok()) {
        this->Finish(ToGrpcStatus(s));
        return;
      }
      this->StartWrite(&response_);
    } else if (info_field_ != nullptr && !info_sent_) {
      info_sent_ = true;
      *(response_.*info_field_)() = snapshot_.info;
      this->StartWriteAndFinish(&response_, {}, grpc::Status::OK);
    } else {
      this->Finish(grpc::Status::OK);
    }
  }

  ChunkField matrix_field_;
  ChunkField vector_field_;
  InfoField info_field_;
  Snapshot snapshot_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool info_sent_ = false;
  Response response_;
};

// UploadHead: a header, then the weight rows (and bias rows) in order, assembled on the CPU;
// the head is created only when every row arrived. A failed or cancelled upload creates
// nothing.
class UploadReactor final : public grpc::ServerReadReactor<v1::UploadHeadRequest> {
 public:
  UploadReactor(grpc::CallbackServerContext* context, HeadRegistry* registry,
                const ServiceOptions& options, v1::HeadInfo* response)
      : context_(context), registry_(registry), options_(options), response_(response) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
      return;
    }
    absl::Status status;
    try {
      status = ok ? OnMessage() : Complete();
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("unexpected error: ", e.what()));
    }
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
    } else if (ok) {
      StartRead(&request_);
    } else {
      Finish(grpc::Status::OK);
    }
  }

  void OnDone() override { delete this; }

 private:
  absl::Status OnMessage() {
    switch (request_.part_case()) {
      case v1::UploadHeadRequest::kHeader: {
        if (header_) {
          return absl::InvalidArgumentError("header: expected exactly one header; got a second");
        }
        const auto& h = request_.header();
        if (h.vocab_size() < 1 || h.hidden_size() < 1) {
          return absl::InvalidArgumentError(
              absl::StrCat("header.vocab_size, header.hidden_size: expected >= 1; got ",
                           h.vocab_size(), ", ", h.hidden_size()));
        }
        ASSIGN_OR_RETURN(const torch::ScalarType dtype, FromWireDtype(h.dtype(), "header.dtype"));
        header_ = h;
        weight_ = torch::empty({h.vocab_size(), h.hidden_size()}, torch::TensorOptions(dtype));
        if (h.has_bias()) bias_ = torch::empty({h.vocab_size()}, torch::TensorOptions(dtype));
        return absl::OkStatus();
      }
      case v1::UploadHeadRequest::kWeightRows:
        return AddRows(request_.weight_rows(), "weight_rows", weight_, &next_weight_row_);
      case v1::UploadHeadRequest::kBiasRows:
        if (header_ && !header_->has_bias()) {
          return absl::InvalidArgumentError(
              "bias_rows: expected none (header.has_bias is false); got bias rows");
        }
        return AddRows(request_.bias_rows(), "bias_rows", bias_, &next_bias_row_);
      default:
        return absl::InvalidArgumentError("part: expected header, weight_rows or bias_rows");
    }
  }

  absl::Status AddRows(const v1::TensorChunk& chunk, const std::string& field,
                       torch::Tensor& target, int64_t* next_row) {
    if (!header_) {
      return absl::InvalidArgumentError(
          absl::StrCat("header: expected the first message to be the header; got ", field));
    }
    if (chunk.row_offset() != *next_row) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".row_offset: expected ", *next_row,
                                                     " (rows arrive in order); got ",
                                                     chunk.row_offset()));
    }
    // A view of the message's bytes: copied once, into the head's tensor, below.
    ASSIGN_OR_RETURN(torch::Tensor values, DecodeTensorView(chunk.values(), field + ".values"));
    const int64_t rows = values.dim() >= 1 ? values.size(0) : 0;
    std::vector<int64_t> expected = target.sizes().vec();
    expected[0] = rows;
    if (values.scalar_type() != target.scalar_type() || values.sizes().vec() != expected ||
        *next_row + rows > target.size(0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".values: expected ", c10::toString(target.scalar_type()), " ",
                       c10::str(c10::IntArrayRef(expected)), " within ", target.size(0),
                       " rows; got ", c10::toString(values.scalar_type()), " ",
                       c10::str(values.sizes()), " at row ", *next_row));
    }
    target.narrow(0, *next_row, rows).copy_(values);
    *next_row += rows;
    return absl::OkStatus();
  }

  absl::Status Complete() {
    if (!header_) return absl::InvalidArgumentError("header: the upload ended without one");
    if (next_weight_row_ != weight_.size(0) ||
        (bias_.defined() && next_bias_row_ != bias_.size(0))) {
      return absl::InvalidArgumentError(absl::StrCat("weight_rows, bias_rows: expected ",
                                                     weight_.size(0), " rows each; got ",
                                                     next_weight_row_, " and ", next_bias_row_));
    }
    ASSIGN_OR_RETURN(auto head,
                     core::Head::FromTensors(weight_, bias_, {.device = options_.device}));
    ASSIGN_OR_RETURN(auto entry, header_->replace()
                                     ? registry_->AddOrReplace(header_->head_id(), std::move(head))
                                     : registry_->Add(header_->head_id(), std::move(head)));
    RETURN_IF_ERROR(DescribeInto(*entry, response_));
    // Replacements come once per optimizer step from trainers that own the parameter: not
    // lifecycle events worth a line each.
    if (!header_->replace()) {
      LogEvent(options_, absl::StrCat("head uploaded: ", HeadSummary(*response_)));
    }
    return absl::OkStatus();
  }

  grpc::CallbackServerContext* context_;
  HeadRegistry* registry_;
  ServiceOptions options_;
  v1::HeadInfo* response_;
  v1::UploadHeadRequest request_;
  std::optional<v1::UploadHeadRequest::UploadHeader> header_;
  torch::Tensor weight_, bias_;
  int64_t next_weight_row_ = 0;
  int64_t next_bias_row_ = 0;
};

}  // namespace

HeadServiceImpl::HeadServiceImpl(HeadRegistry* registry, ServiceOptions options)
    : registry_(registry),
      options_(options),
      admission_(std::make_unique<AdmissionController>(options.admission)),
      retained_(std::make_unique<RetainedInputStore>(admission_.get(), options.max_retain_seconds)),
      compute_(std::make_unique<ComputePool>(options.compute_threads)) {
  if (options_.metrics != nullptr) options_.metrics->set_admission(admission_.get());
}

StepEnvironment HeadServiceImpl::StepEnv() {
  return {registry_, retained_.get(), compute_.get(), admission_.get(), &options_};
}

// The pool goes first: its threads finish their tasks while the rest is still alive.
HeadServiceImpl::~HeadServiceImpl() {
  compute_.reset();
  if (options_.metrics != nullptr) options_.metrics->set_admission(nullptr);
}

grpc::ServerReadReactor<v1::UploadHeadRequest>* HeadServiceImpl::UploadHead(
    grpc::CallbackServerContext* context, v1::HeadInfo* response) {
  return new UploadReactor(context, registry_, options_, response);
}

grpc::ServerUnaryReactor* HeadServiceImpl::CreateHead(grpc::CallbackServerContext* context,
                                                      const v1::CreateHeadRequest* request,
                                                      v1::HeadInfo* response) {
  return Unary(context, [&]() -> absl::Status {
    std::optional<torch::ScalarType> requested_dtype;
    if (request->dtype() != v1::DTYPE_UNSPECIFIED) {
      ASSIGN_OR_RETURN(requested_dtype, FromWireDtype(request->dtype(), "dtype"));
    }
    if (request->source_case() == v1::CreateHeadRequest::kSafetensors) {
      const auto& src = request->safetensors();
      const std::string weight_name =
          src.weight_name().empty() ? "lm_head.weight" : src.weight_name();
      ASSIGN_OR_RETURN(torch::Tensor weight, core::ReadSafetensor(src.path(), weight_name));
      torch::Tensor bias;
      if (!src.bias_name().empty()) {
        ASSIGN_OR_RETURN(bias, core::ReadSafetensor(src.path(), src.bias_name()));
      }
      if (requested_dtype) {
        weight = weight.to(*requested_dtype);
        if (bias.defined()) bias = bias.to(*requested_dtype);
      }
      ASSIGN_OR_RETURN(auto head,
                       core::Head::FromTensors(weight, bias, {.device = options_.device}));
      ASSIGN_OR_RETURN(auto entry, registry_->Add(request->head_id(), std::move(head)));
      RETURN_IF_ERROR(DescribeInto(*entry, response));
      LogEvent(options_, absl::StrCat("head created from ", src.path(), " (", weight_name,
                                      "): ", HeadSummary(*response)));
      return absl::OkStatus();
    }
    if (request->source_case() != v1::CreateHeadRequest::kInit) {
      return absl::InvalidArgumentError("source: expected safetensors or init; got none");
    }
    const auto& init = request->init();
    const torch::ScalarType dtype = requested_dtype.value_or(torch::kFloat);
    core::HeadInit head_init{.vocab_size = init.vocab_size(),
                             .hidden_size = init.hidden_size(),
                             .dtype = dtype,
                             .bias = init.bias(),
                             .seed = init.seed()};
    if (init.init_std() != 0) head_init.init_std = init.init_std();
    ASSIGN_OR_RETURN(auto head, core::Head::Initialize(head_init, {.device = options_.device}));
    ASSIGN_OR_RETURN(auto entry, registry_->Add(request->head_id(), std::move(head)));
    RETURN_IF_ERROR(DescribeInto(*entry, response));
    LogEvent(options_,
             absl::StrCat("head created from seed ", init.seed(), ": ", HeadSummary(*response)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::SaveWeights(grpc::CallbackServerContext* context,
                                                       const v1::SaveWeightsRequest* request,
                                                       v1::SaveWeightsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    std::map<std::string, torch::Tensor> tensors;
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      tensors[request->weight_name().empty() ? "lm_head.weight" : request->weight_name()] =
          entry->head->weight().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
      if (entry->head->has_bias()) {
        tensors[request->bias_name().empty() ? "lm_head.bias" : request->bias_name()] =
            entry->head->bias().to(torch::kCPU, false, true);
      }
    }
    ASSIGN_OR_RETURN(const int64_t bytes, core::WriteSafetensors(request->path(), tensors));
    response->set_bytes_written(bytes);
    LogEvent(options_, absl::StrCat("head \"", request->head_id(), "\" saved to ",
                                    request->path(), " (", bytes, " bytes)"));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::DescribeHead(grpc::CallbackServerContext* context,
                                                        const v1::HeadRef* request,
                                                        v1::HeadInfo* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    return DescribeInto(*entry, response);
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::ListHeads(grpc::CallbackServerContext* context,
                                                     const v1::ListHeadsRequest*,
                                                     v1::ListHeadsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    for (const auto& entry : registry_->List()) {
      RETURN_IF_ERROR(DescribeInto(*entry, response->add_heads()));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::DropHead(grpc::CallbackServerContext* context,
                                                    const v1::HeadRef* request,
                                                    v1::DropHeadResponse*) {
  return Unary(context, [&]() -> absl::Status {
    RETURN_IF_ERROR(registry_->Drop(request->head_id()));
    LogEvent(options_, absl::StrCat("head dropped: \"", request->head_id(), "\""));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::ZeroGradients(grpc::CallbackServerContext* context,
                                                         const v1::HeadRef* request,
                                                         v1::ZeroGradientsResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      entry->head->ZeroGrad();
      entry->applied.clear();  // a new accumulation window: ids may be reused
    }
    RETURN_IF_ERROR(DescribeInto(*entry, response->mutable_info()));
    LogEvent(options_, absl::StrCat("gradients zeroed: \"", request->head_id(), "\""));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* HeadServiceImpl::OptimizerStep(grpc::CallbackServerContext* context,
                                                         const v1::OptimizerStepRequest* request,
                                                         v1::OptimizerStepResponse* response) {
  return Unary(context, [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto entry, registry_->Get(request->head_id()));
    const double grad_scale = request->has_grad_scale() ? request->grad_scale() : 1.0;
    {
      std::lock_guard<std::mutex> lock(entry->mu);
      core::Head& head = *entry->head;
      switch (request->optimizer_case()) {
        case v1::OptimizerStepRequest::kSgd: {
          const auto& o = request->sgd();
          RETURN_IF_ERROR(core::SgdStep(
              head, {.lr = o.lr(), .momentum = o.momentum(), .weight_decay = o.weight_decay()},
              grad_scale, &entry->optimizer));
          break;
        }
        case v1::OptimizerStepRequest::kAdamw: {
          const auto& o = request->adamw();
          core::AdamWOptions options{.lr = o.lr()};
          // Unset (0) hyper-parameters take torch.optim.AdamW's defaults.
          if (o.beta1() != 0) options.beta1 = o.beta1();
          if (o.beta2() != 0) options.beta2 = o.beta2();
          if (o.eps() != 0) options.eps = o.eps();
          options.weight_decay = o.weight_decay();
          RETURN_IF_ERROR(core::AdamWStep(head, options, grad_scale, &entry->optimizer));
          break;
        }
        default:
          return absl::InvalidArgumentError("optimizer: expected sgd or adamw; got none");
      }
      if (request->zero_gradients()) {
        head.ZeroGrad();
        entry->applied.clear();
      }
    }
    RETURN_IF_ERROR(DescribeInto(*entry, response->mutable_info()));
    LogEvent(options_, absl::StrCat("optimizer step (", request->has_sgd() ? "sgd" : "adamw",
                                    "): ", HeadSummary(response->info())));
    return absl::OkStatus();
  });
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::ForwardBackward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, StepSession::Mode::kFused, StepEnv());
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::Forward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, StepSession::Mode::kForward, StepEnv());
}

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* HeadServiceImpl::Backward(
    grpc::CallbackServerContext* context) {
  return new StepReactor(context, StepSession::Mode::kBackward, StepEnv());
}

grpc::ServerWriteReactor<v1::FetchGradientsResponse>* HeadServiceImpl::FetchGradients(
    grpc::CallbackServerContext*, const v1::FetchGradientsRequest* request) {
  using R = v1::FetchGradientsResponse;
  return new SnapshotStreamReactor<R>(
      TakeSnapshot(registry_, request->head_id(), request->dtype(), /*gradients=*/true),
      options_.response_chunk_bytes, &R::mutable_weight_grad_rows, &R::mutable_bias_grad_rows,
      &R::mutable_info);
}

grpc::ServerWriteReactor<v1::ExportWeightsResponse>* HeadServiceImpl::ExportWeights(
    grpc::CallbackServerContext*, const v1::ExportWeightsRequest* request) {
  using R = v1::ExportWeightsResponse;
  return new SnapshotStreamReactor<R>(
      TakeSnapshot(registry_, request->head_id(), request->dtype(), /*gradients=*/false),
      options_.response_chunk_bytes, &R::mutable_weight_rows, &R::mutable_bias_rows, nullptr);
}

}  // namespace remotehead::server
